"""The runtime's data contracts: a packed batch in, a forward result out, a model handle.

    batch = PackedBatch.from_documents(docs, seq_len=64, rows=4)  # docs: 1-D LongTensors
    mine = batch.rows_for(dp_rank, dp_size)                       # a replica's rows

`PackedBatch` follows the Hugging Face packing convention: several documents back to
back in one row, `position_ids` restarting at 0 where each document starts (that is how
the boundaries are known), `labels` the next token within the document and -100 where
no loss is taken (the last token of a document, padding).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

IGNORE_INDEX = -100  # a label that adds no loss (Hugging Face's and torch's convention)


@dataclass
class PackedBatch:
    """Documents packed into rows of equal length. Every tensor is (rows, seq_len), CPU
    or any device; the runtime moves them to the model's device.

    Attributes:
        input_ids: int64 token ids.
        position_ids: int64; 0 at each document start, then +1 per token.
        labels: int64; the token to predict, or -100 where no loss is taken.
        loss_weights: optional float per-token weights (a token's loss counts
            `weight` times); None means 1 for every labelled token.
    """

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    labels: torch.Tensor
    loss_weights: torch.Tensor | None = None

    def __post_init__(self):
        shape = tuple(self.input_ids.shape)
        if len(shape) != 2:
            raise ValueError(f"PackedBatch: input_ids must be (rows, seq_len), got shape {shape}")
        named = {
            "position_ids": self.position_ids,
            "labels": self.labels,
            "loss_weights": self.loss_weights,
        }
        for name, t in named.items():
            if t is not None and tuple(t.shape) != shape:
                raise ValueError(
                    f"PackedBatch: {name} has shape {tuple(t.shape)}, input_ids "
                    f"{shape}: give every tensor the same (rows, seq_len)"
                )
        pos = self.position_ids
        if shape[1] and bool((pos[:, 0] != 0).any()):
            raise ValueError(
                "PackedBatch: every row must start a document (position_ids[:, 0] "
                f"== 0), got {pos[:, 0].tolist()}"
            )
        steps = pos[:, 1:] - pos[:, :-1]
        if bool(((steps != 1) & (pos[:, 1:] != 0)).any()):
            raise ValueError(
                "PackedBatch: position_ids must rise by 1 within a document and "
                "restart at 0 at the next one"
            )

    @property
    def rows(self) -> int:
        return self.input_ids.shape[0]

    @property
    def seq_len(self) -> int:
        return self.input_ids.shape[1]

    @property
    def cu_seqlens(self) -> torch.Tensor:
        """int32 cumulative document lengths over the flattened rows (row-major), as
        flash-attention's varlen kernels take them: [0, len0, len0 + len1, ..., rows *
        seq_len]. A row's padding is a segment of its own (labels -100)."""
        flat = self.position_ids.reshape(-1)
        starts = torch.nonzero(flat == 0).flatten()
        end = torch.tensor([flat.numel()], dtype=starts.dtype, device=starts.device)
        return torch.cat([starts, end]).to(torch.int32)

    def token_weights(self) -> torch.Tensor:
        """float32 (rows, seq_len): each token's weight in the loss, 0 where labels are -100."""
        mask = (self.labels != IGNORE_INDEX).float()
        return mask if self.loss_weights is None else mask * self.loss_weights.float()

    def select_rows(self, rows: slice) -> "PackedBatch":
        """The batch made of `rows` (a slice of row indices)."""
        weights = None if self.loss_weights is None else self.loss_weights[rows]
        return PackedBatch(
            self.input_ids[rows], self.position_ids[rows], self.labels[rows], weights
        )

    def rows_for(self, dp_rank: int, dp_size: int) -> "PackedBatch":
        """Data-parallel rank `dp_rank`'s share of the rows: rows [dp_rank * r, (dp_rank +
        1) * r) with r = rows / dp_size. Local."""
        if not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank={dp_rank} is outside a data-parallel size of {dp_size}")
        if self.rows % dp_size:
            raise ValueError(
                f"PackedBatch has {self.rows} rows, which {dp_size} data-parallel ranks cannot "
                f"split evenly: use a multiple of {dp_size} rows (e.g. "
                f"{-(-self.rows // dp_size) * dp_size})"
            )
        per = self.rows // dp_size
        return self.select_rows(slice(dp_rank * per, (dp_rank + 1) * per))

    def split(self, parts: int) -> list["PackedBatch"]:
        """`parts` micro-batches of rows / parts rows each, in order."""
        if parts < 1 or self.rows % parts:
            raise ValueError(
                f"{self.rows} rows cannot make {parts} micro-batches of equal "
                f"size: use num_micro_batches dividing {self.rows}"
            )
        per = self.rows // parts
        return [self.select_rows(slice(i * per, (i + 1) * per)) for i in range(parts)]

    @classmethod
    def from_documents(cls, docs, seq_len: int, rows: int, pad_id: int = 0) -> "PackedBatch":
        """Packs 1-D token tensors into `rows` rows of `seq_len` tokens, in order.

        A document goes into the current row if it fits in what is left of it, else it
        starts the next row (the rest of the row is padding: token `pad_id`, labels
        -100, its own position run from 0). Labels are the next token of the same
        document; the last token of each document is -100.

        Raises:
            ValueError: a document longer than `seq_len`, or more documents than `rows`
                rows hold (the message says how many rows they need).
        """
        ids = torch.full((rows, seq_len), pad_id, dtype=torch.long)
        pos = torch.zeros((rows, seq_len), dtype=torch.long)
        labels = torch.full((rows, seq_len), IGNORE_INDEX, dtype=torch.long)
        used = [0] * rows  # real tokens in each row
        row = 0
        for i, doc in enumerate(docs):
            doc = torch.as_tensor(doc, dtype=torch.long).flatten()
            n = doc.numel()
            if n > seq_len:
                raise ValueError(
                    f"document {i} has {n} tokens, more than seq_len={seq_len}: "
                    "split it first or raise seq_len"
                )
            if n == 0:
                continue
            if used[row] + n > seq_len:
                row += 1
            if row >= rows:
                raise ValueError(
                    f"the documents need {_rows_needed(docs, seq_len)} rows of "
                    f"seq_len={seq_len}, rows={rows}: raise rows or pass fewer "
                    "documents"
                )
            col = used[row]
            ids[row, col : col + n] = doc
            pos[row, col : col + n] = torch.arange(n)
            labels[row, col : col + n - 1] = doc[1:]
            used[row] = col + n
        for r in range(rows):  # padding: a position run of its own, no labels
            pos[r, used[r] :] = torch.arange(seq_len - used[r])
        return cls(ids, pos, labels)


def _rows_needed(docs, seq_len: int) -> int:
    rows, col = 1, 0
    for doc in docs:
        n = torch.as_tensor(doc).numel()
        if n == 0:
            continue
        if col + n > seq_len:
            rows, col = rows + 1, 0
        col += n
    return rows


@dataclass
class ForwardResult:
    """What `forward_backward` returns, the same on every rank.

    Attributes:
        metrics: "loss" (float: the weighted mean of the token losses over every
            labelled token of the global batch), "tokens" (int: labelled tokens of the
            global batch), "num_micro_batches" (int).
        token_losses: float32 (rows, seq_len) on the CPU: each token's loss over the
            global batch (unweighted), 0 where labels are -100.
    """

    metrics: dict
    token_losses: torch.Tensor | None = None


@dataclass
class ModelHandle:
    """A built model and what trains it; made by `Runtime.build_model`, passed back to
    every runtime call. Treat it as opaque: the fields are the backend's.

    Attributes:
        model: this rank's trained module (the backend's form: a plain GPT for
            "reference", a wrapped pipeline stage for "nbtrain").
        optimizer: the torch optimizer over this rank's parameters (or shards).
        scheduler: the learning-rate schedule `lr_scheduler_step` advances.
        manager: nbtrain's OptimManager (loss scale, clipping; the checkpoint's
            optimizer container).
        backend: the backend's name.
        steps: optimizer steps taken (skipped ones not counted).
    """

    model: torch.nn.Module
    optimizer: object
    scheduler: object
    manager: object
    backend: str
    steps: int = 0
    extra: dict = field(default_factory=dict)
