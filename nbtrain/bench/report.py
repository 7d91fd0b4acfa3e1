"""Aggregate per-rank results into runs, theory ratios, a table and JSON."""

from __future__ import annotations

import math
import statistics

BYTES_PER_ELEMENT = 4  # fp32 policy: 4 param + 4 grad + 8 AdamW = 16 bytes/parameter
# Max |loss - reference loss| over all steps. fp32: four engines on identical data agree
# to rounding. bf16: the engines round their bf16 weights and gradients at different
# points (DDP's fp32 average goes back into a bf16 bucket; FSDP2 casts its fp32 shards
# each step), measured at 0.5-2e-4 on the CPU presets.
PARITY_ATOL = {"fp32": 1e-4, "bf16": 1e-2}


def theory(engine: str, param_numel: int, world: int, dtype: str = "fp32") -> dict:
    """ZeRO-paper bytes per rank: model state at rest and wire bytes per step.

    fp32: 4 bytes of parameter, 4 of gradient, 8 of AdamW moments (16 per parameter).
    bf16: the paper's mixed precision, 2 + 2 + 12 (fp32 master and moments), the same
    16; on the wire bf16 gathers and fp32 gradient reductions (every engine here
    reduces in fp32).
    """
    ring = (world - 1) / world
    if dtype == "bf16":
        state = {"zero3": 16 / world, "fsdp2": 16 / world, "zero2": 2 + 14 / world, "ddp": 16}[
            engine
        ] * param_numel
        per_param = {"zero3": 2 + 2 + 4, "fsdp2": 2 + 2 + 4, "zero2": 2 + 4, "ddp": 2 * 4}[engine]
        return {"state_bytes": state, "wire_bytes": per_param * param_numel * ring}
    p_bytes = param_numel * BYTES_PER_ELEMENT
    state = {"zero3": 16 / world, "fsdp2": 16 / world, "zero2": 4 + 12 / world, "ddp": 16}[
        engine
    ] * param_numel
    wire = (3 if engine in ("zero3", "fsdp2") else 2) * p_bytes * ring
    return {"state_bytes": state, "wire_bytes": wire}


def summarize(
    engine: str, rounds: list[list[dict]], world: int, th: dict | None = None, dtype: str = "fp32"
) -> dict:
    """One engine's run from its rounds (each a list of per-rank results), against the
    theory `th` (state_bytes, wire_bytes; default: the ZeRO paper's for `engine` in
    `dtype`)."""
    steps = [t for ranks in rounds for t in ranks[0]["step_s"]]
    round_medians = [statistics.median(ranks[0]["step_s"]) for ranks in rounds]
    first = rounds[0]
    numel = first[0]["param_numel"]
    th = th or theory(engine, numel, world, dtype)
    state = max(r["state"]["total"] for r in first)
    wire = statistics.median(w for ranks in rounds for r in ranks for w in r["wire_bytes"])
    hidden = [h for ranks in rounds for r in ranks for h in r["hidden"] if h is not None]
    return {
        "step_time_s": statistics.median(steps),
        "step_time_round_medians_s": round_medians,
        "peak_mem_bytes": max(r["peak_mem"] for ranks in rounds for r in ranks),
        "baseline_mem_bytes": max(r["baseline_mem"] for ranks in rounds for r in ranks),
        "state_bytes": state,
        "state_breakdown": first[0]["state"],
        "state_theory_bytes": th["state_bytes"],
        "wire_bytes_per_step": wire,
        "wire_theory_bytes": th["wire_bytes"],
        "hidden_comm_pct": 100 * statistics.median(hidden) if hidden else None,
        "losses": first[0]["loss"],
        "param_numel": numel,
        # per round (a fresh launch): the first warm-up step less the timed median, which
        # is the compile time where the model is compiled
        "first_step_extra_s": [
            ranks[0]["warmup_s"][0] - statistics.median(ranks[0]["step_s"])
            for ranks in rounds
            if ranks[0].get("warmup_s")
        ],
    }


def add_parity(runs: dict, reference: str = "ddp", dtype: str = "fp32") -> None:
    """Each run's max |loss - reference loss| over all steps, and whether it agrees
    (within PARITY_ATOL[dtype]; a loss that is not finite never agrees)."""
    ref = runs[reference]["losses"]
    for run in runs.values():
        diffs = [abs(a - b) for a, b in zip(run["losses"], ref)]
        diff = max(diffs) if all(map(math.isfinite, diffs)) else math.inf
        run["reference"] = reference
        run["loss_max_abs_diff_vs_ddp"] = diff
        run["parity"] = diff <= PARITY_ATOL[dtype] and len(run["losses"]) == len(ref)


def _ratio(measured: float, expected: float) -> float:
    # One rank moves no bytes and theory says so too: that is a match, not 0/0.
    if expected == 0:
        return 1.0 if measured == 0 else float("inf")
    return measured / expected


def ratios(runs: dict) -> dict:
    z3 = runs["zero3"]
    return {
        "zero3_step_vs_fsdp2": z3["step_time_s"] / runs["fsdp2"]["step_time_s"],
        "zero3_step_vs_ddp": z3["step_time_s"] / runs["ddp"]["step_time_s"],
        "zero3_state_mem_vs_theory": z3["state_bytes"] / z3["state_theory_bytes"],
        "zero3_bytes_vs_theory": _ratio(z3["wire_bytes_per_step"], z3["wire_theory_bytes"]),
    }


def tp_ratios(runs: dict) -> dict:
    ours, peer = runs["nbtrain_tp"], runs["dtensor_tp"]
    return {
        "tp_step_vs_dtensor": ours["step_time_s"] / peer["step_time_s"],
        "tp_bytes_vs_megatron": _ratio(ours["wire_bytes_per_step"], ours["wire_theory_bytes"]),
        "dtensor_bytes_vs_megatron": _ratio(peer["wire_bytes_per_step"], peer["wire_theory_bytes"]),
        "tp_state_mem_vs_theory": ours["state_bytes"] / ours["state_theory_bytes"],
        "tp_loss_max_abs_diff_vs_dtensor": ours["loss_max_abs_diff_vs_ddp"],
    }


def table(runs: dict, ratio: dict, compile_column: bool = False) -> str:
    """The Markdown table and the ratio lines; `compile_column` adds "compile s": per
    launch, the first warm-up step less the median step (lowest-highest over rounds)."""
    mib = 2**20
    reference = next(iter(runs.values())).get("reference", "ddp").replace("_tp", "")
    head = (
        "engine",
        "step ms",
        "rounds ms",
        "peak MiB",
        "state MiB",
        "state/th",
        "wire MiB",
        "wire/th",
        "hidden %",
        f"loss |d| vs {reference}",
    )
    if compile_column:
        head = head[:3] + ("compile s",) + head[3:]
    rows = [head]
    for name, r in runs.items():
        spread = "-".join(
            f"{1e3 * t:.0f}"
            for t in (min(r["step_time_round_medians_s"]), max(r["step_time_round_medians_s"]))
        )
        hidden = "n/a" if r["hidden_comm_pct"] is None else f"{r['hidden_comm_pct']:.0f}"
        row = (
            name,
            f"{1e3 * r['step_time_s']:.1f}",
            spread,
            f"{r['peak_mem_bytes'] / mib:.0f}",
            f"{r['state_bytes'] / mib:.2f}",
            f"{r['state_bytes'] / r['state_theory_bytes']:.3f}",
            f"{r['wire_bytes_per_step'] / mib:.2f}",
            f"{_ratio(r['wire_bytes_per_step'], r['wire_theory_bytes']):.3f}",
            hidden,
            f"{r['loss_max_abs_diff_vs_ddp']:.1e} {'ok' if r['parity'] else 'DIFFER'}",
        )
        if compile_column:
            extra = r.get("first_step_extra_s") or [float("nan")]
            row = row[:3] + ("-".join(f"{t:.1f}" for t in (min(extra), max(extra))),) + row[3:]
        rows.append(row)
    widths = [max(len(row[i]) for row in rows) for i in range(len(head))]
    lines = ["| " + " | ".join(c.ljust(w) for c, w in zip(row, widths)) + " |" for row in rows]
    lines.insert(1, "|" + "|".join("-" * (w + 2) for w in widths) + "|")
    lines.append("")
    lines += [
        f"{k}: {v:.3f}" if abs(v) >= 1e-3 or v == 0 else f"{k}: {v:.1e}" for k, v in ratio.items()
    ]
    return "\n".join(lines)
