"""The activation term of a model the planner has no formula for, measured: one
micro-batch's forward and loss run under `torch.autograd.graph.saved_tensors_hooks`,
counting the bytes autograd keeps for backward, by layer.

On the meta device (a model built under `torch.device("meta")`, a transformers model
from its config) nothing is allocated and the trace is exact for the shapes; a model
with real weights is traced by a real forward of one row on this rank. Either way the
result says which (`ActivationTrace.where`).

Tensors that are parameters (or views of them, a transposed weight) are not counted:
the parameter terms hold them. A tensor saved by several ops is counted once.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ActivationTrace:
    """Bytes saved for backward by one traced micro-batch of `tokens` tokens.

    Attributes:
        tokens: tokens traced (rows x seq).
        layer_bytes: saved while the largest layer of the layer list ran forward.
        outside_bytes: saved outside the layers (embeddings, final norm, head, logits
            and the loss's log-softmax).
        where: "the meta device" or "this rank" (a real forward on this process).
    """

    tokens: int
    layer_bytes: int
    outside_bytes: int
    where: str

    def per_token(self) -> tuple[float, float]:
        """(layer bytes, outside bytes) per token."""
        return self.layer_bytes / self.tokens, self.outside_bytes / self.tokens


def _logits(out):
    if torch.is_tensor(out):
        return out
    logits = getattr(out, "logits", None)
    if torch.is_tensor(logits):
        return logits
    if isinstance(out, (tuple, list)) and out and torch.is_tensor(out[0]):
        return out[0]
    raise TypeError(
        f"plan: the model's forward returned a {type(out).__name__}; the trace needs "
        "logits (a tensor, an output with .logits, or a tuple starting with them)"
    )


def _forward(model, ids):
    """The model's logits for token ids: HF-style `input_ids=`, then `(ids,)`, then
    nbtrain's `(ids, positions)`."""
    positions = torch.arange(ids.shape[1], device=ids.device).expand_as(ids)
    attempts = (
        lambda: model(input_ids=ids),
        lambda: model(ids),
        lambda: model(ids, positions),
    )
    errors = []
    for call in attempts:
        try:
            return _logits(call())
        except TypeError as err:
            errors.append(str(err))
    raise TypeError(
        "plan: could not call the model on token ids (tried model(input_ids=ids), "
        f"model(ids), model(ids, positions)): {errors[-1]}"
    )


def trace_activations(model: torch.nn.Module, layers, seq: int, rows: int = 1) -> ActivationTrace:
    """The ActivationTrace of `rows` x `seq` token ids through `model` and a
    cross-entropy loss over its logits; `layers` is the model's list of blocks."""
    first = next(iter(model.parameters()), None)
    device = first.device if first is not None else torch.device("cpu")
    where = "the meta device" if device.type == "meta" else "this rank"
    params = {id(p) for p in model.parameters()}
    kept: dict[int, tuple[torch.Tensor, int, int | None]] = {}  # id -> (tensor, bytes, layer)
    current: list[int | None] = [None]

    def pack(t):
        base = t._base if t._base is not None else t
        if id(t) not in params and id(base) not in params and id(base) not in kept:
            kept[id(base)] = (base, base.numel() * base.element_size(), current[0])
        return t

    def enter(index):
        def hook(module, args):
            current[0] = index

        return hook

    def leave(module, args, out):
        current[0] = None

    handles = []
    for index, layer in enumerate(layers):
        handles.append(layer.register_forward_pre_hook(enter(index)))
        handles.append(layer.register_forward_hook(leave))
    ids = torch.zeros(rows, seq, dtype=torch.long, device=device)
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            with torch.enable_grad():
                logits = _forward(model, ids)
                torch.nn.functional.cross_entropy(
                    logits.float().reshape(-1, logits.shape[-1]), ids.reshape(-1)
                )
    finally:
        for h in handles:
            h.remove()
    by_layer: dict[int, int] = {}
    outside = 0
    for _, size, layer in kept.values():
        if layer is None:
            outside += size
        else:
            by_layer[layer] = by_layer.get(layer, 0) + size
    return ActivationTrace(rows * seq, max(by_layer.values(), default=0), outside, where)
