"""`compare(cfg_a, cfg_b, steps, data, per_layer=True)`: a runtime layout and the
one-process reference trained side by side on the same batches, with
`nbtrain.debug.locate_steps` naming, per step, the first module whose output, then
whose input gradient, then whose parameters after the step differ (docs/debugging.md).

Names: the "nbtrain" backend trains a pipeline stage at every `pipe_size` (1 included),
whose modules are named by layer position: "1.attn" is the `attn` of layer 1 of the
model protocol's `pp_stages` list. `plain_module_names` pairs them with the plain
model's names ("layers.0.attn") by cutting a plain model, built on the meta device, with
the same `pp_stages` and matching modules by identity. Modules with no plain name (a
stage's own wrapper around the embedding or the head) are not compared; their children
are.
"""

from __future__ import annotations

from .base import Runtime
from .config import ParallelConfig, RuntimeConfig
from .contracts import PackedBatch
from .create import create_runtime


def plain_module_names(rt: Runtime) -> dict[str, str]:
    """The module names of `rt`'s pipeline stage ("1.attn") -> the plain model's
    ("layers.0.attn"), for every module of every stage. Local (nothing is allocated:
    the plain model is built on the meta device)."""
    plain, _ = rt._plain_model("meta", ParallelConfig())
    where = {id(module): name for name, module in plain.named_modules()}
    layers = rt.nb.protocol().pp_stages(plain, rt.nb.parallel.pipe_size)
    out = {}
    for index, layer in enumerate(layers):
        for sub, module in layer.named_modules():
            name = where.get(id(module))
            if name:
                out[f"{index}.{sub}" if sub else str(index)] = name
    return out


def train_per_layer(
    cfg_a: RuntimeConfig,
    cfg_b: RuntimeConfig,
    steps: int,
    data: list[PackedBatch],
    atol: float,
    rtol: float,
):
    """(a's steps, b's steps, report): fresh models of both configs trained step by step
    on `data` (cycled), each step's (loss, grad_norm, update_successful, num_zeros) per
    config, and the DivergenceReport of a's modules against b's.

    Raises:
        ValueError: cfg_b is not the "reference" backend.

    Collective: every rank calls this with the same configs and data.
    """
    from ..debug.locate import locate_steps

    if cfg_b.backend != "reference":
        raise ValueError(
            f"compare(per_layer=True): cfg_b has backend {cfg_b.backend!r}; the layer-by-"
            "layer comparison needs the one-process reference there: pass "
            "RuntimeConfig(backend='reference', backend_cfg=...) as cfg_b"
        )
    rt_a, rt_b = create_runtime(cfg_a), create_runtime(cfg_b)
    model_a = rt_a.build_model()  # first: it makes the process groups of a's layout
    model_b = rt_b.build_model()
    names = plain_module_names(rt_a) if cfg_a.backend == "nbtrain" else None
    runs = ((rt_a, model_a, []), (rt_b, model_b, []))

    def train(step):
        for rt, handle, out in runs:
            out.append([rt.forward_backward(handle, data[step % len(data)]).metrics["loss"]])

    def update():
        for rt, handle, out in runs:
            ok, norm, zeros = rt.optimizer_step(handle)
            rt.lr_scheduler_step(handle)
            rt.zero_grad(handle)
            out[-1] += [norm, ok, zeros]

    with rt_a.train_mode(model_a), rt_b.train_mode(model_b):
        rt_a.zero_grad(model_a), rt_b.zero_grad(model_b)
        report = locate_steps(
            model_a.model, model_b.model, steps, train, update, names=names, atol=atol, rtol=rtol
        )
    return [tuple(s) for s in runs[0][2]], [tuple(s) for s in runs[1][2]], report
