"""TransformerBlockList: a ModuleList of Blocks whose communication overlaps compute.

Neighbouring blocks are linked, so while block i computes, block i+1's
all-gather is already in flight, and in backward block i-1's gather starts while
block i computes; block i+1's reduce-scatter runs during block i's backward.
The links live in the blocks, so a model's own loop over the list
(`for layer in self.layers: h = layer(h)`) overlaps just as `blocks(x)` does.
"""

from __future__ import annotations

import torch
from torch import nn

from .block import Block
from .reducer import GradReducer


class TransformerBlockList(nn.ModuleList):
    """Blocks run in sequence with prefetching.

    Args:
        modules: Blocks, or plain modules (wrapped as `Block(m)`: ZeRO-3, checkpointed).
            A plain module listed twice is one layer used twice (`Block.twin`: the
            same shards); a Block listed twice is an AssertionError (BMTrain's).
        num_hidden: how many leading arguments are hidden states (BMTrain's).
        compile: for the plain modules it wraps: torch.compile them (Block's `compile`).
            Blocks given keep their own setting.

    `blocks(*args, **kwargs)` calls the blocks in turn as BMTrain's list does: each
    block's output (a tuple, or one tensor) replaces the first `num_hidden` arguments
    of the next call, and the other arguments (and keyword arguments) go to every
    block. Returns the last block's first output (its first `num_hidden` outputs, a
    tuple, when num_hidden > 1); with `return_hidden_states=True`, all of the last
    block's outputs followed by each hidden state's inputs to the blocks, stacked
    along a new first dimension.
    """

    def __init__(self, modules=None, num_hidden: int = 1, compile: bool | dict = False):  # noqa: A002 (the public keyword)
        blocks = list_blocks(modules or [], lambda m: Block(m, compile=compile))
        super().__init__(blocks)
        if num_hidden < 1:
            raise ValueError(f"num_hidden={num_hidden}: at least one argument is a hidden state")
        self.num_hidden = num_hidden
        reducer = GradReducer()  # one queue for the list; its model's replaces it
        for i, block in enumerate(blocks):
            block.join(reducer, label=f"block{i}")
        for prev, nxt in zip(blocks, blocks[1:]):
            object.__setattr__(prev, "_next_block", nxt)
            object.__setattr__(nxt, "_prev_block", prev)

    def forward(self, *args, return_hidden_states: bool = False, **kwargs):
        hidden_states, outputs = [], args
        for block in self:
            if return_hidden_states:
                hidden_states.extend(args[: self.num_hidden])
            outputs = block(*args, **kwargs)
            if not isinstance(outputs, tuple):
                outputs = (outputs,)
            args = outputs + args[self.num_hidden :]
        if return_hidden_states:
            stacked = [
                torch.stack(hidden_states[i :: self.num_hidden]) for i in range(self.num_hidden)
            ]
            return outputs + tuple(stacked)
        return tuple(outputs[: self.num_hidden]) if self.num_hidden > 1 else outputs[0]


def list_blocks(modules, make_block) -> list[Block]:
    """The blocks of a list: Blocks as given, plain modules made blocks by
    `make_block`, a plain module seen before the twin of its first block. A Block
    given twice (or a Block over a module listed before) is an AssertionError, as in
    BMTrain: give each use a Block of its own module. Local."""
    blocks, seen = [], {}
    for m in modules:
        if isinstance(m, Block):
            if id(m.inner_module) in seen:
                raise AssertionError(
                    f"the same Block ({m.label}) is listed twice in a block list: "
                    "build one Block per layer (copy.deepcopy the module for a second "
                    "layer), or list the plain module twice to use one layer twice"
                )
            seen[id(m.inner_module)] = m
            blocks.append(m)
        elif id(m) in seen:
            blocks.append(seen[id(m)].twin())
        else:
            seen[id(m)] = block = make_block(m)
            blocks.append(block)
    return blocks
