"""`nbtrain.runtime`: one training-step contract over nbtrain's parallel layouts, and a
reference to check them against (Bumblebee's runtime API).

    from nbtrain.runtime import create_runtime, RuntimeConfig, NBConfig, ParallelConfig
    from nbtrain.runtime.contracts import PackedBatch

    rt = create_runtime(RuntimeConfig(backend="nbtrain", backend_cfg=NBConfig(
        parallel=ParallelConfig(tp_size=2))))
    handle = rt.build_model()
    with rt.train_mode(handle):
        rt.zero_grad(handle)
        result = rt.forward_backward(handle, batch, num_micro_batches=2)
        ok, grad_norm, num_zeros = rt.optimizer_step(handle)
        rt.lr_scheduler_step(handle)

    rows = compare(reference_cfg, cfg, steps=10, data=[batch])  # per-step loss, grad norm

Read config.py (what can be configured), contracts.py (the batch and result types),
create.py, base.py, reference.py and nbtrain_backend.py (the two backends), compare.py
(with per_layer.py: `compare(..., per_layer=True)` names the first module off) and
validate.py (`nbtrain validate`).

Models are built by name from nbtrain's registry (`nbtrain.models.register_model`):
the built-in "gpt", "gpt_moe" (the GPT with mixture-of-experts MLPs), "gpt2" and
"llama" (Llama, Qwen2), or a package of your own.
`RuntimeConfig(hf_path=...)` starts from a Hugging Face folder, read into each rank's
shards one tensor at a time (models/hf_load.py).

Packed batches: both backends give the model each batch's position_ids, so attention
stays within each packed document and positions restart at 0 with each one; a packed
row's per-document losses and gradients are those of its documents run one by one.

Expert and context parallelism are carved from the data-parallel ranks:
`ParallelConfig(ep_size=2)` splits "gpt_moe"'s experts over 2 ranks, and
`ParallelConfig(cp_size=2)` splits each sequence over 2 ranks with ring attention ("gpt",
"gpt2", "gpt_moe", "llama"; with pp too, not with tp).
"""

from .compare import compare
from .config import NBConfig, ParallelConfig, RuntimeConfig
from .create import create_runtime

__all__ = ["create_runtime", "RuntimeConfig", "NBConfig", "ParallelConfig", "compare"]
