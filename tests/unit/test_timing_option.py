"""`--timing` (tests/timing.py) is a flag: the path after it is a test to run, never a
file to write the table into (it once took `tests/notebook/test_slurm.py` for its JSON
path and overwrote the module); the JSON goes to `--timing-json PATH` only.

Each case runs pytest in a subprocess on a small project in tmp_path whose conftest
installs the timing plugin as tests/conftest.py does.
"""

import json
from pathlib import Path

from support import pytester

TESTS_DIR = Path(__file__).resolve().parents[1]  # holds timing.py

CONFTEST = f"""\
import sys

sys.path.insert(0, {str(TESTS_DIR)!r})
import timing


def pytest_addoption(parser):
    timing.pytest_addoption(parser)


def pytest_configure(config):
    timing.install(config)
"""

SLEEPY = """\
import time


def test_sleeps():
    time.sleep(0.2)
"""


def run_pytest(root: Path, *args: str):
    return pytester.run_pytest(root, "-q", *args, timeout=120)


def project(root: Path) -> Path:
    (root / "pytest.ini").write_text("[pytest]\n")
    (root / "conftest.py").write_text(CONFTEST)
    test = root / "test_sleepy.py"
    test.write_text(SLEEPY)
    return test


def test_the_path_after_timing_is_run_and_left_alone(tmp_path):
    test = project(tmp_path)
    result = run_pytest(tmp_path, "--timing", "test_sleepy.py")
    out = result.stdout + result.stderr
    assert result.returncode == 0, out
    assert test.read_text() == SLEEPY  # not overwritten
    assert "1 passed" in out, out
    assert "| test_sleepy.py::test_sleeps |" in out, out  # the slowest-tests table


def test_timing_json_writes_each_test_row(tmp_path):
    project(tmp_path)
    path = tmp_path / "rows.json"
    result = run_pytest(tmp_path, "--timing", "--timing-json", str(path), "test_sleepy.py")
    assert result.returncode == 0, result.stdout + result.stderr
    row = json.loads(path.read_text())["test_sleepy.py::test_sleeps"]
    assert row["wait"] >= 0.2 and row["total"] >= row["wait"], row  # the sleep counted as wait


def test_a_timing_json_path_that_is_not_json_is_refused(tmp_path):
    test = project(tmp_path)
    result = run_pytest(tmp_path, "--timing", "--timing-json", "test_sleepy.py", "test_sleepy.py")
    out = result.stdout + result.stderr
    assert result.returncode != 0, out
    assert "--timing-json test_sleepy.py: the path must end in .json" in out, out
    assert test.read_text() == SLEEPY
