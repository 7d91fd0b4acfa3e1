"""Unit tests that need a context get a world of one (no port, an in-memory store)."""

import pytest

import nbtrain as nbt


@pytest.fixture(scope="module")
def world_of_one(request):
    """init_distributed(seed=<the module's SEED, default 0>) for the module, then shutdown."""
    if nbt.comm.is_initialized():
        yield nbt.get_context()
        return
    ctx = nbt.init_distributed(seed=getattr(request.module, "SEED", 0))
    yield ctx
    nbt.comm.shutdown()
