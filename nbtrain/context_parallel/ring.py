"""Ring attention: exact attention over a sequence sharded across the ranks of a group.

Each cp rank holds q, k, v of its shard of the sequence (layout.py says which tokens);
`ring_attention` keeps the local queries and passes K/V blocks around the ring (rank i
sends to i+1), merging each step's partial result by its log-sum-exp (online softmax),
in float32. The next block's send/receive is posted before the current block is computed
and waited after it. The backward recomputes each block's probabilities from the saved
output and log-sum-exp, starting with the block the forward received first (kept) and
ending with its own: K/V travel cp - 2 hops, and each block's dK/dV partial sums travel
towards its owner one hop a step, every hop hidden behind the next step's compute (the
owner adds its own share last, so nothing is left to send home). Packed documents' ids
travel with K/V. Each block runs a kernel of kernels.py.

Point-to-point traffic goes through `nbtrain.comm.collectives.send_recv` (one
`batch_isend_irecv` per exchange: a paired send and receive with the same neighbour must
be one batch on NCCL, which would else deadlock at cp 2), so nbtrain's P2P counter sees
its bytes. `Ring` chooses and moves a call's blocks: a subclass given as `ring=` can
change either (nbtrain bench --ring does).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from ..comm import collectives as C
from ..comm import events
from ..comm.topology import ALONE
from .kernels import _diagonal, _kernel, _merge, _visible
from .layout import Block, SequenceLayout, _layout, _ring, _step_blocks

# Tags keep the ring's messages apart from other P2P traffic (gloo matches by tag, NCCL by order)
_TAG_KV, _TAG_DOC, _TAG_GRAD = 0x5241, 0x5242, 0x5243


def ring_attention(
    q, k, v, causal: bool = True, group=None, doc_ids=None, layout="zigzag", *, ring=None
):
    """Attention of this rank's queries over the whole sharded sequence.

    Args:
        q, k, v: (batch, heads, local_seq, head_dim), floating, this rank's shard of the
            sequence (`shard_sequence(x, 2, group, layout)`); local_seq equal on every rank
            of the group and even for zigzag.
        causal: mask keys after the query (by global position).
        group: the cp process group; None is the default group, `ALONE` (or a world of
            one) computes plain attention.
        doc_ids: optional int (batch, local_seq), this rank's shard of per-token document
            ids (`document_ids` of the full position_ids, sharded); tokens attend only
            within their document.
        layout: "zigzag" or "contiguous" (`SequenceLayout`), as the shards were cut.
        ring: builds the call's `Ring`, called as ring(group=, layout=, causal=): `Ring`
            (None), a subclass, or e.g. functools.partial(Ring, kernel="math").

    Returns (batch, heads, local_seq, head_dim) in q's dtype: softmax(q k^T / sqrt(head_dim))
    v for this rank's queries, differentiable in q, k and v.

    Collective: every rank of the group calls this, forward and backward, in the same order.
    """
    layout = _layout(layout)
    _check(q, k, v, doc_ids, layout)
    if doc_ids is not None:
        doc_ids = doc_ids.to(device=q.device, dtype=torch.int64)
    if _ring(group)[1] == 1:  # the whole sequence is here, in order
        whole = Block(slice(0, q.shape[2]), q.shape[2], causal)
        mask = None if doc_ids is None else _diagonal(whole, _visible(whole, doc_ids, doc_ids))
        return F.scaled_dot_product_attention(q, k, v, mask, is_causal=causal and mask is None)
    built = (ring or Ring)(group=group, layout=layout, causal=causal)
    return _RingAttention.apply(q, k, v, doc_ids, built)


def _check(q, k, v, doc_ids, layout):
    if q.dim() != 4 or q.shape != k.shape or q.shape != v.shape:
        raise ValueError(
            f"ring_attention: q, k, v must share one shape (batch, heads, local_"
            f"seq, head_dim); got {[tuple(t.shape) for t in (q, k, v)]}"
        )
    if not q.dtype.is_floating_point or q.dtype != k.dtype or q.dtype != v.dtype:
        raise ValueError(
            f"ring_attention: q, k, v must share one floating dtype; got "
            f"{q.dtype}, {k.dtype}, {v.dtype}"
        )
    if layout is SequenceLayout.ZIGZAG and q.shape[2] % 2:
        raise ValueError(
            f"ring_attention: local_seq={q.shape[2]} is odd; the zigzag layout holds"
            f" two equal chunks per rank: pad the full sequence to a multiple of "
            f"2*cp, or use layout='contiguous'"
        )
    if doc_ids is not None and (
        doc_ids.dtype.is_floating_point
        or doc_ids.dtype == torch.bool
        or tuple(doc_ids.shape) != (q.shape[0], q.shape[2])
    ):
        raise ValueError(
            f"ring_attention: doc_ids must be integers shaped (batch, local_seq)"
            f" = {(q.shape[0], q.shape[2])}; got {doc_ids.dtype} "
            f"{tuple(doc_ids.shape)}"
        )


class Ring:
    """One ring_attention call's ring (built from its `ring=` argument): who is where,
    which blocks meet at each step (`blocks`), how K/V blocks move (`exchange`), and the
    block kernel (`kernel`: "auto", fused where this device and dtype have it, or "math").
    A subclass may override `exchange` (say, local copies: the compute alone) or `blocks`
    (none: the communication alone); the attention math stays in this module."""

    def __init__(self, group=None, layout="zigzag", causal: bool = True, kernel="auto"):
        if kernel not in ("auto", "math"):
            raise ValueError(f"Ring: kernel={kernel!r}: use 'auto' or 'math'")
        self.rank, self.size, ranks = _ring(group)
        self.group = None if group is ALONE else group
        self.next = ranks[(self.rank + 1) % self.size]
        self.prev = ranks[(self.rank - 1) % self.size]
        self.layout, self.causal, self.kernel = _layout(layout), causal, kernel

    def blocks(self, step: int, local_seq: int, whole_diagonal: bool = True) -> list[Block]:
        """The blocks of this step's held K/V to compute (see `Block`, `_step_blocks`)."""
        return _step_blocks(
            self.rank, self.size, step, local_seq, self.layout, self.causal, whole_diagonal
        )

    def exchange(self, sends: list, recvs: list, tags: list, label: str) -> list:
        """Sends `sends` to the next rank and receives `recvs` from the previous one (one
        batch), counts the bytes; returns works to `wait()` on before using either."""
        return C.send_recv(
            sends, recvs, tags, dst=self.next, src=self.prev, group=self.group, label=label
        )


def _wait(works, label):
    C.wait_send_recv(works, label)


class _RingAttention(torch.autograd.Function):
    """Saves q, k, v, the merged output and the row log-sum-exp (batch, heads, local_seq);
    the backward recomputes each block's probabilities from them (no score matrix kept)."""

    @staticmethod
    def forward(ctx, q, k, v, doc_ids, ring):
        kernel = _kernel(ring.kernel, q, doc_ids is not None)
        n, scale = q.shape[2], 1.0 / math.sqrt(q.shape[3])
        qk, out = q.to(kernel.dtype), torch.zeros(q.shape, dtype=kernel.acc, device=q.device)
        lse = torch.full(q.shape[:3], float("-inf"), dtype=kernel.acc, device=q.device)
        kv, doc = torch.stack([k, v]), doc_ids
        for step in range(ring.size):
            if step + 1 < ring.size:  # post the next block before computing this one
                nxt = [torch.empty_like(kv)] + ([] if doc is None else [torch.empty_like(doc)])
                works = ring.exchange(
                    [kv] + ([] if doc is None else [doc]),
                    nxt,
                    [_TAG_KV, _TAG_DOC],
                    f"cp ring kv step {step + 1}",
                )
            with events.compute_span(f"cp ring attention step {step}", "forward"):
                kvk = kv.to(kernel.dtype)
                for block in ring.blocks(step, n, kernel.fused is not None):
                    rows, keys = block.rows, block.keys
                    mask = _visible(block, doc_ids, doc)
                    bo, bl = kernel.forward(
                        qk[..., rows, :],
                        kvk[0, ..., :keys, :],
                        kvk[1, ..., :keys, :],
                        block,
                        mask,
                        scale,
                    )
                    out[..., rows, :], lse[..., rows] = _merge(
                        out[..., rows, :], lse[..., rows], bo, bl
                    )
            if step + 1 < ring.size:  # needed now: the next step computes on it
                _wait(works, f"cp ring kv step {step + 1}")
                kv, doc = nxt[0], (None if doc is None else nxt[1])
                if step == 0:  # the previous rank's K/V: the backward starts with it
                    first_kv, first_doc = kv, doc
        if ring.size == 1:
            first_kv, first_doc = None, None
        ctx.save_for_backward(q, k, v, out, lse, doc_ids, first_kv, first_doc)
        ctx.ring, ctx.kernel = ring, kernel
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, dout):
        """Visits the K/V blocks in the order previous rank's, the one before, ..., its
        own last. Block b's dK/dV partial sums then travel b+1 -> b+2 -> ... -> b, each hop
        posted after a step and waited a step later, so the owner adds its own share last
        and no hop is left without compute to hide behind. The first block is the one the
        forward received first (saved), the last this rank's own: cp - 2 K/V receives."""
        q, k, v, out, lse, doc_ids, first_kv, first_doc = ctx.saved_tensors
        ring, kernel = ctx.ring, ctx.kernel
        n, scale = q.shape[2], 1.0 / math.sqrt(q.shape[3])
        do = dout.to(kernel.acc)
        delta = (do * out).sum(dim=-1)  # (b, h, n): rowsum(dO * O), for the math kernel
        safe_lse = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)
        qk, dok, outk = q.to(kernel.dtype), do.to(kernel.dtype), out.to(kernel.dtype)
        dq = torch.zeros(q.shape, dtype=kernel.acc, device=q.device)
        last = ring.size - 1
        kv, doc = (first_kv, first_doc) if last else (torch.stack([k, v]), doc_ids)
        acc_works = acc_in = None
        for step in range(ring.size):
            held = (step + 1) % ring.size  # how many ranks back the held block comes from
            if step + 1 < last:  # the next block from the previous rank (not our own)
                nxt = [torch.empty_like(kv)] + ([] if doc is None else [torch.empty_like(doc)])
                works = ring.exchange(
                    [kv] + ([] if doc is None else [doc]),
                    nxt,
                    [_TAG_KV, _TAG_DOC],
                    f"cp ring kv grad step {step + 1}",
                )
            dkv = torch.zeros(2, *k.shape, dtype=kernel.acc, device=q.device)
            with events.compute_span(f"cp ring attention step {step}", "backward"):
                kvk = kv.to(kernel.dtype)
                for block in ring.blocks(held, n, kernel.fused is not None):
                    rows, keys = block.rows, block.keys
                    mask = _visible(block, doc_ids, doc)
                    dq_rows, dk_rows, dv_rows = kernel.backward(
                        dok[..., rows, :],
                        qk[..., rows, :],
                        kvk[0, ..., :keys, :],
                        kvk[1, ..., :keys, :],
                        outk[..., rows, :],
                        safe_lse[..., rows],
                        delta[..., rows],
                        block,
                        mask,
                        scale,
                    )
                    dq[..., rows, :] += dq_rows
                    dkv[0, ..., :keys, :] += dk_rows
                    dkv[1, ..., :keys, :] += dv_rows
            if acc_works is not None:  # this block's dK/dV from the ranks before
                _wait(acc_works, f"cp ring dkv step {step}")
                dkv += acc_in
            if step < last:  # on to the next rank, waited there a step later
                acc_in = torch.empty_like(dkv)
                acc_works = ring.exchange(
                    [dkv], [acc_in], [_TAG_GRAD], f"cp ring dkv step {step + 1}"
                )
            if step + 1 < last:
                _wait(works, f"cp ring kv grad step {step + 1}")
                kv, doc = nxt[0], (None if doc is None else nxt[1])
            elif step + 1 == last:  # our own block last
                kv, doc = torch.stack([k, v]), doc_ids
        return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), None, None
