"""`nbtrain.synchronize`: BMTrain's module of the same name (`bmtrain.synchronize`).

`synchronize` (a barrier over every rank), `wait_loader`, `sum_loss` and the deprecated
`gather_result`, the same objects as nbtrain's top-level names (comm/context.py,
utils.py). `nbtrain.synchronize` itself stays the function, as `bmt.synchronize` is in
BMTrain; `import nbtrain.synchronize` or `from nbtrain.synchronize import ...` reach
this module.
"""

from .comm.context import synchronize
from .utils import gather_result, sum_loss, wait_loader

__all__ = ["gather_result", "sum_loss", "synchronize", "wait_loader"]
