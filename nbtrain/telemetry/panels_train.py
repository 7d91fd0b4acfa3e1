"""The training-curve panels: step time with the skew between ranks, tokens/s, loss
with user metrics, gradient norm and learning rate (each on its own labelled axis).
The MoE routing metrics are not user metrics here: panels_moe draws them.
"""

from __future__ import annotations

from .panels_base import (
    COMPUTE_COLOR,
    SKEW_COLOR,
    by_step,
    draw_series,
    empty,
    ignore_warm_up,
    lead_rank,
    metric_by_rank,
    skew,
    step_axis,
    step_times,
)
from .panels_moe import is_routing_metric

# Metric names drawn by a panel of their own; any other number is a user metric (the
# MoE layers' "moe.<i>.balance" / "moe.<i>.dropped" go to the routing panel, panels_moe).
OWN_PANEL = frozenset(
    (
        "loss",
        "lr",
        "loss_scale",
        "grad_norm",
        "skipped",
        "step_time_s",
        "tokens",
        "batch_tokens",
        "nonfinite",
    )
)
NONFINITE_COLOR = "red"


def draw_step_time(ax, summaries: dict) -> None:
    times = {r: step_times(s) for r, s in summaries.items()}
    ax.set_title("step time per rank")
    if not any(times.values()):
        return empty(ax, "no finished step yet")
    draw_series(ax, times, scale=1e3)
    ignore_warm_up(ax, times, scale=1e3)
    ax.set_ylabel("ms per step")
    step_axis(ax)
    ratio = skew(times)
    if ratio:
        twin = ax.twinx()
        xs = sorted(ratio)
        twin.plot(
            xs, [ratio[x] for x in xs], ":", color=SKEW_COLOR, lw=1.2, label="slowest / fastest"
        )
        twin.set_ylabel("slowest / fastest rank", color=SKEW_COLOR)
        twin.set_ylim(1.0, 1.15 * max(ratio.values()))
        ax.set_title(f"step time per rank (skew {ratio[xs[-1]]:.2f}x at step {xs[-1]})")
        twin.legend(loc="upper right", fontsize="x-small")
    ax.legend(loc="upper left", fontsize="x-small")


def draw_throughput(ax, summaries: dict) -> None:
    # The user's own count (telemetry.metric(tokens=n)) wins over the wrapped model's.
    tokens = metric_by_rank(summaries, "tokens")
    if not any(any(v.values()) for v in tokens.values()):
        tokens = metric_by_rank(summaries, "batch_tokens")
    per_rank, times_of = {}, {}
    for r, s in summaries.items():
        times = times_of[r] = step_times(s)
        if any(tokens[r].values()):
            per_rank[r] = {x: n / times[x] for x, n in tokens[r].items() if times.get(x)}
        else:
            per_rank[r] = {x: 1.0 / t for x, t in times.items() if t > 0}
    has_tokens = any(any(v.values()) for v in tokens.values())
    unit = "tokens/s" if has_tokens else "steps/s"
    ax.set_title(f"{unit} per rank")
    if not any(per_rank.values()):
        return empty(ax, "no finished step yet")
    draw_series(ax, per_rank)
    ignore_warm_up(ax, per_rank)
    ax.set_ylabel(unit)
    step_axis(ax)
    ax.set_title(f"{unit} per rank ({throughput_total(times_of, tokens, has_tokens)})")
    if not has_tokens:
        ax.text(
            0.5,
            0.02,
            "telemetry.metric(tokens=n) gives tokens/s",
            transform=ax.transAxes,
            ha="center",
            fontsize="x-small",
            color="gray",
        )
    ax.legend(loc="upper left", fontsize="x-small")


def smoothed(values: list, weight: float = 0.8) -> list:
    """Exponential moving average, bias-corrected (the first points are not pulled to 0)."""
    out, acc = [], 0.0
    for i, v in enumerate(values, 1):
        acc = weight * acc + (1 - weight) * v
        out.append(acc / (1 - weight**i))
    return out


def throughput_total(times_of: dict, tokens: dict, has_tokens: bool, window: int = 10) -> str:
    """Over the last `window` steps: tokens/s of all ranks together (each rank's own
    tokens), or the ranks' mean steps/s (they step together: a sum means nothing).
    `times_of`: {rank: {step: seconds}}."""
    rates = []
    for r, times in times_of.items():
        last = sorted(times)[-window:]
        seconds = sum(times[x] for x in last)
        if seconds <= 0:
            continue
        done = sum(tokens[r].get(x, 0) for x in last) if has_tokens else len(last)
        rates.append(done / seconds)
    if not rates:
        return "no finished step yet"
    if has_tokens:
        return f"all ranks: {sum(rates):,.0f} tokens/s"
    return f"mean of ranks: {sum(rates) / len(rates):,.1f} steps/s"


# -- loss, metrics, grad norm, learning rate ------------------------------------------
def user_metrics(summaries: dict) -> list[str]:
    names = {k for s in summaries.values() for m in s.get("metrics", []) for k in m}
    return sorted(n for n in names - OWN_PANEL - {"step"} if not is_routing_metric(n))


def draw_loss(ax, summaries: dict) -> None:
    ax.set_title("loss and metrics")
    loss = metric_by_rank(summaries, "loss")
    extra = user_metrics(summaries)
    if not any(loss.values()) and not extra:
        return empty(ax, "no loss yet")
    draw_series(ax, loss, lw=0.8, alpha=0.5)  # raw, per rank
    mean = {x: sum(v) / len(v) for x, v in by_step(loss).items()}
    if len(mean) > 1:
        xs = sorted(mean)
        ax.plot(xs, smoothed([mean[x] for x in xs]), color="black", lw=1.8, label="mean, smoothed")
    ax.set_ylabel("loss")
    step_axis(ax)
    twin = None
    for i, name in enumerate(extra):
        # A metric's value per step: the median over the ranks that recorded it.
        steps = by_step(metric_by_rank(summaries, name))
        xs = sorted(steps)
        ys = [sorted(steps[x])[(len(steps[x]) - 1) // 2] for x in xs]
        target = ax
        if "loss" not in name:  # accuracy, perplexity, ...: a scale of their own
            twin = twin or ax.twinx()
            target = twin
        target.plot(xs, ys, "o-", ms=3, lw=1, color=f"C{(i + 3) % 10}", label=name)
    if twin is not None:
        twin.set_ylabel(", ".join(n for n in extra if "loss" not in n))
        twin.legend(loc="lower left", fontsize="x-small")
    # nbtrain.debug.detect_nonfinite's origins: the step where a NaN/Inf first appeared.
    for x in sorted({x for v in metric_by_rank(summaries, "nonfinite").values() for x in v}):
        ax.axvline(x, color=NONFINITE_COLOR, ls="--", lw=1.2, label=f"NaN/Inf at step {x}")
    if ax.get_legend_handles_labels()[0]:  # matplotlib warns on a legend with no entry
        ax.legend(loc="upper right", fontsize="x-small")


def draw_grad_norm(ax, summaries: dict) -> None:
    norms = metric_by_rank(summaries, "grad_norm")
    ax.set_title("gradient norm")
    if not any(norms.values()):
        return empty(
            ax,
            "no grad_norm recorded\n(OptimManager.step records it, or\n"
            "telemetry.metric(grad_norm=...))",
        )
    draw_series(ax, norms)
    ax.set_ylabel("grad norm (L2)")
    step_axis(ax)
    ax.legend(loc="upper right", fontsize="x-small")


def draw_lr(ax, summaries: dict) -> None:
    lead = summaries[lead_rank(summaries)] if summaries else {}
    lr = metric_by_rank({0: lead}, "lr")[0] if lead else {}
    scale = metric_by_rank({0: lead}, "loss_scale")[0] if lead else {}
    ax.set_title("learning rate")
    if not lr and not scale:
        return empty(ax, "no lr recorded")
    xs = sorted(lr)
    ax.plot(xs, [lr[x] for x in xs], color=COMPUTE_COLOR, lw=1.4, label="lr")
    ax.set_ylabel("learning rate", color=COMPUTE_COLOR)
    ax.ticklabel_format(axis="y", style="sci", scilimits=(-2, 3))
    step_axis(ax)
    if scale and set(scale.values()) != {1.0}:  # a loss scale of 1 is no scaling
        twin = ax.twinx()
        xs = sorted(scale)
        twin.plot(xs, [scale[x] for x in xs], ":", color=SKEW_COLOR, lw=1.2, label="loss scale")
        twin.set_yscale("log")
        twin.set_ylabel("loss scale", color=SKEW_COLOR)
