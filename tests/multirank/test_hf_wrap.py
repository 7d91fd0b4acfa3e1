"""wrap() on a Hugging Face causal LM (built from a config, no download)."""

import pytest
import torch
from support.ranks import run_ranks

import nbtrain as nbt

transformers = pytest.importorskip("transformers")

STEPS, BATCH_PER_RANK, SEQ = 5, 2, 12


def _config():
    return transformers.LlamaConfig(
        vocab_size=97,
        hidden_size=32,
        intermediate_size=56,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=SEQ,
        tie_word_embeddings=True,
    )


def _model():
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(_config())


def _data(world):
    g = torch.Generator().manual_seed(7)
    return torch.randint(0, 97, (STEPS, world * BATCH_PER_RANK, SEQ), generator=g)


def _train(model, xs, lo, hi):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, eps=1e-6)
    losses = []
    for s in range(STEPS):
        opt.zero_grad()
        loss = model(input_ids=xs[s, lo:hi], labels=xs[s, lo:hi]).loss
        loss.backward()
        opt.step()
        losses.append(loss.detach())
    return losses


def _sharded_run():
    model = nbt.wrap(_model(), zero_level=3)
    tied = model.lm_head.weight is model.model.embed_tokens.weight
    is_list = isinstance(model.model.layers, nbt.TransformerBlockList)
    lo = nbt.rank() * BATCH_PER_RANK
    losses = [
        nbt.sum_loss(ln).item()
        for ln in _train(model, _data(nbt.world_size()), lo, lo + BATCH_PER_RANK)
    ]
    return tied, is_list, losses, model.state_dict()


def test_wrapped_llama_trains_like_plain():
    world = 2
    ref = _model()
    assert ref.lm_head.weight is ref.model.embed_tokens.weight
    xs = _data(world)
    # Every rank's slice has the same token count (no padding), so the mean of the
    # ranks' losses equals the loss of one process on the concatenated batch.
    ref_losses = [ln.item() for ln in _train(ref, xs, 0, world * BATCH_PER_RANK)]
    tied, is_list, losses, state = run_ranks(_sharded_run, world, timeout_s=180)[0]
    assert tied and is_list
    assert losses == pytest.approx(ref_losses, abs=1e-5)
    ref_state = ref.state_dict()
    assert list(state) == list(ref_state)
    for name, value in ref_state.items():
        torch.testing.assert_close(
            state[name], value, atol=1e-5, rtol=1e-5, msg=lambda m, name=name: f"{name}: {m}"
        )
