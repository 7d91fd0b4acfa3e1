"""Activations and gradients between neighbouring stages, through nbtrain's counted sends.

Each direction between two stages carries one kind of message: activations go to the
next stage, their gradients come back. Messages of one direction arrive in the order
they were sent, so no tags are needed, and sends never wait: a stage posts its send
and goes on, and only a receive blocks. With every stage following its schedule this
cannot deadlock. The first activation carries a small header (its dtype and shape);
later ones reuse it: shapes are agreed once, not per micro-batch.

`Mailbox` serves the interleaved schedule, where one pair of ranks carries activations
and gradients of several chunks in each direction. Tags cannot tell them apart (NCCL
ignores them), so messages are matched by their order: the receiver knows the order in
which its peer sends (every rank's schedule is deterministic), receives in that order and
keeps the messages that came before the one it needs. Sends never wait, so a receive
waits only for a message its peer's schedule sends earlier: no deadlock.
"""

from __future__ import annotations

from collections import deque

import torch

from ..comm import collectives as C

_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64, torch.int32)
_HEADER = 10  # ndim, dtype, and up to 8 dimensions


def _header(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """The header announcing `tensor`'s dtype and shape (int64, `_HEADER` long)."""
    if tensor.dim() > _HEADER - 2 or tensor.dtype not in _DTYPES:
        raise ValueError(
            f"pipeline: a stage's output must be a tensor of at most "
            f"{_HEADER - 2} dimensions and one of {_DTYPES}; got "
            f"{tensor.dtype} of shape {tuple(tensor.shape)}"
        )
    header = torch.zeros(_HEADER, dtype=torch.int64, device=device)
    header[0], header[1] = tensor.dim(), _DTYPES.index(tensor.dtype)
    header[2 : 2 + tensor.dim()] = torch.tensor(tensor.shape)
    return header


def _recv_header(peer: int, device: torch.device, label: str) -> tuple[torch.dtype, tuple]:
    header = torch.zeros(_HEADER, dtype=torch.int64, device=device)
    C.recv(header, peer, label=f"{label} header")
    ndim = int(header[0])
    return _DTYPES[int(header[1])], tuple(int(n) for n in header[2 : 2 + ndim])


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
            self.pending.append(
                C.send(_header(tensor, self.device), self.peer, label=f"{self.label} header")
            )
        self.pending.append(C.send(tensor.detach(), self.peer, label=f"{self.label} {what}"))

    def recv_act(self) -> torch.Tensor:
        if self.shape is None:
            self.dtype, self.shape = _recv_header(self.peer, self.device, self.label)
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


class Mailbox:
    """This rank's transfers with one peer (global rank `peer`) when the pair carries
    activations and gradients of several chunks: message keys are ("act", part, i), the
    output of the sender's part `part` for micro-batch i, and ("grad", part, i), the
    gradient of that part's input. `incoming` lists the keys of the peer's messages to
    this rank in the order the peer sends them.

    As with `Link`, a header (dtype and shape) goes before the first activation of each
    part; a gradient has the shape of the activation it answers, which its receiver sent.
    A rank's mailbox with itself (a pipeline of one rank) hands tensors over unsent.
    """

    def __init__(self, peer: int, me: int, device: torch.device, label: str, incoming: list):
        self.peer, self.device, self.label = peer, device, label
        self.local = peer == me
        self.incoming = deque(incoming)
        self.arrived: dict = {}  # key -> tensor received before it was needed
        self.sent: dict = {}  # part -> (dtype, shape) of its activations, sent
        self.received: dict = {}  # part -> (dtype, shape) of its activations, announced
        self.pending: list = []

    def send(self, tensor: torch.Tensor, key: tuple) -> None:
        """Sends `tensor` as message `key` without waiting."""
        tensor = tensor.detach()
        if self.local:
            self.arrived[key] = tensor
            return
        what, part, micro = key
        if what == "act" and part not in self.sent:
            self.sent[part] = (tensor.dtype, tuple(tensor.shape))
            self.pending.append(
                C.send(_header(tensor, self.device), self.peer, label=f"{self.label} header")
            )
        elif what == "act" and self.sent[part] != (tensor.dtype, tuple(tensor.shape)):
            raise ValueError(
                f"pipeline: part {part}'s output for micro-batch {micro} is {tensor.dtype} "
                f"of shape {tuple(tensor.shape)}, its first was {self.sent[part][0]} of "
                f"shape {self.sent[part][1]}: give every micro-batch the same shape"
            )
        self.pending.append(C.send(tensor, self.peer, label=f"{self.label} {what}"))

    def recv(self, key: tuple) -> torch.Tensor:
        """The peer's message `key`; blocks until it has come, keeping earlier ones."""
        while key not in self.arrived:
            if self.local or not self.incoming:
                raise RuntimeError(
                    f"pipeline: message {key} is not in the schedule of "
                    f"rank {self.peer}'s messages to this rank"
                )
            nxt = self.incoming.popleft()
            what, part, _ = nxt
            if what == "act" and part not in self.received:
                self.received[part] = _recv_header(self.peer, self.device, self.label)
            # a gradient answers the activation of the part before the sender's
            dtype, shape = self.received[part] if what == "act" else self.sent[part - 1]
            out = torch.empty(shape, dtype=dtype, device=self.device)
            C.recv(out, self.peer, label=f"{self.label} {what}")
            self.arrived[nxt] = out
        return self.arrived.pop(key)

    def finish(self) -> None:
        """Waits for every send posted (their buffers may then be reused)."""
        for handle in self.pending:
            handle.wait()
        self.pending.clear()
