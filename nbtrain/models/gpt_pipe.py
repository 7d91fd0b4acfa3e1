"""`nbtrain.models.GPT` as a list of pipeline layers, for `nbtrain.pipeline.stage_of`.

    layers = gpt_layers(GPT(cfg))          # [embedding, block 0, ..., block L-1, head]
    stage = nbtrain.pipeline.stage_of(layers)

The layers share the GPT's own modules (and weights), so a pipeline made from them
computes what the GPT does. With tied embeddings the head holds the embedding's
weight too: `stage_of` finds the weight on the first and last stages and
`pipeline.run` sums its gradient over both, so it stays one parameter.

Packed documents: stages pass one tensor (the hidden states), so position ids cannot
travel with them. Every rank holds every micro-batch's position ids instead, and the
layers read the current one from a `StagePositions`:

    positions = StagePositions()
    stage = wrap(stage_of(gpt_layers(gpt, positions)))
    with positions.feeding(stage, [ids.position_ids for ids in micro_batches]):
        pipeline.run(stage, ...)
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
from torch import nn

from .gpt import GPT, TransformerLayer, embed


class StagePositions:
    """The position ids (rows, seq) of the micro-batch a pipeline stage is computing,
    read by the layers `gpt_layers(gpt, positions)` makes; None (outside `feeding`)
    means one causal sequence per row, as without packing.

    `feeding(stage, position_ids)` hands the stage's k-th forward micro-batch k's ids:
    the GPipe and 1F1B schedules run each stage's forwards in micro-batch order. Not
    for activation checkpointing (`wrap(..., use_checkpoint=True)`): a forward
    recomputed in backward would read whichever ids are current then.
    """

    def __init__(self):
        self.current: torch.Tensor | None = None
        self.current_docs: torch.Tensor | None = None
        self.cp = None  # a ContextParallel while feeding sequence shards

    @contextmanager
    def feeding(self, stage: nn.Module, position_ids: list, doc_ids: list | None = None, cp=None):
        """During the context, each forward of `stage` (one per micro-batch) makes the
        next of `position_ids` (one int64 (rows, seq) tensor per micro-batch, any
        device) current. Under context parallelism (`cp`, a ContextParallel) the
        tensors are this rank's sequence shards and `doc_ids` their document ids
        (`ContextParallel.shard_batch`): the layers then run ring attention. Local."""
        pending = list(position_ids)
        docs = list(doc_ids) if doc_ids is not None else [None] * len(pending)
        self.cp = cp

        def next_micro_batch(module, args):
            if not pending:
                raise RuntimeError(
                    f"StagePositions: the stage ran more forwards than the "
                    f"{len(position_ids)} micro-batches it was fed"
                )
            self.current = pending.pop(0)
            self.current_docs = docs.pop(0)

        hook = stage.register_forward_pre_hook(next_micro_batch)
        try:
            yield self
        finally:
            hook.remove()
            self.current = self.current_docs = self.cp = None

    def read(self, x: torch.Tensor) -> torch.Tensor | None:
        """The current ids on x's device, checked against x's (rows, seq). Local."""
        ids = self.current
        if ids is None:
            return None
        if tuple(ids.shape) != tuple(x.shape[:2]):
            raise ValueError(
                f"StagePositions: position ids of shape {tuple(ids.shape)} for "
                f"activations of shape {tuple(x.shape)}: feed one (rows, seq) "
                "tensor per micro-batch, in order (sequence-parallel stages "
                "are not supported)"
            )
        return ids.to(x.device, non_blocking=True)


class Embed(nn.Module):
    """Token and position embeddings: ids (batch, seq) -> hidden (batch, seq, dim);
    position_ids (or the fed ones, see StagePositions) start each packed document at 0."""

    def __init__(self, gpt: GPT, positions: StagePositions | None = None):
        super().__init__()
        self.tok, self.pos = gpt.tok, gpt.pos
        self.positions = positions

    def forward(self, idx, position_ids=None):
        if position_ids is None and self.positions is not None:
            position_ids = self.positions.read(idx)
        return embed(self.tok, self.pos, idx, position_ids)


class FedLayer(TransformerLayer):
    """A GPT transformer layer (its own modules, under the same names) whose attention
    stays within the packed documents of the fed position ids (see StagePositions)."""

    def __init__(self, layer: TransformerLayer, positions: StagePositions):
        nn.Module.__init__(self)
        self.ln1, self.attn, self.ln2, self.mlp = layer.ln1, layer.attn, layer.ln2, layer.mlp
        self.positions = positions

    def forward(self, x, position_ids=None):
        if position_ids is None:
            position_ids = self.positions.read(x)
        cp = self.positions.cp
        if cp is not None:  # a sequence shard: ring attention within the documents
            docs = self.positions.current_docs
            return super().forward(
                x, cp=cp, doc_ids=None if docs is None else docs.to(x.device, non_blocking=True)
            )
        return super().forward(x, position_ids)


class Head(nn.Module):
    """Final norm and output projection: hidden -> logits."""

    def __init__(self, gpt: GPT):
        super().__init__()
        self.ln_f, self.head = gpt.ln_f, gpt.head

    def forward(self, x):
        return self.head(self.ln_f(x))


def gpt_layers(gpt: GPT, positions: StagePositions | None = None) -> list[nn.Module]:
    """The GPT as consecutive layers: embedding, transformer blocks, head. With
    `positions`, the embedding and blocks read packed documents' position ids from it
    (the blocks become FedLayers sharing the GPT's modules); without, the blocks are
    the GPT's own and every row is one causal sequence."""
    if positions is None:
        return [Embed(gpt), *gpt.layers, Head(gpt)]
    return [Embed(gpt, positions), *(FedLayer(layer, positions) for layer in gpt.layers), Head(gpt)]
