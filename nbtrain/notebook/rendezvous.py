"""From the engines' reports to each rank's torchrun variables (pure functions).

Each engine reports its host and address (`engine_boot.probe`). Ranks follow the
launcher's ranks (MPI, Slurm) when every engine has one, else engine ids; LOCAL_RANK
counts the ranks of each host (the launcher's own local rank when it gives one);
MASTER_ADDR is rank 0's reported address unless the user names one. Nothing here
assumes that the ranks share a host.
"""

from __future__ import annotations


def assign_ranks(infos: list[dict]) -> list[dict]:
    """Engines in rank order: by launcher rank when every engine has one, else by id."""
    launcher_ranks = sorted(i["launcher_rank"] for i in infos if i["launcher_rank"] is not None)
    if launcher_ranks == list(range(len(infos))):
        return sorted(infos, key=lambda i: i["launcher_rank"])
    for info in infos:
        info["launcher_local_rank"] = None  # ranks follow engine ids; so do local ranks
    return sorted(infos, key=lambda i: i["engine_id"])


def master_address(ranks: list[dict], override: str | None = None) -> str:
    """The rendezvous address: `override`, else the address rank 0 reported."""
    return override or ranks[0]["address"]


def rank_envs(ranks: list[dict], master_addr: str, master_port: int) -> dict[int, dict]:
    """Per engine id, the torchrun variables of its rank.

    Also writes `rank`, `local_rank` and `local_world_size` into each info dict.
    """
    per_host: dict[str, int] = {}
    for info in ranks:
        per_host[info["host"]] = per_host.get(info["host"], 0) + 1
    counted: dict[str, int] = {}
    envs = {}
    for rank, info in enumerate(ranks):
        host = info["host"]
        local_rank = info.get("launcher_local_rank")
        if local_rank is None:
            local_rank = counted.get(host, 0)
        counted[host] = counted.get(host, 0) + 1
        info.update(rank=rank, local_rank=local_rank, local_world_size=per_host[host])
        envs[info["engine_id"]] = {
            "RANK": str(rank),
            "WORLD_SIZE": str(len(ranks)),
            "LOCAL_RANK": str(local_rank),
            "LOCAL_WORLD_SIZE": str(per_host[host]),
            "MASTER_ADDR": master_addr,
            "MASTER_PORT": str(master_port),
        }
    return envs
