"""Rank functions for test_runtime_models.py: registered models through nbtrain.runtime,
Hugging Face folders loaded into each rank's shards."""

import gc

import torch

SEQ = 16
MODEL_OF = {"gpt2": "gpt2", "llama": "llama", "qwen2": "llama"}


def save_hf_model(
    kind: str, path: str, *, tie: bool = True, size: str = "tiny", shard: str | None = None
) -> str:
    """A `transformers` model of `kind` ("gpt2", "llama", "qwen2") built from a config
    (no download), its weights perturbed (zero biases and unit norms would hide a
    misplaced tensor), saved with save_pretrained; `shard` ("200KB"): a sharded save."""
    import transformers

    torch.manual_seed(0)
    if kind == "gpt2":
        config = transformers.GPT2Config(
            n_embd=32,
            n_layer=2,
            n_head=4,
            vocab_size=80,
            n_positions=SEQ,
            bos_token_id=0,
            eos_token_id=0,
            tie_word_embeddings=tie,
        )
        model = transformers.GPT2LMHeadModel(config)
    else:
        big = size == "big"
        sizes = dict(
            vocab_size=512 if big else 96,
            hidden_size=256 if big else 64,
            intermediate_size=704 if big else 96,
            num_hidden_layers=8 if big else 3,
            num_attention_heads=8 if big else 4,
            num_key_value_heads=4 if big else 2,
            max_position_embeddings=64,
            tie_word_embeddings=tie,
            bos_token_id=0,
            eos_token_id=0,
            pad_token_id=0,
        )
        if kind == "llama":
            model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**sizes))
        else:
            model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**sizes))
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    kwargs = {"max_shard_size": shard} if shard else {}
    model.save_pretrained(path, **kwargs)
    return path


def _rows_batch(vocab: int, rows: int = 4):
    from nbtrain.runtime.contracts import PackedBatch

    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, vocab, (rows, SEQ), generator=g)
    return PackedBatch(
        input_ids=ids, position_ids=torch.arange(SEQ).expand(rows, SEQ).clone(), labels=ids.clone()
    )


def hf_logits(folders: dict, layouts: list):
    """For each folder (kind -> path) and layout (parallel kwargs): the largest |logit
    difference| of the "nbtrain" backend loaded from the folder against transformers'
    own model loaded from it, and of the "reference" backend: {(kind, i): (nb, ref)}."""
    import transformers

    from nbtrain.runtime import NBConfig, ParallelConfig, RuntimeConfig, create_runtime

    out = {}
    for kind, path in folders.items():
        hf = transformers.AutoModelForCausalLM.from_pretrained(path).eval()
        batch = _rows_batch(hf.config.vocab_size)
        with torch.no_grad():
            want = hf(batch.input_ids).logits.float()
        for i, parallel in enumerate(layouts):
            diffs = []
            for backend in ("nbtrain", "reference"):
                rt = create_runtime(
                    RuntimeConfig(
                        backend,
                        hf_path=path,
                        backend_cfg=NBConfig(
                            model_name=MODEL_OF[kind], parallel=ParallelConfig(**parallel)
                        ),
                    )
                )
                handle = rt.build_model()
                with rt.eval_mode(handle):
                    got = rt.logits(handle, batch)
                assert got.shape == want.shape, (got.shape, want.shape)
                diffs.append(float((got - want).abs().max()))
            out[(kind, i)] = tuple(diffs)
    return out


def load_peak(path: str, parallel: dict):
    """Builds the "nbtrain" backend from `path` (twice: the second is measured), the peak
    resident memory the build adds (Linux's VmHWM, reset just before): (peak bytes,
    the folder's tensor bytes, this rank's parameter bytes after the load, whether
    glibc took the fixed mmap threshold)."""
    import nbtrain
    from nbtrain.bench.memory import Phase, fix_mmap_threshold
    from nbtrain.checkpoint.stream import read_one
    from nbtrain.models.hf_load import weight_files
    from nbtrain.runtime import NBConfig, ParallelConfig, RuntimeConfig, create_runtime

    fixed = fix_mmap_threshold()  # the high-water mark shows what is held at once
    files = weight_files(path)
    full = sum(read_one(f, n).nbytes for n, f in files.items())  # before the baseline
    cfg = RuntimeConfig(
        "nbtrain",
        hf_path=path,
        backend_cfg=NBConfig(model_name="llama", parallel=ParallelConfig(**parallel)),
    )
    rt = create_runtime(cfg)
    # A first build pays the one-time costs (libraries' code and first collectives, the
    # process groups: 150 MB on gloo); the second is the model's own cost.
    warm = rt.build_model()
    del warm
    gc.collect()
    with Phase(nbtrain.get_context().device) as phase:
        handle = rt.build_model()
    peak = phase.host
    held = sum(p.numel() * p.element_size() for p in handle.model.parameters())
    return peak, full, held, fixed


def gentle(optimizer: str) -> dict:
    """runtime_cases' optimizer at a tenth (AdamW) or half (SGD) of its rate: at higher
    rates AdamW throws these models about (the loss rises over the steps), and chaotic
    steps magnify last-bit differences to ~1e-5 within 10 steps."""
    from support.runtime_cases import OPTIMIZERS

    spec = dict(OPTIMIZERS[optimizer])
    spec["lr"] *= 0.1 if optimizer == "adamw" else 0.5
    return spec


def toy_parity(cases, steps):
    """Registers the test folder's toy_lm package, then compare(reference, nbtrain) over
    `steps` steps for each (optimizer, parallel kwargs): {index: rows}."""
    from support.runtime_cases import batches

    from nbtrain.models import register_model
    from nbtrain.runtime import NBConfig, ParallelConfig, RuntimeConfig, compare

    register_model("toy", package="toy_lm", impls={"default": "toy_lm.protocol"}, replace=True)
    out = {}
    for i, (opt, parallel) in enumerate(cases):
        nb = dict(
            model_name="toy", model_config={"vocab_size": 64, "width": 32}, optimizer=gentle(opt)
        )
        out[i] = compare(
            RuntimeConfig("reference", backend_cfg=NBConfig(**nb)),
            RuntimeConfig(
                "nbtrain", backend_cfg=NBConfig(**nb, parallel=ParallelConfig(**parallel))
            ),
            steps=steps,
            data=batches(),
            verbose=False,
        )
    return out


def hf_training(path: str, cases, steps):
    """compare(reference, nbtrain) from the Llama-family folder `path` (both start from its
    weights) for each (optimizer, parallel kwargs): {index: rows}."""
    from nbtrain.runtime import NBConfig, ParallelConfig, RuntimeConfig, compare
    from nbtrain.runtime.validate import synthetic_batches

    data = synthetic_batches(2, 4, SEQ, 96, 0)
    out = {}
    for i, (opt, parallel) in enumerate(cases):
        nb = dict(model_name="llama", optimizer=gentle(opt))
        out[i] = compare(
            RuntimeConfig("reference", hf_path=path, backend_cfg=NBConfig(**nb)),
            RuntimeConfig(
                "nbtrain",
                hf_path=path,
                backend_cfg=NBConfig(**nb, parallel=ParallelConfig(**parallel)),
            ),
            steps=steps,
            data=data,
            verbose=False,
        )
    return out


def hf_contract_example(path: str):
    """The issue's example as written, from a Qwen2 folder at tp=2 (ep=1), and the
    reference's first step from the same folder: {"nbtrain": ..., "reference": ...}."""
    from nbtrain.runtime import NBConfig, ParallelConfig, RuntimeConfig, create_runtime
    from nbtrain.runtime.validate import synthetic_batches

    data = synthetic_batches(1, 4, SEQ, 96, 3)[0]
    out = {}
    for backend in ("nbtrain", "reference"):
        cfg = RuntimeConfig(
            backend=backend,
            hf_path=path,
            backend_cfg=NBConfig(model_name="llama", parallel=ParallelConfig(tp_size=2, ep_size=1)),
        )
        rt = create_runtime(cfg)
        handle = rt.build_model()  # noqa: E702 (as quoted)
        with rt.train_mode(handle):
            rt.zero_grad(handle)
            result = rt.forward_backward(handle, data, loss_fn=None, num_micro_batches=2)
            ok, grad_norm, num_zeros = rt.optimizer_step(handle)
            rt.lr_scheduler_step(handle)
        out[backend] = (result.metrics["loss"], ok, grad_norm, num_zeros)
    return out
