"""init_distributed takes its own keywords and BMTrain's, and refuses anything else
by name (a misspelt `pipe_sise=2` once ran without a pipeline and without an error)."""

import pytest

import nbtrain as nbt


def test_a_misspelt_keyword_is_refused_naming_it_and_the_fix():
    with pytest.raises(TypeError) as info:
        nbt.init_distributed(pipe_sise=2)
    message = str(info.value)
    assert "unknown keyword pipe_sise=2" in message
    assert "Did you mean pipe_size=?" in message
    assert "tp_size" in message and "zero_level" in message  # the accepted ones
    assert not nbt.comm.is_initialized()  # refused before anything started


def test_an_unrelated_keyword_is_refused_without_a_guess():
    with pytest.raises(TypeError, match=r"unknown keyword colour='red'\. It takes seed"):
        nbt.init_distributed(colour="red")


def test_bmtrains_keywords_are_accepted():
    ctx = nbt.init_distributed(
        init_method="env://",
        seed=3,
        zero_level=2,
        loss_scale_factor=2,
        loss_scale_steps=1024,
        pipe_size=-1,
        num_micro_batches=1,
    )
    try:
        assert ctx.topology.pipe_size == 1 and ctx.seed == 3 and ctx.world_size == 1
    finally:
        nbt.comm.shutdown()


@pytest.mark.parametrize(
    "keyword, value, fix",
    [
        ("init_method", "tcp://10.0.0.1:23456", "set MASTER_ADDR and MASTER_PORT"),
        ("zero_level", 1, "each Block takes its own zero_level"),
    ],
)
def test_a_bmtrain_keyword_nbtrain_cannot_honour_says_so(keyword, value, fix):
    with pytest.raises(ValueError, match=fix):
        nbt.init_distributed(**{keyword: value})
    assert not nbt.comm.is_initialized()


def test_bmtrains_positional_init_method_is_refused_with_the_keyword_form():
    with pytest.raises(TypeError, match=r"init_distributed\(init_method='env://', seed=\.\.\.\)"):
        nbt.init_distributed("env://", 1)
    assert not nbt.comm.is_initialized()
