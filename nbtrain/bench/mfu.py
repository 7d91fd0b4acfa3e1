"""`nbtrain bench --mfu`: tokens/s and model FLOPs utilisation of a ~1B Llama, world 1.

    nbtrain bench --mfu                 # on a GPU: the 1B model, seq 2048, bf16
    nbtrain bench --mfu --quick         # the tiny model (what a CPU always runs)

One model (nbtrain.models.llama: RMSNorm, rotary positions, SwiGLU MLP; 18 layers of
width 2048, 16 heads of 128, MLP 5632, vocabulary 32000, untied head: 1.06 B
parameters) trained on one device by each engine, on the same seeded weights and
batches, in bf16 with fp32 master weights:
  nbtrain          wrap(bf16 model, zero_level=3, reduce_dtype=fp32) and AdamOptimizer
  torch            the plain bf16 model, torch AdamW on fp32 master copies (fused on CUDA)
  torch_compile    the same, each decoder layer compiled (torch.compile(layer))
  nbtrain_compile  nbtrain with each Block's module compiled (where wrap takes compile=)
Each engine runs in its own process (its memory peak is its own). A step is forward,
the loss in fp32, backward and the optimizer step; the first `--warmup` steps are not
timed, and they absorb compilation: the compile time shown is the first step's time
less the median timed step.

Model FLOPs per token (PaLM, Chowdhery et al. 2022, appendix B): 6 N + 12 L d T, with
N the parameters less the input embedding (a lookup, no matmul), L layers, d the width
and T the sequence length (the attention scores and values, forward and backward,
counted without the causal half: the usual convention). MFU = tokens/s x FLOPs per token
/ the device's dense bf16 peak (PEAK_BF16_TFLOPS, by device name; `--peak-tflops`
overrides). With no peak known (a CPU) it prints tokens/s and says so.
"""

from __future__ import annotations

import inspect
import math
import re
import statistics
import sys
import time

# Dense (no sparsity) bf16 tensor-core peaks, TFLOPS, from the vendor's data sheets; the
# first pattern that matches torch.cuda.get_device_name() wins. NVL and other variants
# not listed here have other clocks: no peak (pass --peak-tflops).
PEAK_BF16_TFLOPS = (
    (r"NVL", None),
    (r"H100.*PCIe", 756.0),
    (r"H100", 989.0),  # SXM5 ("NVIDIA H100 80GB HBM3")
    (r"H200", 989.0),  # SXM (and GH200: the same Hopper GPU)
    (r"A100", 312.0),  # SXM4 and PCIe alike
    (r"L40S", 362.0),
    (r"\bL4\b", 121.0),
    (r"\bA10\b", 125.0),  # not the A10G
)

SIZES = {
    # ~1B: 18 x 51.4 M (attention 4 d^2, SwiGLU 3 d x 5632) + 2 x 65.5 M (embedding, head)
    "1b": {
        "config": {
            "vocab_size": 32000,
            "hidden_size": 2048,
            "intermediate_size": 5632,
            "num_hidden_layers": 18,
            "num_attention_heads": 16,
        },
        "seq_len": 2048,
    },
    "tiny": {
        "config": {
            "vocab_size": 256,
            "hidden_size": 64,
            "intermediate_size": 176,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
        },
        "seq_len": 64,
    },
}
ADAMW = {"lr": 1e-4, "eps": 1e-8, "weight_decay": 0.1}


def peak_tflops(device_name: str) -> float | None:
    """The dense bf16 peak of a device by its name, or None when not known."""
    for pattern, tflops in PEAK_BF16_TFLOPS:
        if re.search(pattern, device_name):
            return tflops
    return None


def config(size: str):
    from nbtrain.models.llama import LlamaConfig

    return LlamaConfig(**SIZES[size]["config"], max_position_embeddings=SIZES[size]["seq_len"])


def param_count(cfg) -> tuple[int, int]:
    """(all parameters, parameters less the input embedding), built on the meta device."""
    import torch

    from nbtrain.models.llama import Llama

    with torch.device("meta"):
        model = Llama(cfg)
    total = sum(p.numel() for p in model.parameters())
    return total, total - model.model.embed_tokens.weight.numel()


def flops_per_token(cfg, seq_len: int) -> tuple[float, str]:
    """Training FLOPs per token, and the formula with its numbers filled in."""
    _, n = param_count(cfg)
    attn = 12 * cfg.num_hidden_layers * cfg.hidden_size * seq_len
    text = (
        f"FLOPs/token = 6 N + 12 L d T = 6 x {n / 1e6:.4g} M + 12 x "
        f"{cfg.num_hidden_layers} x {cfg.hidden_size} x {seq_len} = "
        f"{(6 * n + attn) / 1e9:.4g} GFLOP (N: parameters less the input embedding; "
        "PaLM, Chowdhery et al. 2022, appendix B)"
    )
    return 6 * n + attn, text


def nbtrain_compiles() -> bool:
    """Whether this nbtrain's wrap compiles Blocks' modules (`wrap(..., compile=)`)."""
    import nbtrain as nbt

    return "compile" in inspect.signature(nbt.wrap).parameters


def engines() -> tuple[str, ...]:
    return ("nbtrain", "torch", "torch_compile") + (
        ("nbtrain_compile",) if nbtrain_compiles() else ()
    )


def build(engine: str, cfg, seed: int, device, backend: str):
    """(model, optimizer) of `engine` on `device`: bf16 weights, fp32 master weights."""
    import torch

    import nbtrain as nbt
    from nbtrain.models.llama import Llama

    from .engines import MasterAdamW, compile_layers

    torch.manual_seed(seed)
    with torch.device(device):
        model = Llama(cfg).to(torch.bfloat16)
    if engine.startswith("nbtrain"):
        kw = {"compile": {"backend": backend}} if engine == "nbtrain_compile" else {}
        model = nbt.wrap(model, zero_level=3, reduce_dtype=torch.float32, **kw)
        opt = nbt.optim.AdamOptimizer(model.parameters(), decoupled_weight_decay=True, **ADAMW)
        return model, opt  # AdamW (decoupled decay), as torch's engines
    if engine == "torch_compile":
        compile_layers(model.model.layers, {"backend": backend})
    fused = {"fused": True} if torch.device(device).type == "cuda" else {}
    return model, MasterAdamW(model.parameters(), **ADAMW, **fused)


def run_rank(spec: dict) -> dict:
    """One engine on this (only) rank: warm-up and timed steps; its numbers."""
    import torch
    import torch.nn.functional as F

    import nbtrain as nbt

    from .worker import _peak, _reset_peak

    device = nbt.get_context().device
    cfg = config(spec["size"])
    seq, rows = SIZES[spec["size"]]["seq_len"], spec["batch"]
    total = spec["warmup"] + spec["steps"]
    g = torch.Generator().manual_seed(spec["seed"] + 1)
    xs = torch.randint(0, cfg.vocab_size, (total, rows, seq + 1), generator=g)
    start = time.perf_counter()
    model, opt = build(spec["engine"], cfg, spec["seed"], device, spec["backend"])
    build_s = time.perf_counter() - start
    _reset_peak(device)
    times, losses = [], []
    for step in range(total):
        batch = xs[step].to(device)
        x, y = batch[:, :-1], batch[:, 1:]
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        logits = model(x).float()
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
        del logits
        loss.backward()
        opt.step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - start)
        losses.append(loss.item())
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    return {
        "step_s": times[spec["warmup"] :],
        "warmup_s": times[: spec["warmup"]],
        "loss": losses,
        "peak_mem": _peak(device),
        "build_s": build_s,
        "device_name": name,
        "torch": torch.__version__,
    }


def _measure(r: dict, tokens: int, flops: float, peak: float | None) -> None:
    r["step_time_s"] = statistics.median(r["step_s"])
    r["tokens_per_s"] = tokens / r["step_time_s"]
    r["tflops"] = r["tokens_per_s"] * flops / 1e12
    r["mfu"] = r["tflops"] / peak if peak else None
    r["first_step_minus_median_s"] = r["warmup_s"][0] - r["step_time_s"]


def run(settings: dict, log=print) -> dict:
    """Every engine in its own world-1 process, one after the other; the results. An
    engine that fails is recorded with its error (the others still run), and each
    engine's numbers are printed as it finishes (a time limit keeps what came before)."""
    from ..launch import run_ranks

    cfg = config(settings["size"])
    seq = SIZES[settings["size"]]["seq_len"]
    flops, formula = flops_per_token(cfg, seq)
    params, _ = param_count(cfg)
    backend = "nccl" if settings["device"] == "cuda" else "gloo"
    tokens = settings["batch"] * seq
    runs, peak, device_name = {}, settings.get("peak_tflops"), None
    for engine in settings["engines"]:
        start = time.perf_counter()
        spec = {**settings, "engine": engine}
        try:
            r = run_ranks(
                run_rank,
                1,
                spec,
                seed=settings["seed"],
                backend=backend,
                timeout_s=settings["timeout_s"],
            )[0]
        except (AssertionError, RuntimeError, TimeoutError) as e:
            lines = [line for line in str(e).splitlines() if line.strip()]
            runs[engine] = {"error": lines[-1] if lines else type(e).__name__}
            log(f"{engine}: FAILED after {time.perf_counter() - start:.1f} s: {e}", file=sys.stderr)
            continue
        device_name = device_name or r["device_name"]
        peak = peak or peak_tflops(device_name)
        _measure(r, tokens, flops, peak)
        runs[engine] = r
        log(
            f"{engine}: {time.perf_counter() - start:.1f} s in all, step "
            f"{1e3 * r['step_time_s']:.1f} ms, {r['tokens_per_s']:.0f} tokens/s, first step "
            f"{r['warmup_s'][0]:.1f} s",
            flush=True,
        )
    done = {e: r for e, r in runs.items() if "error" not in r}
    ratios = {f"{e}_mfu": r["mfu"] for e, r in done.items() if r["mfu"] is not None}
    for ours in ("nbtrain", "nbtrain_compile"):
        for peer in ("torch", "torch_compile"):
            if ours in done and peer in done:
                ratios[f"{ours}_tokens_per_s_vs_{peer}"] = (
                    done[ours]["tokens_per_s"] / done[peer]["tokens_per_s"]
                )
    for e, r in done.items():
        if e.endswith("_compile"):
            ratios[f"{e}_compile_s"] = r["first_step_minus_median_s"]
    return {
        "settings": settings,
        "device_name": device_name or "?",
        "peak_tflops": peak,
        "params": params,
        "flops_per_token": flops,
        "formula": formula,
        "tokens_per_step": tokens,
        "runs": runs,
        "ratios": ratios,
    }


def table(result: dict) -> str:
    """The Markdown table, the peak (or that none is known) and the ratio lines."""
    mib = 2**20
    head = (
        "engine",
        "step ms",
        "tokens/s",
        "TFLOPS",
        "MFU",
        "first step s",
        "compile s",
        "peak MiB",
        "loss first",
        "loss last",
    )
    rows = [head]
    for name, r in result["runs"].items():
        if "error" in r:
            rows.append((name, f"FAILED: {r['error'][:80]}") + ("",) * (len(head) - 2))
            continue
        compiled = name.endswith("_compile")
        rows.append(
            (
                name,
                f"{1e3 * r['step_time_s']:.1f}",
                f"{r['tokens_per_s']:.0f}",
                f"{r['tflops']:.2f}",
                "n/a" if r["mfu"] is None else f"{r['mfu']:.3f}",
                f"{r['warmup_s'][0]:.1f}",
                f"{r['first_step_minus_median_s']:.1f}" if compiled else "-",
                f"{r['peak_mem'] / mib:.0f}",
                f"{r['loss'][0]:.4f}",
                f"{r['loss'][-1]:.4f}",
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(head))]
    lines = ["| " + " | ".join(c.ljust(w) for c, w in zip(row, widths)) + " |" for row in rows]
    lines.insert(1, "|" + "|".join("-" * (w + 2) for w in widths) + "|")
    lines.append("")
    if result["peak_tflops"] is None:
        lines.append(
            f"no peak known for this device ({result['device_name']}): tokens/s "
            "and TFLOPS only (--peak-tflops gives one)"
        )
    else:
        lines.append(
            f"peak: {result['peak_tflops']:.0f} TFLOPS dense bf16 ({result['device_name']})"
        )
    lines += [f"{k}: {v:.3f}" for k, v in result["ratios"].items()]
    return "\n".join(lines)


def main(args) -> int:
    import torch

    from .runs import write_json

    device = args.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("nbtrain bench --mfu --device cuda needs a CUDA GPU and none is visible")
    size = "tiny" if args.quick or device == "cpu" else "1b"
    settings = {
        "device": device,
        "size": size,
        "seed": args.seed,
        "batch": args.batch_per_rank,
        "backend": args.compile_backend,
        "steps": args.steps or (3 if size == "tiny" else 10),
        "warmup": max(1, args.warmup if args.warmup is not None else 3),
        "engines": engines(),
        "peak_tflops": args.peak_tflops,
        "timeout_s": 600.0,
    }
    cfg = config(size)
    seq = SIZES[size]["seq_len"]
    params, _ = param_count(cfg)
    _, formula = flops_per_token(cfg, seq)
    print(
        f"nbtrain bench --mfu: world 1, {device}, Llama {size} ({params / 1e6:.1f} M "
        f"parameters: {cfg.num_hidden_layers} layers, width {cfg.hidden_size}, "
        f"{cfg.num_attention_heads} heads, MLP {cfg.intermediate_size}, vocabulary "
        f"{cfg.vocab_size}), seq {seq}, {settings['batch']} seq/step, bf16 weights and "
        f"activations, fp32 master weights and loss, {settings['steps']} timed steps "
        f"(+{settings['warmup']} warm-up)",
        flush=True,
    )
    print(formula)
    print(
        "engines: nbtrain = wrap(zero_level=3, reduce_dtype=fp32) + AdamOptimizer; torch "
        "= plain model + AdamW on fp32 masters; *_compile = each decoder layer compiled "
        f"(torch.compile, backend {args.compile_backend}); compile s = the first step "
        "less the median step (a later compiled engine may find inductor's on-disk cache "
        "warm)",
        flush=True,
    )
    if not nbtrain_compiles():
        print("nbtrain_compile: not run (this nbtrain's wrap takes no compile=)")
    result = run(settings)
    print(table(result))
    write_json(args.json, result)
    runs = result["runs"].values()
    ok = all("error" not in r and all(map(math.isfinite, r["loss"])) for r in runs)
    return 0 if ok else 1
