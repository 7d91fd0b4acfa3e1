"""Rank functions for test_compare_per_layer.py, and the model package "gpt_scaled_mlp":
nbtrain's GPT whose layers.1.mlp output is multiplied by 1.5 on global rank 1 in the
second forward it runs (step 1 with one micro-batch per step), an injected bug that
`compare(..., per_layer=True)` must name."""

from nbtrain.models.builtin_gpt import (  # noqa: F401 (the package's protocol functions)
    hf_names,
    load_hf_weights,
    make_config,
    make_forward_step,
    pp_stages,
    tp_plan,
)

STEPS = 3
BUGGY_RANK, BUGGY_STEP, BUGGY_MODULE = 1, 1, "layers.1.mlp"
LAYOUTS = {"dp": {}, "tp": {"tp_size": 2}, "pp": {"pipe_size": 2}}


class _ScaleOnce:
    """A forward hook multiplying the output by 1.5 on BUGGY_RANK in its call
    BUGGY_STEP (0-based)."""

    def __init__(self):
        self.calls = 0

    def __call__(self, module, args, output):
        import torch.distributed as dist

        call, self.calls = self.calls, self.calls + 1
        if call == BUGGY_STEP and dist.get_rank() == BUGGY_RANK:
            return output * 1.5
        return None


def build_model(config, parallel=None):
    from nbtrain.models.gpt import GPT

    model = GPT(config)
    model.get_submodule(BUGGY_MODULE).register_forward_hook(_ScaleOnce())
    return model


def _summary(rows, report):
    def one(f):
        return None if f is None else (f.step, f.direction, f.module, f.rank, f.tensor)

    return {
        "losses": [(r["loss_a"], r["loss_b"]) for r in rows],
        "diverged": report.diverged,
        "first": one(report.first()),
        "steps": [
            [one(getattr(s, d)) for d in ("forward", "backward", "params")] for s in report.steps
        ],
        "skipped": report.skipped,
        "compared": {d: sorted(report.steps[0].errors[d]) for d in ("forward", "backward")},
        "params": len(report.steps[0].errors["params"]),
        "table": report.table(),
    }


def per_layer():
    """compare(nbtrain layout, reference, per_layer=True) for the tiny GPT at each of
    LAYOUTS, correct and with "gpt_scaled_mlp" as the layout's model:
    {(layout, case): summary}."""
    import sys

    from support.runtime_cases import batches, configs

    from nbtrain.models import register_model
    from nbtrain.runtime import compare

    register_model("gpt_scaled_mlp", package=sys.modules[__name__], replace=True)
    out = {}
    for layout, parallel in LAYOUTS.items():
        for case in ("correct", "bug"):
            reference, mine = configs("sgd", **parallel)
            if case == "bug":
                mine.backend_cfg.model_name = "gpt_scaled_mlp"
            rows, report = compare(mine, reference, STEPS, batches(), verbose=False, per_layer=True)
            out[layout, case] = _summary(rows, report)
    return out
