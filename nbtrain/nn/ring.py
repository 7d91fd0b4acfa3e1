"""Deprecated path: ring attention lives in `nbtrain.context_parallel` (layout, kernels,
the ring and its autograd, the model-side `ContextParallel`). This module re-exports its
public names for one release."""

import warnings

from ..context_parallel import (  # noqa: F401 (re-exported)
    Ring,
    RingBlock,
    SequenceLayout,
    chunk_ids,
    document_ids,
    gather_sequence,
    global_positions,
    ring_attention,
    shard_sequence,
)

Block = RingBlock  # its name here before RingBlock (this whole module is deprecated)

warnings.warn(
    "nbtrain.nn.ring moved to nbtrain.context_parallel (ring_attention, Ring, "
    "shard_sequence, ...); import from there: this path goes in the next release",
    FutureWarning,
    stacklevel=2,
)
