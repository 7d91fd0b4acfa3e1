"""Mixture of experts with expert parallelism: the experts split over an ep group
the caller gives (`MoE(..., group=ExpertParallel.from_topology())`).

Read in this order:
    routing.py   top-k routing and the capacity rule (one rank's tokens, no communication)
    experts.py   one expert's computation, and the layer as a plain one-process loop
                 (`moe_reference`)
    dispatch.py  token rows to the experts' ranks and back (an uneven all_to_all through
                 nbtrain.comm.collectives); `ExpertParallel`, the layout a caller gives
                 a layer (`group=`): which ranks split its experts
    layer.py     `MoE`: route, dispatch, compute, combine; balance by an auxiliary loss
                 or a loss-free bias; routing statistics for telemetry
"""

from .dispatch import ExpertParallel, all_to_all_rows
from .experts import expert_ffn, experts_ffn, moe_reference, uses_grouped_mm
from .layer import MoE
from .routing import BALANCE_MODES, capacity_keep, route

__all__ = [
    "BALANCE_MODES",
    "ExpertParallel",
    "MoE",
    "all_to_all_rows",
    "capacity_keep",
    "expert_ffn",
    "experts_ffn",
    "uses_grouped_mm",
    "moe_reference",
    "route",
]
