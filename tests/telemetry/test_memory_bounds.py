"""What nbtrain keeps per step, per event and per run stays bounded: long runs level off.

A 2-rank run of a few hundred steps with the `nbtrain demo` machinery (ZeRO-3 GPT,
OptimManager, telemetry written to JSONL, `nbtrain.progress`), its recorder's bounds
shrunk so that they fill early: from then on the containers must stop growing, and
so must the process. `tests/stress/memory_growth.py` measures the real defaults
over 20000 steps.
"""

import os
from collections import deque

from support.ranks import run_ranks

from nbtrain import telemetry
from nbtrain.comm import recovery
from nbtrain.notebook import dashboard
from nbtrain.telemetry import sinks
from nbtrain.telemetry.steplog import StepLog

MiB = 2**20
STEPS = 320
CHECKS = (160, 240, STEPS)  # the shrunk bounds are full by step ~70
MAX_EVENTS = 3000
HISTORY = 50


def _lengths() -> dict:
    from nbtrain.comm import collectives, events

    rec, log = telemetry.RECORDER, telemetry.RECORDER.log
    return {
        "events": len(rec.events),
        "metrics": len(log.metrics),
        "steps": len(log.steps),
        "overlap": len(log.overlap),
        "memory_history": len(log.memory_history),
        "spans": len(log._spans),
        "sinks": len(rec.sinks),
        "counter_kinds": len(collectives.COUNTERS.bytes),
        "in_flight": len(collectives.IN_FLIGHT),
        "step_end_hooks": len(events._STEP_END),
        "subscribers": len(events.HUB.subscribers),
        "phases": len(recovery._S.phases),
    }


def _train(run_dir: str) -> dict:
    import torch.nn.functional as F

    import nbtrain as nbt
    from nbtrain import progress
    from nbtrain.models import GPT, GPTConfig
    from nbtrain.models.data import VOCAB_SIZE, BatchSampler, stdlib_corpus
    from nbtrain.telemetry.sinks import _rss_bytes

    rec = telemetry.RECORDER
    rec.events = deque(maxlen=MAX_EVENTS)
    rec.log = StepLog(history=HISTORY)
    telemetry.start(run_dir)
    cfg = GPTConfig.preset("tiny", vocab_size=VOCAB_SIZE, seq_len=16)
    model = nbt.wrap(GPT(cfg), zero_level=3)
    optimizer = nbt.optim.AdamOptimizer(model.parameters(), lr=1e-3)
    manager = nbt.optim.OptimManager()
    manager.add_optimizer(
        optimizer, nbt.lr_scheduler.Cosine(optimizer, start_lr=1e-3, warmup_iter=10, end_iter=STEPS)
    )
    telemetry.watch(model, optimizer)
    sampler = BatchSampler(stdlib_corpus(), cfg.seq_len, 2 * nbt.world_size(), seed=0)
    seen = {}
    for step in progress(range(STEPS), desc="bounds", mininterval=60):
        x, y = sampler.local_batch(step)
        telemetry.metric(tokens=x.numel())
        manager.zero_grad()
        logits = model(x)
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
        manager.backward(loss)
        manager.clip_grad_norm(optimizer.param_groups, max_norm=1.0)
        manager.step()
        nbt.sum_loss(loss).item()
        if step + 1 in CHECKS:
            seen[step + 1] = {**_lengths(), "rss": _rss_bytes()}
    telemetry.stop()
    return seen


def test_a_long_run_levels_off(tmp_path):
    run_dir = str(tmp_path / "telemetry")
    for rank, seen in enumerate(run_ranks(_train, 2, run_dir, timeout_s=300)):
        first, *_, last = (seen[s] for s in CHECKS)
        # The step histories thin themselves when full (steplog.History): between
        # 3/4 of HISTORY and HISTORY rows from then on.
        thinned = ("metrics", "steps", "overlap", "memory_history")
        for check in CHECKS:
            assert all(HISTORY * 3 // 4 <= seen[check][k] <= HISTORY for k in thinned), seen
        grown = {
            k: (first[k], last[k])
            for k in first
            if k not in ("rss", *thinned) and last[k] > first[k]
        }
        assert not grown, f"rank {rank}: still growing after step {CHECKS[0]}: {grown}"
        assert first["events"] == MAX_EVENTS
        # Loose: the containers above are what grew (~22 kB a step before they were
        # bounded); the allocator's own noise stays well under this.
        assert last["rss"] - first["rss"] < 8 * MiB, (rank, first["rss"], last["rss"])
    # The finished run's report reads every step from disk.
    with open(os.path.join(run_dir, "rank0.jsonl")) as f:
        ends = sum('"type": "step_end"' in line for line in f)
    assert ends == STEPS


def test_recorder_and_step_log_defaults_are_bounded():
    rec = telemetry.Recorder()
    assert rec.events.maxlen == telemetry.DEFAULT_MAX_EVENTS <= 10_000
    for name in ("metrics", "overlap", "steps", "memory_history"):
        assert getattr(rec.log, name).maxlen is not None, name


def test_started_and_stopped_runs_leave_no_writer_behind(tmp_path):
    from nbtrain.comm import events

    # The switch itself: telemetry.enabled() is "switched on and someone subscribed",
    # False in a process that never recorded, and putting that back switched events
    # off for every later module of the process (tests/state_guard.py now says so).
    was_on = events.HUB.enabled
    before = len(sinks._OPEN_WRITERS)
    try:
        for run in range(20):
            telemetry.start(tmp_path / f"run{run}")
            telemetry.stop()
    finally:
        telemetry.set_enabled(was_on)
    import gc

    gc.collect()
    assert len(sinks._OPEN_WRITERS) == before


def test_open_phases_of_failed_optimizer_steps_are_bounded():
    saved = list(recovery._S.phases)
    try:
        for _ in range(3 * recovery.MAX_OPEN_PHASES):  # steps that raised, never closed
            recovery._S.phases.append("AdamOptimizer.step() (the optimizer update)")
        with recovery.phase("checkpoint"):
            assert recovery.interrupted_phase() == "checkpoint"
        assert len(recovery._S.phases) <= recovery.MAX_OPEN_PHASES
    finally:
        recovery._S.phases.clear()
        recovery._S.phases.extend(saved)


def test_dashboard_history_is_bounded():
    old: list = []
    for start in range(0, 3 * dashboard.MAX_HISTORY, 300):
        new = [{"step": s} for s in range(start, start + 300)]
        old = dashboard._merge_by_step(old, new)
    assert len(old) <= dashboard.MAX_HISTORY
    assert old[-1]["step"] == 3 * dashboard.MAX_HISTORY - 1
    assert old[0]["step"] == 0  # the whole run, thinned where older
