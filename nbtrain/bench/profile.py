"""`nbtrain bench --profile`: where each engine's step time goes.

Rank 0 of each engine's first launch runs its timed steps under torch.profiler and
keeps, per step, the self time of every operator grouped into a few kinds
(matmuls, attention, collectives, copies, optimizer, other operators), the self time
of Python ranges (custom autograd Functions such as a Block's gather and release,
hooks' record_function ranges: Python work and the waits inside it), and what the
step spends outside any of these. The
profiler's own cost slows those launches, so their step times stay out of the main
table; the profile is read side by side, engine against engine.
"""

from __future__ import annotations

import contextlib

import torch

TOP = 8  # operators listed per engine

# First match wins; matched against the profiler's operator name.
KINDS = (
    (
        "collectives",
        (
            "gloo",
            "nccl",
            "c10d",
            "all_gather",
            "reduce_scatter",
            "allreduce",
            "all_reduce",
            "alltoall",
            "all_to_all",
            "broadcast",
            "send",
            "recv",
        ),
    ),
    ("optimizer", ("_foreach", "adam", "Optimizer.")),
    ("attention", ("scaled_dot_product", "flash", "_efficient_attention", "softmax")),
    (
        "matmul",
        ("aten::mm", "aten::addmm", "aten::bmm", "aten::matmul", "aten::linear", "aten::baddbmm"),
    ),
    (
        "copies",
        (
            "aten::copy_",
            "aten::cat",
            "aten::clone",
            "aten::to",
            "aten::_to_copy",
            "aten::contiguous",
            "aten::zero_",
            "aten::fill_",
            "aten::empty",
            "aten::resize_",
            "aten::split_with_sizes",
        ),
    ),
)
ORDER = (
    "matmul",
    "attention",
    "optimizer",
    "collectives",
    "copies",
    "other ops",
    "Python ranges",
    "outside ops",
)


def kind_of(name: str) -> str:
    for kind, needles in KINDS:
        if any(n in name for n in needles):
            return kind
    if not name.startswith(("aten::", "prim::", "autograd::", "cuda", "cudnn")):
        return "Python ranges"  # custom autograd Functions, hooks' record_function ranges
    return "other ops"


class StepProfile:
    """Operator self times over the steps profiled (each step profiled on its own, so
    the barrier and the loss reduction between steps stay out)."""

    def __init__(self):
        self.self_us: dict[str, float] = {}
        self.calls: dict[str, int] = {}
        self.device_us = 0.0
        self.wall_s = 0.0
        self.steps = 0

    @contextlib.contextmanager
    def step(self):
        """Profiles the block as one step; the caller times it and calls `add_wall`."""
        from torch.profiler import ProfilerActivity, profile

        activities = [ProfilerActivity.CPU]
        if torch.cuda.is_available():
            activities.append(ProfilerActivity.CUDA)
        with profile(activities=activities) as prof:
            yield
        for e in prof.key_averages():
            self.self_us[e.key] = self.self_us.get(e.key, 0.0) + e.self_cpu_time_total
            self.calls[e.key] = self.calls.get(e.key, 0) + e.count
            self.device_us += getattr(e, "self_device_time_total", 0)
        self.steps += 1

    def add_wall(self, seconds: float) -> None:
        self.wall_s += seconds

    def summary(self) -> dict:
        """Per step, in ms: each kind's operator self time, the top operators, and the
        time outside operators (wall time less every operator's self time on the host;
        on a GPU the device kernels' time is listed apart). record_function ranges
        (Optimizer.step#..., autograd's nodes) count their own self time."""
        n = max(self.steps, 1)
        self_ms = {k: us / 1e3 / n for k, us in self.self_us.items()}
        kinds = dict.fromkeys(ORDER, 0.0)
        for name, ms in self_ms.items():
            kinds[kind_of(name)] += ms
        step_ms = self.wall_s * 1e3 / n
        kinds["outside ops"] = max(step_ms - sum(self_ms.values()), 0.0)
        top = sorted(self_ms.items(), key=lambda kv: -kv[1])[:TOP]
        return {
            "step_ms": step_ms,
            "kinds_ms": kinds,
            "device_ms": self.device_us / 1e3 / n,
            "top": [(name, ms, self.calls[name] / n) for name, ms in top],
        }


def table(profiles: dict[str, dict]) -> str:
    """Kinds by engine, then each engine's top operators."""
    engines = list(profiles)
    lines = [
        "where the time goes (rank 0, ms per step under the profiler):",
        "",
        "| kind | " + " | ".join(engines) + " |",
        "|------|" + "|".join("-" * (len(e) + 2) for e in engines) + "|",
    ]
    for kind in ORDER:
        lines.append(
            f"| {kind} | "
            + " | ".join(f"{profiles[e]['kinds_ms'][kind]:.1f}" for e in engines)
            + " |"
        )
    lines.append(
        "| step (wall) | " + " | ".join(f"{profiles[e]['step_ms']:.1f}" for e in engines) + " |"
    )
    if any(p["device_ms"] for p in profiles.values()):
        lines.append(
            "| device kernels | "
            + " | ".join(f"{profiles[e]['device_ms']:.1f}" for e in engines)
            + " |"
        )
    for e in engines:
        lines += ["", f"{e}: top operators by self time (ms/step, calls/step)"]
        lines += [f"  {ms:7.2f}  {n:6.1f}  {name}" for name, ms, n in profiles[e]["top"]]
    return "\n".join(lines)
