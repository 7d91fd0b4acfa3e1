"""Each rank's peak memory, term by term, for one layout of one model (the arithmetic
behind `nbtrain.plan`; docs/larger-than-device.md says what each term counts).

Bytes of a rank holding P parameters sharded over its D data-parallel ranks
(the ZeRO paper's arithmetic), b bytes per parameter element:
    parameters   b P / D, + the whole gathered blocks ZeRO-2 keeps from forward to backward
    gradients    b P / D
    optimizer    AdamW's two moments 8 P / D (+ an fp32 master 4 P / D when b = 2);
                 with offload on the host instead
    activations  per layer and token, in units of hidden: 10 + 2 mlp_ratio (Megatron's
                 split ones / tp), x micro-batches in flight, + the logits' three copies
    communication  the blocks gathered in flight (ZeRO-3: the current one and the
                 prefetched one) and two blocks' full-size gradients being reduced
"""

from __future__ import annotations

from dataclasses import dataclass

from ..comm.layout import Layout as CommLayout
from .shape import ModelShape

# Saved for backward per token of one GPT layer, in units of hidden elements (fp32 on
# CPU): LayerNorm inputs and outputs, the residual stream (5); q, k, v, attention
# output and its reshaped copy (5) and the MLP's two wide tensors (2 mlp_ratio), which
# tensor parallelism splits over tp as Megatron does.
LAYER_WHOLE = 5
LAYER_SPLIT = 5
# The logits, their log-softmax kept for backward and their gradient: 3 x tokens x vocab.
LOGIT_COPIES = 3
# A MoE layer per routed copy of a token: the rows each expert multiplies, kept for
# its backward (units of hidden; the experts' wide tensors are the dense MLP's 2
# mlp_ratio, as each expert is mlp_ratio / top_k wide).
MOE_DISPATCH = 1


@dataclass
class Layout:
    """A parallel layout over `world_size` ranks (names of ParallelConfig)."""

    world_size: int = 1
    tp_size: int = 1
    pipe_size: int = 1
    cp_size: int = 1
    ep_size: int = 1
    zero_level: int = 3
    num_micro_batches: int = 1
    offload: bool = False
    checkpointing: bool = False

    def __post_init__(self):
        CommLayout(self.tp_size, self.pipe_size, self.ep_size, self.cp_size).check(
            self.world_size, who="plan"
        )
        if self.zero_level not in (2, 3):
            raise ValueError(f"plan: zero_level={self.zero_level!r}: use 2 or 3")

    @property
    def dp_size(self) -> int:
        return self.world_size // (self.tp_size * self.pipe_size)

    def name(self) -> str:
        parts = [f"dp {self.dp_size}", f"ZeRO-{self.zero_level}"]
        for key, short in (("tp_size", "tp"), ("pipe_size", "pp"), ("cp_size", "cp")):
            if getattr(self, key) > 1:
                parts.append(f"{short} {getattr(self, key)}")
        if self.ep_size > 1:
            parts.append(f"ep {self.ep_size}")
        if self.pipe_size > 1:
            parts.append(f"{self.num_micro_batches} micro-batches")
        if self.offload:
            parts.append("offload")
        if self.checkpointing:
            parts.append("checkpointing")
        return ", ".join(parts)


@dataclass
class RankPlan:
    """One rank role's predicted peak, in bytes, by term. `host` is what offload keeps
    in host memory (not counted in `total`)."""

    role: str
    parameters: int
    gradients: int
    optimizer: int
    activations: int
    communication: int
    host: int = 0
    # False where the peak comes before any gradient exists (see rank_plans).
    gradients_at_peak: bool = True

    @property
    def total(self) -> int:
        state = self.parameters + self.optimizer
        state += self.gradients if self.gradients_at_peak else 0
        return state + self.activations + self.communication


def _stage_items(shape: ModelShape, pipe_size: int) -> list[list[str]]:
    """Which pieces ("embed", "layer", "head") each pipeline stage holds, split by
    parameter count as nbtrain.pipeline.split does."""
    from ..pipeline.split import balanced_split

    layer = shape.layer_numel + shape.expert_numel * shape.moe_layers // max(1, shape.layers)
    items = ["embed"] + ["layer"] * shape.layers + ["head"]
    sizes = [shape.embed_numel] + [layer] * shape.layers + [max(1, shape.head_numel)]
    return [[items[i] for i in r] for r in balanced_split(sizes, pipe_size)]


def rank_plans(
    shape: ModelShape, layout: Layout, batch: int, seq: int, param_bytes: int = 4
) -> list[RankPlan]:
    """One RankPlan per pipeline stage (every rank of a stage alike). `batch`: rows of
    the global batch, `seq`: tokens per row. Local."""
    tp, dp, ep = layout.tp_size, layout.dp_size, layout.ep_size
    b = param_bytes
    moe_share = shape.moe_layers / max(1, shape.layers)
    out = []
    for stage, items in enumerate(_stage_items(shape, layout.pipe_size)):
        layers = items.count("layer")
        dense = layers * shape.layer_numel // tp
        dense += shape.embed_numel // tp if "embed" in items else 0
        dense += shape.head_numel // tp if "head" in items else 0
        if "head" in items and "embed" not in items:  # a tied head: the stage's own copy
            dense += shape.tied_numel // tp
        experts = round(layers * moe_share) * shape.expert_numel // ep
        shard = dense / dp + experts / (dp // ep)  # the experts over the ranks holding them
        # One block's parameters gathered over the dp ranks (experts: over dp / ep).
        block = b * (shape.layer_numel // tp if dp > 1 else 0)
        block += b * (shape.expert_numel * min(1, moe_share) // ep if dp // ep > 1 else 0)
        parameters = b * shard
        if layout.zero_level == 2:  # every gathered block kept from forward to backward
            parameters += b * (dense + experts) - b * shard
        optimizer = (8 + (4 if b == 2 else 0)) * shard
        host = 0
        if layout.offload:
            host, optimizer = optimizer, 0
        # A shard group of one gathers nothing: its buffer is the parameters.
        gathered = 2 * block if layout.zero_level == 3 else 0
        communication = gathered + 2 * block  # and two blocks' gradients being reduced
        activations = _activations(shape, layout, stage, items, batch, seq, b)
        out.append(
            RankPlan(
                role=f"stage {stage}" if layout.pipe_size > 1 else "every rank",
                parameters=int(parameters),
                gradients=int(b * shard),
                optimizer=int(optimizer),
                activations=int(activations),
                communication=int(communication),
                host=int(host),
                # One micro-batch: the peak is at backward's start, every activation
                # held and no gradient made yet (zero_grad drops them; each Block's
                # leaves as a shard while activations are freed). Over several, the
                # earlier micro-batches' gradients are held beside the later ones'
                # activations.
                gradients_at_peak=layout.num_micro_batches > 1,
            )
        )
    return out


def _activations(shape, layout, stage, items, batch, seq, b) -> float:
    """Bytes kept for backward at the peak: per micro-batch in flight, each layer's saved
    tensors (only its input under checkpointing, plus one layer recomputed)."""
    rows = batch / layout.dp_size * layout.cp_size / layout.num_micro_batches
    tokens = rows * seq / layout.cp_size  # this rank's tokens of one micro-batch
    if shape.trace is not None:
        return _traced_activations(shape, layout, stage, items, tokens, b)
    h, tp = shape.hidden, layout.tp_size
    moe_share = shape.moe_layers / max(1, shape.layers)
    per_layer = LAYER_WHOLE + (LAYER_SPLIT + 2 * shape.mlp_ratio) / tp
    per_layer += moe_share * MOE_DISPATCH * shape.top_k
    layers = items.count("layer")
    if layout.checkpointing:
        kept = tokens * h * b * (layers + per_layer)
    else:
        kept = tokens * h * b * per_layer * layers
    in_flight = min(layout.pipe_size - stage, layout.num_micro_batches)
    logits = LOGIT_COPIES * tokens * shape.vocab_size / tp * 4 if "head" in items else 0
    return kept * in_flight + logits


def _traced_activations(shape, layout, stage, items, tokens, b) -> float:
    """The activation term from a measured trace (trace.py): each layer's saved bytes
    per token, the part tensor parallelism splits taken as in a GPT layer's formula;
    outside the layers what the stage holds (the embedding's, or the head's, logits
    and log-softmax), + the logits' gradient made in backward."""
    layer, outside = shape.trace.per_token()
    tp = layout.tp_size
    whole = LAYER_WHOLE + LAYER_SPLIT + 2 * shape.mlp_ratio
    layer *= (LAYER_WHOLE + (LAYER_SPLIT + 2 * shape.mlp_ratio) / tp) / whole
    layers = items.count("layer")
    if layout.checkpointing:
        kept = tokens * (shape.hidden * b * layers + layer)
    else:
        kept = tokens * layer * layers
    in_flight = min(layout.pipe_size - stage, layout.num_micro_batches)
    head = "head" in items
    # Not split over tp: a traced model's tensor-parallel head (models/hf_tp.py) gives
    # its logits back full-width, so the logits, their log-softmax and their gradient
    # are whole on every rank (planned / tp, "llama" at tp 2 read 10.5% low).
    logits_grad = tokens * shape.vocab_size * 4 if head else 0
    if layout.pipe_size > 1:  # the embedding's few saved tensors go with stage 0
        outside = outside if head else shape.hidden * b
    return (kept + tokens * outside) * in_flight + logits_grad
