"""Rank functions for test_moe_gpt.py: the MoE GPT sharded by wrap at ep > 1 against the
same model in one process (on rank 0, every expert local)."""

import torch

VOCAB, SEQ, ROWS = 64, 8, 2  # ROWS sequences per rank


def config(**kw):
    from nbtrain.models.gpt_moe import MoEGPTConfig

    return MoEGPTConfig(
        vocab_size=VOCAB, seq_len=SEQ, hidden=16, heads=2, layers=2, num_experts=4, top_k=2, **kw
    )


def batches(world: int, steps: int):
    """[step][rank] token ids (ROWS, SEQ), the same on every process."""
    g = torch.Generator().manual_seed(7)
    return [
        [torch.randint(0, VOCAB, (ROWS, SEQ), generator=g) for _ in range(world)]
        for _ in range(steps)
    ]


def _optimizer(kind, params):
    if kind == "adamw":
        return torch.optim.AdamW(params, lr=3e-3, weight_decay=0.01)
    return torch.optim.SGD(params, lr=0.05, momentum=0.9)


def train(
    ep_size: int,
    kind: str,
    steps: int,
    zero_level: int = 3,
    layout: bool = True,
    cfg: dict | None = None,
):
    """(sharded losses per step (mean over ranks), reference losses, final state dicts
    of both, router stats, all_to_all bytes of one forward, what the routing counted,
    the warnings of the build). `layout`: the model is given the topology's ep group
    (ExpertParallel.from_topology()); False: none (every expert local). `cfg`: more
    MoEGPTConfig fields (e.g. {"balance": "bias"})."""
    cfg = cfg or {}
    import warnings

    import nbtrain
    from nbtrain.comm.collectives import COUNTERS
    from nbtrain.comm.topology import ALONE
    from nbtrain.models.gpt_moe import MoEGPT, router_stats
    from nbtrain.moe import ExpertParallel
    from nbtrain.optim import OptimManager

    nbtrain.init_distributed(ep_size=ep_size)
    world, rank = nbtrain.world_size(), nbtrain.rank()
    torch.manual_seed(0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        built = MoEGPT(config(**cfg), ep_group=ExpertParallel.from_topology() if layout else None)
    model = nbtrain.wrap(built, zero_level=zero_level)
    manager = OptimManager()
    manager.add_optimizer(_optimizer(kind, list(model.parameters())))
    data = batches(world, steps)
    losses, reference, ref_model = [], [], None
    if rank == 0:
        torch.manual_seed(0)
        ref_model = MoEGPT(config(**cfg), ep_group=ALONE)  # the same draws, all experts here
        ref_opt = _optimizer(kind, list(ref_model.parameters()))
    for step in range(steps):
        ids = data[step][rank]
        manager.zero_grad()
        loss = model.loss(ids, ids.roll(-1, dims=1))
        manager.backward(loss)
        manager.step()
        losses.append(nbtrain.sum_loss(loss).item())
        if ref_model is not None:  # the same ranks' batches, each its own aux loss
            ref_opt.zero_grad()
            ref_loss = sum(ref_model.loss(b, b.roll(-1, dims=1)) for b in data[step]) / world
            ref_loss.backward()
            ref_opt.step()
            reference.append(ref_loss.item())
    stats = router_stats(model)
    COUNTERS.reset()
    with torch.no_grad():
        model(data[0][rank])
    a2a = COUNTERS.snapshot()["bytes"].get("all_to_all", 0)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    ref_state = ref_model.state_dict() if ref_model is not None else None
    return dict(
        losses=losses,
        reference=reference,
        state=state,
        ref_state=ref_state,
        stats=stats,
        a2a=a2a,
        local_experts=model.layers[0].mlp.local_experts,
        warnings=[str(w.message) for w in caught],
    )


def save_and_load(ep_size: int, path: str):
    """nbtrain.save of a wrapped MoE GPT (all experts in the file), then nbtrain.load into
    a fresh one at the same ep size: (state before, state after, file keys' shapes)."""
    import nbtrain
    from nbtrain.models.gpt_moe import MoEGPT
    from nbtrain.moe import ExpertParallel

    nbtrain.init_distributed(ep_size=ep_size)
    torch.manual_seed(3)
    model = nbtrain.wrap(MoEGPT(config(), ep_group=ExpertParallel.from_topology()))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    nbtrain.save(model, path)
    torch.manual_seed(4)
    fresh = nbtrain.wrap(MoEGPT(config(), ep_group=ExpertParallel.from_topology()))
    nbtrain.load(fresh, path)
    after = {k: v.clone() for k, v in fresh.state_dict().items()}
    try:
        nbtrain.save_checkpoint(fresh, path + ".ckpt")
        refused = None
    except NotImplementedError as err:
        refused = str(err)
    return before, after, refused


def bias_with_checkpointing(steps: int = 3):
    """The loss-free bias after `steps` steps, with and without activation checkpointing
    (each Block's forward recomputed in backward): (plain bias, checkpointed bias,
    balance metrics recorded per step)."""
    import nbtrain
    from nbtrain.comm import events
    from nbtrain.models.gpt_moe import MoEGPT
    from nbtrain.moe import ExpertParallel

    nbtrain.init_distributed(ep_size=nbtrain.world_size())
    rank, out, recorded = nbtrain.rank(), [], []
    events.subscribe(lambda e: recorded.append(e) if e.get("type") == "metric" else None)
    for use_checkpoint in (False, True):
        torch.manual_seed(0)
        model = nbtrain.wrap(
            MoEGPT(
                config(balance="bias", bias_update_rate=0.1),
                ep_group=ExpertParallel.from_topology(),
            ),
            use_checkpoint=use_checkpoint,
        )
        recorded.clear()
        for step in range(steps):
            ids = batches(nbtrain.world_size(), steps)[step][rank]
            model.loss(ids, ids.roll(-1, dims=1)).backward()
            events.end_step()  # what OptimManager.step does: the bias moves
        out.append(model.layers[0].mlp.expert_bias.clone())
        out.append(sum("moe.0.balance" in e for e in recorded))
    return out


def meta_build(steps: int = 2):
    """The MoE GPT built on the meta device, sharded at ep = world, initialised rank by
    rank (moe_inits): (expert weights' std and bound, losses of a few steps)."""
    import nbtrain
    from nbtrain.models.gpt_moe import MoEGPT, moe_inits
    from nbtrain.moe import ExpertParallel

    nbtrain.init_distributed(ep_size=nbtrain.world_size())
    cfg = config()
    with nbtrain.empty_parameters():
        model = MoEGPT(cfg, ep_group=ExpertParallel.from_topology())
    nbtrain.assign_inits(model, moe_inits(cfg))
    model = nbtrain.wrap(model)
    nbtrain.init_parameters(model)
    w_in = model.state_dict()["layers.0.mlp.w_in"]
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    losses = []
    ids = batches(nbtrain.world_size(), 1)[0][nbtrain.rank()]
    for _ in range(steps):  # one batch again and again: its loss falls
        opt.zero_grad()
        loss = model.loss(ids, ids.roll(-1, dims=1))
        loss.backward()
        opt.step()
        losses.append(nbtrain.sum_loss(loss).item())
    return float(w_in.std()), float(w_in.abs().max()), cfg.hidden**-0.5, losses
