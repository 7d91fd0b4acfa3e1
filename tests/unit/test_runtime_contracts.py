"""nbtrain.runtime's contracts and configuration, in one process: packing documents
Hugging Face style, a data-parallel rank's rows, and every configuration error."""

import pytest
import torch

from nbtrain.runtime import NBConfig, ParallelConfig, RuntimeConfig, create_runtime
from nbtrain.runtime.contracts import ForwardResult, ModelHandle, PackedBatch  # noqa: F401


def _packed():
    docs = [torch.arange(1, 6), torch.arange(10, 13), torch.arange(20, 28)]
    return PackedBatch.from_documents(docs, seq_len=10, rows=2)


def test_documents_pack_in_order_with_padding():
    b = _packed()
    assert b.input_ids.tolist() == [
        [1, 2, 3, 4, 5, 10, 11, 12, 0, 0],
        [20, 21, 22, 23, 24, 25, 26, 27, 0, 0],
    ]
    # positions restart at each document (and at the padding)
    assert b.position_ids.tolist() == [
        [0, 1, 2, 3, 4, 0, 1, 2, 0, 1],
        [0, 1, 2, 3, 4, 5, 6, 7, 0, 1],
    ]


def test_labels_are_the_next_token_of_the_same_document():
    assert _packed().labels.tolist() == [
        [2, 3, 4, 5, -100, 11, 12, -100, -100, -100],
        [21, 22, 23, 24, 25, 26, 27, -100, -100, -100],
    ]


def test_cu_seqlens_come_from_the_position_ids():
    b = _packed()
    assert b.cu_seqlens.tolist() == [0, 5, 8, 10, 18, 20]
    assert b.cu_seqlens.dtype == torch.int32


def test_token_weights_zero_where_no_label():
    b = _packed()
    assert b.token_weights().sum().item() == 4 + 2 + 7
    b.loss_weights = torch.full((2, 10), 0.5)
    assert b.token_weights().sum().item() == pytest.approx(6.5)


def test_rows_for_takes_a_replicas_rows():
    b = PackedBatch.from_documents([torch.arange(3)] * 4, seq_len=3, rows=4)
    b.input_ids += torch.arange(4)[:, None] * 100  # tell the rows apart
    assert b.rows_for(1, 2).input_ids[:, 0].tolist() == [200, 300]
    assert b.rows_for(0, 4).rows == 1


def test_rows_for_names_rows_and_dp_size_when_they_do_not_divide():
    b = _packed()
    with pytest.raises(ValueError, match=r"2 rows, which 3 data-parallel ranks.*multiple of 3"):
        b.rows_for(0, 3)


@pytest.mark.parametrize(
    "docs,seq_len,rows,match",
    [
        ([torch.arange(11)], 10, 1, r"document 0 has 11 tokens, more than seq_len=10"),
        ([torch.arange(6)] * 3, 10, 2, r"need 3 rows of seq_len=10, rows=2"),
    ],
)
def test_packing_errors(docs, seq_len, rows, match):
    with pytest.raises(ValueError, match=match):
        PackedBatch.from_documents(docs, seq_len, rows)


def test_a_batch_checks_its_position_ids():
    ids = torch.zeros(1, 4, dtype=torch.long)
    with pytest.raises(ValueError, match="rise by 1"):
        PackedBatch(ids, torch.tensor([[0, 1, 3, 4]]), ids)
    with pytest.raises(ValueError, match="start a document"):
        PackedBatch(ids, torch.tensor([[1, 2, 3, 4]]), ids)
    with pytest.raises(ValueError, match=r"labels has shape \(1, 3\)"):
        PackedBatch(ids, torch.tensor([[0, 1, 2, 3]]), ids[:, :3])


def test_micro_batches_must_divide_the_rows():
    with pytest.raises(ValueError, match="2 rows cannot make 3 micro-batches"):
        _packed().split(3)


@pytest.mark.parametrize(
    "make,error,match",
    [
        (lambda: RuntimeConfig(backend="megatron"), ValueError, r"backend='megatron'.*reference"),
        (
            lambda: NBConfig(model_name="bert"),
            ValueError,
            r"model_name='bert' is not registered.*'gpt', 'gpt2', 'gpt_moe', 'llama'.*register_model",
        ),
        (lambda: NBConfig(impl="fast"), ValueError, r"impl='fast'.*\['default'\]"),
        (
            lambda: ParallelConfig(ep_size=3).check_world(4),
            ValueError,
            r"ep_size=3 does not divide the data-parallel size 4 \(world 4 / tp_size 1 / "
            r"pipe_size 1\)",
        ),
        (
            lambda: ParallelConfig(cp_size=2, tp_size=2),
            ValueError,
            r"cp_size=2 with tp_size=2: ring attention does not split heads; use tp_size=1",
        ),
        (lambda: ParallelConfig(tp_size=0), ValueError, r"tp_size=0: give a positive integer"),
        (lambda: ParallelConfig(zero_level=1), ValueError, r"zero_level=1: use 2 or 3"),
        (
            lambda: RuntimeConfig(hf_path="/models/gpt"),
            FileNotFoundError,
            r"hf_path='/models/gpt' is not a folder",
        ),
        (lambda: NBConfig(optimizer={"name": "lion"}), ValueError, r"'lion'.*adamw"),
        (
            lambda: NBConfig(optimizer={"name": "sgd", "betas": (0.9, 0.99)}),
            ValueError,
            r"\['betas'\] are not understood for 'sgd'",
        ),
        (lambda: NBConfig(lr_schedule={"name": "cosine"}), ValueError, r"'cosine'.*warmup"),
        (lambda: NBConfig(clip_grad_norm=0), ValueError, r"clip_grad_norm=0 must be > 0"),
        (
            lambda: create_runtime(
                RuntimeConfig(backend_cfg=NBConfig(parallel=ParallelConfig(tp_size=4)))
            ),
            ValueError,
            r"world size 1 is not divisible by tp_size 4 x pipe_size 1 = 4",
        ),
    ],
    ids=[
        "backend",
        "model",
        "impl",
        "ep",
        "cp",
        "tp0",
        "zero_level",
        "hf_path",
        "optimizer",
        "optimizer_key",
        "schedule",
        "clip",
        "world",
    ],
)
def test_config_errors_name_the_value_and_the_fix(make, error, match, monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(error, match=match):
        make()


def test_the_public_names():
    import nbtrain.runtime

    assert sorted(nbtrain.runtime.__all__) == sorted(
        ["create_runtime", "RuntimeConfig", "NBConfig", "ParallelConfig", "compare"]
    )
