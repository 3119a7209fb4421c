"""The padded verify step without graphs (issue 31: eager mode is the same code without capture).

On the CPU's default torch attention backend (which reads host copies of the lengths) and under
--enforce-eager, greedy verify batches take the padded device step (runner/graphed_verify.py) on
the target's static buffers run eagerly (CudaGraphRunner with capture_graphs off and, for the
torch backend, reads_host_lengths: exact buckets, host lengths read from the buffers) and the
uncaptured draft loop (spec_decode/draft_graph.py). Checked here: greedy output equals the plain
engine's for each drafter (EAGLE3, a draft LM in both catch-up layouts, MTP on the DeepSeek-V3
fixture), requests ending mid-verify and near max_model_len stay exact, and the runner's own
pieces: the exact bucket, the host lengths in the metadata, the forward equal to the eager one.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from fixtures.padded_step import count_steps, short_context_copy
from foretell import LLM, SamplingParams
from foretell.runner.cuda_graph import CudaGraphRunner

PROMPTS = ["The cat reads the book. The cat", "a b a b a b a b", "Question: what"]




def generate(folder, max_tokens=12, prompts=PROMPTS, **kwargs):
    llm = LLM(folder, dtype="float32", num_kv_blocks=64, max_num_seqs=4, **kwargs)
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    return llm, [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


@pytest.fixture(scope="module")
def plain(qwen3_checkpoint):
    return generate(qwen3_checkpoint)[1]


@pytest.mark.parametrize("drafter", ["eagle3", "draft_model_other", "draft_model_self"])
@pytest.mark.parametrize("enforce_eager", [False, True])
def test_greedy_verifies_take_the_eager_padded_step(qwen3_checkpoint, qwen3_tied_checkpoint, eagle3_head, plain,
                                                    monkeypatch, drafter, enforce_eager):
    model = {"eagle3": eagle3_head, "draft_model_other": qwen3_tied_checkpoint,
             "draft_model_self": qwen3_checkpoint}[drafter]
    config = {"method": drafter.split("_other")[0].split("_self")[0], "model": model, "num_speculative_tokens": 3}
    counts = count_steps(monkeypatch)
    llm, got = generate(qwen3_checkpoint, speculative_config=config, enforce_eager=enforce_eager)
    assert got == plain
    runner = llm.engine.runner
    assert runner.graphs is None and runner.padded_forward is not None
    assert not runner.padded_forward.captures and runner.padded_forward.reads_host_lengths
    assert not runner.draft_graphs.captures and not runner.draft_graphs.graphs
    # Every verify after a prompt's first step is greedy with k drafts: the padded step takes it.
    assert counts["padded"] > 0 and counts["host_verify"] == 0, counts
    assert llm.engine.scheduler.keep_draft_rows
    stats = llm.get_stats()
    assert stats["num_free_kv_blocks"] == stats["num_kv_blocks"]
    if drafter == "draft_model_self":  # the target drafting for itself: its catch-up must be exact
        assert stats["num_accepted_tokens"] == stats["num_draft_tokens"] > 0


def test_eager_padded_step_caps_near_max_tokens_and_max_model_len(qwen3_checkpoint, eagle3_head, monkeypatch):
    """max_tokens not a multiple of the accepted lengths (acceptance capped on the padded step),
    and sequences that run into max_model_len (max_tokens unset; the last verifies, with fewer
    than k drafts, stay on the padded step, their padded rows past the limit)."""
    config = {"method": "eagle3", "model": eagle3_head, "num_speculative_tokens": 3}
    for max_tokens, limit in [(7, None), (None, 24)]:
        extra = {} if limit is None else {"max_model_len": limit}
        _, want = generate(qwen3_checkpoint, max_tokens=max_tokens, **extra)
        counts = count_steps(monkeypatch)
        llm, got = generate(qwen3_checkpoint, max_tokens=max_tokens, speculative_config=config, **extra)
        assert got == want and counts["padded"] > 0 and counts["host_verify"] == 0, (max_tokens, limit, counts)
        assert all(len(tokens) <= (max_tokens or limit) for tokens in got)
        stats = llm.get_stats()
        assert stats["num_free_kv_blocks"] == stats["num_kv_blocks"]


@pytest.mark.parametrize("drafter", ["eagle3", "draft_model", "suffix"])
def test_verifies_at_the_end_of_the_rotary_table_stay_padded(qwen3_checkpoint, eagle3_head, tmp_path, monkeypatch,
                                                            drafter):
    """A target (and draft LM) whose rotary table ends at the engine's max_model_len (40): the
    verifies of sequences running into the limit stay on the padded step, their padded rows past
    it rotated at its last position (input_batch.rows_within; unclamped they would index past the
    table), the draft loop's catch-up rows clamped the same way; greedy output equals plain's and
    every sequence ends at the limit."""
    folder = short_context_copy(qwen3_checkpoint, tmp_path, 40)
    config = {"eagle3": {"method": "eagle3", "model": eagle3_head, "num_speculative_tokens": 3},
              "draft_model": {"method": "draft_model", "model": folder, "num_speculative_tokens": 3},
              "suffix": {"method": "suffix", "num_speculative_tokens": 5}}[drafter]
    llm, want = generate(folder, max_tokens=None)
    assert llm.engine.runner.max_model_len == 40
    counts = count_steps(monkeypatch)
    llm, got = generate(folder, max_tokens=None, speculative_config=config)
    assert got == want and counts["padded"] > 0 and counts["host_verify"] == 0, counts
    assert [len(llm.engine.tokenizer.encode(p)) + len(t) for p, t in zip(PROMPTS, got)] == [40] * len(PROMPTS)
    stats = llm.get_stats()
    assert stats["num_draft_tokens"] > 0 and stats["num_free_kv_blocks"] == stats["num_kv_blocks"]


def test_mtp_at_the_end_of_the_rotary_table_stays_padded(checkpoint_root, tokenizer_dir, tmp_path, monkeypatch):
    """MTP on the DeepSeek-V3 fixture (MLA + MoE; the MLA path rotates its own rope part) whose
    rotary table ends at max_model_len (24): verifies into the limit stay padded, greedy = plain."""
    from fixtures import deepseek as ds

    folder = short_context_copy(ds.checkpoint(checkpoint_root, tokenizer_dir, "v3"), tmp_path, 24)
    prompts = [{"prompt_token_ids": [5, 17, 250, 3, 99, 41, 7]}, {"prompt_token_ids": [44, 9]}]
    llm, want = generate(folder, max_tokens=None, prompts=prompts)
    assert llm.engine.runner.max_model_len == 24
    counts = count_steps(monkeypatch)
    llm, got = generate(folder, max_tokens=None, prompts=prompts,
                        speculative_config={"method": "mtp", "num_speculative_tokens": 2})
    assert got == want and counts["padded"] > 0 and counts["host_verify"] == 0, counts
    assert [len(p["prompt_token_ids"]) + len(t) for p, t in zip(prompts, got)] == [24, 24]


def test_sampled_and_logprob_requests_take_the_padded_step(qwen3_checkpoint, eagle3_head, monkeypatch):
    """Sampled rows and logprobs (tests/runner/test_padded_logprobs.py) no longer leave the padded step."""
    counts = count_steps(monkeypatch)
    llm = LLM(qwen3_checkpoint, dtype="float32", num_kv_blocks=64, max_num_seqs=4,
              speculative_config={"method": "eagle3", "model": eagle3_head, "num_speculative_tokens": 2})
    sampled = SamplingParams(temperature=1.0, seed=3, max_tokens=8, ignore_eos=True)
    logprobs = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=2)
    outs = llm.generate(PROMPTS[:2], [sampled, logprobs], use_tqdm=False)
    assert counts["padded"] > 0 and counts["host_verify"] == 0
    assert all(len(o.outputs[0].token_ids) == 8 for o in outs)
    assert len(outs[1].outputs[0].logprobs) == 8


def test_mtp_on_the_mla_target_takes_the_eager_padded_step(checkpoint_root, tokenizer_dir, monkeypatch):
    from fixtures import deepseek as ds

    folder = ds.checkpoint(checkpoint_root, tokenizer_dir, "v3")
    prompts = [{"prompt_token_ids": [5, 17, 250, 3, 99, 41, 7]}, {"prompt_token_ids": [44]}]
    _, want = generate(folder, prompts=prompts)
    counts = count_steps(monkeypatch)
    llm, got = generate(folder, prompts=prompts, speculative_config={"method": "mtp", "num_speculative_tokens": 2})
    assert got == want and counts["padded"] > 0
    assert llm.engine.runner.padded_forward.reads_host_lengths


# ---- the runner's pieces ------------------------------------------------------------------------
class RecordingModel(nn.Module):
    """A target that records each forward's metadata and returns the ids as hidden states."""

    def __init__(self):
        super().__init__()
        self.seen = []

    def forward(self, input_ids, positions, metadata):
        self.seen.append(metadata)
        hidden = torch.stack([input_ids.float(), positions.float()], dim=1)  # [rows, 2]
        return hidden, [hidden + 1]

    def compute_logits(self, hidden):
        return torch.nn.functional.one_hot(hidden[:, 0].long(), 16).float()


def host_length_runner(model, reads_host_lengths=True):
    return CudaGraphRunner(model, max_num_seqs=8, query_lens=(1, 3), max_blocks_per_seq=8, block_size=4,
                           max_model_len=32, device=torch.device("cpu"), capture_graphs=False,
                           reads_host_lengths=reads_host_lengths)


def verify_batch(num_seqs: int):
    from foretell.runner.input_batch import InputBatch

    starts = [5 + 3 * i for i in range(num_seqs)]  # each sequence's first verify position
    return InputBatch(
        token_ids=[(7 * i + r) % 16 for i in range(num_seqs) for r in range(3)],
        position_list=[p + r for p in starts for r in range(3)],
        slot_list=[4 * i + (p + r) % 4 for i, p in enumerate(starts) for r in range(3)],
        block_ids=[[i, i + 1, i + 2, i + 3] for i in range(num_seqs)],
        query_start=[3 * i for i in range(num_seqs + 1)],
        seq_lens=[p + 3 for p in starts],
        block_size=4,
        device=torch.device("cpu"),
        logits_row_ids=list(range(3 * num_seqs)),
        sampling_seq_index=list(range(num_seqs)),
        row_positions=[p + r + 1 for p in starts for r in range(3)],
    )


@pytest.mark.parametrize("num_seqs", [1, 3, 5])
def test_host_length_runner_takes_the_exact_bucket_and_real_lengths(num_seqs):
    model = RecordingModel()
    runner = host_length_runner(model)
    batch = verify_batch(num_seqs)
    key = runner.bucket_for(batch)
    assert key == (num_seqs, 3)  # no padding sequences (slot -1 rows a torch backend would write)
    out = runner.run(batch, key)
    meta = model.seen[-1]
    assert meta.seq_lens_cpu == batch.seq_lens == meta.seq_lens.tolist()
    assert meta.query_start_loc_cpu == batch.query_start == meta.query_start_loc.tolist()
    assert meta.max_seq_len == max(batch.seq_lens)
    assert meta.slot_mapping.tolist() == batch.slot_list
    # The forward over the buffers is the eager forward over the batch's own tensors.
    want, _ = model(batch.input_ids, batch.positions, batch.attn_metadata)
    assert torch.equal(out.hidden[: batch.num_tokens], want)
    assert torch.equal(out.greedy[: batch.num_tokens], batch.input_ids)
    runner.run(verify_batch(2), (2, 3))
    assert list(runner.graphs) == [(2, 3)]  # uncaptured: only the latest outputs are held
    # A graph-safe runner pads to its bucket, with placeholder lengths, as on a GPU.
    padded = host_length_runner(RecordingModel(), reads_host_lengths=False)
    assert padded.bucket_for(batch) == (next(b for b in padded.buckets if b >= num_seqs), 3)
    assert not padded.captures and not runner.captures


def test_draft_loop_metadata_reads_host_lengths_only_when_asked():
    from foretell.spec_decode.draft_graph import device_metadata

    starts, seq_lens = torch.tensor([0, 2, 4], dtype=torch.int32), torch.tensor([9, 13], dtype=torch.int32)
    table, slots = torch.zeros(2, 4, dtype=torch.int32), torch.arange(4)
    real = device_metadata(starts, seq_lens, table, slots, 4, 2, 32, read_host_lengths=True)
    assert real.seq_lens_cpu == [9, 13] and real.max_seq_len == 13 and real.query_start_loc_cpu == [0, 2, 4]
    placeholder = device_metadata(starts, seq_lens, table, slots, 4, 2, 32)
    assert placeholder.seq_lens_cpu == [2, 2] and placeholder.max_seq_len == 32
