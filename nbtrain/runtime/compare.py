"""`compare(cfg_a, cfg_b, steps, data)`: two runtimes trained on the same batches, step by
step, loss and gradient norm side by side: how a parallel layout proves itself
against the reference.

    rows = compare(RuntimeConfig(backend="reference", backend_cfg=nb),
                   RuntimeConfig(backend="nbtrain", backend_cfg=nb_tp2), steps=10,
                   data=[batch0, batch1])
    # [{"step": 0, "loss_a": ..., "loss_b": ..., "grad_norm_a": ..., "grad_norm_b": ...}, ...]

Runtime a runs all its steps first, then runtime b, so two "nbtrain" layouts that need
different process groups can be compared too.

    rows, report = compare(cfg, reference_cfg, steps=3, data=[batch], per_layer=True)
    print(report.table())   # per step: the first module off in forward, backward, params

With `per_layer=True` the two train step by step side by side (per_layer.py), and
`nbtrain.debug`'s locator names the first module of `cfg_a` that leaves the reference
`cfg_b` (docs/debugging.md).
"""

from __future__ import annotations

from .config import RuntimeConfig
from .contracts import PackedBatch
from .create import create_runtime


def train_steps(cfg: RuntimeConfig, steps: int, data: list[PackedBatch]) -> list[tuple]:
    """(loss, grad_norm, update_successful, num_zeros) of `steps` training steps of a fresh model of
    `cfg` on `data`, cycled. Collective for the "nbtrain" backend."""
    rt = create_runtime(cfg)
    handle = rt.build_model()
    out = []
    with rt.train_mode(handle):
        for step in range(steps):
            rt.zero_grad(handle)
            result = rt.forward_backward(handle, data[step % len(data)])
            ok, norm, zeros = rt.optimizer_step(handle)
            rt.lr_scheduler_step(handle)
            out.append((result.metrics["loss"], norm, ok, zeros))
    return out


def max_deviation(rows: list[dict]) -> dict:
    """The largest |loss_a - loss_b| and |grad_norm_a - grad_norm_b| over `rows`, with
    the steps where they occur."""

    def worst(key):
        diffs = [(abs(r[f"{key}_a"] - r[f"{key}_b"]), r["step"]) for r in rows]
        return max(diffs) if diffs else (0.0, None)

    (loss, loss_step), (norm, norm_step) = worst("loss"), worst("grad_norm")
    return {"loss": loss, "loss_step": loss_step, "grad_norm": norm, "grad_norm_step": norm_step}


def format_table(rows: list[dict], names: tuple[str, str] = ("a", "b")) -> str:
    """The rows as a text table, then the largest deviations."""
    a, b = names
    lines = [
        f"{'step':>4}  {'loss ' + a:>14}  {'loss ' + b:>14}  {'|diff|':>9}  "
        f"{'grad_norm ' + a:>16}  {'grad_norm ' + b:>16}  {'|diff|':>9}"
    ]
    for r in rows:
        lines.append(
            f"{r['step']:>4}  {r['loss_a']:>14.8f}  {r['loss_b']:>14.8f}  "
            f"{abs(r['loss_a'] - r['loss_b']):>9.2e}  {r['grad_norm_a']:>16.8f}  "
            f"{r['grad_norm_b']:>16.8f}  {abs(r['grad_norm_a'] - r['grad_norm_b']):>9.2e}"
        )
    dev = max_deviation(rows)
    lines.append(
        f"largest deviation: loss {dev['loss']:.3e} (step {dev['loss_step']}), "
        f"grad norm {dev['grad_norm']:.3e} (step {dev['grad_norm_step']})"
    )
    return "\n".join(lines)


def compare(
    cfg_a: RuntimeConfig,
    cfg_b: RuntimeConfig,
    steps: int,
    data: list[PackedBatch],
    verbose: bool = True,
    per_layer: bool = False,
    atol: float = 1e-5,
    rtol: float = 1e-4,
):
    """Trains a fresh model of each config for `steps` steps on `data` (a list of global
    batches, cycled) and returns one row per step: {"step", "loss_a", "loss_b",
    "grad_norm_a", "grad_norm_b", "num_zeros_a", "num_zeros_b"} (the gradient's zero
    elements), the same on every rank. With `verbose`, rank 0
    prints the table and the largest deviation.

    With `per_layer`, `cfg_b` must be the "reference" backend: both train step by step
    on the same batches and the result is `(rows, report)`, the report a
    `nbtrain.debug.DivergenceReport` naming per step the first module of `cfg_a` whose
    output, input gradient or parameters after the step differ from the reference's
    beyond `atol + rtol * abs(reference)`, with the rank and the max absolute and
    relative error.

    Collective: every rank calls this with the same configs and data.
    """
    if steps < 1:
        raise ValueError(f"compare: steps={steps} must be >= 1")
    data = list(data)
    if not data or not all(isinstance(b, PackedBatch) for b in data):
        raise TypeError("compare: data must be a non-empty list of PackedBatch")
    report = None
    if per_layer:
        from .per_layer import train_per_layer

        first, second, report = train_per_layer(cfg_a, cfg_b, steps, data, atol, rtol)
    else:
        first = train_steps(cfg_a, steps, data)
        second = train_steps(cfg_b, steps, data)
    rows = [
        {
            "step": i,
            "loss_a": la,
            "loss_b": lb,
            "grad_norm_a": na,
            "grad_norm_b": nb,
            "num_zeros_a": za,
            "num_zeros_b": zb,
        }
        for i, ((la, na, _, za), (lb, nb, _, zb)) in enumerate(zip(first, second))
    ]
    if verbose:
        from ..comm.context import get_context

        if get_context().rank == 0:
            print(format_table(rows, (cfg_a.backend, cfg_b.backend)), flush=True)
            if report is not None:
                print(report.table(), flush=True)
    return rows if report is None else (rows, report)
