"""Rank functions for test_tensor_parallel.py: each tp layer against the plain layer."""

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn


def _err(a, b):
    return (a.detach().float() - b.detach().float()).abs().max().item()


def layer_errors():
    """Max |tp - plain| for outputs, input grads and weight grads of every layer and flag."""
    import nbtrain
    from nbtrain.nn import ColumnParallelLinear, RowParallelLinear, VPEmbedding

    topo = nbtrain.init_distributed(tp_size=dist.get_world_size()).topology
    tp, r = topo.tp_size, topo.tp_rank

    def rows(t):
        return t.chunk(tp, 0)[r]

    def cols(t):
        return t.chunk(tp, -1)[r]

    errs = {}
    gen = torch.Generator().manual_seed(11)
    B, S = 6, 3  # the batch splits over tp 2 and 3
    X = torch.randn(B, S, 7, generator=gen)
    for gi in (True, False):
        for go in (False, True):
            torch.manual_seed(5)
            layer = ColumnParallelLinear(7, 6, gather_input=gi, gather_output=go)
            torch.manual_seed(5)
            ref = nn.Linear(7, 6)
            G = torch.randn(B, S, 6, generator=gen)
            xr = X.clone().requires_grad_()
            (ref(xr) * G).sum().backward()
            x = (rows(X) if gi else X).clone().requires_grad_()
            y = layer(x)
            (y * (G if go else cols(G))).sum().backward()
            key = f"column gather_input={gi} gather_output={go}"
            expected = ref(X) if go else cols(ref(X))
            errs[key] = max(
                _err(y, expected),
                _err(x.grad, rows(xr.grad) if gi else xr.grad),
                _err(layer.weight.grad, rows(ref.weight.grad)),
                _err(layer.bias.grad, rows(ref.bias.grad)),
            )
    X2 = torch.randn(B, S, 6, generator=gen)
    for split in (False, True):
        for aro in (False, True):
            torch.manual_seed(6)
            layer = RowParallelLinear(6, 5, split_input=split, all_reduce_output=aro)
            torch.manual_seed(6)
            ref = nn.Linear(6, 5)
            G = torch.randn(B, S, 5, generator=gen)
            xr = X2.clone().requires_grad_()
            (ref(xr) * G).sum().backward()
            if split:
                x_in, grad_ref = rows(X2), rows(xr.grad)  # gathered, then split
            else:
                x_in, grad_ref = cols(X2), cols(xr.grad)
            x = x_in.clone().requires_grad_()
            y = layer(x)
            (y * (G if aro else rows(G))).sum().backward()
            key = f"row split_input={split} all_reduce_output={aro}"
            errs[key] = max(
                _err(y, ref(X2) if aro else rows(ref(X2))),
                _err(x.grad, grad_ref),
                _err(layer.weight.grad, cols(ref.weight.grad)),
                _err(layer.bias.grad, ref.bias.grad),
            )
    # Vocabulary 11: padded to 12 at tp 2 and 3.
    V, E = 11, 5
    torch.manual_seed(7)
    emb = VPEmbedding(V, E)
    torch.manual_seed(7)
    W = torch.empty(V, E).normal_(0.0, 1.0).requires_grad_()
    ids = torch.randint(0, V, (B, S), generator=gen)
    G = torch.randn(B, S, E, generator=gen)
    (F.embedding(ids, W) * G).sum().backward()
    out = emb(rows(ids))
    (out * rows(G)).sum().backward()
    W_pad = torch.cat([W.grad, torch.zeros(1, E)])
    errs["embedding"] = max(
        _err(out, F.embedding(rows(ids), W)), _err(emb.weight.grad, rows(W_pad))
    )
    # The tied projection and the parallel loss (ignore_index, label smoothing).
    emb.weight.grad = None
    W.grad = None
    H = torch.randn(B, S, E, generator=gen)
    target = torch.randint(0, V, (B, S), generator=gen)
    target[0, :2] = -100
    class_weight = torch.rand(V, generator=gen) + 0.5  # one per real class, not the pad
    for smoothing, weight in ((0.0, None), (0.1, None), (0.0, class_weight), (0.1, class_weight)):
        hr = H.clone().requires_grad_()
        full = F.linear(hr, W)
        ref_loss = F.cross_entropy(
            full.reshape(-1, V),
            target.reshape(-1),
            weight=weight,
            ignore_index=-100,
            label_smoothing=smoothing,
        )
        ref_loss.backward()
        h = rows(H).clone().requires_grad_()
        logits = emb(h, projection=True)
        loss = nbtrain.nn.FusedCrossEntropy(
            weight, ignore_index=-100, label_smoothing=smoothing, parallel=True
        )(logits, target)
        loss.backward()
        finite = torch.isfinite(logits)
        full_padded = torch.cat([full, torch.full((B, S, 1), float("-inf"))], dim=-1)
        name = "" if weight is None else ", class weights"
        errs[f"projection + parallel loss, smoothing {smoothing}{name}"] = max(
            _err(logits[finite], cols(full_padded)[finite]),
            _err(loss, ref_loss),
            _err(h.grad, rows(hr.grad)),
            _err(emb.weight.grad, rows(torch.cat([W.grad, torch.zeros(1, E)]))),
        )
        emb.weight.grad = W.grad = None
    return errs


def training_errors(sequence_parallel, optimizer, tp_size=None, zero_level=None):
    """A tiny tp model (vocab-parallel embedding, column and row layers, tied projection,
    parallel loss) trained 5 steps against the plain model on this process. With
    tp_size below the world size, the data-parallel replicas take slices of the batch.
    With a zero_level the norm and the tp layers live in a Block (ZeRO over dp)."""
    import nbtrain
    from nbtrain.nn import ColumnParallelLinear, FusedCrossEntropy, RowParallelLinear, VPEmbedding

    topo = nbtrain.init_distributed(tp_size=tp_size or dist.get_world_size()).topology
    tp, r = topo.tp_size, topo.tp_rank
    dp, dp_rank = topo.dp_size, topo.dp_rank
    sp = sequence_parallel
    V, E, H = 11, 6, 12

    class FFN(nn.Module):
        def __init__(self):
            super().__init__()
            self.norm = nbtrain.nn.LayerNorm(E, sequence_parallel=sp)  # on token slices
            self.up = ColumnParallelLinear(E, H, gather_input=sp)
            self.down = RowParallelLinear(H, E, all_reduce_output=not sp)

        def forward(self, h):
            return self.down(torch.relu(self.up(self.norm(h))))

    class TinyTP(nbtrain.DistributedModule):
        def __init__(self):
            super().__init__()
            self.emb = VPEmbedding(V, E)
            self.ffn = FFN() if zero_level is None else nbtrain.Block(FFN(), zero_level)

        def forward(self, ids):
            h = self.emb(ids, sequence_parallel=sp)
            h = h + self.ffn(h)
            return self.emb(h, projection=True, sequence_parallel=sp)

    class PlainFFN(nn.Module):
        def __init__(self):
            super().__init__()
            self.norm = nn.LayerNorm(E)
            self.up, self.down = nn.Linear(E, H), nn.Linear(H, E)

        def forward(self, h):
            return self.down(torch.relu(self.up(self.norm(h))))

    class Plain(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(V, E)
            self.ffn = PlainFFN()

        def forward(self, ids):
            h = self.emb(ids)
            h = h + self.ffn(h)
            return F.linear(h, self.emb.weight)

    torch.manual_seed(3)
    model = TinyTP()
    torch.manual_seed(3)
    plain = Plain()

    def make(params):
        if optimizer == "sgd":
            return torch.optim.SGD(params, lr=0.1, momentum=0.9)
        return torch.optim.AdamW(params, lr=0.01, weight_decay=0.1)

    opt, plain_opt = make(model.parameters()), make(plain.parameters())
    loss_fn = FusedCrossEntropy(parallel=True)
    manager = nbtrain.optim.OptimManager(loss_scale=None)
    manager.add_optimizer(opt)
    gen = torch.Generator().manual_seed(4)
    loss_err = norm_err = 0.0
    for _ in range(5):
        ids = torch.randint(0, V, (6 * dp, 3), generator=gen)
        target = torch.randint(0, V, (6 * dp, 3), generator=gen)
        mine, my_target = ids.chunk(dp, 0)[dp_rank], target.chunk(dp, 0)[dp_rank]
        logits = model(mine.chunk(tp, 0)[r] if sp else mine)
        loss = loss_fn(logits, my_target)
        loss.backward()
        norm = manager.clip_grad_norm(1e9)  # the global norm, over tp and dp
        opt.step()
        opt.zero_grad()
        loss = loss.detach().clone()
        dist.all_reduce(loss)  # the mean over replicas (tp ranks agree)
        loss /= dist.get_world_size()
        ref = F.cross_entropy(plain(ids).reshape(-1, V), target.reshape(-1))
        ref.backward()
        ref_norm = torch.nn.utils.clip_grad_norm_(plain.parameters(), 1e9).item()
        norm_err = max(norm_err, abs(norm - ref_norm))
        plain_opt.step()
        plain_opt.zero_grad()
        loss_err = max(loss_err, _err(loss, ref))
    # state_dict: full tensors under the plain names, both ways.
    state = model.state_dict()
    state_err = max(_err(state[k], v) for k, v in plain.state_dict().items())
    if zero_level is None:  # each rank's slices, one by one
        W = plain.emb.weight.detach()
        W_pad = torch.cat([W, torch.zeros(1, E)]) if (V % tp) else W
        f, pf = model.ffn, plain.ffn
        param_err = max(
            _err(model.emb.weight, W_pad.chunk(tp, 0)[r]),
            _err(f.up.weight, pf.up.weight.chunk(tp, 0)[r]),
            _err(f.up.bias, pf.up.bias.chunk(tp, 0)[r]),
            _err(f.down.weight, pf.down.weight.chunk(tp, 1)[r]),
            _err(f.down.bias, pf.down.bias),
            _err(f.norm.weight, pf.norm.weight),
            _err(f.norm.bias, pf.norm.bias),
        )
    else:  # in a Block: the gathered state is every final parameter
        param_err = state_err
    fresh = Plain()
    fresh.load_state_dict(state)
    torch.manual_seed(99)
    again = TinyTP()
    again.load_state_dict(plain.state_dict())
    state_err = max(
        state_err, max(_err(a, b) for a, b in zip(again.parameters(), model.parameters()))
    )
    return {
        "loss": loss_err,
        "params": param_err,
        "state": state_err,
        "norm": norm_err,
        "keys": sorted(state) == sorted(plain.state_dict()),
    }


def telemetry_kinds():
    """The comm kinds telemetry records for one tensor-parallel step."""
    import nbtrain
    from nbtrain import telemetry
    from nbtrain.nn import ColumnParallelLinear, RowParallelLinear

    nbtrain.init_distributed(tp_size=dist.get_world_size())
    telemetry.set_enabled(True)
    up, down = ColumnParallelLinear(4, 8), RowParallelLinear(8, 4)
    x = torch.randn(4, 4).requires_grad_()
    down(up(x)).sum().backward()
    x = torch.ones(2)
    dist.all_reduce(x)  # not through nbtrain: not counted
    telemetry.next_step()
    kinds = sorted(telemetry.summary()["steps"][-1]["comm"])
    telemetry.set_enabled(False)
    return kinds


def checkpoints(folder):
    """nbtrain.save of a tp model is the plain model's file."""
    import nbtrain
    from nbtrain.nn import ColumnParallelLinear

    nbtrain.init_distributed(tp_size=2)
    torch.manual_seed(0)
    layer = ColumnParallelLinear(4, 6)
    torch.manual_seed(0)
    plain = nn.Linear(4, 6)
    nbtrain.save(layer, f"{folder}/layer.safetensors")
    torch.manual_seed(1)
    again = ColumnParallelLinear(4, 6)
    nbtrain.load(again, f"{folder}/layer.safetensors")
    out = {"same": bool(torch.equal(again.weight, layer.weight))}
    from safetensors.torch import load_file

    saved = load_file(f"{folder}/layer.safetensors")
    out["plain"] = bool(torch.equal(saved["weight"], plain.weight.detach()))
    return out


def _tiny_tp_model():
    import nbtrain
    from nbtrain.nn import ColumnParallelLinear, RowParallelLinear, VPEmbedding

    class TinyTP(nbtrain.DistributedModule):
        def __init__(self):
            super().__init__()
            self.emb = VPEmbedding(11, 6)
            self.up = ColumnParallelLinear(6, 12)
            self.down = RowParallelLinear(12, 6)

    return TinyTP()


def save_at(folder, tp_size):
    """Save a model made at this layout (seed 3) with nbtrain.save; return its state."""
    import nbtrain

    nbtrain.init_distributed(tp_size=tp_size)
    torch.manual_seed(3)
    model = _tiny_tp_model()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.5)  # not what a fresh model at seed 3 holds
    nbtrain.save(model, f"{folder}/model.safetensors")
    return {k: v.clone() for k, v in model.state_dict().items()}


def load_at(folder, tp_size):
    """Load the file into a model made at this layout; return its (gathered) state."""
    import nbtrain

    nbtrain.init_distributed(tp_size=tp_size)
    torch.manual_seed(7)
    model = _tiny_tp_model()
    nbtrain.load(model, f"{folder}/model.safetensors")
    return {k: v.clone() for k, v in model.state_dict().items()}
