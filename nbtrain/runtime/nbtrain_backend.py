"""The "nbtrain" backend: the registered model tensor-parallel, cut into pipeline stages
and sharded with ZeRO, per `NBConfig.parallel` (the model's protocol module, see
nbtrain/models/registry.py, gives each piece):

    model = build_model(config, parallel)               # on the meta device with hf_path
    model = parallelize(model, tp_plan(config))         # tp > 1: heads, MLP, vocabulary split
    stage = wrap(stage_of(pp_stages(model, pp, positions)))  # this rank's stage, ZeRO
    load_hf_weights(stage, hf_path)                     # only this rank's slices are kept
    pipeline.run(stage, micro-batches, ...)             # every layout, pp = 1 included

Each data-parallel rank takes its rows of the global batch; its loss is scaled so the
data-parallel average of the gradients is the gradient of the global batch's mean
token loss, the reference's.

Packed documents: stages pass one tensor, so each micro-batch's position_ids reach
every stage's layers through a `StagePositions` (models/gpt_pipe.py), fed
one micro-batch per stage forward during `pipeline.run`; attention stays within each
document, as in the reference. The loss ignores -100 labels.
"""

from __future__ import annotations

import math

import torch

from ..comm import collectives as C
from ..comm.renamed import renamed_kwargs
from ..optim.manager import OptimManager
from ..zero import full_numel
from .base import Runtime, labelled_weight, token_cross_entropy
from .contracts import ForwardResult, ModelHandle, PackedBatch


class NBTrainRuntime(Runtime):
    """ZeRO + tensor + pipeline parallel backend; see the module docstring."""

    def build_model(self) -> ModelHandle:
        """Builds this rank's part of the model (re-making the context's tp/pp groups for
        this layout). Collective: every rank calls this."""
        from .. import pipeline
        from ..models.gpt_pipe import StagePositions
        from ..models.hf_load import record_plain_names
        from ..tensor_parallel.parallelize import parallelize
        from ..zero import wrap

        par = self.nb.parallel
        ctx = self._context(
            tp_size=par.tp_size, pipe_size=par.pipe_size, ep_size=par.ep_size, cp_size=par.cp_size
        )
        hf_path = self.cfg.hf_path
        protocol = self.nb.protocol()
        # From a folder: built on the meta device, so a rank allocates only its shards.
        model, config = self._plain_model("meta" if hf_path else ctx.device, par)
        # The whole model's, ties once (experts split over ep: their full shapes).
        numel = sum(full_numel(p) for p in model.parameters())
        if par.cp_size > 1:
            from ..models.gpt import GPT
            from ..models.llama import Llama

            if not isinstance(model, (GPT, Llama)):
                raise NotImplementedError(
                    f"ParallelConfig(cp_size={par.cp_size}): model {self.nb.model_name!r} "
                    f"({type(model).__name__}) has no context-parallel attention; the "
                    "built-in 'gpt', 'gpt2', 'gpt_moe' and 'llama' have: use one of "
                    "them, or cp_size=1"
                )
        if par.tp_size > 1:
            model = parallelize(model, protocol.tp_plan(config))
        positions = StagePositions()  # the micro-batch's position ids, for every stage
        stage = pipeline.stage_of(protocol.pp_stages(model, par.pipe_size, positions))
        record_plain_names(stage, model)  # for hf_path's names, and save_pretrained's
        stage = wrap(stage, zero_level=par.zero_level)
        if hf_path:
            protocol.load_hf_weights(stage, hf_path)
        optimizer = self._optimizer(stage.parameters())
        manager = OptimManager(loss_scale=self.nb.loss_scale)
        manager.add_optimizer(optimizer)  # the schedule is stepped by lr_scheduler_step
        return ModelHandle(
            stage,
            optimizer,
            self._scheduler(optimizer),
            manager,
            "nbtrain",
            extra={
                "layout": (par.tp_size, par.pipe_size, par.ep_size, ctx.world_size),
                "positions": positions,
                "numel": numel,
            },
        )

    def _topology(self, handle: ModelHandle):
        topo = self._context().topology
        if (topo.tp_size, topo.pipe_size, topo.ep_size, topo.world_size) != handle.extra["layout"]:
            tp, pp, ep, world = handle.extra["layout"]
            raise RuntimeError(
                f"this model was built for tp={tp}, pp={pp}, ep={ep} on {world} ranks, but "
                f"the distributed context now has tp={topo.tp_size}, pp={topo.pipe_size}, "
                f"ep={topo.ep_size}: "
                "another runtime re-made the groups; finish with one layout before building "
                "the next"
            )
        return topo

    @renamed_kwargs(num_microbatches="num_micro_batches")
    def forward_backward(
        self,
        handle: ModelHandle,
        data: PackedBatch,
        loss_fn=None,
        num_micro_batches: int | None = None,
    ) -> ForwardResult:
        """Forward and backward of the global batch `data`: this data-parallel rank's
        rows, in `num_micro_batches` micro-batches (default `ParallelConfig.
        num_micro_batches`) through the pipeline schedule (1F1B).

        Args:
            data: the global batch, the same on every rank.
            loss_fn: `loss_fn(logits, labels)` -> per-token losses (rows, seq_len);
                default: cross-entropy, 0 where labels are -100.

        Returns the loss over the whole global batch and every token's loss, the same on
        every rank. Collective: every rank calls this with the same batch.
        """
        loss_fn = loss_fn or token_cross_entropy
        topo = self._topology(handle)
        micro = num_micro_batches or self.nb.parallel.num_micro_batches
        mine = data.rows_for(topo.data_rank, topo.data_size)
        parts, cp = mine.split(micro), _context_parallel(handle, topo)
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

        shards = [_shard(p, cp) for p in parts]  # (ids, pos, docs, labels, weights)
        with handle.extra["positions"].feeding(
            handle.model, [t[1] for t in shards], [t[2] for t in shards], cp
        ):
            pipeline.run(
                handle.model, [t[0] for t in shards], [(t[3], t[4]) for t in shards], stage_loss
            )
        tokens = self._gather_token_losses(token_losses, mine, topo, cp)
        loss = float((tokens * data.token_weights()).sum()) / labelled_weight(data)
        return ForwardResult(
            metrics={
                "loss": loss,
                "tokens": int((data.labels != -100).sum()),
                "num_micro_batches": micro,
            },
            token_losses=tokens,
        )

    @torch.no_grad()
    def logits(self, handle: ModelHandle, data: PackedBatch) -> torch.Tensor:
        """The model's logits (rows, seq_len, vocab) for the global batch `data`, on the
        CPU of every rank: each data-parallel rank computes its rows through the
        pipeline's stages (no gradient), the last stage's result is shared over the
        pipeline and gathered over the data-parallel ranks. Collective."""
        from ..pipeline.p2p import Link

        topo = self._topology(handle)
        ctx = self._context()
        mine = data.rows_for(topo.data_rank, topo.data_size)
        cp = _context_parallel(handle, topo)
        ids, pos, docs, _, _ = _shard(mine, cp)
        ranks, index = topo.ranks("pipe"), topo.pipe_rank
        with handle.extra["positions"].feeding(handle.model, [pos], [docs], cp):
            if index == 0:
                x = ids.to(ctx.device)
            else:
                x = Link(ranks[index - 1], ctx.device, "logits in").recv_act()
            y = handle.model(x)
        if index < topo.pipe_size - 1:
            out = Link(ranks[index + 1], ctx.device, "logits out")
            out.send(y, "act")
            out.finish()
        if topo.pipe_size > 1:  # the vocabulary's width, then the logits
            width = torch.tensor(
                [y.shape[-1] if index == topo.pipe_size - 1 else 0], device=ctx.device
            )
            C.broadcast(width, src=ranks[-1], group=topo.group("pipe"), label="logits width")
            if index < topo.pipe_size - 1:
                y = torch.empty(mine.rows, ids.shape[1], int(width), device=ctx.device)
        y = y.float().contiguous()
        if topo.pipe_size > 1:
            C.broadcast(y, src=ranks[-1], group=topo.group("pipe"), label="logits")
        return _gather_rows(y, topo, cp, "logits").view(data.rows, mine.seq_len, -1).cpu()

    def _gather_token_losses(self, parts: list, mine: PackedBatch, topo, cp=None) -> torch.Tensor:
        """The global batch's token losses (rows, seq_len) on the CPU, on every rank:
        from the last stage to its pipeline, then over the cp and data ranks."""
        device = self._context().device
        local_seq = mine.seq_len // (cp.size if cp is not None else 1)
        local = (
            torch.cat(parts)
            if parts
            else torch.zeros(mine.rows, local_seq, dtype=torch.float32, device=device)
        )
        if topo.pipe_size > 1:
            C.broadcast(
                local,
                src=topo.ranks("pipe")[-1],
                group=topo.group("pipe"),
                label="runtime token losses",
            )
        return _gather_rows(local, topo, cp, "runtime token losses").view(-1, mine.seq_len).cpu()

    def optimizer_step(self, handle: ModelHandle) -> tuple[bool, float, int]:
        """Unscales, clips the global gradient norm to `NBConfig.clip_grad_norm`, checks
        every rank for inf/nan and steps or skips (OptimManager's dynamic loss scale).

        Returns:
            (update_successful, grad_norm, num_zeros): grad_norm is the global norm of
            the unscaled gradients before clipping, each element of the model counted
            once (a weight tied across pipeline stages once, not once per stage);
            num_zeros is how many elements of the unscaled gradient are zero, over the
            whole model (each element once; a parameter no loss reached counts whole).

        Collective: every rank calls this.
        """
        self._topology(handle)
        zeros = handle.extra["numel"] - handle.manager.count_nonzero_grads()
        # OptimManager counts each element once: a weight tied across pipeline stages
        # on its first stage only, a stage's replicated parameters on one of its ranks.
        norm = handle.manager.clip_grad_norm(self.nb.clip_grad_norm or math.inf)
        ok = handle.manager.step()
        if ok:
            handle.steps += 1
        return ok, norm, zeros


def _context_parallel(handle: ModelHandle, topo):
    """The ContextParallel splitting sequences over the topology's cp group, or None
    (cp_size 1)."""
    if topo.cp_size == 1:
        return None
    from ..context_parallel import ContextParallel

    return ContextParallel(topo.group("cp"))


def _shard(batch: PackedBatch, cp) -> tuple:
    """(input_ids, position_ids, doc_ids, labels, token weights) of `batch`: whole rows
    (doc_ids None), or under `cp` this rank's shard of every row."""
    weights = batch.token_weights()
    if cp is None:
        return batch.input_ids, batch.position_ids, None, batch.labels, weights
    from ..context_parallel import shard_sequence

    ids, labels, pos, docs = cp.shard_batch(batch.input_ids, batch.labels, batch.position_ids)
    return ids, pos, docs, labels, shard_sequence(weights, 1, cp.group, cp.layout)


def _gather_rows(local: torch.Tensor, topo, cp, label: str) -> torch.Tensor:
    """Every data rank's rows of a (rows, seq or its shard, ...) tensor, in order: the
    sequence joined over cp first, then the rows over the data-parallel ranks (whose
    cp peers hold the same rows: one copy each). Collective over the dp group."""
    if cp is not None:
        local = cp.gather(local, 1)
    local = local.contiguous()
    if topo.dp_size == 1:
        return local
    out = torch.empty(topo.dp_size * local.numel(), dtype=local.dtype, device=local.device)
    C.all_gather(out, local.reshape(-1), group=topo.group("dp"), label=label)
    return out.view(topo.dp_size, *local.shape)[:: topo.cp_size].reshape(-1, *local.shape[1:])
