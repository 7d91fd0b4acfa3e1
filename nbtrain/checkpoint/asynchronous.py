"""Background checkpoint writes: `save_checkpoint(..., non_blocking=True)`.

The caller's thread takes the snapshot (this rank's shards copied to host memory) and
the collective parts (the version name, every rank's description of its entries);
a thread of this rank then writes its file and leaves a marker beside it,
`rankNNNNN.done` or `rankNNNNN.failed` (holding the error). Rank 0's thread, once
every rank's marker says done, writes meta.json, which names the new version: the
commit. Until then meta.json names the previous checkpoint, so a rank killed during
its write leaves that one loadable. No collective runs in the background (the
markers are files in the checkpoint's folder, which every rank sees, as it must for
the sharded checkpoint anyway).

`wait()` blocks until the background save is finished and committed, and raises its
error (a failed write here, or a rank that failed or never finished within
`MARKER_TIMEOUT_S`); it is collective, so every rank learns the outcome.
`save_checkpoint` and `load_checkpoint` call it first; the end of the process waits
for this rank's own writes.
"""

from __future__ import annotations

import atexit
import os
import threading
import time

from .layout import write_tensors

MARKER_TIMEOUT_S = 600.0  # how long rank 0 waits for the other ranks' files
PAUSE_S = 0.0  # tests: a pause before writing, a window to kill a rank in

_pending: list["_Save"] = []
_lock = threading.Lock()


class _Save(threading.Thread):
    def __init__(self, path, version, file, tensors, rank, world, commit):
        super().__init__(name=f"nbtrain-checkpoint-{version}", daemon=True)
        self.path, self.version, self.file, self.tensors = path, version, file, tensors
        self.rank, self.world, self.commit = rank, world, commit
        self.error: BaseException | None = None
        self.timeout_s = MARKER_TIMEOUT_S

    def _marker(self, rank: int, kind: str) -> str:
        return os.path.join(self.path, self.version, f"rank{rank:05d}.{kind}")

    def run(self) -> None:
        try:
            if PAUSE_S:
                time.sleep(PAUSE_S)
            os.makedirs(os.path.dirname(self.file), exist_ok=True)
            write_tensors(self.file, self.tensors)
            self.tensors = None  # the snapshot's memory is given back
            with open(self._marker(self.rank, "done"), "w"):
                pass
        except BaseException as err:
            self.error = err
            try:
                with open(self._marker(self.rank, "failed"), "w") as f:
                    f.write(f"{type(err).__name__}: {err}")
            except OSError:
                pass
            return
        if self.commit is not None:
            try:
                self._wait_for_everyone()
                self.commit()
            except BaseException as err:
                self.error = err

    def _wait_for_everyone(self) -> None:
        deadline = time.monotonic() + self.timeout_s
        waiting = set(range(self.world))
        while waiting:
            for rank in sorted(waiting):
                failed = self._marker(rank, "failed")
                if os.path.exists(failed):
                    with open(failed) as f:
                        raise RuntimeError(
                            f"save_checkpoint({self.path!r}): rank {rank} failed "
                            f"to write its shards ({f.read()}); meta.json "
                            "still names the previous checkpoint"
                        )
                if os.path.exists(self._marker(rank, "done")):
                    waiting.discard(rank)
            if waiting and time.monotonic() > deadline:
                raise TimeoutError(
                    f"save_checkpoint({self.path!r}): rank(s) {sorted(waiting)} "
                    f"did not finish writing within {self.timeout_s:g} s (did "
                    "they die?); meta.json still names the previous checkpoint"
                )
            if waiting:
                time.sleep(0.02)


def start(path, version, file, tensors, rank, world, commit) -> None:
    """Writes `tensors` to `file` in a background thread (rank 0's also commits)."""
    save = _Save(path, version, file, tensors, rank, world, commit)
    with _lock:
        _pending.append(save)
    save.start()


def in_flight() -> bool:
    """Whether a background save of this rank is still writing or committing."""
    with _lock:
        return any(s.is_alive() for s in _pending)


def _join() -> tuple[bool, BaseException | None]:
    """Waits for this rank's background saves: (whether there were any, the first
    error). Local."""
    with _lock:
        saves, _pending[:] = list(_pending), []
    for save in saves:
        save.join()
    errors = [s.error for s in saves if s.error is not None]
    return bool(saves), errors[0] if errors else None


def wait() -> None:
    """Blocks until the background saves are finished and committed (rank 0 writes
    meta.json once every rank's file is on disk), then raises the first error.

    Collective when a background save is pending: every rank calls it (save_checkpoint
    and load_checkpoint do), so that on return every rank knows the outcome, rank 0's
    commit included. Nothing pending: returns at once, no collective.
    """
    pending, error = _join()
    if not pending:
        return
    from .layout import agreed

    def outcome():
        if error is not None:
            raise error

    try:
        agreed("save_checkpoint (in the background)", outcome)
    except Exception as exc:
        if error is not None and exc is not error:  # the peers are gone: say what we know
            raise error from exc
        raise


def _at_exit() -> None:
    _, error = _join()  # local: the other ranks may be gone already
    if error is not None:  # the process is ending: say so
        print(f"nbtrain: a background checkpoint save failed: {error}", flush=True)


atexit.register(_at_exit)
