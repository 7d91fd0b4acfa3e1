"""BMTrain 1.x's public names at the paths a BMTrain script writes, with BMTrain's
behaviour: `import nbtrain as bmt` and nothing else changed.

The list below is BMTrain's public API by import path (bmtrain/__init__.py and the
`__init__` of each of its packages, plus the modules a script imports by path).
"""

import importlib
import inspect as pyinspect
import io
import subprocess
import sys
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import nbtrain as bmt

BMTRAIN_NAMES = {
    "": [
        "print_block",
        "print_dict",
        "print_rank",
        "see_memory",
        "load_nccl_pypi",
        "config",
        "world_size",
        "rank",
        "init_distributed",
        "DistributedParameter",
        "ParameterInitializer",
        "DistributedModule",
        "init_parameters",
        "grouped_parameters",
        "synchronize",
        "sum_loss",
        "wait_loader",
        "gather_result",
        "Block",
        "TransformerBlockList",
        "BMTrainModelWrapper",
        "PipelineTransformerBlockList",
        "debug",
        "save",
        "load",
        "loss",
        "distributed",
        "nn",
        "optim",
        "inspect",
        "lr_scheduler",
        "CheckpointBlock",
    ],
    "nn": [
        "Linear",
        "OpLinear",
        "ColumnParallelLinear",
        "RowParallelLinear",
        "VPEmbedding",
        "OpParallelLinear",
    ],
    "optim": ["AdamOptimizer", "AdamOffloadOptimizer", "OptimManager"],
    "optim.optim_manager": ["OptimManager"],
    "optim.adam": ["AdamOptimizer"],
    "optim.adam_offload": ["AdamOffloadOptimizer"],
    "lr_scheduler": ["WarmupLRScheduler", "NoDecay", "Noam", "Linear", "Cosine", "Exponential"],
    "loss": ["FusedCrossEntropy"],
    "inspect": ["format_summary", "inspect_model", "inspect_tensor", "record_tensor"],
    "distributed": [
        "all_gather",
        "all_reduce",
        "broadcast",
        "reduce_scatter",
        "send_activations",
        "recv_activations",
    ],
    "distributed.ops": [
        "all_gather",
        "all_reduce",
        "broadcast",
        "reduce_scatter",
        "send_activations",
        "recv_activations",
    ],
    "utils": [
        "AverageRecorder",
        "check_torch_version",
        "load_nccl_pypi",
        "print_block",
        "print_dict",
        "print_rank",
        "round_up",
        "see_memory",
        "tp_split_tensor",
    ],
    "debug": ["set", "get", "append", "extend", "clear"],
    "global_var": ["config", "rank", "world_size"],
}


def test_every_bmtrain_name_is_there():
    missing = []
    for sub, names in BMTRAIN_NAMES.items():
        path = f"nbtrain.{sub}" if sub else "nbtrain"
        try:
            module = importlib.import_module(path)
        except ImportError as err:
            missing.append(f"import {path} ({err})")
            continue
        prefix = f"bmt.{sub}." if sub else "bmt."
        missing += [prefix + n for n in names if not hasattr(module, n)]
    assert not missing, "missing BMTrain names: " + ", ".join(missing)


def test_the_paths_give_the_same_objects():
    import nbtrain.global_var
    import nbtrain.loss
    import nbtrain.lr_scheduler
    import nbtrain.optim.optim_manager

    assert bmt.CheckpointBlock is bmt.Block
    assert bmt.loss is nbtrain.loss and bmt.lr_scheduler is nbtrain.lr_scheduler
    assert nbtrain.loss.FusedCrossEntropy is bmt.nn.FusedCrossEntropy
    assert nbtrain.lr_scheduler.Cosine is bmt.optim.lr_scheduler.Cosine
    assert nbtrain.optim.optim_manager.OptimManager is bmt.optim.OptimManager
    assert nbtrain.global_var.config is bmt.config
    assert bmt.utils.print_rank is bmt.print_rank
    assert bmt.distributed.all_gather is bmt.distributed.ops.all_gather


def test_import_nbtrain_stays_light():
    code = (
        "import sys, nbtrain; heavy = ('ipyparallel', 'triton', 'ipywidgets', "
        "'nbtrain.distributed', 'nbtrain.zero.bmtrain_wrapper'); "
        "print([m for m in heavy if m in sys.modules])"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=240
    )
    assert out.stdout.strip() == "[]"


# -- printing -----------------------------------------------------------------------------


def test_print_block_centres_the_title_in_60_columns():
    out = io.StringIO()
    bmt.print_block("abc", "body", file=out)
    bmt.print_block("four", file=out)
    assert out.getvalue() == (
        "=" * 27 + " abc " + "=" * 28 + "\nbody\n" + "=" * 27 + " four " + "=" * 27 + "\n"
    )


def test_print_dict_aligns_values_and_wraps_them():
    out = io.StringIO()
    bmt.print_dict("cfg", {"lr": 0.1, "name": "y" * 60, "empty": ""}, file=out)
    # Keys padded to round_up(5 + 3, 4) = 8 columns, values wrapped at 60 - 8 = 52.
    assert out.getvalue() == (
        "=" * 27
        + " cfg "
        + "=" * 28
        + "\n"
        + "lr :    0.1\n"
        + "name :  "
        + "y" * 52
        + "\n"
        + " " * 8
        + "y" * 8
        + "\n"
        + "empty : "
        + " "
        + "\n"
        + "\n"
    )
    assert bmt.utils.round_up(5, 4) == 8 and bmt.utils.round_up(8, 4) == 8


def test_average_recorder_is_bias_corrected():
    avg = bmt.utils.AverageRecorder(alpha=0.9)
    assert avg.value == 0
    avg.record(1.0)
    assert avg.value == pytest.approx(1.0)
    avg.record(3.0)
    assert avg.value == pytest.approx((0.9 * 1.0 + 3.0) / 1.9)  # weights 0.9 and 1
    started = bmt.utils.AverageRecorder(alpha=0.5, start_value=5.0)
    assert started.value == 5.0
    started.record(1.0)  # (0.5 * 5 + 0.5 * 1) / (1 - 0.5): BMTrain's formula
    assert started.value == pytest.approx(6.0)


def test_check_torch_version():
    assert bmt.utils.check_torch_version("1.0.0") > 0
    assert bmt.utils.check_torch_version("99.0.0") < 0


def test_debug_set_get_append_extend_clear():
    from nbtrain import debug

    try:
        t = torch.ones(2, requires_grad=True) * 2
        debug.set("t", t)
        kept = debug.get("t")
        assert not kept.requires_grad and kept.device.type == "cpu"
        assert torch.equal(kept, torch.full((2,), 2.0))
        assert debug.get("nothing") is None and debug.get("nothing", 7) == 7
        debug.append("xs", 1)
        debug.append("xs", 2)
        debug.extend("xs", [3, 4])
        debug.extend("ys", (5,))
        assert debug.get("xs") == [1, 2, 3, 4] and debug.get("ys") == [5]
        debug.clear("xs")
        debug.clear("not there")
        assert debug.get("xs") is None and debug.get("ys") == [5]
        debug.clear()
        assert debug.get("t") is None and debug.get("ys") is None
    finally:
        debug.clear()


# -- learning-rate schedules and the manager ---------------------------------------------

SCHEDULES = ["Cosine", "Exponential", "Linear", "NoDecay", "Noam"]


@pytest.mark.parametrize("name", SCHEDULES)
def test_scheduler_signature_current_lr_and_state_dict_round_trip(name):
    cls = getattr(bmt.lr_scheduler, name)
    params = list(pyinspect.signature(cls).parameters)
    assert params[:5] == ["optimizer", "start_lr", "warmup_iter", "end_iter", "num_iter"]
    opt = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=5.0)
    sched = cls(opt, 1.0, 4, 20, 0)
    assert sched.current_lr == 0.0 == opt.param_groups[0]["lr"]
    for _ in range(7):
        sched.step()
    assert sched.current_lr == opt.param_groups[0]["lr"]
    assert sched.get_lr_warmup(2) == pytest.approx(0.5 / (2.0 if name == "Noam" else 1.0))
    assert sched.get_lr_decay(7) == pytest.approx(sched.current_lr)
    state = sched.state_dict()
    assert {"start_lr", "warmup_iter", "end_iter", "num_iter"} <= set(state)

    other_opt = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=5.0)
    other = cls(other_opt, 3.0, 1, 5, 0)
    other.load_state_dict(state)
    assert other.current_lr == sched.current_lr == other_opt.param_groups[0]["lr"]
    sched.step()
    other.step()
    assert other.current_lr == sched.current_lr and other.num_iter == 8


def test_a_bmtrain_style_subclass_schedules():
    class Halving(bmt.lr_scheduler.WarmupLRScheduler):  # BMTrain's two hooks only
        def get_lr_warmup(self, num_iter):
            return 0.01

        def get_lr_decay(self, num_iter):
            return self.start_lr / 2 ** (num_iter - self.warmup_iter)

    opt = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=5.0)
    sched = Halving(opt, start_lr=1.0, warmup_iter=2, end_iter=10)
    lrs = [sched.current_lr]
    for _ in range(4):
        sched.step()
        lrs.append(opt.param_groups[0]["lr"])
    assert lrs == [0.01, 0.01, 1.0, 0.5, 0.25]  # num_iter == warmup_iter decays


def test_optim_manager_loss_scale():
    assert bmt.optim.OptimManager(loss_scale=1024).loss_scale == 1024
    assert bmt.optim.OptimManager().loss_scale == 1


def test_op_linear_is_f_linear():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 3, 4, dtype=torch.float64, generator=g, requires_grad=True)
    w = torch.randn(5, 4, dtype=torch.float64, generator=g, requires_grad=True)
    b = torch.randn(5, dtype=torch.float64, generator=g, requires_grad=True)
    assert issubclass(bmt.nn.OpLinear, torch.autograd.Function)
    assert torch.equal(bmt.nn.OpLinear.apply(x, w, b), F.linear(x, w, b))
    assert torch.autograd.gradcheck(bmt.nn.OpLinear.apply, (x, w, b))
    assert torch.autograd.gradcheck(bmt.nn.OpLinear.apply, (x, w))


# -- in a world of one --------------------------------------------------------------------


def test_see_memory_and_wait_loader(world_of_one, capsys):
    bmt.see_memory("after forward")
    bmt.see_memory("detailed", detail=True)
    bmt.wait_loader()
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "after forward"
    kind = "memory_allocated" if world_of_one.device.type == "cuda" else "resident_memory"
    assert any(line.startswith(kind) and line.endswith(" GB") for line in out)
    assert "detailed" in out


def test_gather_result_warns_and_concatenates(world_of_one):
    t = torch.arange(6.0).view(2, 3)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = bmt.gather_result(t)
    assert [w.category for w in caught] == [DeprecationWarning]
    assert "distributed.all_gather" in str(caught[0].message)
    assert torch.equal(got, t) and got.device == t.device
    with pytest.warns(DeprecationWarning):
        assert bmt.gather_result(torch.tensor(2.0)).tolist() == [2.0]


def test_distributed_ops_at_world_one(world_of_one):
    D = bmt.distributed
    x = torch.tensor([[1.0, -2.0], [3.0, 4.0]], requires_grad=True)
    y = D.all_gather(x)
    assert y.shape == (1, 2, 2) and torch.equal(y[0], x.detach())
    for op in ("sum", "avg", "max", "min", "prod"):
        assert torch.equal(D.all_reduce(x, op), x.detach()), op
    assert torch.equal(D.reduce_scatter(x, "sum"), x.detach())
    assert torch.equal(D.broadcast(x, 0), x.detach())
    (
        D.all_gather(x).sum()
        + D.all_reduce(x, "avg").sum()
        + D.reduce_scatter(x).sum()
        + D.broadcast(x, 0).sum()
    ).backward()
    assert torch.equal(x.grad, torch.full((2, 2), 4.0))
    with pytest.raises(ValueError, match="op='mean'"):
        D.all_reduce(x, "mean")
    with pytest.raises(ValueError, match="outside the group"):
        D.broadcast(x, 1)


def test_op_parallel_linear_at_tp_one_is_f_linear(world_of_one):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(4, 3, dtype=torch.float64, generator=g, requires_grad=True)
    w = torch.randn(5, 3, dtype=torch.float64, generator=g, requires_grad=True)
    b = torch.randn(5, dtype=torch.float64, generator=g, requires_grad=True)
    for flags in [
        (False, False, False, None),
        (True, True, False, None),
        (False, False, True, bmt.nn.ReduceType.ALL_REDUCE),
        (True, False, False, 2),
    ]:
        assert torch.equal(bmt.nn.OpParallelLinear.apply(x, w, b, *flags), F.linear(x, w, b))
        assert torch.autograd.gradcheck(
            lambda x, w, b, flags=flags: bmt.nn.OpParallelLinear.apply(x, w, b, *flags), (x, w, b)
        ), flags


def test_inspect_has_bmtrain_arguments_and_columns(world_of_one):
    model = nn.Sequential(nn.Linear(3, 2))
    names = [s["name"] for s in bmt.inspect.inspect_model(model, "net.*", prefix="net.")]
    assert names == ["net.0.weight", "net.0.bias"]
    x = torch.ones(2, 3, requires_grad=True)
    with bmt.inspect.inspect_tensor() as inspector:
        h = model(x)
        bmt.inspect.record_tensor(h, "h", group="g")
        bmt.inspect.record_tensor(h * 2, "h", group="g")
        h.sum().backward()
    summary = inspector.get_summary()
    assert [s["name"] for s in summary] == ["g.h", "g.h"]
    assert torch.equal(inspector.get_tensor("h", group="g", index=1), (h * 2).detach())
    assert inspector.get_tensor("h") is None
    header = bmt.inspect.format_summary(summary).splitlines()[0].split()
    assert header == [
        "name",
        "shape",
        "max",
        "min",
        "std",
        "mean",
        "grad_std",
        "grad_mean",
    ]
    with pytest.raises(TypeError, match="Parameter"):
        bmt.inspect.record_tensor(model[0].weight, "w")


class ListNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(3, 4)
        self.layers = nn.ModuleList([nn.Linear(4, 4) for _ in range(2)])
        self.mixed = nn.ModuleList([nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4)])
        self.head = nn.Linear(4, 2)

    def forward(self, x):
        h = self.inp(x)
        for layer in [*self.layers, *self.mixed]:
            h = layer(h)
        return self.head(h)


def test_bmtrain_model_wrapper_and_grouped_parameters(world_of_one):
    torch.manual_seed(0)
    plain = ListNet()
    torch.manual_seed(0)
    model = bmt.BMTrainModelWrapper(ListNet())
    assert isinstance(model.layers, nn.ModuleList)
    assert all(isinstance(m, bmt.Block) for m in model.layers)
    assert [type(m).__name__ for m in model.mixed] == ["Block", "Tanh", "Block"]
    assert model.mixed[0]._next_block is model.mixed[2]  # neighbours linked
    assert isinstance(model.head.weight, bmt.DistributedParameter)
    x = torch.randn(5, 3)
    torch.testing.assert_close(model(x), plain(x))
    state, want = model.state_dict(), plain.state_dict()
    assert list(state) == list(want)
    for key in want:
        torch.testing.assert_close(state[key], want[key])

    groups = list(bmt.grouped_parameters(model))
    assert [g for g, _ in groups] == [None]
    assert {id(p) for p in groups[0][1]} == {id(p) for p in model.parameters()}
    assert len(groups[0][1]) == len(list(model.parameters()))

    blocks = bmt.BMTrainModelWrapper(nn.ModuleList([nn.Linear(2, 2), nn.Linear(2, 2)]))
    assert all(isinstance(m, bmt.Block) for m in blocks)


def test_bmtrain_model_wrapper_refuses_tied_layers(world_of_one):
    shared = nn.Linear(2, 2)
    model = nn.Module()
    model.mixed = nn.ModuleList([shared, nn.ReLU(), nn.Sequential(shared)])
    with pytest.raises(ValueError, match="tied"):
        bmt.BMTrainModelWrapper(model)


# -- BMTrain's whole package, module by module ------------------------------------------

# Every module of BMTrain 1.x (bmtrain/**/*.py at the commit in the BMTrain suite's
# SOURCE) and the public names it defines (a package: the names its __init__ imports
# too), as data. nbtrain has each at the same path: nbtrain.X.name for bmtrain.X.name,
# but for those listed below with the reason.
BMTRAIN_MODULES = {
    "": [
        "BMTrainModelWrapper",
        "Block",
        "CheckpointBlock",
        "DistributedModule",
        "DistributedParameter",
        "ParameterInitializer",
        "PipelineTransformerBlockList",
        "TransformerBlockList",
        "config",
        "debug",
        "distributed",
        "gather_result",
        "grouped_parameters",
        "init_distributed",
        "init_parameters",
        "inspect",
        "load",
        "load_nccl_pypi",
        "loss",
        "lr_scheduler",
        "nn",
        "optim",
        "print_block",
        "print_dict",
        "print_rank",
        "rank",
        "save",
        "see_memory",
        "sum_loss",
        "synchronize",
        "wait_loader",
        "world_size",
    ],
    "benchmark": ["all_gather", "reduce_scatter", "send_recv"],
    "benchmark.all_gather": ["all_gather"],
    "benchmark.reduce_scatter": ["reduce_scatter"],
    "benchmark.send_recv": ["send_recv"],
    "benchmark.shape": ["SHAPES"],
    "benchmark.utils": ["format_size", "format_size_"],
    "block_layer": ["Block", "TransformerBlockList", "storage_type_cuda"],
    "debug": ["DEBUG_VARS", "append", "clear", "extend", "get", "set"],
    "distributed": [
        "all_gather",
        "all_reduce",
        "broadcast",
        "recv_activations",
        "reduce_scatter",
        "send_activations",
    ],
    "distributed.ops": [
        "DTYPE_LIST",
        "OpAllGather",
        "OpAllReduce",
        "OpBroadcast",
        "OpReduceScatter",
        "all_gather",
        "all_reduce",
        "broadcast",
        "recv_activations",
        "recv_meta",
        "reduce_scatter",
        "send_activations",
        "send_meta",
    ],
    "global_var": ["ConfigMap", "config", "rank", "world_size"],
    "hook_func": [
        "OneStepNoGradFunc",
        "PostHookFunc",
        "PreHookFunc",
        "zero_post_backward",
        "zero_post_forward",
        "zero_pre_backward",
        "zero_pre_forward",
    ],
    "init": ["init_distributed", "is_initialized", "topology"],
    "inspect": ["format_summary", "inspect_model", "inspect_tensor", "record_tensor"],
    "inspect.format": ["align_str", "format_line", "format_summary", "item_formater"],
    "inspect.model": ["inspect_block", "inspect_model", "inspect_pipeline_transformer_block_list"],
    "inspect.tensor": ["InspectTensor", "InspectTensorManager", "inspect_tensor", "record_tensor"],
    "layer": ["DistributedModule"],
    "loss": ["FusedCrossEntropy"],
    "loss._function": [
        "CHECK_INPUT",
        "cross_entropy_backward_inplace",
        "cross_entropy_forward",
        "fused_softmax_inplace",
        "fused_sumexp",
        "has_inf_nan",
    ],
    "loss.cross_entropy": ["FusedCrossEntropy", "OpFusedCrossEntropy", "VPFusedCrossEntropy"],
    "lr_scheduler": ["Cosine", "Exponential", "Linear", "NoDecay", "Noam", "WarmupLRScheduler"],
    "lr_scheduler.cosine": ["Cosine"],
    "lr_scheduler.exponential": ["Exponential"],
    "lr_scheduler.linear": ["Linear"],
    "lr_scheduler.no_decay": ["NoDecay"],
    "lr_scheduler.noam": ["Noam"],
    "lr_scheduler.warmup": ["WarmupLRScheduler"],
    "nccl": [
        "NCCLCommunicator",
        "allGather",
        "allReduce",
        "broadcast",
        "commCount",
        "commDestroy",
        "commInitRank",
        "commRank",
        "dtype2nccl",
        "getUniqueId",
        "groupEnd",
        "groupStart",
        "ncclAvg",
        "ncclBFloat16",
        "ncclBool",
        "ncclChar",
        "ncclDouble",
        "ncclFloat",
        "ncclFloat16",
        "ncclFloat32",
        "ncclFloat64",
        "ncclHalf",
        "ncclInt",
        "ncclInt32",
        "ncclInt64",
        "ncclInt8",
        "ncclMax",
        "ncclMin",
        "ncclProd",
        "ncclSum",
        "ncclUint32",
        "ncclUint64",
        "ncclUint8",
        "op2nccl",
        "recv",
        "reduce",
        "reduceScatter",
        "send",
    ],
    "nccl.enums": [
        "ncclAvg",
        "ncclBFloat16",
        "ncclBool",
        "ncclChar",
        "ncclDouble",
        "ncclFloat",
        "ncclFloat16",
        "ncclFloat32",
        "ncclFloat64",
        "ncclHalf",
        "ncclInt",
        "ncclInt32",
        "ncclInt64",
        "ncclInt8",
        "ncclMax",
        "ncclMin",
        "ncclProd",
        "ncclSum",
        "ncclUint32",
        "ncclUint64",
        "ncclUint8",
    ],
    "nn": [
        "ColumnParallelLinear",
        "Linear",
        "OpLinear",
        "OpParallelLinear",
        "RowParallelLinear",
        "VPEmbedding",
    ],
    "nn.column_parallel_linear": ["ColumnParallelLinear"],
    "nn.linear": ["Linear", "OpLinear"],
    "nn.parallel_embedding": ["VPEmbedding"],
    "nn.parallel_linear_func": [
        "OpParallelLinear",
        "ReduceType",
        "async_all_gather_linear_backward_func",
        "async_all_gather_linear_func",
        "async_reduce_scatter_linear_func",
        "preprocess_input",
    ],
    "nn.row_parallel_linear": ["RowParallelLinear"],
    "optim": ["AdamOffloadOptimizer", "AdamOptimizer", "OptimManager"],
    "optim._distributed": ["state_dict_gather"],
    "optim._function": [
        "CHECK_INPUT",
        "adam_bf16",
        "adam_cpu",
        "adam_fp16",
        "bf16_from_fp32",
        "fp16_from_fp32",
    ],
    "optim.adam": ["AdamOptimizer"],
    "optim.adam_offload": ["AdamOffloadOptimizer"],
    "optim.optim_manager": ["OptimManager", "check_overflow", "grad_rescale"],
    "param_init": [
        "grouped_parameters",
        "init_distributed_parameter",
        "init_parameters",
        "iterate_parameters",
    ],
    "parameter": ["DistributedParameter", "OpAllGather", "ParameterInitializer"],
    "pipe_layer": [
        "PipePostFunction",
        "PipePreFunction",
        "PipelineTransformerBlockList",
        "StagePostFunction",
        "StagePreFunction",
    ],
    "store": [
        "DTYPE_LIST",
        "DistributedStateDictWrapper",
        "DistributedTensorWrapper",
        "allgather_objects",
        "async_save_to_file",
        "broadcast_object",
        "load",
        "save",
    ],
    "synchronize": ["gather_result", "sum_loss", "synchronize", "wait_loader"],
    "utils": [
        "ALIGN",
        "AverageRecorder",
        "ROW_WIDTH",
        "check_torch_version",
        "load_nccl_pypi",
        "print_block",
        "print_dict",
        "print_rank",
        "round_up",
        "see_memory",
        "tp_split_tensor",
    ],
    "wrapper": ["BMTrainModelWrapper", "make_distributed", "model_wrapper_dispatch"],
    "zero_context": ["ZeroContext"],
}

_ONE_MODULE = "nbtrain.{0} is one module: BMTrain's names of {0}.* are nbtrain.{0}.NAME"
ABSENT_MODULES = {
    "benchmark": "BMTrain's NCCL bandwidth scripts; nbtrain.bench measures nbtrain's own",
    "benchmark.all_gather": "BMTrain's NCCL bandwidth scripts",
    "benchmark.reduce_scatter": "BMTrain's NCCL bandwidth scripts",
    "benchmark.send_recv": "BMTrain's NCCL bandwidth scripts",
    "benchmark.shape": "BMTrain's NCCL bandwidth scripts",
    "benchmark.utils": "BMTrain's NCCL bandwidth scripts",
    "hook_func": "the autograd hooks inside BMTrain's Block; nbtrain's Block has its own",
    "zero_context": "the gather/release context inside BMTrain's Block; nbtrain's Block has its own",
    "loss._function": "BMTrain's C++/CUDA binding",
    "optim._function": "BMTrain's C++/CUDA binding",
    "optim._distributed": "BMTrain's private helper of OptimManager.state_dict",
    "inspect.format": _ONE_MODULE.format("inspect"),
    "inspect.model": _ONE_MODULE.format("inspect"),
    "inspect.tensor": _ONE_MODULE.format("inspect"),
    "loss.cross_entropy": _ONE_MODULE.format("loss"),
    "lr_scheduler.cosine": _ONE_MODULE.format("lr_scheduler"),
    "lr_scheduler.exponential": _ONE_MODULE.format("lr_scheduler"),
    "lr_scheduler.linear": _ONE_MODULE.format("lr_scheduler"),
    "lr_scheduler.no_decay": _ONE_MODULE.format("lr_scheduler"),
    "lr_scheduler.noam": _ONE_MODULE.format("lr_scheduler"),
    "lr_scheduler.warmup": _ONE_MODULE.format("lr_scheduler"),
}

_INTERNAL = "an autograd function or helper inside the public one; call that instead"
ABSENT_NAMES = {
    "block_layer": {"storage_type_cuda": "CUDA storage types; nbtrain's buffers are tensors"},
    "distributed.ops": {
        "OpAllGather": _INTERNAL,
        "OpAllReduce": _INTERNAL,
        "OpBroadcast": _INTERNAL,
        "OpReduceScatter": _INTERNAL,
        "send_meta": "the header travels inside send_activations",
        "recv_meta": "the header travels inside recv_activations",
    },
    "nn.parallel_linear_func": {
        "preprocess_input": _INTERNAL,
        "async_all_gather_linear_func": _INTERNAL,
        "async_all_gather_linear_backward_func": _INTERNAL,
        "async_reduce_scatter_linear_func": _INTERNAL,
    },
    "optim.optim_manager": {"check_overflow": _INTERNAL, "grad_rescale": _INTERNAL},
    "parameter": {"OpAllGather": _INTERNAL},
    "pipe_layer": {
        "PipePreFunction": _INTERNAL,
        "PipePostFunction": _INTERNAL,
        "StagePreFunction": _INTERNAL,
        "StagePostFunction": _INTERNAL,
    },
    "store": {
        "DistributedStateDictWrapper": "BMTrain's load broadcasts rank 0's file; each rank reads its rows",
        "DistributedTensorWrapper": "BMTrain's load broadcasts rank 0's file; each rank reads its rows",
    },
    "wrapper": {"make_distributed": _INTERNAL, "model_wrapper_dispatch": _INTERNAL},
}


def _nbtrain_module(sub: str):
    return importlib.import_module(f"nbtrain.{sub}" if sub else "nbtrain")


@pytest.mark.parametrize("sub", sorted(m for m in BMTRAIN_MODULES if m not in ABSENT_MODULES))
def test_every_bmtrain_module_and_name_is_at_its_path(sub):
    module = _nbtrain_module(sub)
    absent = ABSENT_NAMES.get(sub, {})
    missing = [n for n in BMTRAIN_MODULES[sub] if n not in absent and not hasattr(module, n)]
    assert not missing, f"nbtrain.{sub} lacks BMTrain's {missing}"


def test_what_is_listed_absent_is_absent():
    # An entry that nbtrain gained since is taken off the list, so the list stays true.
    present = []
    for sub in ABSENT_MODULES:
        try:
            _nbtrain_module(sub)
            present.append(sub)
        except ImportError:
            pass
    for sub, names in ABSENT_NAMES.items():
        assert set(names) <= set(BMTRAIN_MODULES[sub]), sub
        present += [f"{sub}.{n}" for n in names if hasattr(_nbtrain_module(sub), n)]
    assert not present, f"listed absent but present: {present}"
    assert set(ABSENT_MODULES) <= set(BMTRAIN_MODULES)


def test_bmtrains_modules_give_nbtrains_objects():
    import nbtrain.nccl
    import nbtrain.param_init
    import nbtrain.store

    module = importlib.import_module("nbtrain.synchronize")
    assert module.synchronize is bmt.synchronize  # and bmt.synchronize stays the function
    assert callable(bmt.synchronize) and module.gather_result is bmt.gather_result
    assert nbtrain.param_init.init_parameters is bmt.init_parameters
    assert nbtrain.store.save is bmt.save and nbtrain.store.load is bmt.load
    assert (
        _nbtrain_module("pipe_layer").PipelineTransformerBlockList
        is bmt.PipelineTransformerBlockList
    )
    assert _nbtrain_module("block_layer").Block is bmt.CheckpointBlock
    assert _nbtrain_module("init").init_distributed is bmt.init_distributed
    assert nbtrain.nccl.ncclSum == 0 and nbtrain.nccl.op2nccl("avg") == nbtrain.nccl.ncclAvg
