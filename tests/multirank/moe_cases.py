"""Rank functions for test_moe.py: nbtrain.moe.MoE over an ep group of the whole world.

Every rank has its own tokens (rank r: (2, 5 + r) tokens) and loads the same full
weights (`full_weights`), keeping its experts; the test compares with
`moe_reference` on all ranks' tokens at once.
"""

import torch

HIDDEN, FFN, EXPERTS = 8, 12, 6
SILENT = EXPERTS - 1  # routed no tokens: its router row is -10 on feature 0, always > 1

# Crafted routing for the capacity case: token i goes to experts (first, second).
CRAFTED = [(0, 1), (0, 1), (0, 2), (0, 1), (0, 3), (1, 0), (2, 3), (0, 4)]
# Each expert keeps ceil(1.0 * 8 * 2 / 6) = 3 per rank, first come first kept:
# expert 0 keeps tokens 0, 1, 2 and drops 3, 4, 5, 7; expert 1 keeps 0, 1, 3, drops 5.
CRAFTED_KEEP = [
    (True, True),
    (True, True),
    (True, True),
    (False, True),
    (False, True),
    (False, False),
    (True, True),
    (False, True),
]


def full_weights():
    """(router (E, H), w_in (E, H, F), w_out (E, F, H)), the same on every rank."""
    g = torch.Generator().manual_seed(11)
    router = torch.randn(EXPERTS, HIDDEN, generator=g)
    router[SILENT] = 0.0
    router[SILENT, 0] = -10.0
    w_in = torch.randn(EXPERTS, HIDDEN, FFN, generator=g) / HIDDEN**0.5
    w_out = torch.randn(EXPERTS, FFN, HIDDEN, generator=g) / FFN**0.5
    return router, w_in, w_out


def rank_tokens(rank: int):
    """(tokens (2, 5 + rank, H), output cotangent of the same shape) of one rank."""
    g = torch.Generator().manual_seed(100 + rank)
    x = torch.randn(2, 5 + rank, HIDDEN, generator=g)
    x[..., 0] = x[..., 0].abs() + 1.0  # keeps SILENT's logit below -10
    return x, torch.randn(x.shape, generator=g)


def crafted_tokens():
    """(1, 8, H): token i scores 3 for its first expert, 2 for its second, 0 else
    (with the identity router)."""
    x = torch.zeros(1, len(CRAFTED), HIDDEN)
    for i, (a, b) in enumerate(CRAFTED):
        x[0, i, a], x[0, i, b] = 3.0, 2.0
    return x


def _layer(top_k, **kw):
    import nbtrain
    from nbtrain.moe import ExpertParallel, MoE

    router, w_in, w_out = full_weights()
    moe = MoE(HIDDEN, FFN, EXPERTS, top_k=top_k, group=ExpertParallel.from_topology(), **kw)
    lo, hi = moe.first_expert, moe.first_expert + moe.local_experts
    with torch.no_grad():
        moe.router.weight.copy_(router)
        moe.w_in.copy_(w_in[lo:hi])
        moe.w_out.copy_(w_out[lo:hi])
    assert moe.ep_size == nbtrain.world_size()
    return moe


def _a2a_bytes():
    from nbtrain.comm.collectives import COUNTERS

    return COUNTERS.snapshot()["bytes"].get("all_to_all", 0)


def _routed(top_k, chunks=1):
    """Dropless routing with aux loss: output, gradients, bytes, aux loss."""
    import nbtrain
    from nbtrain.comm.collectives import COUNTERS

    moe = _layer(top_k, chunks=chunks)
    x, g = rank_tokens(nbtrain.rank())
    x.requires_grad_(True)
    COUNTERS.reset()
    out = moe(x)
    forward_bytes = _a2a_bytes()
    COUNTERS.reset()
    (out * g).sum().backward(retain_graph=True)  # the aux loss's graph is shared
    backward_bytes = _a2a_bytes()
    aux = moe.aux_loss
    (aux_grad,) = torch.autograd.grad(aux, moe.router.weight)
    return {
        "x": x.detach(),
        "g": g,
        "out": out.detach(),
        "x_grad": x.grad,
        "router_grad": moe.router.weight.grad,
        "w_in_grad": moe.w_in.grad,
        "w_out_grad": moe.w_out.grad,
        "first": moe.first_expert,
        "local": moe.local_experts,
        "forward_bytes": forward_bytes,
        "backward_bytes": backward_bytes,
        "aux": aux.detach(),
        "aux_grad": aux_grad,
        "stats": moe.stats,
    }


def _capacity():
    moe = _layer(2, capacity_factor=1.0, balance="none")
    with torch.no_grad():
        moe.router.weight.copy_(torch.eye(EXPERTS, HIDDEN))
    x = crafted_tokens().requires_grad_(True)
    out = moe(x)
    out.sum().backward()  # drops are in the graph too
    return {
        "out": out.detach(),
        "stats": moe.stats,
        "capacity": moe.capacity(len(CRAFTED)),
        "x_grad": x.grad,
    }


def _bias():
    """Training forward: the bias moves; then an eval forward with a steering bias."""
    import nbtrain

    moe = _layer(2, balance="bias", bias_update_rate=0.1)
    x, _ = rank_tokens(nbtrain.rank())
    moe.train()
    moe(x)
    unmoved = bool((moe.expert_bias == 0).all())  # the bias moves when the step ends
    moe.apply_bias_update()
    trained = moe.expert_bias.clone()
    stats = moe.stats
    moe.eval()
    steer = torch.zeros(EXPERTS)
    steer[SILENT] = 2.0  # SILENT now wins selection; its combine weight stays tiny
    with torch.no_grad():
        moe.expert_bias.copy_(steer)
        out = moe(x)
    return {
        "trained_bias": trained,
        "unmoved": unmoved,
        "stats": stats,
        "steered_out": out,
        "bias_after_eval": moe.expert_bias.clone(),
        "x": x,
        "steer": steer,
        "aux": moe.aux_loss,
    }


def _alone():
    """An ep group of this rank alone (every expert here): output, a2a bytes."""
    import nbtrain
    from nbtrain.comm.collectives import COUNTERS
    from nbtrain.comm.topology import ALONE
    from nbtrain.moe import MoE

    router, w_in, w_out = full_weights()
    moe = MoE(HIDDEN, FFN, EXPERTS, top_k=2, group=ALONE)
    with torch.no_grad():
        moe.router.weight.copy_(router)
        moe.w_in.copy_(w_in)
        moe.w_out.copy_(w_out)
    x, _ = rank_tokens(nbtrain.rank())
    COUNTERS.reset()
    with torch.no_grad():
        out = moe(x)
    return {
        "x": x,
        "out": out,
        "bytes": COUNTERS.snapshot()["total_bytes"],
        "local": moe.local_experts,
    }


def _no_layout():
    """A layer built without a group under init_distributed(ep_size=world): every expert
    here, nothing sent, and the warnings its build gave."""
    import warnings

    from nbtrain.comm.collectives import COUNTERS
    from nbtrain.moe import MoE

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        moe = MoE(HIDDEN, FFN, EXPERTS, top_k=2)
    x, _ = rank_tokens(0)
    COUNTERS.reset()
    with torch.no_grad():
        moe(x)
    return {
        "local": moe.local_experts,
        "bytes": COUNTERS.snapshot()["total_bytes"],
        "warnings": [f"{w.category.__name__}: {w.message}" for w in caught],
    }


def _uneven_split_error():
    from nbtrain.moe import ExpertParallel, MoE

    try:
        MoE(HIDDEN, FFN, 5, group=ExpertParallel.from_topology())
    except ValueError as err:
        return str(err)
    return None


def all_cases():
    """Every case on this rank, in one launch: {name: result}. The world is the ep
    group, given to each layer as ExpertParallel.from_topology()."""
    import nbtrain

    nbtrain.init_distributed(ep_size=nbtrain.world_size())
    return {
        "top1": _routed(1),
        "top2": _routed(2),
        "top2-chunks3": _routed(2, chunks=3),
        "capacity": _capacity(),
        "bias": _bias(),
        "alone": _alone(),
        "no_layout": _no_layout(),
        "uneven_split_error": _uneven_split_error(),
    }
