"""`nbtrain.models.GPT` as a list of pipeline layers, for `nbtrain.pipeline.stage_of`.

    layers = gpt_layers(GPT(cfg))          # [embedding, block 0, ..., block L-1, head]
    stage = nbtrain.pipeline.stage_of(layers)

The layers share the GPT's own modules (and weights), so a pipeline made from them
computes what the GPT does. With tied embeddings the head holds the embedding's
weight too: `stage_of` finds the weight on the first and last stages and
`pipeline.run` sums its gradient over both, so it stays one parameter.
"""
from __future__ import annotations

import torch
from torch import nn

from .gpt import GPT


class Embed(nn.Module):
    """Token and position embeddings: ids (batch, seq) -> hidden (batch, seq, dim)."""

    def __init__(self, gpt: GPT):
        super().__init__()
        self.tok, self.pos = gpt.tok, gpt.pos

    def forward(self, idx):
        t = idx.shape[1]
        return self.tok(idx) + self.pos(torch.arange(t, device=idx.device))


class Head(nn.Module):
    """Final norm and output projection: hidden -> logits."""

    def __init__(self, gpt: GPT):
        super().__init__()
        self.ln_f, self.head = gpt.ln_f, gpt.head

    def forward(self, x):
        return self.head(self.ln_f(x))


def gpt_layers(gpt: GPT) -> list[nn.Module]:
    """The GPT as consecutive layers: embedding, transformer blocks, head."""
    return [Embed(gpt), *gpt.layers, Head(gpt)]
