"""The "nbtrain" backend: the GPT tensor-parallel, cut into pipeline stages and sharded
with ZeRO, per `NBConfig.parallel`.

    model = parallelize(GPT(cfg), gpt_plan(cfg))   # tp > 1: heads, MLP, vocabulary split
    stage = wrap(stage_of(gpt_layers(model)))      # this rank's stage, ZeRO over its dp ranks
    pipeline.run(stage, micro-batches, ...)        # every layout, pp = 1 included

Each data-parallel rank takes its rows of the global batch; its loss is scaled so the
data-parallel average of the gradients is the gradient of the global batch's mean
token loss, the reference's.

Packed documents: stages pass one tensor, so each micro-batch's position_ids reach
every stage's layers through the model's `StagePositions` (models/gpt_pipe.py), fed
one micro-batch per stage forward during `pipeline.run`; attention stays within each
document, as in the reference. The loss ignores -100 labels.
"""
from __future__ import annotations

import math

import torch

from ..comm import collectives as C
from ..optim.manager import OptimManager
from .base import Runtime, labelled_weight, token_cross_entropy
from .contracts import ForwardResult, ModelHandle, PackedBatch


class NBTrainRuntime(Runtime):
    """ZeRO + tensor + pipeline parallel backend; see the module docstring."""

    def build_model(self) -> ModelHandle:
        """Builds this rank's part of the model (re-making the context's tp/pp groups for
        this layout). Collective: every rank calls this."""
        from .. import pipeline
        from ..models.gpt_pipe import StagePositions, gpt_layers
        from ..models.gpt_tp import gpt_plan
        from ..nn.parallelize import parallelize
        from ..zero.wrap import wrap

        par = self.nb.parallel
        ctx = self._context(tp_size=par.tp, pipe_size=par.pp)
        gpt = self._plain_gpt(ctx.device)
        if par.tp > 1:
            gpt = parallelize(gpt, gpt_plan(gpt.cfg))
        positions = StagePositions()  # the micro-batch's position ids, for every stage
        stage = wrap(pipeline.stage_of(gpt_layers(gpt, positions)), zero_level=par.zero_level)
        optimizer = self._optimizer(stage.parameters())
        manager = OptimManager(loss_scale=self.nb.loss_scale)
        manager.add_optimizer(optimizer)  # the schedule is stepped by lr_scheduler_step
        return ModelHandle(stage, optimizer, self._scheduler(optimizer), manager, "nbtrain",
                           extra={"layout": (par.tp, par.pp, ctx.world_size),
                                  "positions": positions})

    def _topology(self, handle: ModelHandle):
        topo = self._context().topology
        if (topo.tp_size, topo.pipe_size, topo.world_size) != handle.extra["layout"]:
            tp, pp, world = handle.extra["layout"]
            raise RuntimeError(
                f"this model was built for tp={tp}, pp={pp} on {world} ranks, but the "
                f"distributed context now has tp={topo.tp_size}, pp={topo.pipe_size}: "
                "another runtime re-made the groups; finish with one layout before building "
                "the next")
        return topo

    def forward_backward(self, handle: ModelHandle, data: PackedBatch, loss_fn=None,
                         num_microbatches: int | None = None) -> ForwardResult:
        """Forward and backward of the global batch `data`: this data-parallel rank's
        rows, in `num_microbatches` micro-batches (default `ParallelConfig.
        num_microbatches`) through the pipeline schedule (1F1B).

        Args:
            data: the global batch, the same on every rank.
            loss_fn: `loss_fn(logits, labels)` -> per-token losses (rows, seq_len);
                default: cross-entropy, 0 where labels are -100.

        Returns the loss over the whole global batch and every token's loss, the same on
        every rank. Collective: every rank calls this with the same batch.
        """
        loss_fn = loss_fn or token_cross_entropy
        topo = self._topology(handle)
        micro = num_microbatches or self.nb.parallel.num_microbatches
        mine = data.rows_for(topo.dp_rank, topo.dp_size)
        parts = mine.split(micro)
        # Each rank's objective is dp * (its weighted token-loss sum) / (the global
        # batch's total weight): the dp average of the gradients is the global mean's.
        # pipeline.run backpropagates loss_fn / micro, hence the factor micro.
        factor = micro * topo.dp_size * handle.manager.loss_scale / labelled_weight(data)
        token_losses = []

        def stage_loss(logits, target):
            labels, weights = (t.to(logits.device) for t in target)
            tokens = loss_fn(logits, labels).float()
            token_losses.append((tokens.detach() * (weights > 0)))
            return (tokens * weights).sum() * factor

        from .. import pipeline

        with handle.extra["positions"].feeding(handle.model, [p.position_ids for p in parts]):
            pipeline.run(handle.model, [p.input_ids for p in parts],
                         [(p.labels, p.token_weights()) for p in parts], stage_loss)
        tokens = self._gather_token_losses(token_losses, mine, topo)
        loss = float((tokens * data.token_weights()).sum()) / labelled_weight(data)
        return ForwardResult(
            metrics={"loss": loss, "tokens": int((data.labels != -100).sum()),
                     "num_microbatches": micro},
            token_losses=tokens)

    def _gather_token_losses(self, parts: list, mine: PackedBatch, topo) -> torch.Tensor:
        """The global batch's token losses (rows, seq_len) on the CPU, on every rank:
        from the last stage to its pipeline, then over the data-parallel ranks."""
        device = self._context().device
        local = torch.cat(parts) if parts else \
            torch.zeros(mine.rows, mine.seq_len, dtype=torch.float32, device=device)
        if topo.pipe_size > 1:
            C.broadcast(local, src=topo.ranks("pipe")[-1], group=topo.group("pipe"),
                        label="runtime token losses")
        if topo.dp_size == 1:
            return local.cpu()
        out = torch.empty(topo.dp_size * local.numel(), dtype=local.dtype, device=device)
        C.all_gather(out, local.reshape(-1).contiguous(), group=topo.group("dp"),
                     label="runtime token losses")
        return out.view(-1, mine.seq_len).cpu()

    def optimizer_step(self, handle: ModelHandle) -> tuple[bool, float, int | None]:
        """Unscales, clips the global gradient norm to `NBConfig.clip_grad_norm`, checks
        every rank for inf/nan and steps or skips (OptimManager's dynamic loss scale).

        Returns:
            (update_successful, grad_norm, num_zeros): grad_norm is the global norm of
            the unscaled gradients before clipping, each element of the model counted
            once (a weight tied across pipeline stages once, not once per stage);
            num_zeros is None (not counted).

        Collective: every rank calls this.
        """
        self._topology(handle)
        # OptimManager counts each element once: a weight tied across pipeline stages
        # on its first stage only, a stage's replicated parameters on one of its ranks.
        norm = handle.manager.clip_grad_norm(self.nb.clip_grad_norm or math.inf)
        ok = handle.manager.step()
        if ok:
            handle.steps += 1
        return ok, norm, None
