"""How the tests find their helpers (see tests/support/__init__.py), kept that way:

- no file under tests/ edits the module search path, except the few listed in
  PATH_EDITS with the reason each needs it (a new one is a helper to move into
  tests/support/, or a script to give PYTHONPATH through support.script_env());
- no fixture is defined in two test modules of one folder: a fixture two modules need
  goes into the folder's conftest.py (parameterised by a module variable where they
  differ, as tests/notebook/conftest.py's `cluster` reads CLUSTER_START);
- no helper module name is used in two test folders or in tests/support/: every test
  folder is on the search path in a run over tests/, and the second name would silently
  import the first.
"""

import ast
import re
from collections import defaultdict
from pathlib import Path

THIS = Path(__file__).resolve()
TESTS = THIS.parents[1]

# Files allowed to edit the search path, and why.
PATH_EDITS = {
    "conftest.py": "--import-mode=importlib leaves tests/ off the path; the guards need it",
    "unit/test_collection_guard.py": "the conftest it writes for a project in tmp_path, "
    "outside tests/, imports tests/collection_guard.py",
    "unit/test_state_guard.py": "the conftest it writes for a project in tmp_path, "
    "outside tests/, imports tests/state_guard.py",
    "unit/test_timing_option.py": "the conftest it writes for a project in tmp_path, "
    "outside tests/, imports tests/timing.py",
    "multirank/test_bmtrain_example.py": "imports the tutorial example's modules as its "
    "script does, from the example's own folder",
    "stress/memory_growth.py": "a command run by path, outside pytest: this checkout's nbtrain",
    "stress/rebuild_repeat.py": "a command run by path, outside pytest: this checkout's "
    "nbtrain, tests/ and the test module it borrows from",
}
# sys.path.insert(...), .append(...), .extend(...), sys.path[...] = ..., sys.path += ...,
# in code or in a script written by a test.
PATH_EDIT = re.compile(
    r"\bsys\.path\s*"
    r"(?:\.\s*(?:insert|append|extend)\s*\(|\[[^\]]*\]\s*=(?!=)|\+=)"
)


def _python_files():
    for path in sorted(TESTS.rglob("*.py")):
        rel = path.relative_to(TESTS)
        # this file, whose examples of path edits are the checker's own
        if not {"__pycache__", ".ipynb_checkpoints"} & set(rel.parts) and path != THIS:
            yield rel, path


def test_the_pattern_finds_each_way_of_editing_the_path():
    for line in (
        "sys.path.insert(0, here)",
        "sys.path.append(here)",
        "sys.path.extend([a])",
        "sys.path[:0] = [a, b]",
        "sys.path[0:0]=[a]",
        "sys.path += [a]",
        "    sys.path .insert (0, x)",
    ):
        assert PATH_EDIT.search(line), line
    for line in (
        "print(sys.path)",
        "if here not in sys.path:",
        "sys.path[0] == here",
        "paths = list(sys.path)",
    ):
        assert not PATH_EDIT.search(line), line


def test_no_file_under_tests_edits_the_search_path_outside_the_list():
    found = {str(rel) for rel, path in _python_files() if PATH_EDIT.search(path.read_text())}
    unexpected = sorted(found - set(PATH_EDITS))
    assert not unexpected, (
        f"{unexpected} edit sys.path: import shared helpers from tests/support/ "
        "(`from support import ...`), give a script tests/ with support.script_env(), "
        "or add the file to PATH_EDITS with the reason it must"
    )
    stale = sorted(set(PATH_EDITS) - found)
    assert not stale, f"{stale} no longer edit sys.path: take them out of PATH_EDITS"


def _is_fixture(decorator: ast.expr) -> bool:
    target = decorator.func if isinstance(decorator, ast.Call) else decorator
    name = target.attr if isinstance(target, ast.Attribute) else getattr(target, "id", "")
    return name in ("fixture", "yield_fixture")


def _fixtures(tree: ast.Module):
    """Names of the fixtures a module defines, at its top level or in its classes."""
    bodies = [tree.body] + [n.body for n in tree.body if isinstance(n, ast.ClassDef)]
    for body in bodies:
        for node in body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and any(
                _is_fixture(d) for d in node.decorator_list
            ):
                yield node.name


def duplicate_fixtures(sources: dict) -> dict:
    """{(folder, fixture name): [modules]} for a fixture defined in more than one test
    module of a folder; `sources` maps a path relative to tests/ to its text."""
    where = defaultdict(list)
    for rel, text in sources.items():
        rel = Path(rel)
        if rel.name.startswith("test_"):
            for name in set(_fixtures(ast.parse(text))):
                where[(str(rel.parent), name)].append(rel.name)
    return {key: sorted(mods) for key, mods in where.items() if len(mods) > 1}


def test_the_duplicate_check_finds_a_copied_fixture():
    copied = "import pytest\n\n@pytest.fixture(scope='module')\ndef cluster(ipython):\n    pass\n"
    bare = (
        "from pytest import fixture\n\nclass TestX:\n    @fixture\n"
        "    def cluster(self):\n        pass\n"
    )
    found = duplicate_fixtures(
        {
            "notebook/test_a.py": copied,
            "notebook/test_b.py": bare,
            "notebook/conftest.py": copied,
            "unit/test_c.py": copied,
        }
    )
    assert found == {("notebook", "cluster"): ["test_a.py", "test_b.py"]}
    assert duplicate_fixtures({"notebook/test_a.py": copied, "unit/test_c.py": copied}) == {}


def test_no_fixture_is_defined_in_two_test_modules_of_a_folder():
    found = duplicate_fixtures({rel: path.read_text() for rel, path in _python_files()})
    assert not found, (
        f"fixtures copied between test modules: {found}; define each once, "
        "in the folder's conftest.py"
    )


def test_no_module_name_is_used_in_two_test_folders():
    """tests/ and each folder in it are on the search path: the names each puts there
    (its modules, its packages) must differ."""
    where = defaultdict(list)
    for folder in [TESTS] + sorted(p for p in TESTS.iterdir() if p.is_dir()):
        if (folder / "__init__.py").exists():
            continue  # a package (tests/support): its modules are support.<name>
        for entry in folder.iterdir():
            if entry.suffix == ".py" and entry.stem != "conftest":
                where[entry.stem].append(str(entry.relative_to(TESTS)))
            elif entry.is_dir() and (entry / "__init__.py").exists():
                where[entry.name].append(str(entry.relative_to(TESTS)) + "/")
    clashes = {name: found for name, found in where.items() if len(found) > 1}
    assert not clashes, f"names importable from more than one folder under tests/: {clashes}"
