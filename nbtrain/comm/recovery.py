"""When one rank fails, every rank stops within seconds and the group is rebuilt.

A rank that raises while its peers wait in a collective would leave them waiting
for the whole process-group timeout (minutes), and a rank blocked in a collective
cannot be interrupted. So, once `arm()` has run (the notebook engines do it):

- the failing rank writes an abort key into the default group's store and aborts
  its own process group (`fail`);
- every rank runs a watcher thread that polls that key a few times a second and,
  when it appears, aborts the local group, so a collective blocked in C++ returns
  with an error (gloo and NCCL alike; gloo peers also see the closed sockets);
- afterwards every rank calls `rebuild()` (collective): a new default group over the
  same store, under a new key prefix. Nothing else changes: nbtrain's collectives
  pass `group=None` (the default group), so models and optimizers keep working.

The same store carries a graceful stop: `request_stop()` names a step a little
ahead at which every rank's `nbtrain.progress` loop ends (`stop_step()`), so all
ranks leave the loop at the same step boundary.

`phase(name)` marks code that must not be cut in half (the optimizer update); a
failure inside it is reported by `interrupted_phase()`.
"""

from __future__ import annotations

import contextlib
import math
import signal
import threading
import time
from collections import deque
from datetime import timedelta

import torch.distributed as dist

from . import collectives, links, teardown

POLL_S = 0.2
STORE_GONE_S = 10.0  # a store that has not answered for this long is gone
MAX_OPEN_PHASES = 32
_PREFIX = "nbtrain/recovery"


# A graceful stop's lead is timed by the median of this many recent steps: the
# fastest since the loop began (or of the recent ones) made a loop whose steps vary
# (a browser drawing on the ranks' cores) stop 9-30 s after the press instead of 1-2.
# The peers learn of a stop within POLL_S (0.2 s), a fifth of the lead.
RECENT_STEPS = 32


class _State:
    def __init__(self):
        self.store = None  # the base store every generation lives in
        self.generation = 0
        self.rank = self.world = 0
        self.backend, self.timeout = None, None
        self.watcher: threading.Thread | None = None
        self.stop_watch = threading.Event()
        self.aborted_by: str | None = None  # "rank R: summary" of the failing rank
        self.stop_at: int | None = None  # the step a graceful stop ends the loop at
        # The step boundary agreed through a collective every rank ran in the same
        # step (OptimManager's overflow all-reduce carries `stop_flag`): sooner than
        # `stop_at`, which must leave the peers time to learn of the stop.
        self.stop_next: int | None = None
        self.loop = 0  # graceful_stop loops entered (same on all ranks)
        self.interrupts = 0
        self.last_check, self.last_step, self.step_s = None, 0, None
        self.fastest_s: float | None = None
        self.recent: deque[float] = deque(maxlen=RECENT_STEPS)  # the last steps' seconds
        # Open phases, innermost last. An optimizer step that raised never closes its
        # phase, so a loop that catches such failures and goes on would add one per
        # failure until the next `rebuild`: the newest few are all a report needs.
        self.phases: deque[str] = deque(maxlen=MAX_OPEN_PHASES)
        self.interrupted: str | None = None
        # Held while a group is aborted and while `rebuild` moves to the next
        # generation: a watcher that was late to stop (a loaded machine) then finds
        # the generation changed and leaves the new group alone.
        self.lock = threading.RLock()


_S = _State()


def armed() -> bool:
    return _S.store is not None


def rank() -> int:
    """This rank, as recorded by `arm`."""
    return _S.rank


def arm(timeout_s: float | timedelta = 600.0) -> bool:
    """Start watching for a failing peer (after init_distributed). Returns False for a
    world of one or a group without a store (nothing to watch)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return False
    try:
        store = dist.distributed_c10d._get_default_store()
    except (AttributeError, RuntimeError, ValueError):
        return False
    # The group's store is a PrefixStore over the rendezvous store; keep the latter, so
    # that the keys are the same for every group generation and for the notebook.
    while isinstance(store, dist.PrefixStore):
        store = store.underlying_store
    disarm()
    _S.store = store
    _S.rank, _S.world = dist.get_rank(), dist.get_world_size()
    _S.backend = dist.get_backend()
    _S.timeout = (
        timeout_s if isinstance(timeout_s, timedelta) else timedelta(seconds=float(timeout_s))
    )
    _watch_optimizer_steps()
    _start_watcher()
    return True


_HOOKED = False


def _watch_optimizer_steps() -> None:
    """Every torch optimizer's step() becomes a phase: a failure inside it is reported."""
    global _HOOKED
    if _HOOKED:
        return
    from torch.optim.optimizer import (
        register_optimizer_step_post_hook,
        register_optimizer_step_pre_hook,
    )

    def before(optimizer, args, kwargs):
        _S.phases.append(f"{type(optimizer).__name__}.step() (the optimizer update)")

    def after(optimizer, args, kwargs):
        if _S.phases:
            _S.phases.pop()

    register_optimizer_step_pre_hook(before)
    register_optimizer_step_post_hook(after)
    _HOOKED = True


def disarm() -> None:
    """Stop the watcher and forget the store (before the group is destroyed for good)."""
    _stop_watcher()
    _S.store = None


def _key(what: str) -> str:
    return f"{_PREFIX}/{_S.generation}/{what}"


def _start_watcher() -> None:
    _S.stop_watch = threading.Event()
    _S.aborted_by = None
    _S.watcher = threading.Thread(
        target=_watch,
        args=(_S.store, _S.generation, _S.stop_watch),
        name="nbtrain-recovery",
        daemon=True,
    )
    _S.watcher.start()


def _stop_watcher() -> None:
    if _S.watcher is not None:
        _S.stop_watch.set()
        _S.watcher.join(timeout=5 * POLL_S)
        _S.watcher = None


def _watch(store, generation: int, stop: threading.Event) -> None:
    abort_key = f"{_PREFIX}/{generation}/abort"
    failing_since = None  # when the store stopped answering
    while not stop.wait(POLL_S):
        try:
            stop_key = f"{_PREFIX}/{generation}/stop/{_S.loop}"
            if _S.stop_at is None and store.check([stop_key]):
                _S.stop_at = int(store.get(stop_key).decode())
            if store.check([abort_key]):
                aborted_by = store.get(abort_key).decode()
                with _S.lock:
                    # Stopped meanwhile (this rank's own `fail`), or already rebuilt:
                    # aborting now would cut the next generation's group, perhaps
                    # while its peers are still connecting to it.
                    if stop.is_set() or generation != _S.generation:
                        return
                    _S.aborted_by = aborted_by
                    _abort_local_group()
                return
            failing_since = None
        except Exception:
            # A store slow to answer on a loaded host is asked again: a watcher that
            # gave up would leave this rank in a collective its failed peer never
            # joins. A store gone for STORE_GONE_S (its host ended): nothing to watch.
            now = time.monotonic()
            failing_since = failing_since if failing_since is not None else now
            if now - failing_since >= STORE_GONE_S:
                return


def _abort_local_group() -> None:
    """Make every pending and future collective of this rank's groups fail now."""
    with _S.lock:
        _abort_groups()


def _abort_groups() -> None:
    if not dist.is_initialized():
        return
    abort = getattr(dist.distributed_c10d, "_abort_process_group", None)
    try:
        if abort is not None:
            abort()
        else:  # older torch: closing the group closes its connections
            dist.destroy_process_group()
    except Exception:
        pass
    if _S.backend == "gloo":
        # An aborted gloo group keeps its connections while anything refers to it (a
        # traceback's frames, a Work): a collective blocked on it, here or on a peer,
        # would wait out the group timeout. Closing them fails it at both ends now.
        links.close_all(getattr(_S.store, "port", None))


def fail(summary: str) -> str | None:
    """This rank failed: tell the others (once per generation) and abort locally.

    Returns the "rank R: summary" of the rank that failed first, which is this rank
    unless a peer's failure got here first (then this rank's error is a consequence).
    """
    if not armed():
        return None
    if _S.aborted_by is None:
        mine = f"rank {_S.rank}: {summary}"
        try:
            # compare_set keeps the first writer's value: that rank is the origin.
            first = _S.store.compare_set(_key("abort"), "", mine)
            _S.aborted_by = first.decode() if first else mine
        except Exception:
            _S.aborted_by = mine
    _stop_watcher()
    _abort_local_group()
    return _S.aborted_by


def failed_first() -> str | None:
    """'rank R: summary' of the rank whose failure aborted this generation, if any."""
    return _S.aborted_by


def rebuild() -> None:
    """Collective: a fresh default group over the same store; the watcher restarts.

    Every rank of the world calls it after a failure (the notebook does this for you).
    """
    if _S.store is None:
        raise RuntimeError("nbtrain recovery is not armed: nothing to rebuild")
    _stop_watcher()
    with _S.lock:  # a watcher still running from the old generation aborts nothing after
        if dist.is_initialized():
            _abort_local_group()
            if dist.is_initialized():
                teardown.destroy_group()
        _S.generation += 1
    collectives.new_generation()  # what was in flight belongs to the aborted group
    collectives.WATCH.reset()  # the new group's collectives count from 1
    if (
        threading.current_thread() is threading.main_thread()
        and signal.getsignal(signal.SIGINT) is _on_interrupt
    ):
        signal.signal(signal.SIGINT, signal.default_int_handler)  # a loop the failure left
    _S.phases.clear()
    _S.interrupted = None
    teardown.import_group_functional()
    store = dist.PrefixStore(f"{_PREFIX}/group{_S.generation}", _S.store)
    with links.recording():
        dist.init_process_group(
            _S.backend, store=store, rank=_S.rank, world_size=_S.world, timeout=_S.timeout
        )
        # init_process_group is no barrier: a rank whose side of gloo's mesh is done
        # returns while a peer is still reading its handshake, and if it then closes
        # the group (a test that ends, `%nbtrain stop`), the peer's init fails with
        # "Connection closed by peer" (2 in 100 rebuilds on a loaded 2-core machine).
        # The barrier completes only once every rank's mesh is up.
        dist.barrier()
    teardown.unpin_group_defaults()
    from .context import rebuild_topology

    rebuild_topology()  # the tensor/data/pipeline groups of the new default group
    _start_watcher()


def request_stop(current_step: int, lead: int) -> int:
    """Ask every rank to end the current `graceful_stop` loop at step `current_step + lead`.

    The first request wins (the others read its step). Returns the step at which the
    loops end. Without a watched store (one rank, or a script) only this rank stops.
    """
    wanted = current_step + max(int(lead), 1)
    if not armed():
        _S.stop_at = wanted if _S.stop_at is None else _S.stop_at
        return _S.stop_at
    try:
        value = _S.store.compare_set(_key(f"stop/{_S.loop}"), "", str(wanted))
        _S.stop_at = int(value.decode()) if value else wanted
    except Exception:
        _S.stop_at = wanted
    return _S.stop_at


def stop_requested(step: int) -> bool:
    """True once the loop should end before running `step` (a graceful stop was asked).

    Check it at the top of every step of a loop inside `graceful_stop()` (nbtrain's
    progress bar does): every rank then leaves at the same step boundary.
    """
    now = time.monotonic()
    if _S.last_check is not None and step > _S.last_step:
        _S.step_s = (now - _S.last_check) / (step - _S.last_step)
        _S.recent.append(_S.step_s)
        _S.fastest_s = sorted(_S.recent)[len(_S.recent) // 2]  # the recent pace
    _S.last_check, _S.last_step = now, step
    if _S.stop_next is not None and step >= _S.stop_next:
        return True
    return _S.stop_at is not None and step >= _S.stop_at


def stop_flag() -> float:
    """1.0 where this rank knows of a graceful stop of the running loop, else 0.0.

    A collective that every rank runs once a step may carry it (OptimManager's
    overflow check does); its sum, handed to `stop_agreed`, tells every rank in the
    same step, so all of them leave at the next step boundary instead of the one
    `request_stop` chose a second ahead.
    """
    return 1.0 if _S.stop_at is not None else 0.0


def stop_agreed(flags: float) -> None:
    """The summed `stop_flag`s of a collective every rank ran in this step."""
    if flags > 0 and _S.stop_next is None:
        _S.stop_next = _S.last_step + 1


def _lead() -> int:
    """Steps ahead for a stop: the others learn of it within POLL_S; allow 1 s at the
    median pace of the last RECENT_STEPS steps. (The last step's time, or a cap in steps,
    shortened that second when the first steps were slow or the steps very fast, and
    a peer whose watcher was a little late ran past the stop.)"""
    if not _S.fastest_s:
        return 10
    return min(2 + math.ceil(1.0 / _S.fastest_s), 10**8)


@contextlib.contextmanager
def graceful_stop():
    """Inside, the first Ctrl-C (or the notebook's stop button) asks every rank to stop
    at a step boundary a little ahead; a second one interrupts at once.

    Outside the main thread, or where SIGINT cannot be handled, it changes nothing.
    """
    _S.loop += 1
    _S.stop_at, _S.stop_next, _S.interrupts = None, None, 0
    _S.last_check, _S.last_step, _S.step_s, _S.fastest_s = None, 0, None, None
    _S.recent.clear()
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    try:
        previous = signal.signal(signal.SIGINT, _on_interrupt)
    except (ValueError, OSError):
        yield
        return
    try:
        yield
    finally:
        with contextlib.suppress(ValueError, OSError):
            signal.signal(signal.SIGINT, previous)


def _on_interrupt(signum, frame):
    _S.interrupts += 1
    # A loop left by an exception keeps its generator (and this handler) alive until
    # collected: when no step has started for a while, interrupt as usual.
    idle_s = time.monotonic() - (_S.last_check or 0.0)
    if _S.interrupts > 1 or idle_s > 5.0 + 3 * (_S.step_s or 0.0):
        raise KeyboardInterrupt
    if not armed() and dist.is_initialized() and dist.get_world_size() > 1:
        # No shared store to agree on a step (a script under torchrun): stopping
        # alone would leave the others waiting, so interrupt as usual.
        raise KeyboardInterrupt
    at = request_stop(_S.last_step, _lead())
    print(
        f"nbtrain: stopping at the next step boundary every rank agrees on (by step {at}; "
        "interrupt again to stop at once)",
        flush=True,  # information: stdout (JupyterLab shows stderr as an error)
    )


@contextlib.contextmanager
def phase(name: str):
    """Marks code that should not be cut half way (e.g. "the optimizer update")."""
    _S.phases.append(name)
    try:
        yield
    except BaseException:
        if _S.interrupted is None:
            _S.interrupted = name
        raise
    finally:
        _S.phases.pop()


def interrupted_phase() -> str | None:
    """The `phase` a failure cut through since the last `rebuild`/`clear_interrupted`
    (or the one still open: an optimizer step left by an exception never closes)."""
    return _S.interrupted or (_S.phases[-1] if _S.phases else None)


def clear_interrupted() -> None:
    _S.interrupted = None
    _S.phases.clear()
