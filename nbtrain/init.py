"""`nbtrain.init`: BMTrain's module of the same name (`bmtrain.init`).

`init_distributed` (nbtrain's, which takes BMTrain's keywords), `is_initialized`, and
`topology`: the type of `config["topology"]` (nbtrain.comm.topology.Topology, with
BMTrain's attributes: stage_id, pipe_idx, tp_id, pp_zero_id, ...). BMTrain builds its
topology from the config dict; nbtrain's is made by init_distributed and read from
`nbtrain.config["topology"]`.
"""

from . import init_distributed
from .comm.context import is_initialized
from .comm.topology import Topology as topology  # BMTrain's name

__all__ = ["init_distributed", "is_initialized", "topology"]
