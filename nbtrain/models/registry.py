"""Model registration: a model's code lives in the researcher's own package, and
`nbtrain.runtime` builds, loads, parallelises and trains it by name.

    from nbtrain.models import register_model
    register_model("mylm", package="mylab.mylm", hf_model_types=["mylm"],
                   impls={"default": "mylab.mylm.protocol"})
    cfg = NBConfig(model_name="mylm", model_config={...})

A model package (a module, or its import path) provides:

    make_config(model_config: dict, hf_config: dict | None) -> config
        the model's configuration from NBConfig.model_config, or from a Hugging Face
        folder's config.json (hf_config; model_config then holds overrides).
    hf_names(config) -> function: plain parameter name -> [HFWeight, ...]
        the checkpoint mapping: where each parameter is in a Hugging Face folder
        (and whether it is stored transposed); how it splits under tensor
        parallelism is the tp plan's business, so the mapping names full tensors.
    hf_config(config) -> dict (optional)
        config.json's fields for `config`, for `Runtime.save_pretrained`; the first
        name `hf_names` gives is where a parameter is written.

and each implementation (`impls`, default: the package itself) is a protocol module:

    build_model(config, parallel) -> nn.Module
        the whole plain model (the runtime may call it under `torch.device("meta")`,
        so nothing may be computed from parameter values here; seeded by the caller).
    load_hf_weights(model, hf_path)
        fills `model` (the plain model, or this rank's wrapped stage) from the folder;
        `nbtrain.models.hf_load.load_hf_weights(model, hf_path, hf_names(config))`.
    make_forward_step(model) -> step(input_ids, position_ids) -> logits
        how the plain model computes a packed batch (position_ids restart at 0 per
        document; None: one sequence per row).
    tp_plan(config) -> dict
        the plan `nbtrain.parallelize` takes (module name pattern -> style).
    pp_stages(model, pipe_size, positions=None) -> list[nn.Module]
        the model as consecutive layers, cut by `nbtrain.pipeline.stage_of`; with a
        `StagePositions`, its layers read each micro-batch's position ids from it.

Missing functions are reported by name when the model is registered. Built in: "gpt"
(nbtrain's GPT), "gpt2" (Hugging Face's GPT-2 on nbtrain's GPT), "llama" (Llama and
Qwen2 folders).
"""

from __future__ import annotations

import importlib
import types
from dataclasses import dataclass, field

PACKAGE_FUNCTIONS = ("make_config", "hf_names")
PROTOCOL_FUNCTIONS = ("build_model", "load_hf_weights", "make_forward_step", "tp_plan", "pp_stages")


@dataclass
class ModelEntry:
    """A registered model: its name, package, Hugging Face model types and protocol
    modules by implementation name."""

    name: str
    package: types.ModuleType
    hf_model_types: list[str] = field(default_factory=list)
    impls: dict[str, types.ModuleType] = field(default_factory=dict)

    def protocol(self, impl: str) -> types.ModuleType:
        """The protocol module of `impl`; KeyError naming the choices."""
        if impl not in self.impls:
            raise KeyError(
                f"model {self.name!r} has no implementation {impl!r}: choose one of "
                f"{sorted(self.impls)}"
            )
        return self.impls[impl]


_REGISTRY: dict[str, ModelEntry] = {}
_BUILTINS = {
    "gpt": ("nbtrain.models.builtin_gpt", []),
    "gpt_moe": ("nbtrain.models.builtin_gpt_moe", []),
    "gpt2": ("nbtrain.models.builtin_gpt2", ["gpt2"]),
    "llama": ("nbtrain.models.builtin_llama", ["llama", "qwen2"]),
}


def _module(what, role: str) -> types.ModuleType:
    if isinstance(what, types.ModuleType):
        return what
    if not isinstance(what, str):
        raise TypeError(
            f"register_model: {role} must be a module or an import path, got {type(what).__name__}"
        )
    try:
        return importlib.import_module(what)
    except ImportError as err:
        raise ImportError(
            f"register_model: cannot import {role} {what!r} ({err}); is its "
            "folder on sys.path (pip install -e your package)?"
        ) from err


def _check(module: types.ModuleType, names, role: str, model: str) -> None:
    missing = [n for n in names if not callable(getattr(module, n, None))]
    if missing:
        raise TypeError(
            f"register_model({model!r}): the {role} {module.__name__} lacks "
            f"{', '.join(missing)}; it must provide {', '.join(names)} "
            "(see nbtrain.models.registry)"
        )


def register_model(
    name: str, package, hf_model_types=(), impls: dict | None = None, *, replace: bool = False
) -> ModelEntry:
    """Registers the model `name`.

    Args:
        name: what NBConfig.model_name calls it.
        package: the model package (module or import path) with make_config and
            hf_names.
        hf_model_types: the config.json `model_type` values it loads ("llama", "qwen2").
        impls: implementation name -> protocol module (or import path); default
            {"default": package}.
        replace: allow registering an existing name again (otherwise ValueError).

    Returns the ModelEntry. Raises TypeError naming each missing function. Local:
    every rank registers (a %%distributed cell, or the script's imports).
    """
    if not isinstance(name, str) or not name:
        raise ValueError(f"register_model: name must be a non-empty string, got {name!r}")
    if (name in _REGISTRY or name in _BUILTINS) and not replace:
        raise ValueError(
            f"register_model: {name!r} is already registered (package "
            f"{get_model(name).package.__name__}); pass replace=True to replace "
            "it, or choose another name"
        )
    pkg = _module(package, "package")
    _check(pkg, PACKAGE_FUNCTIONS, "package", name)
    protocols = {}
    for impl, module in (impls or {"default": pkg}).items():
        protocols[impl] = _module(module, f"implementation {impl!r}")
        _check(protocols[impl], PROTOCOL_FUNCTIONS, f"implementation {impl!r}", name)
    entry = ModelEntry(name, pkg, list(hf_model_types), protocols)
    _REGISTRY[name] = entry
    return entry


def _builtin(name: str) -> ModelEntry | None:
    """The built-in `name`, imported on first use (None if `name` is not built in)."""
    if name not in _REGISTRY and name in _BUILTINS:
        path, hf_types = _BUILTINS[name]
        pkg = importlib.import_module(path)
        _REGISTRY[name] = ModelEntry(name, pkg, list(hf_types), {"default": pkg})
    return _REGISTRY.get(name)


def get_model(name: str) -> ModelEntry:
    """The entry registered as `name`; KeyError naming the registered ones."""
    entry = _builtin(name)
    if entry is None:
        raise KeyError(
            f"no model {name!r} is registered: choose one of {registered()}, or "
            "register yours with nbtrain.models.register_model"
        )
    return entry


def registered() -> list[str]:
    """The registered model names (built-ins included), sorted."""
    return sorted(set(_REGISTRY) | set(_BUILTINS))


def model_for_hf_type(model_type: str) -> ModelEntry:
    """The entry loading Hugging Face `model_type`; KeyError naming the known types."""
    for name in registered():
        types_ = _REGISTRY[name].hf_model_types if name in _REGISTRY else _BUILTINS[name][1]
        if model_type in types_:
            return get_model(name)
    known = sorted(
        {
            t
            for n in registered()
            for t in (_REGISTRY[n].hf_model_types if n in _REGISTRY else _BUILTINS[n][1])
        }
    )
    raise KeyError(
        f"no registered model loads Hugging Face model_type {model_type!r} (known: "
        f"{known}); register one with nbtrain.models.register_model(..., "
        f"hf_model_types=[{model_type!r}])"
    )
