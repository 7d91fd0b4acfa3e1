"""Ranks on two hosts, on one machine: two groups of engines that see themselves as hosts
"node-a" (127.0.0.2) and "node-b" (127.0.0.3), through a real nbtrain.Cluster.

On Linux all of 127.0.0.0/8 reaches this machine, so each group's address is reachable
by the other while nothing leaves loopback. The engines get `NBTRAIN_HOST` and
`NBTRAIN_ADDRESS` (what a user sets where the defaults guess wrong); everything else is
the code the notebook runs: ranks by engine id, LOCAL_RANK counted per host, MASTER_ADDR
rank 0's reported address, then ZeRO-3 training across both groups.
"""

import socket

import pytest

for _needed in ("IPython", "ipyparallel"):
    pytest.importorskip(_needed)
import torch

from nbtrain.notebook.cluster import Cluster
from nbtrain.notebook.launchers import engine_environment

HOSTS = (("node-a", "127.0.0.2"), ("node-b", "127.0.0.3"))
RANKS_PER_HOST = 2

TRAIN = """
import os
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Tanh(), torch.nn.Linear(7, 3))
sharded = nbt.wrap(model, zero_level=3)
opt = torch.optim.SGD(sharded.parameters(), lr=0.1)
g = torch.Generator().manual_seed(1)
losses = []
for step in range(3):
    x = torch.randn(4 * nbt.world_size(), 5, generator=g)[4 * nbt.rank():4 * (nbt.rank() + 1)]
    loss = sharded(x).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    losses.append(nbt.sum_loss(loss).item())
seen = {k: os.environ[k] for k in ("RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR")}
"""


def _reference_losses(world: int) -> list[float]:
    """One process on the concatenated batch: what data parallel must reproduce."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Tanh(), torch.nn.Linear(7, 3))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(3):
        loss = model(torch.randn(4 * world, 5, generator=g)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


class TwoHostCluster(Cluster):
    """Starts its engines in one group per pretend host."""

    def _start_engines(self, n: int) -> None:
        for host, addr in HOSTS:
            env = {**engine_environment("local"), "NBTRAIN_HOST": host, "NBTRAIN_ADDRESS": addr}
            self._ipp.start_engines_sync(n // len(HOSTS), environment=env)


def _loopback_aliases_work() -> bool:
    try:
        with socket.socket() as sock:
            sock.bind(("127.0.0.3", 0))
        return True
    except OSError:
        return False


@pytest.mark.timeout(240)
@pytest.mark.skipif(not _loopback_aliases_work(), reason="cannot bind 127.0.0.3 on this system")
def test_ranks_on_two_hosts_rendezvous_at_rank_0_and_train_together(tmp_path, monkeypatch):
    for var in ("IPYTHONDIR", "JUPYTER_RUNTIME_DIR"):  # nothing written under ~
        monkeypatch.setenv(var, str(tmp_path / var.lower()))
    world = RANKS_PER_HOST * len(HOSTS)
    cluster = TwoHostCluster(
        n=world, backend="gloo", start_timeout_s=120, profile_dir=str(tmp_path / "profile")
    )
    try:
        cluster.start()
        ranks = cluster.ranks
        assert sorted(r["host"] for r in ranks) == ["node-a"] * 2 + ["node-b"] * 2
        assert {r["host"]: r["address"] for r in ranks} == dict(HOSTS)
        assert all(r["local"] for r in ranks)  # same machine: liveness by pid still works
        # The rendezvous is rank 0's address, whichever pretend host rank 0 landed on.
        assert cluster.master_addr == ranks[0]["address"] != "127.0.0.1"

        cluster.execute(TRAIN)
        seen = cluster.pull("seen")
        assert [s["RANK"] for s in seen] == ["0", "1", "2", "3"]
        assert {s["MASTER_ADDR"] for s in seen} == {ranks[0]["address"]}
        for host, _ in HOSTS:
            local = sorted(s["LOCAL_RANK"] for s, r in zip(seen, ranks) if r["host"] == host)
            assert local == ["0", "1"], (host, seen)
        assert {s["LOCAL_WORLD_SIZE"] for s in seen} == {"2"}
        losses = cluster.pull("losses")
        assert all(ln == losses[0] for ln in losses)
        assert losses[0] == pytest.approx(_reference_losses(world), rel=1e-5, abs=1e-6)
        assert [row["host"] for row in cluster.status()] == [r["host"] for r in ranks]
    finally:
        cluster.stop()
