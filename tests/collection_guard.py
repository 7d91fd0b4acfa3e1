"""Fails a pytest run that silently skips a test file.

pytest walks a folder and quietly passes over what its settings exclude: a folder
matching `norecursedirs` (by default `build`, `dist`, `venv`, `*.egg`, dot-folders and
a few more; that is how a whole `tests/dist/` once went unrun) or a file whose name
does not match `python_files`. Nothing in the output says so.

When the run's collection roots cover the whole tests folder (`pytest tests`,
`pytest` with `testpaths = ["tests"]`, `bash tests/run.sh`), this plugin lists every
`test_*.py` / `*_test.py` file under that folder on disk and stops the run with a
usage error naming each one that contributed no collected item. A file counts as
collected when it yielded at least one item before any `-k`/`-m`/`--deselect`
filtering, or when its collection was reported, as an error or as a skip (module-level
`pytest.skip`, `importorskip`): those are not silent. Runs that name single files or
sub-folders, `--lf` runs (which skip files on purpose) and runs that stop during
collection are not checked; files or folders passed to `--ignore`/`--ignore-glob` are
left out on purpose and so are exempt, as are editor copies in `.ipynb_checkpoints/`.

Install it from a conftest:

    from collection_guard import CollectionGuard
    def pytest_configure(config):
        CollectionGuard.install(config, tests_dir=Path(__file__).parent)
"""

from __future__ import annotations

import fnmatch
from pathlib import Path

import pytest

__all__ = ["CollectionGuard", "find_test_files"]

TEST_FILE_GLOBS = ("test_*.py", "*_test.py")
# Never meant to be collected: bytecode caches and Jupyter's autosaved copies
# (`test_x-checkpoint.py` matches test_*.py).
EXEMPT_DIRS = frozenset({"__pycache__", ".ipynb_checkpoints"})
PLUGIN_NAME = "nbtrain-collection-guard"


def find_test_files(tests_dir: Path) -> list[Path]:
    """Every test_*.py / *_test.py file under `tests_dir`, found on disk (not via git)."""
    found = set()
    for pattern in TEST_FILE_GLOBS:
        for path in tests_dir.rglob(pattern):
            rel_dirs = path.relative_to(tests_dir).parts[:-1]
            if path.is_file() and not EXEMPT_DIRS.intersection(rel_dirs):
                found.add(path.resolve())
    return sorted(found)


def _covers(root: Path, target: Path) -> bool:
    return root == target or root in target.parents


class CollectionGuard:
    """pytest plugin: see the module docstring."""

    def __init__(self, config: pytest.Config, tests_dir: Path):
        self.config = config
        self.tests_dir = Path(tests_dir).resolve()
        self.collected: set[Path] = set()  # files that yielded items (before deselection)
        self.reported: set[Path] = set()  # collectors whose collection failed or skipped

    @classmethod
    def install(cls, config: pytest.Config, tests_dir: Path) -> "CollectionGuard | None":
        if config.pluginmanager.has_plugin(PLUGIN_NAME):
            return config.pluginmanager.get_plugin(PLUGIN_NAME)
        guard = cls(config, tests_dir)
        config.pluginmanager.register(guard, PLUGIN_NAME)
        return guard

    # -- which runs are checked -------------------------------------------------------

    def _roots(self) -> list[Path]:
        base = self.config.invocation_params.dir
        roots = []
        for arg in self.config.args:
            path = Path(arg.split("::", 1)[0])
            roots.append((path if path.is_absolute() else base / path).resolve())
        return roots

    def active(self) -> bool:
        """True when the collection roots include the whole tests folder."""
        if self.config.getoption("pyargs", False) or self.config.getoption("lf", False):
            return False
        return any(_covers(root, self.tests_dir) for root in self._roots())

    def _ignored(self, path: Path) -> bool:
        base = self.config.invocation_params.dir
        for ignored in self.config.getoption("ignore", None) or []:
            if _covers((base / ignored).resolve(), path):
                return True
        for pattern in self.config.getoption("ignore_glob", None) or []:
            pattern = str((base / pattern).absolute())
            if any(fnmatch.fnmatch(str(p), pattern) for p in (path, *path.parents)):
                return True
        return False

    # -- hooks ----------------------------------------------------------------------

    def pytest_itemcollected(self, item: pytest.Item) -> None:
        # Fires for every item as it is collected, before pytest_collection_modifyitems
        # (where -k/-m/--deselect drop items), so deselected files still count.
        self.collected.add(Path(item.path).resolve())

    @pytest.hookimpl(wrapper=True)
    def pytest_make_collect_report(self, collector: pytest.Collector):
        report = yield
        if report.outcome != "passed" and getattr(collector, "path", None) is not None:
            self.reported.add(Path(collector.path).resolve())
        return report

    def pytest_collection_finish(self, session: pytest.Session) -> None:
        if session.shouldstop or session.shouldfail or not self.active():
            return
        missing = self.missing()
        if missing:
            raise pytest.UsageError(self.message(missing))

    # -- the check --------------------------------------------------------------------

    def missing(self) -> list[Path]:
        return [
            path
            for path in find_test_files(self.tests_dir)
            if path not in self.collected
            and not any(_covers(r, path) for r in self.reported)
            and not self._ignored(path)
        ]

    def _why(self, path: Path) -> str:
        for folder in path.relative_to(self.tests_dir).parents:
            if str(folder) == ".":
                continue
            name = folder.name
            for pattern in self.config.getini("norecursedirs"):
                if fnmatch.fnmatch(name, pattern):
                    return (
                        f"folder {name!r} matches norecursedirs pattern {pattern!r}, "
                        "so pytest never looks inside it"
                    )
            if (self.tests_dir / folder / "pyvenv.cfg").exists():
                return f"folder {name!r} looks like a virtualenv (pyvenv.cfg), so pytest skips it"
        python_files = self.config.getini("python_files")
        if not any(fnmatch.fnmatch(path.name, pattern) for pattern in python_files):
            return f"file name does not match python_files {python_files}"
        return (
            "collected nothing: no test functions or classes under the "
            "python_functions/python_classes names"
        )

    def _show(self, path: Path) -> str:
        for base in (self.config.invocation_params.dir, self.config.rootpath):
            base = Path(base).resolve()
            if _covers(base, path):
                return path.relative_to(base).as_posix()
        return str(path)

    def message(self, missing: list[Path]) -> str:
        lines = [
            f"collection guard: {len(missing)} test file(s) under "
            f"{self._show(self.tests_dir)}/ contributed no collected test, silently:"
        ]
        lines += [f"  {self._show(p)}: {self._why(p)}" for p in missing]
        lines.append(
            "Rename the file or folder so pytest collects it, or adjust "
            "norecursedirs / python_files in [tool.pytest.ini_options] "
            "(pass --ignore=PATH to leave something out on purpose)."
        )
        return "\n".join(lines)
