"""A BMTrain tensor-parallel training script with only its import changed.

Run by test_tensor_parallel.py on 2 ranks: `main()` trains and returns the losses
and the rank's final parameter slices; `plain()` trains the same model with plain
PyTorch on one process.
"""

import torch
import torch.nn.functional as F

import nbtrain as bmt  # was: import bmtrain as bmt

VOCAB, DIM, FFN, STEPS = 13, 8, 16, 4


class Model(bmt.DistributedModule):
    def __init__(self):
        super().__init__()
        self.embed = bmt.nn.VPEmbedding(VOCAB, DIM, dtype=torch.float32)
        self.w_in = bmt.nn.ColumnParallelLinear(DIM, FFN)
        self.w_out = bmt.nn.RowParallelLinear(FFN, DIM)

    def forward(self, ids):
        h = self.embed(ids)
        h = h + self.w_out(torch.relu(self.w_in(h)))
        return self.embed(h, projection=True)


def batches():
    gen = torch.Generator().manual_seed(9)
    for _ in range(STEPS):
        yield (
            torch.randint(0, VOCAB, (4, 5), generator=gen),
            torch.randint(0, VOCAB, (4, 5), generator=gen),
        )


def main():
    bmt.init_distributed(seed=1, tp_size=2)
    model = Model()
    loss_func = bmt.loss.FusedCrossEntropy(ignore_index=-100, parallel=True)
    optimizer = bmt.optim.AdamOptimizer(model.parameters(), lr=1e-2, weight_decay=1e-2)
    optim_manager = bmt.optim.OptimManager(loss_scale=None)
    optim_manager.add_optimizer(optimizer)
    tp, tp_rank = bmt.config["tp_size"], bmt.config["tp_rank"]
    losses = []
    for ids, target in batches():
        optim_manager.zero_grad()
        logits = model(ids.chunk(tp, dim=0)[tp_rank])  # each tp rank: its rows
        loss = loss_func(logits, target)
        optim_manager.backward(loss)
        optim_manager.step()
        losses.append(loss.item())
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}


def plain():
    torch.manual_seed(1)
    embed = torch.nn.Embedding(VOCAB, DIM)
    w_in, w_out = torch.nn.Linear(DIM, FFN), torch.nn.Linear(FFN, DIM)
    params = [embed.weight, w_in.weight, w_in.bias, w_out.weight, w_out.bias]
    # BMTrain's AdamOptimizer on fp32 parameters: weight decay as L2, torch's Adam.
    optimizer = torch.optim.Adam(params, lr=1e-2, weight_decay=1e-2)
    losses = []
    for ids, target in batches():
        optimizer.zero_grad()
        h = embed(ids)
        h = h + w_out(torch.relu(w_in(h)))
        loss = F.cross_entropy(F.linear(h, embed.weight).reshape(-1, VOCAB), target.reshape(-1))
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses, {
        "embed.weight": embed.weight,
        "w_in.weight": w_in.weight,
        "w_in.bias": w_in.bias,
        "w_out.weight": w_out.weight,
        "w_out.bias": w_out.bias,
    }
