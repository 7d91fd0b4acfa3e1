"""TransformerBlockList: a ModuleList of Blocks whose communication overlaps compute.

Neighbouring blocks are linked, so while block i computes, block i+1's
all-gather is already in flight, and in backward block i-1's gather starts while
block i computes; block i+1's reduce-scatter runs during block i's backward.
The links live in the blocks, so a model's own loop over the list
(`for layer in self.layers: h = layer(h)`) overlaps just as `blocks(x)` does.
"""
from __future__ import annotations

from torch import nn

from .block import Block
from .reducer import GradReducer


class TransformerBlockList(nn.ModuleList):
    """Blocks run in sequence with prefetching.

    Args:
        modules: Blocks, or plain modules (wrapped as `Block(m)` at ZeRO-3).

    `blocks(x, *args, **kwargs)` feeds x through every block; extra arguments go
    to every block. A block that returns a tuple passes its first element on;
    the last block's whole output is returned.
    """

    def __init__(self, modules=None):
        blocks = [m if isinstance(m, Block) else Block(m) for m in (modules or [])]
        super().__init__(blocks)
        reducer = GradReducer()  # one queue for the list; its model's replaces it
        for i, block in enumerate(blocks):
            block.join(reducer, label=f"block{i}")
        for prev, nxt in zip(blocks, blocks[1:]):
            object.__setattr__(prev, "_next_block", nxt)
            object.__setattr__(nxt, "_prev_block", prev)

    def forward(self, hidden, *args, **kwargs):
        out = hidden
        for block in self:
            out = block(hidden, *args, **kwargs)
            hidden = out[0] if isinstance(out, tuple) else out
        return out
