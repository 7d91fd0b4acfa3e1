"""Rank functions for test_pipeline.py: a pipelined model against one plain process."""

import copy

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

STEPS, MICRO, BATCH = 10, 4, 8


def _layers():
    torch.manual_seed(0)
    dims = [6, 16, 12, 16, 10, 12, 5]  # six layers of different sizes
    out = []
    for i, (a, b) in enumerate(zip(dims, dims[1:])):
        out.append(nn.Sequential(nn.Linear(a, b), nn.Tanh()) if i < 5 else nn.Linear(a, b))
    return out


def _optimizer(params, name, eps=1e-8):
    if name == "sgd":
        return torch.optim.SGD(params, lr=0.1, momentum=0.9)
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1, eps=eps)


def parity(pipe, schedule, optimizer, zero_level=None, virtual=1, micro=MICRO):
    """STEPS steps of a pipelined stack of layers against the same stack on this process:
    max |loss difference| and max |parameter difference| of this rank's layers. With
    schedule "interleaved", `virtual` chunks per rank (each wrapped for ZeRO on its own)."""
    import nbtrain
    from nbtrain import pipeline, telemetry

    topo = nbtrain.init_distributed(pipe_size=pipe).topology
    telemetry.RECORDER.clear()
    dp, d = topo.dp_size, topo.dp_rank
    layers = _layers()
    plain = nn.Sequential(*copy.deepcopy(layers))
    split = pipeline.balanced_split(
        [sum(p.numel() for p in m.parameters()) for m in layers], pipe * virtual
    )
    if schedule == "interleaved":
        chunks = list(pipeline.stages_of(layers, virtual=virtual, split=split))
    else:
        chunks = [pipeline.stage_of(layers, split)]
    if zero_level is not None:  # ZeRO inside the stage, over its data-parallel ranks
        chunks = [nbtrain.wrap(c, zero_level=zero_level) for c in chunks]
    stage = chunks if schedule == "interleaved" else chunks[0]
    params = [p for c in chunks for p in c.parameters()]
    opts = [_optimizer(plain.parameters(), optimizer), _optimizer(params, optimizer)]
    gen = torch.Generator().manual_seed(1)
    loss_err, peak, norm_err = 0.0, 0, 0.0
    for step in range(STEPS):
        x = torch.randn(BATCH * dp, 6, generator=gen)
        y = torch.randn(BATCH * dp, 5, generator=gen)
        ref = F.mse_loss(plain(x), y)
        ref.backward()
        mine_x, mine_y = x.chunk(dp)[d], y.chunk(dp)[d]  # this replica's rows
        stats = {}
        telemetry.set_enabled(step == STEPS - 1)  # the last step's collectives, counted
        losses = pipeline.run(
            stage,
            list(mine_x.chunk(micro)),
            list(mine_y.chunk(micro)),
            F.mse_loss,
            schedule=schedule,
            stats=stats,
        )
        telemetry.set_enabled(False)
        peak = max(peak, stats["live_peak"])
        norm_err = max(norm_err, _norm_error(plain, opts[1]))
        for opt in opts:
            opt.step()
            opt.zero_grad()
        mean = torch.tensor(sum(losses) / micro)
        dist.all_reduce(mean)
        loss_err = max(loss_err, abs(mean.item() / dist.get_world_size() - ref.item()))
    mine = [i for v in range(virtual) for i in split[v * pipe + topo.pipe_rank]]
    got = [t for c in chunks for t in c.state_dict().values()]  # full tensors, in order
    want = [v for i in mine for v in plain[i].state_dict().values()]
    param_err = max((a - b).abs().max().item() for a, b in zip(got, want))
    kinds = [e["kind"] for e in telemetry.RECORDER.snapshot() if e["type"] == "comm"]
    return {
        "loss": loss_err,
        "params": param_err,
        "peak": peak,
        "norm": norm_err,
        "layers": mine,
        "n": (len(got), len(want)),
        "flat_groups": len(_flat(chunks)),
        "gathers": kinds.count("all_gather"),
        "reductions": kinds.count("reduce_scatter"),
    }


def _norm_error(plain, opt):
    """|OptimManager's global gradient norm of the pipelined model - the plain model's|
    (each element counted once: a stage's replicated parameters by one of its ranks,
    a tied parameter once). Collective."""
    import nbtrain

    manager = nbtrain.optim.OptimManager()
    manager.add_optimizer(opt)
    ours = manager.clip_grad_norm(1e9)  # a bound never reached: the norm alone
    theirs = torch.nn.utils.clip_grad_norm_(plain.parameters(), 1e9).item()
    return abs(ours - theirs)


def _flat(modules):
    from nbtrain.zero.accumulate import _groups

    return _groups(modules if isinstance(modules, list) else [modules])


def blocklist_script(pipe, zero_level, optimizer):
    """A BMTrain-style script: `import nbtrain as bmt`, a DistributedModule whose middle
    is a PipelineTransformerBlockList of Blocks, every rank passing its own batch slice;
    against the same model on one process with the whole batch."""
    import nbtrain as bmt

    bmt.init_distributed(pipe_size=pipe, num_micro_batches=2)
    world, rank = dist.get_world_size(), dist.get_rank()

    class Layer(nn.Module):
        def __init__(self, width):
            super().__init__()
            self.linear = nn.Linear(8, 8)
            self.norm = nn.LayerNorm(8)

        def forward(self, x):
            return x + torch.tanh(self.linear(self.norm(x)))

    class Plain(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed, self.head = nn.Linear(4, 8), nn.Linear(8, 3)
            self.layers = nn.ModuleList(Layer(8) for _ in range(5))

        def forward(self, x):
            h = self.embed(x)
            for layer in self.layers:
                h = layer(h)
            return self.head(h)

    class Model(bmt.DistributedModule):
        def __init__(self, plain):
            super().__init__()
            self.embed, self.head = copy.deepcopy(plain.embed), copy.deepcopy(plain.head)
            self.layers = bmt.PipelineTransformerBlockList(
                [
                    bmt.Block(copy.deepcopy(m), zero_level=zero_level, mode="PIPE")
                    for m in plain.layers
                ]
            )

        def forward(self, x):
            return self.head(self.layers(self.embed(x)))

    torch.manual_seed(0)
    plain = Plain()
    model = Model(plain)
    opts = [_optimizer(plain.parameters(), optimizer), _optimizer(model.parameters(), optimizer)]
    gen = torch.Generator().manual_seed(3)
    loss_err = 0.0
    bmt.telemetry.RECORDER.clear()
    for step in range(STEPS):
        x = torch.randn(2 * world, 4, generator=gen)
        y = torch.randn(2 * world, 3, generator=gen)
        ref = F.mse_loss(plain(x), y)
        ref.backward()
        bmt.telemetry.set_enabled(step == STEPS - 1)  # the last step's collectives, counted
        loss = F.mse_loss(model(x.chunk(world)[rank]), y.chunk(world)[rank])  # my rows
        loss.backward()
        bmt.telemetry.set_enabled(False)
        for opt in opts:
            opt.step()
            opt.zero_grad()
        loss_err = max(loss_err, abs(bmt.sum_loss(loss).item() - ref.item()))
    state, ref_state = model.state_dict(), plain.state_dict()
    param_err = max((state[k] - ref_state[k]).abs().max().item() for k in state)
    blocks = [
        e
        for e in bmt.telemetry.RECORDER.snapshot()  # the Blocks' own collectives
        if e["type"] == "comm" and not e["label"].startswith("pp ")
    ]
    return {
        "loss": loss_err,
        "params": param_err,
        "keys": sorted(state),
        "local": list(model.layers.local),
        "flat_groups": len(_flat(model.layers)),
        "gathers": sum(e["kind"] == "all_gather" for e in blocks),
        "reductions": sum(e["kind"] == "reduce_scatter" for e in blocks),
    }


def gpt_pipeline(pipe, schedule, optimizer, tp=1, zero_level=None):
    """A GPT whose token embedding is also its output projection, cut into `pipe` stages
    (the two ends on different stages) and, with tp > 1, tensor-parallelised first;
    10 steps against the GPT on one process. Compares this stage's parameters, gathered
    over tp into full tensors under the plain names."""
    import nbtrain

    nbtrain.init_distributed(tp_size=tp, pipe_size=pipe)
    return _gpt_parity(schedule, optimizer, zero_level=zero_level, tp=tp)


def gpt_pipe_by_data_parallel(pipe, cases):
    """The tied GPT at pp `pipe` x dp (world // pipe), each replica its own rows, for each
    case (schedule, optimizer, zero_level) in one launch: {case: parity}."""
    import nbtrain
    from nbtrain import pipeline
    from nbtrain.models import GPT, GPTConfig
    from nbtrain.models.gpt_pipe import gpt_layers

    nbtrain.init_distributed(pipe_size=pipe)
    out = {case: _gpt_parity(*case) for case in cases}
    # Unwrapped, nobody averages the stage's copies over its replicas: refused
    stage = pipeline.stage_of(
        gpt_layers(GPT(GPTConfig(vocab_size=32, seq_len=8, hidden=16, heads=2, layers=2)))
    )
    idx = torch.zeros(2, 8, dtype=torch.long)
    try:
        pipeline.run(stage, [idx], [idx], F.mse_loss)
        out["unwrapped"] = "not refused"
    except ValueError as exc:
        out["unwrapped"] = str(exc)
    # stage_of's tie groups are no barrier, and the refusal is at once: a rank that
    # returned, and exited, closed its side of a tie group's gloo mesh while its peer
    # was still connecting ("Connection closed by peer", under load).
    dist.barrier()
    return out


def _gpt_parity(schedule, optimizer, zero_level=None, tp=1):
    """STEPS steps of the tied GPT through the pipeline (schedule "interleaved": two
    chunks per rank) against the GPT on this process with the whole batch; with
    zero_level, each stage (or chunk) wrapped for ZeRO over its data-parallel ranks.
    Max |loss difference| and max |parameter difference| of this rank's layers (full
    tensors, plain names)."""
    import nbtrain
    from nbtrain import pipeline
    from nbtrain.models import GPT, GPTConfig
    from nbtrain.models.gpt_pipe import gpt_layers
    from nbtrain.models.gpt_tp import gpt_plan

    topo = nbtrain.get_context().topology
    dp, d = topo.dp_size, topo.dp_rank
    cfg = GPTConfig(vocab_size=32, seq_len=8, hidden=16, heads=2, layers=2)
    torch.manual_seed(0)
    plain = GPT(cfg)
    model = copy.deepcopy(plain)
    if tp > 1:
        model = nbtrain.parallelize(model, gpt_plan(cfg))
    if schedule == "interleaved":
        chunks = list(pipeline.stages_of(gpt_layers(model), virtual=2))
    else:
        chunks = [pipeline.stage_of(gpt_layers(model))]
    if zero_level is not None:
        chunks = [nbtrain.wrap(c, zero_level=zero_level) for c in chunks]
    ties = sum(len(c.ties) for c in chunks)
    stage = chunks if schedule == "interleaved" else chunks[0]
    params = [p for c in chunks for p in c.parameters()]
    # Adam's first step moves an element by lr * g / (|g| + eps): the GPT's second MLP
    # has an element with |g| = 7e-10, where the replicas' sum in another order differs
    # by ~1e-10, which eps = 1e-8 turns into 6e-5 of parameter; eps = 1e-6 keeps that
    # under 1e-6 and SGD checks the gradients' exact scale.
    eps = 1e-6 if dp > 1 else 1e-8
    opts = [_optimizer(plain.parameters(), optimizer, eps), _optimizer(params, optimizer, eps)]
    gen = torch.Generator().manual_seed(2)
    loss_err, micro, norm_err = 0.0, MICRO, 0.0

    def loss_fn(logits, target):
        return F.cross_entropy(logits.reshape(-1, cfg.vocab_size), target.reshape(-1))

    for _ in range(STEPS):
        idx = torch.randint(0, cfg.vocab_size, (micro * 2 * dp, 8), generator=gen)
        target = torch.randint(0, cfg.vocab_size, (micro * 2 * dp, 8), generator=gen)
        ref = plain.loss(idx, target)
        ref.backward()
        mine_idx, mine_target = idx.chunk(dp)[d], target.chunk(dp)[d]  # this replica's rows
        losses = pipeline.run(
            stage,
            list(mine_idx.chunk(micro)),
            list(mine_target.chunk(micro)),
            loss_fn,
            schedule=schedule,
        )
        norm_err = max(norm_err, _norm_error(plain, opts[1]))
        for opt in opts:
            opt.step()
            opt.zero_grad()
        mean = torch.tensor(sum(losses) / micro)
        if dp > 1:
            dist.all_reduce(mean, group=topo.group("dp"))
        loss_err = max(loss_err, abs(mean.item() / dp - ref.item()))
    ref_state = nn.Sequential(*gpt_layers(plain)).state_dict()
    if tp > 1:  # the tp slices gathered into full tensors under the plain names
        mine = {id(p) for p in params}
        names = [n for n, p in model.named_parameters() if id(p) in mine]
        state, ref_state = model.state_dict(), plain.state_dict()
    else:
        state = {k: v for c in chunks for k, v in c.state_dict().items()}
        names = list(state)
    param_err = max((state[n] - ref_state[n]).abs().max().item() for n in names)
    return {
        "loss": loss_err,
        "params": param_err,
        "checked": len(names),
        "ties": ties,
        "norm": norm_err,
    }


# -- PipelineTransformerBlockList state dicts (test_pipeline_state_dict.py) ---------------

SD_VOCAB, SD_WIDTH, SD_LAYERS, SD_STEPS = 16, 8, 4, 4


class _SdLayer(nn.Module):
    """A tiny residual layer with a persistent buffer (state dicts carry buffers too)."""

    def __init__(self, index):
        super().__init__()
        self.norm = nn.LayerNorm(SD_WIDTH)
        self.linear = nn.Linear(SD_WIDTH, SD_WIDTH)
        self.register_buffer("gain", torch.full((SD_WIDTH,), 0.5 + 0.1 * index))

    def forward(self, x):
        return x + self.gain * torch.tanh(self.linear(self.norm(x)))


class _SdPlain(nn.Module):
    """Embedding, SD_LAYERS layers, head: the plain model the pipelined ones match."""

    def __init__(self, seed, frozen_embed=False):
        super().__init__()
        torch.manual_seed(seed)
        self.embed = nn.Embedding(SD_VOCAB, SD_WIDTH)
        self.embed.weight.requires_grad_(not frozen_embed)
        self.layers = nn.ModuleList(_SdLayer(i) for i in range(SD_LAYERS))
        self.head = nn.Linear(SD_WIDTH, SD_VOCAB)

    def forward(self, ids):
        h = self.embed(ids)
        for layer in self.layers:
            h = layer(h)
        return self.head(h)


def _sd_model(plain, make):
    """The pipelined copy of `plain`: its layers made blocks by `make` ("pipe":
    Block(layer, mode="PIPE"), checkpointing; "block": the same without checkpointing;
    "plain": the layer itself)."""
    import nbtrain as bmt

    wrap = {
        "pipe": lambda m: bmt.Block(m, mode="PIPE"),
        "block": lambda m: bmt.Block(m, use_checkpoint=False, mode="PIPE"),
        "plain": lambda m: m,
    }[make]

    class Model(bmt.DistributedModule):
        def __init__(self):
            super().__init__()
            self.embed, self.head = copy.deepcopy(plain.embed), copy.deepcopy(plain.head)
            self.layers = bmt.PipelineTransformerBlockList(
                [wrap(copy.deepcopy(m)) for m in plain.layers]
            )

        def forward(self, ids):
            return self.head(self.layers(self.embed(ids)))

    return Model()


def _sd_batch(gen, rows):
    ids = torch.randint(0, SD_VOCAB, (rows, 3), generator=gen)
    return ids, torch.randint(0, SD_VOCAB, (rows, 3), generator=gen)


def _sd_loss(logits, target):
    return F.cross_entropy(logits.reshape(-1, SD_VOCAB), target.reshape(-1))


def _sd_compare(state, ref, what):
    """Same keys, values within assert_close's float32 tolerance; the largest error."""
    assert sorted(state) == sorted(ref), (what, sorted(set(state) ^ set(ref)))
    for k in ref:
        torch.testing.assert_close(state[k].cpu(), ref[k], msg=lambda m, k=k: f"{what} {k}: {m}")
    return max((state[k].cpu() - ref[k]).abs().max().item() for k in ref)


def state_dict_after_training(pipe, optimizer):
    """Pipelined models (layers as Block(mode="PIPE") checkpointing or not, plain modules; and one with
    a frozen embedding, so the list's input needs no gradient) trained SD_STEPS steps
    with every rank's slice, against the plain model on this process with the whole
    batch. Every rank's state_dict() must be the plain model's: every key, equal
    values. Returns per variant the keys, the largest error and this rank's layers."""
    import nbtrain as bmt

    bmt.init_distributed(pipe_size=pipe, num_micro_batches=2)
    world, rank = dist.get_world_size(), dist.get_rank()
    variants = [("pipe", False), ("block", False), ("plain", False), ("pipe", True)]
    runs = []
    for make, frozen in variants:
        plain = _SdPlain(0, frozen_embed=frozen)
        model = _sd_model(plain, make)
        opts = [
            _optimizer([p for p in m.parameters() if p.requires_grad], optimizer)
            for m in (plain, model)
        ]
        runs.append((plain, model, opts))
    gen = torch.Generator().manual_seed(3)
    for _ in range(SD_STEPS):
        ids, target = _sd_batch(gen, 2 * world)
        for plain, model, opts in runs:
            _sd_loss(plain(ids), target).backward()
            _sd_loss(model(ids.chunk(world)[rank]), target.chunk(world)[rank]).backward()
            for opt in opts:
                opt.step()
                opt.zero_grad()
    out = {}
    for (make, frozen), (plain, model, _) in zip(variants, runs):
        what = f"{make}{' frozen embed' if frozen else ''}"
        state = model.state_dict()
        out[what] = {
            "keys": list(state),
            "plain_keys": list(plain.state_dict()),
            "err": _sd_compare(state, plain.state_dict(), what),
            "local": list(model.layers.local),
            "stage_keys": sorted(model.layers.stage_state_dict()),
        }
    return out


def state_dict_loading(pipe):
    """A pipelined model (Block(mode="PIPE")) loads a plain model's state dict, strict,
    on every stage; its logits and loss are then the plain model's. Loads lacking a key
    or with bogus keys: what each raises or reports (collected, every rank)."""
    import nbtrain as bmt

    bmt.init_distributed(pipe_size=pipe, num_micro_batches=2)
    world, rank = dist.get_world_size(), dist.get_rank()
    model = _sd_model(_SdPlain(0), "pipe")
    plain = _SdPlain(7)  # other values everywhere, buffers included
    for i, layer in enumerate(plain.layers):
        layer.gain.fill_(2.0 + i)
    full = plain.state_dict()
    result = model.load_state_dict(full, strict=True)
    out = {
        "missing": list(result.missing_keys),
        "unexpected": list(result.unexpected_keys),
        "local": list(model.layers.local),
    }
    ids, target = _sd_batch(torch.Generator().manual_seed(4), 2 * world)
    with torch.no_grad():
        ref_logits = plain(ids)
    logits = model(ids.chunk(world)[rank])
    torch.testing.assert_close(logits.detach(), ref_logits.chunk(world)[rank])
    loss = _sd_loss(logits, target.chunk(world)[rank])
    torch.testing.assert_close(bmt.sum_loss(loss), _sd_loss(ref_logits, target))
    out["after"] = _sd_compare(model.state_dict(), full, "after load")
    for key in ("layers.0.linear.weight", f"layers.{SD_LAYERS - 1}.gain", "head.bias"):
        lacking = {k: v for k, v in full.items() if k != key}
        out[f"non-strict without {key}"] = list(
            model.load_state_dict(lacking, strict=False).missing_keys
        )
        try:
            model.load_state_dict(lacking, strict=True)
            out[f"strict without {key}"] = "loaded"
        except RuntimeError as err:
            out[f"strict without {key}"] = str(err)
    bogus = {
        **full,
        "layers.1.bogus": full["head.bias"],
        f"layers.{SD_LAYERS}.linear.weight": full["layers.0.linear.weight"],
        "layers.extra": full["head.bias"],
    }
    out["non-strict bogus"] = list(model.load_state_dict(bogus, strict=False).unexpected_keys)
    try:
        model.load_state_dict(bogus, strict=True)
        out["strict bogus"] = "loaded"
    except RuntimeError as err:
        out["strict bogus"] = str(err)
    out["still"] = _sd_compare(model.state_dict(), full, "after the failed loads")
    return out


def state_dict_checkpoint(pipe, folder):
    """nbtrain.save / nbtrain.load of a model holding a PipelineTransformerBlockList (each
    stage writes its own layers), safetensors and BMTrain's .pt, after SD_STEPS of SGD:
    a fresh model loads the files and its state dict is the trained one. Returns rank 0's
    plain reference state dict."""
    import nbtrain as bmt

    bmt.init_distributed(pipe_size=pipe, num_micro_batches=2)
    world, rank = dist.get_world_size(), dist.get_rank()
    plain = _SdPlain(0)
    model = _sd_model(plain, "pipe")
    opts = [_optimizer(m.parameters(), "sgd") for m in (plain, model)]
    gen = torch.Generator().manual_seed(5)
    for _ in range(SD_STEPS):
        ids, target = _sd_batch(gen, 2 * world)
        _sd_loss(plain(ids), target).backward()
        _sd_loss(model(ids.chunk(world)[rank]), target.chunk(world)[rank]).backward()
        for opt in opts:
            opt.step()
            opt.zero_grad()
    ref = plain.state_dict()
    out = {}
    for name in ("model.safetensors", "model.pt"):
        path = f"{folder}/{name}"
        bmt.save(model, path)
        fresh = _sd_model(_SdPlain(9), "pipe")
        result = bmt.load(fresh, path)
        out[name] = {
            "missing": list(result.missing_keys),
            "unexpected": list(result.unexpected_keys),
            "err": _sd_compare(fresh.state_dict(), ref, f"loaded {name}"),
        }
    out["ref"] = ref if rank == 0 else None
    return out
