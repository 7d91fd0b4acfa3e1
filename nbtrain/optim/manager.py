"""OptimManager: loss scaling, the cross-rank overflow check, clipping and schedules.

    manager = OptimManager(loss_scale=2**15)
    manager.add_optimizer(opt, lr_scheduler)
    for batch in data:
        manager.zero_grad()
        manager.backward(loss)                 # several times to accumulate
        manager.clip_grad_norm(opt.param_groups, 1.0)
        manager.step()

Gradients stay multiplied by the loss scale until the first of `clip_grad_norm` or
`step` divides them, once. The scale is a power of two by default, so scaling and
unscaling are exact in floating point and a scaled fp32 run equals an unscaled one.
"""

from __future__ import annotations

import math
import time

import torch

from ..comm import collectives as C
from ..comm import events, recovery, step_inputs
from ..comm.context import get_context
from ..zero import is_sharded, placement_of
from .adam import clear_grad, param_grad


class OptimManager:
    """Drives one or more optimizers with (dynamic) loss scaling.

    Args:
        loss_scale: initial scale; None disables scaling (scale 1, never changes).
        loss_scale_factor: the scale is divided by this on overflow and multiplied
            by it after `loss_scale_steps` clean steps.
        loss_scale_steps: clean steps before the scale grows.
        min_loss_scale, max_loss_scale: bounds of the scale.
        grad_scale: BMTrain's divisor of the loss (its gradients are sums over the
            ranks; None: the data-parallel size, which makes them means). nbtrain's
            gradients are already means, so only another value changes anything: the
            loss is multiplied by zero_size / grad_scale, as BMTrain's would be.
        record_grad_norm: compute the global gradient norm at every `step` (in the
            overflow check's all-reduce, so no collective more) and record it with
            the step's telemetry; False skips that pass over the gradients.

    Collective: `step`, `clip_grad_norm` and `backward` (through the model's
    backward) must be called by every rank, in the same order.
    """

    def __init__(
        self,
        loss_scale: float | None = None,
        loss_scale_factor: float = 2,
        loss_scale_steps: int = 1024,
        min_loss_scale: float = 1,
        max_loss_scale: float = 2**24,
        grad_scale: float | None = None,
        record_grad_norm: bool = True,
    ):
        if loss_scale is not None and loss_scale <= 0:
            raise ValueError(f"loss_scale={loss_scale} must be > 0 (or None for no scaling)")
        if loss_scale_factor <= 1 or loss_scale_steps < 1:
            raise ValueError(
                f"loss_scale_factor={loss_scale_factor} must be > 1 and "
                f"loss_scale_steps={loss_scale_steps} >= 1"
            )
        if grad_scale is not None and grad_scale <= 0:
            raise ValueError(f"grad_scale={grad_scale} must be > 0 (or None)")
        self._grad_scale = grad_scale
        self.record_grad_norm = bool(record_grad_norm)
        self.loss_scale_enabled = loss_scale is not None
        self.loss_scale = float(loss_scale) if loss_scale is not None else 1.0
        self.loss_scale_factor = float(loss_scale_factor)
        self.loss_scale_steps = int(loss_scale_steps)
        self.min_loss_scale, self.max_loss_scale = float(min_loss_scale), float(max_loss_scale)
        self.optimizers: list = []
        self.lr_schedulers: list = []
        self.steps_since_rescale = 0
        self.num_steps = 0  # steps applied
        self.num_skipped = 0  # steps skipped for inf/nan
        self._unscaled = False
        self._found_inf: bool | None = None
        self._grad_norm: float | None = None
        self._loss_sum = 0.0
        self._step_start: float | None = None

    @property
    def steps_since_last_scale(self) -> int:
        """BMTrain's name: steps since the loss scale last changed."""
        return self.steps_since_rescale

    @property
    def grad_scale(self) -> float:
        """BMTrain's divisor of the loss (default: the data-parallel size, zero_size)."""
        if self._grad_scale is not None:
            return self._grad_scale
        from ..comm.config import config

        return config["zero_size"] if config["initialized"] else 1

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """What `backward` differentiates: `loss` times the loss scale. BMTrain's also
        divides by `grad_scale` because it sums gradients over ranks; nbtrain averages
        them, which is the same for the default grad_scale."""
        factor = self.loss_scale if self.loss_scale_enabled else 1.0
        if self._grad_scale is not None:
            factor = factor * self._grad_scale_relative()
        return loss * factor if factor != 1.0 else loss

    def _grad_scale_relative(self) -> float:
        from ..comm.config import config

        zero = config["zero_size"] if config["initialized"] else 1
        return zero / self._grad_scale

    def add_optimizer(self, optimizer, lr_scheduler=None) -> None:
        """Registers an optimizer and (optionally) the scheduler `step()` advances."""
        self.optimizers.append(optimizer)
        self.lr_schedulers.append(lr_scheduler)
        step_inputs.offer(optimizer=optimizer)  # telemetry counts its state by default

    def _params(self):
        for opt in self.optimizers:
            for group in opt.param_groups:
                yield from group["params"]

    def zero_grad(self) -> None:
        """Drops every gradient (`grad` and `main_grad`). Local."""
        for p in self._params():
            clear_grad(p)
        self._reset_step_state()
        self._step_start = time.perf_counter()

    def _reset_step_state(self) -> None:
        self._unscaled, self._found_inf, self._grad_norm = False, None, None
        self._loss_sum = 0.0

    def backward(self, loss: torch.Tensor) -> None:
        """`(loss * loss_scale).backward()`; call several times to accumulate.

        Collective (the sharded model's backward reduce-scatters gradients).
        """
        if self._unscaled:
            raise RuntimeError(
                "backward() after clip_grad_norm()/step() unscaled the "
                "gradients; call zero_grad() first"
            )
        if self._step_start is None:
            self._step_start = time.perf_counter()
        self._loss_sum = self._loss_sum + loss.detach().float()  # no host sync here
        self.scale_loss(loss).backward()

    # -- unscaling, overflow and clipping -------------------------------------------
    def _unscale(self) -> None:
        if self._unscaled:
            return
        self._unscaled = True
        if self.loss_scale == 1.0:
            return
        grads = [g for g in (param_grad(p) for p in self._params()) if g is not None]
        if grads:
            torch._foreach_mul_(grads, 1.0 / self.loss_scale)

    def _local_sums(self, params, norm_type: float) -> torch.Tensor:
        """[sharded part, replicated part] of sum |g|^p (or max for inf) on this rank.

        Each element of the model counts once: ZeRO shards on every rank, tensor-
        parallel slices on the first data-parallel replica, a pipeline stage's
        replicated parameters on the stage's first rank (a tied parameter on its first
        stage), other replicated parameters on rank 0."""
        ctx = get_context()
        # Counts (norm_type 0) in float64: exact far beyond float32's 2**24.
        out = torch.zeros(
            2, dtype=torch.float64 if norm_type == 0 else torch.float32, device=ctx.device
        )
        parts: tuple[list, list] = ([], [])  # [0]: summed over every rank, [1]: rank 0's
        for p in params:
            g = param_grad(p)
            part = None if g is None else placement_of(p).norm_part(is_sharded(p), ctx.topology)
            if part is not None:
                parts[part].append(g.detach())
        for part, grads in enumerate(parts):
            if not grads:
                continue
            if norm_type == 0:  # how many elements are not zero (padding never is)
                out[part] = sum(torch.count_nonzero(g).double() for g in grads)
                continue
            # One multi-tensor kernel per part, accumulated in float32 whatever the
            # gradients' dtype (as torch.nn.utils.clip_grad_norm_ computes it).
            norms = torch.stack(_norms(grads, norm_type))
            out[part] = norms.max() if math.isinf(norm_type) else norms.pow(norm_type).sum()
        if ctx.rank != 0:
            out[1] = 0.0  # replicated parameters: every rank holds the same gradient
        return out

    def count_nonzero_grads(self) -> int:
        """How many gradient elements of the whole model are not zero, each element
        counted once (as the norm counts them; ZeRO and vocabulary padding are zero
        and not counted). Collective: every rank calls this (one all-reduce)."""
        sums = self._local_sums(self._params(), 0)
        C.all_reduce(sums, op="sum", label="grad_nonzeros")
        return int(sums.sum())

    def clip_grad_norm(
        self, param_groups, max_norm: float | None = None, norm_type: float = 2
    ) -> float:
        """Scales gradients so their global norm is at most `max_norm`; returns the norm.

        `clip_grad_norm(param_groups, max_norm, norm_type)` is BMTrain's form;
        `clip_grad_norm(max_norm)` clips every parameter of every added optimizer.

        The norm is over every shard on every rank (each element counted once), of
        the unscaled gradients, as `torch.nn.utils.clip_grad_norm_` computes it on
        the plain model. An inf/nan norm leaves the gradients alone: `step()` skips.

        Collective: every rank calls this (one all-reduce).
        """
        if max_norm is None:
            param_groups, max_norm = (
                [g for o in self.optimizers for g in o.param_groups],
                param_groups,
            )
        self._unscale()
        norm_type = float(norm_type)
        params = [p for group in param_groups for p in group["params"]]
        sums = self._local_sums(params, norm_type)
        # A graceful stop travels along, as in the overflow check (which this replaces
        # when it covers every parameter).
        sums = torch.cat([sums, sums.new_tensor([recovery.stop_flag()])])
        op = "max" if math.isinf(norm_type) else "sum"
        C.all_reduce(sums, op=op, label="grad_norm")
        *sums, stops = sums.tolist()
        recovery.stop_agreed(stops)
        total = max(sums) if op == "max" else sum(sums) ** (1.0 / norm_type)
        self._grad_norm = total
        covers_all = {id(p) for p in params} >= {id(p) for p in self._params()}
        if covers_all:  # a finite norm over every gradient proves there is no overflow
            self._found_inf = not math.isfinite(total)
        if math.isfinite(total):
            coef = max_norm / (total + 1e-6)
            if coef < 1.0:
                grads = [g for g in (param_grad(p) for p in params) if g is not None]
                torch._foreach_mul_(grads, coef)
        return total

    def _check_overflow(self) -> bool:
        """inf/nan on any rank; with `record_grad_norm`, the step's global gradient norm
        travels in the same all-reduce (what the dashboard and telemetry show)."""
        if self._found_inf is not None:
            return self._found_inf
        ctx = get_context()
        flag = torch.zeros(1, dtype=torch.float32, device=ctx.device)
        finite = [torch.isfinite(g).all() for g in map(param_grad, self._params()) if g is not None]
        if finite:  # one device-side reduction: no host sync per parameter
            flag += (~torch.stack(finite).all()).float()
        # A graceful stop known to any rank (the stop button) travels along, so every
        # rank leaves its loop at the next step boundary.
        flag = torch.cat([flag, flag.new_tensor([recovery.stop_flag()])])
        if self.record_grad_norm:
            flag = torch.cat([flag, self._local_sums(self._params(), 2.0)])
        C.all_reduce(flag, op="sum", label="overflow")  # inf/nan on ANY rank: sum > 0
        found, stops, *sums = flag.tolist()  # one host sync for the flags and the norm
        recovery.stop_agreed(stops)
        if self.record_grad_norm and found == 0:
            self._grad_norm = sum(sums) ** 0.5
        return found > 0

    # -- the step ---------------------------------------------------------------------
    def step(self) -> bool:
        """Unscales, checks overflow on every rank, then steps or skips. Returns True
        when the step was applied.

        On overflow no rank updates anything (parameters, optimizer state, schedule)
        and the scale is divided by `loss_scale_factor`; after `loss_scale_steps`
        clean steps it is multiplied by it.

        Collective: every rank calls this (one all-reduce, or none after
        clip_grad_norm over all parameters).
        """
        self._unscale()
        skipped = self._check_overflow()
        scale_used = self.loss_scale
        if skipped:
            self.num_skipped += 1
            self.steps_since_rescale = 0
            if self.loss_scale_enabled:
                self.loss_scale = max(self.loss_scale / self.loss_scale_factor, self.min_loss_scale)
        else:
            for opt, sched in zip(self.optimizers, self.lr_schedulers):
                opt.step()
                if sched is not None:
                    sched.step()
            self.num_steps += 1
            self.steps_since_rescale += 1
            if self.loss_scale_enabled and self.steps_since_rescale >= self.loss_scale_steps:
                self.loss_scale = min(self.loss_scale * self.loss_scale_factor, self.max_loss_scale)
                self.steps_since_rescale = 0
        self._emit(skipped, scale_used)
        self._reset_step_state()  # the next backward starts a new step
        return not skipped

    def _emit(self, skipped: bool, scale_used: float) -> None:
        lr = self.optimizers[0].param_groups[0]["lr"] if self.optimizers else None
        now = time.perf_counter()
        step_time = now - self._step_start if self._step_start is not None else None
        loss = float(self._loss_sum)
        events.metric(
            loss=loss,
            lr=lr,
            loss_scale=scale_used,
            grad_norm=self._grad_norm,
            skipped=bool(skipped),
            step_time_s=step_time,
        )
        events.end_step()
        self._step_start = None

    # -- state ------------------------------------------------------------------------
    def scalar_state(self) -> dict:
        """Loss-scale and schedule state (no tensors): the same on every rank."""
        return {
            "loss_scale": self.loss_scale,
            "steps_since_rescale": self.steps_since_rescale,
            "num_steps": self.num_steps,
            "num_skipped": self.num_skipped,
            "lr_schedulers": [None if s is None else s.state_dict() for s in self.lr_schedulers],
        }

    def load_scalar_state(self, state: dict) -> None:
        self.loss_scale = float(state["loss_scale"])
        # BMTrain's manager saves neither counter, but whether the scale is dynamic.
        self.steps_since_rescale = int(state.get("steps_since_rescale", 0))
        if "loss_scale_enabled" in state:
            self.loss_scale_enabled = bool(state["loss_scale_enabled"])
        self.num_steps = int(state.get("num_steps", 0))
        self.num_skipped = int(state.get("num_skipped", 0))
        saved = state.get("lr_schedulers", [])
        if len(saved) != len(self.lr_schedulers):
            raise ValueError(
                f"state has {len(saved)} lr schedulers, this manager {len(self.lr_schedulers)}"
            )
        for sched, sd in zip(self.lr_schedulers, saved):
            if (sched is None) != (sd is None):
                raise ValueError(
                    "lr scheduler present in the state but not in the manager (or the reverse)"
                )
            if sched is not None:
                sched.load_state_dict(sd)

    def state_dict(self, gather_opt: bool = False) -> dict:
        """This rank's state: scale, schedules and each optimizer's local state dict.

        BMTrain's default (`gather_opt=False`): each rank saves its own, and it restores
        on the same world size; `nbtrain.save_checkpoint` reshards. Local.

        Raises:
            NotImplementedError: `gather_opt=True` (BMTrain gathers AdamOffload's state
                whole on every rank); nbtrain saves it sharded instead.
        """
        if gather_opt:
            raise NotImplementedError(
                "OptimManager.state_dict(gather_opt=True): nbtrain does not gather the "
                "optimizer state whole; save it sharded with nbtrain.save_checkpoint(model, "
                "folder, manager), which loads at any world size, or keep gather_opt=False "
                "(each rank's own state, as BMTrain's default)"
            )
        return {
            **self.scalar_state(),
            "loss_scale_enabled": self.loss_scale_enabled,
            "optimizers": [opt.state_dict() for opt in self.optimizers],
        }

    def load_state_dict(self, state: dict) -> None:
        """Restores `state_dict()` output (same world size). Local."""
        saved = state.get("optimizers", [])
        if len(saved) != len(self.optimizers):
            raise ValueError(
                f"state has {len(saved)} optimizers, this manager {len(self.optimizers)}"
            )
        for opt, sd in zip(self.optimizers, saved):
            opt.load_state_dict(sd)
        self.load_scalar_state(state)


def _norms(grads: list, norm_type: float) -> list:
    """Each gradient's norm in float32, float64 ones computed in float64 (torch refuses
    to narrow them in the norm) and then rounded."""
    wide = [g for g in grads if g.dtype == torch.float64]
    rest = [g for g in grads if g.dtype != torch.float64]
    out = list(torch._foreach_norm(rest, norm_type, dtype=torch.float32)) if rest else []
    return out + [n.float() for n in torch._foreach_norm(wide, norm_type)] if wide else out
