"""Rank functions for test_gpt_context_parallel.py: nbtrain's GPT under context
parallelism (world 2, cp_size 2: one batch, each rank half of every sequence), every
case in one launch. The single-process reference lives here too, so both sides build
the same model and read the same batches."""

import itertools

import torch

ROWS, SEQ = 2, 32
LAYOUTS = ("zigzag", "contiguous")
OPTIMIZERS = ("adamw", "sgd")
CASES = list(itertools.product(LAYOUTS, (False, True), OPTIMIZERS))  # (layout, packed, opt)

# Documents of uneven lengths whose starts fall inside the zigzag and contiguous chunks
# (boundaries at 8, 16, 24), so documents span ranks.
DOC_LENGTHS = ([5, 14, 13], [11, 3, 18])


def config():
    from nbtrain.models.gpt import GPTConfig

    return GPTConfig(vocab_size=64, seq_len=SEQ, hidden=32, heads=2, layers=2)


def new_gpt(context_parallel=None):
    """The tiny GPT every case starts from (seeded: the same weights everywhere), with
    the given layout (None: whole sequences)."""
    from nbtrain.models.gpt import GPT

    torch.manual_seed(0)
    return GPT(config(), context_parallel=context_parallel)


def packed_position_ids() -> torch.Tensor:
    """int64 (ROWS, SEQ): positions restarting at 0 at each document's start."""
    return torch.stack([torch.cat([torch.arange(n) for n in row]) for row in DOC_LENGTHS])


def batch(step: int, packed: bool):
    """The full rows of `step` (two batches taking turns, so the loss falls): (token
    ids, targets, position ids or None)."""
    ids = torch.randint(0, 64, (ROWS, SEQ), generator=torch.Generator().manual_seed(100 + step % 2))
    return ids, ids.roll(-1, dims=1), packed_position_ids() if packed else None


def optimizer(name: str, params):
    if name == "adamw":
        return torch.optim.AdamW(params, lr=3e-3, weight_decay=0.01)
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def train(model, opt_name: str, packed: bool, steps: int, report=lambda loss: float(loss.detach())):
    """`steps` steps on model.shard_batch of each full batch: (losses, logits of the
    first batch before training, gathered to full rows). `report` turns a step's
    (local) loss into the number recorded."""
    opt = optimizer(opt_name, model.parameters())
    losses, logits = [], None
    for step in range(steps):
        idx, targets, pos, docs = model.shard_batch(*batch(step, packed))
        if step == 0:
            with torch.no_grad():
                logits = model.gather_sequence(model(idx, pos, docs), 1)
        opt.zero_grad()
        loss = model.loss(idx, targets, pos, docs)
        loss.backward()
        opt.step()
        losses.append(report(loss))
    return losses, logits


def reference(opt_name: str, packed: bool, steps: int):
    """One process, plain GPT, full rows: (losses, first logits, final state)."""
    model = new_gpt()
    losses, logits = train(model, opt_name, packed, steps)
    return losses, logits, {k: v.detach().clone() for k, v in model.state_dict().items()}


def cp_training(steps: int):
    """Every case at cp 2: {(layout, packed, optimizer): (losses averaged over the cp
    ranks, first logits gathered, final full state)} (one more with activation
    checkpointing, keyed (..., "recompute")), plus the cp facts this rank saw, what a
    GPT given no layout computes, and the messages of bad inputs."""
    import nbtrain
    from nbtrain.context_parallel import ContextParallel

    topo = nbtrain.init_distributed(cp_size=2).topology
    facts = dict(cp_size=topo.cp_size, cp_rank=topo.cp_rank, data_size=topo.data_size)
    results = {}
    # and once with activation checkpointing: the ring runs again in the backward
    for layout, packed, opt_name, *recompute in CASES + [("zigzag", True, "sgd", "recompute")]:
        model = new_gpt(ContextParallel.from_topology(layout))
        model = nbtrain.wrap(model, use_checkpoint=bool(recompute))
        cp = model.active_cp()
        facts[layout] = (cp.layout, cp.rank, cp.size)
        losses, logits = train(
            model, opt_name, packed, steps, report=lambda loss: nbtrain.sum_loss(loss).item()
        )
        state = {k: v.detach().clone() for k, v in model.state_dict().items()}
        results[(layout, packed, opt_name, *recompute)] = (losses, logits, state)
    return dict(
        results=results,
        facts=facts,
        no_layout=_without_a_layout(),
        errors=_errors(ContextParallel.from_topology()),
    )


def _without_a_layout() -> dict:
    """A GPT built with no layout argument at cp_size 2: what it sees and computes on
    full rows (one sequence per row, packed documents), one training step's loss, and
    the P2P bytes all of it sent (a ring would send some)."""
    from nbtrain.comm.collectives import COUNTERS

    model = new_gpt()
    ids, targets, pos = batch(0, True)
    COUNTERS.reset()
    with torch.no_grad():
        logits = (model(ids), model(ids, pos))
    loss = model.loss(ids, targets, pos)
    loss.backward()
    return dict(
        active=model.active_cp(),
        logits=logits,
        loss=float(loss.detach()),
        shard=model.shard_batch(ids, targets, pos) == (ids, targets, pos, None),
        grad=model.tok.weight.grad.clone(),
        p2p=COUNTERS.snapshot()["bytes"].get("p2p", 0),
    )


def _errors(cp) -> dict:
    """The message of each bad input at cp 2 (local checks: raised before any ring)."""
    from nbtrain.models.gpt import GPT

    model = GPT(config(), context_parallel=cp)
    ids, targets, pos = batch(0, True)
    idx, _, local_pos, docs = model.shard_batch(ids, targets, pos)
    attempts = {
        "indivisible": lambda: model.shard_batch(ids[:, :30], targets[:, :30]),
        "full rows": lambda: model(ids),
        "odd shard": lambda: model(ids[:, :7]),
        "no doc_ids": lambda: model(idx, local_pos),
        "targets": lambda: model.shard_batch(ids, targets[:, :16]),
    }
    out = {}
    for name, attempt in attempts.items():
        try:
            attempt()
            out[name] = None
        except ValueError as e:
            out[name] = str(e)
    return out
