"""Rank function for test_plan_models.py: the measured training peak (VmHWM's rise,
as plan_cases.py measures it) of the registered "gpt2" and "llama" through the runtime,
and of a transformers LlamaForCausalLM built on the meta device and wrapped with ZeRO
(`nbtrain.wrap`), trained by AdamW. "llama" and the transformers model have no
formula in the planner: their activations are traced."""

import torch
from plan_cases import _baseline, _reset_peak, _rss, _train

ROWS, SEQ, STEPS = 4, 128, 4  # the peak is the highest step's: under load one step's
# prefetched gathers may not overlap its compute (CI once measured ZeRO-3 10% under plan at 2)
LLAMA = dict(
    vocab_size=4096,
    hidden_size=384,
    intermediate_size=1024,
    num_hidden_layers=6,
    num_attention_heads=6,
    num_key_value_heads=2,
    seq_len=SEQ,
)  # 12.6 M parameters, untied head
GPT2 = dict(vocab_size=4096, n_embd=384, n_layer=6, n_head=6, n_positions=SEQ, seq_len=SEQ)
CONFIGS = {"llama": LLAMA, "gpt2": GPT2}
TINY = {
    "llama": dict(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=64,
    ),
    "gpt2": dict(n_embd=32, n_layer=2, n_head=4, vocab_size=64),
}
CASES = {
    "gpt2 dp ZeRO-2": ("gpt2", dict(zero_level=2)),
    "gpt2 dp ZeRO-3": ("gpt2", dict(zero_level=3)),
    "llama dp ZeRO-2": ("llama", dict(zero_level=2)),
    "llama dp ZeRO-3": ("llama", dict(zero_level=3)),
    # Before tp and pp: a runtime's groups stay made after it, and nbtrain.wrap shards
    # over the data-parallel ranks of the groups it finds.
    "transformers llama ZeRO-2": ("hf", dict(zero_level=2)),
    "transformers llama ZeRO-3": ("hf", dict(zero_level=3)),
    "llama tp 2": ("llama", dict(tp_size=2)),
    "llama pp 2, 4 micro-batches": ("llama", dict(pipe_size=2, num_micro_batches=4)),
}


def hf_config(**overrides):
    import transformers

    fields = {k: v for k, v in LLAMA.items() if k != "seq_len"}
    fields.update(overrides)
    return transformers.LlamaConfig(
        **fields, max_position_embeddings=SEQ, tie_word_embeddings=False
    )


def _train_hf(config, zero_level, steps, measure):
    import transformers

    import nbtrain
    from nbtrain.comm.context import get_context

    assert get_context().topology.dp_size == 2, get_context().topology  # see CASES
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(config)
    # The rotary table is a buffer computed at build, not a weight: made again off meta.
    model.model.rotary_emb = type(model.model.rotary_emb)(config)
    model = nbtrain.wrap(model, zero_level=zero_level)  # each rank makes its shards
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    ids = torch.randint(0, config.vocab_size, (ROWS // 2, SEQ), generator=torch.Generator())
    if measure:
        _reset_peak()
    for _ in range(steps):
        optimizer.zero_grad()
        logits = model(input_ids=ids).logits
        loss = torch.nn.functional.cross_entropy(
            logits.float().reshape(-1, config.vocab_size), ids.roll(-1, 1).reshape(-1)
        )
        loss.backward()
        optimizer.step()


def measure_all(names):
    """{case: this rank's training peak above its baseline, bytes}; each case first
    trains a tiny model of its own kind once, as plan_cases.measure_all does."""
    from nbtrain.bench.phase import fix_mmap_threshold

    fix_mmap_threshold()
    out = {}
    for name in names:
        kind, layout = CASES[name]
        if kind == "hf":
            _train_hf(hf_config(**TINY["llama"]), layout["zero_level"], 1, measure=False)
            base = _baseline()
            _train_hf(hf_config(), layout["zero_level"], STEPS, measure=True)
        else:
            tiny = dict(CONFIGS[kind], **TINY[kind], seq_len=16)
            _train(layout, kind, tiny, 1, measure=False)
            base = _baseline()
            _train(layout, kind, CONFIGS[kind], STEPS, measure=True)
        out[name] = _rss("VmHWM") - base
    return out
