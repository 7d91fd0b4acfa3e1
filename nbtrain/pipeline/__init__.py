"""Pipeline parallelism: a model's layers split into stages on the `pipe` ranks.

    nbtrain.init_distributed(pipe_size=2)
    stage = nbtrain.pipeline.stage_of(layers)         # this rank's contiguous layers
    losses = nbtrain.pipeline.run(stage, inputs, targets, loss_fn, schedule="1f1b")

Interleaved 1F1B (Megatron-LM's virtual stages): V chunks per rank, rank p holding
parts p, p + P, ... of the model cut into P * V, and M a multiple of P:

    stages = nbtrain.pipeline.stages_of(layers, virtual=2)
    losses = nbtrain.pipeline.run(stages, inputs, targets, loss_fn, schedule="interleaved")

BMTrain's `PipelineTransformerBlockList` (blocklist.py) pipelines a list of blocks
inside an ordinary data-parallel model; its `state_dict()` holds every layer, on every
rank, and `load_state_dict` takes the plain model's on every stage.

SCHEDULES names the schedules: "gpipe", "1f1b", "interleaved". See schedule.py for the
schedules, interleaved.py for the interleaved one and p2p.py for the transfers between
stages.
"""

from .blocklist import PipelineTransformerBlockList
from .interleaved import VirtualStages, stages_of
from .schedule import SCHEDULES, run
from .split import Stage, balanced_split, stage_of

__all__ = [
    "PipelineTransformerBlockList",
    "SCHEDULES",
    "Stage",
    "VirtualStages",
    "balanced_split",
    "run",
    "stage_of",
    "stages_of",
]
