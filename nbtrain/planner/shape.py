"""What the planner knows of a model: its widths and its parameters by kind, read from a
config (GPTConfig, MoEGPTConfig, NBConfig, RuntimeConfig) or a model (one built on the
meta device is enough: only shapes are read)."""

from __future__ import annotations

from dataclasses import dataclass

EXPERT_WEIGHTS = ("w_in", "w_out")  # nbtrain.moe.MoE's stacked expert weights


@dataclass
class ModelShape:
    """A transformer's sizes, as the planner counts them.

    Attributes:
        hidden, heads, layers, vocab_size, mlp_ratio: the config's widths.
        layer_numel: parameters of one transformer layer outside its experts.
        expert_numel: parameters of one MoE layer's experts, all of them (0: dense).
        embed_numel: token and position embeddings.
        head_numel: final norm and (untied) output projection.
        moe_layers: how many layers are MoE; num_experts, top_k as the config's.
        tied_numel: the output projection's weight when it is the token embedding's
            (a last pipeline stage holds it too).
    """

    hidden: int
    heads: int
    layers: int
    vocab_size: int
    mlp_ratio: int
    layer_numel: int
    embed_numel: int
    head_numel: int
    expert_numel: int = 0
    moe_layers: int = 0
    num_experts: int = 1
    top_k: int = 1
    tied_numel: int = 0
    # Set for models without a formula: the activation term comes from this trace.
    trace: object = None
    seq_len: int | None = None  # the model's own sequence length, when it says

    @property
    def numel(self) -> int:
        return (
            self.layers * self.layer_numel
            + self.moe_layers * self.expert_numel
            + self.embed_numel
            + self.head_numel
        )


def _config_of(source):
    """(model config, ParallelConfig or None) of a RuntimeConfig, NBConfig or config."""
    backend = getattr(source, "backend_cfg", None)
    if backend is not None:
        return backend.make_config(getattr(source, "hf_path", None)), backend.parallel
    if hasattr(source, "make_config") and hasattr(source, "parallel"):
        return source.make_config(), source.parallel
    return source, None


GPT_FIELDS = ("hidden", "heads", "layers", "vocab_size")
TRACE_SEQ = 128  # tokens per row of the traced micro-batch (scaled to the planned seq)


def shape_of(source, seq: int | None = None) -> tuple[ModelShape, object]:
    """(ModelShape, the ParallelConfig the source carries or None) of:

    - a RuntimeConfig or NBConfig of any registered model, a GPTConfig / MoEGPTConfig;
    - a transformers config (`PretrainedConfig`: its causal LM is built on the meta
      device);
    - a model: nbtrain's GPT, a transformers model, or any `nn.Module` with a list of
      blocks (built on the meta device is enough).

    nbtrain's GPTs are counted by formula; every other model's activation term comes
    from a trace of one micro-batch (trace.py: on the meta device, or a real forward of
    one row on this rank for a model with real weights), `seq` tokens long (default
    128). Local; on the meta device allocates nothing.
    """
    import torch

    if isinstance(source, torch.nn.Module):
        cfg = getattr(source, "cfg", None)
        if cfg is not None and hasattr(source, "layers") and _gpt_shaped(cfg):
            return _from_model(source, cfg), None
        return _generic(source, getattr(source, "config", cfg), seq), None
    if _is_hf_config(source):
        return _generic(_hf_meta_model(source), source, seq), None
    cfg, parallel = _config_of(source)
    if _gpt_shaped(cfg) and _is_builtin_gpt_config(cfg):
        with torch.device("meta"):
            model = _meta_model(cfg)
        return _from_model(model, cfg), parallel
    protocol = _protocol_of(source)
    if protocol is None:
        raise TypeError(
            f"plan: cannot read a model from a {type(source).__name__}: give a "
            "RuntimeConfig or NBConfig, a GPTConfig or MoEGPTConfig, a transformers "
            "config, or a model (an nn.Module with a list of blocks; the meta device "
            "is enough)"
        )
    from ..runtime.config import ParallelConfig

    with torch.device("meta"):
        model = protocol.build_model(cfg, ParallelConfig())
    return _generic(model, cfg, seq), parallel


def _gpt_shaped(cfg) -> bool:
    return all(hasattr(cfg, name) for name in GPT_FIELDS)


def _is_builtin_gpt_config(cfg) -> bool:
    from ..models.gpt import GPTConfig
    from ..models.gpt_moe import MoEGPTConfig

    return isinstance(cfg, (GPTConfig, MoEGPTConfig))


def _protocol_of(source):
    """The registered model protocol of a RuntimeConfig or NBConfig, else None."""
    nb = getattr(source, "backend_cfg", source)
    return nb.protocol() if hasattr(nb, "protocol") and hasattr(nb, "make_config") else None


def _is_hf_config(source) -> bool:
    return any(c.__name__.lower() == "pretrainedconfig" for c in type(source).__mro__)


def _hf_meta_model(config):
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


def _config_value(cfg, *names, default=None):
    for name in names:
        value = getattr(cfg, name, None) if cfg is not None else None
        if value is not None:
            return value
    return default


def layer_list(model):
    """The model's list of blocks: the ModuleList (or Sequential) of two or more
    children holding the most parameters."""
    import torch

    best, best_numel = None, 0
    for module in model.modules():
        if isinstance(module, (torch.nn.ModuleList, torch.nn.Sequential)) and len(module) > 1:
            numel = sum(p.numel() for p in module.parameters())
            if numel > best_numel:
                best, best_numel = module, numel
    if best is None:
        raise TypeError(
            f"plan: {type(model).__name__} has no list of blocks (an nn.ModuleList or "
            "nn.Sequential of its layers): the planner shards and gathers per block"
        )
    return list(best)


def _generic(model, cfg, seq: int | None) -> ModelShape:
    """A ModelShape of any model with a list of blocks; activations traced."""
    import torch

    from ..zero import full_numel  # the whole tensor's count, for a tp or expert slice
    from .trace import trace_activations

    layers = layer_list(model)
    inside = {id(p) for layer in layers for p in layer.parameters()}
    embeddings = [
        m
        for m in model.modules()
        if isinstance(m, torch.nn.Embedding) and id(m.weight) not in inside
    ]
    if not embeddings:
        raise TypeError(
            f"plan: {type(model).__name__} has no token embedding (nn.Embedding) outside "
            "its blocks: the planner plans language models"
        )
    tok = max(embeddings, key=lambda e: e.num_embeddings)
    outside = [p for p in model.parameters() if id(p) not in inside]  # tied: once
    embed = sum(full_numel(e.weight) for e in embeddings)
    tied = any(getattr(m, "weight", None) is tok.weight and m is not tok for m in model.modules())
    per_layer = [sum(full_numel(p) for p in layer.parameters()) for layer in layers]
    trace = trace_activations(model, layers, seq or TRACE_SEQ)
    return ModelShape(
        hidden=tok.embedding_dim,
        heads=int(_config_value(cfg, "num_attention_heads", "n_head", "heads", default=1)),
        layers=len(layers),
        vocab_size=tok.num_embeddings,
        mlp_ratio=4,
        layer_numel=max(per_layer),
        embed_numel=embed,
        head_numel=sum(full_numel(p) for p in outside) - embed,
        tied_numel=full_numel(tok.weight) if tied else 0,
        trace=trace,
        seq_len=_config_value(cfg, "seq_len", "max_position_embeddings", "n_positions"),
    )


def _meta_model(cfg):
    from ..models.gpt import GPT
    from ..models.gpt_moe import MoEGPT, MoEGPTConfig

    return MoEGPT(cfg) if isinstance(cfg, MoEGPTConfig) else GPT(cfg)


def _from_model(model, cfg) -> ModelShape:
    from ..zero import full_numel  # the whole tensor's count, for a tp or expert slice

    def numel(module, experts: bool) -> int:
        return sum(
            full_numel(p)
            for n, p in module.named_parameters()
            if (n.rsplit(".", 1)[-1] in EXPERT_WEIGHTS) == experts
        )

    layers = list(model.layers)
    seen = {id(p) for layer in layers for p in layer.parameters()}
    outside = [(n, p) for n, p in model.named_parameters() if id(p) not in seen]
    embeddings = ("tok", "pos", "wte", "wpe")
    embed = sum(full_numel(p) for n, p in outside if n.split(".")[0] in embeddings)
    expert = [numel(layer, True) for layer in layers]
    return ModelShape(
        hidden=cfg.hidden,
        heads=cfg.heads,
        layers=len(layers),
        vocab_size=cfg.vocab_size,
        mlp_ratio=getattr(cfg, "mlp_ratio", 4),
        layer_numel=max(numel(layer, False) for layer in layers),
        embed_numel=embed,
        head_numel=sum(full_numel(p) for _, p in outside) - embed,
        expert_numel=max(expert),
        moe_layers=sum(1 for e in expert if e),
        num_experts=getattr(cfg, "num_experts", 1),
        top_k=getattr(cfg, "top_k", 1),
        tied_numel=full_numel(model.tok.weight) if getattr(cfg, "tie_embeddings", False) else 0,
    )
