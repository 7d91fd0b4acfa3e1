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
from .layout import RingBlock, SequenceLayout, _layout, _ring, _step_blocks

# Tags keep the ring's messages apart from other P2P traffic (gloo matches by tag, NCCL by order)
_TAG_K, _TAG_V, _TAG_DOC, _TAG_DK, _TAG_DV = 0x5241, 0x5244, 0x5242, 0x5243, 0x5245
_KV_TAGS, _GRAD_TAGS = [_TAG_K, _TAG_V, _TAG_DOC], [_TAG_DK, _TAG_DV]


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
        whole = RingBlock(slice(0, q.shape[2]), q.shape[2], causal)
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

    def blocks(self, step: int, local_seq: int, whole_diagonal: bool = True) -> list[RingBlock]:
        """The blocks of this step's held K/V to compute (see `RingBlock`, `_step_blocks`)."""
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


def _post_kv(ring, held, doc, source: int, n: int, label):
    """Posts the held K/V (and document ids) of rank `source` to the next rank, and
    receives the previous rank's held block (rank source - 1's), each as many leading
    keys as travel (`_kv_keys`): (works, the receive buffers [k, v, doc?])."""
    sent, received = _kv_keys(ring, source, n), _kv_keys(ring, (source - 1) % ring.size, n)
    k, v = held
    sends = [t[..., :sent, :].contiguous() for t in (k, v)]
    recvs = [t.new_empty((*t.shape[:2], received, t.shape[3])) for t in (k, v)]
    if doc is not None:
        sends.append(doc[:, :sent].contiguous())
        recvs.append(doc.new_empty((doc.shape[0], received)))
    return ring.exchange(sends, recvs, _KV_TAGS, label), recvs


def _zigzag_causal(ring) -> bool:
    return ring.causal and ring.layout is SequenceLayout.ZIGZAG


def _kv_keys(ring, source: int, n: int) -> int:
    """Keys of `source`'s K/V block that travel: under a causal zigzag layout every rank
    but 0 reads only the first chunk of rank 0's block (its other chunk is the sequence's
    last), and rank 0's block never comes back to it; every other block, all n."""
    return n // 2 if _zigzag_causal(ring) and source == 0 else n


def _dkv_keys(ring, holder: int, source: int, n: int) -> int:
    """Keys of `source`'s dK/dV partial sum once `holder` has added its share: under a
    causal zigzag layout, ranks after the source (before the ring wraps to 0) reach only
    its first chunk, so the sum of their shares is zero beyond it; else all n."""
    return n // 2 if _zigzag_causal(ring) and holder > source else n


def _no_keys_yet(q, dtype):
    """The merged (output, log-sum-exp) of rows that have seen no key: 0 and -inf."""
    lse = torch.full(q.shape[:3], float("-inf"), dtype=dtype, device=q.device)
    return torch.zeros(q.shape, dtype=dtype, device=q.device), lse


def _add_rows(total, rows, part, length, dim):
    """total + part placed at `rows` along `dim` (of `length`): the part itself where it
    is the first and covers every row (no zeros written, no copy), else added in place."""
    if total is None:
        if rows.start == 0 and rows.stop == length:
            return part
        shape = list(part.shape)
        shape[dim] = length
        total = part.new_zeros(shape)
    total.narrow(dim, rows.start, rows.stop - rows.start).add_(part)
    return total


class _RingAttention(torch.autograd.Function):
    """Saves q, k, v, the merged output and the row log-sum-exp (batch, heads, local_seq);
    the backward recomputes each block's probabilities from them (no score matrix kept).
    K and V move as two tensors (no stacked copy); a row range's first partial result is
    taken as it is, later ones merged into it, and a gradient's first block is kept as the
    kernel gave it (no zeros filled and added to)."""

    @staticmethod
    def forward(ctx, q, k, v, doc_ids, ring):
        kernel = _kernel(ring.kernel, q, doc_ids is not None)
        n, scale = q.shape[2], 1.0 / math.sqrt(q.shape[3])
        q_in, out, lse = q.to(kernel.dtype), None, None
        held, doc, first = (k, v), doc_ids, (None, None, None)
        for step in range(ring.size):
            source = (ring.rank - step) % ring.size
            if step + 1 < ring.size:  # post the next block before computing this one
                works, nxt = _post_kv(ring, held, doc, source, n, f"cp ring kv step {step + 1}")
            with events.compute_span(f"cp ring attention step {step}", "forward"):
                k_in, v_in = (t.to(kernel.dtype) for t in held)
                for block in ring.blocks(step, n, kernel.fused is not None):
                    rows, keys = block.rows, block.keys
                    mask = _visible(block, doc_ids, doc)
                    block_out, block_lse = kernel.forward(
                        q_in[..., rows, :],
                        k_in[..., :keys, :],
                        v_in[..., :keys, :],
                        block,
                        mask,
                        scale,
                    )
                    if out is None and rows.start == 0 and rows.stop == n:
                        # the first result of every row: nothing to merge
                        out, lse = block_out, block_lse
                        continue
                    if out is None:
                        out, lse = _no_keys_yet(q, kernel.acc)
                    out[..., rows, :], lse[..., rows] = _merge(
                        out[..., rows, :], lse[..., rows], block_out, block_lse
                    )
            if step + 1 < ring.size:  # needed now: the next step computes on it
                _wait(works, f"cp ring kv step {step + 1}")
                held, doc = tuple(nxt[:2]), (None if doc is None else nxt[2])
                if step == 0:  # the previous rank's K/V: the backward starts with it
                    first = (*held, doc)
        if out is None:  # no block at all (a `Ring` computing none)
            out, lse = _no_keys_yet(q, kernel.acc)
        ctx.save_for_backward(q, k, v, out, lse, doc_ids, *first)
        ctx.ring, ctx.kernel = ring, kernel
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, dout):
        """Visits the K/V blocks in the order previous rank's, the one before, ..., its
        own last. Block b's dK/dV partial sums then travel b+1 -> b+2 -> ... -> b, each hop
        posted after a step and waited a step later, so the owner adds its own share last
        and no hop is left without compute to hide behind. The first block is the one the
        forward received first (saved), the last this rank's own: cp - 2 K/V receives."""
        q, k, v, out, lse, doc_ids, first_k, first_v, first_doc = ctx.saved_tensors
        ring, kernel = ctx.ring, ctx.kernel
        n, scale = q.shape[2], 1.0 / math.sqrt(q.shape[3])
        do = dout.to(kernel.acc)
        # rowsum(dO * O): the math kernel's; a fused backward computes its own
        delta = (do * out).sum(dim=-1) if kernel.fused is None else None
        safe_lse = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)
        q_in, dout_in, out_in = q.to(kernel.dtype), do.to(kernel.dtype), out.to(kernel.dtype)
        dq = None
        last = ring.size - 1
        held, doc = ((first_k, first_v), first_doc) if last else ((k, v), doc_ids)
        acc_works = acc_in = None
        for step in range(ring.size):
            back = (step + 1) % ring.size  # how many ranks back the held block comes from
            source = (ring.rank - back) % ring.size
            if step + 1 < last:  # the next block from the previous rank (not our own)
                works, nxt = _post_kv(
                    ring, held, doc, source, n, f"cp ring kv grad step {step + 1}"
                )
            span = _dkv_keys(ring, ring.rank, source, n)  # the dK/dV rows this rank sends on
            dk = dv = None
            with events.compute_span(f"cp ring attention step {step}", "backward"):
                k_in, v_in = (t.to(kernel.dtype) for t in held)
                for block in ring.blocks(back, n, kernel.fused is not None):
                    rows, keys = block.rows, block.keys
                    mask = _visible(block, doc_ids, doc)
                    dq_rows, dk_rows, dv_rows = kernel.backward(
                        dout_in[..., rows, :],
                        q_in[..., rows, :],
                        k_in[..., :keys, :],
                        v_in[..., :keys, :],
                        out_in[..., rows, :],
                        safe_lse[..., rows],
                        None if delta is None else delta[..., rows],
                        block,
                        mask,
                        scale,
                    )
                    dq = _add_rows(dq, rows, dq_rows, n, 2)
                    dk = _add_rows(dk, slice(0, keys), dk_rows, span, 2)
                    dv = _add_rows(dv, slice(0, keys), dv_rows, span, 2)
            if dk is None:  # no block of this step
                shape = (*k.shape[:2], span, k.shape[3])
                dk, dv = (torch.zeros(shape, dtype=kernel.acc, device=q.device) for _ in "kv")
            if acc_works is not None:  # this block's dK/dV from the ranks before
                _wait(acc_works, f"cp ring dkv step {step}")
                dk.narrow(2, 0, acc_in[0].shape[2]).add_(acc_in[0])
                dv.narrow(2, 0, acc_in[1].shape[2]).add_(acc_in[1])
            if step < last:  # on to the next rank, waited there a step later
                dk, dv = dk.contiguous(), dv.contiguous()
                # what the previous rank sends on next: the block this rank holds next
                coming = _dkv_keys(ring, (ring.rank - 1) % ring.size, (source - 1) % ring.size, n)
                acc_in = [t.new_empty((*t.shape[:2], coming, t.shape[3])) for t in (dk, dv)]
                acc_works = ring.exchange(
                    [dk, dv], acc_in, _GRAD_TAGS, f"cp ring dkv step {step + 1}"
                )
            if step + 1 < last:
                _wait(works, f"cp ring kv grad step {step + 1}")
                held, doc = tuple(nxt[:2]), (None if doc is None else nxt[2])
            elif step + 1 == last:  # our own block last
                held, doc = (k, v), doc_ids
        if dq is None:
            dq = torch.zeros(q.shape, dtype=kernel.acc, device=q.device)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None
