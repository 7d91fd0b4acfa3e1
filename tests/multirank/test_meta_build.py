"""Models built on the meta device (nbtrain.empty_parameters), sharded by wrap and
initialised rank by rank by init_parameters, on real gloo ranks:

- nbtrain's GPT: the same initial model at world 1 and 2 (world-size independent),
  the GPT's own initialisation (N(0, 0.02), scaled residual projections, unit norms),
  and training from it equals a plain GPT holding the same weights (SGD with momentum).
- transformers' Llama built from a config: its buffers stay real, and its logits equal
  a plain model's loaded with the gathered weights.
- Peak memory of building a 25 MB GPT at world 2: from the meta device below 0.7 of the
  model (each rank its half); built whole first, at least the whole model.
"""

import math

import pytest
import torch
from meta_cases import build_peak, gpt_from_meta, hf_llama_from_meta, plain_gpt_training
from support.ranks import run_ranks

STEPS = 4


@pytest.fixture(scope="module")
def gpts():
    return {
        world: run_ranks(gpt_from_meta, world, STEPS, seed=5, timeout_s=300) for world in (1, 2)
    }


def test_the_initial_model_does_not_depend_on_the_world_size(gpts):
    one, two = gpts[1][0][0], gpts[2][0][0]
    assert one.keys() == two.keys()
    for key in one:
        assert torch.equal(one[key], two[key]), key
    assert torch.equal(gpts[2][0][0]["tok.weight"], gpts[2][1][0]["tok.weight"])


def test_the_gpts_own_initialisation_is_drawn(gpts):
    state = gpts[2][0][0]
    assert abs(float(state["tok.weight"].std()) - 0.02) < 0.002
    residual = 0.02 / math.sqrt(2 * 2)
    assert abs(float(state["layers.1.attn.proj.weight"].std()) - residual) < 0.002
    assert abs(float(state["layers.1.attn.qkv.weight"].std()) - 0.02) < 0.002
    assert torch.equal(state["layers.0.ln1.weight"], torch.ones(64))
    assert torch.equal(state["layers.0.mlp.0.bias"], torch.zeros(256))
    assert torch.equal(state["head.weight"], state["tok.weight"])  # still tied


def test_training_from_it_equals_a_plain_gpt(gpts):
    state, losses = gpts[2][0]
    plain = plain_gpt_training(state, STEPS)
    assert len(set(losses)) == STEPS  # it trains
    for a, b in zip(losses, plain):
        assert abs(a - b) < 1e-5, (losses, plain)
    assert gpts[2][1][1] == losses and gpts[1][0][1] == pytest.approx(losses, abs=1e-5)


def test_a_transformers_model_from_a_config():
    import transformers
    from meta_cases import VOCAB

    per_rank = run_ranks(hf_llama_from_meta, 2, timeout_s=300)
    state, logits, meta_buffers = per_rank[0]
    assert not meta_buffers
    config = transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    plain = transformers.LlamaForCausalLM(config)
    plain.load_state_dict(state)
    ids = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = plain(ids).logits
    for _, got, _ in per_rank:
        assert (got - want).abs().max() < 1e-5
    assert abs(float(state["model.layers.0.mlp.up_proj.weight"].std()) - 0.02) < 0.003


@pytest.mark.parametrize("from_meta", [True, False], ids=["meta", "built-whole"])
def test_peak_memory_while_building(from_meta):
    for peak, full, held in run_ranks(build_peak, 2, 256, 8, from_meta, timeout_s=300):
        assert full > 20e6 and abs(held - full / 2) < 0.05 * full
        if from_meta:
            assert peak < 0.7 * full, f"peak {peak / 1e6:.1f} MB of a {full / 1e6:.1f} MB model"
        else:  # the contrast: the plain model exists whole before it is sharded
            assert peak > 0.95 * full, f"peak {peak / 1e6:.1f} MB of a {full / 1e6:.1f} MB model"
