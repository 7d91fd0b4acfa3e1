"""`%nbtrain debug` in a real IPython shell on 2 real gloo ranks: after a cell raises on
rank 1 only, its frames and locals, expressions evaluated in its frame, the Python API
behind the magic, and the usage errors; rank 0's namespace stays as it was."""

import pytest

for _needed in ("IPython", "ipyparallel"):
    pytest.importorskip(_needed)
from IPython.core.error import UsageError
from IPython.utils.capture import capture_output
from support.notebook import captured, nbtrain, run

from nbtrain import RankError
from nbtrain.notebook.post_mortem import post_mortem, split_expression

pytestmark = pytest.mark.timeout(240)

FAILING_CELL = """\
def step(rank):
    secret = 40 + rank
    batch = torch.ones(3, 5)
    loss = batch.sum()
    if rank == 1:
        raise ValueError(f"rank {rank} failed")
    return secret

kept = "before " + str(nbt.rank())
result = step(nbt.rank())
"""


def _fail_on_rank_1(ipython) -> None:
    with pytest.raises(RankError, match="rank 1 failed"):
        run(ipython, FAILING_CELL)


def _debug(ipython, line: str) -> str:
    return captured(ipython, "nbtrain", line)[1]


def test_no_failure_yet_is_a_usage_error(ipython, cluster):
    nbtrain(ipython, "debug --clear")
    with pytest.raises(UsageError, match="no failed cell to debug on any rank.*raises"):
        nbtrain(ipython, "debug")


def test_debug_lists_frames_and_locals_of_the_lowest_failing_rank(ipython, cluster):
    _fail_on_rank_1(ipython)
    shown = _debug(ipython, "debug")
    assert shown.startswith("rank 1 raised ValueError: rank 1 failed"), shown
    frames = shown.split("locals of frame")[0]
    assert "in <module>" in frames and "in step" in frames, shown
    assert "> 1  Cell In[" in shown and 'raise ValueError(f"rank {rank} failed")' in shown
    assert "locals of frame 1 (step):" in shown
    assert "  secret  int 41" in shown and "batch   Tensor (3, 5) float32 cpu" in shown, shown
    assert "loss    Tensor () float32 cpu = 15.0" in shown, shown


def test_an_expression_is_evaluated_in_the_failing_frame_on_that_rank_only(ipython, cluster):
    _fail_on_rank_1(ipython)
    assert _debug(ipython, "debug --rank 1 secret").strip() == "41"
    # The expression is taken verbatim: its spaces and quotes survive.
    assert _debug(ipython, "debug --rank 1 secret * 2 + len('ab')").strip() == "84"
    assert _debug(ipython, "debug --rank 1 batch.sum()").strip() == "tensor(15.)"
    # A statement is executed; later expressions in that frame see it (as in pdb).
    assert _debug(ipython, "debug --rank 1 doubled = secret * 2; print('set')").strip() == "set"
    assert _debug(ipython, "debug --rank 1 doubled").strip() == "82"
    # The outer frame is the cell itself: `result` was never assigned on rank 1.
    shown = _debug(ipython, "debug --rank 1 --frame 0 result")
    assert shown.strip() == "*** NameError: name 'result' is not defined", shown
    # Rank 0 finished the cell and keeps its namespace; a cell on rank 0 only leaves
    # rank 1's failure in place.
    out = run(ipython, "print(kept, result, 'doubled' in globals())", "-t 0")
    assert out == "[rank 0] before 0 40 False\n", out
    assert _debug(ipython, "debug secret").strip() == "41"


def test_the_python_api_behind_the_magic(ipython, cluster):
    _fail_on_rank_1(ipython)
    debugger = cluster.post_mortem()
    assert repr(debugger) == repr(post_mortem(cluster, 1, -1))
    assert debugger.rank == 1 and debugger.failing == [1]
    assert [f["function"] for f in debugger.frames()] == ["<module>", "step"]
    assert debugger.eval("secret") == 41
    assert debugger.eval("batch").shape == (3, 5)  # the value itself comes back
    assert debugger.locals()["secret"] == "int 41"
    assert debugger.up().eval("kept") == "before 1"
    assert debugger.up().frame == 0 and debugger.down().down().frame == 1
    with pytest.raises(Exception, match=r"rank 1, frame 1 \(step\): `missing` raised NameError"):
        debugger.eval("missing")
    answers = iter(["secret + 1", "up", "kept", "q"])
    with capture_output() as out:  # the prompt `%nbtrain debug -i` gives, fed these lines
        debugger.select(-1).interact(read=lambda prompt: next(answers))
    assert "\n42\n" in out.stdout and "\n'before 1'\n" in out.stdout, out.stdout
    assert "secret  int 41" in out.stdout and "> 0  Cell In[" in out.stdout


def test_usage_errors_name_the_value_and_the_fix(ipython, cluster):
    _fail_on_rank_1(ipython)
    with pytest.raises(UsageError, match=r"--rank 5: the cluster has ranks 0 to 1.*--rank 0"):
        nbtrain(ipython, "debug --rank 5 secret")
    with pytest.raises(UsageError, match=r"on rank 0 \(failing: rank\(s\) 1\)"):
        nbtrain(ipython, "debug --rank 0")
    with pytest.raises(UsageError, match=r"--frame 7: rank 1's failure has frames 0.*to 1"):
        nbtrain(ipython, "debug --frame 7")


def test_the_next_cell_or_clear_drops_the_failure(ipython, cluster):
    _fail_on_rank_1(ipython)
    run(ipython, "x = 1")  # the next cell on rank 1 drops its failure as it starts
    with pytest.raises(UsageError, match="no failed cell to debug on any rank"):
        nbtrain(ipython, "debug")
    _fail_on_rank_1(ipython)
    assert _debug(ipython, "debug --clear").strip() == "cleared the failure of rank(s) 1"
    with pytest.raises(UsageError, match="no failed cell to debug on rank 1"):
        nbtrain(ipython, "debug --rank 1")


@pytest.mark.parametrize(
    "line, flags, expr",
    [
        ("debug", "debug", ""),
        ("debug --rank 1 x['a b']", "debug --rank 1", "x['a b']"),
        ("debug --frame -1 --rank=1 f(1, 2)", "debug --frame -1 --rank=1", "f(1, 2)"),
        ("debug -i", "debug -i", ""),
        ("debug --all-frames x", "debug --all-frames", "x"),
        ("pull x", "pull x", ""),
    ],
)
def test_split_expression_keeps_it_verbatim(line, flags, expr):
    assert split_expression(line) == (flags, expr)


LAYER_FILE = """\
import torch


class Scale(torch.nn.Module):
    def forward(self, x):
        factor = 3
        return torch.nn.functional.linear(x * factor, torch.ones(4, 7))
"""

LAYER_CELL = """\
import importlib.util, os
layer_path = os.path.abspath(f"nbt_pm_layer{nbt.rank()}.py")  # one file per rank
with open(layer_path, "w") as f:
    f.write(LAYER_FILE)
spec = importlib.util.spec_from_file_location("nbt_pm_layer", layer_path)
nbt_pm_layer = importlib.util.module_from_spec(spec)
spec.loader.exec_module(nbt_pm_layer)
model = torch.nn.Sequential(torch.nn.Identity(), nbt_pm_layer.Scale())
if nbt.rank() == 1:
    model(torch.ones(2, 5))
"""


def test_torch_frames_are_hidden_and_paths_relative(ipython, cluster):
    """A shape error raised inside torch, under nn.Sequential, from a layer in a file
    of the working folder: the layer is frame 1 of 2 (of 7 with torch's own), its path
    is relative, and its locals are those of frame 1, not of a hidden frame."""
    cluster.push({"LAYER_FILE": LAYER_FILE})
    try:
        with pytest.raises(RankError, match="shapes cannot be multiplied"):
            run(ipython, LAYER_CELL)
        debugger = cluster.post_mortem()
        assert [f["function"] for f in debugger.frames()] == ["<module>", "forward"]
        assert debugger.frame == 1 and debugger.frames()[1]["file"] == "nbt_pm_layer1.py"
        assert debugger.eval("factor") == 3 and debugger.up().eval("LAYER_FILE") == LAYER_FILE
        shown = _debug(ipython, "debug")
        assert "> 1  nbt_pm_layer1.py, line 7, in forward" in shown, shown
        assert "hidden, --all-frames shows" in shown and "  factor  int 3" in shown, shown
        every = _debug(ipython, "debug --all-frames")
        assert "torch/nn/modules/module.py" in every and "in _call_impl" in every, every
        assert "hidden" not in every, every
        # Under --all-frames the innermost frame is still the layer's.
        assert _debug(ipython, "debug --all-frames factor").strip() == "3"
    finally:
        run(ipython, "os.remove(layer_path); del model, LAYER_FILE, nbt_pm_layer, spec, layer_path")
