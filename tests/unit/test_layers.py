"""The package's layers: lower layers never import higher ones, and there are no cycles.

Read from the source (every import, including those inside functions), so a lazy
import that hides a cycle or an upward dependency is caught too.
"""

import ast
import pathlib

import pytest

import nbtrain

ROOT = pathlib.Path(nbtrain.__file__).parent
KERNELS = "nbtrain.kernels"  # the kernels/ folder, installed under this name
LAYERS = [
    "comm",
    "distributed",  # BMTrain's differentiable collectives, over comm
    "utils",  # BMTrain's helpers (sum_loss, print_rank), over comm and distributed
    "zero",
    "context_parallel",
    "nn",
    "moe",
    "pipeline",
    "optim",
    "checkpoint",
    "models",
    "telemetry",
    "debug",
    "notebook",
    "launch",
    "runtime",
    "planner",
]  # runtime drives the models; validate launches ranks; the planner reads runtime configs


def _module_name(path: pathlib.Path) -> str:
    parts = ["nbtrain", *path.relative_to(ROOT).with_suffix("").parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module_name(p): p for p in ROOT.rglob("*.py")}


def _imports(name: str) -> set[str]:
    """nbtrain modules `name` imports (a package counts as itself, not its children)."""
    path = MODULES[name]
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            subs = [
                f"{target}.{a.name}"
                for a in node.names
                if f"{target}.{a.name}" in MODULES or f"{target}.{a.name}" == KERNELS
            ]
            out.update(subs or [target])
    return {m for m in out if (m in MODULES or m.startswith(KERNELS)) and m != name}


def _layer(name: str):
    parts = name.split(".")
    return LAYERS.index(parts[1]) if len(parts) > 1 and parts[1] in LAYERS else None


@pytest.mark.parametrize("name", sorted(m for m in MODULES if _layer(m) is not None))
def test_no_upward_imports(name):
    mine = _layer(name)
    for target in _imports(name):
        theirs = _layer(target)
        if target == "nbtrain" and mine >= LAYERS.index("notebook"):
            continue  # the notebook layer drives the whole package
        if target.startswith("nbtrain.kernels"):
            continue  # Triton kernels: a leaf that imports nothing of nbtrain
        assert theirs is not None and theirs <= mine, f"{name} imports {target}"


def test_no_import_cycles():
    # Engines hand users the facade (`nbt`), and the facade loads the magics lazily;
    # that one loop through the top package is by design, every other is a defect.
    graph = {
        m: _imports(m) - ({"nbtrain"} if _layer(m) == LAYERS.index("notebook") else set())
        for m in MODULES
    }
    state: dict[str, int] = {}

    def visit(m, path):
        state[m] = 1
        for t in graph.get(m, ()):
            if state.get(t) == 1:
                raise AssertionError("import cycle: " + " -> ".join(path + [m, t]))
            if t not in state:
                visit(t, path + [m])
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m, [])


def test_comm_imports_nothing_else_of_nbtrain():
    for name in (m for m in MODULES if m.startswith("nbtrain.comm")):
        assert all(t.startswith("nbtrain.comm") for t in _imports(name)), name


def test_every_subpackage_is_installed():
    """A package folder missing from pyproject's list works in a checkout (and an
    editable install) but is left out of a wheel."""
    import tomllib

    listed = set(
        tomllib.loads((ROOT.parent / "pyproject.toml").read_text())["tool"]["setuptools"][
            "packages"
        ]
    )
    found = {_module_name(p) for p in ROOT.rglob("__init__.py")}
    assert found - listed == set(), sorted(found - listed)


@pytest.mark.parametrize("name", sorted(MODULES))
def test_every_relative_import_exists(name):
    """A relative import (even one inside a function, run only on some path) names a
    module or package of nbtrain: `from .comm import context` in a moved file is caught
    here, not by the first rank that takes that path."""
    path = MODULES[name]
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level:
            base = package.split(".")[: len(package.split(".")) - node.level + 1]
            target = ".".join(base + ([node.module] if node.module else []))
            assert target in MODULES or target.startswith(KERNELS), (
                f"{name}: line {node.lineno} imports {target}, which does not exist"
            )


COLLECTIVES = {
    "send",
    "recv",
    "isend",
    "irecv",
    "batch_isend_irecv",
    "P2POp",
    "all_gather",
    "all_gather_into_tensor",
    "all_gather_object",
    "all_reduce",
    "all_to_all",
    "all_to_all_single",
    "broadcast",
    "broadcast_object_list",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "barrier",
    "gather",
    "scatter",
    "reduce",
}
# comm owns them; bench times torch's own calls; launch's barrier brings the group up.
OWN_CALLS = ("nbtrain.comm", "nbtrain.bench", "nbtrain.launch")


@pytest.mark.parametrize("name", sorted(m for m in MODULES if not m.startswith(OWN_CALLS)))
def test_collectives_go_through_comm(name):
    """Traffic between ranks goes through nbtrain.comm.collectives, whose byte counters
    and events the benchmarks and telemetry read: no torch.distributed call elsewhere."""
    tree = ast.parse(MODULES[name].read_text())
    aliases = {"torch.distributed"} | {
        a.asname or a.name
        for node in ast.walk(tree)
        if isinstance(node, ast.Import)
        for a in node.names
        if a.name == "torch.distributed"
    }
    direct = {
        a.asname or a.name
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom) and node.module == "torch.distributed"
        for a in node.names
    }
    calls = [
        f"{ast.unparse(node.value)}.{node.attr}"
        for node in ast.walk(tree)
        if isinstance(node, ast.Attribute)
        and node.attr in COLLECTIVES
        and ast.unparse(node.value) in aliases
    ]
    assert not calls and not direct & COLLECTIVES, (calls, direct & COLLECTIVES)
