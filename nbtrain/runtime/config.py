"""The runtime's configuration: which backend, which model, which parallel layout.

    cfg = RuntimeConfig(backend="nbtrain",
                        backend_cfg=NBConfig(model_name="gpt", model_config={"preset": "tiny"},
                                             parallel=ParallelConfig(tp_size=2),
                                             optimizer={"lr": 1e-3, "weight_decay": 0.0}))

Every field is checked when the config is made (and the layout against the world size
when `create_runtime` runs): a bad or not-yet-supported value is an error that names it
and says what to use instead, never a silent fallback.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from ..comm.layout import Layout
from ..comm.renamed import renamed_kwargs, warn_renamed

BACKENDS = ("nbtrain", "reference")
OPTIMIZERS = ("adamw", "sgd")
SCHEDULES = ("constant", "warmup")


# The old field names (docs/naming.md): accepted with a FutureWarning for one release.
_RENAMED = {
    "tp": "tp_size",
    "pp": "pipe_size",
    "ep": "ep_size",
    "cp": "cp_size",
    "num_microbatches": "num_micro_batches",
}


@renamed_kwargs(**_RENAMED)
@dataclass
class ParallelConfig:
    """The parallel layout. world size = dp x tp x pp; dp is what is left.

    The fields have `init_distributed`'s names (docs/naming.md); the old `tp`, `pp`,
    `ep`, `cp` and `num_microbatches` still work, with a FutureWarning.

    Attributes:
        tp_size: tensor-parallel ranks (attention heads and MLP columns split).
        pipe_size: pipeline stages.
        ep_size: expert-parallel ranks (MoE models: experts split over them), carved
            from the data-parallel ranks: it must divide dp.
        cp_size: context-parallel ranks splitting each sequence (ring attention; models
            "gpt", "gpt2", "gpt_moe" and "llama"), carved from the data-parallel ranks:
            it must divide dp; tp_size must be 1.
        zero_level: 2 or 3, ZeRO sharding of each stage over its data-parallel ranks.
        num_micro_batches: micro-batches per step (each data-parallel rank's rows must
            divide by it); `forward_backward(..., num_micro_batches=)` overrides it.
    """

    tp_size: int = 1
    pipe_size: int = 1
    ep_size: int = 1
    cp_size: int = 1
    zero_level: int = 3
    num_micro_batches: int = 1

    def __getattr__(self, name):  # only for names the dataclass does not have
        new = _RENAMED.get(name)
        if new is None:
            raise AttributeError(f"ParallelConfig has no attribute {name!r}")
        warn_renamed(f"ParallelConfig.{name}", f"ParallelConfig.{new}")
        return getattr(self, new)

    def __post_init__(self):
        value = self.num_micro_batches
        if not isinstance(value, int) or value < 1:
            raise ValueError(
                f"ParallelConfig: num_micro_batches={value!r} must be a positive integer"
            )
        self.layout().check(who="ParallelConfig")
        if self.zero_level not in (2, 3):
            raise ValueError(f"ParallelConfig: zero_level={self.zero_level!r}: use 2 or 3")

    def layout(self) -> Layout:
        """The sizes as nbtrain.comm's Layout (the one layout rule)."""
        return Layout(self.tp_size, self.pipe_size, self.ep_size, self.cp_size)

    def check_world(self, world_size: int) -> None:
        """Raises ValueError when the layout does not fit `world_size` ranks (tp_size x
        pipe_size must divide it, ep_size and cp_size the data-parallel ranks left)."""
        self.layout().check(world_size, who="ParallelConfig")


@dataclass
class NBConfig:
    """Configuration of the "nbtrain" and "reference" backends.

    Attributes:
        model_name: a registered model (`nbtrain.models.register_model`); built in:
            "gpt" (nbtrain's GPT), "gpt_moe" (the GPT with mixture-of-experts MLPs),
            "gpt2" and "llama" (Llama, Qwen2).
        impl: the model's implementation ("default").
        model_config: the model package's `make_config` reads it. For "gpt",
            GPTConfig fields with "preset" ("tiny", "small", "medium") picking a size
            (default {"preset": "tiny"}); with `RuntimeConfig.hf_path`, overrides of the
            folder's config.json.
        parallel: the layout (the "reference" backend ignores it: one plain model).
        optimizer: "name" ("adamw" default, or "sgd"), "lr", "weight_decay", and
            "betas", "eps" (AdamW) or "momentum" (SGD).
        lr_schedule: {"name": "constant"} or {"name": "warmup", "warmup_steps": N}
            (the first step at lr / N, rising linearly to lr at step N, then lr).
        clip_grad_norm: the global gradient norm is clipped to this (None: no clipping).
        loss_scale: initial dynamic loss scale (None: no scaling; a power of two keeps
            fp32 results exact).
        seed: seeds the model's initialisation (the same on every rank and backend).
    """

    model_name: str = "gpt"
    impl: str = "default"
    model_config: dict | None = None
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    optimizer: dict = field(default_factory=lambda: {"lr": 1e-3, "weight_decay": 0.0})
    lr_schedule: dict = field(default_factory=lambda: {"name": "constant"})
    clip_grad_norm: float | None = 1.0
    loss_scale: float | None = None
    seed: int = 0

    def __post_init__(self):
        from ..models.registry import get_model, registered

        try:
            entry = get_model(self.model_name)
        except KeyError:
            raise ValueError(
                f"NBConfig: model_name={self.model_name!r} is not registered: "
                f"choose one of {registered()}, or register it with "
                "nbtrain.models.register_model"
            ) from None
        if self.impl not in entry.impls:
            raise ValueError(
                f"NBConfig: impl={self.impl!r} for model {self.model_name!r}: "
                f"choose one of {sorted(entry.impls)}"
            )
        if self.model_config is None:
            self.model_config = {"preset": "tiny"} if self.model_name == "gpt" else {}
        if not isinstance(self.parallel, ParallelConfig):
            raise TypeError(
                f"NBConfig: parallel must be a ParallelConfig, got {type(self.parallel).__name__}"
            )
        name = self.optimizer.get("name", "adamw")
        if name not in OPTIMIZERS:
            raise ValueError(f"NBConfig: optimizer name {name!r}: choose one of {OPTIMIZERS}")
        allowed = {"name", "lr", "weight_decay"} | (
            {"betas", "eps"} if name == "adamw" else {"momentum"}
        )
        unknown = sorted(set(self.optimizer) - allowed)
        if unknown:
            raise ValueError(
                f"NBConfig: optimizer keys {unknown} are not understood for "
                f"{name!r}: use {sorted(allowed)}"
            )
        schedule = self.lr_schedule.get("name", "constant")
        if schedule not in SCHEDULES:
            raise ValueError(f"NBConfig: lr_schedule name {schedule!r}: choose one of {SCHEDULES}")
        if self.clip_grad_norm is not None and self.clip_grad_norm <= 0:
            raise ValueError(
                f"NBConfig: clip_grad_norm={self.clip_grad_norm} must be > 0 "
                "(or None for no clipping)"
            )

    def entry(self):
        """The registered model (`nbtrain.models.registry.ModelEntry`)."""
        from ..models.registry import get_model

        return get_model(self.model_name)

    def protocol(self):
        """The protocol module of this model's `impl`."""
        return self.entry().protocol(self.impl)

    def make_config(self, hf_path: str | None = None):
        """The model's configuration: its package's `make_config` of `model_config` and
        (with `hf_path`) the folder's config.json."""
        from ..models.hf_load import read_hf_config

        hf = read_hf_config(hf_path) if hf_path is not None else None
        return self.entry().package.make_config(dict(self.model_config), hf)


@dataclass
class RuntimeConfig:
    """Which backend runs the model, and its configuration.

    Attributes:
        backend: "nbtrain" (ZeRO, tensor and pipeline parallel per
            `backend_cfg.parallel`) or "reference" (one plain PyTorch model on the whole
            batch, computed the same way on every rank: the baseline).
        hf_path: a local Hugging Face folder (config.json and safetensors, sharded or
            not) to build the model from and load its weights: each rank reads only the
            tensors of its own stage, one at a time, keeping its shards. None: the
            model is initialised from NBConfig.seed.
        backend_cfg: an NBConfig.
    """

    backend: str = "nbtrain"
    hf_path: str | None = None
    backend_cfg: NBConfig = field(default_factory=NBConfig)

    def __post_init__(self):
        if self.backend not in BACKENDS:
            raise ValueError(f"RuntimeConfig: backend={self.backend!r}: choose one of {BACKENDS}")
        if not isinstance(self.backend_cfg, NBConfig):
            raise TypeError(
                f"RuntimeConfig: backend_cfg must be an NBConfig, got "
                f"{type(self.backend_cfg).__name__}"
            )
        if self.hf_path is not None:
            self._check_hf_path()

    def _check_hf_path(self) -> None:
        from ..models.hf_load import read_hf_config

        path = os.fspath(self.hf_path)
        if not os.path.isdir(path):
            raise FileNotFoundError(
                f"RuntimeConfig: hf_path={path!r} is not a folder: give a "
                "local folder a Hugging Face model was saved to"
            )
        model_type = read_hf_config(path).get("model_type")
        entry = self.backend_cfg.entry()
        if model_type not in entry.hf_model_types:
            raise ValueError(
                f"RuntimeConfig: hf_path={path!r} holds model_type {model_type!r}, which model "
                f"{entry.name!r} does not load (it loads {entry.hf_model_types or 'none'}); "
                "choose the model_name registered for it"
            )
        self.hf_path = path
