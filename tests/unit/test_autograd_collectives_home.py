"""One home for the differentiable collectives: nbtrain.distributed.autograd.

A class deriving torch.autograd.Function whose forward or backward communicates (calls
a collective of nbtrain.comm.collectives or torch.distributed, directly or through
functions it calls) is defined there, or listed in ALLOWED with the reason it fuses its
communication with other work. Read from the source with ast, so a new Function that
wraps a collective elsewhere fails here, naming its file and line.

What the scan follows from forward/backward (and setup_context): calls of the modules'
top-level functions, in the same module or imported from another of nbtrain
(`tp_comm._gather_rows`, `from .x import f`), methods of the same module's classes
(`ctx.group.reduce_grad(...)`, by name), and `Function.apply` of a Function that
communicates. Calls through objects of other modules' classes are not followed.
"""

from __future__ import annotations

import ast
import pathlib

from support.collective_names import DIST_MODULES, TORCH_COLLECTIVES

import nbtrain

ROOT = pathlib.Path(nbtrain.__file__).parent
HOME = "nbtrain/distributed/autograd.py"

# Functions outside the home that communicate: {(file, class): why}.
_FUSED = "fuses its communication with the compute between it (one Function, one graph node)"
ALLOWED = {
    ("nbtrain/tensor_parallel/ops.py", "OpParallelLinear"): (
        "BMTrain's OpParallelLinear: one Function around the GEMM and its tp steps, saving "
        "only the input slice and gathering it again in backward; its steps are "
        "nbtrain.distributed.autograd's non-autograd collectives, through nn.tp_comm"
    ),
    ("nbtrain/zero/parameter.py", "_GatherParam"): (
        "ZeRO's parameter gather: the full parameter from its shards, the gradient "
        "reduce-scattered back to the shard with the optimizer's scale and tp layout"
    ),
    ("nbtrain/zero/loose.py", "_GatherMany"): (
        "ZeRO's gather of several loose parameters in one buffer (one all-gather), the "
        "gradients reduce-scattered in one buffer likewise"
    ),
    ("nbtrain/zero/flat.py", "_GatherFlat"): (
        "ZeRO's flat block gather: backward hands the gradient to the FlatGroup's "
        "bucketed, overlapped reduce-scatter"
    ),
    ("nbtrain/context_parallel/ring.py", "_RingAttention"): (
        "ring attention: the K/V exchange of each step " + _FUSED + ", the attention blocks"
    ),
    ("nbtrain/pipeline/blocklist.py", "_Pipelined"): (
        "BMTrain's pipeline of a block list: the stages' sends and receives interleaved "
        "with their blocks' forward and backward, micro-batch by micro-batch"
    ),
    ("nbtrain/moe/dispatch.py", "_ExpertsExchange"): (
        "MoE's pipelined exchange: each chunk's dispatch and combine " + _FUSED + ", the "
        "local experts, so one chunk's exchange travels while another's experts compute"
    ),
}

COLLECTIVES_MODULE = "nbtrain.comm.collectives"
# Calls that move tensors between ranks: torch's, and nbtrain.comm.collectives' own.
COMM_CALLS = TORCH_COLLECTIVES | {"send_recv", "post_p2p"}
FUNCTION_BASES = {"torch.autograd.Function", "autograd.Function", "Function"}
SCANNED_METHODS = {"forward", "backward", "setup_context"}


def _module_name(path: pathlib.Path) -> str:
    parts = ["nbtrain", *path.relative_to(ROOT).with_suffix("").parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


class Module:
    """One source file: what it imports, its functions and classes."""

    def __init__(self, name: str, source: str, file: str, is_package: bool = False):
        self.name, self.file = name, file
        self.tree = ast.parse(source)
        package = name if is_package else name.rpartition(".")[0]
        self.comm = set()  # names bound to a module of collectives
        self.comm_calls = set()  # collectives imported by name
        self.modules = {}  # alias -> nbtrain module name
        self.imported = {}  # name -> (nbtrain module, name there)
        for node in ast.walk(self.tree):
            if isinstance(node, ast.Import):
                for a in node.names:
                    if a.name in DIST_MODULES or a.name == COLLECTIVES_MODULE:
                        self.comm.add(a.asname or a.name)
                    elif a.name.startswith("nbtrain") and a.asname:
                        self.modules[a.asname] = a.name
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(up + ([node.module] if node.module else []))
                for a in node.names:
                    full, bound = f"{base}.{a.name}", a.asname or a.name
                    if full in DIST_MODULES or full == COLLECTIVES_MODULE:
                        self.comm.add(bound)
                    elif base in DIST_MODULES or base == COLLECTIVES_MODULE:
                        if a.name in COMM_CALLS:
                            self.comm_calls.add(bound)
                    elif full.startswith("nbtrain"):
                        self.modules[bound] = full  # a module, or a name: both kept
                        if base.startswith("nbtrain"):
                            self.imported[bound] = (base, a.name)
        self.comm |= set(DIST_MODULES)  # `import torch`: torch.distributed.all_reduce
        self.functions = {
            n.name: n
            for n in self.tree.body
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))
        }
        self.classes = {n.name: n for n in self.tree.body if isinstance(n, ast.ClassDef)}
        self.methods = {}  # method name -> its definitions in this module's classes
        for cls in self.classes.values():
            for n in cls.body:
                if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    self.methods.setdefault(n.name, []).append(n)

    def is_function_class(self, cls: ast.ClassDef) -> bool:
        for base in cls.bases:
            spelled = ast.unparse(base)
            if spelled in FUNCTION_BASES:
                return True
            if spelled in self.classes and self.is_function_class(self.classes[spelled]):
                return True
        return False

    def function_classes(self):
        return [c for c in self.classes.values() if self.is_function_class(c)]


class Scan:
    """Which functions and Functions of a set of modules communicate."""

    def __init__(self, modules: dict[str, Module]):
        self.modules = modules
        self.memo: dict[tuple, bool] = {}

    def communicates(self, module: Module, node, seen=frozenset()) -> bool:
        key = (module.name, id(node))
        if key in self.memo:
            return self.memo[key]
        if key in seen:
            return False
        seen = seen | {key}
        found = any(self._call_communicates(module, c, seen) for c in _calls(node))
        self.memo[key] = found
        return found

    def function_communicates(self, module: Module, cls: ast.ClassDef, seen=frozenset()):
        """Whether a Function's forward/backward communicates: (line, what) or None."""
        for n in cls.body:
            if isinstance(n, ast.FunctionDef) and n.name in SCANNED_METHODS:
                if self.communicates(module, n, seen):
                    return n.lineno
        return None

    def _call_communicates(self, module: Module, call: ast.Call, seen) -> bool:
        func = call.func
        if isinstance(func, ast.Name):
            if func.id in module.comm_calls:
                return True
            if func.id in module.functions:
                return self.communicates(module, module.functions[func.id], seen)
            if func.id in module.imported:
                return self._imported(*module.imported[func.id], seen)
            return False
        if not isinstance(func, ast.Attribute):
            return False
        owner = ast.unparse(func.value)
        if owner in module.comm:
            return func.attr in COMM_CALLS
        if func.attr == "apply":  # Function.apply: X.apply, mod.X.apply
            *path, cls = owner.split(".")
            where = module
            if path and path[0] in module.modules and module.modules[path[0]] in self.modules:
                where = self.modules[module.modules[path[0]]]
            elif not path and cls in module.imported:
                mod, cls = module.imported[cls]
                where = self.modules.get(mod)
            if where is not None and cls in where.classes:
                c = where.classes[cls]
                return where.is_function_class(c) and bool(
                    self.function_communicates(where, c, seen)
                )
            return False
        if owner in module.modules and module.modules[owner] in self.modules:
            return self._imported(module.modules[owner], func.attr, seen)
        # A method of one of this module's classes, called through any object.
        return any(self.communicates(module, m, seen) for m in module.methods.get(func.attr, ()))

    def _imported(self, module_name: str, name: str, seen) -> bool:
        target = self.modules.get(module_name)
        if target is None:
            return False
        if name in target.functions:
            return self.communicates(target, target.functions[name], seen)
        if name in target.imported:  # re-exported
            return self._imported(*target.imported[name], seen)
        return False


def _calls(node):
    return [n for n in ast.walk(node) if isinstance(n, ast.Call)]


def _dynamic_functions(module: Module):
    """Lines where a Function is made with type(name, (Function,), ...)."""
    for node in ast.walk(module.tree):
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id == "type"
            and len(node.args) == 3
            and isinstance(node.args[1], ast.Tuple)
            and any(ast.unparse(b) in FUNCTION_BASES for b in node.args[1].elts)
        ):
            yield node.lineno


def load(sources: dict[str, tuple[str, str]]) -> dict[str, Module]:
    """{module name: Module} of {module name: (file, source)}."""
    return {
        name: Module(name, text, file, file.endswith("__init__.py"))
        for name, (file, text) in sources.items()
    }


def communicating_functions(modules: dict[str, Module]) -> list[tuple[str, int, str]]:
    """(file, line, class) of every Function whose forward/backward communicates, and
    (file, line, "type(...)") of every Function made dynamically."""
    scan, found = Scan(modules), []
    for module in modules.values():
        for cls in module.function_classes():
            if scan.function_communicates(module, cls):
                found.append((module.file, cls.lineno, cls.name))
        found += [(module.file, line, "type(...)") for line in _dynamic_functions(module)]
    return sorted(found)


def _nbtrain_modules() -> dict[str, Module]:
    sources = {}
    for path in sorted(ROOT.rglob("*.py")):
        file = str(path.relative_to(ROOT.parent))
        sources[_module_name(path)] = (file, path.read_text())
    return load(sources)


FOUND = communicating_functions(_nbtrain_modules())


def test_differentiable_collectives_live_in_one_home():
    bad = [
        f"{file}:{line}: {cls}"
        for file, line, cls in FOUND
        if file != HOME and (file, cls) not in ALLOWED
    ]
    assert not bad, (
        f"autograd Functions that communicate outside {HOME} (define the collective "
        "there, with its shape as an argument, and call it; or list the class in ALLOWED "
        "in tests/unit/test_autograd_collectives_home.py with the reason): " + "; ".join(bad)
    )


def test_every_allowed_function_still_communicates():
    found = {(file, cls) for file, _, cls in FOUND}
    gone = sorted(set(ALLOWED) - found)
    assert not gone, f"ALLOWED lists Functions that no longer communicate: {gone}"
    assert all(why for why in ALLOWED.values())


def test_the_home_is_seen_communicating():
    """The scan is not vacuous: it finds the home's own Functions."""
    home = {cls for file, _, cls in FOUND if file == HOME}
    assert {"Gather", "ReduceScatter", "AllReduce", "SumGrad", "AllToAll"} <= home, home


def test_the_scan_fails_on_a_function_outside_the_home():
    helper = """
from ..comm import collectives as C

def gather_it(x):
    out = x.new_empty(2 * x.numel())
    C.all_gather(out, x)
    return out
"""
    user = """
import torch
import torch.distributed as dist
from torch.autograd import Function
from ..comm.collectives import all_reduce
from . import helper
from .helper import gather_it as g

class Direct(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        dist.all_reduce(x)
        return x

class ByName(Function):
    @staticmethod
    def backward(ctx, grad):
        all_reduce(grad)
        return grad

class ThroughHelper(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return helper.gather_it(x)

class ThroughImport(torch.autograd.Function):
    @staticmethod
    def backward(ctx, grad):
        return _local(grad)

def _local(t):
    return g(t)

class Nested(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return Direct.apply(x)

class Local(torch.autograd.Function):  # no communication: not reported
    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

Made = type("Made", (torch.autograd.Function,), {})
"""
    modules = load(
        {
            "nbtrain.pkg.helper": ("nbtrain/pkg/helper.py", helper),
            "nbtrain.pkg.user": ("nbtrain/pkg/user.py", user),
        }
    )
    found = [(cls, line) for _, line, cls in communicating_functions(modules)]
    assert found == [
        ("Direct", 9),
        ("ByName", 15),
        ("ThroughHelper", 21),
        ("ThroughImport", 26),
        ("Nested", 34),
        ("type(...)", 44),
    ], found
