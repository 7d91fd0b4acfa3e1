"""AdamOptimizer: Adam on the local shards, with fp32 master weights for half params.

Each parameter the optimizer sees is this rank's shard (a Block's flat shard or a
DistributedParameter's slice), so the update is purely local: no collective here.

State per parameter (all tensors the shape of the parameter, so a checkpoint can
reshard them element by element):
    step        int, steps taken by this parameter (bias correction counts from 1).
    segment_step  only for a flat shard one of whose parameters was ever frozen:
                int32 counts (host), each element its own parameter's (segment_steps.py).
    exp_avg     fp32 first moment.
    exp_avg_sq  fp32 second moment.
    master      fp32 copy of the parameter, present when the parameter is bf16/fp16
                (or lives on another device than the state, see AdamOffloadOptimizer).

Gradients: `param.main_grad` (fp32, from a Block with reduce_dtype=torch.float32)
when present, else `param.grad`. The whole update goes through `adam_update`: the
fused Triton kernel on CUDA, torch `_foreach` ops elsewhere.

Weight decay follows BMTrain per parameter dtype: an fp32 parameter takes it as L2
(BMTrain steps it with torch's functional Adam: grad + wd * p feeds the moments, as
`torch.optim.Adam(weight_decay=...)`), an fp16/bf16 parameter decoupled (BMTrain's
fused kernels: p -= lr * wd * p beside the Adam step, as `torch.optim.AdamW`).
`decoupled_weight_decay=True` makes every parameter AdamW (False: every one L2).
"""

from __future__ import annotations

import math

import torch

from .segment_steps import SEGMENT_STEP, step_pieces

_HALF = (torch.float16, torch.bfloat16)
_MOMENTS = ("exp_avg", "exp_avg_sq", "master")
# BMTrain's host staging buffers, which some of its state dicts carry: not state.
_BMTRAIN_BUFFERS = ("_grad_fp32", "_param_fp16", "_grad_fp16")


def param_grad(param: torch.Tensor) -> torch.Tensor | None:
    """The gradient nbtrain's optimizers read: `main_grad` (fp32) first, then `grad`."""
    main = getattr(param, "main_grad", None)
    return main if main is not None else param.grad


def clear_grad(param: torch.Tensor) -> None:
    param.grad = None
    if getattr(param, "main_grad", None) is not None:
        param.main_grad = None


def adam_update(
    params,
    grads,
    exp_avgs,
    exp_avg_sqs,
    model_copies,
    steps,
    *,
    lr,
    beta1,
    beta2,
    eps,
    weight_decay,
    decoupled: bool = True,
) -> None:
    """One Adam step over lists of flat fp32 tensors, in place.

    Args:
        params: fp32 master weights (contiguous).
        grads: gradients (fp32/bf16/fp16) on the same device as params.
        exp_avgs, exp_avg_sqs: fp32 moments.
        model_copies: per entry None or a bf16/fp16 tensor to receive the new weights.
        steps: per entry the step number (>= 1) for bias correction.
        decoupled: weight decay as AdamW's (p -= lr * wd * p, torch.optim.AdamW) or,
            when False, as L2 (grad + wd * p, torch.optim.Adam).

    Local: no communication.
    """
    if not params:
        return
    if params[0].is_cuda:
        from .. import kernels  # imports triton: only on the GPU path

        for p, g, m, v, c, s in zip(params, grads, exp_avgs, exp_avg_sqs, model_copies, steps):
            kernels.adam_step_(
                p.view(-1),
                g.reshape(-1),
                m.view(-1),
                v.view(-1),
                lr=lr,
                beta1=beta1,
                beta2=beta2,
                eps=eps,
                weight_decay=weight_decay,
                step=s,
                model_copy=None if c is None else c.view(-1),
                decoupled=decoupled,
            )
        return
    by_step: dict[int, list[int]] = {}
    for i, s in enumerate(steps):
        by_step.setdefault(s, []).append(i)
    for step, idx in by_step.items():
        _foreach_adam(
            [params[i] for i in idx],
            [grads[i].float() for i in idx],
            [exp_avgs[i] for i in idx],
            [exp_avg_sqs[i] for i in idx],
            step,
            lr=lr,
            beta1=beta1,
            beta2=beta2,
            eps=eps,
            weight_decay=weight_decay,
            decoupled=decoupled,
        )
        for i in idx:
            if model_copies[i] is not None:
                model_copies[i].copy_(params[i])


@torch.no_grad()
def _foreach_adam(
    params, grads, exp_avgs, exp_avg_sqs, step, *, lr, beta1, beta2, eps, weight_decay, decoupled
) -> None:
    # The same operations, in the same order, as the single-tensor path of
    # torch.optim.AdamW (decoupled) or torch.optim.Adam (L2), so a run matches it to
    # rounding (and is bitwise reproducible).
    bias_correction1 = 1.0 - beta1**step
    bias_correction2_sqrt = math.sqrt(1.0 - beta2**step)
    step_size = lr / bias_correction1
    if weight_decay != 0.0 and decoupled:
        torch._foreach_mul_(params, 1.0 - lr * weight_decay)
    elif weight_decay != 0.0:  # new tensors: the parameters' own gradients stay
        grads = torch._foreach_add(grads, params, alpha=weight_decay)
    torch._foreach_lerp_(exp_avgs, grads, 1.0 - beta1)
    torch._foreach_mul_(exp_avg_sqs, beta2)
    torch._foreach_addcmul_(exp_avg_sqs, grads, grads, value=1.0 - beta2)
    denom = torch._foreach_sqrt(exp_avg_sqs)
    torch._foreach_div_(denom, bias_correction2_sqrt)
    torch._foreach_add_(denom, eps)
    torch._foreach_addcdiv_(params, exp_avgs, denom, value=-step_size)


class AdamOptimizer(torch.optim.Optimizer):
    """Adam over this rank's shards, with BMTrain's weight decay per dtype.

    Args:
        params: iterable of parameters or param-group dicts (usually
            `model.parameters()` of a sharded model).
        lr: learning rate (a scheduler may overwrite it each step).
        betas: (beta1, beta2).
        eps: added to the denominator.
        weight_decay: as BMTrain applies it: L2 for fp32 parameters (grad + wd * p,
            `torch.optim.Adam`), decoupled for fp16/bf16 ones (p -= lr * wd * p,
            `torch.optim.AdamW`).
        hold_steps: BMTrain's: for a parameter's first `hold_steps` steps the moments
            are updated but the weights are not (lr 0), warming the moments up.
        decoupled_weight_decay: nbtrain's: None (default) follows BMTrain's rule above;
            True decouples the decay for every dtype (AdamW, equal to
            `torch.optim.AdamW` for fp32 parameters); False makes it L2 for every
            dtype. A param group may set its own.

    `step()` is local to this rank. Use it through `OptimManager` for loss
    scaling, the cross-rank overflow check and clipping.
    """

    def __init__(
        self,
        params,
        lr: float = 1e-3,
        betas=(0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        hold_steps: int = 0,
        *,
        decoupled_weight_decay: bool | None = None,
    ):
        self._hold_steps = int(hold_steps)
        if lr < 0 or eps < 0 or weight_decay < 0:
            raise ValueError(f"lr={lr}, eps={eps}, weight_decay={weight_decay} must be >= 0")
        if not all(0.0 <= b < 1.0 for b in betas):
            raise ValueError(f"betas={betas}: each must be in [0, 1)")
        if decoupled_weight_decay not in (None, True, False):
            raise ValueError(
                f"decoupled_weight_decay={decoupled_weight_decay!r}: use None (BMTrain's "
                "rule: L2 for fp32 parameters, decoupled for fp16/bf16), True (AdamW for "
                "every dtype) or False (L2 for every dtype)"
            )
        defaults = dict(
            lr=lr,
            betas=tuple(betas),
            eps=eps,
            weight_decay=weight_decay,
            decoupled_weight_decay=decoupled_weight_decay,
        )
        super().__init__(params, defaults)

    def _state_device(self, param: torch.Tensor) -> torch.device:
        """Where this parameter's optimizer state lives (overridden by offload)."""
        return param.device

    def _init_state(self, param: torch.Tensor) -> dict:
        device = self._state_device(param)
        state = self.state[param]
        state["step"] = 0
        state["exp_avg"] = torch.zeros(param.shape, dtype=torch.float32, device=device)
        state["exp_avg_sq"] = torch.zeros(param.shape, dtype=torch.float32, device=device)
        if param.dtype != torch.float32 or device != param.device:
            state["master"] = self._new_master(param, device)
        return state

    def _new_master(self, param: torch.Tensor, device: torch.device) -> torch.Tensor:
        return param.detach().to(device=device, dtype=torch.float32, copy=True)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Drops `grad` and `main_grad` of every parameter. Local."""
        for group in self.param_groups:
            for p in group["params"]:
                clear_grad(p)

    def load_state_dict(self, state_dict: dict) -> None:
        """Restores `state_dict()` output; state keeps its saved dtype (fp32).

        torch's default would cast the fp32 master and moments to a bf16 parameter's
        dtype. Local.
        """
        saved_groups = state_dict["param_groups"]
        if len(saved_groups) != len(self.param_groups) or any(
            len(a["params"]) != len(b["params"]) for a, b in zip(saved_groups, self.param_groups)
        ):
            raise ValueError(
                "load_state_dict: the saved param groups do not match this "
                "optimizer's (different number of groups or parameters)"
            )
        self.state.clear()
        for saved, group in zip(saved_groups, self.param_groups):
            group.update({k: v for k, v in saved.items() if k != "params"})
            for index, p in zip(saved["params"], group["params"]):
                entry = state_dict["state"].get(index)
                if entry is not None:
                    self.state[p] = self._restore_state(p, entry)

    def _restore_state(self, param: torch.Tensor, entry: dict) -> dict:
        device = self._state_device(param)
        entry = dict(entry)
        # BMTrain's state: its fp32 master is `_param_fp32` (kept for fp32 parameters
        # too by its offload optimizer, where nbtrain's parameter is its own master).
        bmtrain_master = entry.pop("_param_fp32", None)
        for key in _BMTRAIN_BUFFERS:
            entry.pop(key, None)
        state = {
            k: v.to(device, dtype=torch.float32 if k in _MOMENTS else v.dtype, copy=True)
            if torch.is_tensor(v)
            else v
            for k, v in entry.items()
        }
        if SEGMENT_STEP in state:  # per-parameter counts live on the host, as int32
            state[SEGMENT_STEP] = state[SEGMENT_STEP].to("cpu", torch.int32).reshape(param.shape)
        needs_master = param.dtype != torch.float32 or device != param.device
        if needs_master and "master" not in state:
            master = bmtrain_master if bmtrain_master is not None else param.detach()
            state["master"] = master.to(device=device, dtype=torch.float32, copy=True)
            state["master"] = state["master"].reshape(param.shape)
        return state

    @torch.no_grad()
    def step(self, closure=None, scale: float = 1.0):
        """One Adam step on every parameter that has a gradient. Local.

        Args:
            closure: as for any torch optimizer.
            scale: BMTrain's: the loss scale the gradients still carry (they are
                divided by it). OptimManager unscales them first and passes nothing.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if scale <= 0:
            raise ValueError(f"step(scale={scale}): the loss scale must be > 0")
        for group in self.param_groups:
            self._step_group(group, float(scale))
        return loss

    @staticmethod
    def decouples(group: dict, param: torch.Tensor) -> bool:
        """Whether `param`'s weight decay is decoupled (AdamW) rather than L2. Local."""
        choice = group.get("decoupled_weight_decay")
        return param.dtype in _HALF if choice is None else bool(choice)

    def _step_group(self, group: dict, scale: float = 1.0) -> None:
        # One update per (held, decoupled) kind: lists of the adam_update arguments.
        kinds: dict[tuple[bool, bool], tuple] = {}
        write_back = []
        for p in group["params"]:
            grad = param_grad(p)
            if grad is None:
                continue
            if grad.is_sparse:
                raise RuntimeError("AdamOptimizer does not support sparse gradients")
            state = self.state[p] if self.state.get(p) else self._init_state(p)
            # A flat shard one of whose parameters was frozen: a count per parameter.
            pieces = step_pieces(p, state)
            state["step"] += 1
            master = state.get("master")
            target = p if master is None else master
            grad = grad.to(target.device)  # blocking: the host update reads it at once
            if scale != 1.0:
                grad = grad.float() / scale
            # The fused path writes the half copy itself when it lives on the same device.
            copy = (
                p if master is not None and master.device == p.device and p.dtype in _HALF else None
            )
            if master is not None and copy is None:
                write_back.append((p, master))
            tensors = (target, grad, state["exp_avg"], state["exp_avg_sq"], copy)
            for lo, hi, before in pieces:
                key = (before < self._hold_steps, self.decouples(group, p))
                lists = kinds.setdefault(key, ([], [], [], [], [], []))
                for out, value in zip(lists, tensors):
                    out.append(value if value is None or lo is None else value.view(-1)[lo:hi])
                lists[5].append(before + 1)
        beta1, beta2 = group["betas"]
        for (holding, decoupled), lists in kinds.items():
            # held: the moments move, the weights do not (BMTrain's hold_steps)
            adam_update(
                *lists,
                lr=0.0 if holding else group["lr"],
                beta1=beta1,
                beta2=beta2,
                eps=group["eps"],
                weight_decay=group["weight_decay"],
                decoupled=decoupled,
            )
        for p, master in write_back:
            p.copy_(master, non_blocking=True)
