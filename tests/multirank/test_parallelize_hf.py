"""A Hugging Face Llama built from a config, tensor-parallelised by llama_plan, trains
like the plain model on one process (tp 2 and 3; grouped-query attention; tied and
untied heads) and its state_dict loads into the plain model; with `wrap` on top, two
data-parallel replicas of the tp 2 model under ZeRO-3 train like it too."""

import copy

import pytest
import torch
import torch.distributed as dist
from support.ranks import run_ranks

transformers = pytest.importorskip("transformers")


def _train(heads, kv_heads, tie, tp=None):
    import nbtrain
    from nbtrain.models.hf_tp import llama_plan

    topo = nbtrain.init_distributed(tp_size=tp or dist.get_world_size()).topology
    cfg = transformers.LlamaConfig(
        vocab_size=37 if tie else 36,
        hidden_size=24,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=16,
        tie_word_embeddings=tie,
    )
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    plain = transformers.LlamaForCausalLM(cfg)
    model = nbtrain.parallelize(copy.deepcopy(plain), llama_plan(cfg))
    if tp is not None:
        model = nbtrain.wrap(model, zero_level=3)
    opts = [torch.optim.AdamW(m.parameters(), lr=3e-3) for m in (plain, model)]
    gen = torch.Generator().manual_seed(2)
    worst = 0.0
    for _ in range(3):
        ids = torch.randint(0, cfg.vocab_size, (2 * topo.dp_size, 8), generator=gen)
        mine = ids.chunk(topo.dp_size)[topo.dp_rank]  # this replica's rows
        losses = []
        for m, opt, batch in zip((plain, model), opts, (ids, mine)):
            loss = m(input_ids=batch, labels=batch).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
            if m is model:
                loss = loss.detach().clone()
                dist.all_reduce(loss)  # the mean over replicas (tp ranks agree)
                loss /= dist.get_world_size()
            losses.append(loss.item())
        worst = max(worst, abs(losses[0] - losses[1]))
    state, ref = model.state_dict(), plain.state_dict()
    fresh = transformers.LlamaForCausalLM(cfg)
    fresh.load_state_dict(state)
    return {
        "loss": worst,
        "keys": sorted(state) == sorted(ref),
        "state": max((state[k] - v).abs().max().item() for k, v in ref.items()),
        "local_q": tuple(model.model.layers[0].self_attn.q_proj.weight.shape),
    }


@pytest.mark.parametrize("tp,heads,kv_heads,tie", [(2, 4, 2, False), (3, 6, 3, True)])
def test_llama_plan_trains_like_the_plain_model(tp, heads, kv_heads, tie):
    for rank, out in enumerate(run_ranks(_train, tp, heads, kv_heads, tie, timeout_s=240)):
        assert out["loss"] < 1e-5 and out["keys"] and out["state"] < 1e-5, (rank, out)
        assert out["local_q"] == (24 // tp, 24)  # the query heads really are split


def test_llama_parallelized_and_wrapped_at_tp2_by_dp2():
    for rank, out in enumerate(run_ranks(_train, 4, 4, 2, True, 2, timeout_s=240)):
        assert out["loss"] < 1e-5 and out["keys"] and out["state"] < 1e-5, (rank, out)
        assert out["local_q"] == (12, 24)
