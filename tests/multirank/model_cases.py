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


def _transformers_logits(path: str, batch=None):
    """(the batch, transformers' own logits for it from the folder `path`); the batch
    is made for the folder's vocabulary when not given."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(path).eval()
    batch = batch if batch is not None else _rows_batch(model.config.vocab_size)
    with torch.no_grad():
        return batch, model(batch.input_ids).logits.float()


def hf_logits(folders: dict, layouts: list):
    """For each folder (kind -> path) and layout (parallel kwargs): the largest |logit
    difference| of the "nbtrain" backend loaded from the folder against transformers'
    own model loaded from it, and of the "reference" backend: {(kind, i): (nb, ref)}."""

    from nbtrain.runtime import NBConfig, ParallelConfig, RuntimeConfig, create_runtime

    out = {}
    for kind, path in folders.items():
        batch, want = _transformers_logits(path)
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
        handle = rt.build_model()  # as quoted
        with rt.train_mode(handle):
            rt.zero_grad(handle)
            result = rt.forward_backward(handle, data, loss_fn=None, num_micro_batches=2)
            ok, grad_norm, num_zeros = rt.optimizer_step(handle)
            rt.lr_scheduler_step(handle)
        out[backend] = (result.metrics["loss"], ok, grad_norm, num_zeros)
    return out


def exported(folders: dict, layouts: list, out_root: str, steps: int = 2):
    """For each folder (kind -> path) and layout: the "nbtrain" backend loaded from the
    folder trains `steps` SGD steps (so its weights are its own), writes itself with
    `Runtime.save_pretrained`, and transformers reads that folder back: {(kind, i):
    (largest |logit difference| against the trained runtime, the trained runtime's
    against the folder it started from, files written)}."""
    import os

    import nbtrain
    from nbtrain.runtime import NBConfig, ParallelConfig, RuntimeConfig, create_runtime

    out = {}
    for kind, path in folders.items():
        batch, before = _transformers_logits(path)
        for i, parallel in enumerate(layouts):
            nb = NBConfig(
                model_name=MODEL_OF[kind],
                parallel=ParallelConfig(**parallel),
                optimizer={"name": "sgd", "lr": 0.5, "momentum": 0.9},
            )
            rt = create_runtime(RuntimeConfig("nbtrain", hf_path=path, backend_cfg=nb))
            handle = rt.build_model()
            with rt.train_mode(handle):
                for _ in range(steps):
                    rt.zero_grad(handle)
                    rt.forward_backward(handle, batch)
                    rt.optimizer_step(handle)
            with rt.eval_mode(handle):
                got = rt.logits(handle, batch)
            folder = os.path.join(out_root, f"{kind}-{i}")
            written = rt.save_pretrained(handle, folder)
            nbtrain.synchronize()
            _, want = _transformers_logits(folder, batch)
            moved = float((got - before).abs().max())
            out[(kind, i)] = (float((got - want).abs().max()), moved, sorted(written))
    return out


def export_edges(root: str):
    """A Llama built from model_config alone (no folder) written in several shards with
    its index and a tokenizer copied in; then what is refused. {name: value}."""
    import os

    import tokenizers
    import transformers

    import nbtrain
    from nbtrain.runtime import NBConfig, ParallelConfig, RuntimeConfig, create_runtime

    tok_dir = os.path.join(root, "tok")
    if nbtrain.rank() == 0:
        os.makedirs(tok_dir, exist_ok=True)
        vocab = {"[UNK]": 0, "a": 1, "b": 2}
        tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]")).save(
            os.path.join(tok_dir, "tokenizer.json")
        )
    nbtrain.synchronize()
    sizes = {
        "vocab_size": 96,
        "hidden_size": 64,
        "intermediate_size": 96,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
    }
    rt = create_runtime(
        RuntimeConfig("nbtrain", backend_cfg=NBConfig(model_name="llama", model_config=sizes))
    )
    handle = rt.build_model()
    batch = _rows_batch(96)
    with rt.eval_mode(handle):
        got = rt.logits(handle, batch)
    folder = os.path.join(root, "plain")
    written = rt.save_pretrained(handle, folder, tokenizer_from=tok_dir, shard_bytes=40_000)
    nbtrain.synchronize()
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
    with torch.no_grad():
        want = hf(batch.input_ids).logits.float()
    out = {"diff": float((got - want).abs().max()), "written": written}
    with (
        open(os.path.join(tok_dir, "tokenizer.json")) as a,
        open(os.path.join(folder, "tokenizer.json")) as b,
    ):
        out["tokenizer_copied"] = a.read() == b.read()

    def error(call):
        try:
            call()
        except Exception as err:  # the test reads its type and text
            return f"{type(err).__name__}: {err}"
        return None

    out["not_empty"] = error(lambda: rt.save_pretrained(handle, folder))
    out["no_tokenizer"] = error(
        lambda: rt.save_pretrained(handle, os.path.join(root, "x"), tokenizer_from=root)
    )
    gpt = create_runtime(RuntimeConfig("nbtrain", backend_cfg=NBConfig(model_name="gpt")))
    out["no_writer"] = error(lambda: gpt.save_pretrained(gpt.build_model(), root + "/g"))
    piped = create_runtime(
        RuntimeConfig(
            "nbtrain",
            backend_cfg=NBConfig(
                model_name="llama", model_config=sizes, parallel=ParallelConfig(pipe_size=2)
            ),
        )
    )
    out["pipeline"] = error(lambda: piped.save_pretrained(piped.build_model(), root + "/p"))
    return out
