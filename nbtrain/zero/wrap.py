"""wrap(model): shard a plain torch model without changing its code or names.

Every ModuleList whose entries hold parameters becomes a TransformerBlockList of
Blocks (the model's own loop over it keeps working and overlaps); every other
parameter becomes a DistributedParameter, gathered for the forward of the module
that owns it. Tied parameters (an embedding shared with the output projection)
stay one shared parameter. A pipeline Stage holds its layers directly, under the
plain model's indices: each layer becomes a Block in place, so the names stay.
"""

from __future__ import annotations

import weakref
from functools import partial

from torch import nn

from ..comm import step_inputs
from ..comm.context import get_context
from .block import Block, ZeroLevel
from .blocklist import TransformerBlockList
from .loose import LooseParams
from .parameter import DistributedParameter, attach_state_dict_hooks
from .placement import is_stage
from .root import ModelRoot

# Modules given the gather hooks of their DistributedParameters, and roots given the
# hooks of their one gather of all of them (each once, however often wrap runs).
_GATHER_HOOKED: weakref.WeakSet = weakref.WeakSet()
_ROOT_HOOKED: weakref.WeakSet = weakref.WeakSet()


def _layer_lists(model: nn.Module) -> list[tuple[str, nn.ModuleList]]:
    """Outermost ModuleLists whose every entry has parameters."""
    found: list[tuple[str, nn.ModuleList]] = []
    found_blocks: list[str] = []
    for name, module in model.named_modules():
        if any(name.startswith(prefix + ".") for prefix in [n for n, _ in found] + found_blocks):
            continue
        if not (isinstance(module, nn.ModuleList) and len(module) > 0 and name):
            continue
        if any(isinstance(m, Block) for m in module):
            found_blocks.append(name)  # already sharded by hand: leave as it is
            continue
        if all(any(True for _ in m.parameters()) for m in module):
            found.append((name, module))
    return found


def _check_no_ties_across(model: nn.Module, lists) -> None:
    inside = {}
    for name, ml in lists:
        for pname, p in ml.named_parameters(prefix=name):
            inside[id(p)] = pname
    for pname, p in model.named_parameters(remove_duplicate=False):
        if id(p) in inside and not any(pname.startswith(n + ".") for n, _ in lists):
            raise ValueError(
                f"parameter {pname!r} is tied to {inside[id(p)]!r} inside a layer "
                "list; untie it or keep that layer list out of wrap()"
            )


def _stage_layers_to_blocks(
    model: nn.Module, level, use_checkpoint, reduce_dtype, offload=False, compile_setting=False
) -> list:
    """Makes each layer of a pipeline Stage (with parameters) a Block in place, under its
    own name, neighbours linked as in a TransformerBlockList. Layers sharing a parameter,
    with each other or with another stage (`model.ties`, a tied embedding), stay outside
    Blocks: their parameters are sharded one by one, so the tie holds, and every stage
    shards a tied parameter the same way (its own flat shape over equally many ranks),
    so `pipeline.run` can sum the shards' gradients over the stages."""
    layers = {k: model._modules[k] for k in model.layer_keys}
    tied = {id(p) for p, _ in getattr(model, "ties", ())}
    users: dict[int, set] = {}
    for k, m in layers.items():
        for p in m.parameters():
            users.setdefault(id(p), set()).add(k)
    shared = {k for pid, ks in users.items() if len(ks) > 1 or pid in tied for k in ks}
    blocks, prev = [], None
    for k, m in layers.items():
        if not isinstance(m, Block) and k not in shared and any(True for _ in m.parameters()):
            m = model._modules[k] = Block(
                m,
                level,
                use_checkpoint,
                label=k,
                reduce_dtype=reduce_dtype,
                offload=offload,
                compile=compile_setting,
            )
            blocks.append(m)
        if isinstance(m, Block) and isinstance(prev, Block):  # neighbours prefetch
            object.__setattr__(prev, "_next_block", m)
            object.__setattr__(m, "_prev_block", prev)
        prev = m
    return blocks


def _shard_loose_parameters(
    model: nn.Module, root: ModelRoot, reduce_dtype=None
) -> list[DistributedParameter]:
    """Converts parameters outside Blocks; returns those the hooks gather (unique)."""
    stage = is_stage(model)  # a pipeline stage's parameters shard over its ranks only
    converted: dict[int, DistributedParameter] = {}
    hooked: dict[int, DistributedParameter] = {}
    for module in model.modules():
        if isinstance(module, Block):
            continue
        changed = False
        for name, param in list(module._parameters.items()):
            if param is None or isinstance(param, DistributedParameter):
                changed |= isinstance(param, DistributedParameter)
                continue
            dp = converted.get(id(param))
            if dp is None:
                dp = converted[id(param)] = DistributedParameter(
                    param.detach(),
                    param.requires_grad,
                    init_method=getattr(param, "init_method", None),
                    tp_slice_of=param,
                    stage=stage,
                )
                if reduce_dtype is not None and reduce_dtype != dp.dtype:
                    dp.reduce_dtype = reduce_dtype  # gradients reduced in it (loose.py)
            module._parameters[name] = dp
            changed = True
        if changed and module not in _GATHER_HOOKED:
            attach_state_dict_hooks(module)
            module.register_forward_pre_hook(partial(_module_pre_forward, root))
            module.register_forward_hook(LooseParams.module_post_forward, always_call=True)
            _GATHER_HOOKED.add(module)
        if changed:
            hooked.update(
                (id(p), p)
                for p in module._parameters.values()
                if isinstance(p, DistributedParameter)
            )
    return list(hooked.values())


def wrap(
    model: nn.Module,
    zero_level: int = 3,
    use_checkpoint: bool = False,
    reduce_dtype=None,
    offload: bool = False,
    compile: bool | dict = False,  # noqa: A002 (the public keyword)
) -> nn.Module:
    """Shards `model` in place and returns it.

    Args:
        model: a plain torch model (e.g. a Hugging Face causal LM).
        zero_level: 2 or 3, for every Block.
        use_checkpoint: recompute activations of every Block in backward.
        offload: the Blocks keep their shards in host memory (see Block); pair it
            with AdamOffloadOptimizer (or any optimizer: it steps on host shards).
        reduce_dtype: dtype gradients are reduced in (see Block), for the Blocks and
            the parameters outside them alike: torch.float32 for bf16 parameters keeps
            each shard's averaged gradient in fp32 as its `main_grad`. None keeps the
            parameters' dtype.
        compile: torch.compile each Block's module (see Block.compile): True, or a dict
            of torch.compile's keywords. Blocks already in the model are left as they are.

    Collective: every rank calls this on an identical model.
    """
    level = ZeroLevel.parse(zero_level)
    if isinstance(model, nn.ModuleList) and len(model) and all(map(is_stage, model)):
        raise ValueError(
            "wrap: got a list of pipeline chunks (pipeline.stages_of); wrap "
            "each chunk instead: [nbtrain.wrap(chunk) for chunk in chunks]"
        )
    first_blocks = []
    if is_stage(model) and hasattr(model, "layer_keys"):  # its layers are the list
        lists = []
        first_blocks += _stage_layers_to_blocks(
            model, level, use_checkpoint, reduce_dtype, offload, compile
        )[:1]
    else:
        lists = _layer_lists(model)
    _check_no_ties_across(model, lists)
    for name, ml in lists:
        blocks = TransformerBlockList(
            [
                Block(
                    m,
                    level,
                    use_checkpoint,
                    label=f"{name}.{i}",
                    reduce_dtype=reduce_dtype,
                    offload=offload,
                    compile=compile,
                )
                for i, m in enumerate(ml)
            ]
        )
        parent_name, _, attr = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, attr, blocks)
        first_blocks.append(blocks[0])
    root = ModelRoot.of(model)
    root.release()  # a DistributedModule's plain parameters become DistributedParameters
    root.adopt_blocks(model)
    root.loose = LooseParams(_shard_loose_parameters(model, root, reduce_dtype), first_blocks)
    if root.loose.params and model not in _ROOT_HOOKED:
        # Before the root's own gather hook: one collective for all of them.
        model.register_forward_pre_hook(partial(_root_pre_forward, root), prepend=True)
        model.register_forward_hook(partial(_root_post_forward, root), always_call=True)
        _ROOT_HOOKED.add(model)
    _join_data_parallel(model)
    step_inputs.offer(model=model)  # telemetry counts its state and its tokens
    step_inputs.count_batch_tokens(model, get_context().topology.tp_rank)
    return model


def _join_data_parallel(model: nn.Module) -> None:
    """Modules that keep statistics of their batch (an MoE layer's expert load, which
    steers its routing bias) are told the ranks their replicas span, the data-parallel
    group, so every replica counts the whole batch and stays identical. Duck-typed: a
    module with a `join_data_parallel(group)` method."""
    group = get_context().topology.group("dp")
    for module in model.modules():
        join = getattr(module, "join_data_parallel", None)
        if callable(join):
            join(group)


# Hooks read the root's current LooseParams, so wrapping again never leaves a
# hook bound to a stale one.
def _root_pre_forward(root: ModelRoot, module, args) -> None:
    root.loose.root_pre_forward(module, args)


def _root_post_forward(root: ModelRoot, module, args, output) -> None:
    root.loose.root_post_forward(module, args, output)


def _module_pre_forward(root: ModelRoot, module, args) -> None:
    root.loose.module_pre_forward(module, args)
