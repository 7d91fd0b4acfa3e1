"""The package's layers: lower layers never import higher ones, and there are no cycles.

Read from the source (every import, including those inside functions), so a lazy
import that hides a cycle or an upward dependency is caught too.
"""

import ast
import pathlib

import pytest
from support.collective_names import DIST_MODULES, TORCH_COLLECTIVES

import nbtrain

ROOT = pathlib.Path(nbtrain.__file__).parent
KERNELS = "nbtrain.kernels"  # the kernels/ folder, installed under this name
LAYERS = [
    "comm",
    "distributed",  # BMTrain's differentiable collectives, over comm
    "utils",  # BMTrain's helpers (sum_loss, print_rank), over comm and distributed
    "tensor_parallel.slices",  # the slice maths ZeRO's Blocks cut with
    "tensor_parallel.partial",  # replicated gradients over tp, which ZeRO reduces
    "zero",
    "tensor_parallel",  # its layers, communication and plans, over zero
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
    """A module's layer: its own entry ("tensor_parallel.slices") or its package's."""
    parts = name.split(".")
    for key in (".".join(parts[1:3]), parts[1] if len(parts) > 1 else None):
        if key in LAYERS:
            return LAYERS.index(key)
    return None


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


COLLECTIVES = TORCH_COLLECTIVES
ONE_PATH = {"nbtrain.comm.collectives"}  # counted, evented, in flight: `_issue`
# Modules that may call torch's collectives themselves: {module: (names, why)}.
_BENCH = (
    "a benchmark of torch's own FSDP2/DDP/pipeline peers: its timing barriers and "
    "result reductions stay outside the counters and events the benchmark measures"
)
ALLOWED = {
    "nbtrain.comm.recovery": (
        {"barrier"},
        "rebuild's handshake right after init_process_group (no barrier itself), part of "
        "making the group: the watch was just reset so that the new group's collectives "
        "count from 1, and the topology is not made yet",
    ),
    "nbtrain.launch": (
        {"barrier"},
        "run_ranks' handshake right after init_process_group, before init_distributed: "
        "part of making the group, and through comm it would be collective #1 of every "
        "rank function, shifting the numbers the hang reports give",
    ),
    "nbtrain.bench.engines": (
        {"all_reduce"},
        _BENCH + "; it wraps DDP's all_reduce to count DDP's wire bytes",
    ),
    "nbtrain.bench.moe": ({"barrier", "all_reduce"}, _BENCH),
    "nbtrain.bench.pp": ({"isend", "barrier", "broadcast", "all_reduce"}, _BENCH),
    "nbtrain.bench.ring": ({"barrier", "all_reduce"}, _BENCH),
    "nbtrain.bench.worker": ({"barrier", "all_reduce"}, _BENCH),
}
KERNELS_DIR = ROOT.parent / "kernels"
SOURCES = {
    **MODULES,
    **{f"kernels.{p.stem}": p for p in KERNELS_DIR.glob("*.py")},
}


def direct_collectives(source: str) -> list[tuple[int, str]]:
    """(line, what) of every use of a torch.distributed collective in `source`: an
    attribute of the module under any alias (`dist.all_reduce`, `torch.distributed.barrier`,
    `dist.distributed_c10d.send`, also passed along uncalled, as `P2POp(dist.isend, ...)`
    does), or a collective imported by name (`from torch.distributed import barrier`)."""
    tree = ast.parse(source)
    aliases = set(DIST_MODULES)  # `import torch.distributed` binds `torch`
    hits = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            aliases.update(a.asname for a in node.names if a.name in DIST_MODULES and a.asname)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            for a in node.names:
                if f"{node.module}.{a.name}" in DIST_MODULES:  # from torch import distributed
                    aliases.add(a.asname or a.name)
                elif node.module in DIST_MODULES and a.name in COLLECTIVES:
                    hits.append((node.lineno, f"{node.module}.{a.name}"))
    base = len("torch.distributed")
    aliases |= {a + m[base:] for a in set(aliases) for m in DIST_MODULES}  # dist.distributed_c10d
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr in COLLECTIVES:
            if ast.unparse(node.value) in aliases:
                hits.append((node.lineno, ast.unparse(node)))
    return sorted(hits)


def _where(path: pathlib.Path) -> str:
    return str(path.relative_to(ROOT.parent))


@pytest.mark.parametrize("name", sorted(m for m in SOURCES if m not in ONE_PATH))
def test_collectives_go_through_comm(name):
    """Traffic between ranks goes through nbtrain.comm.collectives, whose one path counts
    the bytes the benchmarks read, publishes the events telemetry shows and registers what
    is in flight for teardown: no torch.distributed collective elsewhere, but for the
    modules in ALLOWED (each with its reason), and there only the names listed."""
    path = SOURCES[name]
    allowed, _why = ALLOWED.get(name, (set(), ""))
    bad = [
        f"{_where(path)}:{line}: {what}"
        for line, what in direct_collectives(path.read_text())
        if what.rpartition(".")[2] not in allowed
    ]
    assert not bad, (
        "torch.distributed collectives outside nbtrain.comm.collectives (call its "
        "wrappers, or add the module and the names to ALLOWED in tests/unit/test_layers.py "
        "with the reason): " + "; ".join(bad)
    )


@pytest.mark.parametrize("name", sorted(ALLOWED))
def test_every_allowed_collective_is_still_used(name):
    """An entry of ALLOWED whose call went away is removed, so the list stays the set of
    exceptions there are."""
    assert name in SOURCES, f"ALLOWED names {name}, which is no module of nbtrain"
    used = {what.rpartition(".")[2] for _, what in direct_collectives(SOURCES[name].read_text())}
    allowed, why = ALLOWED[name]
    assert why and allowed <= used, f"{name}: {sorted(allowed - used)} no longer used"


def test_the_scan_finds_direct_collectives_under_any_spelling():
    source = """
import torch
import torch.distributed
import torch.distributed as dist
from torch import distributed as d2
from torch.distributed import all_gather_object as ago
import torch.distributed.nn.functional as dfn

def f(x, ops):
    dist.all_reduce(x)
    torch.distributed.barrier()
    d2.broadcast(x, 0)
    dist.distributed_c10d.send(x, 1)
    dfn.all_reduce(x)
    dist.batch_isend_irecv([dist.P2POp(dist.isend, x, 1)])
    dist.get_rank(); dist.new_group([0]); x.all_reduce  # not torch's collectives
"""
    assert direct_collectives(source) == [
        (6, "torch.distributed.all_gather_object"),
        (10, "dist.all_reduce"),
        (11, "torch.distributed.barrier"),
        (12, "d2.broadcast"),
        (13, "dist.distributed_c10d.send"),
        (14, "dfn.all_reduce"),
        (15, "dist.P2POp"),
        (15, "dist.batch_isend_irecv"),
        (15, "dist.isend"),
    ]
