"""No listener on a wildcard address: ranks started as a notebook cluster starts them
(the torchrun variables, MASTER_ADDR on loopback) listen on loopback only; the
rendezvous store, which torch's env:// rendezvous binds to every interface, included."""

import subprocess
import sys
import textwrap

from support import script_env
from support.listeners import WILDCARDS

from nbtrain.notebook.engine_boot import free_port

RANK_SCRIPT = textwrap.dedent("""
    import os
    import torch
    import nbtrain as nbt
    from support.listeners import listening
    nbt.init_distributed()
    x = torch.ones(1)
    nbt.comm.collectives.all_reduce(x, label="probe")  # the group's connections are up
    # one file per rank: two ranks printing to one pipe interleave their lines
    out = os.path.join(os.environ["LISTEN_OUT"], f"rank{os.environ['RANK']}.txt")
    with open(out, "w") as f:
        f.write(repr(sorted(listening(os.getpid()))))
    nbt.synchronize()
    nbt.comm.shutdown()
""")


def _seen(folder):
    """Each rank's listening addresses, in rank order."""
    return [
        eval((folder / f"rank{r}.txt").read_text())
        for r in range(2)
        if (folder / f"rank{r}.txt").exists()
    ]


def test_ranks_listen_on_loopback_only(tmp_path):
    script = tmp_path / "rank.py"
    script.write_text(RANK_SCRIPT)
    port = free_port()
    procs = []
    for rank in range(2):
        env = {
            **script_env(),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "WORLD_SIZE": "2",
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "CUDA_VISIBLE_DEVICES": "",
            "LISTEN_OUT": str(tmp_path),
        }
        procs.append(
            subprocess.Popen(
                [sys.executable, str(script)],
                env=env,
                text=True,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
            )
        )
    outputs = []
    try:
        for p in procs:
            outputs.append(p.communicate(timeout=120)[0])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    assert all(p.returncode == 0 for p in procs), outputs
    seen = _seen(tmp_path)
    assert len(seen) == 2, outputs
    assert ("127.0.0.1", port) in seen[0], seen  # rank 0 serves the store, on loopback
    wild = [s for rank_seen in seen for s in rank_seen if s[0] in WILDCARDS]
    assert not wild, f"listening on a wildcard address: {wild}"


def test_ranks_under_torchrun_listen_on_no_wildcard_address(tmp_path):
    """Under torchrun the ranks use torchrun's own store (its agent binds it to every
    interface: torch's, outside nbtrain; the README says so); the ranks themselves open
    nothing on a wildcard address."""
    script = tmp_path / "rank.py"
    script.write_text(RANK_SCRIPT)
    env = script_env(CUDA_VISIBLE_DEVICES="", LISTEN_OUT=str(tmp_path))
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nnodes",
            "1",
            "--nproc-per-node",
            "2",
            "--master-addr",
            "127.0.0.1",
            "--master-port",
            str(free_port()),
            str(script),
        ],
        capture_output=True,
        text=True,
        timeout=180,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    seen = _seen(tmp_path)
    assert len(seen) == 2, proc.stdout
    wild = [s for rank_seen in seen for s in rank_seen if s[0] in WILDCARDS]
    assert not wild, f"a rank listens on a wildcard address: {wild}"
