"""Pipeline parallelism: a model's layers split into stages on the `pipe` ranks.

    nbtrain.init_distributed(pipe_size=2)
    stage = nbtrain.pipeline.stage_of(layers)         # this rank's contiguous layers
    losses = nbtrain.pipeline.run(stage, inputs, targets, loss_fn, schedule="1f1b")

See schedule.py for the schedules and p2p.py for the transfers between stages.
"""
from .blocklist import PipelineTransformerBlockList
from .schedule import SCHEDULES, run
from .split import Stage, balanced_split, stage_of

__all__ = ["PipelineTransformerBlockList", "SCHEDULES", "Stage", "balanced_split", "run", "stage_of"]
