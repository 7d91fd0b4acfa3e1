"""A model's own forward reads a parameter outside its Blocks whole, as in BMTrain.

BMTrain's test_model_wrapper and test_training GPT ties its head to the embedding
by reading `self.word_emb.weight` in the model's forward, outside the embedding's
own forward. After `BMTrainModelWrapper` (or `wrap`) that read must give the full
matrix, not this rank's shard, and its gradient must join the embedding's. Checked
against the plain model on one process, trained on the whole batch while each rank
trains on its slice, with SGD (momentum) and AdamW.
"""

import pytest
import torch
import torch.nn.functional as F
from support.ranks import run_ranks
from torch import nn

import nbtrain as bmt

VOCAB, DIM, BATCH_PER_RANK, SEQ, STEPS = 11, 6, 2, 5, 3


class TiedLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList([nn.Linear(DIM, DIM) for _ in range(2)])

    def forward(self, tokens):
        h = self.emb(tokens)
        for layer in self.layers:
            h = torch.tanh(layer(h))
        return F.linear(h, self.emb.weight)  # the head: the embedding, read by the root


def _model():
    torch.manual_seed(7)
    return TiedLM()


def _batch(world):
    torch.manual_seed(11)
    tokens = torch.randint(0, VOCAB, (STEPS, world * BATCH_PER_RANK, SEQ))
    return tokens, tokens.roll(-1, dims=-1)


def _optimizer(name, params):
    if name == "sgd":
        return torch.optim.SGD(params, lr=0.1, momentum=0.9)
    return torch.optim.AdamW(params, lr=0.02, weight_decay=0.01)


def _train(model, optim, tokens, targets):
    losses = []
    opt = _optimizer(optim, model.parameters())
    for step in range(STEPS):
        logits = model(tokens[step])
        loss = F.cross_entropy(logits.reshape(-1, VOCAB), targets[step].reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def _rank_run(optim, wrapper):
    ctx = bmt.init_distributed()
    model = _model()
    model = bmt.BMTrainModelWrapper(model) if wrapper == "bmtrain" else bmt.wrap(model)
    tokens, targets = _batch(ctx.world_size)
    rows = slice(ctx.rank * BATCH_PER_RANK, (ctx.rank + 1) * BATCH_PER_RANK)
    losses = _train(model, optim, tokens[:, rows], targets[:, rows])
    losses = torch.tensor(losses)
    torch.distributed.all_reduce(losses)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    return (losses / ctx.world_size).tolist(), state


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("optim", ["sgd", "adamw"])
@pytest.mark.parametrize("wrapper", ["bmtrain", "wrap"])
def test_the_root_reads_a_tied_head_whole_and_trains_as_one_process(world, optim, wrapper):
    tokens, targets = _batch(world)
    plain = _model()
    ref_losses = _train(plain, optim, tokens, targets)
    results = run_ranks(_rank_run, world, optim, wrapper, timeout_s=120)
    for losses, state in results:
        assert losses == pytest.approx(ref_losses, abs=1e-5)
        for key, ref in plain.state_dict().items():
            assert state[key].shape == ref.shape, key
            assert torch.allclose(state[key], ref, atol=1e-5), key
