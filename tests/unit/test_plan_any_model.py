"""nbtrain.plan reads any model: every registered model by name, a user's own
registered package, a transformers config, a transformers model and a plain nn.Module
built on the meta device, and a model with real weights (traced on this rank). Models
without a formula get their activation term from a traced micro-batch, and say so."""

import pytest
import torch
from torch import nn

import nbtrain
from nbtrain.models.registry import registered
from nbtrain.planner.shape import shape_of
from nbtrain.planner.trace import trace_activations
from nbtrain.runtime import NBConfig, RuntimeConfig

LLAMA = dict(
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
)
CONFIGS = {
    "gpt": {"preset": "tiny"},
    "gpt_moe": {"preset": "tiny"},
    "llama": LLAMA,
    "gpt2": dict(vocab_size=512, n_embd=64, n_layer=3, n_head=4, n_positions=64),
}


class Tiny(nn.Module):
    """A user's model: an untied embedding and head around a list of 3 blocks."""

    def __init__(self, vocab=300, width=32):
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))
            for _ in range(3)
        )
        self.head = nn.Linear(width, vocab, bias=False)

    def forward(self, ids):
        x = self.embed(ids)
        for block in self.blocks:
            x = x + block(x)
        return self.head(x)


def _numel(model):
    return sum(p.numel() for p in model.parameters())


def test_every_registered_model_is_planned_by_name():
    assert set(CONFIGS) <= set(registered()), registered()
    for name, config in CONFIGS.items():
        source = RuntimeConfig(
            "nbtrain", backend_cfg=NBConfig(model_name=name, model_config=config)
        )
        p = nbtrain.plan(source, dict(zero_level=3), batch=4, seq=32, world_size=2)
        assert p.peak > 0 and p.ranks[0].parameters > 0, (name, p.table())
        if name == "llama":  # no formula: traced, and the table says where
            assert p.shape.trace.where == "the meta device", p.table()
            assert (
                "activations traced: one micro-batch of 32 tokens on the meta device" in p.table()
            )


def test_a_user_module_on_the_meta_device_is_planned_exactly():
    with torch.device("meta"):
        model = Tiny()
    shape, _ = shape_of(model, seq=16)
    assert shape.layers == 3 and shape.vocab_size == 300 and shape.hidden == 32
    assert shape.layers * shape.layer_numel + shape.embed_numel + shape.head_numel == _numel(model)
    p = nbtrain.plan(model, dict(zero_level=3), batch=2, seq=16, world_size=2)
    assert p.ranks[0].gradients == 4 * _numel(model) // 2, p.table()  # fp32, over 2 ranks
    with pytest.raises(ValueError, match="does not say its sequence length: give seq="):
        nbtrain.plan(model, dict(zero_level=3), batch=2, world_size=2)


def test_the_trace_counts_what_autograd_saves_by_layer():
    with torch.device("meta"):
        model = Tiny(vocab=300, width=32)
    trace = trace_activations(model, list(model.blocks), seq=16, rows=2)
    # One block saves its input (32), the first Linear's output and GELU's (2 x 128),
    # 4-byte floats, per token: 288 x 4 bytes; outside: the embedding's ids are not
    # floats and the head saves the last residual (32), the loss its log-softmax (300).
    assert trace.tokens == 32 and trace.where == "the meta device"
    assert trace.layer_bytes == 32 * (32 + 2 * 128) * 4, trace
    assert trace.outside_bytes >= 32 * (32 + 300) * 4, trace
    real = Tiny(vocab=300, width=32)  # real weights: a real forward on this rank
    assert trace_activations(real, list(real.blocks), seq=16, rows=2).where == "this rank"


def test_transformers_configs_and_models():
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(**LLAMA, max_position_embeddings=64)
    p = nbtrain.plan(config, dict(zero_level=2), batch=2, world_size=2)
    assert p.seq == 64 and p.shape.trace.tokens == 64, p.table()  # its own length
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(config)
    q = nbtrain.plan(model, dict(zero_level=2), batch=2, world_size=2)
    assert q.peak == p.peak
    shape, _ = shape_of(model)
    assert shape.layers == 3 and shape.heads == 4
    tied = shape.tied_numel > 0
    assert shape.layers * shape.layer_numel + shape.embed_numel + shape.head_numel == _numel(
        model
    ), (shape, tied)


def test_a_users_registered_package_is_planned_by_name():
    import types

    from nbtrain.models import registry

    package = types.ModuleType("users_tiny")
    package.make_config = lambda model_config, hf_config=None: dict(model_config)
    package.hf_names = lambda config=None: lambda plain: []
    package.build_model = lambda config, parallel=None: Tiny(**config)
    for name in ("load_hf_weights", "make_forward_step", "tp_plan", "pp_stages"):
        setattr(package, name, lambda *a, **k: None)
    registry.register_model("users_tiny", package, replace=True)
    try:
        source = RuntimeConfig(
            "nbtrain",
            backend_cfg=NBConfig(model_name="users_tiny", model_config={"vocab": 300}),
        )
        p = nbtrain.plan(source, dict(zero_level=3), batch=2, seq=16, world_size=2)
    finally:
        registry._REGISTRY.pop("users_tiny")
    assert p.shape.layers == 3 and p.shape.vocab_size == 300, p.table()
    assert p.ranks[0].gradients == 4 * _numel(Tiny()) // 2, p.table()


def test_the_command_line_plans_llama_and_says_what_is_missing(capsys):
    import json

    from nbtrain.planner.cli import main

    assert main(["--model", "llama", "--model-config", json.dumps(LLAMA), "--seq-len", "32"]) == 0
    assert "activations traced" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="give --hf-path FOLDER, or every config field"):
        main(["--model", "llama"])
    with pytest.raises(SystemExit, match="--model-size is for nbtrain's GPTs"):
        main(["--model", "llama", "--model-size", "tiny"])


def test_the_command_line_plans_a_transformers_folder(tmp_path, capsys):
    transformers = pytest.importorskip("transformers")
    from nbtrain.planner.cli import main

    transformers.LlamaConfig(**LLAMA, max_position_embeddings=64).save_pretrained(tmp_path)
    argv = ["--model", "hf", "--hf-path", str(tmp_path), "--ranks", "2", "--zero-level", "3"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "seq 64" in out and "activations traced: one micro-batch of 64 tokens" in out, out
    with pytest.raises(SystemExit, match="--hf-path"):
        main(["--model", "hf"])
