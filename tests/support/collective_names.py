"""The names the source scans look for: torch.distributed's collectives and the
modules they live in (tests/unit/test_layers.py, test_autograd_collectives_home.py)."""

# Calls that move tensors (or objects) between ranks, as torch.distributed names them.
TORCH_COLLECTIVES = frozenset(
    {
        "send",
        "recv",
        "isend",
        "irecv",
        "batch_isend_irecv",
        "P2POp",
        "send_object_list",
        "recv_object_list",
        "all_gather",
        "all_gather_into_tensor",
        "all_gather_single",
        "all_gather_object",
        "all_gather_coalesced",
        "all_reduce",
        "all_reduce_coalesced",
        "all_to_all",
        "all_to_all_single",
        "broadcast",
        "broadcast_object_list",
        "reduce_scatter",
        "reduce_scatter_tensor",
        "reduce_scatter_single",
        "barrier",
        "monitored_barrier",
        "gather",
        "gather_object",
        "scatter",
        "scatter_object_list",
        "reduce",
    }
)
# Where torch's collectives live: the package, its c10d module, its differentiable
# (nn.functional) and functional ones.
DIST_MODULES = (
    "torch.distributed",
    "torch.distributed.distributed_c10d",
    "torch.distributed.nn",
    "torch.distributed.nn.functional",
    "torch.distributed._functional_collectives",
)
