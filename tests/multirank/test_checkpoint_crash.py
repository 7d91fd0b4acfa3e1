"""A rank killed (SIGKILL, by PID) in the middle of save_checkpoint leaves the previous
checkpoint loadable and intact.

The victim rank pauses just before one of the save's renames (this test replaces
`os.replace` inside the rank process), reports its PID through a marker file, and
the test kills that PID. Its peer fails in the save's next collective; the test reaps it by handle.
"""

import os
import signal
import tempfile
import time

import optim_cases as oc
import torch
from support.ranks import run_ranks

import nbtrain as nbt
from nbtrain.launch import spawn_ranks

WORLD = 2
FIRST_STEPS = 3


def _setup():
    return oc.sharded_setup(loss_scale=2.0**12, scheduler=True)


def _snapshot(model, opt, manager):
    return dict(
        state=model.state_dict(),
        shards=oc.shard_snapshot(opt),
        manager=manager.scalar_state(),
        lr=opt.param_groups[0]["lr"],
    )


def _initial(folder):
    model, opt, manager = _setup()
    oc.sharded_train(model, manager, FIRST_STEPS, total=10)
    nbt.save_checkpoint(model, folder, manager, step=FIRST_STEPS)
    return _snapshot(model, opt, manager)


def _crash_save(folder, victim, stage, marker):
    model, opt, manager = _setup()
    meta = nbt.load_checkpoint(model, folder, manager)
    oc.sharded_train(model, manager, 2, start=meta["step"], total=10)  # now differs

    real_replace = os.replace

    def pause_before_rename(src, dst):
        name = os.path.basename(dst)
        where = (
            "meta" if name == "meta.json" else "shard" if name.endswith(".safetensors") else None
        )
        if where == stage and nbt.rank() == victim:
            with open(marker + ".tmp", "w") as f:
                f.write(str(os.getpid()))
            real_replace(marker + ".tmp", marker)
            time.sleep(120)  # the test kills this process long before
        real_replace(src, dst)

    os.replace = pause_before_rename  # in this rank's process only
    nbt.save_checkpoint(model, folder, manager, step=meta["step"] + 2)
    return "saved"  # never reached on the victim


def _verify(folder):
    model, opt, manager = _setup()
    meta = nbt.load_checkpoint(model, folder, manager)
    out = dict(meta=meta, **_snapshot(model, opt, manager))
    nbt.save_checkpoint(model, folder, manager, step=meta["step"])  # cleans leftovers
    return out


def _kill_during_save(folder, victim, stage):
    with tempfile.TemporaryDirectory(prefix="nbtrain-crash-") as tmp:
        marker = os.path.join(tmp, "victim.pid")
        procs, _ = spawn_ranks(
            _crash_save,
            WORLD,
            folder,
            victim,
            stage,
            marker,
            init_file=os.path.join(tmp, "rendezvous"),
            pg_timeout_s=30.0,
        )
        try:
            deadline = time.monotonic() + 90
            while not os.path.exists(marker):
                assert time.monotonic() < deadline, "the victim never reached the save hook"
                assert all(p.is_alive() for p in procs), "a rank ended before the save hook"
                time.sleep(0.05)
            with open(marker) as f:
                pid = int(f.read())
            assert pid == procs[victim].pid
            os.kill(pid, signal.SIGKILL)
            procs[victim].join(timeout=10)
            assert procs[victim].exitcode == -signal.SIGKILL
            survivors = [p for r, p in enumerate(procs) if r != victim]
            for p in survivors:
                p.join(timeout=60)  # fails in the save's next collective
            return [p.exitcode for p in survivors]
        finally:
            for p in procs:
                if p.is_alive():
                    p.kill()
                p.join()


def _versions(folder):
    return sorted(n for n in os.listdir(folder) if n.startswith("v-"))


def test_killed_rank_leaves_previous_checkpoint_intact(tmp_path):
    folder = str(tmp_path / "ckpt")
    before = run_ranks(_initial, WORLD, folder)
    good = _versions(folder)
    assert len(good) == 1

    # Rank 1 dies with its shard written but not renamed; rank 0 dies before the
    # metadata rename (its new meta.json.tmp is on disk, the old meta.json is not touched).
    for dead_saves, (victim, stage) in enumerate(((1, "shard"), (0, "meta")), start=1):
        _kill_during_save(folder, victim, stage)
        left = _versions(folder)
        assert good[0] in left and len(left) == 1 + dead_saves, left  # dead saves' folders

    after = run_ranks(_verify, WORLD, folder)
    for rank, (b, a) in enumerate(zip(before, after)):
        assert a["meta"]["step"] == FIRST_STEPS and a["meta"]["version"] == good[0]
        assert a["manager"] == b["manager"] and a["lr"] == b["lr"]
        for k in b["state"]:
            assert torch.equal(a["state"][k], b["state"][k]), (rank, k)
        assert len(a["shards"]) == len(b["shards"])
        for (pa, sa), (pb, sb) in zip(a["shards"], b["shards"]):
            assert torch.equal(pa, pb) and sa.keys() == sb.keys()
            for key in sb:
                same = (
                    torch.equal(sa[key], sb[key])
                    if torch.is_tensor(sb[key])
                    else sa[key] == sb[key]
                )
                assert same, (rank, key)
    # A later successful save removes the dead saves' folders and temporary files.
    assert len(_versions(folder)) == 1
    assert not [n for n in os.listdir(folder) if ".tmp" in n]
