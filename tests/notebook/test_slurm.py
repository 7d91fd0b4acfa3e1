"""The Slurm launcher for real: a single-host Slurm cluster (slurm_cluster.py), brought up
once for this module, and `%nbtrain start --launcher slurm` through it.

A Slurm start is a job submitted, scheduled (1 s) and launched, and two engines importing
torch: about 5 s on an idle 2-core machine, several times that under the suite's four
workers, and a clean stop 1-9 s more (Slurm signals, then kills after 5 s). The training
test and the cancelled-job test share one started cluster (`slurm_ranks`); the test that
waits in the queue needs a job of its own, and its clean stop is the module's check that
stopping a running Slurm cluster leaves nothing.

Skipped, with the reason printed, only where Slurm is missing and apt-get cannot
install slurm-wlm and munge (or this is not root, which slurmd needs).
"""

import os
import re
import signal
import threading
import time

import psutil
import pytest

for _needed in ("IPython", "ipyparallel"):
    pytest.importorskip(_needed)
from IPython.core.error import UsageError
from IPython.utils.capture import capture_output
from procs import wait_gone
from slurm_cluster import install, running

from nbtrain import RankDiedError
from nbtrain.notebook import magics
from nbtrain.notebook.slurm import SlurmError
from nbtrain.notebook.watchdog import Watchdog

pytestmark = pytest.mark.timeout(600)  # the first test's setup may install Slurm with apt

TRAIN = """
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
g = torch.Generator().manual_seed(100 + nbt.rank())
for step in range(4):
    x = torch.randn(4, 6, generator=g)
    loss = model(x).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    for p in model.parameters():
        torch.distributed.all_reduce(p.grad, op=torch.distributed.ReduceOp.AVG)
    opt.step()
    mean = loss.detach().clone()
    torch.distributed.all_reduce(mean, op=torch.distributed.ReduceOp.AVG)
    print(f"step {step} loss {mean.item():.7f}")
"""


@pytest.fixture(scope="module")
def slurm(request):
    reason = install()
    if reason:
        capture = request.config.pluginmanager.get_plugin("capturemanager")
        with capture.global_and_fixture_disabled():
            print(f"\nSKIP the real-Slurm tests: {reason}")
        pytest.skip(reason)
    with running() as cluster:
        yield cluster


@pytest.fixture(scope="module")
def slurm_ranks(ipython, slurm):
    """`%nbtrain start -n 2 --launcher slurm`, started once for the tests that only run
    cells on it: its printed output, the seconds it took and the cluster. Its last user,
    the cancelled-job test, ends it; whoever runs alone is stopped here, checked like any
    stop."""
    out, seconds = start(ipython, "-n 2 --launcher slurm --start-timeout-s 90")
    cluster = magics.current_cluster()
    yield out, seconds, cluster
    if cluster is not None and magics.current_cluster() is cluster:
        stop_and_check_gone(ipython, slurm)


def start(ipython, line):
    """`%nbtrain start LINE`: its printed output and the seconds it took."""
    began = time.monotonic()
    with capture_output() as cap:
        ipython.run_line_magic("nbtrain", f"start {line}")
    return cap.stdout + cap.stderr, time.monotonic() - began


def sleeper(slurm, seconds, *options):
    """Submits a job that sleeps; returns its id."""
    return slurm.run(
        "sbatch", "--output=/dev/null", "--parsable", *options, "--wrap", f"sleep {seconds}"
    ).stdout.strip()


def our_engines_and_controllers() -> list[int]:
    """Pids of the ipyparallel processes started by this test session (its IPYTHONDIR)."""
    found = []
    for proc in psutil.process_iter(["cmdline"]):
        try:
            if (
                "ipyparallel" in " ".join(proc.info["cmdline"] or [])
                and proc.environ().get("IPYTHONDIR") == os.environ["IPYTHONDIR"]
            ):
                found.append(proc.pid)
        except psutil.Error:
            pass
    return found


def stop_and_check_gone(ipython, slurm):
    """`%nbtrain stop`: the job is cancelled by id and no process of it remains."""
    cluster = magics.current_cluster()
    job_id = cluster.job.job_id if cluster.job is not None else None
    pids = cluster.pids() + [r["pid"] for r in cluster.ranks]
    ipython.run_line_magic("nbtrain", "stop")
    assert wait_gone(pids) == []
    if job_id is not None:
        assert slurm.run("squeue", "-h", "-j", job_id, "-t", "PD,R,CG").stdout.strip() == ""
        steps = [
            p.pid
            for p in psutil.process_iter(["cmdline"])
            if f"[{job_id}." in " ".join(p.info["cmdline"] or [])
        ]
        assert wait_gone(steps) == []  # slurmstepd of the job's steps ended too


def test_slurm_ranks_train_like_local_ranks(ipython, slurm, capsys, request):
    _, local_s = start(ipython, "-n 2 --start-timeout-s 90")
    local = magics.current_cluster().execute(TRAIN).stdout
    stop_and_check_gone(ipython, slurm)

    # Started only now, with the local cluster gone. This test leaves it running for
    # the cancelled-job test; that stopping a running Slurm cluster leaves nothing is
    # checked at the end of the waiting-in-the-queue test.
    out, slurm_s, cluster = request.getfixturevalue("slurm_ranks")
    assert magics.current_cluster() is cluster
    job_id = cluster.job.job_id
    assert f"Slurm job {job_id}" in out, out
    assert [r["node"] for r in cluster.ranks] == [slurm.node, slurm.node]
    assert [r["local_rank"] for r in cluster.ranks] == [0, 1]  # SLURM_LOCALID
    assert cluster.master_addr == cluster.ranks[0]["address"] == "127.0.0.1"
    assert cluster.execute(TRAIN).stdout == local  # same losses, step by step, on each rank
    with capture_output() as cap:
        ipython.run_line_magic("nbtrain", "status")
    assert re.search(rf"Slurm job {job_id} RUNNING on {slurm.node}\b", cap.stdout), cap.stdout
    assert cap.stdout.count(slurm.node) >= 3  # the job line and one row per rank
    with capsys.disabled():
        print(
            f"\nstart-until-ready: local {local_s:.1f} s, slurm {slurm_s:.1f} s "
            f"(slurm / local = {slurm_s / local_s:.2f})"
        )


def test_a_job_cancelled_from_outside_is_reported_as_rank_died(ipython, slurm, slurm_ranks):
    _, _, cluster = slurm_ranks  # the training test's cluster, or a fresh one
    assert magics.current_cluster() is cluster and cluster.job.running(max_age_s=0)
    job_id = cluster.job.job_id
    cancelled = []

    def scancel():
        time.sleep(2)
        cancelled.append(time.monotonic())
        slurm.run("scancel", job_id)

    threading.Thread(target=scancel, daemon=True).start()
    try:
        with pytest.raises(RankDiedError) as info:
            cluster.execute("import time\nfor _ in range(600):\n    time.sleep(0.1)")
        assert time.monotonic() - cancelled[0] < 10
        assert info.value.ranks == [0, 1]
        assert str(info.value).startswith("rank 0, rank 1 died")
    finally:
        stop_and_check_gone(ipython, slurm)


def test_waiting_in_the_queue_is_shown_and_not_counted_against_the_timeout(ipython, slurm):
    # Another job holds the only node until our job has waited in the queue longer than
    # the start timeout; the engines then get the whole timeout to register and boot
    # (a fixed 16 s blocker against a 12 s timeout left the engines too little of it
    # on a loaded machine: their first task imports torch).
    timeout_s = 20
    blocker = sleeper(slurm, 300, "--exclusive")
    deadline = time.monotonic() + 20
    while "RUNNING" not in slurm.run("squeue", "-h", "-j", blocker, "-o", "%T").stdout:
        assert time.monotonic() < deadline, "the blocking job did not start"
        time.sleep(0.3)
    done = threading.Event()

    def release_the_node():
        seen = None
        while not done.wait(0.3):
            ours = slurm.run("squeue", "-h", "-t", "PD", "-o", "%i").stdout.split()
            if seen is None and ours:
                seen = time.monotonic()
            if seen is not None and time.monotonic() - seen > timeout_s + 2:
                slurm.run("scancel", blocker)
                return

    threading.Thread(target=release_the_node, daemon=True).start()
    try:
        out, _ = start(ipython, f"-n 2 --launcher slurm --start-timeout-s {timeout_s}")
        assert re.search(
            r"Slurm job \d+ PENDING \((Resources|Priority)\): waiting in the "
            r"queue",
            out,
        ), out
        queued = re.search(r"Slurm job \d+ RUNNING on \S+ after (\d+) s in the queue", out)
        assert queued and int(queued.group(1)) > timeout_s, out  # longer, and it started
        assert magics.current_cluster().world_size == 2
        # The module's check that `%nbtrain stop` of a running Slurm cluster cancels
        # its job and leaves no process (the training test hands its cluster on).
        stop_and_check_gone(ipython, slurm)
    finally:
        done.set()
        slurm.run("scancel", blocker)
        if magics.current_cluster() is not None:
            stop_and_check_gone(ipython, slurm)


def test_interrupting_the_wait_in_the_queue_cancels_the_job(ipython, slurm):
    blocker = sleeper(slurm, 60, "--exclusive")
    done = threading.Event()

    def stop_button():
        # Pressed once the blocker runs and Slurm has left our job waiting behind it
        # (reason Resources): the start is then waiting in the queue. A fixed 4 s timer
        # waited 2 s longer than that, and on a loaded machine could fire before the job
        # was submitted.
        deadline = time.monotonic() + 60
        while not done.wait(0.2) and time.monotonic() < deadline:
            rows = slurm.run("squeue", "-h", "-o", "%i|%T|%r").stdout.splitlines()
            jobs = {job: (state, why) for job, state, why in (r.split("|", 2) for r in rows)}
            ours = [why for job, (_, why) in jobs.items() if job != blocker]
            running = jobs.get(blocker, ("",))[0] == "RUNNING"
            if running and ours and ours[0] in ("Resources", "Priority") and not done.is_set():
                os.kill(os.getpid(), signal.SIGINT)
                return

    threading.Thread(target=stop_button, daemon=True).start()
    try:
        with pytest.raises(KeyboardInterrupt):
            ipython.run_line_magic("nbtrain", "start -n 2 --launcher slurm --start-timeout-s 60")
        assert magics.current_cluster() is None
        assert wait_gone(our_engines_and_controllers()) == []
        jobs = slurm.run("squeue", "-h", "-t", "PD,R", "-o", "%i").stdout.split()
        assert jobs == [blocker]  # ours was cancelled; the other job runs on
    finally:
        done.set()
        slurm.run("scancel", blocker)
        if magics.current_cluster() is not None:  # the interrupt never arrived
            stop_and_check_gone(ipython, slurm)


# Slurm first says PartitionConfig for a request over the partition's limits, and the
# precise limit once the scheduler has looked at it: either is Slurm's own reason.
@pytest.mark.parametrize(
    "flags, reason",
    [
        ("--partition nope", "invalid partition specified: nope"),
        ("--gpus-per-node 1", "Invalid generic resource"),
        ("--nodes 2", "can never start: Slurm's reason is Partition(NodeLimit|Config)"),
        (
            "--partition short --time 5",
            "can never start: Slurm's reason is Partition(TimeLimit|Config)",
        ),
    ],
    ids=["unknown-partition", "no-gpus", "too-many-nodes", "over-time-limit"],
)
def test_a_job_that_cannot_start_fails_at_once_with_slurms_reason(ipython, slurm, flags, reason):
    n = 2 if "--nodes 2" in flags else 1
    began = time.monotonic()
    with pytest.raises(SlurmError, match=reason):
        ipython.run_line_magic(
            "nbtrain", f"start -n {n} --launcher slurm --start-timeout-s 60 {flags}"
        )
    assert time.monotonic() - began < 20  # not the start timeout, let alone forever
    assert magics.current_cluster() is None
    assert wait_gone(our_engines_and_controllers()) == []  # the controller's children too
    assert slurm.run("squeue", "-h", "-t", "PD,R", "-o", "%i").stdout.strip() == ""


def test_a_wrong_n_is_refused_before_submitting(ipython, slurm):
    before = slurm.run("squeue", "-h", "-o", "%i").stdout
    with pytest.raises(UsageError, match=r"-n 4 does not match .* \(2 x 1 = 2\)"):
        ipython.run_line_magic(
            "nbtrain", "start -n 4 --launcher slurm --nodes 2 --ntasks-per-node 1"
        )
    assert slurm.run("squeue", "-h", "-o", "%i").stdout == before  # nothing submitted


def test_the_watchdog_cancels_the_job_when_the_notebook_dies(slurm):
    job = sleeper(slurm, 120)
    watchdog = Watchdog()
    watchdog.watch_job(job)
    watchdog.proc.stdin.close()  # what a killed kernel leaves: end of file, no "stop"
    watchdog.proc.wait(timeout=30)
    deadline = time.monotonic() + 15
    while slurm.run("squeue", "-h", "-j", job, "-t", "PD,R").stdout.strip():
        assert time.monotonic() < deadline, f"job {job} still queued or running"
        time.sleep(0.3)
