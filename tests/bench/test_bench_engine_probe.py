"""foretell.bench.engine_probe and foretell.bench.tiny_checkpoints on the CPU: the tiny checkpoints
load and speculation on them reproduces plain greedy decoding; the probes count steps, switch the
step pipeline off and back, time an EAGLE3 chain step, count active weight bytes from the written
file, and refuse what needs CUDA graphs with a clear error; the target model runs a hand-built
forward, a host drafter can be told to draft nothing, and the graph state says why nothing was
captured. (scripts/bench_gpu.py runs them on the GPU.)"""

from __future__ import annotations

import pytest
import torch

from foretell import LLM, SamplingParams
from foretell.bench import engine_probe as probe
from foretell.bench.tiny_checkpoints import write_tiny_eagle3_head, write_tiny_qwen3
from foretell.ops.attention.metadata import AttentionMetadata

PROMPTS = [{"prompt_token_ids": [(13 * i + 7 * j * j) % 440 + 1 for j in range(20 + 5 * i)]} for i in range(3)]
PARAMS = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny")
    target = write_tiny_qwen3(str(root / "qwen3"))
    head = write_tiny_eagle3_head(str(root / "head"), target, draft_vocab_size=256, aux_layer_ids=[0, 1, 2])
    return target, head


def make_llm(target, spec=None):
    return LLM(target, device="cpu", dtype="float32", skip_tokenizer_init=True, num_kv_blocks=64,
               speculative_config=spec, log_stats_interval_s=0)


@pytest.fixture(scope="module")
def plain(tiny):
    with make_llm(tiny[0]) as llm:
        yield llm


@pytest.fixture(scope="module")
def eagle3(tiny):
    with make_llm(tiny[0], {"method": "eagle3", "model": tiny[1], "num_speculative_tokens": 2}) as llm:
        yield llm


def tokens(llm):
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, PARAMS, use_tqdm=False)]


def test_tiny_checkpoints_load_and_speculation_matches_plain_greedy(plain, eagle3):
    expected = tokens(plain)
    assert all(len(t) == 12 for t in expected)
    assert len({tuple(t) for t in expected}) > 1  # the random model does not collapse to one output
    assert tokens(eagle3) == expected
    assert eagle3.get_stats()["num_drafts"] > 0


def test_tiny_head_rejects_a_draft_vocab_larger_than_the_target(tiny, tmp_path):
    with pytest.raises(ValueError, match="draft_vocab_size must be in"):
        write_tiny_eagle3_head(str(tmp_path / "bad"), tiny[0], draft_vocab_size=513, aux_layer_ids=[0])


def test_step_count_and_engine_facts(plain, eagle3):
    before = probe.engine_step_count(plain)
    plain.generate(PROMPTS[:1], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True), use_tqdm=False)
    assert probe.engine_step_count(plain) - before == 5  # one prefill step (its first token) + 4 decode steps
    assert probe.num_speculative_tokens(plain) is None and probe.num_speculative_tokens(eagle3) == 2
    assert probe.warm_up_seconds(plain) >= 0.0
    assert probe.max_model_len(plain) == 64 * 16  # the 64 KV blocks of 16 hold less than the config's 4096


def test_queue_ahead_off_restores_the_pipeline(plain):
    pipeline = plain.engine.runner.pipeline
    saved = pipeline.queue_ahead, list(pipeline.kinds)
    expected = tokens(plain)
    with probe.queue_ahead_off(plain):
        assert pipeline.queue_ahead is False and pipeline.kinds == []
        assert tokens(plain) == expected
    assert (pipeline.queue_ahead, pipeline.kinds) == saved


def test_draft_chain_step_is_timed_and_needs_an_eagle3_head(plain, eagle3):
    assert probe.draft_chain_step_ms(eagle3, iters=3, warmup=1) > 0
    with pytest.raises(ValueError, match="times an EAGLE3 head"):
        probe.draft_chain_step_ms(plain)


def test_graph_timers_say_they_need_cuda_graphs(plain, eagle3):
    with pytest.raises(ValueError, match="captured no CUDA graphs"):
        probe.target_graph_replay_ms(plain, 1, 1)
    with pytest.raises(ValueError, match="no captured draft loop"):
        probe.draft_loop_replay_ms(eagle3, 1)


def test_active_weight_bytes_counts_the_checkpoint_less_its_embedding(plain, tiny):
    from safetensors.torch import load_file

    state = load_file(f"{tiny[0]}/model.safetensors")
    values = sum(t.numel() for k, t in state.items() if k != "model.embed_tokens.weight")
    kv_scales = 2 * 4  # each of the 4 layers keeps a k and a v cache scale as parameters
    assert probe.active_weight_bytes(plain) == (values + kv_scales) * 4  # float32 engine
    with pytest.raises(ValueError, match="experts_per_token must be in"):
        probe.active_weight_bytes(plain, num_routed_experts=8, experts_per_token=9)


def test_target_model_runs_a_hand_built_forward_that_matches_the_engine(tiny, plain):
    first_token = tokens(plain)[0][0]
    with make_llm(tiny[0]) as llm:  # its own engine: the forward writes the cache's first blocks
        target = probe.target_model(llm)
        logits = _last_row_logits(target, PROMPTS[0]["prompt_token_ids"])
    assert int(logits.argmax()) == first_token  # the engine's first greedy token
    assert target.device.type == "cpu" and target.dtype == torch.float32
    assert target.vocab_size == probe.vocab_size(plain) and target.num_blocks == 64
    assert target.block_size > 0 and target.small_m_gemm_mode is None  # the CPU binds no few-row GEMMs


def _last_row_logits(target, ids) -> torch.Tensor:  # [1, vocab]
    """One eager prefill forward of ids over blocks 0.. of the target's cache."""
    rows, size = len(ids), target.block_size
    table = torch.arange(-(-rows // size), dtype=torch.int32)[None]  # [1, blocks]: the script's own blocks
    positions = torch.arange(rows)
    meta = AttentionMetadata(query_start_loc=torch.tensor([0, rows], dtype=torch.int32),
                             seq_lens=torch.tensor([rows], dtype=torch.int32), block_table=table,
                             slot_mapping=table[0, positions // size].long() * size + positions % size,
                             block_size=size, max_query_len=rows, max_seq_len=rows, query_start_loc_cpu=[0, rows],
                             seq_lens_cpu=[rows])
    with torch.inference_mode():
        hidden, _ = target.model(torch.tensor(ids), positions, meta)  # [rows, hidden]
        return target.model.compute_logits(hidden[-1:])


def test_propose_nothing_keeps_the_output_and_drafts_nothing(tiny, plain):
    expected = tokens(plain)
    with make_llm(tiny[0], {"method": "ngram", "num_speculative_tokens": 2}) as llm:
        probe.propose_nothing(llm)
        assert tokens(llm) == expected
        assert llm.get_stats()["num_drafts"] == 0
    with pytest.raises(ValueError, match="propose_nothing needs a host drafter"):
        probe.propose_nothing(plain)


def test_graph_state_says_why_the_cpu_engine_captures_nothing(plain):
    state = probe.parallel_graph_state(plain)
    assert state["captured"] is False and set(state) == {"allowed", "reason", "captured", "queue_ahead",
                                                         "padded_verify_steps", "host_verify_steps"}
