"""Activations and gradients between neighbouring stages, through nbtrain's counted sends.

Each direction between two stages carries one kind of message: activations go to the
next stage, their gradients come back. Messages of one direction arrive in the order
they were sent, so no tags are needed, and sends never wait: a stage posts its send
and goes on, and only a receive blocks. With every stage following its schedule this
cannot deadlock. The first activation carries a small header (its dtype and shape);
later ones reuse it: shapes are agreed once, not per micro-batch.
"""
from __future__ import annotations

import torch

from ..comm import collectives as C

_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64,
           torch.int32)
_HEADER = 10  # ndim, dtype, and up to 8 dimensions


class Link:
    """This stage's transfers with one neighbouring stage (global rank `peer`)."""

    def __init__(self, peer: int, device: torch.device, label: str):
        self.peer, self.device, self.label = peer, device, label
        self.sent_header = False
        self.shape: tuple | None = None
        self.dtype: torch.dtype | None = None
        self.pending: list = []

    def send(self, tensor: torch.Tensor, what: str) -> None:
        if not self.sent_header and what == "act":
            self.sent_header = True
            if tensor.dim() > _HEADER - 2 or tensor.dtype not in _DTYPES:
                raise ValueError(f"pipeline: a stage's output must be a tensor of at most "
                                 f"{_HEADER - 2} dimensions and one of {_DTYPES}; got "
                                 f"{tensor.dtype} of shape {tuple(tensor.shape)}")
            header = torch.zeros(_HEADER, dtype=torch.int64, device=self.device)
            header[0], header[1] = tensor.dim(), _DTYPES.index(tensor.dtype)
            header[2:2 + tensor.dim()] = torch.tensor(tensor.shape)
            self.pending.append(C.send(header, self.peer, label=f"{self.label} header"))
        self.pending.append(C.send(tensor.detach(), self.peer, label=f"{self.label} {what}"))

    def recv_act(self) -> torch.Tensor:
        if self.shape is None:
            header = torch.zeros(_HEADER, dtype=torch.int64, device=self.device)
            C.recv(header, self.peer, label=f"{self.label} header")
            ndim = int(header[0])
            self.dtype = _DTYPES[int(header[1])]
            self.shape = tuple(int(n) for n in header[2:2 + ndim])
        out = torch.empty(self.shape, dtype=self.dtype, device=self.device)
        C.recv(out, self.peer, label=f"{self.label} act")
        return out

    def recv_grad(self, like: torch.Tensor) -> torch.Tensor:
        out = torch.empty_like(like)
        C.recv(out, self.peer, label=f"{self.label} grad")
        return out

    def finish(self) -> None:
        """Waits for every send posted (their buffers may then be reused)."""
        for handle in self.pending:
            handle.wait()
        self.pending.clear()
