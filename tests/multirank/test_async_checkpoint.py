"""save_checkpoint(..., non_blocking=True) on real gloo ranks.

- It returns while the files are still being written (a pause holds the write back);
  training goes on, changing the shards, and the checkpoint still holds the state at
  the save, bitwise, with its step and loss scale. The step time with a save in
  flight against without is measured (printed; not asserted: timing).
- A rank killed (SIGKILL) in the middle of writing its file: rank 0's wait() says
  which rank never finished, and the previous checkpoint still loads bitwise.
"""

import os

import pytest
import torch
from async_cases import killed_during_write, load_state, roundtrip
from support.ranks import run_ranks


def test_a_background_save_holds_the_state_at_the_save(tmp_path):
    per_rank = run_ranks(roundtrip, 2, str(tmp_path / "ckpt"), 3, timeout_s=300)
    for out in per_rank:
        assert out["in_flight_at_return"] and out["still_writing"]
        assert out["changed"]  # training went on during the write
        assert out["same"] and out["step"] == 5
        assert out["scale"][0] == out["scale"][1]
    ratio = max(o["busy_s"] for o in per_rank) / max(o["quiet_s"] for o in per_rank)
    print(f"\nstep time with a save in flight / without: {ratio:.2f}")


def test_a_rank_killed_mid_write_leaves_the_previous_checkpoint(tmp_path):
    folder = tmp_path / "ckpt"
    folder.mkdir()
    with pytest.raises(RuntimeError, match=r"rank\(s\) \[1\] died"):
        run_ranks(killed_during_write, 2, str(folder), timeout_s=300)
    leftovers = [n for n in os.listdir(folder) if n.startswith("v-")]
    assert len(leftovers) == 2  # A's version and B's unfinished one
    saved = torch.load(tmp_path / "rank0.pt")
    assert saved["error"] is not None and "rank(s) [1] did not finish" in saved["error"]
    for step, state in run_ranks(load_state, 2, str(folder), timeout_s=300):
        assert step == 2
        for key, value in saved["state"].items():
            assert torch.equal(value, state[key]), key
