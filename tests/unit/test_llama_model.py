"""nbtrain.models.llama against Hugging Face: a LlamaForCausalLM / Qwen2ForCausalLM
state_dict loads (strict) into `Llama(LlamaConfig.from_hf(...))` and gives the same
logits (within 1e-5); a row of packed documents gives each document's logits alone;
the model builds on the meta device without buffers; its pipeline layers compute
what it does; from_hf refuses what the model does not compute."""

import pytest
import torch
import transformers
from torch import nn

from nbtrain.models.gpt_pipe import StagePositions
from nbtrain.models.llama import Llama, LlamaConfig, llama_layers

VOCAB, SEQ = 96, 12
LENGTHS = (5, 7)  # two packed documents fill a row of SEQ tokens
SIZES = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
)
CASES = [
    ("llama", False, False),
    ("llama", True, False),
    ("llama", False, True),
    ("qwen2", False, False),
    ("qwen2", True, False),
]


def _hf(model_type, tied, attention_bias, attn="eager"):
    """A random HF model; every parameter perturbed, so zero biases and unit norms
    (the init) cannot hide a weight that is loaded into the wrong place."""
    if model_type == "llama":
        cfg = transformers.LlamaConfig(
            **SIZES, tie_word_embeddings=tied, rope_theta=1000.0, attention_bias=attention_bias
        )
    else:
        cfg = transformers.Qwen2Config(**SIZES, tie_word_embeddings=tied, rope_theta=1000.0)
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(
        cfg, attn_implementation=attn, dtype=torch.float32
    ).eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return hf


def _ours(hf):
    model = Llama(LlamaConfig.from_hf(hf.config.to_dict()))
    model.load_state_dict(hf.state_dict(), strict=True)
    return model.eval()


def _packed():
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (2, SEQ), generator=g)
    position_ids = torch.cat([torch.arange(n) for n in LENGTHS]).expand(2, SEQ)
    return ids, position_ids


def _max_diff(a, b):
    return (a - b).abs().max().item()


@pytest.mark.parametrize("model_type,tied,attention_bias", CASES)
def test_logits_match_hugging_face(model_type, tied, attention_bias):
    hf = _hf(model_type, tied, attention_bias)
    model = _ours(hf)
    cfg = model.config
    assert (cfg.model_type, cfg.tie_word_embeddings, cfg.rope_theta) == (model_type, tied, 1000.0)
    assert cfg.qkv_bias == (model_type == "qwen2") and cfg.attention_bias == attention_bias
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == tied
    assert sorted(n for n, _ in model.named_parameters(remove_duplicate=False)) == sorted(
        n for n, _ in hf.named_parameters(remove_duplicate=False)
    )
    ids = torch.randint(0, VOCAB, (3, 17), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        assert _max_diff(model(ids), hf(ids).logits) <= 1e-5


@pytest.mark.parametrize("model_type,tied,attention_bias", CASES)
def test_packed_documents_match_documents_alone(model_type, tied, attention_bias):
    hf = _hf(model_type, tied, attention_bias, attn="sdpa")
    model = _ours(hf)
    ids, position_ids = _packed()
    with torch.no_grad():
        packed = model(ids, position_ids)
        start = 0
        for n in LENGTHS:
            doc = ids[:, start : start + n]
            assert _max_diff(packed[:, start : start + n], model(doc)) <= 1e-5
            assert _max_diff(packed[:, start : start + n], hf(doc).logits) <= 1e-5
            start += n
        # Without position_ids the row is one sequence: the second document sees the first.
        assert _max_diff(model(ids)[:, LENGTHS[0] :], packed[:, LENGTHS[0] :]) > 1e-3


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_meta_build_materialises_to_the_same_model(tied):
    hf = _hf("qwen2", tied, False)
    reference = _ours(hf)
    with torch.device("meta"):
        model = Llama(reference.config)
    assert list(model.buffers()) == []
    assert all(p.is_meta for p in model.parameters())
    model.to_empty(device="cpu")
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == tied
    model.load_state_dict(hf.state_dict(), strict=True)
    ids, _ = _packed()
    with torch.no_grad():
        assert torch.equal(model.eval()(ids), reference(ids))


def test_init_is_seeded_and_hugging_face_shaped():
    cfg = LlamaConfig(**SIZES, attention_bias=True)
    torch.manual_seed(3)
    a = Llama(cfg)
    torch.manual_seed(3)
    b = Llama(cfg)
    for (name, p), q in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(p, q), name
        if name.endswith("norm.weight"):
            assert torch.equal(p, torch.ones_like(p)), name
        elif name.endswith("bias"):
            assert torch.equal(p, torch.zeros_like(p)), name
        else:
            assert abs(p.std().item() - 0.02) < 0.002, name


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_pipeline_layers_compute_the_model(tied):
    model = _ours(_hf("llama", tied, False))
    layers = llama_layers(model)
    assert len(layers) == model.config.num_hidden_layers + 2
    assert (layers[-1].lm_head.weight is layers[0].embed_tokens.weight) == tied
    ids, position_ids = _packed()
    with torch.no_grad():
        assert torch.equal(nn.Sequential(*layers)(ids), model(ids))

        positions = StagePositions()
        stage = nn.Sequential(*llama_layers(model, positions))
        # Two micro-batches: one packed, one whose row restarts elsewhere.
        other = torch.cat([torch.arange(3), torch.arange(SEQ - 3)]).expand(2, SEQ)
        with positions.feeding(stage, [position_ids, other]):
            first, second = stage(ids), stage(ids)
        assert torch.equal(first, model(ids, position_ids))
        assert torch.equal(second, model(ids, other))
        assert not torch.equal(first, second)


def _hf_dict(family="llama", **overrides):
    make = transformers.LlamaConfig if family == "llama" else transformers.Qwen2Config
    return {**make(**SIZES).to_dict(), **overrides}


def test_from_hf_reads_old_and_new_rope_fields():
    new = _hf_dict(rope_parameters={"rope_theta": 5e5, "rope_type": "default"})
    assert LlamaConfig.from_hf(new).rope_theta == 5e5
    old = {k: v for k, v in _hf_dict().items() if k != "rope_parameters"}
    assert LlamaConfig.from_hf({**old, "rope_theta": 2e5, "rope_scaling": None}).rope_theta == 2e5
    assert LlamaConfig.from_hf(old).rope_theta == 10000.0
    qwen = LlamaConfig.from_hf(_hf_dict("qwen2"))
    assert (qwen.qkv_bias, qwen.attention_bias, qwen.head_dim, qwen.num_key_value_heads) == (
        True,
        False,
        16,
        2,
    )


@pytest.mark.parametrize(
    "overrides,match",
    [
        (dict(model_type="mistral"), "'mistral'"),
        (dict(rope_scaling={"rope_type": "llama3", "factor": 8.0}), "'llama3'"),
        (dict(rope_scaling={"type": "linear", "factor": 2.0}), "'linear'"),
        (
            transformers.LlamaConfig(rope_scaling={"rope_type": "yarn", "factor": 2.0}).to_dict(),
            "'yarn'",
        ),
        (dict(hidden_act="gelu"), "'gelu'"),
        (dict(mlp_bias=True), "mlp_bias"),
    ],
)
def test_from_hf_refuses_what_the_model_does_not_compute(overrides, match):
    with pytest.raises(ValueError, match=match):
        LlamaConfig.from_hf(_hf_dict(**overrides))


def test_from_hf_refuses_qwen2_sliding_window():
    with pytest.raises(ValueError, match="use_sliding_window"):
        LlamaConfig.from_hf(_hf_dict("qwen2", use_sliding_window=True))


@pytest.mark.parametrize(
    "overrides,match",
    [
        (dict(num_key_value_heads=3), "num_key_value_heads = 3"),
        (dict(hidden_size=66), "hidden_size = 66"),
        (dict(head_dim=15), "head_dim = 15"),
        (dict(model_type="gpt2"), "'gpt2'"),
    ],
)
def test_config_validation_names_the_bad_value(overrides, match):
    with pytest.raises(ValueError, match=match):
        LlamaConfig(**{**SIZES, **overrides})
