"""Events of a real 2-rank TransformerBlockList step: order, nesting, step summary."""

import torch
from support import cases
from support.ranks import run_ranks

import nbtrain as nbt
from nbtrain import telemetry


def _recorded_step():
    model = cases.sharded_model("blocklist", 3, False)
    opt = cases.make_adamw(model)
    telemetry.watch(model, opt)
    xs, ys = cases.batches(nbt.world_size(), 2)
    for step in range(2):  # step 0 warms up; step 1 is checked
        telemetry.RECORDER.clear()
        loss = model.loss(xs[step, :2], ys[step, :2])
        loss.backward()
        opt.step()
        opt.zero_grad()
        telemetry.metric(loss=loss.detach(), lr=1e-3, loss_scale=1.0, skipped=False)
        telemetry.next_step()
    labels = [b.label for b in model.layers]
    # zero_grad freed the grads: the shards, AdamW's m and v, and one fp32 step per shard.
    shards = list(model.parameters())
    state_bytes = sum(3 * p.numel() * p.element_size() + 4 for p in shards)
    return labels, telemetry.RECORDER.snapshot(), telemetry.RECORDER.summary(), state_bytes


def _compute_nesting(events, phase):
    """Blocks' compute spans of one phase, in order; they must not interleave."""
    open_label, order = None, []
    for e in events:
        if e.get("phase") != phase or e["type"] not in ("compute_begin", "compute"):
            continue
        if e["type"] == "compute_begin":
            assert open_label is None, f"{phase}: {e['label']} began inside {open_label}"
            open_label = e["label"]
        else:
            assert e["label"] == open_label, f"{phase}: {e['label']} ended, {open_label} open"
            assert e["start"] <= e["end"]
            open_label = None
            order.append(e["label"])
    assert open_label is None
    return order


def test_two_rank_step_events_in_order_and_nested():
    for labels, events, summary, state_bytes in run_ranks(_recorded_step, 2):
        seqs = [e["seq"] for e in events]
        assert seqs == sorted(seqs) and len(set(seqs)) == len(seqs)
        # A collective's completion callback can run after its step ended; it keeps
        # the step it was issued in.
        late = [e for e in events if e["step"] != 1]
        assert all(e["type"] == "comm" and e["step"] == 0 for e in late), late
        events = [e for e in events if e["step"] == 1]
        assert _compute_nesting(events, "forward") == labels
        assert _compute_nesting(events, "backward") == labels[::-1]
        # Every communication span follows its issue and lies inside the step.
        issued = {}
        for e in events:
            if e["type"] == "comm_issue":
                issued.setdefault((e["label"], e["kind"]), []).append(e)
        comm = [e for e in events if e["type"] == "comm"]
        assert {e["kind"] for e in comm} >= {"all_gather", "reduce_scatter"}
        for e in comm:
            # Blocking collectives record their issue instant on return, just
            # before their span; asynchronous ones long before it.
            assert issued[(e["label"], e["kind"])][0]["seq"] < e["seq"]
            assert e["start"] <= e["end"] and e["bytes"] > 0
        tail = [e["type"] for e in events[-3:]]
        assert tail == ["metric", "memory", "step_end"], tail
        memory = events[-2]
        assert memory["rss_bytes"] > 0
        assert memory["model_state_bytes"] == state_bytes
        last = summary["last_step"]
        assert last["step"] == 1 and 0.0 <= last["overlap"] <= 1.0
        assert last["comm_bytes"] == sum(e["bytes"] for e in comm)
        assert len(last["compute"]) == 2 * len(labels)
        assert [m["step"] for m in summary["metrics"]] == [0, 1]


def _tour_training():
    """The README tour's training code, no telemetry call in it."""
    from nbtrain.models import GPT, GPTConfig
    from nbtrain.models.data import BatchSampler, stdlib_corpus

    cfg = GPTConfig.preset("tiny")
    model = nbt.wrap(GPT(cfg), zero_level=3)
    opt = nbt.optim.AdamOptimizer(model.parameters(), lr=3e-3)
    optim = nbt.optim.OptimManager(loss_scale=None)
    optim.add_optimizer(opt)
    sampler = BatchSampler(stdlib_corpus(1 << 16), seq_len=cfg.seq_len, global_batch=4)
    telemetry.RECORDER.clear()
    for step in range(3):
        x, y = sampler.local_batch(step)
        optim.zero_grad()
        optim.backward(model.loss(x, y))
        optim.step()
        with torch.no_grad():  # an evaluation forward: no tokens trained on
            model.loss(x, y)
    full = sum(p.numel() for p in GPT(cfg).parameters()) * 4
    return telemetry.RECORDER.summary(), x.numel(), full


def test_the_tours_code_fills_the_panels_without_a_telemetry_call():
    for summary, local_tokens, full in run_ranks(_tour_training, 2):
        rows = [m for m in summary["metrics"] if "loss" in m]
        assert len(rows) == 3
        # Tokens from the batch each training forward saw (the no_grad one not counted).
        assert [m.get("batch_tokens") for m in rows] == [local_tokens] * 3
        # The gradient norm OptimManager.step computes without clip_grad_norm.
        assert all(m["grad_norm"] > 0 for m in rows), rows
        # The wrapped model and the added optimizer are counted in memory samples.
        last = summary["memory_history"][-1]
        assert last["optimizer_bytes"] > 0 and last["param_bytes"] > 0, last
        assert last["full_param_bytes"] == full, (last, full)
