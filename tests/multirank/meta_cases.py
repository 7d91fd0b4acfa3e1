"""Rank functions for test_meta_build.py: models built on the meta device, sharded and
initialised rank by rank."""

import gc

import torch

VOCAB = 96


def gpt_from_meta(steps: int):
    """A tiny GPT built under empty_parameters, wrapped (ZeRO-3), initialised by
    init_parameters, then trained `steps` SGD-with-momentum steps on a fixed batch:
    (its initial full state dict, the losses)."""
    import nbtrain
    from nbtrain.models.gpt import GPT, GPTConfig, gpt_inits

    cfg = GPTConfig.preset("tiny", vocab_size=VOCAB, seq_len=16)
    with nbtrain.empty_parameters():
        model = GPT(cfg)
    assert all(p.is_meta for p in model.parameters())
    nbtrain.assign_inits(model, gpt_inits(cfg))
    model = nbtrain.wrap(model)
    nbtrain.init_parameters(model)
    state = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
    return state, _train(model, steps)


def _train(model, steps):
    ids = torch.randint(0, VOCAB, (4, 16), generator=torch.Generator().manual_seed(0))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        loss = model.loss(ids, ids.roll(-1, dims=1))
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    return losses


def plain_gpt_training(state, steps):
    """The same training on one plain GPT holding `state`."""
    from nbtrain.models.gpt import GPT, GPTConfig

    model = GPT(GPTConfig.preset("tiny", vocab_size=VOCAB, seq_len=16))
    model.load_state_dict(state)
    return _train(model, steps)


def hf_llama_from_meta():
    """transformers' LlamaForCausalLM built from a config under empty_parameters (its
    rotary buffers stay real), wrapped and initialised rank by rank: (its full state
    dict, its logits on a fixed batch, whether any buffer was on the meta device)."""
    import transformers

    import nbtrain
    from nbtrain.zero import normal_inits

    config = transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    with nbtrain.empty_parameters():
        model = transformers.LlamaForCausalLM(config)
    meta_buffers = any(b.is_meta for b in model.buffers())
    nbtrain.assign_inits(model, normal_inits(config.initializer_range))
    model = nbtrain.wrap(model)
    nbtrain.init_parameters(model)
    ids = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        logits = model(ids).logits
    state = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
    return state, logits, meta_buffers


def build_peak(hidden: int, layers: int, from_meta: bool):
    """Peak resident memory (Linux's VmHWM) added while building a GPT of `hidden` x
    `layers` and sharding it with ZeRO-3: from the meta device (empty_parameters,
    init_parameters), or built whole and then wrapped (`from_meta=False`, the path
    that holds a full copy). A first small build pays the one-time costs.
    Returns (peak bytes, the model's bytes, this rank's parameter bytes)."""
    import nbtrain
    from nbtrain.bench.memory import Phase, fix_mmap_threshold
    from nbtrain.models.gpt import GPT, GPTConfig, gpt_inits

    fix_mmap_threshold()  # big tensors mmapped, given back when freed

    def build(cfg):
        if not from_meta:
            return nbtrain.wrap(GPT(cfg))
        with nbtrain.empty_parameters():
            model = GPT(cfg)
        nbtrain.assign_inits(model, gpt_inits(cfg))
        model = nbtrain.wrap(model)
        nbtrain.init_parameters(model)
        return model

    warm = build(GPTConfig(vocab_size=VOCAB, hidden=64, heads=4, layers=2, seq_len=16))
    del warm
    gc.collect()
    cfg = GPTConfig(vocab_size=VOCAB, hidden=hidden, heads=8, layers=layers, seq_len=16)
    with torch.device("meta"):
        full = sum(p.numel() * p.element_size() for p in GPT(cfg).parameters())
    with Phase(nbtrain.get_context().device) as phase:
        model = build(cfg)
    peak = phase.host
    held = sum(p.numel() * p.element_size() for p in model.parameters())
    return peak, full, held


def save_load_peak(folder: str, hidden: int, layers: int, vocab: int = VOCAB):
    """A GPT of `hidden` x `layers` built on the meta device and sharded (ZeRO-3), saved
    with nbtrain.save and loaded into a second one: the peak resident memory each
    adds above what the rank held before it (VmHWM, reset just before), with the
    sizes to judge them by. Returns a dict of bytes."""
    import nbtrain
    from nbtrain.bench.memory import Phase, fix_mmap_threshold
    from nbtrain.models.gpt import GPT, GPTConfig, gpt_inits

    fix_mmap_threshold()

    def build(cfg, init=True):
        with nbtrain.empty_parameters():
            model = GPT(cfg)
        nbtrain.assign_inits(model, gpt_inits(cfg))
        model = nbtrain.wrap(model)
        if init:
            nbtrain.init_parameters(model)
        return model

    small = GPTConfig(vocab_size=VOCAB, hidden=64, heads=4, layers=2, seq_len=16)
    nbtrain.save(build(small), f"{folder}/warm.safetensors")  # one-time costs
    nbtrain.load(build(small, init=False), f"{folder}/warm.safetensors")
    gc.collect()
    cfg = GPTConfig(vocab_size=vocab, hidden=hidden, heads=8, layers=layers, seq_len=16)
    model = build(cfg)
    path = f"{folder}/model.safetensors"

    def peak_of(fn):
        with Phase(nbtrain.get_context().device) as phase:
            out = fn()
        return phase.host, out

    save_peak, _ = peak_of(lambda: nbtrain.save(model, path))
    load_peak, fresh = peak_of(lambda: _load_fresh(build, cfg, path))
    with torch.device("meta"):
        plain = GPT(cfg)
    block = sum(p.numel() * p.element_size() for p in plain.layers[0].parameters())
    full = sum(p.numel() * p.element_size() for p in plain.parameters())
    largest = max(p.numel() * p.element_size() for p in plain.parameters())
    held = sum(p.numel() * p.element_size() for p in model.parameters())
    same = all(
        torch.equal(a, b) for a, b in zip(model.state_dict().values(), fresh.state_dict().values())
    )
    return {
        "save_peak": save_peak,
        "load_peak": load_peak,
        "block": block,
        "full": full,
        "largest": largest,
        "held": held,
        "same": same,
        "path": path,
    }


def _load_fresh(build, cfg, path):
    import nbtrain

    fresh = build(cfg, init=False)
    nbtrain.load(fresh, path)
    return fresh


def bad_files(folder: str):
    """The errors nbtrain.load and nbtrain.save give for bad files and paths: {case:
    message}."""
    import nbtrain
    from nbtrain.models.gpt import GPT, GPTConfig

    model = nbtrain.wrap(GPT(GPTConfig(vocab_size=VOCAB, hidden=32, heads=4, layers=1, seq_len=16)))
    good = f"{folder}/good.safetensors"
    nbtrain.save(model, good)
    out = {}
    if nbtrain.rank() == 0:
        with open(good, "rb") as f:
            data = f.read()
        with open(f"{folder}/truncated.safetensors", "wb") as f:
            f.write(data[: len(data) // 2])
        with open(f"{folder}/garbage.safetensors", "wb") as f:
            f.write(b"\xff" * 64)
    checkpoint = f"{folder}/ckpt"
    nbtrain.save_checkpoint(model, checkpoint)
    if nbtrain.rank() == 0:
        import json

        with open(f"{checkpoint}/meta.json") as f:
            version = json.load(f)["version"]
        for rank in range(nbtrain.world_size()):  # every rank reads its own here
            with open(f"{checkpoint}/{version}/rank{rank:05d}.safetensors", "r+b") as f:
                f.truncate(100)
    torch.distributed.barrier()
    other = nbtrain.wrap(GPT(GPTConfig(vocab_size=VOCAB, hidden=64, heads=4, layers=1, seq_len=16)))
    for case, call in {
        "truncated": lambda: nbtrain.load(model, f"{folder}/truncated.safetensors"),
        "garbage": lambda: nbtrain.load(model, f"{folder}/garbage.safetensors"),
        "missing": lambda: nbtrain.load(model, f"{folder}/nothing.safetensors"),
        "other model": lambda: nbtrain.load(other, good),
        "unwritable": lambda: nbtrain.save(model, f"{folder}/no/such/dir/m.safetensors"),
        "truncated shard": lambda: nbtrain.load_checkpoint(model, checkpoint),
        "unwritable checkpoint": lambda: nbtrain.save_checkpoint(model, f"{good}/ckpt"),
    }.items():
        try:
            call()
            out[case] = "no error"
        except Exception as err:
            out[case] = f"{type(err).__name__}: {err}"
    return out
