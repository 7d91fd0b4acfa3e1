"""Rank functions for test_runtime.py: nbtrain.runtime's layouts against its reference."""

import torch

VOCAB, SEQ = 64, 16
MODEL = {"preset": "tiny", "vocab_size": VOCAB, "seq_len": SEQ}
OPTIMIZERS = {
    # Adam divides by sqrt(v) + eps: a gradient element near 1e-9, whose sum over the
    # data-parallel ranks differs from the reference's in the last bits, moves by up to
    # lr * 1e-10 / eps; eps = 1e-6 keeps that far below the 1e-5 tolerance. At lr 1e-2
    # the tiny GPT's steps turn chaotic and, over 10 steps, magnify last-bit
    # differences past 1e-5; 3e-3 still trains it fast.
    "adamw": {"name": "adamw", "lr": 3e-3, "weight_decay": 0.1, "eps": 1e-6},
    "sgd": {"name": "sgd", "lr": 0.1, "momentum": 0.9, "weight_decay": 0.01},
}


def batches(count=2, rows=4, seed=0):
    """`count` global batches of random documents packed into `rows` rows of SEQ tokens."""
    from nbtrain.runtime.validate import synthetic_batches

    return synthetic_batches(count, rows, SEQ, VOCAB, seed)


def configs(optimizer="adamw", untied=False, moe=None, **parallel):
    """(reference, nbtrain) configs of the tiny GPT, or with `moe` (a balance mode) the
    MoE GPT with 4 experts, top 2."""
    from nbtrain.runtime import NBConfig, ParallelConfig, RuntimeConfig

    model = {**MODEL, "tie_embeddings": False} if untied else MODEL
    nb = dict(
        model_config=model,
        optimizer=OPTIMIZERS[optimizer],
        clip_grad_norm=1.0,
        lr_schedule={"name": "warmup", "warmup_steps": 4},
    )
    if moe:
        nb.update(
            model_name="gpt_moe",
            model_config={**model, "num_experts": 4, "top_k": 2, "balance": moe},
        )
    ref = RuntimeConfig("reference", backend_cfg=NBConfig(**nb))
    mine = RuntimeConfig("nbtrain", backend_cfg=NBConfig(**nb, parallel=ParallelConfig(**parallel)))
    return ref, mine


def parity(cases, steps):
    """compare(reference, nbtrain layout) for each (optimizer, parallel kwargs) case, in
    one launch: {case index: rows}."""
    from nbtrain.comm.collectives import COUNTERS
    from nbtrain.runtime import compare

    out = {}
    for i, (opt, par) in enumerate(cases):
        par = dict(par)
        data = weighted(batches()) if par.pop("weighted", False) else batches()
        scaled = par.pop("scaled", False)
        cfgs = configs(opt, **par)
        for cfg in cfgs if scaled else ():
            cfg.backend_cfg.loss_scale = 2.0**12  # a power of two: exact in fp32
        COUNTERS.reset()
        out[i] = compare(*cfgs, steps=steps, data=data, verbose=False)
        out[f"bytes {i}"] = dict(COUNTERS.snapshot()["bytes"])  # which exchanges ran
    return out


def packed_vs_alone(layouts):
    """For each parallel layout: the "nbtrain" backend's token losses and gradient norm on
    packed rows, and the reference's on the same documents one per row (padded)."""
    from nbtrain.runtime import create_runtime
    from nbtrain.runtime.contracts import PackedBatch

    g = torch.Generator().manual_seed(7)
    docs = [torch.randint(0, VOCAB, (n,), generator=g) for n in (5, 7, 3, 9, 6, 4, 2, 8)]
    packed = PackedBatch.from_documents(docs, SEQ, rows=4)
    rows = [PackedBatch.from_documents([d], SEQ, rows=1) for d in docs]  # one per row
    alone = PackedBatch(
        *(torch.cat([getattr(r, k) for r in rows]) for k in ("input_ids", "position_ids", "labels"))
    )
    out = {}
    for i, parallel in enumerate(layouts):
        ref, mine = configs("sgd", **parallel)
        results = []
        for cfg, batch in ((mine, packed), (ref, alone)):
            rt = create_runtime(cfg)
            handle = rt.build_model()
            rt.zero_grad(handle)
            result = rt.forward_backward(handle, batch)
            results.append((_by_document(result.token_losses, batch), rt.optimizer_step(handle)[1]))
        out[i] = results
    return out


def _by_document(token_losses, batch):
    """Each labelled document's token losses, in packing order."""
    flat, cu = token_losses.reshape(-1), batch.cu_seqlens.tolist()
    labelled = (batch.labels != -100).reshape(-1)
    return [flat[a : b - 1] for a, b in zip(cu, cu[1:]) if bool(labelled[a:b].any())]


def weighted(data):
    """The batches with random per-token loss weights in [0, 2)."""
    g = torch.Generator().manual_seed(5)
    for b in data:
        b.loss_weights = 2 * torch.rand(b.input_ids.shape, generator=g)
    return data


def doubled_cross_entropy(logits, labels):
    """A custom loss_fn: twice the default per-token cross-entropy."""
    from nbtrain.runtime.base import token_cross_entropy

    return 2 * token_cross_entropy(logits, labels)


def resume(backend, parallel, path, steps=6):
    """(loss, grad norm) of `steps` steps in one go, and of steps/2, save, a fresh model,
    load, steps/2 more: they must be equal."""
    from nbtrain.runtime import create_runtime

    ref, mine = configs("adamw", **parallel)
    cfg = ref if backend == "reference" else mine
    data = batches()

    def run(handle, rt, first, count):
        out = []
        for step in range(first, first + count):
            rt.zero_grad(handle)
            result = rt.forward_backward(handle, data[step % len(data)])
            ok, norm, _ = rt.optimizer_step(handle)
            rt.lr_scheduler_step(handle)
            out.append((result.metrics["loss"], norm))
        return out

    rt = create_runtime(cfg)
    whole = run(rt.build_model(), rt, 0, steps)
    rt = create_runtime(cfg)
    handle = rt.build_model()
    half = run(handle, rt, 0, steps // 2)
    rt.save(handle, path)
    rt = create_runtime(cfg)
    fresh = rt.build_model()
    rt.load(fresh, path)
    return {
        "whole": whole,
        "resumed": half + run(fresh, rt, steps // 2, steps - steps // 2),
        "steps": fresh.steps,
    }


def contract_example():
    """The issue's example, as written, with the "nbtrain" backend at tp=2."""
    from nbtrain.runtime import NBConfig, ParallelConfig, RuntimeConfig, create_runtime
    from nbtrain.runtime.contracts import ForwardResult

    data = batches(count=1)[0]
    cfg = RuntimeConfig(
        backend="nbtrain",
        hf_path=None,
        backend_cfg=NBConfig(
            model_name="gpt", model_config=MODEL, parallel=ParallelConfig(tp_size=2)
        ),
    )
    rt = create_runtime(cfg)
    handle = rt.build_model()
    with rt.train_mode(handle):
        rt.zero_grad(handle)
        result = rt.forward_backward(handle, data, loss_fn=None, num_micro_batches=2)
        ok, grad_norm, num_zeros = rt.optimizer_step(handle)
        lr = rt.lr_scheduler_step(handle)
        with rt.eval_mode(handle):
            modes = [handle.model.training]
        modes.append(handle.model.training)
    rt.zero_grad(handle)
    plain = rt.forward_backward(handle, data).metrics["loss"]
    rt.zero_grad(handle)
    doubled = rt.forward_backward(handle, data, loss_fn=doubled_cross_entropy).metrics["loss"]
    assert isinstance(result, ForwardResult)
    return {
        "loss": result.metrics["loss"],
        "tokens": result.metrics["tokens"],
        "expected_tokens": int((data.labels != -100).sum()),
        "token_losses": result.token_losses,
        "labelled": data.labels != -100,
        "ok": ok,
        "grad_norm": grad_norm,
        "num_zeros": num_zeros,
        "lr": lr,
        "modes": modes,
        "plain": plain,
        "doubled": doubled,
    }
