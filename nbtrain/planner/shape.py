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


def shape_of(source) -> tuple[ModelShape, object]:
    """(ModelShape, the ParallelConfig the source carries or None) of a RuntimeConfig,
    NBConfig, GPTConfig / MoEGPTConfig, or a GPT-shaped model (`.cfg` and `.layers`,
    on any device, the meta device included). Local; allocates nothing."""
    import torch

    if isinstance(source, torch.nn.Module):
        cfg = getattr(source, "cfg", None)
        if cfg is None or not hasattr(source, "layers"):
            raise TypeError(
                f"plan: a {type(source).__name__} has no GPT-shaped config (.cfg with "
                "hidden, heads, layers, vocab_size) and .layers: give the model's config "
                "or a RuntimeConfig instead"
            )
        return _from_model(source, cfg), None
    cfg, parallel = _config_of(source)
    for name in ("hidden", "heads", "layers", "vocab_size"):
        if not hasattr(cfg, name):
            raise TypeError(
                f"plan: {type(source).__name__} has no {name!r}: give a RuntimeConfig, "
                "NBConfig, GPTConfig or MoEGPTConfig, or a model built from one"
            )
    with torch.device("meta"):
        model = _meta_model(cfg)
    return _from_model(model, cfg), parallel


def _meta_model(cfg):
    from ..models.gpt import GPT
    from ..models.gpt_moe import MoEGPT, MoEGPTConfig

    return MoEGPT(cfg) if isinstance(cfg, MoEGPTConfig) else GPT(cfg)


def _from_model(model, cfg) -> ModelShape:
    def numel(module, experts: bool) -> int:
        return sum(
            p.numel()
            for n, p in module.named_parameters()
            if (n.rsplit(".", 1)[-1] in EXPERT_WEIGHTS) == experts
        )

    layers = list(model.layers)
    seen = {id(p) for layer in layers for p in layer.parameters()}
    outside = [(n, p) for n, p in model.named_parameters() if id(p) not in seen]
    embed = sum(p.numel() for n, p in outside if n.split(".")[0] in ("tok", "pos", "wte", "wpe"))
    expert = [numel(layer, True) for layer in layers]
    return ModelShape(
        hidden=cfg.hidden,
        heads=cfg.heads,
        layers=len(layers),
        vocab_size=cfg.vocab_size,
        mlp_ratio=getattr(cfg, "mlp_ratio", 4),
        layer_numel=max(numel(layer, False) for layer in layers),
        embed_numel=embed,
        head_numel=sum(p.numel() for _, p in outside) - embed,
        expert_numel=max(expert),
        moe_layers=sum(1 for e in expert if e),
        num_experts=getattr(cfg, "num_experts", 1),
        top_k=getattr(cfg, "top_k", 1),
        tied_numel=model.tok.weight.numel() if getattr(cfg, "tie_embeddings", False) else 0,
    )
