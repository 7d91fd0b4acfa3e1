"""`locate_divergence`: where a parallel layout first leaves its one-process twin.

    report = nbtrain.debug.locate_divergence(
        model, reference, batches, loss_fn, optimizer, reference_optimizer, steps=3)
    print(report.table())      # per step: first module off in forward, backward, params
    report.plot()              # max error by layer and step (matplotlib, log scale)

`model` is the parallel model (wrap, Blocks, a tp plan, a pipeline stage); `reference`
its plain twin with the same starting weights, whole on every rank. Each step both
train on the same global batch: the reference on all of it, locally on every rank (no
communication), the model on this rank's rows. Forward hooks and full backward hooks
on every module the two share by name record each module's output and the gradient
with respect to its inputs; after the optimizer steps, each parameter's shard on this
rank (`nbtrain.zero.shards`) is checked against the reference's same elements.

Per step the report names, in execution order, the first module whose output differs,
the first (in backward order) whose input gradient differs, and the first parameter
that differs after the step, each with the rank that saw it first and the max absolute
and relative error. A module whose tensors have other shapes than the reference's (a
column-parallel layer's output slice, a sequence-parallel token slice) is skipped and
listed in `report.skipped`; the root module is never compared (its children are).

Activation checkpointing is fine: a forward recomputed in backward is the same call
again and is not recorded twice.

Memory: every module's outputs and input gradients of one step are kept (as clones),
so run it on a small model for a few steps.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass, field

import torch
from torch import nn

from ..comm import collectives as C
from ..comm.context import get_context
from ..tensor_parallel.slices import slice_from_full
from ..zero import shards

DIRECTIONS = ("forward", "backward", "params")


@dataclass(frozen=True)
class Finding:
    """The first tensor of one direction that differs beyond the tolerance.

    Attributes:
        step: the training step (0-based).
        direction: "forward" (the module's output), "backward" (the gradient with
            respect to its inputs) or "params" (a parameter after the optimizer step).
        module: the module's name, as in `reference.named_modules()`.
        rank: the lowest global rank that saw it.
        max_abs: max |model - reference| over the tensor's elements on that rank.
        max_rel: max_abs / max |reference|.
        tensor: the parameter's name ("params"), else "output" or "input grad".
        ratio: the least-squares factor f with model ~ f * reference over that
            tensor (1.0: no common factor). Near-equal ratios over every module of a
            direction mean one scale went wrong upstream (a summed loss: every input
            gradient times the rows; docs/debugging.md), not one module.
    """

    step: int
    direction: str
    module: str
    rank: int
    max_abs: float
    max_rel: float
    tensor: str
    ratio: float = 1.0


@dataclass
class StepReport:
    """One step: the first Finding of each direction (None: no divergence there), and
    every compared module's max absolute error over the ranks, by direction."""

    step: int
    forward: Finding | None = None
    backward: Finding | None = None
    params: Finding | None = None
    errors: dict = field(default_factory=dict)  # direction -> {module: max abs error}

    @property
    def diverged(self) -> bool:
        return any(getattr(self, d) is not None for d in DIRECTIONS)


@dataclass
class DivergenceReport:
    """`locate_divergence`'s result, the same on every rank."""

    steps: list[StepReport]
    skipped: list[str]
    atol: float
    rtol: float

    @property
    def diverged(self) -> bool:
        return any(s.diverged for s in self.steps)

    def first(self) -> Finding | None:
        """The earliest finding: the first diverging step's forward, else backward, else
        parameter finding."""
        for s in self.steps:
            for d in DIRECTIONS:
                if getattr(s, d) is not None:
                    return getattr(s, d)
        return None

    def table(self) -> str:
        """A text table: one line per step and direction."""
        lines = [f"{'step':>4}  {'direction':<9}  {'module':<28}  {'rank':>4}  max abs    max rel"]
        for s in self.steps:
            for d in DIRECTIONS:
                f = getattr(s, d)
                if f is None:
                    lines.append(f"{s.step:>4}  {d:<9}  {'-':<28}  {'':>4}  agrees")
                    continue
                name = f.module if d != "params" else f.tensor
                ratio = f"  (= reference x {f.ratio:.4g})" if abs(f.ratio - 1) > 1e-3 else ""
                lines.append(
                    f"{s.step:>4}  {d:<9}  {name:<28}  {f.rank:>4}  "
                    f"{f.max_abs:.3e}  {f.max_rel:.3e}{ratio}"
                )
        lines.append(f"tolerance: atol {self.atol:g}, rtol {self.rtol:g}")
        if self.skipped:
            lines.append("not compared (other shapes): " + ", ".join(self.skipped))
        return "\n".join(lines)

    def plot(self):
        """Max absolute error by module (x, in execution order) for each step, one panel
        per direction, log scale. Returns the matplotlib Figure."""
        import matplotlib.pyplot as plt

        fig, axes = plt.subplots(1, 3, figsize=(15, 4), squeeze=False)
        for ax, d in zip(axes[0], DIRECTIONS):
            names: list[str] = []
            for s in self.steps:
                errors = s.errors.get(d, {})
                values = [max(v, 1e-30) for v in errors.values()]
                ax.plot(range(len(values)), values, marker=".", label=f"step {s.step}")
                names = list(errors)
            ax.set_yscale("log")
            ax.set_title(f"{d}: max |error| by module")
            if names:
                ax.set_xticks(range(len(names)), names, rotation=90, fontsize=6)
            ax.axhline(self.atol, color="grey", linestyle=":")
        axes[0][0].legend()
        fig.tight_layout()
        return fig


class _Recorder:
    """Every named module's outputs and input gradients of one step, and the order in
    which modules first ran forward and backward. With `names`, only the modules it
    maps, recorded under the names it gives them."""

    def __init__(self, model: nn.Module, names: dict[str, str] | None = None):
        self.outputs: dict[str, list] = {}
        self.grads: dict[str, list] = {}
        self.handles = []
        for name, module in model.named_modules():
            name = name if names is None else names.get(name, "")
            if name:  # the root is never compared: its output is its children's
                self.handles.append(module.register_forward_hook(self._forward(name)))
                self.handles.append(module.register_full_backward_hook(self._backward(name)))

    def _forward(self, name):
        def hook(module, args, out):
            if _in_backward():  # activation checkpointing recomputing this call
                return
            self.outputs.setdefault(name, []).append([t.detach().clone() for t in _tensors(out)])

        return hook

    def _backward(self, name):
        def hook(module, grad_input, grad_output):
            grads = [None if g is None else g.detach().clone() for g in grad_input]
            self.grads.setdefault(name, []).append(grads)

        return hook

    def clear(self):
        self.outputs, self.grads = {}, {}

    def remove(self):
        for h in self.handles:
            h.remove()


def _in_backward() -> bool:
    """Whether autograd is running a backward pass on this thread. A module's forward
    called then is a recompute (`torch.utils.checkpoint`, a Block's `use_checkpoint`):
    the same call again, not another micro-batch, so it is not recorded."""
    return torch._C._current_graph_task_id() != -1


def _tensors(out) -> list[torch.Tensor]:
    if torch.is_tensor(out):
        return [out]
    if isinstance(out, (tuple, list)):
        return [t for o in out for t in _tensors(o)]
    if isinstance(out, dict):
        return [t for o in out.values() for t in _tensors(o)]
    return []


def _joined(calls: list[list]) -> list:
    """A module's records of several calls (micro-batches) joined along dim 0."""
    if len(calls) == 1:
        return calls[0]
    out = []
    for parts in zip(*calls):
        if all(p is None for p in parts):  # an input that takes no gradient
            out.append(None)
            continue
        if any(p is None for p in parts) or len({p.shape[1:] for p in parts}) != 1:
            return [t for c in calls for t in c]  # not one batch in pieces: call by call
        out.append(torch.cat(parts))
    return out


def _error(mine, theirs, atol, rtol):
    """(max abs, max rel, exceeds, ratio) over paired tensors, or None when shapes
    differ; ratio: the least-squares factor of the worst tensor (see Finding)."""
    pairs = [(a, b) for a, b in zip(mine, theirs) if a is not None and b is not None]
    if len(mine) != len(theirs):
        return None
    if not pairs:  # no input that takes a gradient (token ids): nothing to compare
        return 0.0, 0.0, False, 1.0
    worst_abs, worst_rel, exceeds, ratio = 0.0, 0.0, False, 1.0
    for a, b in pairs:
        if a.shape != b.shape:
            return None
        a, b = a.float(), b.float().to(a.device)
        diff = (a - b).abs()
        if diff.numel() == 0:
            continue
        bad = ~(diff <= atol + rtol * b.abs())  # NaN counts as bad
        top = float(diff.max()) if torch.isfinite(diff).all() else math.inf
        scale = max(float(b.abs().max()), 1e-30)
        if top >= worst_abs:
            norm = float((b * b).sum())
            ratio = float((a * b).sum()) / norm if norm > 0 else 1.0
        worst_abs, worst_rel = max(worst_abs, top), max(worst_rel, top / scale)
        exceeds = exceeds or bool(bad.any())
    return worst_abs, worst_rel, exceeds, ratio


def _data_rows(t: torch.Tensor) -> torch.Tensor:
    """This data-parallel rank's rows of a global-batch tensor (dim 0)."""
    topo = get_context().topology
    size, rank = topo.data_size, topo.data_rank
    if size == 1 or t.dim() == 0 or t.shape[0] % size:
        return t
    return t.chunk(size, 0)[rank]


def _rows_like(theirs: torch.Tensor, mine, local_rows) -> torch.Tensor:
    """The reference's tensor as this rank holds it: whole when the shapes already agree
    (a position embedding, a replicated activation), else its `local_rows`."""
    if mine is not None and theirs.shape == mine.shape:
        return theirs
    return local_rows(theirs)


def _default_step(model, batch, loss_fn):
    *inputs, target = batch
    loss_fn(model(*inputs), target).backward()


def _as_tuple(batch) -> tuple:
    return tuple(batch) if isinstance(batch, (tuple, list)) else (batch,)


def _compare_modules(mine, ref, order, local_rows, scale, atol, rtol, skipped):
    rows = []
    for name, calls in mine.items():
        if name not in ref:
            continue
        calls = _joined(calls)
        theirs = [
            None if t is None else _rows_like(t, m, local_rows) * scale
            for t, m in zip(_joined(ref[name]), calls)
        ]  # scale: 1 for outputs
        got = _error(calls, theirs, atol, rtol)
        if got is None:
            skipped.add(name)
        else:
            rows.append((order[name], name, *got, None))
    return rows


def _plain_parameter(name: str, names: dict[str, str] | None) -> str:
    """A model's parameter name under the reference's module names ("" if unmapped)."""
    if names is None:
        return name
    module, _, param = name.rpartition(".")
    return f"{names[module]}.{param}" if module in names else ""


def _compare_params(model, reference, atol, rtol, names=None):
    # Tied names kept: a pipeline's last stage holds the head's name of the embedding.
    full = dict(reference.named_parameters(remove_duplicate=False))
    order = {n: i for i, n in enumerate(full)}
    rows = []
    for shard in shards(model):
        plain = (_plain_parameter(n, names) for n in shard.names)
        name = next((n for n in plain if n in full), None)
        if name is None or shard.values.numel() == 0:
            continue
        want = full[name].detach()
        if shard.tp is not None:
            want = slice_from_full(want, shard.tp, shard.shape)
        want = want.reshape(-1)[shard.start : shard.stop]
        got = _error([shard.values], [want], atol, rtol)
        if got is not None:
            rows.append((order[name], name.rpartition(".")[0], *got, name))
    return rows


def _agree(step: int, local: dict) -> StepReport:
    """Every rank's rows gathered; the first exceeding by order, then lowest rank."""
    everyone = C.all_gather_object(local)
    report = StepReport(step)
    for d in DIRECTIONS:
        errors: dict[int, tuple[str, float]] = {}
        best = None
        for rank, rows in enumerate(everyone):
            for order, module, max_abs, max_rel, exceeds, ratio, tensor in rows[d]:
                key = (order, module if tensor is None else tensor)
                errors[key] = max(errors.get(key, 0.0), max_abs)
                if exceeds and (best is None or (order, rank) < best[:2]):
                    best = (order, rank, module, max_abs, max_rel, tensor, ratio)
        report.errors[d] = {name: e for (_, name), e in sorted(errors.items())}
        if best is not None:
            order, rank, module, max_abs, max_rel, tensor, ratio = best
            default = "output" if d == "forward" else "input grad"
            finding = Finding(
                step, d, module, rank, max_abs, max_rel, tensor or default, round(ratio, 6)
            )
            setattr(report, d, finding)
    return report


def locate_divergence(
    model: nn.Module,
    reference: nn.Module,
    batches,
    loss_fn,
    optimizer,
    reference_optimizer,
    *,
    steps: int | None = None,
    forward_backward=None,
    local_rows=None,
    grad_scale: float | None = None,
    atol: float = 1e-5,
    rtol: float = 1e-4,
) -> DivergenceReport:
    """Trains `model` and its plain twin `reference` side by side and names, per step,
    where they first differ (see the module docstring).

    Args:
        model: the parallel model, as this rank holds it.
        reference: the same model, plain and whole, with the same starting weights
            (every rank builds it from the same seed).
        batches: global batches, cycled; each a tuple `(*inputs, target)` of tensors
            whose dim 0 is the batch (a lone tensor is a one-element tuple).
        loss_fn: `loss_fn(output, target)` -> the MEAN loss over the rows given.
        optimizer, reference_optimizer: their `step()` and `zero_grad()` are called
            after each backward (an OptimManager is fine for the model).
        steps: how many steps (default: one per batch).
        forward_backward: `forward_backward(model, local_batch)` runs this rank's
            forward and backward (a pipeline schedule); default
            `loss_fn(model(*inputs), target).backward()` on `local_rows` of the batch.
        local_rows: `local_rows(tensor)` -> this rank's part of a global-batch tensor;
            default: its data-parallel rows (dim 0 split over `data_size`). Applied to
            the batch and to the reference's outputs and gradients.
        grad_scale: what the reference's activation gradients are multiplied by
            before comparing; default `data_size` (a mean loss over this rank's rows
            weighs each row `data_size` times as much as the global mean does).
        atol, rtol: an element differs when |a - b| > atol + rtol * |b|.

    Returns a DivergenceReport, the same on every rank.

    Collective: every rank of the world calls this with the same batches.
    """
    batches = [_as_tuple(b) for b in batches]
    if not batches:
        raise ValueError("locate_divergence: batches is empty; pass at least one global batch")
    steps = len(batches) if steps is None else steps
    local_rows = local_rows or _data_rows
    step_fn = forward_backward or (lambda m, b: _default_step(m, b, loss_fn))

    def train(step):
        batch = batches[step % len(batches)]
        _default_step(reference, batch, loss_fn)
        step_fn(model, tuple(local_rows(t) for t in batch))

    def update():
        optimizer.step(), reference_optimizer.step()
        optimizer.zero_grad(), reference_optimizer.zero_grad()

    return locate_steps(
        model,
        reference,
        steps,
        train,
        update,
        local_rows=local_rows,
        grad_scale=grad_scale,
        atol=atol,
        rtol=rtol,
    )


def locate_steps(
    model: nn.Module,
    reference: nn.Module,
    steps: int,
    train,
    update,
    *,
    names: dict[str, str] | None = None,
    local_rows=None,
    grad_scale: float | None = None,
    atol: float = 1e-5,
    rtol: float = 1e-4,
) -> DivergenceReport:
    """`locate_divergence`'s loop around any training step (the runtime's `compare(...,
    per_layer=True)` drives its backends through it).

    Args:
        model, reference: as for `locate_divergence`.
        steps: how many steps.
        train: `train(step)` runs both models' forward and backward of step `step`.
        update: `update()` steps both optimizers and drops both gradients.
        names: the model's module name -> the reference's name of the same module
            (a pipeline stage's "1.attn" -> "layers.0.attn"); modules it leaves out are
            not compared. Default: the names are the same.
        local_rows, grad_scale, atol, rtol: as for `locate_divergence`.

    Returns a DivergenceReport, the same on every rank.

    Collective: every rank of the world calls this.
    """
    if steps < 1:
        raise ValueError(f"locate_divergence: steps={steps} must be >= 1")
    local_rows = local_rows or _data_rows
    scale = get_context().topology.data_size if grad_scale is None else grad_scale
    mine, theirs = _Recorder(model, names), _Recorder(reference)
    skipped: set[str] = set()
    reports = []

    def compare(records, other, order, scale):
        return _compare_modules(records, other, order, local_rows, scale, atol, rtol, skipped)

    with warnings.catch_warnings():
        # Modules fed token ids have no input gradient: torch warns, the record is empty.
        warnings.filterwarnings("ignore", "Full backward hook is firing")
        try:
            for step in range(steps):
                mine.clear(), theirs.clear()
                train(step)
                local = {
                    "forward": compare(mine.outputs, theirs.outputs, _Order(theirs, "outputs"), 1),
                    "backward": compare(mine.grads, theirs.grads, _Order(theirs, "grads"), scale),
                }
                update()
                local["params"] = _compare_params(model, reference, atol, rtol, names)
                reports.append(_agree(step, local))
        finally:
            mine.remove(), theirs.remove()
    return DivergenceReport(reports, sorted(skipped), atol, rtol)


class _Order(dict):
    """Module name -> its position in the reference's run (dicts keep insertion order,
    and the recorder inserts a module when it first runs)."""

    def __init__(self, recorder: _Recorder, which: str):
        super().__init__((name, i) for i, name in enumerate(getattr(recorder, which)))
