"""The notebook layer: cluster, engine boot, launchers, cell runner, magics, dashboard.

It observes and drives the ranks; it owns no training state. Importing it pulls in
ipyparallel, so `import nbtrain` does not: `nbtrain.Cluster` loads it on first use.
"""

from .cluster import Cluster
from .errors import CellTimeoutError, DistributedError, NoClusterError, RankDiedError, RankError

__all__ = [
    "Cluster",
    "DistributedError",
    "NoClusterError",
    "RankError",
    "RankDiedError",
    "CellTimeoutError",
]
