"""nbtrain.zero's internals stay inside it; no package imports another's private names.

Read from the source (every import and attribute, including those inside functions).
Outside nbtrain/zero, code may import the names in `nbtrain.zero.__all__` from
`nbtrain.zero` and the modules in `nbtrain.zero.PUBLIC_MODULES` (pure maths); it reads a
model's shards through `nbtrain.zero.shards` / `flat_buffers`, never through a Block's
flat groups or the private fields zero sets on its objects.
"""

import ast
import pathlib

import pytest
import torch
from torch import nn

import nbtrain
import nbtrain.zero as zero

ROOT = pathlib.Path(nbtrain.__file__).parent
ZERO = ROOT / "zero"

# Public attributes of zero's internal objects (a Block's flat groups, their layouts and
# entries) that no other package has a use for: distinctive names, so a hit is a reach
# into zero. (Generic ones such as `layout` or `entries` name other packages' own
# attributes too; the private names below catch those objects' other fields.)
INTERNAL_PUBLIC = {
    "groups",
    "local_part",
    "param_views",
    "full_items",
    "start_gather",
    "wait_gather",
    "full_tensor",
    "reduce_grad",
    "flush_deferred",
    "load_full",
    "synced_requires_grad",
    "on_grad_ready",
    "grad_dtype",
}


def _module_name(path: pathlib.Path) -> str:
    parts = ["nbtrain", *path.relative_to(ROOT).with_suffix("").parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _zero_private_attrs() -> set[str]:
    """Private attribute names zero sets or reads on objects (its classes' fields, the
    markers it puts on parameters and modules), less torch's own (`_parameters`, ...)."""
    found = set()
    for path in ZERO.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                found.add(node.attr)
            elif isinstance(node, ast.Constant) and isinstance(node.value, str):
                found.add(node.value)
    return {
        n
        for n in found
        if _private(n)
        and n.isidentifier()
        and not hasattr(nn.Module(), n)
        and not hasattr(torch.Tensor, n)
    }


ZERO_PRIVATE = _zero_private_attrs()
INTERNAL = ZERO_PRIVATE | INTERNAL_PUBLIC


def _target(node: ast.ImportFrom, module: str, is_package: bool) -> str:
    if not node.level:
        return node.module or ""
    package = module if is_package else module.rpartition(".")[0]
    base = package.split(".")[: len(package.split(".")) - node.level + 1]
    return ".".join(base + ([node.module] if node.module else []))


def _top(module: str) -> str:
    """The package a module belongs to: nbtrain.checkpoint.stream -> checkpoint."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def _string_attr(node: ast.Call) -> str | None:
    """The attribute named by getattr(x, "name"), hasattr, setattr, x.__dict__.get/pop."""
    func = node.func
    name = func.id if isinstance(func, ast.Name) else getattr(func, "attr", None)
    if name in ("getattr", "hasattr", "setattr", "delattr") and len(node.args) >= 2:
        arg = node.args[1]
    elif (
        name in ("get", "pop", "setdefault")
        and isinstance(func, ast.Attribute)
        and getattr(func.value, "attr", None) == "__dict__"
        and node.args
    ):
        arg = node.args[0]
    else:
        return None
    return arg.value if isinstance(arg, ast.Constant) and isinstance(arg.value, str) else None


def zero_violations(source: str, module: str, is_package: bool = False) -> list[str]:
    """ "line: what" for each reach into nbtrain.zero's internals in `source`."""
    out = []
    for node in ast.walk(ast.parse(source)):
        where = getattr(node, "lineno", 0)
        if isinstance(node, ast.ImportFrom):
            target = _target(node, module, is_package)
            if target == "nbtrain.zero":
                for alias in node.names:
                    if alias.name not in zero.__all__ and alias.name not in zero.PUBLIC_MODULES:
                        out.append(f"{where}: imports {alias.name!r}, not in nbtrain.zero.__all__")
            elif target.startswith("nbtrain.zero."):
                sub = target.split(".")[2]
                if sub not in zero.PUBLIC_MODULES:
                    out.append(f"{where}: imports from {target}, an internal module of zero")
                out += [
                    f"{where}: imports private {target}.{a.name}"
                    for a in node.names
                    if _private(a.name)
                ]
        elif isinstance(node, ast.Import):
            for alias in node.names:
                parts = alias.name.split(".")
                if (
                    parts[:2] == ["nbtrain", "zero"]
                    and len(parts) > 2
                    and parts[2] not in zero.PUBLIC_MODULES
                ):
                    out.append(f"{where}: imports {alias.name}, an internal module of zero")
        elif isinstance(node, ast.Attribute) and node.attr in INTERNAL:
            owner = node.value
            if not (isinstance(owner, ast.Name) and owner.id in ("self", "cls")):
                out.append(f"{where}: reads .{node.attr}, a field of zero's internals")
        elif isinstance(node, ast.Call) and _string_attr(node) in ZERO_PRIVATE:
            out.append(f"{where}: reads {_string_attr(node)!r}, a field zero sets")
    return out


def private_imports(source: str, module: str, is_package: bool = False) -> list[str]:
    """ "line: what" for each private name imported from another nbtrain package."""
    out = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.ImportFrom):
            continue
        target = _target(node, module, is_package)
        if not target.startswith("nbtrain") or _top(target) == _top(module) != "":
            continue
        if any(_private(n) for n in target.split(".")) or any(_private(a.name) for a in node.names):
            out.append(
                f"{node.lineno}: from {target} import " + ", ".join(a.name for a in node.names)
            )
    return out


def _outside_zero():
    for path in sorted(ROOT.rglob("*.py")):
        if ZERO not in path.parents:
            yield path, _module_name(path), path.name == "__init__.py"


def test_nothing_outside_zero_touches_its_internals():
    found = [
        f"{path.relative_to(ROOT.parent)}:{v}"
        for path, module, is_package in _outside_zero()
        for v in zero_violations(path.read_text(), module, is_package)
    ]
    assert found == [], "\n".join(found)


def test_no_package_imports_another_packages_private_names():
    found = [
        f"{path.relative_to(ROOT.parent)}:{v}"
        for path in sorted(ROOT.rglob("*.py"))
        for v in private_imports(path.read_text(), _module_name(path), path.name == "__init__.py")
    ]
    assert found == [], "\n".join(found)


def test_the_checks_catch_each_kind_of_reach():
    """What the scans above report, on sources that do each forbidden thing."""
    cases = {
        "from ..zero.block import Block": "internal module",
        "from nbtrain.zero import _collect": "not in nbtrain.zero.__all__",
        "from nbtrain.zero.partition import _private_helper": "private",
        "import nbtrain.zero.flat": "internal module",
        "n = block.groups[0].layout.numel": ".groups",
        "part = slot.local_part(0, 4)": ".local_part",
        "inside = p._block_part": "._block_part",
        "inside = getattr(p, '_in_block', False)": "'_in_block'",
        "buckets = dp.__dict__.get('_bucket_of')": "'_bucket_of'",
    }
    for source, expected in cases.items():
        found = zero_violations(source, "nbtrain.checkpoint.stream")
        assert len(found) == 1 and expected in found[0], (source, found)
    for fine in (
        "from ..zero import Block, shards",
        "from ..zero.partition import shard_range",
        "self._groups = []",
        "n = buffer.numel",
        "import nbtrain.zero",
    ):
        assert zero_violations(fine, "nbtrain.checkpoint.stream") == [], fine
    assert private_imports("from .comm.context import _pick_backend", "nbtrain.launch")
    assert private_imports("from .parallel import _slice_param", "nbtrain.models.gpt_tp") == []
    assert private_imports("from ..nn.parallel import _slice_param", "nbtrain.models.gpt_tp")
    assert private_imports("from .layout import _commit", "nbtrain.checkpoint.writer") == []


# What a parameter is, told by one record (nbtrain.zero.placement): the attribute that
# holds it, and the marks it replaced, which no code may set or read again.
PLACEMENT_ATTR = "nbtrain_placement"
OLD_MARKS = {
    "tp_split_dim",
    "tp_full_shape",
    "tp_groups",
    "tp_slice_group",
    "tp_replicated",
    "_nbtrain_flat",
    "_nbtrain_dp_owned",
    "_nbtrain_frozen_spans",
    "_nbtrain_segments",
    "_nbtrain_partly_frozen",
    "_nbtrain_stage_replica",
    "_nbtrain_norm_skip",
    "_nbtrain_pipeline_stage",
    "_nbtrain_tp_layout",
    "_nbtrain_expert",
}


def placement_violations(source: str, module: str) -> list[str]:
    """Reads or writes of a parameter's placement other than through
    nbtrain.zero.placement (`place`, `placement_of`): the record's attribute anywhere
    else, or one of the marks it replaced (as an attribute or a getattr string)."""
    out = []
    for node in ast.walk(ast.parse(source)):
        name = None
        if isinstance(node, ast.Attribute):
            name = node.attr
        elif isinstance(node, ast.Call) and (
            getattr(node.func, "id", None) in ("getattr", "setattr", "hasattr", "delattr")
            or getattr(node.func, "attr", None) in ("get", "pop", "setdefault")
        ):
            name = next((a.value for a in node.args if isinstance(a, ast.Constant)), None)
        elif isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant):
            name = node.slice.value
        if name in OLD_MARKS:
            out.append(f"{node.lineno}: {name!r} (a placement mark: nbtrain.zero.place)")
        named = getattr(node, "attr", None), getattr(node, "value", None)  # x.attr, "..."
        if PLACEMENT_ATTR in named and module != "nbtrain.zero.placement":
            out.append(f"{node.lineno}: {PLACEMENT_ATTR!r} (read it through placement_of)")
    return out


def test_a_parameters_placement_is_read_and_set_through_one_record():
    found = [
        f"{path.relative_to(ROOT.parent)}:{v}"
        for path in sorted(ROOT.rglob("*.py"))
        for v in placement_violations(path.read_text(), _module_name(path))
    ]
    assert found == [], "\n".join(found)
    for source in (
        "p.tp_split_dim = 0",
        "getattr(p, 'tp_full_shape', None)",
        "p._nbtrain_norm_skip = True",
        "p.__dict__['nbtrain_placement']",
    ):
        assert len(placement_violations(source, "nbtrain.optim.manager")) == 1, source
    assert placement_violations("placement_of(p).split_dim", "nbtrain.optim.manager") == []


# nbtrain puts no attribute of its own on objects it does not own (torch modules and
# optimizers, IPython shells, tqdm bars): the mechanism that needs some state keeps it,
# keyed by the object (a weakref.WeakKeyDictionary or WeakSet). Those attributes were
# all named `_nbtrain_...`, so the string stays out of nbtrain's source altogether.
OWN_ATTR_PREFIX = "_nbtrain_"


def own_attr_marks(source: str) -> list[str]:
    """ "line: text" for each line of `source` that holds `_nbtrain_` (code, string or
    comment alike)."""
    return [
        f"{n}: {line.strip()}"
        for n, line in enumerate(source.splitlines(), 1)
        if OWN_ATTR_PREFIX in line
    ]


def test_nbtrain_sets_no_attribute_of_its_own_on_objects_it_does_not_own():
    found = [
        f"{path.relative_to(ROOT.parent)}:{mark}"
        for path in sorted(ROOT.rglob("*.py"))
        for mark in own_attr_marks(path.read_text())
    ]
    assert found == [], "\n".join(found)
    for planted in (
        "model._nbtrain_root = root",
        "optimizer.__dict__['_nbtrain_saved'] = saved",
        "done = getattr(shell, '_nbtrain_trimmed_to', 0)",
        "def _is_nbtrain_gpt_config(cfg):",
        "x = 1  # was bar._nbtrain_display",
    ):
        assert own_attr_marks(f"import weakref\n{planted}\n") == [f"2: {planted}"], planted
    assert own_attr_marks("_ROOTS = weakref.WeakKeyDictionary()\nimport nbtrain_x\n") == []


def test_placement_fields_are_set_one_at_a_time_and_norms_count_each_element_once():
    from nbtrain.zero.placement import Placement, place, placement_of

    p = nn.Parameter(torch.zeros(4, 2))
    assert placement_of(p) == Placement()
    place(p, kind="tp_slice", split_dim=0, full_shape=(8, 2))
    place(p, stage=True)  # the other fields kept
    assert placement_of(p) == Placement("tp_slice", 0, (8, 2), stage=True)
    with pytest.raises(ValueError, match="kind 'tp': one of replicated, tp_slice"):
        Placement("tp")

    class Topo:  # this rank's place in the groups norm_part reads
        dp_rank = tp_rank = edp_rank = 0

    first, other = Topo(), Topo()
    other.dp_rank = other.tp_rank = other.edp_rank = 1
    cases = {  # placement, sharded: (on the first rank, on another)
        (Placement(), False): (1, 1),  # replicated everywhere: rank 0's (zeroed elsewhere)
        (Placement(), True): (0, 0),  # ZeRO: each element on one rank
        (Placement("tp_slice", 0, (8, 2)), False): (0, None),
        (Placement("tp_replicated"), True): (0, None),
        (Placement("expert", 0, (8, 2)), False): (0, None),
        (Placement(stage=True), False): (0, None),
        (Placement(tied_copy=True), False): (None, None),
    }
    for (placed, sharded), want in cases.items():
        got = (placed.norm_part(sharded, first), placed.norm_part(sharded, other))
        assert got == want, (placed, sharded, got)


def test_zero_public_names_exist():
    missing = [n for n in zero.__all__ if not hasattr(zero, n)]
    assert missing == []
    for sub in zero.PUBLIC_MODULES:
        assert (ZERO / f"{sub}.py").is_file(), sub
