"""Ring attention's block kernels: attention of local queries over one K/V block.

Where torch has a fused attention returning the log-sum-exp (CPU: the flash-attention
ops behind SDPA, masks included; CUDA: the memory-efficient ones, no mask), a block runs
it, and its fused backward given the merged output and log-sum-exp; else the float32
math (`Ring(kernel="math")` forces it). A fused op is checked against the math once per
device, dtype, head size and masking (`_fused_works`), and left (warning) if it fails.
A block's partial result joins the others by its log-sum-exp (`_merge`).
"""

from __future__ import annotations

import functools
import warnings

import torch
import torch.nn.functional as F

from .layout import RingBlock


def _visible(block: RingBlock, q_doc, k_doc):
    """bool (batch, 1, rows, keys): which (query, key) pairs of a block share a document
    (None without documents); a kernel adds a causal block's own mask to it."""
    if q_doc is None:
        return None
    return (q_doc[:, block.rows].unsqueeze(2) == k_doc[:, : block.keys].unsqueeze(1)).unsqueeze(1)


def _diagonal(block: RingBlock, mask, device=None):
    """`mask` (or None) narrowed, for a causal block, to its causal pairs."""
    if not block.causal:
        return mask
    rows = block.rows.stop - block.rows.start
    diagonal = torch.ones(rows, block.keys, dtype=torch.bool, device=device or mask.device).tril(
        block.keys - rows
    )
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
        q, k, v, 0.0, causal, attn_mask=bias, scale=scale
    )


def _cpu_backward(do, q, k, v, out, lse, causal, bias, scale):
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        do, q, k, v, out, lse, 0.0, causal, attn_mask=bias, scale=scale
    )


def _cuda_forward(q, k, v, causal, bias, scale):
    out, lse = torch.ops.aten._scaled_dot_product_efficient_attention(
        q.contiguous(), k.contiguous(), v.contiguous(), None, True, 0.0, causal, scale=scale
    )[:2]
    return out, lse[..., : q.shape[2]]  # its rows are padded to a multiple of 32


def _cuda_backward(do, q, k, v, out, lse, causal, bias, scale):
    lse = F.pad(lse, (0, -q.shape[2] % 32))  # the padded rows its forward gives
    unused = torch.zeros((), dtype=torch.int64, device=q.device)  # philox: no dropout
    return torch.ops.aten._scaled_dot_product_efficient_attention_backward(
        do.contiguous(),
        q.contiguous(),
        k.contiguous(),
        v.contiguous(),
        None,
        out.contiguous(),
        lse,
        unused,
        unused,
        0.0,
        [True, True, True, False],
        causal,
        scale=scale,
    )[:3]


# device type: (forward, backward, dtypes, takes a mask). Both take (batch, heads, seq,
# dim) and give (out, lse) / (dq, dk, dv); a mask comes as an additive bias of q's dtype.
_FUSED = {
    "cpu": (
        _cpu_forward,
        _cpu_backward,
        (torch.float32, torch.float64, torch.bfloat16, torch.float16),
        True,
    ),
    "cuda": (_cuda_forward, _cuda_backward, (torch.float32, torch.bfloat16, torch.float16), False),
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
            return (_diagonal(block, mask, q.device),)
        return block.causal, None if mask is None else torch.zeros(
            mask.shape, dtype=q.dtype, device=q.device
        ).masked_fill_(~mask, float("-inf"))

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
        grads = self.fused[1](
            do, q, k, v, out, lse.contiguous(), *self._masks(block, mask, q), scale
        )
        return [g.to(self.acc) for g in grads]


def _kernel(choice, q, masked: bool) -> _Kernel:
    use = choice == "auto" and _fused_works(q.device, q.dtype, q.shape[-1], masked)
    return _Kernel(_FUSED[q.device.type] if use else None, q.dtype)


def uses_fused_kernel(q: torch.Tensor, masked: bool = False) -> bool:
    """Whether ring attention (kernel "auto") runs its blocks on the fused op for q's
    device, dtype and head size (with packed documents when `masked`), else the float32
    math. Checks the op once per arguments (see `_fused_works`). Local."""
    return _kernel("auto", q, masked).fused is not None


@functools.lru_cache(maxsize=None)
def _fused_works(device: torch.device, dtype: torch.dtype, head_dim: int, masked: bool):
    """Does this device's fused op exist, take `dtype` (and a mask), and agree with the
    math kernel on a small causal block, forward and backward? Once per arguments."""
    entry = _FUSED.get(device.type)
    if entry is None or dtype not in entry[2] or (masked and not entry[3]):
        return False
    x = torch.randn(4, 1, 2, 40, head_dim, generator=torch.Generator().manual_seed(0))
    x, block, mask, scale = x.to(device, dtype), RingBlock(slice(0, 40), 40, True), None, 0.125
    if masked:  # documents of 5, 30 and 5 queries; no key in the third
        doc = torch.tensor([[0] * 5 + [1] * 30 + [2] * 5], device=device)
        mask = _visible(block, doc, doc.clamp(max=1))
    ref, fused = _Kernel(None, dtype), _Kernel(entry, dtype)
    q, k, v, do = x.to(ref.acc)
    want = ref.forward(q, k, v, block, mask, scale)
    lse, delta = want[1].nan_to_num(neginf=0.0), (do * want[0]).sum(dim=-1)
    want += tuple(ref.backward(do, q, k, v, want[0], lse, delta, block, mask, scale))
    try:
        got = fused.forward(*x[:3], block, mask, scale) + tuple(
            fused.backward(x[3], *x[:3], want[0].to(dtype), lse, delta, block, mask, scale)
        )
    except RuntimeError as err:
        why = f"{type(err).__name__}: {str(err).splitlines()[0]}"
    else:
        tol = 1e-4 if ref.acc == dtype else 5e-2
        if all(torch.allclose(a, b, rtol=tol, atol=tol) for a, b in zip(want, got)):
            return True
        why = "its results differ from the math kernel's"
    warnings.warn(
        f"ring_attention: the fused attention op for {device.type} {dtype} (head_"
        f"dim {head_dim}, masked={masked}) is not used: {why}",
        RuntimeWarning,
        stacklevel=2,
    )
    return False


def _merge(out, lse, block_out, block_lse):
    """The log-sum-exp merge of two partial softmax results over disjoint keys."""
    new = torch.logaddexp(lse, block_lse)
    safe = torch.where(torch.isinf(new), torch.zeros_like(new), new)  # rows with no key
    out = out * torch.exp(lse - safe).unsqueeze(-1) + block_out * torch.exp(
        block_lse - safe
    ).unsqueeze(-1)
    return out, new
