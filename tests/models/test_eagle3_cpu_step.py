"""The EAGLE3 head's CPU step in direct torch calls (models/eagle3_cpu_step.py) equals Eagle3Head.step
bit for bit: logits, h and the draft cache's keys and values, for a catch-up over a verify's rows
(fc over the aux hidden states, one or several kept rows) and for chain steps (from h), across
context lengths, with norm_before_residual either way; the runner turns it on for a packed CPU
head (a hybrid's too), and cpu_step_fits refuses heads it does not cover."""

from __future__ import annotations

import pytest
import torch

from fixtures.eagle3_steps import K, cpu_drafter as drafter, noisy_draft_cache, step_inputs
from foretell import LLM, SamplingParams
from foretell.models.eagle3_cpu_step import cpu_step_fits, eagle3_cpu_step


@pytest.mark.parametrize("before_residual", [False, True])
def test_direct_step_equals_head_step(qwen3_checkpoint, eagle3_head, before_residual):
    _, proposer = drafter(qwen3_checkpoint, eagle3_head)
    head = proposer.head
    assert proposer.cpu_direct_step and cpu_step_fits(head)
    head.midlayer.norm_before_residual = before_residual
    cache, gen = noisy_draft_cache(head)  # [2, num_blocks, block_size, KV, D]
    block_size = proposer.draft_block_size
    target_hidden = head.fc.weight.shape[1] // 3
    with torch.inference_mode():
        for seq_len in (1, 4, 17, 6 * block_size - 1):  # the context after the step's rows
            for rows, keep in ((1, None), (K + 1, [2]), (K + 1, [0, 3]), (2, None)):
                if seq_len < rows:
                    continue
                meta, ids, positions = step_inputs(head, seq_len, rows, block_size, gen)
                keep_rows = None if keep is None else torch.tensor(keep)
                if keep is None:  # a chain step: from the previous h
                    kw = {"g": torch.randn(rows, head.hidden_size, generator=gen)}
                    g = kw["g"]
                else:  # a catch-up: fc over the aux hidden states
                    kw = {"aux": [torch.randn(rows, target_hidden, generator=gen) for _ in range(3)]}
                    g = head.combine(kw["aux"])
                before = cache.clone()
                want_logits, want_h = head.step(ids, positions, g, meta, keep_rows)
                want_cache = cache.clone()
                cache.copy_(before)
                got_logits, got_h = eagle3_cpu_step(head, ids, positions, meta, keep_rows, **kw)
                assert got_logits.dtype == torch.float32 and got_logits.shape == want_logits.shape
                assert torch.equal(got_logits, want_logits) and torch.equal(got_h, want_h)
                assert torch.equal(cache, want_cache) and not torch.equal(cache, before)


def test_heads_it_does_not_cover(qwen3_checkpoint, eagle3_head, monkeypatch):
    _, proposer = drafter(qwen3_checkpoint, eagle3_head)
    head = proposer.head
    table = head.midlayer.normed_embedding
    head.midlayer.normed_embedding = None  # no table: the module path
    assert not cpu_step_fits(head)
    head.midlayer.normed_embedding = table
    gemm = head.midlayer.mlp.down_proj.small_m
    head.midlayer.mlp.down_proj.small_m = None  # a projection without the packed GEMM
    assert not cpu_step_fits(head)
    head.midlayer.mlp.down_proj.small_m = gemm
    assert cpu_step_fits(head)
    assert not cpu_step_fits(object())
    monkeypatch.setenv("FORETELL_CPU_DRAFT_WEIGHTS", "fp32")  # nothing packed: the runner leaves it off
    _, unpacked = drafter(qwen3_checkpoint, eagle3_head)
    assert not unpacked.cpu_direct_step and not cpu_step_fits(unpacked.head)


def test_eagle3_greedy_equals_plain_through_the_direct_step(qwen3_checkpoint, eagle3_head):
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    prompts = [{"prompt_token_ids": [11, 42, 7, 99, 3, 250, 18, 64, 5]}, {"prompt_token_ids": [5, 17, 200, 31, 9]}]
    spec, proposer = drafter(qwen3_checkpoint, eagle3_head)
    assert proposer.cpu_direct_step
    plain = LLM(qwen3_checkpoint, dtype="float32", device="cpu", num_kv_blocks=32, num_cpu_threads=1, max_num_seqs=1)
    got = [o.outputs[0].token_ids for o in spec.generate(prompts, params, use_tqdm=False)]
    want = [o.outputs[0].token_ids for o in plain.generate(prompts, params, use_tqdm=False)]
    assert got == want


def test_a_hybrids_eagle3_head_takes_the_direct_step(qwen3_checkpoint, eagle3_head):
    spec = {"method": "suffix", "hybrid": "eagle3", "model": eagle3_head, "num_speculative_tokens": 4,
            "hybrid_num_speculative_tokens": 2}
    hybrid = LLM(qwen3_checkpoint, dtype="float32", device="cpu", num_kv_blocks=32, num_cpu_threads=1,
                 speculative_config=spec).engine.runner.proposer
    assert hybrid.model.cpu_direct_step and hybrid.cpu_direct_step  # the flag reaches the head's proposer
