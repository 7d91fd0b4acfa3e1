"""One name per concept (docs/naming.md): each canonical spelling runs without a warning,
each old one still works and gives a FutureWarning naming the new one, and BMTrain's
names give none."""

import contextlib
import warnings

import pytest
import torch
from IPython.core.magic_arguments import parse_argstring

import nbtrain as nbt
from nbtrain.bench import build_parser as bench_parser
from nbtrain.notebook import magics
from nbtrain.planner.cli import build_parser as plan_parser
from nbtrain.runtime import NBConfig, ParallelConfig, RuntimeConfig, create_runtime
from nbtrain.runtime.validate import build_parser as validate_parser
from nbtrain.runtime.validate import synthetic_batches


@contextlib.contextmanager
def no_future_warning():
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        yield
    assert not [w for w in seen if issubclass(w.category, FutureWarning)], [
        str(w.message) for w in seen
    ]


# -- the runtime's ParallelConfig --------------------------------------------------------

OLD_FIELDS = [
    ("tp", "tp_size", 2),
    ("pp", "pipe_size", 2),
    ("ep", "ep_size", 2),
    ("cp", "cp_size", 2),
    ("num_microbatches", "num_micro_batches", 4),
]


@pytest.mark.parametrize("old, new, value", OLD_FIELDS, ids=[o for o, _, _ in OLD_FIELDS])
def test_parallel_config_old_field_works_and_warns(old, new, value):
    with pytest.warns(
        FutureWarning,
        match=rf"ParallelConfig\({old}=\.\.\.\) is deprecated.*"
        rf"use {new}=",
    ):
        config = ParallelConfig(**{old: value})
    assert getattr(config, new) == value
    with pytest.warns(
        FutureWarning,
        match=rf"ParallelConfig\.{old} is deprecated.*"
        rf"ParallelConfig\.{new}",
    ):
        assert getattr(config, old) == value


def test_parallel_config_canonical_fields_do_not_warn():
    with no_future_warning():
        config = ParallelConfig(
            tp_size=2, pipe_size=2, ep_size=1, cp_size=1, zero_level=2, num_micro_batches=4
        )
        assert (config.tp_size, config.pipe_size, config.num_micro_batches) == (2, 2, 4)
        config.check_world(8)


def test_parallel_config_refuses_both_spellings():
    with pytest.raises(TypeError, match=r"both tp= and tp_size="):
        ParallelConfig(tp=2, tp_size=2)


def test_parallel_config_unknown_attribute_is_still_an_attribute_error():
    with pytest.raises(AttributeError, match="'tpsize'"):
        ParallelConfig().tpsize  # noqa: B018 (reading it is what raises)


# -- forward_backward(num_micro_batches=) ------------------------------------------------


@pytest.mark.parametrize("backend", ["reference", "nbtrain"])
def test_forward_backward_micro_batches(world_of_one, backend):
    rt = create_runtime(
        RuntimeConfig(backend, backend_cfg=NBConfig(model_config={"preset": "tiny", "seq_len": 16}))
    )
    handle = rt.build_model()
    vocab = rt.cfg.backend_cfg.make_config().vocab_size
    data = synthetic_batches(1, rows=4, seq_len=16, vocab=vocab, seed=0)[0]
    with no_future_warning():
        new = rt.forward_backward(handle, data, num_micro_batches=2)
    with pytest.warns(FutureWarning, match=r"forward_backward\(num_microbatches=\.\.\.\)"):
        old = rt.forward_backward(handle, data, num_microbatches=2)
    assert old.metrics == new.metrics
    assert new.metrics["num_micro_batches"] == (2 if backend == "nbtrain" else 1)


# -- init_distributed --------------------------------------------------------------------


def test_init_distributed_timeout_is_pg_timeout_s(world_of_one):
    with no_future_warning():
        assert nbt.init_distributed(pg_timeout_s=30) is world_of_one
    with pytest.warns(FutureWarning, match=r"init_distributed\(timeout=\.\.\.\).*pg_timeout_s="):
        assert nbt.init_distributed(timeout=30) is world_of_one


def test_bmtrains_init_keywords_do_not_warn(world_of_one):
    with no_future_warning():
        ctx = nbt.init_distributed(
            init_method="env://", seed=0, pipe_size=-1, num_micro_batches=1, tp_size=1, zero_level=3
        )
    assert ctx.topology.pipe_size == 1 and ctx.num_micro_batches == 1


# -- checkpoints: (model, path), BMTrain's order -------------------------------------------


def _model():
    torch.manual_seed(0)
    return torch.nn.Linear(3, 5).to(nbt.get_context().device)


def test_save_checkpoint_and_load_checkpoint_take_the_model_first(world_of_one, tmp_path):
    model, other = _model(), _model()
    torch.nn.init.zeros_(other.weight)
    with no_future_warning():
        nbt.save_checkpoint(model, str(tmp_path / "new"), step=3)
        meta = nbt.load_checkpoint(other, tmp_path / "new")  # a PathLike path too
    assert meta["step"] == 3 and torch.equal(other.weight, model.weight)


def test_the_old_path_first_order_works_and_warns(world_of_one, tmp_path):
    model, other = _model(), _model()
    torch.nn.init.zeros_(other.weight)
    with pytest.warns(
        FutureWarning,
        match=r"save_checkpoint\(path, model\) is deprecated.*"
        r"save_checkpoint\(model, path\)",
    ):
        nbt.save_checkpoint(str(tmp_path / "old"), model, step=4)
    with pytest.warns(FutureWarning, match=r"load_checkpoint\(path, model\) is deprecated"):
        meta = nbt.load_checkpoint(tmp_path / "old", other)
    assert meta["step"] == 4 and torch.equal(other.weight, model.weight)


@pytest.mark.parametrize("suffix", [".safetensors", ".pt"])
def test_bmtrains_save_and_load_do_not_warn(world_of_one, tmp_path, suffix):
    model, other = _model(), _model()
    torch.nn.init.zeros_(other.weight)
    with no_future_warning():
        nbt.save(model, str(tmp_path / f"model{suffix}"))
        nbt.load(other, str(tmp_path / f"model{suffix}"))
    assert torch.equal(other.weight, model.weight)


# -- the command line ----------------------------------------------------------------------

COMMAND_FLAGS = [
    (validate_parser, "--tp", "--tp-size", "tp_size", 3),
    (validate_parser, "--pp", "--pipe-size", "pipe_size", 3),
    (validate_parser, "--micro-batches", "--num-micro-batches", "num_micro_batches", 3),
    (bench_parser, "--tp", "--tp-size", "tp_size", 3),
    (bench_parser, "--pp", "--pipe-size", "pipe_size", 3),
    (bench_parser, "--micro-batches", "--num-micro-batches", "num_micro_batches", 3),
    (plan_parser, "--preset", "--model-size", "model_size", "tiny"),  # bench's name
    (plan_parser, "--seq", "--seq-len", "seq_len", 3),
]


@pytest.mark.parametrize(
    "parser, old, new, dest, value",
    COMMAND_FLAGS,
    ids=[f"{p.__module__.split('.')[1]}{o}" for p, o, *_ in COMMAND_FLAGS],
)
def test_command_flags(parser, old, new, dest, value):
    defaults = parser().parse_args([])
    with no_future_warning():
        assert getattr(parser().parse_args([new, str(value)]), dest) == value
    with pytest.warns(FutureWarning, match=rf"the flag {old} is deprecated.*use {new}"):
        args = parser().parse_args([old, str(value)])
    assert getattr(args, dest) == value
    assert vars(args) == {**vars(defaults), dest: value}  # the old flag adds no attribute
    assert old not in parser().format_help().replace(new, "")  # hidden from --help


MAGIC_FLAGS = [
    ("--tp", "--tp-size", "tp_size", "2", 2),
    ("--pg-timeout", "--pg-timeout-s", "pg_timeout_s", "30", 30.0),
    ("--ip", "--controller-ip", "controller_ip", "10.1.0.1", "10.1.0.1"),
]


@pytest.mark.parametrize(
    "old, new, dest, text, value", MAGIC_FLAGS, ids=[o for o, *_ in MAGIC_FLAGS]
)
def test_magic_flags(old, new, dest, text, value):
    with no_future_warning():
        assert (
            getattr(parse_argstring(magics.NbtrainMagics.nbtrain, f"start {new} {text}"), dest)
            == value
        )
    with pytest.warns(FutureWarning, match=rf"the flag {old} is deprecated.*use {new}"):
        args = parse_argstring(magics.NbtrainMagics.nbtrain, f"start {old} {text}")
    assert getattr(args, dest) == value


class _Started(Exception):
    pass


@pytest.fixture
def started(monkeypatch):
    """The Cluster each `%nbtrain start` builds, stopped before anything is launched."""
    seen = []

    def start(cluster):
        seen.append(cluster)
        raise _Started

    monkeypatch.setattr(magics.Cluster, "start", start)
    return seen  # each test's NbtrainMagics holds no cluster yet


def test_start_timeout_flag(started):
    shell = magics.NbtrainMagics(shell=None)
    with no_future_warning(), pytest.raises(_Started):
        shell.nbtrain("start -n 1 --start-timeout-s 7 --controller-ip 127.0.0.2 --pg-timeout-s 9")
    with pytest.warns(FutureWarning) as record, pytest.raises(_Started):
        shell.nbtrain("start -n 1 --timeout 8 --ip 127.0.0.3 --pg-timeout 10")
    messages = sorted(str(w.message).split(" is deprecated")[0] for w in record)
    assert messages == ["`%nbtrain start --timeout`", "the flag --ip", "the flag --pg-timeout"]
    assert "use --start-timeout-s" in str(record[-1].message)
    new, old = started
    assert (new.start_timeout_s, new.controller_ip, new.pg_timeout_s) == (7, "127.0.0.2", 9)
    assert (old.start_timeout_s, old.controller_ip, old.pg_timeout_s) == (8, "127.0.0.3", 10)


def test_wait_timeout_is_not_deprecated():
    with no_future_warning():
        assert parse_argstring(magics.NbtrainMagics.nbtrain, "wait --timeout 3").timeout == 3


# -- one home per mechanism ----------------------------------------------------------------


def test_one_init_distributed_starts_the_recorder(world_of_one):
    from nbtrain import comm
    from nbtrain import init as bmtrain_init
    from nbtrain.comm import events

    assert nbt.init_distributed is comm.init_distributed is bmtrain_init.init_distributed
    events.unsubscribe(nbt.telemetry.RECORDER)
    try:
        with no_future_warning():
            assert comm.init_distributed() is nbt.get_context()
        assert nbt.telemetry.RECORDER in events.HUB.subscribers
    finally:
        nbt.telemetry.record()


def test_context_parallels_block_is_ring_block():
    from nbtrain import context_parallel

    assert "Block" not in context_parallel.__all__ and "RingBlock" in context_parallel.__all__
    with pytest.warns(
        FutureWarning,
        match=r"nbtrain\.context_parallel\.Block is deprecated.*"
        r"use nbtrain\.context_parallel\.RingBlock",
    ):
        old = context_parallel.Block
    assert old is context_parallel.RingBlock and old is not nbt.Block
    with pytest.raises(AttributeError, match="'Blok'"):
        context_parallel.Blok  # noqa: B018 (reading it is what raises)


def test_ring_attention_has_one_documented_home():
    from nbtrain import context_parallel, nn

    assert "ring_attention" in context_parallel.__all__
    assert "ring_attention" not in nn.__all__
    with pytest.warns(FutureWarning, match="nbtrain.nn.ring_attention moved.*context_parallel"):
        alias = nn.ring_attention  # a deprecated alias
    assert alias is context_parallel.ring_attention


def test_recorder_snapshot_event_type():
    recorder = nbt.telemetry.Recorder()
    recorder.emit({"type": "metric", "t": 0.0, "loss": 1.0})
    recorder.emit({"type": "instant", "t": 0.0})
    with no_future_warning():
        new = recorder.snapshot(event_type="metric")
        assert recorder.snapshot("metric") == new
    with pytest.warns(FutureWarning, match=r"snapshot\(type=\.\.\.\).*use event_type="):
        assert recorder.snapshot(type="metric") == new
    assert [e["type"] for e in new] == ["metric"]
