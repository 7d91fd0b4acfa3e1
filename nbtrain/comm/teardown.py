"""Teardown that leaves no backend thread alive into interpreter shutdown.

Why a rank could end in SIGABRT ("terminate called without an active exception"):
a gloo worker thread keeps a collective's work object for a moment after the
waiting thread has been woken, and releasing it drops references to the
collective's tensors. For a tensor that has a Python object, torch >= 2.10 then
takes the GIL (c10::TensorImpl::decref_pyobject). If the interpreter has begun
shutting down by then, taking the GIL ends the thread with pthread_exit, whose
unwinding through a noexcept destructor calls std::terminate. destroy_process_group
would normally prevent it: the last reference to the group runs ProcessGroupGloo's
destructor without the GIL, which waits for queued work and joins the workers.
But `torch.distributed.nn.functional` binds `group=group.WORLD` as a default
argument of ten functions when it is imported; imported after the group exists
(torch._dynamo imports it, and the first torch.optim.Optimizer imports
torch._dynamo) they keep the group alive, destroy_process_group frees nothing and
the workers live on into interpreter shutdown.

So `init_distributed` imports that module before it creates the group and unbinds
an adopted group from those defaults, `destroy_group` checks that the group was
really freed, and an exit hook (in context.py) destroys a group the program left
alive. tests/multirank/test_clean_exit.py forces the race; tests/stress/resume_exit.py
counts aborted ranks over many runs.
"""

from __future__ import annotations

import gc
import sys
import time
import types
import weakref

import torch.distributed as dist


def import_group_functional() -> None:
    """Imports torch.distributed.nn.functional (cheap: a few ms after torch.distributed)."""
    try:
        import torch.distributed.nn.functional  # noqa: F401 (imported for its side effect)
    except Exception:  # an unusual build; nothing binds the group then
        pass


def unpin_group_defaults() -> None:
    """Replaces process groups bound as default arguments in
    torch.distributed.nn.functional by None.

    Those functions read None as "the default group", which is what they get when
    imported before any group exists; imported later they hold the group then
    current, so `destroy_process_group` cannot free it (see above).
    """
    module = sys.modules.get("torch.distributed.nn.functional")
    group_type = getattr(dist, "ProcessGroup", None)
    if module is None or group_type is None:
        return
    for fn in list(vars(module).values()):
        defaults = getattr(fn, "__defaults__", None) if isinstance(fn, types.FunctionType) else None
        if defaults and any(isinstance(d, group_type) for d in defaults):
            fn.__defaults__ = tuple(None if isinstance(d, group_type) else d for d in defaults)


def destroy_group() -> None:
    """destroy_process_group, checking that it freed the group (which joins its threads)."""
    unpin_group_defaults()
    group = dist.group.WORLD
    try:
        alive = weakref.ref(group) if group is not None else None
    except TypeError:  # a group type without weak references: skip the check
        alive = None
    del group
    dist.destroy_process_group()
    if alive is not None and alive() is not None:
        gc.collect()  # a reference cycle may hold it
    if alive is not None and alive() is not None:
        # Someone else still holds the group (a stored handle): its worker threads
        # outlive destroy_process_group. Give up the GIL for a moment so that one
        # still releasing its last collective does it now, not during shutdown.
        time.sleep(0.1)
