"""`Cluster.pull` of a tensor of a sharded model, run on ranks as the engines run it:
a layer of a PipelineTransformerBlockList (held by one stage; the list's state dict is
collective over every rank) and a DistributedParameter a Block holds (it shows only
this rank's part, so the full tensor comes from the block's state dict)."""

import pipeline_cases as pc
import torch
from support.ranks import run_ranks

from nbtrain.notebook import engine_pull


def _pull_on_ranks(names):
    import nbtrain as bmt

    bmt.init_distributed(pipe_size=2, num_micro_batches=2)
    plain = pc._SdPlain(3)
    namespace = {"model": pc._sd_model(plain, "pipe")}
    engine_pull._user_ns = lambda: namespace  # an engine's namespace holds the model here
    out = {}
    for name in names:
        kind = engine_pull.pull_kind(name)
        value = engine_pull.pull_full(name, kind)
        out[name] = (kind, value)
    return out, {n: plain.state_dict()[n[len("model.") :]] for n in names}


def test_pulling_a_pipeline_layers_tensor_gathers_it_on_every_rank():
    names = ["model.layers.0.linear.weight", f"model.layers.{pc.SD_LAYERS - 1}.linear.bias"]
    results = run_ranks(_pull_on_ranks, 2, names, timeout_s=120)
    got, want = results[0]
    for name in names:
        kind, value = got[name]
        assert kind == "state_dict", (name, kind)
        torch.testing.assert_close(value, want[name], msg=name)
    assert all(v is None for _, v in results[1][0].values())  # rank 0 returns it


def _pull_block_member():
    import torch.nn.functional as F
    from torch import nn

    import nbtrain as bmt

    class Linear(bmt.DistributedModule):
        def __init__(self):
            super().__init__()
            self.weight = bmt.DistributedParameter(torch.arange(15.0).view(5, 3))

        def forward(self, x):
            return F.linear(x, self.weight)

    class Model(bmt.DistributedModule):
        def __init__(self):
            super().__init__()
            self.layers = bmt.TransformerBlockList([bmt.Block(Linear()), bmt.Block(nn.Tanh())])

    namespace = {"model": Model()}
    engine_pull._user_ns = lambda: namespace
    kind = engine_pull.pull_kind("model.layers.0.weight")
    return kind, engine_pull.pull_full("model.layers.0.weight", kind)


def test_pulling_a_distributed_parameter_a_block_holds_gives_the_full_tensor():
    kind, value = run_ranks(_pull_block_member, 2, timeout_s=120)[0]
    assert kind == "state_dict"
    assert torch.equal(value, torch.arange(15.0).view(5, 3))
