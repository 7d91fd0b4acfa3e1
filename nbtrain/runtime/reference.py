"""The "reference" backend: one plain PyTorch model (the registered model, whole, from
its seed or its Hugging Face folder) on the whole global batch.

Every rank builds the same model from the same seed and computes the same step on the
same global batch with no collective, so every rank holds the baseline that other
backends are checked against (the role Megatron plays for Bumblebee). The parallel
layout and `num_micro_batches` are ignored: the whole batch is one forward and backward.

Packed documents: the model gets the batch's position_ids, so each document's positions
start at 0 and its tokens attend only to earlier tokens of the same document; a
packed row computes what its documents would one by one. The loss ignores -100
labels, so it is taken only within documents.
"""

from __future__ import annotations

import math

import torch

from ..comm import events
from ..comm.renamed import renamed_kwargs
from ..optim.manager import OptimManager
from .base import Runtime, labelled_weight, token_cross_entropy
from .config import ParallelConfig
from .contracts import ForwardResult, ModelHandle, PackedBatch


class ReferenceRuntime(Runtime):
    """The baseline backend; see the module docstring."""

    def build_model(self) -> ModelHandle:
        """The plain model of `NBConfig.model_config`, seeded by `NBConfig.seed`, with
        `hf_path`'s weights when given (the whole model, read on this rank). Local."""
        ctx = self._context()
        model, _ = self._plain_model(ctx.device, ParallelConfig())  # one process's layout
        protocol = self.nb.protocol()
        if self.cfg.hf_path is not None:
            protocol.load_hf_weights(model, self.cfg.hf_path)
        optimizer = self._optimizer(model.parameters())
        # The manager holds the loss-scale state and is the checkpoint's optimizer
        # container; its collective methods are never called here.
        manager = OptimManager(loss_scale=self.nb.loss_scale)
        manager.add_optimizer(optimizer)
        return ModelHandle(
            model,
            optimizer,
            self._scheduler(optimizer),
            manager,
            "reference",
            extra={"step": protocol.make_forward_step(model)},
        )

    @renamed_kwargs(num_microbatches="num_micro_batches")
    def forward_backward(
        self,
        handle: ModelHandle,
        data: PackedBatch,
        loss_fn=None,
        num_micro_batches: int | None = None,
    ) -> ForwardResult:
        """Forward and backward of the whole global batch; gradients accumulate.

        Args:
            data: the global batch.
            loss_fn: `loss_fn(logits, labels)` -> per-token losses (rows, seq_len);
                default: cross-entropy, 0 where labels are -100.
            num_micro_batches: accepted and ignored (one pass over the whole batch).

        The loss is the weighted mean of the token losses over the labelled tokens.
        Local.
        """
        loss_fn = loss_fn or token_cross_entropy
        device = next(handle.model.parameters()).device
        total = labelled_weight(data)
        logits = handle.extra["step"](data.input_ids.to(device), data.position_ids.to(device))
        tokens = loss_fn(logits, data.labels.to(device)).float()
        weights = data.token_weights().to(device)
        loss = (tokens * weights).sum() / total
        (loss * handle.manager.loss_scale).backward()
        return ForwardResult(
            metrics={
                "loss": float(loss.detach()),
                "tokens": int((data.labels != -100).sum()),
                "num_micro_batches": 1,
            },
            token_losses=(tokens.detach() * (weights > 0)).cpu(),
        )

    @torch.no_grad()
    def logits(self, handle: ModelHandle, data: PackedBatch) -> torch.Tensor:
        """The model's logits (rows, seq_len, vocab) for the batch, float32 on the CPU.
        Local."""
        device = next(handle.model.parameters()).device
        out = handle.extra["step"](data.input_ids.to(device), data.position_ids.to(device))
        return out.float().cpu()

    def optimizer_step(self, handle: ModelHandle) -> tuple[bool, float, int]:
        """Unscales, clips to `NBConfig.clip_grad_norm` and steps (or skips on inf/nan,
        halving the loss scale, as nbtrain's OptimManager does).

        Returns:
            (update_successful, grad_norm, num_zeros): grad_norm is the global norm of
            the unscaled gradients before clipping; num_zeros is how many of their
            elements are zero (a parameter without a gradient counts whole).

        Local.
        """
        manager = handle.manager
        params = [p for p in handle.model.parameters() if p.grad is not None]
        grads = [p.grad for p in params]
        zeros = sum(
            p.numel() if p.grad is None else p.numel() - int(torch.count_nonzero(p.grad))
            for p in handle.model.parameters()
        )
        if grads and manager.loss_scale != 1.0:
            torch._foreach_mul_(grads, 1.0 / manager.loss_scale)
        clip = self.nb.clip_grad_norm
        norm = float(torch.nn.utils.clip_grad_norm_(params, clip if clip is not None else math.inf))
        ok = math.isfinite(norm)
        if ok:
            handle.optimizer.step()
            handle.steps += 1
            manager.steps_since_rescale += 1
            if (
                manager.loss_scale_enabled
                and manager.steps_since_rescale >= manager.loss_scale_steps
            ):
                manager.loss_scale = min(
                    manager.loss_scale * manager.loss_scale_factor, manager.max_loss_scale
                )
                manager.steps_since_rescale = 0
        else:
            manager.steps_since_rescale = 0
            if manager.loss_scale_enabled:
                manager.loss_scale = max(
                    manager.loss_scale / manager.loss_scale_factor, manager.min_loss_scale
                )
        events.end_step()  # as OptimManager.step: the step's end (a MoE bias moves)
        return ok, norm, zeros
