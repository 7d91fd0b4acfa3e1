"""tutorials/conftest.py gives each pytest process an IPython home of its own.

pytest-xdist's workers inherit the environment of the process that starts them, which
has imported the conftest too. When the conftest kept an IPYTHONDIR it found set, both
workers used that one home, and its teardown (stop the clusters a failed notebook left
under $IPYTHONDIR) in one worker stopped the cluster of the notebook running in the
other: `pytest -n 2 tutorials` failed 16 cells of three notebooks (engines gone at
`%nbtrain start`, a rank dead in the middle of a cell).
"""

import json
from pathlib import Path

import pytest
from support.pytester import run_pytest, write_project

REPO = Path(__file__).resolve().parents[2]

RECORD = """\
import json, os, time


def test_records_its_home():
    time.sleep(1)  # long enough that both workers take a module
    with open({path!r}, "w") as f:
        json.dump([os.environ["PYTEST_XDIST_WORKER"], os.environ["IPYTHONDIR"]], f)
"""


def test_each_xdist_worker_has_a_home_of_its_own(tmp_path):
    pytest.importorskip("xdist")
    files = {"conftest.py": (REPO / "tutorials" / "conftest.py").read_text()}
    for m in "abcd":
        files[f"test_{m}.py"] = RECORD.format(path=str(tmp_path / f"{m}.json"))
    result = run_pytest(write_project(tmp_path, files), "-q", "-p", "xdist", "-n", "2")
    assert result.returncode == 0, result.stdout + result.stderr
    homes = {}
    for m in "abcd":
        worker, home = json.loads((tmp_path / f"{m}.json").read_text())
        homes.setdefault(worker, set()).add(home)
    assert len(homes) == 2, homes  # both workers ran modules
    assert all(len(h) == 1 for h in homes.values()), homes  # one home per process
    first, second = homes.values()
    assert first != second, homes
