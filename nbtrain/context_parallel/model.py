"""The model side of context parallelism: `ContextParallel`, how a model splits each
sequence over a cp group, and the calls a model makes under it.

A model takes a `ContextParallel` as an argument (nbtrain's GPT: `GPT(cfg,
context_parallel=...)`; Llama and the pipeline layers through the runtime's
`StagePositions`): the layout is the caller's choice, never read from nbtrain's topology
behind the model's back. `ContextParallel.from_topology()` makes the one of
`init_distributed(cp_size=...)` for a caller that wants it. A training step:

    cp = ContextParallel.from_topology()
    idx, targets, position_ids, doc_ids = cp.shard_batch(idx, targets, position_ids)
    logits = model(idx, position_ids, doc_ids)   # this rank's shard of every row
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist

from ..comm import context
from ..comm.topology import ALONE
from .layout import (
    SequenceLayout,
    check_position_ids,
    chunk_ids,
    document_ids,
    gather_sequence,
    global_positions,
    shard_sequence,
)
from .ring import ring_attention


@dataclass(frozen=True)
class ContextParallel:
    """How a model (nbtrain's GPT, Llama's pipeline layers) splits each sequence over
    the ranks of a cp group: given to the model, never read from global state by it.

    Attributes:
        group: the cp process group (None: the whole world; `ALONE`: this rank alone,
            which runs the cp code path on whole sequences).
        layout: "zigzag" (rank r holds chunks r and 2*cp-1-r of 2*cp: equal causal
            work) or "contiguous" (chunk r of cp); see `SequenceLayout`.
    """

    group: object = None
    layout: str = "zigzag"

    def __post_init__(self):
        try:
            object.__setattr__(self, "layout", SequenceLayout(self.layout).value)
        except ValueError:
            raise ValueError(
                f"layout={self.layout!r}: use one of {[m.value for m in SequenceLayout]}"
            ) from None

    @classmethod
    def from_topology(cls, layout="zigzag") -> "ContextParallel | None":
        """The topology's cp group when nbtrain is initialised with cp_size > 1, else None.
        Read once, here: the caller hands the result to the model."""
        if not context.is_initialized():
            return None
        topo = context.get_context().topology
        return cls(topo.group("cp"), layout) if topo.cp_size > 1 else None

    @property
    def rank(self) -> int:
        if self.group is ALONE or not dist.is_initialized():
            return 0
        rank = dist.get_rank(self.group)
        if rank < 0:
            raise ValueError(
                f"context parallelism: global rank {dist.get_rank()} is not in "
                "the cp group: give each rank the group holding it"
            )
        return rank

    @property
    def size(self) -> int:
        if self.group is ALONE or not dist.is_initialized():
            return 1
        return dist.get_world_size(self.group)

    @property
    def chunks(self) -> int:
        """How many equal chunks a full sequence is cut into (2*cp zigzag, cp contiguous)."""
        return self.size * len(chunk_ids(0, self.size, self.layout))

    def shard_batch(self, idx, targets=None, position_ids=None):
        """This rank's shard of a batch of full rows. Local (every cp rank holds the batch).

        Args:
            idx: int (rows, seq) token ids; seq must divide into `chunks`.
            targets: optional, shaped like idx.
            position_ids: optional int (rows, seq), packed documents (0 at each start).

        Returns:
            (idx, targets, position_ids, doc_ids), each (rows, seq / cp) or None:
            doc_ids are the documents of the FULL rows (a document may start in another
            rank's shard), None without position_ids.
        """
        if idx.dim() != 2:
            raise ValueError(
                f"shard_batch takes token ids of shape (rows, seq); got {tuple(idx.shape)}"
            )
        seq, n = idx.shape[1], self.chunks
        if seq % n:
            raise ValueError(
                f"shard_batch: sequence length {seq} does not divide into {n} "
                f"chunks ({self.layout} layout over cp {self.size} ranks): pad "
                f"the rows to a multiple of {n} (e.g. {-(-seq // n) * n})"
            )
        if targets is not None and tuple(targets.shape) != tuple(idx.shape):
            raise ValueError(
                f"shard_batch: targets of shape {tuple(targets.shape)} for token "
                f"ids of shape {tuple(idx.shape)}: give one target per token"
            )
        check_position_ids(position_ids, idx)
        docs = None if position_ids is None else document_ids(position_ids)
        return tuple(
            None if t is None else shard_sequence(t, 1, self.group, self.layout)
            for t in (idx, targets, position_ids, docs)
        )

    def gather(self, x, dim: int = 1):
        """The full tensor from every rank's shard `x` along `dim`, in sequence order (no
        autograd). Collective over the cp group."""
        return gather_sequence(x, dim, self.group, self.layout)

    def positions(self, local_seq: int, device=None):
        """int64 (local_seq,): this rank's tokens' positions in the full sequence."""
        return global_positions(self.rank, self.size, local_seq, self.layout, device)

    def attention(self, q, k, v, doc_ids=None):
        """Causal ring attention of this rank's q, k, v (batch, heads, local_seq, dim)."""
        return ring_attention(
            q, k, v, causal=True, group=self.group, doc_ids=doc_ids, layout=self.layout
        )

    def check_local(self, idx, position_ids, doc_ids, seq_len: int):
        """Raises unless idx (rows, local_seq) is a shard this cp group can run."""
        t, size = idx.shape[1], self.size
        where = f"GPT under context parallelism (cp {size}, {self.layout} layout)"
        if t % (self.chunks // size):
            raise ValueError(
                f"{where}: local sequence length {t} is odd; each rank holds "
                f"two equal chunks: shard full rows whose length divides by "
                f"2*cp = {self.chunks} (model.shard_batch), or use "
                "ContextParallel(layout='contiguous')"
            )
        if t * size > seq_len:
            raise ValueError(
                f"{where}: sequence length {t * size} (local {t} x cp {size}) "
                f"exceeds seq_len={seq_len}: pass this rank's shard "
                "(model.shard_batch), not the full rows"
            )
        check_position_ids(position_ids, idx)
        if (position_ids is None) != (doc_ids is None):
            raise ValueError(
                f"{where}: position_ids and doc_ids come together: a document "
                "may start in another rank's shard, so its ids come from the "
                "full rows: idx, targets, position_ids, doc_ids = "
                "model.shard_batch(idx, targets, position_ids)"
            )
        if doc_ids is not None:
            check_position_ids(doc_ids, idx)
