"""The state guard (tests/state_guard.py) fails a module that leaves process-wide state
behind, names each thing, and puts it back so the next module starts clean; the
module order option (tests/module_order.py) reorders whole modules.

Each case runs pytest in a subprocess on a small project in tmp_path whose conftest
installs the same plugins the real tests/conftest.py installs.
"""

import re
from pathlib import Path

import pytest
from support import pytester
from support.pytester import write_project

TESTS_DIR = Path(__file__).resolve().parents[1]  # holds state_guard.py, module_order.py

CONFTEST = f"""\
import sys

sys.path.insert(0, {str(TESTS_DIR)!r})
import module_order
from module_order import (pytest_addoption, pytest_collection_modifyitems, pytest_report_header,
                          pytest_terminal_summary)
from state_guard import StateGuard


def pytest_configure(config):
    StateGuard.install(config)
    module_order.configure(config)
"""

# Written to leak: every kind of state the guard watches.
LEAKY = """\
import os
import signal
import subprocess
import sys
import threading

import torch.distributed as dist

import nbtrain


def test_leaks_everything():
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    os.environ["NBTRAIN_LEAKED"] = "yes"
    stop = threading.Event()
    threading.Thread(target=stop.wait, name="leaky-thread", daemon=True).start()
    subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    nbtrain.init_distributed()  # a world of one: the default group and the context
    nbtrain.telemetry.set_enabled(False)
"""

# Runs after the leaky module: sees what a fresh process would.
CLEAN_AFTER = """\
import os
import signal

import torch.distributed as dist


def test_starts_clean():
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    assert "NBTRAIN_LEAKED" not in os.environ
    assert not dist.is_initialized()
    import nbtrain

    assert nbtrain.comm.events.HUB.enabled
"""

TIDY = """\
import os
import threading
import subprocess
import sys

import nbtrain


def test_cleans_up_after_itself(monkeypatch):
    monkeypatch.setenv("NBTRAIN_TIDY", "1")
    thread = threading.Thread(target=lambda: None)
    thread.start()
    thread.join()
    subprocess.run([sys.executable, "-c", "pass"], check=True)
    nbtrain.init_distributed()
    nbtrain.comm.shutdown()
"""


def make_project(root: Path, files: dict) -> Path:
    return write_project(root, {"tests/conftest.py": CONFTEST, **files})


def run_pytest(root: Path, *args: str):
    # The leaking module's thread and child never end: wait 1 s for each, not 10.
    return pytester.run_pytest(root, *args, NBTRAIN_STATE_GRACE_S="1")


def test_a_leaking_module_fails_naming_each_leftover_and_the_next_starts_clean(tmp_path):
    root = make_project(
        tmp_path, {"tests/test_a_leaky.py": LEAKY, "tests/test_b_after.py": CLEAN_AFTER}
    )
    result = run_pytest(root, "-q", "tests")
    out = result.stdout + result.stderr
    assert result.returncode == pytest.ExitCode.TESTS_FAILED, out
    # The leaky test itself passed, and so did the module after it: everything was put back.
    assert re.search(r"\b2 passed, 1 error\b", out), out
    assert "ERROR at teardown of test_leaks_everything" in out, out
    assert "tests/test_a_leaky.py left process-wide state behind" in out
    for leftover in (
        "the SIGINT handler is <Handlers.SIG_IGN",
        "environment variable NBTRAIN_LEAKED='yes' was set",
        "thread 'leaky-thread' still running",
        "child process",
        "time.sleep(600)",
        "torch.distributed's default group is still initialised (backend gloo",
        "nbtrain's context is still set",
        "nbtrain's events are switched off (telemetry.set_enabled(False))",
    ):
        assert leftover in out, (leftover, out)


def test_a_module_that_cleans_up_passes(tmp_path):
    root = make_project(tmp_path, {"tests/test_tidy.py": TIDY})
    result = run_pytest(root, "-q", "tests")
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize(
    "order, expected",
    [
        ("written", ["a", "b", "c"]),
        ("reverse", ["c", "b", "a"]),
    ],
)
def test_module_order_moves_whole_modules(tmp_path, order, expected):
    files = {
        f"tests/test_{m}.py": f"def test_{m}1():\n    pass\n\n\ndef test_{m}2():\n    pass\n"
        for m in "abc"
    }
    result = run_pytest(make_project(tmp_path, files), "-v", f"--module-order={order}", "tests")
    ran = re.findall(r"test_([abc])\.py::test_\w(\d)", result.stdout)
    assert ran == [(m, i) for m in expected for i in "12"], result.stdout


@pytest.mark.parametrize("workers", [None, "1"], ids=["one-process", "xdist"])
def test_the_longest_modules_go_first(tmp_path, workers):
    """`longest`, tests/run.sh's order: by tests/module_seconds.json, unknown modules last
    in written order; under xdist too, with its own reorder (most tests first) off."""
    pytest.importorskip("xdist")
    files = {
        f"tests/test_{m}.py": f"def test_{m}1():\n    pass\n\n\ndef test_{m}2():\n    pass\n"
        for m in "abcd"
    }
    files["tests/test_a.py"] += "\n\ndef test_a3():\n    pass\n"  # most tests, 0 s
    seconds = tmp_path / "seconds.json"
    seconds.write_text('{"tests/test_c.py": 9.0, "tests/test_b.py": 5.0}')
    args = ["-v", "--module-order=longest", "tests"]
    if workers:  # without --no-loadscope-reorder xdist runs a, c, b, d
        args = ["-p", "xdist", "-n", workers, "--dist", "loadfile", "--no-loadscope-reorder"] + args
    result = pytester.run_pytest(
        make_project(tmp_path, files), *args, NBTRAIN_TEST_MODULE_SECONDS=str(seconds)
    )
    assert result.returncode == 0, result.stdout + result.stderr
    ran = re.findall(r"test_([abcd])\.py::test_\w\d", result.stdout)
    order = [m for i, m in enumerate(ran) if m not in ran[:i]]
    assert order == ["c", "b", "a", "d"], result.stdout


def test_a_random_order_is_seeded_and_printed(tmp_path):
    files = {f"tests/test_{m}.py": f"def test_{m}():\n    pass\n" for m in "abcdefgh"}
    root = make_project(tmp_path, files)

    def order(*args):
        result = run_pytest(root, "-v", *args, "tests")
        return result.stdout, re.findall(r"test_(\w)\.py::", result.stdout)

    out, first = order("--module-order=random")
    seed = re.search(r"module order: random \(again: --module-order=random:(\d+)\)", out).group(1)
    quiet = run_pytest(root, "-q", f"--module-order=random:{seed}", "tests").stdout
    assert quiet.strip().splitlines()[-2] == (  # -q hides the header: it ends the run too
        f"module order: random (again: --module-order=random:{seed})"
    ), quiet
    _, again = order(f"--module-order=random:{seed}")
    assert again == first and sorted(first) == list("abcdefgh")
    shuffled = {tuple(order(f"--module-order=random:{s}")[1]) for s in (1, 2, 3)}
    assert len(shuffled) > 1


def test_a_bad_module_order_is_a_usage_error(tmp_path):
    result = run_pytest(
        make_project(tmp_path, {"tests/test_a.py": "def test_a():\n    pass\n"}),
        "--module-order=backwards",
        "tests",
    )
    assert result.returncode == pytest.ExitCode.USAGE_ERROR
    assert "--module-order 'backwards': use written, reverse, random" in result.stderr
