"""Rank function for test_plan_accuracy.py: each layout's measured training peak (the
rise of the resident high-water mark, VmHWM, above what the rank held before building)."""

import gc

import torch

MODEL = dict(vocab_size=4096, hidden=384, heads=6, layers=6, seq_len=128)  # 12.3 M parameters
MOE = dict(MODEL, num_experts=4, top_k=2)
ROWS, SEQ, STEPS = 4, 128, 2
LAYOUTS = {
    "dp ZeRO-2": dict(zero_level=2),
    "dp ZeRO-3": dict(zero_level=3),
    "tp 2": dict(tp_size=2),
    "pp 2, 4 micro-batches": dict(pipe_size=2, num_micro_batches=4),
    "cp 2": dict(cp_size=2),
    "ep 2": dict(ep_size=2),
}


def model_of(name):
    """(registered model name, model_config) of a layout: ep needs the MoE GPT."""
    return ("gpt_moe", MOE) if name == "ep 2" else ("gpt", MODEL)


def _rss(field="VmRSS"):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def _baseline():
    """What the rank holds before a case: after a collection and after glibc gives back
    the free pages of its small-block heap (trimmed later, mid-case, they made a
    rank's rise read up to 10 MiB low)."""
    import ctypes

    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass
    return _rss()


def _reset_peak():
    gc.collect()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM back to the current VmRSS


def _train(parallel, model_name, model_config, steps, measure):
    from nbtrain.runtime import NBConfig, ParallelConfig, RuntimeConfig, create_runtime
    from nbtrain.runtime.contracts import PackedBatch

    nb = NBConfig(
        model_name=model_name,
        model_config=model_config,
        parallel=ParallelConfig(**parallel),
        optimizer={"lr": 1e-4, "weight_decay": 0.0},
    )
    rt = create_runtime(RuntimeConfig("nbtrain", backend_cfg=nb))
    seq = model_config["seq_len"]
    ids = torch.randint(0, model_config["vocab_size"], (ROWS, seq), generator=torch.Generator())
    batch = PackedBatch(ids, torch.arange(seq).repeat(ROWS, 1), ids.roll(-1, 1))
    handle = rt.build_model()
    if measure:  # the build's whole-model transient is not training's peak
        _reset_peak()
    with rt.train_mode(handle):
        for _ in range(steps):
            rt.zero_grad(handle)
            rt.forward_backward(handle, batch)
            rt.optimizer_step(handle)


def measure_all(names):
    """{layout name: this rank's training peak above its baseline, bytes}. Each layout
    first trains a tiny model of its own layout once (its process groups and one-time
    costs), then the baseline is read, then the real model is built and trained."""
    from nbtrain.bench.phase import fix_mmap_threshold

    fix_mmap_threshold()  # freed large blocks go back: each layout's peak is its own
    out = {}
    for name in names:
        model_name, config = model_of(name)
        tiny = dict(config, hidden=32, heads=4, layers=2, vocab_size=64, seq_len=16)
        _train(LAYOUTS[name], model_name, tiny, 1, measure=False)
        base = _baseline()
        _train(LAYOUTS[name], model_name, config, STEPS, measure=True)
        out[name] = _rss("VmHWM") - base
    return out


def accuracy(plans: dict, measured: list, width: int = 24) -> tuple[list, dict]:
    """(the table's lines, {(name, rank): relative error}) of planned against measured
    peaks: `plans` {name: Plan}, `measured` each rank's {name: bytes} (measure_all's).
    Pipeline stage s is rank s of 2."""
    mib = 2**20
    lines = [f"{'layout':<{width}}{'rank':>5}{'planned':>9}{'measured':>10}{'error':>8}"]
    errors = {}
    for name, p in plans.items():
        for rank in range(2):
            role = p.ranks[rank * len(p.ranks) // 2]  # pp 2: rank 0 stage 0, rank 1 stage 1
            got = measured[rank][name]
            errors[name, rank] = (role.total - got) / got
            lines.append(
                f"{name:<{width}}{rank:>5}{role.total / mib:>9.1f}{got / mib:>10.1f}"
                f"{errors[name, rank]:>+8.1%}"
            )
    return lines, errors
