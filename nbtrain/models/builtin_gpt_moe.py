"""The MoE GPT (models/gpt_moe.py) as a registered model package: "gpt_moe".

    NBConfig(model_name="gpt_moe", model_config={"preset": "tiny", "num_experts": 4},
             parallel=ParallelConfig(ep_size=2))

model_config holds MoEGPTConfig fields, with "preset" picking the GPT's size. With
`ParallelConfig(ep_size=E)` each MoE layer splits its experts over the topology's ep group,
given to the model as `ExpertParallel.from_topology()` (carved from the data-parallel
ranks) and `wrap` shards them over the ranks holding the same experts. The runtime's loss is
the token loss: the layers' auxiliary balance loss is not added, so balance through the
runtime with `"balance": "bias"` (loss-free).
Tensor parallelism does not split experts: tp must be 1.
"""

from __future__ import annotations

from ..comm.topology import ALONE
from ..context_parallel import ContextParallel
from ..moe import ExpertParallel
from . import builtin_gpt as _gpt
from .builtin_gpt import (  # noqa: F401 (the registry reads these hooks from this module)
    hf_names,
    load_hf_weights,
    make_forward_step,
    pp_stages,  # the GPT's layers, MoE MLPs inside
)
from .gpt_moe import MoEGPT, MoEGPTConfig


def make_config(model_config: dict, hf_config: dict | None = None) -> MoEGPTConfig:
    """The MoEGPTConfig of `model_config` (its fields, "preset" for the GPT's size)."""
    return _gpt.make_config(model_config, hf_config, config_class=MoEGPTConfig)


def build_model(config: MoEGPTConfig, parallel=None) -> MoEGPT:
    """The MoE GPT: every expert here (parallel None or ep 1: the reference), or this
    rank's experts of the topology's ep group (ep > 1)."""
    ep = getattr(parallel, "ep_size", 1)
    model = MoEGPT(config, ep_group=ExpertParallel.from_topology() if ep > 1 else ALONE)
    if getattr(parallel, "cp_size", 1) > 1:  # the runtime has made the topology for this layout
        model.context_parallel = ContextParallel.from_topology()
    return model


def tp_plan(config: MoEGPTConfig) -> dict:
    raise ValueError(
        "model 'gpt_moe': tensor parallelism does not split experts; use "
        "ParallelConfig(tp_size=1) (ep and dp split the work instead)"
    )
