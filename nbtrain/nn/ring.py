"""Ring attention: exact attention over a sequence sharded across the ranks of a group.

Context parallelism splits the sequence dimension: each rank of the cp group holds the
queries, keys and values of its shard. `ring_attention` keeps the local queries and passes
the key/value blocks around the ring (rank i sends to i+1, receives from i-1), so after
cp steps every query has met every key. Each step's partial result is merged into the
running one by its log-sum-exp (the online softmax), in float32. The next block's
send/receive is posted before the current block is computed, so the transfer hides
behind the compute. The backward recomputes each block's probabilities from the saved
log-sum-exp and passes K/V around again; the dK/dV of a block travel with it and reach
their owner after the last step (cp sends, the last one home).

Layouts (which chunks of the full sequence a rank holds, `SequenceLayout`):

    contiguous  cp chunks, rank r holds chunk r. Causal work grows with r.
    zigzag      2*cp chunks, rank r holds chunks r and 2*cp-1-r: an early and a late
                chunk, so every rank has the same number of causal (query, key) pairs.

Causal masks use global token positions, so they are exact for either layout; a chunk
pair entirely in the future is skipped (no compute), the diagonal one masked. Packed
documents come as `doc_ids` (batch, local_seq), sharded like the tokens; they travel
with K/V and restrict attention to a token's own document.

Point-to-point traffic goes through `torch.distributed.batch_isend_irecv` (a paired
send and receive with the same neighbour must be one batch on NCCL, which would else
deadlock at cp 2); its bytes are added to nbtrain's P2P counter on the sender.
"""
from __future__ import annotations

import enum
import math

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ..comm import collectives as C
from ..comm import events
from ..comm.topology import ALONE

# Tags keep the ring's messages apart from other point-to-point traffic on the same
# pair of ranks (gloo matches by tag; NCCL matches by order, which is the same here).
_TAG_KV, _TAG_DOC, _TAG_GRAD = 0x5241, 0x5242, 0x5243


class SequenceLayout(str, enum.Enum):
    """How the full sequence is cut into the cp ranks' shards (see the module docstring)."""
    ZIGZAG = "zigzag"
    CONTIGUOUS = "contiguous"


def _layout(layout) -> SequenceLayout:
    try:
        return SequenceLayout(layout)
    except ValueError:
        raise ValueError(f"layout={layout!r}: use one of "
                         f"{[m.value for m in SequenceLayout]}") from None


def _ring(group) -> tuple[int, int, list[int]]:
    """(this rank's index in the group, the group's size, the group's global ranks)."""
    if group is ALONE or not dist.is_initialized():
        return 0, 1, [dist.get_rank() if dist.is_initialized() else 0]
    index = dist.get_rank(group)
    if index < 0:
        raise ValueError(f"ring attention: global rank {dist.get_rank()} is not in the "
                         f"given group: call it on the group's ranks only")
    ranks = (dist.get_process_group_ranks(group) if group is not None
             else list(range(dist.get_world_size())))
    return index, len(ranks), ranks


def chunk_ids(rank: int, size: int, layout="zigzag") -> list[int]:
    """The chunks of the full sequence that `rank` of `size` holds, in local order.
    The full sequence is cut into 2*size chunks (zigzag) or size chunks (contiguous)."""
    if _layout(layout) is SequenceLayout.ZIGZAG:
        return [rank, 2 * size - 1 - rank]
    return [rank]


def _n_chunks(size: int, layout) -> int:
    return 2 * size if _layout(layout) is SequenceLayout.ZIGZAG else size


def global_positions(rank: int, size: int, local_seq: int, layout="zigzag",
                     device=None) -> torch.Tensor:
    """int64 (local_seq,): the full-sequence position of each of `rank`'s tokens. Local."""
    ids = chunk_ids(rank, size, layout)
    chunk = local_seq // len(ids)
    return torch.cat([torch.arange(c * chunk, (c + 1) * chunk, device=device) for c in ids])


def document_ids(position_ids: torch.Tensor) -> torch.Tensor:
    """Per-token document ids of packed rows: int64 (rows, seq), the number of
    document starts (position 0) up to each token. Give it the FULL sequence, then
    `shard_sequence(ids, 1)` like the tokens. Local."""
    if position_ids.dim() != 2 or position_ids.dtype.is_floating_point:
        raise ValueError(f"document_ids: position_ids must be integers shaped (rows, seq); "
                         f"got {position_ids.dtype} of shape {tuple(position_ids.shape)}")
    return (position_ids == 0).cumsum(dim=1)


def shard_sequence(x: torch.Tensor, dim: int, group=None, layout="zigzag") -> torch.Tensor:
    """This rank's shard of the full tensor `x` along `dim` (a copy, contiguous).

    `x.shape[dim]` must divide into cp chunks (contiguous) or 2*cp chunks (zigzag).
    Local: no communication (every rank holds the full `x`).
    """
    rank, size, _ = _ring(group)
    n = _n_chunks(size, layout)
    if x.shape[dim] % n:
        raise ValueError(f"shard_sequence: length {x.shape[dim]} along dim {dim} does not "
                         f"divide into {n} chunks ({layout} layout over {size} ranks): pad "
                         f"the sequence to a multiple of {n}")
    chunks = x.chunk(n, dim=dim)
    return torch.cat([chunks[c] for c in chunk_ids(rank, size, layout)], dim=dim).contiguous()


def gather_sequence(x: torch.Tensor, dim: int, group=None, layout="zigzag") -> torch.Tensor:
    """The full tensor from every rank's shard `x` along `dim`, in sequence order (no
    autograd). Collective: every rank of the group calls this with equal shapes."""
    rank, size, _ = _ring(group)
    if size == 1:
        return x.detach().clone()
    per_rank = len(chunk_ids(0, size, layout))
    if x.shape[dim] % per_rank:
        raise ValueError(f"gather_sequence: local length {x.shape[dim]} along dim {dim} is "
                         f"odd; the zigzag layout holds two equal chunks per rank")
    with torch.no_grad():
        shard = x.detach().contiguous()
        out = torch.empty(size * shard.numel(), dtype=shard.dtype, device=shard.device)
        C.all_gather(out, shard.view(-1), group=group, label="cp gather_sequence")
        parts = out.view(size, *shard.shape)
        chunks = [None] * _n_chunks(size, layout)
        for r in range(size):
            for c, piece in zip(chunk_ids(r, size, layout), parts[r].chunk(per_rank, dim=dim)):
                chunks[c] = piece
        return torch.cat(chunks, dim=dim)


def ring_attention(q, k, v, causal: bool = True, group=None, doc_ids=None,
                   layout="zigzag"):
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

    Returns:
        (batch, heads, local_seq, head_dim) in q's dtype: softmax(q k^T / sqrt(head_dim)) v
        for this rank's queries. Differentiable in q, k and v.

    Collective: every rank of the group calls this, forward and backward, in the same order.
    """
    layout = _layout(layout)
    _check(q, k, v, doc_ids, layout)
    rank, size, ranks = _ring(group)
    if size == 1:
        return _plain_attention(q, k, v, causal, doc_ids)
    if doc_ids is not None:
        doc_ids = doc_ids.to(device=q.device, dtype=torch.int64)
    ring = _Ring(rank, size, ranks, None if group is ALONE else group, layout, causal)
    return _RingAttention.apply(q, k, v, doc_ids, ring)


def _check(q, k, v, doc_ids, layout):
    if q.dim() != 4 or q.shape != k.shape or q.shape != v.shape:
        raise ValueError(f"ring_attention: q, k, v must share one shape (batch, heads, "
                         f"local_seq, head_dim); got {tuple(q.shape)}, {tuple(k.shape)}, "
                         f"{tuple(v.shape)}")
    if not q.dtype.is_floating_point or q.dtype != k.dtype or q.dtype != v.dtype:
        raise ValueError(f"ring_attention: q, k, v must share one floating dtype; got "
                         f"{q.dtype}, {k.dtype}, {v.dtype}")
    if layout is SequenceLayout.ZIGZAG and q.shape[2] % 2:
        raise ValueError(f"ring_attention: local_seq={q.shape[2]} is odd; the zigzag layout "
                         f"holds two equal chunks per rank: pad the full sequence to a "
                         f"multiple of 2*cp, or use layout='contiguous'")
    if doc_ids is not None and (doc_ids.dtype.is_floating_point or doc_ids.dtype == torch.bool
                                or tuple(doc_ids.shape) != (q.shape[0], q.shape[2])):
        raise ValueError(f"ring_attention: doc_ids must be integers shaped (batch, local_seq)"
                         f" = {(q.shape[0], q.shape[2])}; got {doc_ids.dtype} of shape "
                         f"{tuple(doc_ids.shape)}")


def _plain_attention(q, k, v, causal, doc_ids):
    """A group of one: the whole sequence is here, in order."""
    if doc_ids is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    mask = (doc_ids.unsqueeze(2) == doc_ids.unsqueeze(1)).unsqueeze(1).to(q.device)
    if causal:
        mask = mask & torch.ones(q.shape[2], q.shape[2], dtype=torch.bool,
                                 device=q.device).tril()
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


class _Ring:
    """The ring's fixed facts for one call: who is where, and which chunk pairs meet."""

    def __init__(self, rank, size, ranks, group, layout, causal):
        self.rank, self.size, self.group = rank, size, group
        self.next, self.prev = ranks[(rank + 1) % size], ranks[(rank - 1) % size]
        self.layout, self.causal = layout, causal

    def source(self, step: int) -> int:
        """The group index whose K/V block this rank holds at `step`."""
        return (self.rank - step) % self.size

    def pairs(self, step: int, local_seq: int, device):
        """For each local query chunk that meets a key of this step's block: (its rows,
        the number of leading key rows it may see, and its causal mask or None).

        A rank's chunks are in ascending order, so the keys not entirely in a query
        chunk's future are always a leading run of the block; only the chunk pair on the
        diagonal (same chunk) needs a causal mask, built from global positions.
        """
        q_ids = chunk_ids(self.rank, self.size, self.layout)
        k_ids = chunk_ids(self.source(step), self.size, self.layout)
        c = local_seq // len(q_ids)
        out = []
        for i, qc in enumerate(q_ids):
            seen = [kc for kc in k_ids if not self.causal or kc <= qc]
            if not seen:
                continue  # every key of the block is in this chunk's future: no compute
            mask = None
            if self.causal and seen[-1] == qc:
                q_pos = torch.arange(qc * c, (qc + 1) * c, device=device)
                k_pos = torch.cat([torch.arange(kc * c, (kc + 1) * c, device=device)
                                   for kc in seen])
                mask = k_pos.unsqueeze(0) <= q_pos.unsqueeze(1)
            out.append((slice(i * c, (i + 1) * c), len(seen) * c, mask))
        return out

    def exchange(self, sends: list, recvs: list, tags: list, label: str) -> list:
        """Posts sends of `sends` to the next rank and receives into `recvs` from the
        previous one (one batch), counts the sent bytes; returns the works to wait on."""
        ops = []
        for send, recv, tag in zip(sends, recvs, tags):
            ops.append(dist.P2POp(dist.isend, send, self.next, self.group, tag))
            ops.append(dist.P2POp(dist.irecv, recv, self.prev, self.group, tag))
        nbytes = sum(t.numel() * t.element_size() for t in sends)
        C.COUNTERS.add(C.CommKind.P2P, nbytes)
        events.instant("comm_issue", label, kind=C.CommKind.P2P.value, bytes=nbytes)
        return dist.batch_isend_irecv(ops)


def _wait(works, label):
    for work in works:
        work.wait()
    events.instant("comm_wait", label, kind=C.CommKind.P2P.value)


def _with_docs(mask, q_doc, k_doc):
    """The causal mask (or None) narrowed to same-document pairs when documents are given:
    bool, broadcastable to (batch, heads, q, k), or None when nothing is masked."""
    if q_doc is None:
        return mask
    same = (q_doc.unsqueeze(2) == k_doc.unsqueeze(1)).unsqueeze(1)
    return same if mask is None else same & mask


def _block_forward(q, k, v, mask, scale):
    """Attention of q over one key block, in float32: (out, lse). A row whose keys are
    all masked gets out 0 and lse -inf (no NaN)."""
    s = torch.matmul(q, k.transpose(-1, -2)) * scale
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf"))
    m = s.amax(dim=-1, keepdim=True)
    m = torch.where(torch.isinf(m), torch.zeros_like(m), m)
    p = torch.exp(s - m)
    total = p.sum(dim=-1, keepdim=True)
    out = torch.matmul(p, v) / torch.where(total > 0, total, torch.ones_like(total))
    return out, (m + torch.log(total)).squeeze(-1)


def _merge(out, lse, block_out, block_lse):
    """The log-sum-exp merge of two partial softmax results over disjoint keys."""
    new = torch.logaddexp(lse, block_lse)
    safe = torch.where(torch.isinf(new), torch.zeros_like(new), new)  # rows with no key
    out = out * torch.exp(lse - safe).unsqueeze(-1) + \
        block_out * torch.exp(block_lse - safe).unsqueeze(-1)
    return out, new


class _RingAttention(torch.autograd.Function):
    """Saves q, k, v, the float32 output and the row log-sum-exp (batch, heads, local_seq);
    the backward recomputes each block's probabilities from them (no score matrix kept)."""

    @staticmethod
    def forward(ctx, q, k, v, doc_ids, ring):
        b, h, n, d = q.shape
        scale = 1.0 / math.sqrt(d)
        qf = q.float()
        out = torch.zeros(b, h, n, d, dtype=torch.float32, device=q.device)
        lse = torch.full((b, h, n), float("-inf"), dtype=torch.float32, device=q.device)
        kv, doc = torch.stack([k, v]), doc_ids
        for step in range(ring.size):
            if step + 1 < ring.size:  # post the next block before computing this one
                nxt = [torch.empty_like(kv)] + ([] if doc is None else [torch.empty_like(doc)])
                works = ring.exchange([kv] + ([] if doc is None else [doc]), nxt,
                                      [_TAG_KV, _TAG_DOC], f"cp ring kv step {step + 1}")
            with events.compute_span(f"cp ring attention step {step}", "forward"):
                kf, vf = kv[0].float(), kv[1].float()
                for rows, n_keys, causal_mask in ring.pairs(step, n, q.device):
                    mask = _with_docs(causal_mask, None if doc is None else doc_ids[:, rows],
                                      None if doc is None else doc[:, :n_keys])
                    bo, bl = _block_forward(qf[..., rows, :], kf[..., :n_keys, :],
                                            vf[..., :n_keys, :], mask, scale)
                    out[..., rows, :], lse[..., rows] = _merge(
                        out[..., rows, :], lse[..., rows], bo, bl)
            if step + 1 < ring.size:
                _wait(works, f"cp ring kv step {step + 1}")
                kv, doc = nxt[0], (None if doc is None else nxt[1])
        ctx.save_for_backward(q, k, v, out, lse, doc_ids)
        ctx.ring = ring
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse, doc_ids = ctx.saved_tensors
        ring = ctx.ring
        n, d = q.shape[2], q.shape[3]
        scale = 1.0 / math.sqrt(d)
        qf, do = q.float(), dout.float()
        delta = (do * out).sum(dim=-1)  # (b, h, n): rowsum(dO * O)
        safe_lse = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)
        dq = torch.zeros_like(qf)
        kv, doc = torch.stack([k, v]), doc_ids
        acc_works, acc_in = None, None
        for step in range(ring.size):
            if step + 1 < ring.size:
                nxt = [torch.empty_like(kv)] + ([] if doc is None else [torch.empty_like(doc)])
                works = ring.exchange([kv] + ([] if doc is None else [doc]), nxt,
                                      [_TAG_KV, _TAG_DOC], f"cp ring kv grad step {step + 1}")
            dkv = torch.zeros(2, *k.shape, dtype=torch.float32, device=q.device)
            with events.compute_span(f"cp ring attention step {step}", "backward"):
                kf, vf = kv[0].float(), kv[1].float()
                for rows, n_keys, causal_mask in ring.pairs(step, n, q.device):
                    mask = _with_docs(causal_mask, None if doc is None else doc_ids[:, rows],
                                      None if doc is None else doc[:, :n_keys])
                    dq_rows, dk_rows, dv_rows = _block_backward(
                        qf[..., rows, :], kf[..., :n_keys, :], vf[..., :n_keys, :],
                        do[..., rows, :], safe_lse[..., rows], delta[..., rows], mask, scale)
                    dq[..., rows, :] += dq_rows
                    dkv[0, ..., :n_keys, :] += dk_rows
                    dkv[1, ..., :n_keys, :] += dv_rows
            if acc_works is not None:  # the block's dK/dV so far, from the ranks before
                _wait(acc_works, f"cp ring dkv step {step}")
                dkv += acc_in
            acc_in = torch.empty_like(dkv)
            acc_works = ring.exchange([dkv], [acc_in], [_TAG_GRAD], f"cp ring dkv step {step + 1}")
            if step + 1 < ring.size:
                _wait(works, f"cp ring kv grad step {step + 1}")
                kv, doc = nxt[0], (None if doc is None else nxt[1])
        _wait(acc_works, "cp ring dkv home")  # after the last step, our own block's
        return dq.to(q.dtype), acc_in[0].to(k.dtype), acc_in[1].to(v.dtype), None, None


def _block_backward(q, k, v, do, lse, delta, mask, scale):
    """(dq, dk, dv) of one block, float32, from the saved (finite) row log-sum-exp."""
    s = torch.matmul(q, k.transpose(-1, -2)) * scale
    p = torch.exp(s - lse.unsqueeze(-1))
    if mask is not None:
        p = p.masked_fill(~mask, 0.0)
    dv = torch.matmul(p.transpose(-1, -2), do)
    ds = p * (torch.matmul(do, v.transpose(-1, -2)) - delta.unsqueeze(-1))
    return torch.matmul(ds, k) * scale, torch.matmul(ds.transpose(-1, -2), q) * scale, dv
