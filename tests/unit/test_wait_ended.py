"""nbtrain.notebook.procs.wait_ended, what Cluster.stop waits with: a process of ours is
reaped, an orphan that was killed counts as ended at once (a zombie only its parent,
init, can reap: this machine's init took 1.3 s, psutil.wait_procs waited for it), and a
process still running is returned once the time is up."""

import subprocess
import sys
import time

import psutil

from nbtrain.notebook.procs import wait_ended

SLEEP = [sys.executable, "-c", "import time; time.sleep(60)"]


def test_a_child_of_ours_is_reaped():
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    proc = psutil.Process(child.pid)
    assert wait_ended([proc], 30) == []
    assert not psutil.pid_exists(child.pid)  # reaped: no zombie left behind


def test_a_killed_orphan_counts_as_ended_at_once():
    parent = subprocess.Popen(
        [sys.executable, "-c", f"import subprocess; print(subprocess.Popen({SLEEP!r}).pid)"],
        stdout=subprocess.PIPE,
        text=True,
    )
    orphan = psutil.Process(int(parent.stdout.readline()))
    parent.wait()
    orphan.kill()
    began = time.monotonic()
    assert wait_ended([orphan], 10) == []
    assert time.monotonic() - began < 0.5


def test_a_running_process_is_returned_when_the_time_is_up():
    child = subprocess.Popen(SLEEP)
    try:
        proc = psutil.Process(child.pid)
        began = time.monotonic()
        assert wait_ended([proc], 0.3) == [proc]
        assert 0.3 <= time.monotonic() - began < 2
    finally:
        child.kill()
        child.wait()
