"""Each tensor-parallel layer on 2 ranks (gloo, CPU, float32) against its unsplit twin: the same
whole-checkpoint tensors, loaded through rank_slices and the weight loaders, give the same
outputs (column-parallel outputs gathered, row-parallel ones summed over ranks); the distributed
greedy argmax against torch.argmax on whole rows, ties included; and the size checks.

All layers run in one call on the session's two ranks (module fixture); the tests read its results.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from fixtures.tensor_parallel import fake_rank, load_whole
from foretell.distributed.tensor_parallel import TensorParallel
from foretell.layers.linear import Linear, MergedLinear, QKVLinear
from foretell.layers.parallel_linear import ColumnParallelLinear, RowParallelLinear, row_parallel_linear
from foretell.layers.vocab_parallel import ParallelLMHead, VocabParallelEmbedding, lm_head, vocab_embedding

HIDDEN, OUT, VOCAB, HEAD_DIM = 12, 10, 11, 4  # VOCAB odd: rank 1 holds a padding row
ATOL = 1e-5


def whole_tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    rand = lambda *shape: torch.randn(*shape, generator=g)  # noqa: E731
    return {
        "x": rand(5, HIDDEN), "w_col": rand(OUT, HIDDEN), "b_col": rand(OUT),
        "x_row": rand(5, OUT), "w_row": rand(HIDDEN, OUT), "b_row": rand(HIDDEN),
        "w_gate": rand(8, HIDDEN), "w_up": rand(8, HIDDEN),
        "w_q": rand(4 * HEAD_DIM, HIDDEN), "w_k2": rand(2 * HEAD_DIM, HIDDEN), "w_v2": rand(2 * HEAD_DIM, HIDDEN),
        "w_k1": rand(HEAD_DIM, HIDDEN), "w_v1": rand(HEAD_DIM, HIDDEN), "b_q": rand(4 * HEAD_DIM),
        "b_k1": rand(HEAD_DIM), "b_v1": rand(HEAD_DIM),
        "embed": rand(VOCAB, HIDDEN), "ids": torch.tensor([0, 5, 6, 10, 3, 10, 7]),
    }


# Whole logits rows for the tie rule: ranks hold ids [0, 6) and [6, 11).
TIE_ROWS = torch.tensor([
    [0.0, 1, 3, 0, 0, 0, 0, 0, 3, 0, 0],  # equal maxima on both ranks (2 and 8): 2
    [0.0, 1, 2, 0, 0, 0, 0, 5, 0, 5, 0],  # equal maxima within rank 1 (7 and 9): 7
    [1.0] * 11,  # all equal: 0
    [0.0] * 10 + [4.0],  # the last id only
    [float("-inf")] * 6 + [-1.0, -2, -1, -3, -5],  # rank 0 all -inf; 6 and 8 tie: 6
    [2.0, 2, 0, 0, 0, 0, 0, 0, 0, 0, 2],  # 0, 1 and 10 tie: 0
])


def layers_on_rank(tp: TensorParallel, t: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out = {}
    with torch.no_grad():
        col = ColumnParallelLinear(HIDDEN, OUT, bias=True, tp=tp)
        load_whole(col.weight, t["w_col"]), load_whole(col.bias, t["b_col"])
        out["column"] = tp.all_gather(col(t["x"]), dim=-1)

        row = row_parallel_linear(OUT, HIDDEN, bias=True, tp=tp)
        assert isinstance(row, RowParallelLinear)
        load_whole(row.weight, t["w_row"]), load_whole(row.bias, t["b_row"])
        start, part = tp.even_shard(OUT)
        out["row"] = row(t["x_row"][:, start:start + part])  # this rank's input columns

        gate_up = MergedLinear(HIDDEN, [8, 8], tp=tp)
        load_whole(gate_up.weight, t["w_gate"], 0), load_whole(gate_up.weight, t["w_up"], 1)
        out["gate_up"] = tp.all_gather(gate_up.forward_gated(t["x"]), dim=-1)

        for kv in (2, 1):  # KV heads split (2 over 2 ranks), then replicated (1 for 2 ranks)
            qkv = QKVLinear(HIDDEN, HEAD_DIM, 4, kv, bias=kv == 1, tp=tp)
            load_whole(qkv.weight, t["w_q"], "q")
            load_whole(qkv.weight, t[f"w_k{kv}"], "k"), load_whole(qkv.weight, t[f"w_v{kv}"], "v")
            if kv == 1:
                load_whole(qkv.bias, t["b_q"], "q")
                load_whole(qkv.bias, t["b_k1"], "k"), load_whole(qkv.bias, t["b_v1"], "v")
            q, k, v = qkv.split(qkv(t["x"]))
            out[f"heads_kv{kv}"] = (qkv.num_heads, qkv.num_kv_heads)
            out[f"q_kv{kv}"] = tp.all_gather(q, dim=-1)
            out[f"k_kv{kv}"], out[f"v_kv{kv}"] = k, v  # this rank's

        embed = vocab_embedding(VOCAB, HIDDEN, tp)
        load_whole(embed.weight, t["embed"])
        out["embed"] = embed(t["ids"])
        out["embed_padding_rows"] = embed.weight[embed.real_rows:].clone()

        head = lm_head(VOCAB, HIDDEN, tp, tie_to=embed)
        assert isinstance(head, ParallelLMHead) and head.weight is embed.weight
        out["logits"] = head(t["x"])
        out["greedy"] = head.greedy_tokens(t["x"])
        untied = lm_head(VOCAB, HIDDEN, tp)
        load_whole(untied.weight, t["embed"])
        out["untied_logits"] = untied(t["x"])

        start, rows, real = tp.padded_shard(VOCAB)
        out["tie_greedy"] = tp.greedy_argmax(TIE_ROWS[:, start:start + real], start)
        out["all_reduce"] = tp.all_reduce(torch.full((3,), float(tp.rank + 1)))
    return out


@pytest.fixture(scope="module")
def ranks(tp_ranks) -> list[dict[str, torch.Tensor]]:
    return tp_ranks.run(layers_on_rank, whole_tensors())


@pytest.fixture(scope="module")
def t() -> dict[str, torch.Tensor]:
    return whole_tensors()


def test_collectives_sum_and_gather(ranks):
    for r in ranks:
        assert r["all_reduce"].tolist() == [3.0, 3.0, 3.0]


def test_column_parallel_gathers_to_the_whole_linear(ranks, t):
    want = F.linear(t["x"], t["w_col"], t["b_col"])
    for r in ranks:
        torch.testing.assert_close(r["column"], want, rtol=0, atol=ATOL)


def test_row_parallel_sums_to_the_whole_linear_with_the_bias_once(ranks, t):
    want = F.linear(t["x_row"], t["w_row"], t["b_row"])
    for r in ranks:
        torch.testing.assert_close(r["row"], want, rtol=0, atol=ATOL)


def test_gate_up_is_split_per_part(ranks, t):
    want = F.silu(t["x"] @ t["w_gate"].T) * (t["x"] @ t["w_up"].T)
    for r in ranks:
        # gathered [gate0*up0 | gate1*up1]: the rank order of the whole intermediate
        torch.testing.assert_close(r["gate_up"], want, rtol=0, atol=ATOL)


def test_qkv_splits_query_and_kv_heads(ranks, t):
    q = t["x"] @ t["w_q"].T
    k, v = t["x"] @ t["w_k2"].T, t["x"] @ t["w_v2"].T
    for rank, r in enumerate(ranks):
        assert r["heads_kv2"] == (2, 1)
        torch.testing.assert_close(r["q_kv2"], q, rtol=0, atol=ATOL)
        cols = slice(rank * HEAD_DIM, (rank + 1) * HEAD_DIM)  # KV head `rank`
        torch.testing.assert_close(r["k_kv2"], k[:, cols], rtol=0, atol=ATOL)
        torch.testing.assert_close(r["v_kv2"], v[:, cols], rtol=0, atol=ATOL)


def test_qkv_replicates_a_single_kv_head(ranks, t):
    q = t["x"] @ t["w_q"].T + t["b_q"]
    k, v = t["x"] @ t["w_k1"].T + t["b_k1"], t["x"] @ t["w_v1"].T + t["b_v1"]
    for r in ranks:
        assert r["heads_kv1"] == (2, 1)
        torch.testing.assert_close(r["q_kv1"], q, rtol=0, atol=ATOL)
        torch.testing.assert_close(r["k_kv1"], k, rtol=0, atol=ATOL)  # whole on every rank
        torch.testing.assert_close(r["v_kv1"], v, rtol=0, atol=ATOL)


def test_vocab_parallel_embedding_and_head(ranks, t):
    want_logits = F.linear(t["x"], t["embed"])
    for r in ranks:
        assert torch.equal(r["embed"], F.embedding(t["ids"], t["embed"]))  # one rank adds zeros
        assert r["logits"].shape == (5, VOCAB)
        torch.testing.assert_close(r["logits"], want_logits, rtol=0, atol=ATOL)
        torch.testing.assert_close(r["untied_logits"], want_logits, rtol=0, atol=ATOL)
        assert r["greedy"].tolist() == want_logits.argmax(-1).tolist()
    assert ranks[0]["embed_padding_rows"].numel() == 0
    assert torch.equal(ranks[1]["embed_padding_rows"], torch.zeros(1, HIDDEN))


def test_distributed_argmax_ties_go_to_the_lowest_id(ranks):
    want = TIE_ROWS.argmax(-1)
    assert want.tolist() == [2, 7, 0, 10, 6, 0]  # torch's rule on whole rows, which we keep
    for r in ranks:
        assert r["tie_greedy"].tolist() == want.tolist()


# ----------------------------------------------------------------------- no processes needed


def test_single_rank_layers_are_the_plain_ones():
    tp = TensorParallel()
    assert type(row_parallel_linear(8, 4, tp=tp)) is Linear
    assert type(vocab_embedding(VOCAB, HIDDEN, tp)).__name__ == "VocabEmbedding"
    assert type(lm_head(VOCAB, HIDDEN, tp)).__name__ == "LMHead"
    for layer in (QKVLinear(HIDDEN, HEAD_DIM, 4, 2), MergedLinear(HIDDEN, [8, 8]), ColumnParallelLinear(HIDDEN, OUT)):
        assert not any(hasattr(p, "rank_slices") for p in layer.parameters())
    assert tp.greedy_argmax(TIE_ROWS, 0).tolist() == TIE_ROWS.argmax(-1).tolist()


def test_padded_vocabulary_rows():
    assert [fake_rank(r, 2).padded_shard(11) for r in range(2)] == [(0, 6, 6), (6, 6, 5)]
    assert [fake_rank(r, 4).padded_shard(5) for r in range(4)] == [(0, 2, 2), (2, 2, 2), (4, 2, 1), (6, 2, 0)]
    embed = VocabParallelEmbedding(5, HIDDEN, fake_rank(3, 4))  # a rank of padding only
    load_whole(embed.weight, torch.randn(5, HIDDEN))
    assert torch.equal(embed.weight, torch.zeros(2, HIDDEN))


@pytest.mark.parametrize("build, message", [
    (lambda tp: QKVLinear(HIDDEN, HEAD_DIM, 6, 2, tp=tp), "num_attention_heads = 6 is not divisible by tensor_parallel_size = 4"),
    (lambda tp: QKVLinear(HIDDEN, HEAD_DIM, 8, 6, tp=tp), "num_key_value_heads = 6 is not divisible"),
    (lambda tp: QKVLinear(HIDDEN, HEAD_DIM, 12, 3, tp=tp), "num_key_value_heads = 3 is fewer than tensor_parallel_size = 4"),
    (lambda tp: MergedLinear(HIDDEN, [6, 6], tp=tp), "output size = 6 is not divisible"),
    (lambda tp: row_parallel_linear(6, HIDDEN, tp=tp), "input size = 6 is not divisible"),
])
def test_sizes_that_do_not_divide_are_refused(build, message):
    with pytest.raises(ValueError, match=message):
        build(fake_rank(1, 4))


def test_a_checkpoint_tensor_of_the_wrong_whole_shape_is_refused():
    qkv = QKVLinear(HIDDEN, HEAD_DIM, 4, 2, tp=fake_rank(0, 2))
    with pytest.raises(ValueError, match=r"expected size 16 along dim 0.*found shape \(8, 12\)"):
        load_whole(qkv.weight, torch.randn(8, HIDDEN), "q")  # half of q: would fit one rank's part


def test_tensor_parallel_validates_itself():
    with pytest.raises(ValueError, match="rank must be in"):
        TensorParallel(2, 2, group="g")
    with pytest.raises(ValueError, match="needs its process group"):
        TensorParallel(0, 2)
    with pytest.raises(ValueError, match="world_size must be an integer >= 1"):
        TensorParallel(0, 0)
