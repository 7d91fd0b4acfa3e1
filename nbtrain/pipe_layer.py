"""`nbtrain.pipe_layer`: BMTrain's module of the same name: `PipelineTransformerBlockList`
(nbtrain.pipeline). BMTrain's autograd functions between stages (PipePreFunction,
StagePreFunction, ...) are internal to its list, as nbtrain's are to its own."""

from .pipeline import PipelineTransformerBlockList

__all__ = ["PipelineTransformerBlockList"]
