"""Any Hugging Face causal LM folder in and out, sharded all the way.

    model = nbtrain.from_pretrained("path/to/folder")   # transformers' own classes, ZeRO-3
    ...train...
    nbtrain.save_pretrained(model, "path/to/out")       # a folder transformers reads

`from_pretrained` builds the folder's architecture with transformers' classes
(`AutoModelForCausalLM.from_config`) with its parameters on the meta device, shards it
with `nbtrain.wrap` (its decoder layers become Blocks of a TransformerBlockList), then
each rank reads from the safetensors shards only its own slices (`load_hf_weights`):
no rank ever holds the whole model. `save_pretrained` writes the folder back the way
transformers does (config, safetensors shards with their index, the source folder's
tokenizer files), gathering one layer at a time, so no rank holds the whole model
either. Both are collective: every rank calls them.
"""

from __future__ import annotations

import os

import torch

from ..checkpoint import stream
from ..checkpoint.layout import agreed
from ..comm.context import get_context
from .hf_folder import (
    SHARD_BYTES,
    prepare,
    rank0_list,
    tokenizer_source,
    write_folder,
)
from .hf_load import HFWeight, load_hf_weights, read_hf_config, record_plain_names, weight_files


def from_pretrained(
    path: str,
    *,
    zero_level: int = 3,
    dtype: torch.dtype | None = None,
    use_checkpoint: bool = False,
    progress: bool = True,
    peft_config=None,
    **wrap_kwargs,
):
    """The causal LM saved in the Hugging Face folder `path`, sharded over the ranks.

    Args:
        path: a local folder with config.json and safetensors weights (one file or
            shards with model.safetensors.index.json), as `save_pretrained` writes it.
        zero_level: 3 shards parameters, gradients and optimizer state; 2 keeps the
            parameters whole on each rank.
        dtype: the parameters' dtype; None: the folder's (config.json's "dtype" or
            "torch_dtype"), float32 when it names none.
        use_checkpoint: recompute each decoder layer's activations in backward.
        progress: a bar over the tensors read.
        peft_config: a PEFT LoraConfig: the model is PEFT's (`peft.get_peft_model`)
            before it is sharded, each adapter inside the Block of the layer it adapts,
            the base weights frozen, the adapters drawn as PEFT draws them (A uniform
            as Kaiming's, B zeros) from the current torch generator, alike at every
            world size.
        **wrap_kwargs: passed to `nbtrain.wrap`.

    Returns the transformers model (its class, config and forward unchanged), in
    eval mode as transformers returns it: call `model.train()` to fine-tune. Collective.
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    from ..zero import empty_parameters, wrap

    raw = read_hf_config(path)  # FileNotFoundError naming the folder
    model_type = raw.get("model_type")
    if model_type not in _causal_lm_types():
        raise ValueError(
            f"{path!r}: model_type {model_type!r} has no causal LM class in transformers "
            f"{_transformers_version()} (architectures: {raw.get('architectures')}); "
            "upgrade transformers, or register the model with nbtrain's runtime "
            "(docs/runtime.md)"
        )
    weight_files(path)  # FileNotFoundError naming the folder, before anything is built
    config = AutoConfig.from_pretrained(path, local_files_only=True)
    dtype = dtype or _folder_dtype(raw)
    with empty_parameters():  # parameters on meta; buffers (rotary frequencies) real
        model = AutoModelForCausalLM.from_config(config)
    model.name_or_path = path
    prefix = getattr(model, "base_model_prefix", "") or ""
    adapters = []
    if peft_config is not None:
        model, adapters = _with_adapters(model, peft_config, path)
    for p in model.parameters():
        p.data = p.data.to(dtype)  # on meta: no memory
    # The checkpoint's names, before wrap flattens them; the adapters are drawn instead.
    names = record_plain_names(model, model)
    for key in adapters:
        names.pop(key)
    model = wrap(model, zero_level=zero_level, use_checkpoint=use_checkpoint, **wrap_kwargs)
    if adapters:
        from ..zero import init_parameters

        init_parameters(model)  # only the adapters have an initialiser
    hf = _names(prefix)
    if peft_config is not None:
        hf = _peft_names(hf)
    load_hf_weights(model, path, hf, progress=progress and get_context().rank == 0)
    model.eval()
    return model


def _with_adapters(model, peft_config, path: str):
    """PEFT's model around `model` (parameters on meta), and the names of its adapters,
    each given PEFT's initialiser (drawn by init_parameters after wrap)."""
    import math

    import peft

    from ..zero import empty_parameters

    try:
        with empty_parameters():
            model = peft.get_peft_model(model, peft_config)
    except ValueError as err:
        linear = {
            n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)
        }
        linear = sorted(linear)
        raise ValueError(
            f"{path!r}: the PEFT config's target_modules {peft_config.target_modules!r} "
            f"match no layer of this {type(model).__name__} ({err}); its linear layers "
            f"are named {linear}"
        ) from None
    adapters = []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        if ".lora_A." in name:
            p.init_method = partial_kaiming(math.sqrt(5))
        elif ".lora_B." in name:
            p.init_method = torch.nn.init.zeros_
        else:
            raise ValueError(
                f"nbtrain.from_pretrained draws LoRA's adapters (lora_A, lora_B); "
                f"{name!r} of this PEFT method is not one: use a peft.LoraConfig"
            )
        adapters.append(name)
    return model, adapters


def partial_kaiming(a: float):
    def init(t: torch.Tensor) -> torch.Tensor:
        return torch.nn.init.kaiming_uniform_(t, a=a)

    return init


def _peft_names(names):
    """PEFT's name of a base weight ("base_model.model.X.q_proj.base_layer.weight")
    -> the checkpoint's ("X.q_proj.weight")."""

    def peft_names(plain: str) -> list[HFWeight]:
        plain = plain.removeprefix("base_model.model.").replace(".base_layer.", ".")
        return names(plain)

    return peft_names


def _names(prefix: str):
    """A parameter's checkpoint name: its own, or without the base model's prefix
    (older saves of the bare model), or with it."""

    def names(plain: str) -> list[HFWeight]:
        out = [HFWeight(plain)]
        if prefix and plain.startswith(prefix + "."):
            out.append(HFWeight(plain[len(prefix) + 1 :]))
        elif prefix:
            out.append(HFWeight(f"{prefix}.{plain}"))
        return out

    return names


def _causal_lm_types() -> set[str]:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def _transformers_version() -> str:
    import transformers

    return transformers.__version__


def _folder_dtype(raw: dict) -> torch.dtype:
    name = raw.get("dtype") or raw.get("torch_dtype") or "float32"
    value = getattr(torch, str(name).removeprefix("torch."), None)
    return value if isinstance(value, torch.dtype) else torch.float32


def save_pretrained(
    model,
    folder: str,
    *,
    tokenizer_from: str | None = None,
    shard_bytes: int = SHARD_BYTES,
    overwrite: bool = False,
) -> list[str]:
    """Writes `model` as a Hugging Face folder: config.json (and generation_config.json),
    safetensors shards with model.safetensors.index.json, and the tokenizer files.

    Args:
        model: a model from `from_pretrained` (or any wrapped transformers model).
        folder: the folder to write; created if absent.
        tokenizer_from: the folder whose tokenizer files are copied; default the one
            the model was read from (`model.name_or_path`), when it has them.
        shard_bytes: the most bytes of tensors in one shard file.
        overwrite: replace the files of a folder that is not empty.

    Returns the files written (names in `folder`). Collective: each Block is gathered
    in turn and rank 0 writes; no rank holds more than one shard's tensors.
    """
    ctx = get_context()
    if getattr(ctx.topology, "pipe_size", 1) > 1:
        raise ValueError(
            "nbtrain.save_pretrained writes a model whose layers are all on every rank "
            "(data parallel, ZeRO); a pipeline stage holds some of them: use "
            "nbtrain.save(model, 'model.safetensors') and convert"
        )
    config = getattr(model, "config", None)
    if (config is None or not hasattr(config, "save_pretrained")) and not hasattr(
        model, "peft_config"
    ):
        raise TypeError(
            f"nbtrain.save_pretrained needs a transformers model (with .config); got "
            f"{type(model).__name__}: use nbtrain.save(model, 'model.safetensors')"
        )
    what = f"nbtrain.save_pretrained({folder!r})"
    source = tokenizer_from or getattr(model, "name_or_path", None)
    peft = hasattr(model, "peft_config")
    has_tokenizer = tokenizer_source(what, source, bool(tokenizer_from), note=not peft)
    prepare(what, folder, overwrite)
    if peft:
        return _save_adapter(model, folder, ctx.rank == 0)
    aliases = _aliases(model)

    def write_config(out: str) -> list[str]:
        config.save_pretrained(out)
        written = ["config.json"]
        generation = getattr(model, "generation_config", None)
        if generation is not None:
            generation.save_pretrained(out)
            written.append("generation_config.json")
        return written

    items = ((k, t) for k, t in stream.units(model) if k not in aliases)
    return write_folder(
        what,
        folder,
        items,
        write_config,
        tokenizer_from=source if has_tokenizer else None,
        shard_bytes=shard_bytes,
    )


def _save_adapter(model, folder: str, writes: bool) -> list[str]:
    """A PEFT model's adapter folder, as PEFT's save_pretrained writes it
    (adapter_config.json, adapter_model.safetensors): the adapters only, gathered
    with their layers one at a time. The base weights are the folder read."""
    import safetensors.torch
    from peft import get_peft_model_state_dict

    adapters = {
        key: tensor.detach().cpu().clone()
        for key, tensor in stream.units(model)
        if writes and ".lora_" in key
    }

    def finish() -> list[str]:
        state = get_peft_model_state_dict(model, state_dict=adapters)
        safetensors.torch.save_file(
            {k: v.contiguous() for k, v in state.items()},
            os.path.join(folder, "adapter_model.safetensors"),
            metadata={"format": "pt"},
        )
        for config in model.peft_config.values():
            config.save_pretrained(folder)
        return ["adapter_config.json", "adapter_model.safetensors"]

    return rank0_list(agreed(f"nbtrain.save_pretrained({folder!r})", finish, run_here=writes))


def _aliases(model) -> set[str]:
    """State-dict names of parameters that an earlier name holds too (a head tied to
    the embedding): written once, under the first name, as transformers writes them."""
    seen, out = set(), set()
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in seen:
            out.add(name)
        seen.add(id(p))
    return out
