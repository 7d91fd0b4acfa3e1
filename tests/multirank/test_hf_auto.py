"""nbtrain.from_pretrained and nbtrain.save_pretrained on real gloo ranks, against
transformers alone on one process:

- a Llama and a Qwen2 folder (transformers' save_pretrained, sharded with an index)
  read on the meta device into ZeRO-3 Blocks give transformers' logits;
- training (SGD with momentum, AdamW) on each rank's rows equals training on all rows
  in one process, at world 2 and 3;
- the folder written back loads in transformers with the trained model's logits, its
  tokenizer file copied;
- errors name the fix: an unknown architecture, a non-empty output folder.
"""

import json
import os

import pytest
import torch
from hf_auto_cases import load_peak, make_folder, train_plain, train_sharded
from support.ranks import run_ranks

pytest.importorskip("transformers")

STEPS = 3
SIZES = {
    "llama": dict(
        vocab_size=96,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=False,
    ),
    "qwen2": dict(
        vocab_size=96,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=True,
    ),
}


@pytest.fixture(scope="module")
def hf_folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf")
    out = {}
    for kind, sizes in SIZES.items():
        path = str(root / kind)
        make_folder(path, kind, **sizes)
        out[kind] = path
    return out


CASES = [("llama", "sgd", 2), ("llama", "adamw", 3), ("qwen2", "sgd", 3)]


@pytest.fixture(scope="module")
def hf_runs(hf_folders, tmp_path_factory):
    out = {}
    for model_type, kind, world in CASES:
        dest = str(tmp_path_factory.mktemp("out") / f"{model_type}-{kind}-{world}")
        per_rank = run_ranks(
            train_sharded, world, hf_folders[model_type], dest, kind, STEPS, timeout_s=300
        )
        out[model_type, kind, world] = (per_rank, dest)
    return out


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c)))
def test_training_equals_transformers_on_one_process(hf_folders, hf_runs, case):
    import transformers

    model_type, kind, world = case
    per_rank, _ = hf_runs[case]
    plain = transformers.AutoModelForCausalLM.from_pretrained(hf_folders[model_type])
    plain.eval()
    from hf_auto_cases import batch

    x, _ = batch(plain.config.vocab_size)
    with torch.no_grad():
        want_first = plain(x).logits
    want_losses, want_last = train_plain(hf_folders[model_type], kind, STEPS)
    for first, losses, last, _, blocks, meta in per_rank:
        assert blocks == SIZES[model_type]["num_hidden_layers"]  # each decoder layer a Block
        assert meta == []  # rotary frequencies real
        assert (first - want_first).abs().max() < 1e-5
        assert losses == pytest.approx(want_losses, abs=1e-5), (losses, want_losses)
        assert (last - want_last).abs().max() < 1e-5
    assert len(set(want_losses)) == STEPS  # it trains


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c)))
def test_the_folder_written_back_loads_in_transformers(hf_runs, case):
    import transformers

    per_rank, dest = hf_runs[case]
    written = per_rank[0][3]
    assert all(rank[3] == written for rank in per_rank)
    assert {"config.json", "tokenizer.json"} <= set(written)
    files = sorted(os.listdir(dest))
    assert files == sorted(written), files  # nothing else left (no part files)
    if "model.safetensors.index.json" in written:
        with open(os.path.join(dest, "model.safetensors.index.json")) as f:
            index = json.load(f)
        assert set(index["weight_map"].values()) <= set(written)
    model = transformers.AutoModelForCausalLM.from_pretrained(dest)
    model.eval()
    from hf_auto_cases import batch

    x, _ = batch(model.config.vocab_size)
    with torch.no_grad():
        got = model(x).logits
    assert (got - per_rank[0][2]).abs().max() < 1e-5


def test_shards_with_an_index_and_errors_that_name_the_fix(hf_folders, tmp_path):
    """A model larger than one shard is written as shards with an index; an unknown
    architecture, a non-empty output folder, a shard missing from the index's list and
    a tokenizer folder without a tokenizer are refused with the fix named."""
    dest = str(tmp_path / "small-shards")
    unknown = tmp_path / "unknown"
    unknown.mkdir()
    (unknown / "config.json").write_text(json.dumps({"model_type": "no-such-model"}))
    (unknown / "model.safetensors").write_bytes(b"")
    full = tmp_path / "full"
    full.mkdir()
    (full / "keep.txt").write_text("mine")
    per_rank = run_ranks(
        _shards_and_errors, 2, hf_folders["llama"], dest, str(unknown), str(full), timeout_s=300
    )
    written = per_rank[0][0]
    shards = [f for f in written if f.startswith("model-")]
    assert len(shards) > 1 and "model.safetensors.index.json" in written, written
    import transformers

    a = transformers.AutoModelForCausalLM.from_pretrained(hf_folders["llama"])
    b = transformers.AutoModelForCausalLM.from_pretrained(dest)
    for (name, p), (_, q) in zip(a.state_dict().items(), b.state_dict().items()):
        assert torch.equal(p, q), name
    for rank, (_, unknown_error, full_error, shard_error, tokenizer_error) in enumerate(per_rank):
        assert "no-such-model" in unknown_error, unknown_error
        assert "lacks: model-" in shard_error and "copy (or download)" in shard_error, shard_error
        assert "has no tokenizer files" in tokenizer_error, tokenizer_error
        assert "tokenizer.save_pretrained(folder)" in tokenizer_error, tokenizer_error
        if rank == 0:  # the rank that writes; the others say where to look
            assert "is not empty" in full_error and "overwrite=True" in full_error, full_error
        else:
            assert "failed on another rank" in full_error, full_error
    assert (full / "keep.txt").read_text() == "mine"


def _shards_and_errors(src, dest, unknown, full):
    import shutil

    import nbtrain

    model = nbtrain.from_pretrained(src, progress=False)
    written = nbtrain.save_pretrained(model, dest, shard_bytes=64 << 10)
    out = [written]
    try:
        nbtrain.from_pretrained(unknown, progress=False)
    except ValueError as err:
        out.append(str(err))
    try:
        nbtrain.save_pretrained(model, full)
    except (FileExistsError, RuntimeError) as err:
        out.append(str(err))
    # A shard the index names is missing (a download cut short).
    broken = f"{dest}-rank{torch.distributed.get_rank()}"
    shutil.copytree(dest, broken)
    os.remove(os.path.join(broken, sorted(f for f in written if f.startswith("model-"))[-1]))
    try:
        nbtrain.from_pretrained(broken, progress=False)
    except FileNotFoundError as err:
        out.append(str(err))
    try:  # a tokenizer folder without a tokenizer
        nbtrain.save_pretrained(model, f"{broken}-out", tokenizer_from=unknown)
    except FileNotFoundError as err:
        out.append(str(err))
    return out


def test_load_peak_per_rank_is_about_its_shard(tmp_path):
    """Peak resident memory added by from_pretrained per rank: at most 1.2 x the rank's
    shard + 64 MiB (the issue's goal), at world 1, 2 and 3, for a 30 M parameter Llama
    whose untied embedding and head are a third of it."""
    path = str(tmp_path / "big")
    make_folder(
        path,
        "llama",
        shard="40MB",
        vocab_size=8000,
        hidden_size=512,
        intermediate_size=1024,
        num_hidden_layers=6,
        num_attention_heads=8,
        num_key_value_heads=4,
        tie_word_embeddings=False,
    )
    mib = 2**20
    report = {}
    for world in (1, 2, 3):
        per_rank = run_ranks(load_peak, world, path, timeout_s=600)
        for rank, got in enumerate(per_rank):
            shard = got["full"] / world
            report[world, rank] = (got["peak"] / mib, shard / mib)
            assert got["peak"] <= 1.2 * shard + 64 * mib, (
                world,
                rank,
                got["peak"] / mib,
                shard / mib,
            )
    print("\nfrom_pretrained peak per rank (MiB above baseline, shard):", report)


LORA_CASES = [("sgd", 2), ("adamw", 3), ("adamw", 2), ("sgd", 3)]


@pytest.mark.parametrize("case", LORA_CASES, ids=lambda c: "-".join(map(str, c)))
def test_lora_under_zero3_equals_peft_on_one_process(hf_folders, tmp_path, case):
    pytest.importorskip("peft")
    import peft
    import transformers
    from hf_auto_cases import batch, train_lora_plain, train_lora_sharded

    kind, world = case
    out = str(tmp_path / "adapter")
    per_rank = run_ranks(
        train_lora_sharded, world, hf_folders["llama"], out, kind, STEPS, timeout_s=300
    )
    initial = per_rank[0][0]
    want_losses, want_last = train_lora_plain(hf_folders["llama"], initial, kind, STEPS)
    sizes = SIZES["llama"]
    # q_proj: A (4 x 32), B (32 x 4); v_proj: A (4 x 32), B (16 x 4): per layer.
    adapter_elems = sizes["num_hidden_layers"] * (4 * 32 + 32 * 4 + 4 * 32 + 16 * 4)
    for _, losses, last, written, held in per_rank:
        assert losses == pytest.approx(want_losses, abs=1e-5), (losses, want_losses)
        assert (last - want_last).abs().max() < 1e-5
        assert set(written) == {"adapter_config.json", "adapter_model.safetensors"}
        # Only the adapters train: their gradients and optimizer state, this rank's share
        # (padding: a few elements per flat group). Measured: exactly the shard.
        shard = adapter_elems * 4 / world
        assert held["trainable"] <= shard + 256 and held["grads"] <= shard + 256, (held, shard)
        factor = 1 if kind == "sgd" else 2  # momentum; Adam's two moments
        assert held["state"] <= factor * (shard + 256), (held, shard)
    assert len(set(want_losses)) == STEPS
    base = transformers.AutoModelForCausalLM.from_pretrained(hf_folders["llama"])
    reloaded = peft.PeftModel.from_pretrained(base, out)
    reloaded.eval()
    x, _ = batch(base.config.vocab_size)
    with torch.no_grad():
        got = reloaded(x).logits
    assert (got - per_rank[0][2]).abs().max() < 1e-5


def test_a_lora_config_that_targets_no_layer_names_the_layers(hf_folders):
    peft = pytest.importorskip("peft")
    import nbtrain

    config = peft.LoraConfig(r=4, target_modules=["query_proj"])
    with pytest.raises(ValueError, match=r"query_proj.*'q_proj'"):
        nbtrain.from_pretrained(hf_folders["llama"], peft_config=config)  # before any rank work
