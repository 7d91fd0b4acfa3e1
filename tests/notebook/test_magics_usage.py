"""%nbtrain push/pull/restart/status, target lists and slices, usage errors and help.

Real IPython shell, 2 real gloo ranks shared by the module (start costs ~10 s on 2
cores); the restart test, the module's last, goes down to 1 rank and leaves it so:
the module's fixture stops whatever cluster is current at the end.
"""

import re

import pytest

# The notebook packages ([notebook]/[test] extras) may be absent, e.g. on a bare GPU machine
# running only `pytest -m gpu`: skip this module there rather than fail collection.
for _needed in ("IPython", "ipyparallel"):
    pytest.importorskip(_needed)
import torch
from IPython.core.error import UsageError
from support.notebook import nbtrain, run

from nbtrain.notebook import magics

pytestmark = pytest.mark.timeout(240)


# ------------------------------------------------------------- help (no cluster)
def test_help_lists_every_action_and_flag():
    doc = magics.NbtrainMagics.nbtrain.__doc__
    for action in magics.ACTIONS:
        assert f"\n  {action}" in doc, action
    for flag in ("--rank", "--frame", "--interactive", "--clear"):  # debug's
        assert flag in doc, flag
    cell_doc = magics.NbtrainMagics.distributed.__doc__
    for flag in ("--targets", "--timeout", "--no-stream", "--dashboard"):
        assert flag in cell_doc, flag
    assert "::2" in cell_doc and "-1" in cell_doc


def test_help_of_the_magic_and_of_each_action(ipython, capsys):
    assert nbtrain(ipython, "--help") is None
    out = capsys.readouterr().out
    assert "%nbtrain ACTION --help" in out and "%%distributed --noblock" in out
    assert all(f"    {action}" in out for action in magics.ACTIONS), out
    nbtrain(ipython, "start --help")
    out = capsys.readouterr().out
    assert "--tp-size T" in out and "--sbatch OPTION" in out and "--rank" not in out
    assert "--ip" not in out.replace("--controller-ip", "")  # the old flags stay hidden
    nbtrain(ipython, "debug -h")
    out = capsys.readouterr().out
    assert "--all-frames" in out and "EXPR" in out and "--tp-size" not in out


@pytest.mark.parametrize(
    "line, message",
    [
        ("status --tp-size 4", "`%nbtrain status` takes nothing"),
        ("pull x --rank 1", "`%nbtrain pull` takes NAME, -t/--targets"),
        ("wait -n 3", "`%nbtrain wait` takes --timeout"),
        ("start --frobnicate 1", "takes no --frobnicate: no action has it; `%nbtrain start` takes"),
        ("stop now", "stop takes no argument 'now'"),
        ("start -n x", "%nbtrain start: argument -n: invalid int value: 'x'"),
    ],
)
def test_a_flag_of_another_action_names_what_this_one_takes(ipython, line, message):
    # Refused by the action's own parser, before any cluster is looked for.
    with pytest.raises(UsageError, match=re.escape(message)):
        nbtrain(ipython, line)


# ------------------------------------------------------------- targets (no engines)
class _Ranks:
    """Just enough of a Cluster for `Cluster.targets`: 4 ranks, running."""

    targets = magics.Cluster.targets
    world_size = 4

    def _require_running(self):
        pass


@pytest.mark.parametrize(
    "spec, ranks",
    [
        (None, [0, 1, 2, 3]),
        ("0,2", [0, 2]),
        ("0:2", [0, 1]),
        ("::2", [0, 2]),
        ("1:", [1, 2, 3]),
        ("-1", [3]),
        (-1, [3]),
        ("0, 3", [0, 3]),
        ("2,0:2", [0, 1, 2]),
        ("-2:", [2, 3]),
        (slice(None, None, -1), [0, 1, 2, 3]),
        ([1, -1], [1, 3]),
        (2, [2]),
    ],
)
def test_targets_accept_lists_and_slices(spec, ranks):
    assert _Ranks().targets(spec) == ranks


@pytest.mark.parametrize(
    "spec, named",
    [
        ("4", "4"),
        ("-5", "-5"),
        ("a", "'a'"),
        ("1:x", "'1:x'"),
        ("::0", "'::0'"),
        ("4:", "'4:'"),
        ([7], "7"),
        ("0:1:2:3", "'0:1:2:3'"),
    ],
)
def test_bad_targets_name_the_value_and_the_range(spec, named):
    with pytest.raises(ValueError) as info:
        _Ranks().targets(spec)
    assert named in str(info.value) and "0..3" in str(info.value)


# ------------------------------------------------------------- on the cluster
def test_push_sends_notebook_variables(ipython, cluster):
    ipython.user_ns.update(lr=0.5, tags=["a", "b"])
    nbtrain(ipython, "push lr tags")
    assert nbtrain(ipython, "pull lr") == [0.5, 0.5]
    ipython.user_ns["lr"] = 0.25
    nbtrain(ipython, "push lr -t 1")
    assert nbtrain(ipython, "pull lr") == [0.5, 0.25]
    assert nbtrain(ipython, "pull tags -t -1") == ["a", "b"]


def test_push_of_an_undefined_name_names_it(ipython, cluster):
    ipython.user_ns.pop("not_here", None)
    with pytest.raises(UsageError, match="not_here not defined in the notebook"):
        nbtrain(ipython, "push lr not_here")


def test_targets_slices_in_cells_and_pull(ipython, cluster):
    run(ipython, "mark = nbt.rank() * 10")
    assert nbtrain(ipython, "pull mark -t 0:") == [0, 10]
    assert nbtrain(ipython, "pull mark -t ::2") == [0]
    assert nbtrain(ipython, "pull mark -t -1") == 10
    out = run(ipython, "print('here', nbt.rank())", line="-t -1")
    assert "[rank 1] here 1" in out and "[rank 0]" not in out
    out = run(ipython, "print('here', nbt.rank())", line="-t 1:")
    assert "[rank 1] here 1" in out and "[rank 0]" not in out


@pytest.mark.parametrize(
    "line, message",
    [
        ("pull mark -t 2", "out of range"),
        ("pull mark -t 0,5", "out of range"),
        ("pull mark -t x", "'x' is not a rank"),
    ],
)
def test_bad_targets_are_usage_errors(ipython, cluster, line, message):
    with pytest.raises(UsageError, match=message) as info:
        nbtrain(ipython, line)
    assert "0..1" in str(info.value)


def test_bad_targets_in_a_cell_are_usage_errors(ipython, cluster):
    with pytest.raises(UsageError, match="out of range.*0..1"):
        ipython.run_cell_magic("distributed", "-t 3", "print('never')")


@pytest.mark.parametrize(
    "line, message",
    [
        ("pull", "name the variable"),
        ("push", "name the variable"),
        ("pull a b", "one NAME"),
        ("frobnicate", "invalid choice: 'frobnicate'"),
        ("start -n 0", "-n 0"),
        ("restart -n 0", "-n 0"),
        ("start --mpi-args '--host a:2'", "--mpi-args: mpiexec arguments, for .*--launcher mpi"),
        ("status --tp-size 4", "status takes no --tp-size: it is a flag of `%nbtrain start`"),
        ("pull x --rank 1", "pull takes no --rank: it is a flag of `%nbtrain debug`"),
        ("stop -n 3", "stop takes no -n: it is a flag of `%nbtrain start` or `%nbtrain restart`"),
    ],
)
def test_bad_usage_is_a_usage_error(ipython, cluster, line, message):
    with pytest.raises(UsageError, match=message):
        nbtrain(ipython, line)
    assert magics.current_cluster() is cluster and cluster.world_size == 2


def test_pull_plain_values_and_attribute_paths(ipython, cluster):
    run(
        ipython,
        "import torch.nn as nn\ntorch.manual_seed(0)\n"
        "net = nn.Sequential(nn.Linear(3, 2))\nitems = [nbt.rank(), 'x']",
    )
    weights = nbtrain(ipython, "pull net.0.weight")
    assert len(weights) == 2 and torch.equal(weights[0], weights[1])
    assert nbtrain(ipython, "pull items.0") == [0, 1]
    run(ipython, "only_one = 1", line="-t 1")
    with pytest.raises(NameError, match=r"'only_one' is not defined on rank\(s\) 0:"):
        nbtrain(ipython, "pull only_one")
    assert nbtrain(ipython, "pull only_one -t 1") == 1


def test_pull_distributed_parameter_gives_the_full_tensor(ipython, cluster):
    run(ipython, "p = nbt.DistributedParameter(torch.arange(15.).reshape(3, 5))\nshard = p.numel()")
    assert nbtrain(ipython, "pull shard") == [8, 8]  # each rank holds half (padded)
    full = nbtrain(ipython, "pull p")
    assert torch.equal(full, torch.arange(15.0).reshape(3, 5))
    assert torch.equal(nbtrain(ipython, "pull p -t 1"), full)


def test_pull_parameter_of_a_sharded_model_gives_the_full_tensor(ipython, cluster):
    run(
        ipython,
        "import torch.nn as nn\ntorch.manual_seed(0)\n"
        "model = nn.Sequential(nn.Linear(4, 8), nn.Sequential(nn.Linear(8, 3)))\n"
        "want = {k: v.clone() for k, v in model.state_dict().items()}\n"
        "model[1] = nbt.Block(model[1], zero_level=3)\n"
        "model[0] = nbt.Block(model[0], zero_level=3)",
    )
    want = nbtrain(ipython, "pull want -t 0")
    got = nbtrain(ipython, "pull model.1.0.weight")
    assert isinstance(got, torch.Tensor) and got.shape == (3, 8)
    assert torch.equal(got, want["1.0.weight"])
    assert torch.equal(nbtrain(ipython, "pull model.0.bias"), want["0.bias"])


def test_status_shows_step_and_loss(ipython, cluster, capsys):
    run(ipython, "nbt.telemetry.metric(loss=2.5 + nbt.rank())\nnbt.telemetry.next_step()")
    rows = cluster.status()
    assert [r["loss"] for r in rows] == [2.5, 3.5]
    assert all(r["step"] >= 1 for r in rows)
    nbtrain(ipython, "status")
    out = capsys.readouterr().out
    assert "step" in out and "loss" in out and "2.5" in out and "3.5" in out


# Last in the module: it leaves 1 rank, and every test above counts on 2. Going down
# to 1 rank and staying there costs one start, of one engine, where going to 3 ranks
# and back to 2 cost two starts, of five engines in all. Growing (2 to 3 ranks) is
# checked by tests/notebook/test_kernel_magics.py (`%nbtrain restart -n 3`, a kernel).
def test_restart_with_n_changes_the_number_of_ranks(ipython, cluster):
    nbtrain(ipython, "restart -n 1")
    assert magics.current_cluster() is cluster and cluster.world_size == 1
    out = run(ipython, "print('world', torch.distributed.get_world_size())")
    assert out.count("world 1") == 1 and "[rank 0] world 1" in out, out
