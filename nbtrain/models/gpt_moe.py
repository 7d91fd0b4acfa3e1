"""The GPT with mixture-of-experts MLPs (nbtrain.moe.MoE): a routing idea at notebook scale.

`MoEGPT(MoEGPTConfig(num_experts=4, top_k=2))` is nbtrain's GPT whose MLP, in every
`moe_every`-th layer, is a MoE layer. Its experts split over the expert-parallel group
the caller gives, `MoEGPT(cfg, ep_group=ExpertParallel.from_topology())` for the one of
`init_distributed(ep_size=...)`; without one every expert is local, whatever the topology
(the same computation as ep 1). By default each expert's inner width is the dense
MLP's divided by top_k, so a token meets as many MLP parameters as in the dense GPT of
the same config (equal active parameters), while the model holds num_experts / top_k
times as many.

`model.loss(idx, target)` adds the layers' auxiliary balance losses (balance="aux") to
the cross-entropy: each rank's loss is over its own tokens, as data parallelism wants.
`nbtrain.wrap(model)` shards it: the experts over the ranks holding the same experts,
everything else over the data-parallel ranks. `router_stats(model)` reads the routing of
the last forward, for telemetry.

Built on the meta device (`nbtrain.empty_parameters()`), `assign_inits(model,
moe_inits(cfg))` gives every parameter its initialiser: the GPT's, and nn.Linear's
U(+-1/sqrt(fan_in)) for the experts. The experts' deferred draws follow their slice,
so they are the same at any world size for one ep size (not across ep sizes).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ..moe import BALANCE_MODES, MoE
from ..zero import ParameterInitializer
from .gpt import GPT, GPTConfig, gpt_inits


@dataclass
class MoEGPTConfig(GPTConfig):
    num_experts: int = 4
    top_k: int = 2
    expert_hidden: int | None = None  # None: mlp_ratio * hidden // top_k (equal active)
    moe_every: int = 1  # every moe_every-th layer (1, 2, ...) is MoE
    capacity_factor: float | None = None  # None: dropless
    balance: str = "aux"  # "aux", "bias" or "none"
    aux_loss_weight: float = 0.01
    bias_update_rate: float = 1e-3
    moe_chunks: int = 1  # pipelined chunks of each MoE layer's exchange (MoE's chunks=)

    def __post_init__(self):
        super().__post_init__()
        if self.moe_every < 1:
            raise ValueError(f"moe_every={self.moe_every}: give 1 (every layer) or more")
        if self.balance not in BALANCE_MODES:
            raise ValueError(f"balance={self.balance!r}: use one of {BALANCE_MODES}")
        if self.expert_hidden is None:
            self.expert_hidden = max(1, self.mlp_ratio * self.hidden // self.top_k)

    def is_moe(self, layer: int) -> bool:
        return (layer + 1) % self.moe_every == 0

    def dense(self) -> GPTConfig:
        """The dense GPT with the same active parameters per token (when expert_hidden
        is the default): the same config without experts."""
        keep = {f: getattr(self, f) for f in GPTConfig.__dataclass_fields__}
        return GPTConfig(**keep)


class MoEGPT(GPT):
    """nbtrain's GPT with MoE MLPs. Token ids (B, T) [+ position_ids] -> logits.
    `ep_group`: the experts' layout, each MoE layer's `group=` (an `ExpertParallel`,
    `ExpertParallel.from_topology()` for nbtrain's ep group; None: every expert local).
    `context_parallel` as the GPT's (None: whole sequences)."""

    def __init__(self, cfg: MoEGPTConfig, ep_group=None, context_parallel=None):
        super().__init__(cfg, context_parallel)
        moe_index = 0
        for i, layer in enumerate(self.layers):
            if cfg.is_moe(i):
                layer.mlp = MoE(
                    cfg.hidden,
                    cfg.expert_hidden,
                    cfg.num_experts,
                    cfg.top_k,
                    group=ep_group,
                    capacity_factor=cfg.capacity_factor,
                    balance=cfg.balance,
                    aux_loss_weight=cfg.aux_loss_weight,
                    bias_update_rate=cfg.bias_update_rate,
                    label=f"moe.{moe_index}",
                    chunks=cfg.moe_chunks,
                )
                moe_index += 1
                nn.init.normal_(layer.mlp.router.weight, std=0.02)

    def moe_layers(self) -> list[MoE]:
        return [m for m in self.modules() if isinstance(m, MoE)]

    def aux_loss(self) -> torch.Tensor:
        """The sum of the MoE layers' auxiliary losses of the last forward."""
        losses = [m.aux_loss for m in self.moe_layers()]
        return torch.stack([loss.to(losses[0].device) for loss in losses]).sum()

    def loss(self, idx, target, position_ids=None):
        ce = super().loss(idx, target, position_ids)
        return ce + self.aux_loss().to(ce.device)


def moe_inits(cfg: MoEGPTConfig):
    """The MoE GPT's initialisation as a rule for `nbtrain.assign_inits`: gpt_inits for
    everything but the experts, U(+-1/sqrt(fan_in)) for each expert's w_in (fan_in =
    hidden) and w_out (fan_in = expert_hidden), as MoE.reset_experts draws them."""
    dense = gpt_inits(cfg)
    bounds = {"w_in": cfg.hidden**-0.5, "w_out": cfg.expert_hidden**-0.5}

    def rule(name, module, param):
        leaf = name.rpartition(".")[2]
        if isinstance(module, MoE) and leaf in bounds:
            b = bounds[leaf]
            return ParameterInitializer(nn.init.uniform_, a=-b, b=b)
        return dense(name, module, param)

    return rule


def router_stats(model: nn.Module) -> dict:
    """The routing of each MoE layer's last forward: {"<label>.balance": max / mean
    load, "<label>.dropped": assignments dropped, "<label>.load": tokens per expert},
    labels "moe.0", "moe.1", ... counting MoE layers in order. Local (the layers
    already summed their load over the ep group)."""
    out = {}
    for m in model.modules():
        if not isinstance(m, MoE) or not m.stats:
            continue
        out[f"{m.label}.balance"] = m.stats["balance"]
        out[f"{m.label}.dropped"] = m.stats["dropped"]
        out[f"{m.label}.load"] = list(m.stats["tokens_per_expert"])
    return out
