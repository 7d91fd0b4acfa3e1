"""Rank functions for test_pipeline_interleaved.py: interleaved 1F1B against one plain
process. One launch runs every case of a world, each case returning its own result."""

import copy

import torch
import torch.nn.functional as F
from pipeline_cases import BATCH, STEPS, _layers, _optimizer, parity
from torch import nn


def _parity(pipe, virtual, micro, optimizer):
    """STEPS steps of the six-layer stack cut into pipe * virtual chunks, against the
    stack on this process: max |loss difference|, max |parameter difference| of this
    rank's chunks, the live peak, the compute spans of one step and the p2p bytes sent."""
    import nbtrain
    from nbtrain import pipeline
    from nbtrain.comm import collectives as C
    from nbtrain.comm import events

    layers = _layers()
    plain = nn.Sequential(*copy.deepcopy(layers))
    split = pipeline.balanced_split(
        [sum(p.numel() for p in m.parameters()) for m in layers], pipe * virtual
    )
    stages = pipeline.stages_of(layers, virtual=virtual, split=split)
    opts = [_optimizer(plain.parameters(), optimizer), _optimizer(stages.parameters(), optimizer)]
    gen = torch.Generator().manual_seed(1)
    loss_err, peak, spans = 0.0, 0, []
    batch = BATCH - BATCH % micro  # equal micro-batches
    C.COUNTERS.reset()
    for step in range(STEPS):
        x = torch.randn(batch, 6, generator=gen)
        y = torch.randn(batch, 5, generator=gen)
        ref = F.mse_loss(plain(x), y)
        ref.backward()
        stats = {}
        record = spans.append if step == 0 else None
        if record:
            events.subscribe(record)
        losses = pipeline.run(
            stages,
            list(x.chunk(micro)),
            list(y.chunk(micro)),
            F.mse_loss,
            schedule="interleaved",
            stats=stats,
        )
        if record:
            events.unsubscribe(record)
        peak = max(peak, stats["live_peak"])
        for opt in opts:
            opt.step()
            opt.zero_grad()
        loss_err = max(loss_err, abs(sum(losses) / micro - ref.item()))
    rank = nbtrain.get_context().topology.pipe_rank
    mine = [split[v * pipe + rank] for v in range(virtual)]
    got = list(stages.state_dict().values())  # chunk by chunk, in the layers' order
    want = [t for part in mine for i in part for t in plain[i].state_dict().values()]
    param_err = max((a - b).abs().max().item() for a, b in zip(got, want))
    return {
        "loss": loss_err,
        "params": param_err,
        "peak": peak,
        "n": (len(got), len(want)),
        "split": [list(r) for r in split],
        "spans": sorted({(e["label"], e["phase"]) for e in spans if e["type"] == "compute"}),
        "p2p_bytes": C.COUNTERS.snapshot()["bytes"].get("p2p", 0),
    }


def _gpt(pipe, virtual, optimizer):
    """The GPT whose embedding is its output projection, one layer per chunk at pp 2 x
    virtual 2: the tie crosses ranks and the last rank's chunk 0 feeds rank 0's chunk 1."""
    from nbtrain import pipeline
    from nbtrain.models import GPT, GPTConfig
    from nbtrain.models.gpt_pipe import gpt_layers

    cfg = GPTConfig(vocab_size=32, seq_len=8, hidden=16, heads=2, layers=2)
    torch.manual_seed(0)
    plain = GPT(cfg)
    model = copy.deepcopy(plain)
    stages = pipeline.stages_of(gpt_layers(model), virtual=virtual)
    opts = [_optimizer(plain.parameters(), optimizer), _optimizer(stages.parameters(), optimizer)]
    gen = torch.Generator().manual_seed(2)
    loss_err, micro = 0.0, 2 * pipe

    def loss_fn(logits, target):
        return F.cross_entropy(logits.reshape(-1, cfg.vocab_size), target.reshape(-1))

    for _ in range(STEPS):
        idx = torch.randint(0, cfg.vocab_size, (micro * 2, 8), generator=gen)
        target = torch.randint(0, cfg.vocab_size, (micro * 2, 8), generator=gen)
        ref = plain.loss(idx, target)
        ref.backward()
        losses = pipeline.run(
            stages,
            list(idx.chunk(micro)),
            list(target.chunk(micro)),
            loss_fn,
            schedule="interleaved",
        )
        for opt in opts:
            opt.step()
            opt.zero_grad()
        loss_err = max(loss_err, abs(sum(losses) / micro - ref.item()))
    mine = {id(p) for p in stages.parameters()}
    names = [n for n, p in model.named_parameters() if id(p) in mine]
    state, ref_state = model.state_dict(), plain.state_dict()
    param_err = max((state[n] - ref_state[n]).abs().max().item() for n in names)
    return {"loss": loss_err, "params": param_err, "checked": len(names), "ties": len(stages.ties)}


def _refusal(call) -> str:
    try:
        call()
    except ValueError as exc:
        return str(exc)
    return "not refused"


def all_cases(pipe, virtual, runs, gpt_optimizers=()):
    """Every case of one world: {(micro, optimizer): parity} for `runs`, {("gpt",
    optimizer): parity} and the messages refusing a bad M and a lone stage."""
    import nbtrain
    from nbtrain import pipeline

    nbtrain.init_distributed(pipe_size=pipe)
    out = {(micro, opt): _parity(pipe, virtual, micro, opt) for micro, opt in runs}
    out.update({("gpt", opt): _gpt(pipe, virtual, opt) for opt in gpt_optimizers})
    stages = pipeline.stages_of(_layers(), virtual=virtual)
    x, y = torch.randn(pipe + 1, 6), torch.randn(pipe + 1, 5)
    out["bad micro"] = _refusal(
        lambda: pipeline.run(
            stages,
            list(x.chunk(pipe + 1)),
            list(y.chunk(pipe + 1)),
            F.mse_loss,
            schedule="interleaved",
        )
    )
    out["lone stage"] = _refusal(
        lambda: pipeline.run(stages[0], [x], [y], F.mse_loss, schedule="interleaved")
    )
    return out


def zero_cases(pipe, virtual, micro, runs):
    """pp x dp with each chunk wrapped for ZeRO over its data-parallel ranks, every rank
    passing its own rows: {(zero_level, optimizer): pipeline_cases.parity's result
    (max |loss difference|, max |parameter difference| of this rank's chunks, ...)}
    against the whole batch on one process."""
    return {
        (zero_level, optimizer): parity(
            pipe, "interleaved", optimizer, zero_level, virtual=virtual, micro=micro
        )
        for zero_level, optimizer in runs
    }
