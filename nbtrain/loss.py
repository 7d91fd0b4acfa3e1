"""`nbtrain.loss` (BMTrain's `bmt.loss`): the losses live in nbtrain.nn.loss.

`import nbtrain.loss` and `from nbtrain.loss import FusedCrossEntropy` work as in
BMTrain; the classes are nbtrain.nn.loss's own.
"""

from .nn.loss import FusedCrossEntropy, parallel_cross_entropy

__all__ = ["FusedCrossEntropy", "parallel_cross_entropy"]
