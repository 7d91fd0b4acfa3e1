"""Ring attention: exact attention over a sequence sharded across the ranks of a group.

Each cp rank holds q, k, v of its shard of the sequence; `ring_attention` keeps the
local queries and passes K/V blocks around the ring (rank i sends to i+1), merging each
step's partial result by its log-sum-exp (online softmax), in float32. The next block's
send/receive is posted before the current block is computed and waited after it. The
backward recomputes each block's probabilities from the saved output and log-sum-exp and
passes K/V around again; a block's dK/dV travel with it and reach their owner after the
last step (cp sends; the last one, home, has no compute left to hide behind).

Layouts (which chunks of the full sequence a rank holds, `SequenceLayout`):
    contiguous  cp chunks, rank r holds chunk r. Causal work grows with r.
    zigzag      2*cp chunks, rank r holds chunks r and 2*cp-1-r: an early and a late
                chunk, so every rank has the same number of causal (query, key) pairs.

Causal masks follow global positions, exact for either layout: a rank's tokens ascend,
so its own block is causal by local index, and every other chunk pair is entirely
visible (a leading run of the held block's keys) or entirely in the future (skipped).
Packed documents come as `doc_ids` (batch, local_seq), sharded like the tokens; they
travel with K/V and restrict attention to a token's own document.

Block kernel: where torch has a fused attention returning the log-sum-exp (CPU: the
flash-attention ops behind SDPA, masks included; CUDA: the memory-efficient ones, no
mask), a block runs it, and its fused backward given the merged output and log-sum-exp;
else the float32 math (`Ring(kernel="math")` forces it). A fused op is checked against
the math once per device, dtype, head size and masking, and left (warning) if it fails.

Point-to-point traffic goes through `torch.distributed.batch_isend_irecv` (a paired
send and receive with the same neighbour must be one batch on NCCL, which would else
deadlock at cp 2); its bytes go to nbtrain's P2P counter. `Ring` chooses and moves a
call's blocks: a subclass given as `ring=` can change either (nbtrain bench --ring does).
"""
from __future__ import annotations

import enum
import functools
import math
import warnings
from typing import NamedTuple

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ..comm import collectives as C
from ..comm import events
from ..comm.topology import ALONE

# Tags keep the ring's messages apart from other P2P traffic (gloo matches by tag, NCCL by order)
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
    """This rank's shard of the full tensor `x` along `dim` (a copy, contiguous); its length
    there must divide into cp chunks (contiguous) or 2*cp (zigzag). Local."""
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
                   layout="zigzag", *, ring=None):
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
        raise ValueError(f"ring_attention: q, k, v must share one shape (batch, heads, local_"
                         f"seq, head_dim); got {[tuple(t.shape) for t in (q, k, v)]}")
    if not q.dtype.is_floating_point or q.dtype != k.dtype or q.dtype != v.dtype:
        raise ValueError(f"ring_attention: q, k, v must share one floating dtype; got "
                         f"{q.dtype}, {k.dtype}, {v.dtype}")
    if layout is SequenceLayout.ZIGZAG and q.shape[2] % 2:
        raise ValueError(f"ring_attention: local_seq={q.shape[2]} is odd; the zigzag layout holds"
                         f" two equal chunks per rank: pad the full sequence to a multiple of "
                         f"2*cp, or use layout='contiguous'")
    if doc_ids is not None and (doc_ids.dtype.is_floating_point or doc_ids.dtype == torch.bool
                                or tuple(doc_ids.shape) != (q.shape[0], q.shape[2])):
        raise ValueError(f"ring_attention: doc_ids must be integers shaped (batch, local_seq)"
                         f" = {(q.shape[0], q.shape[2])}; got {doc_ids.dtype} "
                         f"{tuple(doc_ids.shape)}")


class Block(NamedTuple):
    """Local query rows that meet a leading run of the held K/V block at one step."""
    rows: slice    # this rank's query rows
    keys: int      # how many leading keys of the held block they see
    causal: bool   # ends on the diagonal: row i sees keys up to i + keys - rows


def _step_blocks(rank: int, size: int, step: int, local_seq: int, layout, causal: bool,
                 whole_diagonal: bool = True) -> list[Block]:
    """The blocks `rank` computes at `step` (holding rank - step's). Its own block under a
    causal mask is one square causal block (`whole_diagonal`: a fused kernel skips the
    future half itself) or one per query chunk, ending on the diagonal (for the math
    kernel). Query chunks seeing the same keys are one block."""
    source = (rank - step) % size
    if causal and source == rank and whole_diagonal:
        return [Block(slice(0, local_seq), local_seq, True)]
    q_ids, k_ids = chunk_ids(rank, size, layout), chunk_ids(source, size, layout)
    c = local_seq // len(q_ids)
    blocks: list[Block] = []
    for i, qc in enumerate(q_ids):
        seen = [kc for kc in k_ids if not causal or kc <= qc]
        if not seen:
            continue  # every key of the block is in this chunk's future: no compute
        diagonal, keys = causal and seen[-1] == qc, c * len(seen)
        if blocks and not diagonal and blocks[-1][1:] == (keys, False):  # widen it
            blocks[-1] = Block(slice(blocks[-1].rows.start, (i + 1) * c), keys, False)
        else:
            blocks.append(Block(slice(i * c, (i + 1) * c), keys, diagonal))
    return blocks


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
        return _step_blocks(self.rank, self.size, step, local_seq, self.layout, self.causal,
                            whole_diagonal)

    def exchange(self, sends: list, recvs: list, tags: list, label: str) -> list:
        """Sends `sends` to the next rank and receives `recvs` from the previous one (one
        batch), counts the bytes; returns works to `wait()` on before using either."""
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


def _visible(block: Block, q_doc, k_doc):
    """bool (batch, 1, rows, keys): which (query, key) pairs of a block share a document
    (None without documents); a kernel adds a causal block's own mask to it."""
    if q_doc is None:
        return None
    return (q_doc[:, block.rows].unsqueeze(2) == k_doc[:, :block.keys].unsqueeze(1)).unsqueeze(1)


def _diagonal(block: Block, mask, device=None):
    """`mask` (or None) narrowed, for a causal block, to its causal pairs."""
    if not block.causal:
        return mask
    rows = block.rows.stop - block.rows.start
    diagonal = torch.ones(rows, block.keys, dtype=torch.bool,
                          device=device or mask.device).tril(block.keys - rows)
    return diagonal if mask is None else mask & diagonal


def _block_forward(q, k, v, mask, scale):
    """The math kernel: attention of q over one key block, in q's (float) dtype:
    (out, lse). A row whose keys are all masked gets out 0 and lse -inf (no NaN)."""
    s = torch.matmul(q, k.transpose(-1, -2)) * scale
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf"))
    m = s.amax(dim=-1, keepdim=True).nan_to_num(neginf=0.0)  # a row with no key: 0
    p = torch.exp(s - m)
    total = p.sum(dim=-1, keepdim=True)
    out = torch.matmul(p, v) / torch.where(total > 0, total, torch.ones_like(total))
    return out, (m + torch.log(total)).squeeze(-1)


def _block_backward(q, k, v, do, lse, delta, mask, scale):
    """The math kernel's (dq, dk, dv) of one block from the merged (finite) row
    log-sum-exp and delta = rowsum(dO * O)."""
    s = torch.matmul(q, k.transpose(-1, -2)) * scale
    p = torch.exp(s - lse.unsqueeze(-1))
    if mask is not None:
        p = p.masked_fill(~mask, 0.0)
    dv = torch.matmul(p.transpose(-1, -2), do)
    ds = p * (torch.matmul(do, v.transpose(-1, -2)) - delta.unsqueeze(-1))
    return torch.matmul(ds, k) * scale, torch.matmul(ds.transpose(-1, -2), q) * scale, dv


def _cpu_forward(q, k, v, causal, bias, scale):
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q, k, v, 0.0, causal, attn_mask=bias, scale=scale)


def _cpu_backward(do, q, k, v, out, lse, causal, bias, scale):
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        do, q, k, v, out, lse, 0.0, causal, attn_mask=bias, scale=scale)


def _cuda_forward(q, k, v, causal, bias, scale):
    out, lse = torch.ops.aten._scaled_dot_product_efficient_attention(
        q.contiguous(), k.contiguous(), v.contiguous(), None, True, 0.0, causal,
        scale=scale)[:2]
    return out, lse[..., :q.shape[2]]  # its rows are padded to a multiple of 32


def _cuda_backward(do, q, k, v, out, lse, causal, bias, scale):
    lse = F.pad(lse, (0, -q.shape[2] % 32))  # the padded rows its forward gives
    unused = torch.zeros((), dtype=torch.int64, device=q.device)  # philox: no dropout
    return torch.ops.aten._scaled_dot_product_efficient_attention_backward(
        do.contiguous(), q.contiguous(), k.contiguous(), v.contiguous(), None,
        out.contiguous(), lse, unused, unused, 0.0, [True, True, True, False], causal,
        scale=scale)[:3]


# device type: (forward, backward, dtypes, takes a mask). Both take (batch, heads, seq,
# dim) and give (out, lse) / (dq, dk, dv); a mask comes as an additive bias of q's dtype.
_FUSED = {
    "cpu": (_cpu_forward, _cpu_backward,
            (torch.float32, torch.float64, torch.bfloat16, torch.float16), True),
    "cuda": (_cuda_forward, _cuda_backward,
             (torch.float32, torch.bfloat16, torch.float16), False),
}


class _Kernel:
    """A call's block kernel: a `_FUSED` entry (run on q's dtype) or None, the math (in
    float32; float64 stays float64). Both give (out, lse) and (dq, dk, dv) in `acc`."""

    def __init__(self, fused, dtype):
        self.fused, self.acc = fused, torch.float64 if dtype == torch.float64 else torch.float32
        self.dtype = dtype if fused else self.acc

    def _masks(self, block, mask, q):
        """The math's bool mask (documents and causal), or the fused op's (is_causal, the
        documents' additive bias or None)."""
        if self.fused is None:
            return _diagonal(block, mask, q.device),
        return block.causal, None if mask is None else torch.zeros(
            mask.shape, dtype=q.dtype, device=q.device).masked_fill_(~mask, float("-inf"))

    def forward(self, q, k, v, block, mask, scale):
        if self.fused is None:
            return _block_forward(q, k, v, *self._masks(block, mask, q), scale)
        out, lse = self.fused[0](q, k, v, *self._masks(block, mask, q), scale)
        if mask is not None:  # a row with no key: out 0, lse -inf (the op gives 0). A causal
            lse = lse.masked_fill(~mask.any(dim=-1), float("-inf"))  # row sees itself
        return out.to(self.acc), lse.to(self.acc)

    def backward(self, do, q, k, v, out, lse, delta, block, mask, scale):
        if self.fused is None:
            return _block_backward(q, k, v, do, lse, delta, *self._masks(block, mask, q), scale)
        grads = self.fused[1](do, q, k, v, out, lse.contiguous(),
                              *self._masks(block, mask, q), scale)
        return [g.to(self.acc) for g in grads]


def _kernel(choice, q, masked: bool) -> _Kernel:
    use = choice == "auto" and _fused_works(q.device, q.dtype, q.shape[-1], masked)
    return _Kernel(_FUSED[q.device.type] if use else None, q.dtype)


@functools.lru_cache(maxsize=None)
def _fused_works(device: torch.device, dtype: torch.dtype, head_dim: int, masked: bool):
    """Does this device's fused op exist, take `dtype` (and a mask), and agree with the
    math kernel on a small causal block, forward and backward? Once per arguments."""
    entry = _FUSED.get(device.type)
    if entry is None or dtype not in entry[2] or (masked and not entry[3]):
        return False
    x = torch.randn(4, 1, 2, 40, head_dim, generator=torch.Generator().manual_seed(0))
    x, block, mask, scale = x.to(device, dtype), Block(slice(0, 40), 40, True), None, 0.125
    if masked:  # documents of 5, 30 and 5 queries; no key in the third
        doc = torch.tensor([[0] * 5 + [1] * 30 + [2] * 5], device=device)
        mask = _visible(block, doc, doc.clamp(max=1))
    ref, fused = _Kernel(None, dtype), _Kernel(entry, dtype)
    q, k, v, do = x.to(ref.acc)
    want = ref.forward(q, k, v, block, mask, scale)
    lse, delta = want[1].nan_to_num(neginf=0.0), (do * want[0]).sum(dim=-1)
    want += tuple(ref.backward(do, q, k, v, want[0], lse, delta, block, mask, scale))
    try:
        got = fused.forward(*x[:3], block, mask, scale) + tuple(fused.backward(
            x[3], *x[:3], want[0].to(dtype), lse, delta, block, mask, scale))
    except RuntimeError as err:
        why = f"{type(err).__name__}: {str(err).splitlines()[0]}"
    else:
        tol = 1e-4 if ref.acc == dtype else 5e-2
        if all(torch.allclose(a, b, rtol=tol, atol=tol) for a, b in zip(want, got)):
            return True
        why = "its results differ from the math kernel's"
    warnings.warn(f"ring_attention: the fused attention op for {device.type} {dtype} (head_"
                  f"dim {head_dim}, masked={masked}) is not used: {why}", RuntimeWarning)
    return False


def _merge(out, lse, block_out, block_lse):
    """The log-sum-exp merge of two partial softmax results over disjoint keys."""
    new = torch.logaddexp(lse, block_lse)
    safe = torch.where(torch.isinf(new), torch.zeros_like(new), new)  # rows with no key
    out = out * torch.exp(lse - safe).unsqueeze(-1) + \
        block_out * torch.exp(block_lse - safe).unsqueeze(-1)
    return out, new


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
                works = ring.exchange([kv] + ([] if doc is None else [doc]), nxt,
                                      [_TAG_KV, _TAG_DOC], f"cp ring kv step {step + 1}")
            with events.compute_span(f"cp ring attention step {step}", "forward"):
                kvk = kv.to(kernel.dtype)
                for block in ring.blocks(step, n, kernel.fused is not None):
                    rows, keys = block.rows, block.keys
                    mask = _visible(block, doc_ids, doc)
                    bo, bl = kernel.forward(qk[..., rows, :], kvk[0, ..., :keys, :],
                                            kvk[1, ..., :keys, :], block, mask, scale)
                    out[..., rows, :], lse[..., rows] = _merge(
                        out[..., rows, :], lse[..., rows], bo, bl)
            if step + 1 < ring.size:  # needed now: the next step computes on it
                _wait(works, f"cp ring kv step {step + 1}")
                kv, doc = nxt[0], (None if doc is None else nxt[1])
        ctx.save_for_backward(q, k, v, out, lse, doc_ids)
        ctx.ring, ctx.kernel = ring, kernel
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse, doc_ids = ctx.saved_tensors
        ring, kernel = ctx.ring, ctx.kernel
        n, scale = q.shape[2], 1.0 / math.sqrt(q.shape[3])
        do = dout.to(kernel.acc)
        delta = (do * out).sum(dim=-1)  # (b, h, n): rowsum(dO * O), for the math kernel
        safe_lse = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)
        qk, dok, outk = q.to(kernel.dtype), do.to(kernel.dtype), out.to(kernel.dtype)
        dq = torch.zeros(q.shape, dtype=kernel.acc, device=q.device)
        kv, doc = torch.stack([k, v]), doc_ids
        acc_works, acc_in = None, None
        for step in range(ring.size):
            if step + 1 < ring.size:
                nxt = [torch.empty_like(kv)] + ([] if doc is None else [torch.empty_like(doc)])
                works = ring.exchange([kv] + ([] if doc is None else [doc]), nxt,
                                      [_TAG_KV, _TAG_DOC], f"cp ring kv grad step {step + 1}")
            dkv = torch.zeros(2, *k.shape, dtype=kernel.acc, device=q.device)
            with events.compute_span(f"cp ring attention step {step}", "backward"):
                kvk = kv.to(kernel.dtype)
                for block in ring.blocks(step, n, kernel.fused is not None):
                    rows, keys = block.rows, block.keys
                    mask = _visible(block, doc_ids, doc)
                    dq_rows, dk_rows, dv_rows = kernel.backward(
                        dok[..., rows, :], qk[..., rows, :], kvk[0, ..., :keys, :],
                        kvk[1, ..., :keys, :], outk[..., rows, :], safe_lse[..., rows],
                        delta[..., rows], block, mask, scale)
                    dq[..., rows, :] += dq_rows
                    dkv[0, ..., :keys, :] += dk_rows
                    dkv[1, ..., :keys, :] += dv_rows
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
