"""The parallel layout and its one rule: which sizes fit a world, which compose.

    layout = Layout(tp_size=2, pipe_size=2)
    dp_size = layout.check(8)          # 2, or a ValueError naming the value and the fix
    Layout.every(8, moe=True)          # every layout init_distributed accepts on 8 ranks

A layout is four sizes (tensor, pipeline, expert, context parallel); the data-parallel
size is what the world leaves: world = dp x tp x pp. The rule:

- every size is a positive integer;
- tp_size x pipe_size divides the world;
- ep_size and cp_size each divide the data-parallel size (their ranks are carved from
  the data-parallel ranks; see topology.py), and may be used together;
- expert parallelism does not compose with tensor parallelism (experts are whole on
  their rank), nor does context parallelism (ring attention keeps every head).

`init_distributed` (through `topology.check_sizes`), the runtime's `ParallelConfig`,
the planner's layouts and `Cluster` all check with this; nothing else states the rule.
"""

from __future__ import annotations

from dataclasses import dataclass

SIZES = ("tp_size", "pipe_size", "ep_size", "cp_size")


@dataclass(frozen=True)
class Layout:
    """Tensor, pipeline, expert and context parallel sizes (1: not used)."""

    tp_size: int = 1
    pipe_size: int = 1
    ep_size: int = 1
    cp_size: int = 1

    def check(self, world_size: int | None = None, who: str = "") -> int | None:
        """The data-parallel size over `world_size` ranks (None without a world: only
        the sizes and how they compose are checked).

        Raises:
            ValueError: a size that is not a positive integer, sizes that do not fit
                the world, or parallelisms that do not compose; the message names the
                values and the fix, prefixed with `who` ("ParallelConfig: ").
        """
        prefix = f"{who}: " if who else ""
        for name in SIZES:
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{prefix}{name}={value!r}: give a positive integer")
        tp, pp = self.tp_size, self.pipe_size
        if self.ep_size > 1 and tp > 1:
            raise ValueError(
                f"{prefix}ep_size={self.ep_size} with tp_size={tp}: experts are not split "
                "by tensor parallelism; use tp_size=1 with expert parallelism"
            )
        if self.cp_size > 1 and tp > 1:
            raise ValueError(
                f"{prefix}cp_size={self.cp_size} with tp_size={tp}: ring attention does not "
                "split heads; use tp_size=1 with context parallelism"
            )
        if world_size is None:
            return None
        if world_size % (tp * pp):
            raise ValueError(
                f"{prefix}world size {world_size} is not divisible by tp_size {tp} x "
                f"pipe_size {pp} = {tp * pp}: choose sizes whose product divides the "
                "number of ranks"
            )
        dp = world_size // (tp * pp)
        for name in ("ep_size", "cp_size"):
            value = getattr(self, name)
            if dp % value:
                raise ValueError(
                    f"{prefix}{name}={value} does not divide the data-parallel size "
                    f"{dp} (world {world_size} / tp_size {tp} / pipe_size {pp}): {name} "
                    f"ranks are carved from the data-parallel ranks, choose a divisor of {dp}"
                )
        return dp

    def fits(self, world_size: int) -> bool:
        """Whether `check(world_size)` passes."""
        try:
            self.check(world_size)
        except ValueError:
            return False
        return True

    @classmethod
    def every(cls, world_size: int, moe: bool = False, pipe_max: int | None = None):
        """Layouts `check(world_size)` accepts, tp then pp ascending, each plain, then
        with each cp_size, then (for a `moe` model) with each ep_size; at most
        `pipe_max` stages. cp and ep together also pass `check`; they are left out here
        (the planner's candidates use one of them at a time)."""
        out = []
        for tp in _divisors(world_size):
            for pp in _divisors(world_size // tp):
                if pipe_max is not None and pp > pipe_max:
                    continue
                dp = world_size // (tp * pp)
                extra = [{}]
                extra += [{"cp_size": cp} for cp in _divisors(dp)[1:]]
                extra += [{"ep_size": ep} for ep in _divisors(dp)[1:]] if moe else []
                for more in extra:
                    layout = cls(tp_size=tp, pipe_size=pp, **more)
                    if layout.fits(world_size):
                        out.append(layout)
        return out

    def sizes(self) -> dict[str, int]:
        """The sizes other than 1, as keyword arguments (`init_distributed(**...)`)."""
        return {name: getattr(self, name) for name in SIZES if getattr(self, name) != 1}


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]
