"""Packed documents in the built-in GPT: with position_ids, a row of packed documents
gives each document's per-token losses and the parameter gradients of the documents
run one by one through the plain GPT (within 1e-5); without, the GPT computes exactly
(bitwise) what the causal-only GPT did. The tensor-parallel attention and the pipeline
layers (fed their micro-batch's position ids) agree with the GPT."""

import pytest
import torch
import torch.nn.functional as F

from nbtrain.models.gpt import GPT, GPTConfig, document_causal_mask
from nbtrain.models.gpt_pipe import StagePositions, gpt_layers
from nbtrain.runtime.contracts import PackedBatch

SEQ, VOCAB = 16, 37  # odd vocabulary; 3 documents of 5 + 7 + 3 tokens and 1 of padding
LENGTHS = (5, 7, 3)


def _gpt(seed=0, **overrides):
    torch.manual_seed(seed)
    cfg = GPTConfig(vocab_size=VOCAB, seq_len=SEQ, hidden=24, heads=3, layers=2, **overrides)
    return GPT(cfg)


def _docs(seed=1, lengths=LENGTHS):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (n,), generator=g) for n in lengths]


def _grads(model):
    return {name: p.grad.clone() for name, p in model.named_parameters()}


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_packed_row_matches_documents_one_by_one(tied):
    docs = _docs()
    batch = PackedBatch.from_documents(docs, seq_len=SEQ, rows=1)
    assert batch.cu_seqlens.tolist() == [0, 5, 12, 15, 16]  # three documents, then padding

    packed = _gpt(tie_embeddings=tied)
    logits = packed(batch.input_ids, batch.position_ids)
    token_losses = F.cross_entropy(
        logits.reshape(-1, VOCAB), batch.labels.reshape(-1), reduction="none"
    ).view(batch.labels.shape)
    token_losses.sum().backward()

    alone = _gpt(tie_embeddings=tied)  # same seed: the same weights
    start = 0
    for doc in docs:
        n = doc.numel()
        losses = F.cross_entropy(alone(doc[None])[0, :-1], doc[1:], reduction="none")
        losses.sum().backward()
        torch.testing.assert_close(
            token_losses[0, start : start + n - 1], losses, rtol=0, atol=1e-5
        )
        assert token_losses[0, start + n - 1] == 0  # a document's last token: no label
        start += n

    want = _grads(alone)
    for name, grad in _grads(packed).items():
        torch.testing.assert_close(grad, want[name], rtol=0, atol=1e-5, msg=name)
    assert want["pos.weight"][7:].abs().sum() == 0  # no document reaches position 7


def _causal_only(model, idx):
    """The GPT's forward as it was before packing: positions 0..t-1, is_causal."""
    t = idx.shape[1]
    x = model.tok(idx) + model.pos(torch.arange(t))
    for layer in model.layers:
        h = layer.ln1(x)
        b, _, c = h.shape
        q, k, v = layer.attn.qkv(h).split(c, dim=2)
        q, k, v = (z.view(b, t, layer.attn.heads, -1).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + layer.attn.proj(y.transpose(1, 2).reshape(b, t, c))
        x = x + layer.mlp(layer.ln2(x))
    return model.head(model.ln_f(x))


def test_without_position_ids_the_gpt_is_bitwise_causal():
    model = _gpt()
    idx = torch.randint(0, VOCAB, (3, SEQ - 3), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        assert torch.equal(model(idx), _causal_only(model, idx))
        # one document per row through the masked path: the same, to rounding
        whole = torch.arange(idx.shape[1]).expand_as(idx)
        torch.testing.assert_close(model(idx, whole), model(idx), rtol=0, atol=1e-6)


def test_document_mask():
    pos = torch.tensor([[0, 1, 2, 0, 1, 0]])
    mask = document_causal_mask(pos)
    assert mask.shape == (1, 1, 6, 6) and mask.dtype == torch.bool
    want = torch.zeros(6, 6, dtype=torch.bool)
    for lo, hi in ((0, 3), (3, 5), (5, 6)):
        want[lo:hi, lo:hi] = torch.ones(hi - lo, hi - lo, dtype=torch.bool).tril()
    assert torch.equal(mask[0, 0], want)


def test_position_ids_of_another_shape_are_refused():
    model = _gpt()
    idx = torch.zeros(2, 8, dtype=torch.long)
    with pytest.raises(ValueError, match="shaped like the token ids"):
        model(idx, torch.zeros(2, 7, dtype=torch.long))


def test_tensor_parallel_attention_masks_documents(world_of_one):
    from nbtrain.models.gpt_tp import TensorParallelAttention

    attn = _gpt().layers[0].attn
    tp = TensorParallelAttention(attn)  # one tp rank: every head, the same weights
    batch = PackedBatch.from_documents(_docs(lengths=(4, 6, 5, 3, 8)), seq_len=SEQ, rows=2)
    x = torch.randn(2, SEQ, 24, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        torch.testing.assert_close(
            tp(x, batch.position_ids), attn(x, batch.position_ids), rtol=0, atol=1e-6
        )
        assert not torch.allclose(tp(x, batch.position_ids), tp(x), atol=1e-4)
        assert torch.equal(tp(x), attn(x))


def test_pipeline_layers_read_each_micro_batch_positions():
    model = _gpt()
    positions = StagePositions()
    stage = torch.nn.Sequential(*gpt_layers(model, positions))
    micro = [
        PackedBatch.from_documents(_docs(seed=s, lengths=lengths), seq_len=SEQ, rows=1)
        for s, lengths in ((4, (9, 6)), (5, (3, 3, 10)))
    ]
    with torch.no_grad():
        with positions.feeding(stage, [m.position_ids for m in micro]):
            outs = [stage(m.input_ids) for m in micro]
            with pytest.raises(RuntimeError, match="more forwards"):
                stage(micro[0].input_ids)
        assert positions.current is None
        for m, out in zip(micro, outs):
            assert torch.equal(out, model(m.input_ids, m.position_ids))
        # outside `feeding`: one causal sequence per row, as the GPT without position_ids
        assert torch.equal(stage(micro[0].input_ids), model(micro[0].input_ids))
