"""Rank code for test_hf_auto: a Hugging Face causal LM folder read by
nbtrain.from_pretrained (transformers' classes, ZeRO-3), trained, written back by
nbtrain.save_pretrained, beside the same training on one plain transformers model."""

import gc
import os

import torch

ROWS, SEQ = 6, 16  # 6 rows: 6, 3 or 2 per rank at world 1, 2, 3


def make_folder(
    folder: str, model_type: str = "llama", seed: int = 0, shard: str = "200KB", **sizes
) -> dict:
    """A causal LM with random weights saved with transformers' save_pretrained in
    small shards (an index file), and a tokenizer file beside it. Returns its config."""
    import transformers

    torch.manual_seed(seed)
    config = transformers.AutoConfig.for_model(model_type, **sizes)
    model = transformers.AutoModelForCausalLM.from_config(config)
    model.save_pretrained(folder, max_shard_size=shard)
    with open(os.path.join(folder, "tokenizer.json"), "w") as f:
        f.write('{"version": "1.0", "model": {"type": "WordLevel", "vocab": {}}}')
    return config.to_dict()


def batch(vocab: int):
    ids = torch.randint(0, vocab, (ROWS, SEQ + 1), generator=torch.Generator().manual_seed(7))
    return ids[:, :-1], ids[:, 1:]


def _optimizer(kind: str, params):
    if kind == "sgd":
        return torch.optim.SGD(params, lr=0.05, momentum=0.9)
    return torch.optim.AdamW(params, lr=1e-3, weight_decay=0.01)


def _loss(model, x, y):
    logits = model(x).logits
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), y.flatten())


def _train(model, opt, steps: int, rank: int = 0, world: int = 1):
    """`steps` steps on rows rank::world of the batch; the losses (the mean over the
    ranks: equal rows each) and the logits of the whole batch after them."""
    x, y = batch(model.config.vocab_size)
    rows = slice(rank, None, world)
    model.train()
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        loss = _loss(model, x[rows], y[rows])
        loss.backward()
        opt.step()
        whole = loss.detach().clone()
        if world > 1:
            torch.distributed.all_reduce(whole)
        losses.append(float(whole) / world)
    model.eval()
    with torch.no_grad():
        return losses, model(x).logits


def train_plain(folder: str, kind: str, steps: int):
    """One process, transformers alone: the losses and the final logits."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    return _train(model, _optimizer(kind, model.parameters()), steps)


def train_sharded(folder: str, out: str, kind: str, steps: int):
    """from_pretrained, the first logits, `steps` steps on this rank's rows, then
    save_pretrained into `out`: (first logits, losses, last logits, files written,
    Blocks in the model, meta buffers left)."""
    import nbtrain
    from nbtrain.zero.block import Block

    ctx = nbtrain.get_context()
    model = nbtrain.from_pretrained(folder, progress=False)
    blocks = sum(isinstance(m, Block) for m in model.modules())
    meta = [n for n, b in model.named_buffers() if b.is_meta]
    x, y = batch(model.config.vocab_size)
    with torch.no_grad():
        first = model(x).logits
    opt = _optimizer(kind, model.parameters())
    losses, last = _train(model, opt, steps, ctx.rank, ctx.world_size)
    written = nbtrain.save_pretrained(model, out)
    return first, losses, last, written, blocks, meta


def load_peak(folder: str) -> dict:
    """Peak resident memory (VmHWM, reset before) that from_pretrained adds on this
    rank, beside this rank's shard of the parameters and the whole model's bytes."""
    import nbtrain
    from nbtrain.bench.memory import Phase, fix_mmap_threshold

    fix_mmap_threshold()
    nbtrain.from_pretrained(folder, progress=False)  # one-time costs (imports, first files)
    gc.collect()
    with Phase(nbtrain.get_context().device) as phase:
        model = nbtrain.from_pretrained(folder, progress=False)
    held = sum(p.numel() * p.element_size() for p in model.parameters())
    import transformers

    config = transformers.AutoConfig.from_pretrained(folder)
    with torch.device("meta"):
        full = sum(
            p.numel() * p.element_size()
            for p in transformers.AutoModelForCausalLM.from_config(config).parameters()
        )
    return {"peak": phase.host, "held": held, "full": full}


def lora_config():
    import peft

    return peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)


def _trainable(model):
    return [p for p in model.parameters() if p.requires_grad]


def train_lora_sharded(folder: str, out: str, kind: str, steps: int):
    """from_pretrained with a LoRA config, `steps` steps on this rank's rows, the adapter
    folder saved: (initial adapters, losses, last logits, files written, bytes per
    rank of trainable parameters, of gradients and of optimizer state)."""
    import nbtrain

    ctx = nbtrain.get_context()
    torch.manual_seed(3)
    model = nbtrain.from_pretrained(folder, peft_config=lora_config(), progress=False)
    initial = {k: v.clone() for k, v in model.state_dict().items() if "lora_" in k}
    params = _trainable(model)
    opt = _optimizer(kind, params)
    losses, last = _train(model, opt, steps, ctx.rank, ctx.world_size)
    nbytes = lambda ts: sum(t.numel() * t.element_size() for t in ts)  # noqa: E731
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    state = [v for s in opt.state.values() for v in s.values() if torch.is_tensor(v) and v.dim()]
    sizes = {"trainable": nbytes(params), "grads": nbytes(grads), "state": nbytes(state)}
    written = nbtrain.save_pretrained(model, out)
    return initial, losses, last, written, sizes


def train_lora_plain(folder: str, initial: dict, kind: str, steps: int):
    """PEFT alone on one process, from the same adapters: losses, last logits."""
    import peft
    import transformers

    base = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    model = peft.get_peft_model(base, lora_config())
    missing = model.load_state_dict(initial, strict=False)
    assert not missing.unexpected_keys, missing.unexpected_keys
    return _train(model, _optimizer(kind, _trainable(model)), steps)
