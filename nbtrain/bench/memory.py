"""`nbtrain bench --memory`: peak memory per rank while a GPT is built, trained, saved
and loaded with ZeRO-3, against the ZeRO-3 theory, with the naive path (the model
built whole on every rank, then wrapped) for contrast, and torch FSDP2 as the peer
(memory_fsdp.py: meta device, fully_shard, to_empty, DCP save and load), with
nbtrain's peak over FSDP2's per phase.

    nbtrain bench --memory                    # a ~200 M-parameter GPT on 2 ranks
    nbtrain bench --memory --quick            # a 6 M-parameter one
    nbtrain bench --memory --offload          # and with wrap(offload=True) (GPU: device peaks)

Each phase's peak is the rise of the process's resident high-water mark (Linux's
VmHWM, reset before the phase) above what the rank held when the phase began; on a
GPU the device's peak allocation is reported beside it. Before measuring, each
launch builds, saves and loads a tiny model once: the libraries' and process groups'
one-time costs, the same for any model. Large tensors are allocated from mmap (a
fixed glibc threshold) so that what a phase frees is given back, and the next
phase's peak is its own.

Theory, P parameters over N ranks (4 bytes each), as the rise above what the rank
held: build and load make the shard, 4P/N; training adds gradients (4P/N) and
AdamW's two moments (8P/N) to it, 16P/N in all, plus activations and the blocks
gathered in flight; saving gathers one parameter at a time, at most one transformer
block (the theory shown; FSDP2's DCP save writes each rank's shards where they lie).
"""

from __future__ import annotations

import sys
import tempfile
import time

from .phase import MB, Phase, fix_mmap_threshold, peak_of


def _gpt(cfg, how: str):
    """A ZeRO-3 GPT: from the meta device and initialised rank by rank ("meta"), from
    the meta device with nothing drawn ("empty", for a load), or built whole on every
    rank and then wrapped ("whole"), or from the meta device with its Blocks' shards
    in host memory ("offload")."""
    import nbtrain
    from nbtrain.models.gpt import GPT, gpt_inits

    if how == "whole":
        return nbtrain.wrap(GPT(cfg))
    with nbtrain.empty_parameters():
        model = GPT(cfg)
    nbtrain.assign_inits(model, gpt_inits(cfg))
    model = nbtrain.wrap(model, offload=how == "offload")
    if how in ("meta", "offload"):
        nbtrain.init_parameters(model)
    return model


def run_rank(spec: dict) -> dict:
    """One rank of one path ("meta": build, train, save, load; "whole": build, train)."""
    import torch

    import nbtrain
    from nbtrain.models.gpt import GPTConfig

    fix_mmap_threshold()
    ctx = nbtrain.get_context()
    tiny = GPTConfig(vocab_size=256, hidden=64, heads=4, layers=2, seq_len=16)
    warm = f"{spec['folder']}/warm.safetensors"
    nbtrain.save(_gpt(tiny, "meta"), warm)  # one-time costs, paid before measuring
    nbtrain.load(_gpt(tiny, "empty"), warm)
    with Phase(ctx.device) as empty:  # the runtime's baseline: an empty model's build
        _gpt(tiny, "meta")
    cfg = GPTConfig(
        vocab_size=256,
        hidden=spec["hidden"],
        heads=spec["heads"],
        layers=spec["layers"],
        seq_len=64,
    )
    out = {"baseline": empty.host}
    with Phase(ctx.device) as build:
        model = _gpt(cfg, spec["path"])
    out["build"] = (build.host, build.gpu, build.seconds)
    out["shard"] = sum(p.numel() * p.element_size() for p in model.parameters())
    out["params"] = sum(p.numel() for p in _gpt_meta_params(cfg))
    if spec["path"] == "offload":  # the optimizer steps on the host shards
        from nbtrain.optim import AdamOffloadOptimizer

        opt = AdamOffloadOptimizer(model.parameters(), lr=1e-4)
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    g = torch.Generator().manual_seed(ctx.rank)
    ids = torch.randint(0, 256, (spec["batch"], 64), generator=g)
    with Phase(ctx.device) as train:
        for _ in range(spec["steps"]):
            opt.zero_grad()
            model.loss(ids, ids.roll(-1, dims=1)).backward()
            opt.step()
    out["train"] = (train.host, train.gpu, train.seconds)
    if spec["path"] == "meta":  # step time while a background save is in flight
        out["async"] = _async_step_ratio(model, opt, ids, spec)
        path = f"{spec['folder']}/model.safetensors"
        with Phase(ctx.device) as save:
            nbtrain.save(model, path)
        out["save"] = (save.host, save.gpu, save.seconds)
        del model, opt
        with Phase(ctx.device) as load:
            fresh = _gpt(cfg, "empty")
            nbtrain.load(fresh, path)
        out["load"] = (load.host, load.gpu, load.seconds)
        with torch.device("meta"):
            from nbtrain.models.gpt import GPT

            out["block"] = sum(p.numel() * 4 for p in GPT(cfg).layers[0].parameters())
    return out


def _async_step_ratio(model, opt, ids, spec) -> tuple[float, bool]:
    """(seconds per step with a save_checkpoint(non_blocking=True) in flight / without,
    whether the save was still in flight after those steps)."""
    import torch

    import nbtrain
    from nbtrain.checkpoint import asynchronous

    def steps():
        start = time.perf_counter()
        for _ in range(spec["steps"]):
            opt.zero_grad()
            model.loss(ids, ids.roll(-1, dims=1)).backward()
            opt.step()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        return time.perf_counter() - start

    quiet = steps()
    nbtrain.save_checkpoint(model, f"{spec['folder']}/async", non_blocking=True)
    busy = steps()
    still = asynchronous.in_flight()
    nbtrain.checkpoint.wait()
    return busy / quiet, still


def _gpt_meta_params(cfg):
    import torch

    from nbtrain.models.gpt import GPT

    with torch.device("meta"):
        return list(GPT(cfg).parameters())


def measure(
    ranks: int,
    hidden: int,
    layers: int,
    heads: int,
    steps: int,
    batch: int,
    backend: str | None = None,
    log=print,
    offload: bool = False,
) -> dict:
    """Every path, each in its own launch: {"meta": per-rank dicts, "whole": ...,
    "fsdp2": ...}. An FSDP2 launch that fails is {"error": ...}, not a number."""
    from ..launch import run_ranks
    from . import memory_fsdp

    out = {}
    with tempfile.TemporaryDirectory(prefix="nbtrain-memory-") as folder:
        for path in ("meta", "whole", "fsdp2") + (("offload",) if offload else ()):
            start = time.perf_counter()
            spec = {
                "path": path,
                "hidden": hidden,
                "layers": layers,
                "heads": heads,
                "steps": steps,
                "batch": batch,
                "folder": folder,
            }
            if path == "fsdp2":
                try:
                    out[path] = run_ranks(
                        memory_fsdp.run_rank, ranks, spec, backend=backend, timeout_s=3600
                    )
                except (AssertionError, RuntimeError, TimeoutError) as exc:
                    out[path] = {"error": str(exc).strip().splitlines()[-1][:200]}
            else:
                out[path] = run_ranks(run_rank, ranks, spec, backend=backend, timeout_s=3600)
            log(f"{path}: {time.perf_counter() - start:.1f} s", file=sys.stderr)
    return out


def _row(name, phase, peak, theory, ratio, seconds) -> str:
    return (
        f"{name:<6} {phase:<6} {peak / MB:>9.1f} {theory / MB:>11.1f} {ratio:>6.2f} {seconds:>8.1f}"
    )


def table(result: dict, ranks: int) -> tuple[str, dict]:
    """The per-phase table (worst rank) and the ratios against the theory."""
    meta, whole = result["meta"], result["whole"]
    params = meta[0]["params"]
    shard = 4 * params / ranks
    baseline = max(r["baseline"] for r in meta)
    block = meta[0]["block"]
    # Each phase's rise above what the rank already held: training adds gradients and
    # AdamW's two moments to the shard it holds (12P/N of the 16P/N).
    theory = {"build": shard, "train": 3 * shard, "save": block, "load": shard}
    ratios = {}
    where = "GPU" if meta[0]["build"][1] is not None else "host"
    lines = [
        (
            f"GPT of {params / 1e6:.1f} M parameters ({4 * params / MB:.0f} MiB fp32) on "
            f"{ranks} ranks, ZeRO-3; runtime baseline {baseline / MB:.1f} MiB"
        ),
        f"peaks per rank ({where} memory, the worst rank)",
        (
            f"{'path':<6} {'phase':<6} {'peak MiB':>9} {'theory MiB':>11} {'ratio':>6} "
            f"{'seconds':>8}"
        ),
    ]
    paths = [
        ("meta", meta, ("build", "train", "save", "load")),
        ("whole", whole, ("build", "train")),
    ]
    if "offload" in result:  # on a GPU its device peaks are the point; on a CPU, equal
        paths.append(("offload", result["offload"], ("build", "train")))
    for name, per_rank, phases in paths:
        for phase in phases:
            peak = peak_of(per_rank, phase)
            seconds = max(r[phase][2] for r in per_rank)
            ratio = peak / (theory[phase] + baseline)
            ratios[f"{name}_{phase}_vs_theory"] = ratio
            lines.append(_row(name, phase, peak, theory[phase], ratio, seconds))
    lines += _fsdp2_rows(result, theory, meta, ratios)
    lines.append(
        "theory (the rise above what the rank held): build/load 4P/N, train 12P/N "
        "(gradients and AdamW's moments; + activations), save one block; "
        "ratio = peak / (theory + baseline)"
    )
    ratio, still = max(r["async"][0] for r in meta), all(r["async"][1] for r in meta)
    lines.append(
        f"step time with a background save in flight / without: {ratio:.2f} "
        f"({'still writing after the steps' if still else 'the write ended first'})"
    )
    ratios["async_save_step_time_ratio"] = ratio
    ratios["naive_build_vs_meta_build"] = max(r["build"][0] for r in whole) / max(
        r["build"][0] for r in meta
    )
    if "offload" in result:
        ratios["offload_train_vs_meta_train"] = (
            ratios["offload_train_vs_theory"] / ratios["meta_train_vs_theory"]
        )
    return "\n".join(lines), ratios


def _fsdp2_rows(result: dict, theory: dict, meta: list, ratios: dict) -> list:
    """FSDP2's rows (its ratios into `ratios`), or one line saying why there are none."""
    from . import memory_fsdp

    fsdp2 = result.get("fsdp2")
    if fsdp2 is None:
        return []
    if isinstance(fsdp2, dict):  # the launch failed
        return [f"fsdp2: not measured: {fsdp2['error']}"]
    rows, fsdp2_ratios = memory_fsdp.rows(fsdp2, theory, _row, meta)
    ratios.update(fsdp2_ratios)
    base = max(r["baseline"] for r in fsdp2)
    shard = max(r.get("shard", 0) for r in fsdp2)
    loaded = [r.get("load_matches_save") for r in fsdp2]
    load = (
        "no load"
        if None in loaded
        else "the load read the saved values"
        if all(loaded)
        else "the load did NOT read the saved values"
    )
    return [
        (
            f"torch {fsdp2[0]['torch']} FSDP2 (meta device, fully_shard per layer and root, "
            f"to_empty, DCP): baseline {base / MB:.1f} MiB, shard {shard / MB:.1f} MiB, "
            f"{load}"
        )
    ] + rows


def main(args) -> int:
    from .runs import backend_of, write_json

    quick = args.quick
    hidden, layers = (256, 8) if quick else (1024, 16)
    ranks = args.ranks
    backend = backend_of(args)
    print(f"nbtrain bench --memory: {ranks} ranks, {backend}", flush=True)
    result = measure(
        ranks, hidden, layers, 8, steps=2, batch=2, backend=backend, offload=args.offload
    )
    text, ratios = table(result, ranks)
    print(text)
    for key, value in ratios.items():
        print(f"{key}: {value:.3f}")
    write_json(args.json, {"result": result, "ratios": ratios})
    return 0
