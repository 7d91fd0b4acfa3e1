"""What both backends share: the model, optimizer and schedule they build, the loss,
the train/eval contexts, the schedule step and checkpoints.

A backend (reference.py, nbtrain_backend.py) adds `build_model`, `forward_backward` and
`optimizer_step`. Every call takes the `ModelHandle` that `build_model` returned.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F

from ..checkpoint import load_checkpoint, save_checkpoint, stream
from ..comm import context as _context
from ..models.hf_load import read_hf_config
from ..optim.lr_scheduler import NoDecay
from .config import RuntimeConfig
from .contracts import IGNORE_INDEX, ModelHandle, PackedBatch


def token_cross_entropy(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The default `loss_fn`: per-token cross-entropy (rows, seq_len) float32 of logits
    (rows, seq_len, vocab) against labels (rows, seq_len); 0 where labels are -100."""
    flat = F.cross_entropy(
        logits.float().reshape(-1, logits.shape[-1]),
        labels.reshape(-1),
        ignore_index=IGNORE_INDEX,
        reduction="none",
    )
    return flat.view(labels.shape)


def labelled_weight(data: PackedBatch) -> float:
    """The global batch's total token weight: the loss's denominator. Local (every rank
    holds the global batch)."""
    total = float(data.token_weights().sum())
    if total <= 0:
        raise ValueError(
            "forward_backward: the batch has no labelled token (every label is "
            "-100, or every weight 0): nothing to take a loss over"
        )
    return total


class Runtime:
    """One backend's training calls. Made by `create_runtime(cfg)`.

    Collective: with the "nbtrain" backend every call except the context managers is
    made by every rank in the same order; the "reference" backend's compute calls
    are local, its `save`/`load` collective (nbtrain's checkpoint functions).
    """

    def __init__(self, cfg: RuntimeConfig):
        self.cfg = cfg
        self.nb = cfg.backend_cfg

    # -- pieces the backends build from ------------------------------------------------
    def _context(self, **sizes):
        """The distributed context (made on first use: a world of one without torchrun)."""
        if sizes or not _context.is_initialized():
            return _context.init_distributed(seed=self.nb.seed, **sizes)
        return _context.get_context()

    def _plain_model(self, device, parallel):
        """(the registered model, whole and plain, its config). With `hf_path` the
        "nbtrain" backend builds it on the meta device (`device="meta"`: nothing is
        allocated until `wrap` makes this rank's shards); otherwise it is initialised
        from the seed, the same on every rank and backend."""
        config = self.nb.make_config(self.cfg.hf_path)
        build = self.nb.protocol().build_model
        if str(device) == "meta":
            with torch.device("meta"):
                return build(config, parallel), config
        torch.manual_seed(self.nb.seed)
        return build(config, parallel).to(device), config

    def _optimizer(self, params):
        spec = dict(self.nb.optimizer)
        name = spec.pop("name", "adamw")
        spec.setdefault("lr", 1e-3)
        spec.setdefault("weight_decay", 0.0)
        if name == "sgd":
            return torch.optim.SGD(params, **spec)
        return torch.optim.AdamW(params, **spec)

    def _scheduler(self, optimizer):
        spec = self.nb.lr_schedule
        warmup = int(spec.get("warmup_steps", 0)) if spec.get("name") == "warmup" else 0
        # num_iter=1: the first step already trains, at lr / warmup_steps.
        return NoDecay(
            optimizer,
            start_lr=optimizer.param_groups[0]["lr"],
            warmup_iter=warmup,
            end_iter=warmup,
            num_iter=1,
        )

    # -- the calls both backends share --------------------------------------------------
    @contextlib.contextmanager
    def train_mode(self, handle: ModelHandle):
        """The model in training mode (dropout on) inside the block, its mode restored
        after. Local."""
        with self._mode(handle, True):
            yield handle

    @contextlib.contextmanager
    def eval_mode(self, handle: ModelHandle):
        """The model in evaluation mode (dropout off) inside the block. Local."""
        with self._mode(handle, False):
            yield handle

    @contextlib.contextmanager
    def _mode(self, handle, training: bool):
        before = handle.model.training
        handle.model.train(training)
        try:
            yield
        finally:
            handle.model.train(before)

    def zero_grad(self, handle: ModelHandle) -> None:
        """Drops every gradient. Local."""
        handle.manager.zero_grad()

    def lr_scheduler_step(self, handle: ModelHandle) -> float:
        """Advances the learning-rate schedule one step; returns the new rate. Local."""
        handle.scheduler.step()
        return handle.scheduler.current_lr

    def save(self, handle: ModelHandle, path: str) -> None:
        """Writes model, optimizer state, loss scale and schedule to the directory `path`
        (`nbtrain.save_checkpoint`). Collective: every rank calls this."""
        save_checkpoint(
            handle.model,
            path,
            handle.manager,
            step={"steps": handle.steps, "lr_scheduler": handle.scheduler.state_dict()},
        )

    def save_pretrained(
        self,
        handle: ModelHandle,
        folder: str,
        *,
        tokenizer_from: str | None = None,
        shard_bytes: int | None = None,
        overwrite: bool = False,
    ) -> list[str]:
        """Writes the model as a Hugging Face folder that transformers'
        `AutoModelForCausalLM.from_pretrained` reads: config.json (the model package's
        `hf_config`), safetensors shards with their index, under the names and layout
        (transposed where stored so) of the package's `hf_names`, and the tokenizer
        files of `tokenizer_from` (default: `hf_path`, when it has them).

        Returns the names written. Collective: every rank calls this; each Block is
        gathered in turn (over ZeRO and tensor-parallel ranks) and rank 0 writes, so
        no rank holds the whole model. A pipeline-parallel model is refused.
        """
        from ..models import hf_folder

        what = f"Runtime.save_pretrained({folder!r})"
        package = self.nb.entry().package
        if not hasattr(package, "hf_config"):
            raise NotImplementedError(
                f"{what}: model {self.nb.model_name!r} has no Hugging Face config writer; "
                f"add hf_config(config) -> dict (config.json's fields) to its package "
                f"{package.__name__}, or use Runtime.save"
            )
        layout = handle.extra.get("layout")
        if layout is not None and layout[1] > 1:
            raise ValueError(
                f"{what}: this model is cut into {layout[1]} pipeline stages, and the "
                "folder is written from ranks that each hold every layer; build it with "
                "pipe_size=1 (Runtime.save, then load that checkpoint at pipe_size=1) "
                "to export it"
            )
        config = self.nb.make_config(self.cfg.hf_path)
        fields = package.hf_config(config)
        source = tokenizer_from or self.cfg.hf_path
        has_tokenizer = hf_folder.tokenizer_source(what, source, tokenizer_from is not None)
        hf_folder.prepare(what, folder, overwrite)
        model = handle.model
        plain = getattr(model, "plain_names", None) or {
            name: name for name, _ in model.named_parameters()
        }
        where = package.hf_names(config)
        dtype = next(iter(model.parameters())).dtype

        def items():
            for key, tensor in stream.units(model):
                if key not in plain:  # buffers (rotary tables) are not in the folder
                    continue
                target = where(plain[key])[0]  # the first name is the folder's own
                yield target.name, tensor.t().contiguous() if target.transpose else tensor

        def write_config(out: str) -> list[str]:
            import transformers

            merged = {**(read_hf_config(self.cfg.hf_path) if self.cfg.hf_path else {})}
            merged.update(fields, dtype=str(dtype).removeprefix("torch."))
            for stale in ("transformers_version", "torch_dtype", "rope_scaling"):
                merged.pop(stale, None)
            transformers.AutoConfig.for_model(**merged).save_pretrained(out)
            return ["config.json"]

        return hf_folder.write_folder(
            what,
            folder,
            items(),
            write_config,
            tokenizer_from=source if has_tokenizer else None,
            shard_bytes=shard_bytes or hf_folder.SHARD_BYTES,
        )

    def load(self, handle: ModelHandle, path: str) -> None:
        """Restores `save`'s directory into `handle`; training then continues as the saved
        run did. Every rank calls this."""
        meta = load_checkpoint(handle.model, path, handle.manager)
        saved = meta.get("step") or {}
        if "lr_scheduler" not in saved:
            raise ValueError(
                f"{path}: not a runtime checkpoint (no schedule state); save it with Runtime.save"
            )
        handle.scheduler.load_state_dict(saved["lr_scheduler"])
        handle.steps = int(saved["steps"])
