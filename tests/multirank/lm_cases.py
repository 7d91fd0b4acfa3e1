"""A small BMTrain-style model: plain embedding, norm and head around sharded Blocks,
and its plain twin (the single-process reference)."""

import torch
import torch.nn.functional as F
from torch import nn

import nbtrain as nbt

VOCAB, HIDDEN, SEQ, ROWS_PER_RANK, STEPS = 37, 12, 5, 2, 10


class Layer(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(HIDDEN, HIDDEN)

    def forward(self, h):
        return h + torch.tanh(self.fc(h))


class PlainLM(nn.Module):
    def __init__(self, seed: int = 0):
        super().__init__()
        torch.manual_seed(seed)
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.layers = nn.ModuleList(Layer() for _ in range(3))
        self.norm = nn.LayerNorm(HIDDEN)
        self.head = nn.Linear(HIDDEN, VOCAB)

    def loss(self, x, y):
        h = self.embed(x)
        for layer in self.layers:
            h = layer(h)
        return F.cross_entropy(self.head(self.norm(h)).flatten(0, 1), y.flatten())


class Nested(nbt.DistributedModule):
    """A layer written as its own DistributedModule (with plain parameters), as BMTrain
    models often are; inside a Block, the Block owns those parameters."""

    def __init__(self, layer: nn.Module):
        super().__init__()
        self.layer = layer

    def forward(self, h):
        return self.layer(h)


class ShardedLM(nbt.DistributedModule):
    """The same model the BMTrain way: plain modules outside, Blocks inside."""

    dp_bucket_numel = 520  # head + norm fill the first bucket, the embedding the second

    def __init__(self, plain: PlainLM, zero_level: int = 3, nested: bool = False):
        super().__init__()
        self.embed, self.norm, self.head = plain.embed, plain.norm, plain.head
        layers = [Nested(m) if nested else m for m in plain.layers]
        self.layers = nbt.TransformerBlockList([nbt.Block(m, zero_level) for m in layers])

    def forward(self, x, y):
        return PlainLM.loss(self, x, y)

    loss = forward


def batches(world: int, seed: int = 7):
    g = torch.Generator().manual_seed(seed)
    shape = (STEPS, world * ROWS_PER_RANK, SEQ)
    return torch.randint(0, VOCAB, shape, generator=g), torch.randint(0, VOCAB, shape, generator=g)
