"""BMTrain's names for where a rank sits (its `config["topology"]`, bmtrain/init.py).

BMTrain lays ranks out as nbtrain does (stage outermost, tensor slot innermost), so
each of its attributes is a number nbtrain's Topology already knows. Its "idx" names
say which group of a kind a rank is in, its "id" names the rank's place inside that
group. BMTrain's kinds differ from nbtrain's groups in two places: its "zero" group is
the whole world (nbtrain's zero group is one stage: BMTrain's "pp_zero"), and its
"tp_zero" group is one tp slot over every stage (nbtrain's dp group is one stage's:
BMTrain's "pp_tp_zero").
"""

from __future__ import annotations


class BMTrainTopologyNames:
    """Mixed into nbtrain.comm.topology.Topology: reads rank, pipe_size, tp_size and
    the coordinates it defines. Every attribute is local."""

    @property
    def stages(self) -> int:
        """The number of pipeline stages (BMTrain's `stages`)."""
        return self.pipe_size

    @property
    def stage_id(self) -> int:
        """This rank's pipeline stage (BMTrain's `stage_id`; nbtrain's pipe_rank)."""
        return self.pipe_rank

    @property
    def pipe_idx(self) -> int:
        """Which pipeline this rank is in: its rank within its stage (BMTrain's
        `pipe_idx`, the same for every stage of one pipeline)."""
        return self.zero_rank

    @property
    def tp_id(self) -> int:
        """This rank's tensor-parallel slot (nbtrain's tp_rank)."""
        return self.tp_rank

    @property
    def tp_idx(self) -> int:
        """Which tensor-parallel group this rank is in (rank // tp_size)."""
        return self.rank // self.tp_size

    @property
    def pp_zero_idx(self) -> int:
        """Which stage's ZeRO group (the ranks of one stage) this rank is in."""
        return self.pipe_rank

    @property
    def pp_zero_id(self) -> int:
        """This rank's place among its stage's ranks (nbtrain's zero_rank)."""
        return self.zero_rank

    @property
    def tp_zero_idx(self) -> int:
        """BMTrain's tp_zero group: the ranks of one tp slot over the world."""
        return self.tp_rank

    @property
    def tp_zero_id(self) -> int:
        """This rank's place in BMTrain's tp_zero group (rank // tp_size)."""
        return self.rank // self.tp_size

    @property
    def pp_tp_zero_idx(self) -> int:
        """Which (stage, tp slot) data-parallel group this rank is in (nbtrain's dp group)."""
        return self.pipe_rank * self.tp_size + self.tp_rank

    @property
    def pp_tp_zero_id(self) -> int:
        """This rank's place in that group (nbtrain's dp_rank)."""
        return self.dp_rank

    zero_idx = 0  # BMTrain's "zero" group is the whole world

    @property
    def zero_id(self) -> int:
        """This rank's place in BMTrain's "zero" group, the world: the rank."""
        return self.rank

    _BMTRAIN_GROUPS = {
        "pipe": ("pipe_idx", "stage_id"),
        "zero": ("zero_idx", "zero_id"),
        "tp_zero": ("tp_zero_idx", "tp_zero_id"),
        "tp": ("tp_idx", "tp_id"),
    }

    def get_group_id(self, group_name: str) -> int:
        """Which group of BMTrain's kind `group_name` ("pipe", "zero", "tp_zero" or
        "tp") this rank is in. Local."""
        return getattr(self, self._bmtrain_group(group_name)[0])

    def get_group_rank(self, group_name: str) -> int:
        """This rank's place in its group of BMTrain's kind `group_name`. Local."""
        return getattr(self, self._bmtrain_group(group_name)[1])

    def _bmtrain_group(self, group_name: str) -> tuple[str, str]:
        if group_name not in self._BMTRAIN_GROUPS:
            raise ValueError(
                f"group_name={group_name!r}: BMTrain's topology knows "
                f"{', '.join(map(repr, self._BMTRAIN_GROUPS))}"
            )
        return self._BMTRAIN_GROUPS[group_name]
