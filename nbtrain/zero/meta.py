"""Models built without memory: parameters on the meta device, each rank then allocating
and initialising only its own shards.

    with nbtrain.empty_parameters():         # parameters on "meta", buffers real
        model = GPT(cfg)                      # or AutoModelForCausalLM.from_config(cfg)
    assign_inits(model, gpt_inits(cfg))       # or normal_inits(0.02), torch_default_inits
    model = nbtrain.wrap(model)               # allocates this rank's shards (zeros)
    nbtrain.init_parameters(model)            # draws this rank's elements

`init_parameters` is the world-size-independent deferred initialisation (zero/init.py):
any world size gathers the same model; each rank holds one full parameter at a time
while it draws (BMTrain's way), or none with `init_parameters(model, by_name=True)`
(values seeded by each parameter's name, for parameters too large to draw whole). Instead of
initialising, a checkpoint can be loaded into the shards (`nbtrain.load`, the runtime's
Hugging Face loading).

`empty_parameters()` (Accelerate's init_empty_weights, parameters only) keeps buffers
real, so buffers computed at construction (a rotary embedding's frequencies) stay
valid; `torch.device("meta")` works too for models without such buffers.

An initialiser rule is `rule(name, module, param) -> initialiser or None`, `name` the
parameter's name in the model, `module` the module owning it; an initialiser is a
ParameterInitializer (or any function of a full-shape tensor, applied to it in place).
"""

from __future__ import annotations

import contextlib
import math

from torch import nn

from .parameter import ParameterInitializer


@contextlib.contextmanager
def empty_parameters():
    """Every parameter registered inside the block is created on the meta device (no
    memory); buffers are not. Local."""
    original = nn.Module.register_parameter

    def register_on_meta(module, name, param):
        original(module, name, param)
        if param is not None and not param.is_meta:
            cls = type(module._parameters[name])
            kwargs = dict(module._parameters[name].__dict__)
            meta = cls(module._parameters[name].to("meta"), requires_grad=param.requires_grad)
            meta.__dict__.update(kwargs)
            module._parameters[name] = meta

    nn.Module.register_parameter = register_on_meta
    try:
        yield
    finally:
        nn.Module.register_parameter = original


def _is_norm(module: nn.Module) -> bool:
    return "norm" in type(module).__name__.lower()


def torch_default_inits(name: str, module: nn.Module, param) -> ParameterInitializer | None:
    """torch's own initialisation (reset_parameters) of nn.Linear, nn.Embedding and norm
    layers: Kaiming-uniform weights and fan-in-bounded biases, N(0, 1) embeddings,
    norms at ones and zeros. None for anything else."""
    leaf = name.rpartition(".")[2]
    if isinstance(module, nn.Linear):
        if leaf == "weight":
            return ParameterInitializer(nn.init.kaiming_uniform_, a=math.sqrt(5))
        bound = 1 / math.sqrt(module.in_features) if module.in_features > 0 else 0
        return ParameterInitializer(nn.init.uniform_, a=-bound, b=bound)
    if isinstance(module, nn.Embedding):
        return ParameterInitializer(nn.init.normal_)
    if _is_norm(module):
        return ParameterInitializer(nn.init.ones_ if leaf == "weight" else nn.init.zeros_)
    return None


def normal_inits(std: float = 0.02, scaled: dict | None = None):
    """The rule most language models use (GPT-2, Llama, Hugging Face's initializer_range):
    linear and embedding weights N(0, std), biases zero, norms at ones and zeros.
    `scaled`: name suffix -> std for weights ending so (GPT-2's residual projections)."""
    scaled = dict(scaled or {})

    def rule(name: str, module: nn.Module, param):
        leaf = name.rpartition(".")[2]
        if _is_norm(module):
            return ParameterInitializer(nn.init.ones_ if leaf == "weight" else nn.init.zeros_)
        if leaf == "bias":
            return ParameterInitializer(nn.init.zeros_)
        if isinstance(module, (nn.Linear, nn.Embedding)) or leaf == "weight":
            sd = next((v for k, v in scaled.items() if name.endswith(k)), std)
            return ParameterInitializer(nn.init.normal_, mean=0.0, std=sd)
        return None

    return rule


def assign_inits(model: nn.Module, rule=torch_default_inits, *, overwrite: bool = False) -> int:
    """Gives each parameter of `model` an `init_method` from `rule` (a tied parameter
    once, under its first name), for `nbtrain.init_parameters` after `wrap`.

    Returns how many were assigned. Raises ValueError naming every parameter on the
    meta device the rule has no initialiser for (it would stay zero). Local.
    """
    owners = {}
    for mod_name, module in model.named_modules():
        for leaf, p in module._parameters.items():
            if p is not None and id(p) not in owners:
                owners[id(p)] = (f"{mod_name}.{leaf}" if mod_name else leaf, module, p)
    missing, count = [], 0
    for name, module, p in owners.values():
        if getattr(p, "init_method", None) is not None and not overwrite:
            continue
        init = rule(name, module, p)
        if init is None:
            if p.is_meta:
                missing.append(f"{name} ({type(module).__name__})")
            continue
        p.init_method = init
        count += 1
    if missing:
        raise ValueError(
            f"assign_inits: no initialiser for {len(missing)} parameter(s) built "
            f"on the meta device: {', '.join(missing)}; give a rule that covers "
            "them, or load a checkpoint into them instead"
        )
    return count
