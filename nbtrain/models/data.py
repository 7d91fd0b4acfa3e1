"""A byte-level corpus made locally, with no download: Python's own standard library.

Every rank builds the same corpus (sorted file list) and draws its own slice of
each step's batch, so N ranks on batch b see what one process sees on N x b.
`BatchSampler.local_batch(step)` is that slice, already on the rank's device.
"""

from __future__ import annotations

import os
import sysconfig

import torch

from ..comm.context import get_context

VOCAB_SIZE = 256  # bytes


def stdlib_corpus(max_bytes: int = 4 << 20) -> torch.Tensor:
    """Up to `max_bytes` of .py source from the standard library, as uint8 tokens."""
    root = sysconfig.get_paths()["stdlib"]
    chunks, total = [], 0
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in ("site-packages", "test", "tests"))
        for name in sorted(filenames):
            if not name.endswith(".py"):
                continue
            try:
                with open(os.path.join(dirpath, name), "rb") as f:
                    data = f.read()
            except OSError:
                continue
            chunks.append(data)
            total += len(data)
            if total >= max_bytes:
                break
        if total >= max_bytes:
            break
    if not chunks:
        raise RuntimeError(f"no Python sources found under {root}")
    blob = b"".join(chunks)[:max_bytes]
    return torch.frombuffer(bytearray(blob), dtype=torch.uint8).long()


class BatchSampler:
    """Seeded random windows of `seq_len + 1` tokens; the same on every rank.

    `batch(step)` returns the global batch (x, y), each (global_batch, seq_len), on
    the CPU. `local_batch(step)` returns this rank's rows of it, [rank * per_rank,
    (rank + 1) * per_rank), on the rank's device: the same code runs on CPU ranks
    and on GPUs, at any world size that divides `global_batch`.
    """

    def __init__(self, tokens: torch.Tensor, seq_len: int, global_batch: int, seed: int = 0):
        if tokens.numel() <= seq_len + 1:
            raise ValueError(
                f"corpus of {tokens.numel()} tokens is too short for seq_len={seq_len}"
            )
        self.tokens, self.seq_len, self.global_batch, self.seed = (
            tokens,
            seq_len,
            global_batch,
            seed,
        )

    def batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + step)
        starts = torch.randint(
            0, self.tokens.numel() - self.seq_len - 1, (self.global_batch,), generator=g
        )
        rows = torch.stack([self.tokens[s : s + self.seq_len + 1] for s in starts.tolist()])
        return rows[:, :-1], rows[:, 1:]

    def rows_per_rank(self) -> int:
        """global_batch / world size; a clear error when it does not divide."""
        world = get_context().world_size
        if self.global_batch % world:
            raise ValueError(
                f"global_batch={self.global_batch} does not split over "
                f"{world} ranks: use a multiple of {world}, e.g. "
                f"{-(-self.global_batch // world) * world}"
            )
        return self.global_batch // world

    def local_batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's (x, y) of `batch(step)`, each (global_batch / world, seq_len),
        on the rank's device. Local: every rank draws the same batch and keeps its rows."""
        ctx = get_context()
        per_rank = self.rows_per_rank()
        rows = slice(ctx.rank * per_rank, (ctx.rank + 1) * per_rank)
        return tuple(t[rows].to(ctx.device, non_blocking=True) for t in self.batch(step))
