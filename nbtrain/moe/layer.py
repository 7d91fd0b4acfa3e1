"""A mixture-of-experts layer with expert parallelism (GShard / Switch routing).

Every rank routes its own tokens; the experts are split evenly over an
expert-parallel (ep) group, rank r holding experts [r*E/P, (r+1)*E/P). A forward
makes these exchanges over the group, all through `nbtrain.comm.collectives`, so the
byte counters see them:

    counts    one all_to_all of chunks x E int64 counts (how many rows each rank will
              receive of each chunk)
    dispatch  per chunk, an all_to_all of the routed token rows, uneven sizes
    combine   per chunk, the reverse all_to_all of the expert outputs

plus one all_reduce of E + 1 int64 (global load and drops, for `stats` and the
bias of balance="bias"), in flight while the experts compute. The routed rows go in
`chunks` chunks by token position (`exchange_experts`): every chunk's dispatch is posted
at once, a chunk's experts run when its rows are in, and its combine travels while the
next chunk's experts compute. Backward runs the row exchanges in reverse, pipelined the
same way. With one rank in the group nothing is exchanged.

Parameters and their gradients:
    router.weight  replicated on every rank; each rank's gradient comes from its
                   own tokens only, so the caller's data parallelism must reduce it
                   over all ranks that run this layer, like any replicated weight.
    w_in, w_out    this rank's experts only: slices along dim 0 of the full (E, ...)
                   tensors over the ep group (placed as kind "expert", split
                   dimension 0: nbtrain.zero.placement_of), so state dicts hold
                   all E experts (gathered over ep) and `nbtrain.wrap` shards
                   them over the ranks holding the same experts
                   (the "edp" group), where their gradients are reduced: they already
                   hold every ep rank's tokens, so wrap divides them by ep_size first.

The layout is the caller's: `group=ExpertParallel.from_topology()` splits the experts
over the ep group of `init_distributed(ep_size=...)`; without a group every expert is
local, whatever the topology (the same computation as ep 1).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from ..comm import collectives, events
from ..tensor_parallel.layers import FullStateDict
from ..zero import place
from .dispatch import Chunk, _ep_group, _is_topology_ep, exchange_experts
from .experts import experts_ffn
from .routing import BALANCE_MODES, capacity_keep, route


class MoE(nn.Module, FullStateDict):
    """Mixture of experts over an expert-parallel group.

    Each token goes to the top_k experts of softmax(router(x)); its output is the
    sum of those experts' outputs weighted by their scores renormalised to sum 1.
    An expert is Linear(hidden, ffn_hidden) -> exact (erf) GELU -> Linear(ffn_hidden,
    hidden), no biases; this rank holds experts [first_expert, first_expert +
    local_experts) as `w_in` (local, hidden, ffn_hidden) and `w_out` (local,
    ffn_hidden, hidden), drawn world-size independently (`reset_experts`).

    Args:
        hidden: model width.
        ffn_hidden: each expert's inner width.
        num_experts: E, a multiple of the ep group size P.
        top_k: experts per token (1 <= top_k <= E).
        group: the ep layout: an `ExpertParallel` (`ExpertParallel.from_topology()`
            for nbtrain's ep group) or a process group; None (the default, whatever
            the topology) or `topology.ALONE`: every expert on this rank.
        capacity_factor: None = dropless. Else each expert keeps at most
            ceil(capacity_factor * T * top_k / E) assignments from each source rank,
            T = that rank's tokens, first come first kept in token order;
            dropped assignments contribute zero (a token whose every choice is
            dropped outputs zero).
        balance: "aux" (Switch/GShard auxiliary loss in `self.aux_loss`), "bias"
            (DeepSeek-V3's loss-free per-expert bias) or "none".
        aux_loss_weight: the auxiliary loss coefficient.
        bias_update_rate: the bias step per training step. The load of every
            training forward of a step (micro-batches) is added up, and the bias moves
            by bias_update_rate * sign(mean load - load) when the step ends
            (OptimManager.step, or `nbtrain.comm.events.end_step()`, or
            `apply_bias_update()` in a loop without them), so every forward of a step,
            and a forward recomputed in backward, routes with the same bias.
        label: the name of this layer's telemetry metrics.
        chunks: how many pipelined chunks a forward's routed rows go to the experts in
            (by token position): 2 or more overlap one chunk's exchange with another's
            experts, at the cost of one more exchange each way per chunk. The default 1
            is measured best over gloo on CPU, where the exchange is latency-bound and
            the same cores compute and copy (nbtrain/bench/NOTES.md). The output is the
            same for any value.

    After each forward:
        aux_loss: scalar tensor in the graph (zero unless balance="aux"), for the
            caller to add to its loss: aux_loss_weight * E * sum_e f_e * P_e over
            this rank's tokens, f_e = share of the T*top_k assignments routed to e
            (before drops), P_e = mean router probability of e.
        stats: {"tokens_per_expert": assignments routed to each expert before
            drops, summed over the ep group; "dropped": assignments dropped, over
            the ep group; "balance": max load / mean load}. A training forward
            also records them as telemetry metrics "<label>.balance" and
            "<label>.dropped" (share of assignments dropped), which the dashboard's
            routing panel draws.
    """

    def __init__(
        self,
        hidden: int,
        ffn_hidden: int,
        num_experts: int,
        top_k: int = 2,
        group=None,
        capacity_factor: float | None = None,
        balance: str = "aux",
        aux_loss_weight: float = 0.01,
        bias_update_rate: float = 1e-3,
        label: str = "moe",
        chunks: int = 1,
    ):
        super().__init__()
        self.group, self.ep_size, self.ep_rank = _ep_group(group)
        if num_experts % self.ep_size:
            raise ValueError(
                f"num_experts={num_experts} is not a multiple of the ep group "
                f"size {self.ep_size}: use a multiple of {self.ep_size} or a "
                f"smaller ep group"
            )
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"top_k={top_k}: choose 1 <= top_k <= num_experts={num_experts}")
        if not isinstance(chunks, int) or chunks < 1:
            raise ValueError(f"chunks={chunks!r}: give a whole number >= 1 (1: no pipelining)")
        if balance not in BALANCE_MODES:
            raise ValueError(f"balance={balance!r}: use one of {BALANCE_MODES}")
        if capacity_factor is not None and capacity_factor <= 0:
            raise ValueError(
                f"capacity_factor={capacity_factor}: give a positive number, "
                f"or None for dropless routing"
            )
        self.hidden, self.ffn_hidden, self.num_experts, self.top_k = (
            hidden,
            ffn_hidden,
            num_experts,
            top_k,
        )
        self.local_experts = num_experts // self.ep_size
        self.first_expert = self.ep_rank * self.local_experts
        self.capacity_factor, self.balance = capacity_factor, balance
        self.aux_loss_weight, self.bias_update_rate = aux_loss_weight, bias_update_rate
        self.label, self.chunks = label, chunks
        # Whose tokens the expert load sums (stats, the routing bias): the ep group, or
        # the data-parallel group once `wrap` says the layer is replicated over it.
        self.stats_group = self.group
        self._load_sum: torch.Tensor | None = None  # this step's routed load (bias mode)
        events.on_step_end(self.apply_bias_update)
        self.router = nn.Linear(hidden, num_experts, bias=False)
        self.w_in = nn.Parameter(torch.empty(self.local_experts, hidden, ffn_hidden))
        self.w_out = nn.Parameter(torch.empty(self.local_experts, ffn_hidden, hidden))
        for p, full in (
            (self.w_in, (num_experts, hidden, ffn_hidden)),
            (self.w_out, (num_experts, ffn_hidden, hidden)),
        ):
            if self.ep_size > 1 and _is_topology_ep(self.group):
                place(p, kind="expert", split_dim=0, full_shape=full)
        self._setup_full_state_dict()
        self.register_buffer("expert_bias", torch.zeros(num_experts))
        self.aux_loss = torch.zeros(())
        self.stats: dict = {}
        self.reset_experts()

    @torch.no_grad()
    def reset_experts(self) -> None:
        """Draws every expert in turn (U(+-1/sqrt(fan_in)), nn.Linear's scale) and
        keeps this rank's: the same seed gives the same model at any ep size. Local."""
        for e in range(self.num_experts):
            w_in = torch.empty(self.hidden, self.ffn_hidden).uniform_(-1, 1) / math.sqrt(
                self.hidden
            )
            w_out = torch.empty(self.ffn_hidden, self.hidden).uniform_(-1, 1) / math.sqrt(
                self.ffn_hidden
            )
            local = e - self.first_expert
            if 0 <= local < self.local_experts:
                self.w_in[local].copy_(w_in)
                self.w_out[local].copy_(w_out)

    def join_data_parallel(self, group) -> None:
        """`wrap` calls this with the data-parallel group (ep ranks included): the
        expert load is summed over the whole batch there, so every replica's stats and
        routing bias stay equal (summed over the ep group alone, replicas fed other rows
        would drift apart)."""
        self.stats_group = group

    def capacity(self, tokens: int) -> int:
        """Assignments each expert keeps from a rank with `tokens` tokens."""
        return math.ceil(self.capacity_factor * tokens * self.top_k / self.num_experts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(batch, seq, hidden) -> (batch, seq, hidden). Ranks may hold different
        batch and seq sizes. Collective: every rank of the ep group calls this."""
        shape = x.shape
        tokens = x.reshape(-1, self.hidden)
        scores = torch.softmax(self.router(tokens).float(), dim=-1)  # (T, E)
        use_bias = self.balance == "bias"
        chosen, weights = route(scores, self.top_k, self.expert_bias if use_bias else None)
        routed = torch.bincount(chosen.reshape(-1), minlength=self.num_experts)
        keep = torch.ones_like(chosen, dtype=torch.bool)
        if self.capacity_factor is not None:
            keep = capacity_keep(chosen, self.num_experts, self.capacity(tokens.shape[0]))
        # the expert load over the stats group travels while the experts compute
        totals = torch.cat([routed, routed.new_tensor([int((~keep).sum())])])
        summed = collectives.all_reduce(
            totals, group=self.stats_group, label="moe stats", async_op=True
        )
        out = self._dispatch_compute_combine(tokens, chosen, weights.to(x.dtype), keep)
        summed.wait()
        self._after_routing(scores, routed, totals)
        return out.reshape(shape)

    def _dispatch_compute_combine(self, tokens, chosen, weights, keep):
        """Sends each kept assignment's token row to its expert's rank, runs the
        experts, brings the results back and sums them weighted: (T, hidden). The
        assignments go in `self.chunks` chunks by token position, pipelined
        (`exchange_experts`):
        one chunk's rows travel while another's experts compute."""
        count = tokens.shape[0]
        token_of = torch.arange(count, device=tokens.device).unsqueeze(1).expand_as(chosen)[keep]
        expert_of, weight_of = chosen[keep], weights[keep]
        if self.ep_size == 1:  # every expert here: no exchange
            order = torch.argsort(expert_of, stable=True)
            token_of, expert_of, weight_of = token_of[order], expert_of[order], weight_of[order]
            per_expert = torch.bincount(expert_of, minlength=self.num_experts).tolist()
            outs = experts_ffn(tokens[token_of], self.w_in, self.w_out, per_expert)
            return torch.zeros_like(tokens).index_add(0, token_of, outs * weight_of.unsqueeze(1))
        # (chunk, expert) order: a chunk's rows grouped by expert, so by owner rank
        chunks = self.chunks
        key = (token_of * chunks // max(count, 1)) * self.num_experts + expert_of
        order = torch.argsort(key, stable=True)
        token_of, weight_of, key = token_of[order], weight_of[order], key[order]
        send = torch.bincount(key, minlength=chunks * self.num_experts)
        send = send.view(chunks, self.ep_size, self.local_experts)  # [chunk, owner, local e]
        recv = send.new_empty((self.ep_size, chunks, self.local_experts))  # [source, chunk, e]
        collectives.all_to_all_single(  # every chunk's counts, once per layer
            recv,
            send.permute(1, 0, 2).contiguous(),
            None,
            None,
            group=self.group,
            label="moe counts",
        )
        plan = [
            Chunk(send[c].sum(1).tolist(), recv[:, c].sum(1).tolist(), recv[:, c])
            for c in range(chunks)
        ]
        returned = exchange_experts(tokens[token_of], self.w_in, self.w_out, plan, self.group)
        return torch.zeros_like(tokens).index_add(0, token_of, returned * weight_of.unsqueeze(1))

    def _after_routing(self, scores, routed, totals):
        # A forward recomputed in backward (activation checkpointing) routes the same
        # tokens again: it must not step the bias or record the metrics a second time.
        recomputed = torch._C._current_graph_task_id() != -1
        load = totals[:-1]  # summed over the stats group
        mean = load.float().mean()
        self.stats = {
            "tokens_per_expert": load.tolist(),
            "dropped": int(totals[-1]),
            "balance": float(load.max() / mean) if mean > 0 else float("nan"),
        }
        if self.training and not recomputed:
            routed_total = max(int(load.sum()), 1)
            events.metric(
                **{
                    f"{self.label}.balance": self.stats["balance"],
                    f"{self.label}.dropped": self.stats["dropped"] / routed_total,
                }
            )
        if self.balance == "aux":
            share = routed.float() / max(int(routed.sum()), 1)  # f_e
            self.aux_loss = self.aux_loss_weight * self.num_experts * (share * scores.mean(0)).sum()
        else:
            self.aux_loss = scores.new_zeros(())
        if self.balance == "bias" and self.training and not recomputed:
            load = load.float()  # the same global load on every rank: the same bias
            self._load_sum = load if self._load_sum is None else self._load_sum + load

    @torch.no_grad()
    def apply_bias_update(self) -> None:
        """Moves the loss-free bias by the load routed since the last update (balance
        "bias"): bias_update_rate * sign(mean load - load). Runs at every step's end;
        a no-op without routed load. Local."""
        load, self._load_sum = self._load_sum, None
        if load is not None:
            self.expert_bias += self.bias_update_rate * torch.sign(load.mean() - load)

    def extra_repr(self) -> str:
        return (
            f"hidden={self.hidden}, ffn_hidden={self.ffn_hidden}, experts={self.num_experts} "
            f"({self.local_experts} here, from {self.first_expert}), top_k={self.top_k}, "
            f"ep={self.ep_size}, capacity_factor={self.capacity_factor}, "
            f"balance={self.balance!r}" + (f", chunks={self.chunks}" if self.chunks > 1 else "")
        )
