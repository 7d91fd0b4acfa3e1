"""Where telemetry goes and what it samples: JSONL files, the notebook, memory.

Kept apart from `telemetry` so the recorder's hot path reads on one screen.
Imports of psutil, torch.cuda and ipyparallel happen on first use.
"""

from __future__ import annotations

import atexit
import json
import os
import socket
import sys
import threading
import time
import weakref

_FLUSH_EVERY_EVENTS = 4096


def current_rank() -> int:
    """This process's rank: nbtrain's context if initialised, else $RANK, else 0."""
    ctx = sys.modules.get("nbtrain.comm.context")
    if ctx is not None and ctx.is_initialized():
        return ctx.get_context().rank
    return int(os.environ.get("RANK", "0"))


def _world_size() -> int:
    ctx = sys.modules.get("nbtrain.comm.context")
    if ctx is not None and ctx.is_initialized():
        return ctx.get_context().world_size
    return int(os.environ.get("WORLD_SIZE", "1"))


def host_name() -> str:
    """This rank's host: `NBTRAIN_HOST` (a test's pretend host) or the host name."""
    return os.environ.get("NBTRAIN_HOST") or socket.gethostname()


def meta() -> dict:
    return {
        "rank": current_rank(),
        "world_size": _world_size(),
        "pid": os.getpid(),
        "host": host_name(),
        "wall_time": time.time(),
    }


# -- memory --------------------------------------------------------------------------
class _Watched:
    """Weak references to the model and optimizer whose state memory samples count:
    those given to `telemetry.watch`, else the last wrapped model and the last
    optimizer added to an OptimManager (`nbtrain.comm.step_inputs.offer`)."""

    def __init__(self):
        self.model = self.optimizer = None
        self.full_param_bytes: int | None = None
        self._full_of: weakref.ref | None = None  # the model full_param_bytes counts

    def set(self, model, optimizer) -> None:
        self.model = weakref.ref(model) if model is not None else None
        self.optimizer = weakref.ref(optimizer) if optimizer is not None else None
        self._count_full(model)

    def _count_full(self, model) -> None:
        # Counted once per model: the panels draw it beside this rank's shard.
        self.full_param_bytes = full_param_bytes(model) if model is not None else None
        self._full_of = weakref.ref(model) if model is not None else None

    def get(self):
        model = self.model() if self.model else None
        optimizer = self.optimizer() if self.optimizer else None
        if model is None and optimizer is None:
            from ..comm import step_inputs

            model, optimizer = step_inputs.offered()
            if model is not None and (self._full_of is None or self._full_of() is not model):
                self._count_full(model)
        return model, optimizer


def full_param_bytes(model) -> int:
    """Bytes of `model`'s parameters unsharded and unpadded: what one process would hold.

    (`nbtrain.inspect.parameter_bytes(model)["full"]`, without importing the layer above.)
    """
    from ..zero import flat_buffers, shards

    total, seen = 0, set()
    for buffer in flat_buffers(model):
        total += buffer.numel * buffer.shard.element_size()
        seen.add(id(buffer.shard))
    numels = {id(s.param): s.numel for s in shards(model) if s.param is not None}
    for p in model.parameters():
        if id(p) not in seen:
            seen.add(id(p))
            total += numels.get(id(p), p.numel()) * p.element_size()
    return total


WATCHED = _Watched()


def _tensor_bytes(t) -> int:
    return t.numel() * t.element_size()


def model_state_bytes(model=None, optimizer=None) -> dict:
    """Bytes this rank holds of parameter shards, their grads and optimizer state.

    Returns {"param_bytes", "grad_bytes", "optimizer_bytes", "model_state_bytes" (their
    sum)}, all None when neither `model` nor `optimizer` is given.
    """
    if model is None and optimizer is None:
        return dict.fromkeys(("param_bytes", "grad_bytes", "optimizer_bytes", "model_state_bytes"))
    import torch

    seen, param, grad, state = set(), 0, 0, 0
    params = list(model.parameters()) if model is not None else []
    if optimizer is not None:
        params += [p for g in optimizer.param_groups for p in g["params"]]
    for p in params:
        if id(p) in seen:
            continue
        seen.add(id(p))
        param += _tensor_bytes(p)
        if p.grad is not None:
            grad += _tensor_bytes(p.grad)
    if optimizer is not None:
        for values in optimizer.state.values():
            state += sum(_tensor_bytes(v) for v in values.values() if isinstance(v, torch.Tensor))
    return {
        "param_bytes": param,
        "grad_bytes": grad,
        "optimizer_bytes": state,
        "model_state_bytes": param + grad + state,
    }


_PAGE_BYTES = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def _rss_bytes() -> int:
    # /proc/self/statm costs ~10x less than building a psutil.Process each step.
    try:
        with open("/proc/self/statm", "rb") as f:
            return int(f.read().split()[1]) * _PAGE_BYTES
    except OSError:
        import psutil

        return psutil.Process().memory_info().rss


def memory_sample(model=None, optimizer=None) -> dict:
    full = None
    if model is None and optimizer is None:
        model, optimizer = WATCHED.get()
        full = WATCHED.full_param_bytes if model is not None else None
    sample = {
        "rss_bytes": _rss_bytes(),
        **model_state_bytes(model, optimizer),
        "full_param_bytes": full,
    }
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available() and torch.cuda.is_initialized():
        sample.update(
            cuda_allocated_bytes=torch.cuda.memory_allocated(),
            cuda_reserved_bytes=torch.cuda.memory_reserved(),
            cuda_peak_bytes=torch.cuda.max_memory_allocated(),
        )
    return sample


# -- JSONL ---------------------------------------------------------------------------
_OPEN_WRITERS: weakref.WeakSet[JsonlWriter] = weakref.WeakSet()


def _close_open_writers() -> None:
    for writer in list(_OPEN_WRITERS):
        writer.close()


atexit.register(_close_open_writers)


class JsonlWriter:
    """A recorder sink: buffers events, appends them as JSON lines at each step end.

    Called under the recorder's lock, so it needs no lock of its own.
    """

    def __init__(self, path: str):
        self.path = path
        self._file = open(path, "a", encoding="utf-8")
        self._buffer: list = []
        # Closed at exit if still open; held weakly, so a notebook session that
        # starts and stops telemetry run after run keeps no closed writer alive.
        _OPEN_WRITERS.add(self)

    @classmethod
    def open(cls, run_dir) -> "JsonlWriter":
        run_dir = run_dir or os.environ.get("NBTRAIN_RUN_DIR")
        if not run_dir:
            raise ValueError("telemetry.start needs a run_dir (or $NBTRAIN_RUN_DIR)")
        os.makedirs(run_dir, exist_ok=True)
        return cls(os.path.join(os.fspath(run_dir), f"rank{current_rank()}.jsonl"))

    def __call__(self, event: dict) -> None:
        self._buffer.append(event)
        if event["type"] == "step_end" or len(self._buffer) >= _FLUSH_EVERY_EVENTS:
            self.flush()

    def flush(self) -> None:
        if self._file.closed or not self._buffer:
            return
        lines, self._buffer = self._buffer, []
        self._file.write("".join(json.dumps(e, default=str) + "\n" for e in lines))
        self._file.flush()

    def close(self) -> None:
        if not self._file.closed:
            self.flush()
            self._file.close()
        _OPEN_WRITERS.discard(self)


# -- notebook ------------------------------------------------------------------------
_PUBLISHER: dict = {}
PUBLISH_FULL_POINTS = 300  # steps of history in a full publication
PUBLISH_TAIL_POINTS = 16  # steps in the others (the dashboard merges them by step)
PUBLISH_FULL_EVERY = 20  # every 20th publication (5 s at 4 a second) is full


def start_publisher(recorder, interval_s: float) -> None:
    """Publish recorder.summary() with ipyparallel's data publication (engines only)."""
    if _PUBLISHER.get("thread") is not None:
        _PUBLISHER["interval_s"] = interval_s
        return
    from ipyparallel.datapub import publish_data
    from IPython import get_ipython

    from ..comm import events

    state = {
        "last": recorder.last_seq,
        "lock": threading.Lock(),
        "count": 0,
        "cell_step": None,
        "progress": None,
    }

    def publish_if_changed(full: bool = False):
        with state["lock"]:
            # nbtrain.progress replaces its dict at each count: a loop's last count
            # (and its end) come after the step's last event.
            if recorder.last_seq == state["last"] and recorder.progress is state["progress"]:
                return
            state["progress"] = recorder.progress
            # The dashboard merges histories by step, so most publications carry only
            # the newest steps (a 2-rank summary of 300 steps is ~160 kB of JSON; at 64
            # ranks and 4 a second that was ~40 MB/s into the notebook).
            full = full or state["count"] % PUBLISH_FULL_EVERY == 0
            state["count"] += 1
            summary = recorder.summary(PUBLISH_FULL_POINTS if full else PUBLISH_TAIL_POINTS)
            state["last"] = summary["seq"]
            summary["cell_first_step"] = state["cell_step"]  # where this cell's steps begin
            publish_data({"nbtrain": summary})

    def loop():
        while True:
            time.sleep(_PUBLISHER["interval_s"])
            try:
                publish_if_changed()
            except Exception:  # the engine is shutting down; the dashboard is optional
                return

    _PUBLISHER["interval_s"] = interval_s
    # The final state of each cell, sent while the cell's parent header still holds.
    get_ipython().events.register("post_execute", lambda: publish_if_changed(full=True))

    def cell_begins():
        state.update(cell_step=events.HUB.step)
        recorder.progress = None  # a cell without a loop shows no bar of the last one

    get_ipython().events.register("pre_execute", cell_begins)
    thread = threading.Thread(target=loop, name="nbtrain-telemetry-publisher", daemon=True)
    _PUBLISHER["thread"] = thread
    thread.start()
