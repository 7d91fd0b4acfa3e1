"""nbtrain.models.register_model: what a package must provide, reported by name, and the
built-ins found by name and by Hugging Face model type."""

import types

import pytest

from nbtrain.models import get_model, register_model, registered
from nbtrain.models.registry import model_for_hf_type


def _module(name, *functions):
    module = types.ModuleType(name)
    for f in functions:
        setattr(module, f, lambda *a, **k: None)
    return module


PACKAGE = ("make_config", "hf_names")
PROTOCOL = ("build_model", "load_hf_weights", "make_forward_step", "tp_plan", "pp_stages")


def test_missing_protocol_functions_are_named():
    pkg = _module("halfdone", *PACKAGE)
    protocol = _module("halfdone.protocol", "build_model", "tp_plan")
    with pytest.raises(
        TypeError,
        match=r"halfdone.protocol lacks load_hf_weights, "
        r"make_forward_step, pp_stages",
    ):
        register_model("halfdone", package=pkg, impls={"default": protocol})
    assert "halfdone" not in registered()


def test_missing_package_functions_are_named():
    with pytest.raises(TypeError, match=r"package noconfig lacks make_config"):
        register_model("noconfig", package=_module("noconfig", "hf_names", *PROTOCOL))


def test_a_complete_package_registers_once_unless_replaced():
    pkg = _module("complete", *PACKAGE, *PROTOCOL)
    entry = register_model("complete", package=pkg, hf_model_types=["complete-lm"])
    assert get_model("complete") is entry and entry.protocol("default") is pkg
    assert model_for_hf_type("complete-lm") is entry
    with pytest.raises(ValueError, match=r"'complete' is already registered.*replace=True"):
        register_model("complete", package=pkg)
    assert register_model("complete", package=pkg, replace=True).package is pkg
    with pytest.raises(KeyError, match=r"no implementation 'fast'.*\['default'\]"):
        entry.protocol("fast")


def test_bad_names_and_paths_are_clear_errors():
    with pytest.raises(ImportError, match=r"cannot import package 'no_such_pkg_xyz'"):
        register_model("ghost", package="no_such_pkg_xyz")
    with pytest.raises(KeyError, match=r"no model 'bert' is registered.*'gpt2'.*register_model"):
        get_model("bert")
    with pytest.raises(KeyError, match=r"model_type 'mamba'.*known: \[.*'qwen2'"):
        model_for_hf_type("mamba")
    with pytest.raises(ValueError, match=r"'gpt' is already registered"):
        register_model("gpt", package=_module("x", *PACKAGE, *PROTOCOL))


def test_builtins_are_found_by_name_and_model_type():
    assert {"gpt", "gpt2", "llama"} <= set(registered())
    assert model_for_hf_type("qwen2").name == "llama"
    assert model_for_hf_type("gpt2").name == "gpt2"
    for name in ("gpt", "gpt2", "llama"):
        entry = get_model(name)
        for f in PACKAGE:
            assert callable(getattr(entry.package, f))
        for f in PROTOCOL:
            assert callable(getattr(entry.protocol("default"), f))


def test_gpt2_configs_nbtrain_cannot_compute_are_refused():
    gpt2 = get_model("gpt2").package
    with pytest.raises(ValueError, match=r"activation_function='relu'"):
        gpt2.make_config({"activation_function": "relu"})
    with pytest.raises(ValueError, match=r"reorder_and_upcast_attn=True"):
        gpt2.make_config({"reorder_and_upcast_attn": True})
    cfg = gpt2.make_config(
        {"n_embd": 32, "n_head": 4, "n_layer": 2, "n_positions": 16, "vocab_size": 50}
    )
    assert (cfg.hidden, cfg.heads, cfg.layers, cfg.seq_len, cfg.mlp_ratio) == (32, 4, 2, 16, 4)
    assert cfg.qkv_bias and cfg.activation == "gelu_tanh" and cfg.tie_embeddings
