"""toy_lm's implementation of nbtrain's model protocol."""

import torch
from torch import nn

from nbtrain.models.hf_load import load_hf_weights as _load

from . import ToyConfig, hf_names


class MixerBlock(nn.Module):
    """x + down(gelu(up(norm(x)))), then a causal running mean over the sequence."""

    def __init__(self, width: int):
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up = nn.Linear(width, 2 * width)
        self.down = nn.Linear(2 * width, width)

    def forward(self, x):
        x = x + self.down(torch.nn.functional.gelu(self.up(self.norm(x))))
        steps = torch.arange(1, x.shape[1] + 1, device=x.device, dtype=x.dtype)
        return x.cumsum(dim=1) / steps.view(1, -1, 1)


class Head(nn.Module):
    def __init__(self, width: int, vocab: int):
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.out = nn.Linear(width, vocab, bias=False)

    def forward(self, x):
        return self.out(self.norm(x))


class ToyLM(nn.Module):
    def __init__(self, cfg: ToyConfig):
        super().__init__()
        self.embed = nn.Embedding(cfg.vocab_size, cfg.width)
        self.blocks = nn.ModuleList(MixerBlock(cfg.width) for _ in range(cfg.layers))
        self.head = Head(cfg.width, cfg.vocab_size)
        if cfg.tie:
            self.head.out.weight = self.embed.weight

    def forward(self, ids, position_ids=None):
        x = self.embed(ids.to(self.embed.weight.device))
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def build_model(config: ToyConfig, parallel) -> ToyLM:
    return ToyLM(config)


def load_hf_weights(model, hf_path: str) -> int:
    return _load(model, hf_path, hf_names())


def make_forward_step(model: ToyLM):
    return lambda input_ids, position_ids=None: model(input_ids, position_ids)


def tp_plan(config: ToyConfig) -> dict:
    return {
        "embed": "vocab",
        "blocks.*.norm": "replicated",
        "blocks.*.up": "colwise",
        "blocks.*.down": "rowwise",
        "head.norm": "replicated",
        "head.out": "tied_head" if config.tie else "head",
    }


def pp_stages(model: ToyLM, pipe_size: int, positions=None) -> list:
    return [model.embed, *model.blocks, model.head]
