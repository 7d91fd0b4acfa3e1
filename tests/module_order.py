"""`--module-order`: run the test modules (files and notebooks) in another order.

A suite that passes only in one order hides state that one module leaves for the
next (see state_guard.py). This reorders whole modules and keeps the tests inside
each module in their written order (module fixtures stay valid):

    pytest --module-order=reverse ...
    pytest --module-order=random ...        # a fresh seed, printed in the header
    pytest --module-order=random:1234 ...   # that order again
    pytest --module-order=longest ...       # the slowest modules first

`longest` is what tests/run.sh runs with its pytest-xdist workers: each worker takes
the next module when it is done with one (pytest-xdist's own order, most tests
first, is turned off there: it put the one-test soak, the slowest module, last and
left one worker running it alone at the end). The seconds come from
tests/module_seconds.json, measured (`python tests/timing.py --module-seconds
RUN.json`); a module not in it counts as 0 s and runs last, in written order.

`NBTRAIN_TEST_ORDER` gives the default, so `NBTRAIN_TEST_ORDER=reverse bash tests/run.sh`
runs the whole README command in reverse.

Install it from a conftest: import its hooks into it and call `configure` from its
pytest_configure (which checks the value before anything runs).

    from module_order import (pytest_addoption, pytest_collection_modifyitems,
                              pytest_report_header, pytest_terminal_summary)
"""

from __future__ import annotations

import json
import os
import random

import pytest

ENV = "NBTRAIN_TEST_ORDER"
# NBTRAIN_TEST_MODULE_SECONDS names another file (tests/unit/test_state_guard.py).
SECONDS = os.environ.get(
    "NBTRAIN_TEST_MODULE_SECONDS",
    os.path.join(os.path.dirname(os.path.abspath(__file__)), "module_seconds.json"),
)
KINDS = ("written", "reverse", "random", "longest")


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--module-order",
        default=os.environ.get(ENV, "written"),
        metavar="written|reverse|random[:SEED]|longest",
        help="the order of test modules (tests inside a module keep theirs); "
        f"default ${ENV} or 'written'",
    )


def parse(value: str) -> tuple[str, int | None]:
    """'reverse' -> ('reverse', None); 'random:7' -> ('random', 7); 'random' picks a seed."""
    kind, _, seed = value.partition(":")
    if kind not in KINDS or (seed and kind != "random"):
        raise pytest.UsageError(
            f"--module-order {value!r}: use written, reverse, random, "
            "random:SEED (e.g. random:1234) or longest"
        )
    if kind != "random":
        return kind, None
    try:
        return kind, int(seed) if seed else random.SystemRandom().randrange(10**6)
    except ValueError:
        raise pytest.UsageError(
            f"--module-order {value!r}: the seed must be an integer, e.g. random:1234"
        ) from None


def configure(config: pytest.Config) -> None:
    worker = getattr(config, "workerinput", {})  # an xdist worker: the controller's order
    if "nbtrain_module_order" in worker:
        config._nbtrain_module_order = tuple(worker["nbtrain_module_order"])
    else:
        config._nbtrain_module_order = parse(config.getoption("module_order"))


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node) -> None:
    """xdist: every worker collects in the controller's order (one random seed for all)."""
    node.workerinput["nbtrain_module_order"] = list(node.config._nbtrain_module_order)


def pytest_report_header(config: pytest.Config) -> str | None:
    kind, seed = config._nbtrain_module_order
    if kind == "written":
        return None
    again = f"random:{seed}" if kind == "random" else kind
    return f"module order: {kind} (again: --module-order={again})"


def pytest_terminal_summary(terminalreporter, exitstatus, config: pytest.Config) -> None:
    """The order again at the end: `-q` (as tests/run.sh runs) hides the header."""
    line = pytest_report_header(config)
    if line:
        terminalreporter.write_line(line)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    kind, seed = config._nbtrain_module_order
    if kind == "written":
        return
    modules: list[str] = []
    for item in items:
        module = item.nodeid.split("::")[0]
        if module not in modules:
            modules.append(module)
    if kind == "reverse":
        modules.reverse()
    elif kind == "longest":
        with open(SECONDS) as f:
            seconds = json.load(f)
        modules.sort(key=lambda m: -seconds.get(m, 0.0))  # stable: ties keep written order
    else:
        random.Random(seed).shuffle(modules)
    rank = {module: i for i, module in enumerate(modules)}
    items.sort(key=lambda item: rank[item.nodeid.split("::")[0]])  # stable inside a module
