"""Events of a real 2-rank TransformerBlockList step: order, nesting, step summary."""

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
