"""Rank functions for test_async_checkpoint.py: save_checkpoint(non_blocking=True)."""

import os
import signal
import time

import optim_cases as oc
import torch


def _setup():
    return oc.sharded_setup(dtype=torch.float32, loss_scale=2.0**12, scheduler=True)


def roundtrip(folder: str, steps: int):
    """Trains, saves in the background, keeps training while the write is in flight
    (PAUSE_S holds the write back), waits; then a fresh model loads the checkpoint.
    Returns the states at the save and after loading, and step times with and
    without a save in flight."""
    import nbtrain as nbt
    from nbtrain.checkpoint import asynchronous

    model, opt, manager = _setup()
    oc.sharded_train(model, manager, 2, total=20)
    quiet = _timed_steps(model, manager, steps, start=2)
    at_save = {k: v.clone() for k, v in model.state_dict().items()}
    scale = manager.loss_scale
    asynchronous.PAUSE_S = 1.0
    nbt.save_checkpoint(model, folder, manager, step=2 + steps, non_blocking=True)
    in_flight_at_return = asynchronous.in_flight()
    busy = _timed_steps(model, manager, steps, start=2 + steps)  # the shards change meanwhile
    changed = not all(torch.equal(at_save[k], v) for k, v in model.state_dict().items())
    still_writing = asynchronous.in_flight()
    nbt.checkpoint.wait()
    asynchronous.PAUSE_S = 0.0
    fresh, _, fresh_manager = _setup()
    meta = nbt.load_checkpoint(fresh, folder, fresh_manager)
    loaded = fresh.state_dict()
    return {
        "same": all(torch.equal(at_save[k], loaded[k]) for k in at_save),
        "changed": changed,
        "step": meta["step"],
        "scale": (scale, fresh_manager.loss_scale),
        "in_flight_at_return": in_flight_at_return,
        "still_writing": still_writing,
        "quiet_s": quiet,
        "busy_s": busy,
    }


def _timed_steps(model, manager, steps, start):
    begin = time.perf_counter()
    oc.sharded_train(model, manager, steps, start=start, total=20 + 2 * steps)
    return (time.perf_counter() - begin) / steps


def killed_during_write(folder: str):
    """Saves checkpoint A, trains, then saves B in the background; rank 1 is killed in
    the middle of writing its file (half of it on disk). Rank 0 returns A's state and
    the error its wait() raised (rank 0 only; rank 1 never returns)."""
    import nbtrain as nbt
    from nbtrain.checkpoint import asynchronous

    model, opt, manager = _setup()
    oc.sharded_train(model, manager, 2, total=20)
    nbt.save_checkpoint(model, folder, manager, step=2)
    state_a = {k: v.clone() for k, v in model.state_dict().items()}
    oc.sharded_train(model, manager, 2, start=2, total=20)
    asynchronous.MARKER_TIMEOUT_S = 2.0
    if nbt.rank() == 1:

        def half_then_die(path, tensors):
            with open(f"{path}.tmp-{os.getpid()}", "wb") as f:
                f.write(b"\0" * 4096)  # a partial temporary file, as a crash leaves it
                f.flush()
            os.kill(os.getpid(), signal.SIGKILL)

        asynchronous.write_tensors = half_then_die
    nbt.save_checkpoint(model, folder, manager, step=4, non_blocking=True)
    try:
        nbt.checkpoint.wait()
        error = None
    except Exception as err:
        error = f"{type(err).__name__}: {err}"
    torch.save({"state": state_a, "error": error}, os.path.join(folder, "..", "rank0.pt"))
    return error


def load_state(folder: str):
    import nbtrain as nbt

    model, _, manager = _setup()
    meta = nbt.load_checkpoint(model, folder, manager)
    return meta["step"], model.state_dict()
