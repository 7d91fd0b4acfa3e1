"""nbtrain.comm.layout: the one layout rule. The planner proposes only layouts that
init_distributed's check accepts (and all of them), on 1 to 16 ranks; the runtime's
ParallelConfig, the planner, the cluster and the topology give the same answer and the
same message; no other module states the rule."""

import itertools
import re
from pathlib import Path

import pytest

from nbtrain.comm.layout import Layout
from nbtrain.comm.topology import check_sizes
from nbtrain.planner import candidate_layouts
from nbtrain.planner.estimate import Layout as PlanLayout
from nbtrain.runtime.config import ParallelConfig


def _divisors(n):
    return [d for d in range(1, n + 1) if n % d == 0]


@pytest.mark.parametrize("moe", [False, True])
def test_the_planner_proposes_exactly_the_layouts_init_distributed_accepts(moe):
    for world in range(1, 17):
        proposed = {
            (c["tp_size"], c["pipe_size"], c.get("ep_size", 1), c.get("cp_size", 1))
            for c in candidate_layouts(world, moe=moe)
        }
        for tp, pp, ep, cp in proposed:  # every proposal: accepted by every checker
            assert check_sizes(world, tp, pp, ep, cp) == world // (tp * pp)
            ParallelConfig(tp_size=tp, pipe_size=pp, ep_size=ep, cp_size=cp).check_world(world)
            PlanLayout(world, tp, pp, cp, ep)
        sizes = _divisors(world)
        accepted = set()
        for tp, pp, ep, cp in itertools.product(sizes, sizes, sizes, sizes):
            try:
                check_sizes(world, tp, pp, ep, cp)
            except ValueError:
                continue
            if pp <= 8 and (ep == 1 or (moe and cp == 1)):
                accepted.add((tp, pp, ep, cp))
        assert proposed == accepted, (
            world,
            sorted(accepted - proposed),
            sorted(proposed - accepted),
        )
    # 8 ranks, a MoE model: 44 layouts (22 x ZeRO-2 and 3); tp with ep is never offered.
    eight = candidate_layouts(8, moe=True)
    assert len(eight) == 44 and not any(c["tp_size"] > 1 and c.get("ep_size", 1) > 1 for c in eight)


@pytest.mark.parametrize(
    "sizes, world, message",
    [
        (dict(tp_size=0), 4, r"tp_size=0: give a positive integer"),
        (dict(cp_size=True), 4, r"cp_size=True: give a positive integer"),
        (dict(tp_size=4), 6, r"world size 6 is not divisible by tp_size 4 x pipe_size 1 = 4"),
        (dict(pipe_size=2, ep_size=3), 8, r"ep_size=3 does not divide the data-parallel size 4"),
        (dict(tp_size=2, ep_size=2), 4, r"ep_size=2 with tp_size=2: .*use tp_size=1"),
        (dict(tp_size=2, cp_size=2), 4, r"cp_size=2 with tp_size=2: ring attention"),
    ],
)
def test_every_checker_refuses_with_the_same_message(sizes, world, message):
    full = {"tp_size": 1, "pipe_size": 1, "ep_size": 1, "cp_size": 1, **sizes}
    checks = {
        "Layout": lambda: Layout(**full).check(world),
        "init_distributed": lambda: check_sizes(world, *full.values()),
        "ParallelConfig": lambda: ParallelConfig(**full).check_world(world),
        "plan": lambda: PlanLayout(
            world, full["tp_size"], full["pipe_size"], full["cp_size"], full["ep_size"]
        ),
    }
    for check in checks.values():
        with pytest.raises(ValueError, match=message):
            check()
    assert not Layout(**full).fits(world)
    assert Layout(tp_size=2, pipe_size=2).check(8) == 2 and Layout(ep_size=2, cp_size=2).fits(4)
    assert Layout(pipe_size=2, cp_size=2).sizes() == {"pipe_size": 2, "cp_size": 2}


def test_no_other_module_states_the_rule():
    """The phrases of the rule's messages appear only in comm/layout.py: a second copy
    of the rule (four used to disagree) fails here."""
    package = Path(__file__).resolve().parents[2] / "nbtrain"
    phrases = re.compile(
        r"does not divide the data-parallel|is not divisible by tp_size|"
        r"experts are not split by tensor|ring attention does not split heads"
    )
    copies = [
        str(p.relative_to(package))
        for p in package.rglob("*.py")
        if p.name != "layout.py" and phrases.search(p.read_text())
    ]
    assert copies == [], copies
