"""tutorials/bmtrain_example: a BMTrain training script in BMTrain's own example style.

1. It runs as a script under torchrun on 2 CPU ranks (tp_size=2) and writes BMTrain's
   checkpoint format: the full state dict, torch.load-able with weights_only=True.
2. Its steps match a plain-PyTorch GPT on one process: the script's own main()
   (AdamOffloadOptimizer, Noam, loss scale 2**20, clipping) against torch Adam, and
   the same model with torch.optim.SGD(momentum=0.9) against plain SGD: every gradient
   exact, the tensor-parallel layers' and the replicated Layernorm's and position
   embedding's (partial on each tp rank, summed over tp: nbtrain.tensor_parallel.partial).
3. Its only nbtrain-specific line is the import.
"""

import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from support.ranks import run_ranks
from torch import nn

EXAMPLE = Path(__file__).resolve().parents[2] / "tutorials" / "bmtrain_example"
FILES = ("layers.py", "models.py", "train.py")
IMPORT = "import nbtrain as bmt  # was: import bmtrain as bmt"


def _example():
    """The example's modules, imported as the script imports them (its folder first).

    For a rank of run_ranks(..., backend="gloo"): the script picks CUDA and half
    precision when it sees a GPU; these tests are about its CPU run, on any machine."""
    torch.cuda.is_available = lambda: False
    if str(EXAMPLE) not in sys.path:
        sys.path.insert(0, str(EXAMPLE))
    import models
    import train

    return train, models


# -- the same GPT in plain PyTorch, under the example's parameter names -------------


class PlainAttention(nn.Module):
    def __init__(self, dim_model, dim_head, num_heads):
        super().__init__()
        inner = dim_head * num_heads
        self.project_q = nn.Linear(dim_model, inner)
        self.project_k = nn.Linear(dim_model, inner)
        self.project_v = nn.Linear(dim_model, inner)
        self.project_out = nn.Linear(inner, dim_model)
        self.dim_head, self.num_heads = dim_head, num_heads

    def forward(self, x, mask):
        b, s, _ = x.shape
        q, k, v = (
            p(x).view(b, s, self.num_heads, self.dim_head).transpose(1, 2)
            for p in (self.project_q, self.project_k, self.project_v)
        )
        score = q @ k.transpose(-1, -2) / math.sqrt(self.dim_head)
        score = score.masked_fill(~mask[:, None], float("-inf"))
        prob = torch.where(mask[:, None], score.softmax(-1), torch.zeros_like(score))
        return self.project_out((prob @ v).transpose(1, 2).reshape(b, s, -1))


class PlainLayer(nn.Module):
    def __init__(self, dim_model, dim_head, num_heads, dim_ff):
        super().__init__()
        self.ln_attn = nn.LayerNorm(dim_model)
        self.attn = PlainAttention(dim_model, dim_head, num_heads)
        self.ln_ff = nn.LayerNorm(dim_model)
        self.ff = nn.Module()
        self.ff.w_in, self.ff.w_out = nn.Linear(dim_model, dim_ff), nn.Linear(dim_ff, dim_model)

    def forward(self, h, mask):
        h = h + self.attn(self.ln_attn(h), mask)
        return h + self.ff.w_out(torch.relu(self.ff.w_in(self.ln_ff(h))))


class PlainGPT(nn.Module):
    def __init__(
        self, num_layers, vocab_size, dim_model, dim_head, num_heads, dim_ff, max_distance
    ):
        super().__init__()
        self.word_emb = nn.Embedding(vocab_size, dim_model)
        self.pos_emb = nn.Embedding(max_distance, dim_model)
        self.transformers = nn.ModuleList(
            PlainLayer(dim_model, dim_head, num_heads, dim_ff) for _ in range(num_layers)
        )
        self.layernorm = nn.LayerNorm(dim_model)

    def forward(self, ids, pos, mask):
        mask_2d = mask[:, None, :] & mask[:, :, None] & (pos[:, None, :] <= pos[:, :, None])
        h = self.word_emb(ids) + self.pos_emb(pos)
        for layer in self.transformers:
            h = layer(h, mask_2d)
        return F.linear(self.layernorm(h), self.word_emb.weight)


def _plain_like(model):
    """A PlainGPT with the example's sizes, holding `model`'s full state dict."""
    emb, pos, first = model.word_emb, model.pos_emb.weight, model.transformers[0]
    plain = PlainGPT(
        len(model.transformers),
        emb.vocab_size,
        emb.embedding_size,
        first.attn.dim_head,
        first.attn.num_heads,
        first.ff.w_in.out_features,
        pos.shape[0],
    )
    plain.load_state_dict(model.state_dict())  # collective: every rank builds one
    return plain


def _noam(step, start_lr=1e-3, warmup=2):
    """The rate of the Noam schedule the example uses, for its `step`-th update."""
    if step <= warmup:
        return start_lr / math.sqrt(warmup) * step / warmup
    return start_lr / math.sqrt(step)


def _plain_steps(plain, batch, steps, optimizer, lr_at=None):
    """Trains `plain` on the example's batch; returns the losses, the gradient norms
    and the first step's gradients (before clipping)."""
    ids, length, targets = batch
    pos = torch.arange(ids.size(1)).repeat(ids.size(0), 1)
    losses, norms, first_grads = [], [], None
    for step in range(steps):
        if lr_at is not None:
            for group in optimizer.param_groups:
                group["lr"] = lr_at(step)
        optimizer.zero_grad()
        logits = plain(ids, pos, pos < length[:, None])
        loss = F.cross_entropy(
            logits.reshape(-1, logits.size(-1)), targets.reshape(-1), ignore_index=-100
        )
        loss.backward()
        if step == 0:
            first_grads = {n: p.grad.clone() for n, p in plain.named_parameters()}
        norms.append(float(torch.nn.utils.clip_grad_norm_(plain.parameters(), 10.0)))
        optimizer.step()
        losses.append(loss.item())
    return losses, norms, first_grads


# -- rank functions (run_ranks: 2 gloo ranks) ------------------------------------------


def _adam_parity(folder):
    """The script's own main() against plain Adam with the same schedule."""
    import nbtrain as bmt

    train, _ = _example()
    bmt.init_distributed(seed=0, tp_size=2)  # what main() starts with: the same model
    start = train.make_model(torch.float32)
    bmt.init_parameters(start)
    plain = _plain_like(start)
    batch = train.make_batch(torch.device("cpu"))

    os.chdir(folder)
    out = train.main()
    # BMTrain's Adam defaults, spelt out: betas, eps, and for these fp32 parameters
    # weight decay as L2 (grad + wd * p), as BMTrain's torch.optim._functional.adam.
    adam = torch.optim.Adam(
        plain.parameters(), lr=0.0, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2
    )
    ref_losses, _, _ = _plain_steps(plain, batch, train.NUM_STEPS, adam, _noam)
    saved = torch.load(os.path.join(folder, out["checkpoint"]), weights_only=True)
    # The key bias's gradient is zero in exact arithmetic (softmax ignores a shift
    # shared by a query's scores): in float32 it is rounding noise near 1e-9, which
    # Adam (eps 1e-8) turns into steps of up to lr. SGD's test below compares it too.
    worst = {
        k: (saved[k] - v).abs().max().item()
        for k, v in plain.state_dict().items()
        if not k.endswith("attn.project_k.bias")
    }
    return out["losses"], ref_losses, worst


SGD_LR = 0.1


def _sgd_parity(steps):
    """The example's model with torch.optim.SGD(momentum=0.9) under OptimManager's loss
    scale and clipping, against plain SGD: gradient-scale errors show here."""
    import nbtrain as bmt

    train, _ = _example()
    bmt.init_distributed(seed=0, tp_size=2)
    model = train.make_model(torch.float32)
    bmt.init_parameters(model)
    plain = _plain_like(model)
    ids, length, targets = batch = train.make_batch(torch.device("cpu"))

    loss_func = bmt.loss.FusedCrossEntropy(ignore_index=-100, parallel=True)
    optimizer = torch.optim.SGD(model.parameters(), lr=SGD_LR, momentum=0.9)
    optim_manager = bmt.optim.OptimManager(loss_scale=2**20)
    optim_manager.add_optimizer(optimizer)
    losses, norms, first_grads = [], [], None
    for step in range(steps):
        before = model.state_dict() if step == 0 else None
        optim_manager.zero_grad()
        pos = torch.arange(ids.size(1)).repeat(ids.size(0), 1)
        logits = model(ids, pos, pos < length[:, None])
        loss = loss_func(logits.view(-1, logits.size(-1)), targets.view(-1))
        losses.append(bmt.sum_loss(loss).item())
        optim_manager.backward(loss)
        norms.append(optim_manager.clip_grad_norm(optimizer.param_groups, max_norm=10.0))
        optim_manager.step()
        if step == 0:  # SGD's first step moves each weight by -lr x its gradient
            after = model.state_dict()
            first_grads = {k: (before[k] - after[k]) / SGD_LR for k in before}
    state = model.state_dict()

    plain_sgd = torch.optim.SGD(plain.parameters(), lr=SGD_LR, momentum=0.9)
    ref_losses, ref_norms, ref_grads = _plain_steps(plain, batch, steps, plain_sgd)
    assert norms[0] < 10.0 and ref_norms[0] < 10.0  # no clipping in the first step
    grad_error = {k: (first_grads[k] - g).abs().max().item() for k, g in ref_grads.items()}
    grad_ratio = {k: (first_grads[k].norm() / g.norm()).item() for k, g in ref_grads.items()}
    param_error = {k: (state[k] - v).abs().max().item() for k, v in plain.state_dict().items()}
    return {
        "losses": losses,
        "ref_losses": ref_losses,
        "norms": norms,
        "ref_norms": ref_norms,
        "grad_error": grad_error,
        "grad_ratio": grad_ratio,
        "param_error": param_error,
    }


# -- the tests ---------------------------------------------------------------------------


def test_the_example_runs_under_torchrun_on_two_cpu_ranks(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env["CUDA_VISIBLE_DEVICES"] = ""  # CPU ranks (gloo, float32) on any machine
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            "2",
            str(EXAMPLE / "train.py"),
        ],
        check=False,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=180,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    losses = [float(x) for x in re.findall(r"\| loss: ([0-9.]+) \|", proc.stdout)]
    assert len(losses) == 6, proc.stdout[-3000:]  # printed once, by rank 0
    assert losses[-1] < losses[0] - 0.1 and losses == sorted(losses, reverse=True), losses
    assert "grad_norm:" in proc.stdout and "scale: 1048576.0000" in proc.stdout
    assert "word_emb.weight" in proc.stdout and "logits" in proc.stdout  # the inspections

    state = torch.load(tmp_path / "checkpoint.pt", weights_only=True)
    shapes = {k: tuple(v.shape) for k, v in state.items()}
    assert shapes["word_emb.weight"] == (64, 16)  # the whole vocabulary: tp slices joined
    assert shapes["pos_emb.weight"] == (8, 16)
    for i in range(2):
        assert shapes[f"transformers.{i}.attn.project_q.weight"] == (16, 16)
        assert shapes[f"transformers.{i}.attn.project_out.weight"] == (16, 16)
        assert shapes[f"transformers.{i}.ff.w_in.weight"] == (32, 16)
        assert shapes[f"transformers.{i}.ff.w_out.weight"] == (16, 32)
        assert shapes[f"transformers.{i}.ln_attn.weight"] == (16,)
    plain = PlainGPT(2, 64, 16, 8, 2, 32, 8)
    assert set(shapes) == set(plain.state_dict())
    plain.load_state_dict(state)  # every key, every full shape
    assert not [k for k in os.listdir(tmp_path) if k != "checkpoint.pt"]  # no parts left


def test_the_example_trains_as_plain_pytorch_with_adam(tmp_path):
    for rank, (losses, ref, worst) in enumerate(
        run_ranks(_adam_parity, 2, str(tmp_path), backend="gloo", timeout_s=120)
    ):
        torch.testing.assert_close(losses, ref, rtol=1e-5, atol=1e-5, msg=f"rank {rank}")
        assert losses[-1] < losses[0], losses
        bad = {k: v for k, v in worst.items() if not v < 1e-5}
        assert not bad, (rank, bad)  # checkpoint.pt against the plain weights


@pytest.fixture(scope="module")
def sgd_runs():
    return run_ranks(_sgd_parity, 2, 4, backend="gloo", timeout_s=120)


def _replicated(name):
    """Parameters every tensor-parallel rank holds whole (not a row-parallel bias)."""
    return name.startswith(("pos_emb.", "layernorm.")) or ".ln_" in name


def test_with_sgd_the_loss_scale_is_undone_and_the_tp_layers_get_exact_gradients(sgd_runs):
    for rank, run in enumerate(sgd_runs):
        assert abs(run["losses"][0] - run["ref_losses"][0]) < 1e-5, rank
        exact = {k: v for k, v in run["grad_error"].items() if not _replicated(k)}
        assert len(exact) == 25  # the vocabulary, 2 x 6 linear layers' weights and biases
        bad = {k: v for k, v in exact.items() if not v < 1e-5}
        assert not bad, f"rank {rank}: {bad}"


def test_the_example_model_trains_as_plain_pytorch_with_sgd_momentum(sgd_runs):
    for rank, run in enumerate(sgd_runs):
        ratios = {k: round(v, 4) for k, v in run["grad_ratio"].items() if _replicated(k)}
        assert all(v == 1.0 for v in ratios.values()), f"rank {rank}: grad ratios {ratios}"
        torch.testing.assert_close(
            run["norms"], run["ref_norms"], rtol=1e-5, atol=1e-5, msg=f"rank {rank}: grad norms"
        )
        torch.testing.assert_close(
            run["losses"], run["ref_losses"], rtol=1e-5, atol=1e-5, msg=f"rank {rank}: losses"
        )
        bad = {k: v for k, v in run["param_error"].items() if not v < 1e-5}
        assert not bad, f"rank {rank}: {bad}"


def test_only_the_import_line_names_nbtrain():
    for name in FILES:
        lines = (EXAMPLE / name).read_text().splitlines()
        mentions = [(i, line) for i, line in enumerate(lines, 1) if "nbtrain" in line.lower()]
        assert [line for _, line in mentions] == [IMPORT], (name, mentions)
        assert not [line for line in lines if re.match(r"\s*(import|from)\s+bmtrain\b", line)]
    assert sorted(p.name for p in EXAMPLE.glob("*.py")) == sorted(FILES)
