"""Statistics of a sharded model's parameters and of chosen activations (BMTrain's bmt.inspect).

    print(format_summary(inspect_model(model, "layers.0.*")))
    with inspect_tensor() as inspector:
        loss = model.loss(x, y)         # the model calls record_tensor(h, "hidden")
        loss.backward()
    print(format_summary(inspector.get_summary()))

Every statistic describes the whole tensor, never one rank's shard, and is reduced
rather than gathered: each rank takes its own real (unpadded) elements in float64
and three all-reduces combine them: [count, sum], max (with -min), then the sum of
squared deviations from the global mean (a two-pass variance). `std` is unbiased,
as `torch.std`. Every rank gets the same numbers.

Collective (every rank calls it at the same point, with the same arguments):
`inspect_model`; leaving an `inspect_tensor` block without an exception; the
inspector's `summary()` / `get_summary()` / iteration if a tensor was recorded or
a gradient arrived since the last summary (else they return the list already
made). `record_tensor` and `format_summary` are local.

What one rank holds and did, all local (no communication):

    parameter_bytes(model)          # {"full", "resident", "gathered"} bytes on this rank
    with track_gathered(model) as g:
        model.loss(x, y).backward()
    g.peak_blocks, g.peak_bytes     # most blocks (and their bytes) gathered at once
    last_step()                     # the last finished step: time, overlap, timeline
"""

from __future__ import annotations

import copy
import fnmatch
import math
import threading

import torch
from torch import nn
from typing_extensions import Self

from .comm import collectives as C
from .comm import events
from .comm.context import get_context
from .zero import ShardKind, flat_buffers, shards

__all__ = [
    "GatherTracker",
    "format_summary",
    "inspect_model",
    "inspect_tensor",
    "last_step",
    "parameter_bytes",
    "record_tensor",
    "track_gathered",
]

_STATS = ("mean", "std", "max", "min")


def _reduce_stats(parts: list[torch.Tensor | None]) -> list[dict | None]:
    """Statistics of the union over ranks of each item's local elements. Collective.

    Args:
        parts: per item, this rank's elements (any shape and dtype), or None for
            none. Every rank passes the same number of items. Each is copied to
            float64 one at a time, never all at once.

    Returns:
        Per item {"count", "mean", "std", "max", "min"}, or None if no rank has any.
    """
    if not parts:
        return []
    device = get_context().device
    parts = [p.detach().reshape(-1) if p is not None and p.numel() else None for p in parts]
    sums = torch.zeros(len(parts), 2, dtype=torch.float64, device=device)
    extremes = torch.full((len(parts), 2), -math.inf, dtype=torch.float64, device=device)
    for i, p in enumerate(parts):
        if p is not None:
            sums[i, 0], sums[i, 1] = p.numel(), p.sum(dtype=torch.float64)
            extremes[i, 0], extremes[i, 1] = p.max(), -p.min()
    C.all_reduce(sums, op="sum", label="inspect.sum")
    C.all_reduce(extremes, op="max", label="inspect.max")
    means = sums[:, 1] / sums[:, 0]
    squares = torch.zeros(len(parts), dtype=torch.float64, device=device)
    for i, p in enumerate(parts):  # two passes: no cancellation in sum(x^2) - n mean^2
        if p is not None:
            squares[i] = (p.to(device, torch.float64) - means[i]).square().sum()
    C.all_reduce(squares, op="sum", label="inspect.var")
    out = []
    for (count, _), mean, sq, (mx, neg_mn) in zip(
        sums.tolist(), means.tolist(), squares.tolist(), extremes.tolist()
    ):
        count = int(count)
        std = math.sqrt(sq / (count - 1)) if count > 1 else math.nan  # as torch.std
        out.append(
            {"count": count, "mean": mean, "std": std, "max": mx, "min": -neg_mn} if count else None
        )
    return out


def _summaries(items: list[tuple]) -> tuple[list[dict], list[int]]:
    """(name, shape, local values, local grad) -> summary dicts and the element
    count of each (over all ranks). Collective."""
    stats = _reduce_stats([v for _, _, v, _ in items] + [g for _, _, _, g in items])
    out, counts = [], []
    for (name, shape, _, _), value, grad in zip(items, stats, stats[len(items) :]):
        entry = {"name": name, "shape": shape}
        entry.update((k, value[k] if value else math.nan) for k in _STATS)
        if grad is not None:
            entry.update(("grad_" + k, grad[k]) for k in _STATS)
        out.append(entry)
        counts.append(value["count"] if value else 0)
    return out, counts


def _model_params(model: nn.Module) -> list[tuple]:
    """(names, full shape, local values, local grad) per distinct parameter: each
    element counted on one rank (a replicated parameter: rank 0's copy)."""
    rank = get_context().rank
    out = []
    for shard in shards(model):
        values, grad = shard.values, shard.grad
        if shard.kind is ShardKind.REPLICATED and rank != 0:
            values, grad = values[:0], None if grad is None else grad[:0]
        out.append((list(shard.names), shard.shape, values, grad))
    return out


def inspect_model(model: nn.Module, param_name: str = "*", prefix: str = "") -> list[dict]:
    """Statistics of every parameter whose name matches `param_name`. Collective.

    Args:
        model: a plain or sharded model (Blocks, DistributedParameters, wrap()).
        param_name: an fnmatch pattern over the plain model's names, as in
            `model.state_dict()`, e.g. "layers.0.*".
        prefix: put before every name, both to match and in the result (BMTrain's
            argument: inspecting a submodule under its name in the whole model).

    Returns:
        One dict per distinct parameter, in the model's order: name (its first
        name matching the pattern; a tied parameter appears once), shape (full),
        mean, std, max, min of the full tensor and, when it has a gradient,
        grad_mean, grad_std, grad_max, grad_min of the full gradient. BMTrain's
        dicts have grad_mean and grad_std 0.0 for a parameter without gradient, and
        no grad_max/grad_min; the values are the same otherwise.
    """
    items = []
    for names, shape, values, grad in _model_params(model):
        names = [prefix + n for n in names]
        name = next((n for n in names if fnmatch.fnmatchcase(n, param_name)), None)
        if name is not None:
            items.append((name, shape, values, grad))
    return _summaries(items)[0]


class TensorInspector:
    """What `inspect_tensor()` yields: the tensors recorded inside its block.

    A recorded tensor's summary describes every rank's tensor concatenated along
    dim 0 (a 0-d tensor: one element per rank); shape is (sum of dim 0, *rest).
    Its grad_* statistics, present when it required grad and a backward reached
    it, describe each rank's gradient of its own loss, concatenated the same way.
    """

    def __init__(self):
        self._records, self._summary, self._stale = [], [], False  # lists of dicts

    def __enter__(self) -> Self:
        _ACTIVE.append(self)
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        _ACTIVE.remove(self)
        if exc_type is None:  # after an error other ranks may never get here
            self.summary()

    def _record(self, x: torch.Tensor, name: str) -> None:
        record = {"name": name, "value": x.detach(), "grad": None}
        if x.requires_grad:

            def keep_grad(grad, record=record):
                record["grad"] = grad.detach()
                self._stale = True

            x.register_hook(keep_grad)
        self._records.append(record)
        self._stale = True

    def summary(self) -> list[dict]:
        """Summary dicts of the recorded tensors, in recording order.

        Collective when something was recorded or a gradient arrived since the
        last summary: every rank must have recorded the same tensors in order.
        """
        if self._stale:
            n = len(self._records)
            count = torch.tensor([n, -n], device=get_context().device)
            C.all_reduce(count, op="max", label="inspect.count")
            if count.tolist() != [n, -n]:  # every rank raises
                raise RuntimeError(
                    f"inspect_tensor: ranks recorded {-int(count[1])} to "
                    f"{int(count[0])} tensors; each must record the same ones"
                )
            items = [
                (r["name"], tuple(r["value"].shape), r["value"], r["grad"]) for r in self._records
            ]
            self._summary, counts = _summaries(items)
            for entry, total in zip(self._summary, counts):  # shape after concatenation
                shape = entry["shape"] or (1,)  # 0-d: one element per rank
                rest = math.prod(shape[1:])
                entry["shape"] = (total // rest if rest else shape[0], *shape[1:])
            self._stale = False
        return self._summary

    get_summary = summary  # BMTrain's name

    def get_tensor(
        self, name: str, group: str | None = None, index: int | None = None
    ) -> torch.Tensor | None:
        """A recorded tensor (detached) by the name and group it was recorded with:
        the first so recorded, or with `index` the index-th (from 0). None if there
        is none. Local."""
        full = f"{group}.{name}" if group is not None else name
        found = [r["value"] for r in self._records if r["name"] == full]
        position = 0 if index is None else index
        return found[position] if position < len(found) else None

    def __iter__(self):
        return iter(self.summary())


_ACTIVE: list[TensorInspector] = []


def inspect_tensor() -> TensorInspector:
    """A context manager; `record_tensor` calls inside it are summarised on exit."""
    return TensorInspector()


def record_tensor(x: torch.Tensor, name: str, group: str | None = None) -> torch.Tensor:
    """Records `x` (any tensor in forward) in every open `inspect_tensor` block. Local.

    Outside a block, and while backward recomputes a checkpointed forward, it
    records nothing. The tensor is read when the summary is made, not copied now.
    Returns `x` unchanged. With `group` the summary names it "group.name".
    BMTrain numbers the records of each name ("0.name", "1.name", ...); here each
    record keeps its name, one summary row per record in recording order.
    """
    if isinstance(x, nn.Parameter):
        raise TypeError(
            "record_tensor: a Parameter cannot be recorded; use inspect_model for parameters"
        )
    if group is not None:
        name = f"{group}.{name}"
    task = getattr(torch._C, "_current_graph_task_id", lambda: -1)
    if _ACTIVE and task() == -1:  # -1: not inside a backward pass
        for inspector in _ACTIVE:
            inspector._record(x, name)
    return x


def _cell(value, width: int) -> str:
    text = f"{value:.4f}" if isinstance(value, float) else ("" if value is None else str(value))
    return f" {text[: width - 1]}".ljust(width)


def format_summary(summary: list[dict]) -> str:
    """A fixed-width table of summary dicts: a header line, then one row each, as
    BMTrain prints it.

    Columns in BMTrain's order and widths: name, shape, max, min, std, mean, then
    grad_std and grad_mean when any row has them (nbtrain's grad_max and grad_min stay
    in the dicts). Numbers are printed as BMTrain's, 0.1234 (4 decimals); a value
    longer than its column is cut, as BMTrain's is; a missing or None value leaves
    its cell empty. Local.
    """
    columns = ["max", "min", "std", "mean"]
    columns += [c for c in ("grad_std", "grad_mean") if any(s.get(c) is not None for s in summary)]
    name_w = max([len("name")] + [len(s["name"]) for s in summary]) + 4
    widths = [name_w, 20] + [10] * len(columns)
    lines = ["".join(_cell(c, w) for c, w in zip(["name", "shape", *columns], widths))]
    for s in summary:
        row = [s["name"], tuple(s["shape"])] + [s.get(c) for c in columns]
        lines.append("".join(_cell(v, w) for v, w in zip(row, widths)))
    return "\n".join(lines)


# -- what one rank holds and did (local) -----------------------------------------


def parameter_bytes(model: nn.Module) -> dict[str, int]:
    """The bytes of `model`'s parameters, as this rank holds them now. Local.

    Args:
        model: a plain or sharded model (Blocks, DistributedParameters, wrap()).

    Returns:
        full: the whole model's parameters, unsharded and unpadded (a tied
            parameter counted once): what one process would hold.
        resident: what this rank stores between steps: its shard of every
            Block's flat buffers and of every DistributedParameter, and the
            whole of each plain (replicated) parameter. About full / world size
            for a fully sharded model (shards are padded to a multiple of it).
        gathered: the Block buffers gathered on this rank right now (0 between
            steps; inside forward and backward, the blocks in use: at most two
            at ZeRO-3, every block from forward to backward at ZeRO-2).
            DistributedParameters gathered for the root's forward are not counted.
    """
    full = resident = gathered = 0
    seen: set[int] = set()
    for buffer in flat_buffers(model):
        size = buffer.shard.element_size()
        full += buffer.numel * size
        resident += buffer.shard.numel() * size
        gathered += buffer.gathered_nbytes
        seen.add(id(buffer.shard))
    numels = {id(s.param): s.numel for s in shards(model) if s.param is not None}
    for param in model.parameters():
        if id(param) in seen:
            continue
        seen.add(id(param))
        size = param.element_size()
        full += numels.get(id(param), param.numel()) * size
        resident += param.numel() * size
    return {"full": full, "resident": resident, "gathered": gathered}


class GatherTracker:
    """What `track_gathered()` yields: the most Blocks gathered at once inside it.

    Attributes:
        peak_blocks: most Blocks with a gathered buffer at the same time.
        peak_bytes: most bytes of gathered Block buffers at the same time (only
            Blocks of the model given to `track_gathered` count; 0 without one).
        gathers: how many buffer gathers were issued inside the block.
    """

    def __init__(self, model: nn.Module | None = None):
        self._sizes = {}
        if model is not None:
            for buffer in flat_buffers(model):
                self._sizes[buffer.label] = buffer.padded_numel * buffer.shard.element_size()
        self._live: dict[str, set[str]] = {}
        self._bytes = 0
        self._lock = threading.Lock()
        self.peak_blocks = self.peak_bytes = self.gathers = 0

    def __call__(self, event: dict) -> None:  # an events subscriber
        kind = event["type"]
        if kind not in ("gather", "release"):
            return
        label = event["label"]
        block = label.rpartition(".")[0]
        with self._lock:
            groups = self._live.setdefault(block, set())
            self.gathers += kind == "gather"
            if kind == "gather" and label not in groups:
                groups.add(label)
                self._bytes += self._sizes.get(label, 0)
            elif kind == "release" and label in groups:
                groups.discard(label)
                self._bytes -= self._sizes.get(label, 0)
            if not groups:
                del self._live[block]
            self.peak_blocks = max(self.peak_blocks, len(self._live))
            self.peak_bytes = max(self.peak_bytes, self._bytes)

    def __enter__(self) -> Self:
        events.subscribe(self)
        if not events.active():
            events.unsubscribe(self)
            raise RuntimeError(
                "track_gathered: engine events are switched off on this rank "
                "(nbtrain.telemetry.set_enabled(False)); turn them on first"
            )
        return self

    def __exit__(self, *exc) -> None:
        events.unsubscribe(self)


def track_gathered(model: nn.Module | None = None) -> GatherTracker:
    """A context manager counting how many Blocks are gathered at once inside it. Local.

    It reads the `gather` and `release` events the Blocks publish (a gather is
    counted when issued, so a prefetch counts). With `model`, `peak_bytes` also
    gives the size of those buffers.

        with nbt.inspect.track_gathered(model) as gathered:
            model.loss(x, y).backward()
        gathered.peak_blocks    # 2 at ZeRO-3 with prefetch, every block at ZeRO-2
    """
    return GatherTracker(model)


def last_step() -> dict | None:
    """The last finished training step on this rank (a copy), or None before the first.

    A step ends with `OptimManager.step()` or `nbtrain.telemetry.next_step()`.
    Keys: step, duration_s, overlap (share of communication time hidden behind
    compute, None without communication), comm_s, compute_s, comm_bytes, and the
    timeline, in seconds since the step began: compute as [start, end, block
    label, phase] and comm as [start, end, kind, bytes].
    """
    from . import telemetry

    return copy.deepcopy(telemetry.summary()["last_step"])
