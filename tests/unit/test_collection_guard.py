"""The collection guard (tests/collection_guard.py) fails a run over tests/ that silently
leaves a test file out, and stays quiet otherwise.

Each case runs pytest in a subprocess on a small project in tmp_path whose
tests/conftest.py installs the same guard the real tests/conftest.py installs. The
project has its own pytest.ini, so pytest's default norecursedirs (which skip `dist`)
apply there, as they did to the old tests/dist/.
"""

from pathlib import Path

import pytest
from support import pytester
from support.pytester import write_project

TESTS_DIR = Path(__file__).resolve().parents[1]  # holds collection_guard.py

CONFTEST = f"""\
import sys
from pathlib import Path

sys.path.insert(0, {str(TESTS_DIR)!r})
from collection_guard import CollectionGuard


def pytest_configure(config):
    CollectionGuard.install(config, tests_dir=Path(__file__).resolve().parent)
"""


def make_project(root: Path, files: dict, ini: str = "[pytest]\n") -> Path:
    base = {"tests/conftest.py": CONFTEST, "tests/test_a.py": "def test_a():\n    pass\n"}
    return write_project(root, {**base, **files}, ini)


def run_pytest(root: Path, *args: str):
    return pytester.run_pytest(root, "-q", *args, timeout=120)


HIDDEN = {"tests/dist/test_hidden.py": "def test_hidden():\n    pass\n"}


def test_hidden_folder_fails_the_run_and_is_named(tmp_path):
    result = run_pytest(make_project(tmp_path, HIDDEN), "tests")
    out = result.stdout + result.stderr
    assert result.returncode == pytest.ExitCode.USAGE_ERROR, out
    assert "tests/dist/test_hidden.py" in out
    assert "norecursedirs" in out and "test_a.py" not in out.split("collection guard")[1]


def test_control_tree_passes(tmp_path):
    result = run_pytest(make_project(tmp_path, {}), "tests")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "collection guard" not in result.stdout + result.stderr


def test_no_arguments_uses_the_invocation_folder(tmp_path):
    """`cd tests && pytest` covers the whole folder too."""
    make_project(tmp_path, HIDDEN)
    result = run_pytest(tmp_path / "tests")
    assert result.returncode == pytest.ExitCode.USAGE_ERROR, result.stdout + result.stderr
    assert "dist/test_hidden.py" in result.stderr


@pytest.mark.parametrize(
    "args",
    [
        ["tests/test_a.py"],
        ["tests/test_a.py::test_a"],
        ["tests", "--ignore=tests/dist"],
        ["tests", "--ignore-glob=*/dist/*"],
    ],
    ids=["file", "node-id", "ignore", "ignore-glob"],
)
def test_runs_not_covering_the_folder_are_not_checked(tmp_path, args):
    result = run_pytest(make_project(tmp_path, HIDDEN), *args)
    assert result.returncode == 0, result.stdout + result.stderr


def test_deselected_and_skipped_files_count_as_collected(tmp_path):
    files = {
        "tests/test_gpu.py": "import pytest\n\n@pytest.mark.gpu\ndef test_g():\n    pass\n",
        "tests/sub/test_skipped_module.py": "import pytest\npytest.skip('not here', allow_module_level=True)\n",
        "tests/sub/test_skipped_at_runtime.py": "import pytest\n\ndef test_s():\n    pytest.skip('later')\n",
    }
    root = make_project(tmp_path, files, ini="[pytest]\nmarkers = gpu: gpu\n")
    for args in (["-m", "gpu"], ["-m", "not gpu"], ["-k", "nothing_matches"]):
        result = run_pytest(root, "tests", *args)
        out = result.stdout + result.stderr
        assert "collection guard" not in out, (args, out)
        assert result.returncode in (0, pytest.ExitCode.NO_TESTS_COLLECTED), (args, out)


def test_deselecting_does_not_hide_a_missing_file(tmp_path):
    result = run_pytest(make_project(tmp_path, HIDDEN), "tests", "-m", "gpu")
    assert result.returncode == pytest.ExitCode.USAGE_ERROR, result.stdout + result.stderr


@pytest.mark.parametrize(
    "files,ini,named",
    [
        (
            {"tests/x_test.py": "def test_x():\n    pass\n"},
            "[pytest]\npython_files = test_*.py\n",
            "tests/x_test.py",
        ),
        (
            {"tests/.cache/test_dot.py": "def test_d():\n    pass\n"},
            "[pytest]\n",
            "tests/.cache/test_dot.py",
        ),
        (
            {"tests/build/test_built.py": "def test_b():\n    pass\n"},
            "[pytest]\n",
            "tests/build/test_built.py",
        ),
        ({"tests/test_empty.py": "def helper():\n    pass\n"}, "[pytest]\n", "tests/test_empty.py"),
    ],
    ids=["python_files", "dot-folder", "build-folder", "no-tests"],
)
def test_other_silent_cases_are_named(tmp_path, files, ini, named):
    result = run_pytest(make_project(tmp_path, files, ini), "tests")
    assert result.returncode == pytest.ExitCode.USAGE_ERROR, result.stdout + result.stderr
    assert named in result.stderr


def test_jupyter_checkpoint_copies_are_exempt(tmp_path):
    files = {"tests/.ipynb_checkpoints/test_a-checkpoint.py": "def test_a():\n    pass\n"}
    result = run_pytest(make_project(tmp_path, files), "tests")
    assert result.returncode == 0, result.stdout + result.stderr
