"""Ring attention (context parallelism) on real gloo ranks at cp 2 and 3, against
F.scaled_dot_product_attention on the full sequence:

- output and q/k/v gradients, causal or not, packed documents or not, zigzag or
  contiguous shards, the fused block kernel and the math one, within 1e-5 in float32;
- shard_sequence / gather_sequence round trips; the zigzag layout's equal causal work;
- the P2P bytes of a forward and a backward against the ring's arithmetic;
- the next K/V block posted before the current one is computed (event order);
- a cp group of global ranks 0 and 2 inside a world of 3;
- in one process: the world-of-one fallback, the no-NaN merge (math and fused kernels),
  the blocks (skipped future pairs, equal zigzag work), the fused kernel's use on CPU,
  and the input errors.
"""

import pytest
import torch
import torch.nn.functional as F
from ring_cases import (
    BATCH,
    HEAD_DIM,
    HEADS,
    SEQ_PER_RANK,
    full_inputs,
    packed_position_ids,
    ring_cases,
)
from support.ranks import run_ranks

from nbtrain import context_parallel as R
from nbtrain.context_parallel import kernels as K
from nbtrain.context_parallel import layout as L

WORLDS = (2, 3)
CASES = [
    (causal, packed, layout, kernel)
    for causal in (True, False)
    for packed in (False, True)
    for layout in ("zigzag", "contiguous")
    for kernel in ("auto", "math")
]


@pytest.fixture(scope="module")
def ring_runs():
    return {world: run_ranks(ring_cases, world, 7, timeout_s=120) for world in WORLDS}


def reference(q, k, v, dout, causal, position_ids=None):
    """Output and q/k/v gradients of plain attention on the full sequence."""
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    if position_ids is None:
        out = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    else:
        doc = R.document_ids(position_ids)
        mask = (doc.unsqueeze(2) == doc.unsqueeze(1)).unsqueeze(1)
        if causal:
            mask = mask & torch.ones(q.shape[2], q.shape[2], dtype=torch.bool).tril()
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    out.backward(dout)
    return out.detach(), [q.grad, k.grad, v.grad]


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize(
    "case",
    CASES,
    ids=lambda c: f"{'causal' if c[0] else 'full'}-{'packed' if c[1] else 'one-doc'}-{c[2]}-{c[3]}",
)
def test_output_and_gradients_equal_full_attention(ring_runs, world, case):
    causal, packed, _, _ = case
    first = ring_runs[world][0]
    q, k, v, dout = first["inputs"]
    out, grads = reference(q, k, v, dout, causal, first["position_ids"] if packed else None)
    for rank_result in ring_runs[world]:
        got = rank_result["cases"][case]
        assert (got["out"] - out).abs().max() < 1e-5
        for name, g, want in zip("qkv", got["grads"], grads):
            err = float((g - want).abs().max())
            assert err < 1e-5, f"d{name}: max error {err:.2e}"


@pytest.mark.parametrize("world", WORLDS)
def test_shard_and_gather_round_trip(ring_runs, world):
    for rank_result in ring_runs[world]:
        assert all(rank_result["round_trips"].values()), rank_result["round_trips"]


@pytest.mark.parametrize("world", WORLDS)
def test_positions_and_zigzag_balances_causal_work(ring_runs, world):
    work = {"zigzag": [], "contiguous": []}
    for rank_result in ring_runs[world]:
        for layout, (sharded, computed) in rank_result["positions"].items():
            assert torch.equal(sharded, computed), layout
            work[layout].append(int((sharded + 1).sum()))  # causal (q, k) pairs
    seq = SEQ_PER_RANK * world
    for layout in work:
        assert sum(work[layout]) == seq * (seq + 1) // 2
    assert len(set(work["zigzag"])) == 1, work
    assert len(set(work["contiguous"])) == world, work  # the imbalance zigzag removes


def expected_p2p_bytes(world, rank, causal, zigzag, packed):
    """(forward, backward) bytes a ring rank sends, from the ring's arithmetic. A K/V
    block is one K and one V (float32, with int64 document ids when packed). Forward: at
    step t the rank sends the block of rank - t, t < world - 1. Backward: the forward's
    first received block is kept and the own block comes last, so K/V travel world - 2
    hops (step t sends the block of rank - t - 1), and each block's dK/dV partial sum
    (float32, no ids) travels world - 1 hops, the last to its owner (step t sends the sum
    for rank - t - 1). Causal zigzag: only the first chunk of rank 0's K/V is read away
    from rank 0, so that block travels half; a dK/dV sum travels half while every share
    in it comes from ranks after its owner."""
    kv = 2 * BATCH * HEADS * SEQ_PER_RANK * HEAD_DIM * 4
    block = kv + (BATCH * SEQ_PER_RANK * 8 if packed else 0)
    half = causal and zigzag

    def kv_bytes(source):
        return block // 2 if half and source == 0 else block

    forward = sum(kv_bytes((rank - t) % world) for t in range(world - 1))
    backward = sum(kv_bytes((rank - t - 1) % world) for t in range(world - 2))
    for t in range(world - 1):
        source = (rank - t - 1) % world
        backward += kv // 2 if half and rank > source else kv
    return forward, backward


def test_cp2_zigzag_causal_bytes_by_hand():
    """At cp 2, causal zigzag: rank 0 sends half its K/V and a whole dK/dV sum, rank 1 a
    whole K/V block and half a dK/dV sum: 3/4 of the full blocks each."""
    kv = 2 * BATCH * HEADS * SEQ_PER_RANK * HEAD_DIM * 4
    assert expected_p2p_bytes(2, 0, True, True, False) == (kv // 2, kv)
    assert expected_p2p_bytes(2, 1, True, True, False) == (kv, kv // 2)
    assert expected_p2p_bytes(2, 0, False, True, False) == (kv, kv)


@pytest.mark.parametrize("world", WORLDS)
def test_p2p_bytes_follow_the_ring(ring_runs, world):
    for rank, rank_result in enumerate(ring_runs[world]):
        for (causal, packed, layout, _), got in rank_result["cases"].items():
            want = expected_p2p_bytes(world, rank, causal, layout == "zigzag", packed)
            assert (got["fwd_bytes"], got["bwd_bytes"]) == want, (rank, causal, packed, layout)


@pytest.mark.parametrize("world", WORLDS)
def test_next_block_is_posted_before_the_current_one_is_computed(ring_runs, world):
    for rank_result in ring_runs[world]:
        order = rank_result["events"]
        for phase, kv_label, hops in (
            ("forward", "cp ring kv step", world - 1),
            ("backward", "cp ring kv grad step", max(world - 2, 0)),
        ):
            for step in range(hops):
                compute = order.index(("compute_begin", f"cp ring attention step {step}", phase))
                issued = order.index(("comm_issue", f"{kv_label} {step + 1}", None))
                waited = order.index(("comm_wait", f"{kv_label} {step + 1}", None))
                assert issued < compute < waited, (phase, step, order)
            assert ("comm_issue", f"{kv_label} {hops + 1}", None) not in order


@pytest.mark.parametrize("world", WORLDS)
def test_every_dkv_hop_is_hidden_behind_the_next_step(ring_runs, world):
    """Each dK/dV hop is posted after a backward step and waited only once the next
    step has computed: no hop is left to wait on after the last step."""
    for rank_result in ring_runs[world]:
        order = rank_result["events"]
        for step in range(1, world):
            issued = order.index(("comm_issue", f"cp ring dkv step {step}", None))
            compute = order.index(("compute_begin", f"cp ring attention step {step}", "backward"))
            waited = order.index(("comm_wait", f"cp ring dkv step {step}", None))
            assert issued < compute < waited, (step, order)
        # world - 1 hops in all: none after the last step (the owner adds its own last)
        assert ("comm_issue", f"cp ring dkv step {world}", None) not in order


def test_a_cp_group_inside_a_larger_world(ring_runs):
    q, k, v, dout = full_inputs(24, 7)
    out, grads = reference(q, k, v, dout, True, packed_position_ids(24))
    per_rank = [r["subgroup"] for r in ring_runs[3]]
    assert per_rank[1] is None
    for got in (per_rank[0], per_rank[2]):
        for g, want in zip(got, [out] + grads):
            assert (g - want).abs().max() < 1e-5


# ----------------------------------------------------------------- in one process


def test_a_world_of_one_is_plain_attention():
    q, k, v, dout = (
        torch.randn(2, 3, 10, 4, generator=torch.Generator().manual_seed(i)) for i in range(4)
    )
    position_ids = torch.tensor([[0, 1, 2, 0, 1, 2, 3, 4, 0, 1]] * 2)
    for causal in (True, False):
        for pos in (None, position_ids):
            want, _ = reference(q, k, v, dout, causal, pos)
            docs = None if pos is None else R.document_ids(pos)
            got = R.ring_attention(q, k, v, causal=causal, doc_ids=docs)
            assert (got - want).abs().max() < 1e-6
    x = torch.randn(2, 10)
    assert torch.equal(R.gather_sequence(R.shard_sequence(x, 1), 1), x)


def test_rows_without_a_visible_key_merge_without_nan():
    q, k, v = (torch.randn(1, 1, 3, 4) for _ in range(3))
    mask = torch.tensor([[True, True, False], [False, False, False], [True, False, True]])
    out, lse = K._block_forward(q, k, v, mask, 0.5)
    assert torch.isneginf(lse[0, 0, 1]) and torch.equal(out[0, 0, 1], torch.zeros(4))
    empty_out, empty_lse = K._block_forward(q, k, v, torch.zeros(3, 3, dtype=torch.bool), 0.5)
    merged, merged_lse = K._merge(empty_out, empty_lse, out, lse)
    assert not torch.isnan(merged).any() and torch.equal(merged[0, 0, 1], torch.zeros(4))
    assert torch.allclose(merged[0, 0, [0, 2]], out[0, 0, [0, 2]])
    assert torch.equal(merged_lse, lse)
    # the fused kernel's op gives such a row lse 0; the kernel makes it -inf
    fused = K._Kernel(K._FUSED["cpu"], torch.float32)
    block = R.RingBlock(slice(0, 3), 3, False)
    got_out, got_lse = fused.forward(q, k, v, block, mask.view(1, 1, 3, 3), 0.5)
    assert torch.equal(torch.isinf(got_lse), torch.isinf(lse))
    assert torch.allclose(got_out, out, atol=1e-6)
    assert torch.allclose(got_lse[0, 0, [0, 2]], lse[0, 0, [0, 2]], atol=1e-6)


def test_the_fused_kernel_runs_on_cpu_and_math_when_asked():
    q = torch.randn(1, 2, 8, 16)
    for masked in (False, True):
        assert K._kernel("auto", q, masked).fused is K._FUSED["cpu"]
        assert K._kernel("math", q, masked).fused is None
    assert K._kernel("auto", q.double(), True).fused is K._FUSED["cpu"]
    assert K._kernel("auto", q.to("meta"), False).fused is None  # no fused op: the math
    assert R.uses_fused_kernel(q, masked=True) and not R.uses_fused_kernel(q.to("meta"))
    with pytest.raises(ValueError, match="kernel='fast'"):
        R.Ring(kernel="fast")


def test_a_fused_op_that_disagrees_with_the_math_is_not_used(monkeypatch):
    def wrong_lse(q, k, v, causal, bias, scale):
        out, lse = K._cpu_forward(q, k, v, causal, bias, scale)
        return out, lse + 1e-2

    def failing(*args):
        raise RuntimeError("no kernel for these inputs\nmore")

    for entry in ((wrong_lse, K._cpu_backward), (K._cpu_forward, failing)):
        monkeypatch.setitem(K._FUSED, "cpu", entry + K._FUSED["cpu"][2:])
        K._fused_works.cache_clear()
        with pytest.warns(RuntimeWarning, match="fused attention op for cpu"):
            assert K._kernel("auto", torch.randn(1, 2, 8, 16), False).fused is None
    monkeypatch.undo()
    K._fused_works.cache_clear()
    assert K._kernel("auto", torch.randn(1, 2, 8, 16), False).fused is K._FUSED["cpu"]


@pytest.mark.parametrize("world", (2, 3, 4))
def test_blocks_skip_future_pairs_and_zigzag_work_is_equal(world):
    chunk = 3
    for causal, whole_diagonal in ((True, True), (True, False), (False, True)):
        per_rank = {}
        for layout in ("zigzag", "contiguous"):
            local = chunk * len(R.chunk_ids(0, world, layout))
            per_rank[layout] = []
            for rank in range(world):
                pairs = 0  # (query, key) pairs left visible by each block's mask
                for step in range(world):
                    for block in L._step_blocks(
                        rank, world, step, local, R.SequenceLayout(layout), causal, whole_diagonal
                    ):
                        rows = block.rows.stop - block.rows.start
                        assert not block.causal or (causal and step == 0)
                        assert block.keys >= rows or not block.causal
                        pairs += rows * block.keys - (rows * (rows - 1) // 2 if block.causal else 0)
                per_rank[layout].append(pairs)
            seq = world * local
            # exactly the visible pairs: nothing in a query's future is computed
            assert sum(per_rank[layout]) == (seq * (seq + 1) // 2 if causal else seq * seq)
        if causal:
            assert len(set(per_rank["zigzag"])) == 1, per_rank
            assert len(set(per_rank["contiguous"])) == world, per_rank
    # the fused kernel's own block is one square; the math kernel's, one per query chunk
    assert L._step_blocks(0, 2, 0, 8, R.SequenceLayout.ZIGZAG, True) == [
        R.RingBlock(slice(0, 8), 8, True)
    ]
    assert L._step_blocks(0, 2, 0, 8, R.SequenceLayout.ZIGZAG, True, False) == [
        R.RingBlock(slice(0, 4), 4, True),
        R.RingBlock(slice(4, 8), 8, True),
    ]


def test_bad_inputs_name_the_problem():
    q = torch.randn(2, 2, 6, 4)
    with pytest.raises(ValueError, match="share one shape"):
        R.ring_attention(q, torch.randn(2, 2, 5, 4), q)
    with pytest.raises(ValueError, match="floating dtype"):
        R.ring_attention(q, q.double(), q)
    with pytest.raises(ValueError, match="local_seq=5 is odd"):
        R.ring_attention(*(torch.randn(2, 2, 5, 4) for _ in range(3)))
    with pytest.raises(ValueError, match="layout='diagonal'"):
        R.ring_attention(q, q, q, layout="diagonal")
    with pytest.raises(ValueError, match=r"doc_ids must be integers shaped \(batch, local_seq\)"):
        R.ring_attention(q, q, q, doc_ids=torch.zeros(2, 5, dtype=torch.int64))
    with pytest.raises(ValueError, match="does not divide into 2 chunks"):
        R.shard_sequence(torch.randn(2, 7), 1)
    with pytest.raises(ValueError, match="position_ids must be integers"):
        R.document_ids(torch.zeros(2, 4))
    assert packed_position_ids(24).shape == (BATCH, 24)
