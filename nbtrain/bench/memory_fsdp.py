"""The FSDP2 peer of `nbtrain bench --memory`: the same GPT, ranks and phases, done the
way FSDP2's documentation does it for a model that does not fit whole.

Build: the GPT under `torch.device("meta")`, `fully_shard` on each transformer layer
then the root (engines.fully_shard_gpt, as the speed benchmark shards it),
`to_empty` on the rank's device, then the GPT's own initialisation applied module by
module to the local shards (LayerNorms reset). Train: AdamW, the same steps and
batches as nbtrain's path. Save: torch.distributed.checkpoint (`get_model_state_dict`,
`dcp.save`; each rank writes its own shards). Load: a fresh meta-built FSDP2 GPT,
`to_empty`, `dcp.load` into its state dict and `set_model_state_dict`.

Each phase is measured as nbtrain's are (phase.Phase), in a launch of its own, after
the same warm-up (a tiny model built, saved and loaded once). A phase that raises is
recorded as {"error": ...} with the phases after it, not as a number.
"""

from __future__ import annotations

import math
import warnings

PHASES = ("build", "train", "save", "load")


def _init_gpt(model, cfg) -> None:
    """The GPT's own initialisation (GPT._init per module, the residual projections
    scaled) on a materialised FSDP2 model; LayerNorms back to ones and zeros."""
    import torch
    from torch import nn

    from nbtrain.models.gpt import GPT

    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.LayerNorm):
                m.reset_parameters()
        model.apply(GPT._init)
        for name, p in model.named_parameters():
            if name.endswith(("proj.weight", "mlp.2.weight")):
                nn.init.normal_(p, std=0.02 / math.sqrt(2 * cfg.layers))


def build_fsdp2(cfg, mesh, device, init: bool = True):
    """A GPT built on the meta device, sharded by FSDP2, materialised on `device` and
    (with `init`) initialised. Collective."""
    import torch

    from nbtrain.models.gpt import GPT

    from .engines import fully_shard_gpt

    with torch.device("meta"):
        model = GPT(cfg)
    model = fully_shard_gpt(model, mesh)
    model.to_empty(device=device)
    if init:
        _init_gpt(model, cfg)
    return model


def save_dcp(model, folder: str) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    dcp.save(get_model_state_dict(model), checkpoint_id=folder)


def load_dcp(cfg, mesh, device, folder: str):
    """A fresh meta-built FSDP2 GPT with the checkpoint in `folder` read into its shards."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        set_model_state_dict,
    )

    model = build_fsdp2(cfg, mesh, device, init=False)
    state = get_model_state_dict(model)
    dcp.load(state, checkpoint_id=folder)
    set_model_state_dict(model, state)
    return model


def _checksum(model) -> float:
    """The sum of this rank's shards (to tell a load that read the saved values)."""
    return sum(float(p.detach().to_local().double().sum()) for p in model.parameters())


def _error(exc: BaseException) -> dict:
    return {"error": f"{type(exc).__name__}: {exc}".splitlines()[0][:200]}


def run_rank(spec: dict) -> dict:
    """One rank of the FSDP2 path: build, train, save (DCP), load (DCP)."""
    import torch

    import nbtrain
    from nbtrain.models.gpt import GPTConfig

    from .engines import fsdp2_mesh
    from .phase import Phase, fix_mmap_threshold

    fix_mmap_threshold()
    # On a CPU mesh DTensor's random ops draw from each rank's own generator (no
    # offset-based RNG tracker): the init differs from an unsharded one, the memory not.
    warnings.filterwarnings("ignore", message="DTensor random operators may not have")
    ctx = nbtrain.get_context()
    device = ctx.device
    mesh = fsdp2_mesh()
    tiny = GPTConfig(vocab_size=256, hidden=64, heads=4, layers=2, seq_len=16)
    warm = f"{spec['folder']}/fsdp2-warm"
    save_dcp(build_fsdp2(tiny, mesh, device), warm)  # one-time costs, before measuring
    load_dcp(tiny, mesh, device, warm)
    with Phase(device) as empty:  # FSDP2's baseline: an empty model's build
        build_fsdp2(tiny, mesh, device)
    cfg = GPTConfig(
        vocab_size=256,
        hidden=spec["hidden"],
        heads=spec["heads"],
        layers=spec["layers"],
        seq_len=64,
    )
    out = {"baseline": empty.host, "torch": torch.__version__}
    failed = None
    try:
        with Phase(device) as build:
            model = build_fsdp2(cfg, mesh, device)
        out["build"] = (build.host, build.gpu, build.seconds)
        out["shard"] = sum(p.to_local().numel() * p.element_size() for p in model.parameters())
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        g = torch.Generator().manual_seed(ctx.rank)
        ids = torch.randint(0, 256, (spec["batch"], 64), generator=g).to(device)
        with Phase(device) as train:
            for _ in range(spec["steps"]):
                opt.zero_grad()
                model.loss(ids, ids.roll(-1, dims=1)).backward()
                opt.step()
        out["train"] = (train.host, train.gpu, train.seconds)
    except Exception as exc:  # reported in the table, not hidden
        failed = _error(exc)
    if failed is None:
        folder = f"{spec['folder']}/fsdp2"
        try:
            with Phase(device) as save:
                save_dcp(model, folder)
            out["save"] = (save.host, save.gpu, save.seconds)
            saved = _checksum(model)
            del model, opt
            with Phase(device) as load:
                fresh = load_dcp(cfg, mesh, device, folder)
            out["load"] = (load.host, load.gpu, load.seconds)
            out["load_matches_save"] = _checksum(fresh) == saved
        except Exception as exc:
            failed = _error(exc)
    for phase in PHASES:
        out.setdefault(phase, failed)
    return out


def rows(per_rank: list, theory: dict, fmt, meta: list) -> tuple[list, dict]:
    """The FSDP2 rows of memory.table (each with nbtrain's meta peak / FSDP2's as its
    note) and their ratios: fsdp2_<phase>_vs_theory and meta_<phase>_vs_fsdp2."""
    from .phase import MB, peak_of

    baseline = max(r["baseline"] for r in per_rank)
    lines, ratios, ours_ratios = [], {}, {}
    for phase in PHASES:
        errors = [r[phase] for r in per_rank if isinstance(r[phase], dict) or r[phase] is None]
        if errors:
            why = next((e["error"] for e in errors if e), "not reached")
            lines.append(
                f"{'fsdp2':<6} {phase:<6} {'-':>9} {theory[phase] / MB:>11.1f} "
                f"{'-':>6} {'-':>8}  not measured: {why}"
            )
            continue
        peak = peak_of(per_rank, phase)
        seconds = max(r[phase][2] for r in per_rank)
        ratio = peak / (theory[phase] + baseline)
        ours = peak_of(meta, phase) / peak if peak > 0 else float("nan")
        ratios[f"fsdp2_{phase}_vs_theory"] = ratio
        ours_ratios[f"meta_{phase}_vs_fsdp2"] = ours
        lines.append(
            fmt("fsdp2", phase, peak, theory[phase], ratio, seconds) + f"  nbtrain/FSDP2 {ours:.2f}"
        )
    return lines, {**ratios, **ours_ratios}
