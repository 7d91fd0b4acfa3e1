"""`nbtrain.plan`: each rank's peak memory for a model and a parallel layout, before
training, split into parameters, gradients, optimizer state, activations and
communication buffers; and which layouts fit a device.

    p = nbtrain.plan(RuntimeConfig(...), batch=8, seq=1024, device_memory="80GiB")
    print(p.table())                 # one row per rank role (pipeline stage)
    p.fits                           # every rank's total <= device_memory
    p.publish()                      # the dashboard's memory panel draws it
    nbtrain.plan_layouts(cfg, world_size=8, batch=8, seq=1024, device_memory="80GiB")

Read shape.py (what is read from a model) and estimate.py (the arithmetic). The
accuracy on CPU ranks against the measured peak is in docs/larger-than-device.md.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field, fields

from ..comm.layout import Layout as CommLayout
from .estimate import Layout, RankPlan, rank_plans
from .shape import ModelShape, shape_of

MiB = 1 << 20
_UNITS = {"": 1, "b": 1, "kib": 1 << 10, "mib": MiB, "gib": 1 << 30, "tib": 1 << 40}
_UNITS.update({"kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12})


def parse_bytes(text) -> int:
    """Bytes of "80GiB", "512 MiB", "40GB" or a number of bytes."""
    if isinstance(text, (int, float)):
        return int(text)
    match = re.fullmatch(r"\s*([0-9.]+)\s*([a-zA-Z]*)\s*", str(text))
    if not match or match.group(2).lower() not in _UNITS:
        raise ValueError(
            f"plan: device memory {text!r} is not a size: write it as 80GiB, 512MiB, "
            "40GB or a number of bytes"
        )
    return int(float(match.group(1)) * _UNITS[match.group(2).lower()])


@dataclass
class Plan:
    """The predicted peak of every rank role of one layout (bytes).

    Attributes:
        layout: the layout planned.
        ranks: one RankPlan per role (one per pipeline stage).
        device_memory: the budget checked by `fits` (None: no verdict).
        batch, seq: rows of the global batch and tokens per row.
    """

    layout: Layout
    ranks: list[RankPlan]
    batch: int
    seq: int
    device_memory: int | None = None
    shape: ModelShape | None = field(default=None, repr=False)

    @property
    def peak(self) -> int:
        """The largest rank's total."""
        return max(r.total for r in self.ranks)

    @property
    def fits(self) -> bool | None:
        """Every rank's total within device_memory (None when no budget was given)."""
        return None if self.device_memory is None else self.peak <= self.device_memory

    def table(self) -> str:
        """The breakdown, one row per rank role, in MiB."""
        head = ["role", "params", "grads", "optim", "activ", "comm", "total"]
        lines = [
            f"{self.layout.name()} on {self.layout.world_size} ranks, batch {self.batch} x "
            f"seq {self.seq} (MiB)",
            f"{head[0]:<11}" + "".join(f"{h:>9}" for h in head[1:]),
        ]
        for r in self.ranks:
            terms = (r.parameters, r.gradients, r.optimizer, r.activations, r.communication)
            lines.append(f"{r.role:<11}" + "".join(f"{t / MiB:>9.1f}" for t in (*terms, r.total)))
            if r.host:
                lines.append(f"{'':<11}+ {r.host / MiB:.1f} MiB on the host (offload)")
        if not all(r.gradients_at_peak for r in self.ranks):
            lines.append(
                "grads: made in backward after the peak (one micro-batch), not in the total"
            )
        trace = getattr(self.shape, "trace", None)
        if trace is not None:
            lines.append(
                f"activations traced: one micro-batch of {trace.tokens} tokens on {trace.where}"
            )
        if self.device_memory is not None:
            verdict = "fits" if self.fits else "does NOT fit"
            budget = self.device_memory / MiB
            lines.append(f"peak {self.peak / MiB:.1f} MiB {verdict} in {budget:.0f} MiB")
        return "\n".join(lines)

    def publish(self) -> None:
        """Hands the planned peak to telemetry (metric "memory_planned_bytes"), which the
        dashboard's memory panel draws beside the measured one. Local."""
        from .. import telemetry

        telemetry.metric(memory_planned_bytes=float(self.peak))


def plan(
    source,
    layout=None,
    batch: int = 1,
    seq: int | None = None,
    device_memory=None,
    world_size: int | None = None,
    param_bytes: int = 4,
    **sizes,
) -> Plan:
    """Each rank role's predicted peak memory (bytes) for training `source` at `layout`.

    Args:
        source: a RuntimeConfig or NBConfig of any registered model (its parallel
            layout is the default), a GPTConfig / MoEGPTConfig, a transformers config,
            or a model: nbtrain's, a transformers model, any nn.Module with a list of
            blocks (built on the meta device is enough). Models other than nbtrain's
            GPTs get their activation term from a traced micro-batch (`p.shape.trace`
            says where it ran).
        layout: a Layout, a ParallelConfig or a dict of their fields; `sizes`
            (tp_size=2, offload=True, checkpointing=True, ...) override it.
        batch: rows of the global batch; seq: tokens per row (default the config's
            seq_len).
        device_memory: bytes, or a size such as "80GiB": sets `Plan.fits`.
        world_size: ranks (default: the product of the layout's sizes, dp 1).
        param_bytes: 4 (fp32) or 2 (bf16/fp16 with fp32 master copies).

    Local: reads shapes only, allocates no parameter (a model with real weights is
    traced by one row's forward on this rank).
    """
    shape, parallel = _shape(source, seq)
    return _plan(
        shape, parallel, source, layout, batch, seq, device_memory, world_size, param_bytes, **sizes
    )


def _shape(source, seq):
    """shape_of, traced at the sequence length the plan will use."""
    shape, parallel = shape_of(source, seq)
    if seq is None and shape.trace is not None and shape.seq_len:
        shape, parallel = shape_of(source, shape.seq_len)
    return shape, parallel


def _plan(
    shape, parallel, source, layout, batch, seq, device_memory, world_size, param_bytes, **sizes
) -> Plan:
    chosen = {}
    for given in (parallel, layout):
        if given is None:
            continue
        items = given.items() if isinstance(given, dict) else vars(given).items()
        chosen.update((k, v) for k, v in items if k in {f.name for f in fields(Layout)})
    chosen.update(sizes)
    if world_size is not None:
        chosen["world_size"] = world_size
    elif "world_size" not in chosen:
        chosen["world_size"] = (
            chosen.get("tp_size", 1)
            * chosen.get("pipe_size", 1)
            * max(chosen.get("cp_size", 1), chosen.get("ep_size", 1))
        )
    lay = Layout(**chosen)
    seq = seq or _seq_len(source, shape)
    budget = None if device_memory is None else parse_bytes(device_memory)
    return Plan(lay, rank_plans(shape, lay, batch, seq, param_bytes), batch, seq, budget, shape)


def _seq_len(source, shape: ModelShape) -> int:
    from .shape import _config_of

    if shape.trace is not None:
        if shape.seq_len is None:
            raise ValueError(
                f"plan: {type(source).__name__} does not say its sequence length: give "
                "seq=, the tokens per row"
            )
        return shape.seq_len
    cfg = getattr(source, "cfg", None) or _config_of(source)[0]
    return cfg.seq_len


def candidate_layouts(world_size: int, moe: bool = False, pipe_max: int = 8) -> list[dict]:
    """Layouts over `world_size` ranks, each ZeRO-2 and ZeRO-3: every layout
    nbtrain.comm.layout's `Layout.every` gives (the layouts init_distributed accepts: tp x pp
    dividing the world, cp and, for a MoE model, ep carved from the dp ranks left)."""
    return [
        dict(tp_size=lay.tp_size, pipe_size=lay.pipe_size, zero_level=zero, **_carved(lay))
        for lay in CommLayout.every(world_size, moe=moe, pipe_max=pipe_max)
        for zero in (2, 3)
    ]


def _carved(layout: CommLayout) -> dict:
    return {k: v for k, v in (("cp_size", layout.cp_size), ("ep_size", layout.ep_size)) if v > 1}


def plan_layouts(
    source,
    world_size: int,
    batch: int = 1,
    seq: int | None = None,
    device_memory=None,
    param_bytes: int = 4,
    **fixed,
) -> list[Plan]:
    """Plans of every candidate layout over `world_size` ranks (see candidate_layouts;
    `fixed` fields such as num_micro_batches=4 or offload=True apply to all), smallest
    peak first; with device_memory each says whether it fits. Layouts the batch cannot
    split over are left out. Local."""
    shape, parallel = _shape(source, seq)
    plans = []
    for lay in candidate_layouts(world_size, moe=shape.moe_layers > 0):
        lay = {**lay, **fixed}
        if lay.get("pipe_size", 1) > 1:
            lay.setdefault("num_micro_batches", 2 * lay["pipe_size"])
        dp = world_size // (lay["tp_size"] * lay["pipe_size"]) // lay.get("cp_size", 1)
        if batch % (dp * lay.get("num_micro_batches", 1)):
            continue
        try:
            plans.append(
                _plan(
                    shape, parallel, source, lay, batch, seq, device_memory, world_size, param_bytes
                )
            )
        except ValueError:
            continue  # the model cannot split this way (more stages than layers)
    return sorted(plans, key=lambda p: p.peak)


def layouts_table(plans: list[Plan]) -> str:
    """One line per plan: its layout, peak and verdict."""
    lines = [f"{'layout':<52}{'peak MiB':>10}  fits"]
    for p in plans:
        verdict = "" if p.fits is None else ("yes" if p.fits else "no")
        lines.append(f"{p.layout.name():<52}{p.peak / MiB:>10.1f}  {verdict}")
    return "\n".join(lines)


__all__ = ["plan", "plan_layouts", "Plan", "Layout", "RankPlan", "ModelShape", "parse_bytes"]
