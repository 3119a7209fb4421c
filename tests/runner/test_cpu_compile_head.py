"""cpu_compile for the EAGLE3 head (runner/cpu_compile_head.py): the head's draft step compiled by
Inductor on the CPU agrees with Eagle3Head.step (logits, h, the draft cache's keys and values)
for a chain step and a catch-up over a verify's rows, at any context length without recompiling;
steps it does not cover run eagerly; EAGLE3 greedy output equals plain greedy output under the flag.

Compiling the head's two graphs takes ~20-40 s on 2 loaded cores: those tests are marked slow."""

from __future__ import annotations

import pytest
import torch

from fixtures.eagle3_steps import K, cpu_drafter, noisy_draft_cache, step_inputs
from foretell import LLM, SamplingParams
from foretell.runner.cpu_compile_head import CompiledHeadStep, install_cpu_compile_head
from foretell.spec_decode.proposer import catch_up_metadata
PROMPTS = [[11, 42, 7, 99, 3, 250, 18, 64, 5], [5, 17, 200, 31, 9, 77, 140, 2, 66, 8, 19]]


@pytest.fixture(autouse=True)
def fresh_dynamo():
    """Each test compiles for its own head object: drop the compiled code of earlier tests."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def unique_graphs() -> int:
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"]


@pytest.mark.slow
def test_compiled_head_step_matches_eager_without_recompiles(qwen3_checkpoint, eagle3_head):
    _, proposer = cpu_drafter(qwen3_checkpoint, eagle3_head)
    assert proposer.cpu_head_step is None  # the flag is off: nothing installed
    assert install_cpu_compile_head(proposer, (1, K + 1))
    step = proposer.cpu_head_step
    head = step.head
    cache, gen = noisy_draft_cache(head)  # [2, num_blocks, block_size, KV, D]
    block_size = proposer.draft_block_size
    target_hidden = head.fc.weight.shape[1] // 3  # fc: [H, 3 x the target's hidden]
    graphs_before = unique_graphs()
    with torch.inference_mode():
        for seq_len in (2, 3, 17, 40, 6 * block_size - 1):  # the context after the step's rows
            for rows in (1, K + 1):
                if seq_len < rows:
                    continue
                meta, ids, positions = step_inputs(head, seq_len, rows, block_size, gen)
                if rows == 1:  # a chain step: from the previous h, every row kept
                    kw, keep = {"g": torch.randn(1, head.hidden_size, generator=gen)}, None
                else:  # a catch-up: fc over the aux hidden states, one drafting row kept
                    kw = {"aux": [torch.randn(rows, target_hidden, generator=gen) for _ in range(3)]}
                    keep = torch.tensor([int(torch.randint(0, rows, (1,), generator=gen))])
                before = cache.clone()
                g = kw["g"] if rows == 1 else head.combine(kw["aux"])
                want_logits, want_h = head.step(ids, positions, g, meta, keep)
                eager_cache = cache.clone()
                cache.copy_(before)
                got_logits, got_h = step(ids, positions, meta, keep, **kw)
                torch.testing.assert_close(got_logits, want_logits, rtol=1e-5, atol=1e-5)
                torch.testing.assert_close(got_h, want_h, rtol=1e-5, atol=1e-5)
                torch.testing.assert_close(cache, eager_cache, rtol=1e-5, atol=1e-5)
                assert not torch.equal(cache, before)  # the rows' keys and values were written
    assert step.num_compiled_calls == 8 and step.num_eager_calls == 0
    assert step.compiled.num_direct_calls == 6  # after each graph's first call, no Dynamo entry
    assert unique_graphs() - graphs_before == 2  # a chain step and a catch-up, whatever the context


def test_steps_the_compiled_head_does_not_cover_run_eagerly(qwen3_checkpoint, eagle3_head, caplog):
    _, proposer = cpu_drafter(qwen3_checkpoint, eagle3_head)
    head = proposer.head
    step = CompiledHeadStep(head, (1, K + 1))
    block_size = proposer.draft_block_size
    table = torch.tensor([[1, 2], [3, 4]], dtype=torch.int32)
    two_seqs = catch_up_metadata([5, 7], [1, 1], table, block_size, block_size)
    g = torch.randn(2, head.hidden_size)
    with torch.inference_mode():
        logits, h = step(torch.tensor([3, 4]), torch.tensor([5, 7]), two_seqs, g=g)  # two sequences
        assert logits.shape == (2, head.draft_vocab_size) and h.shape == (2, head.hidden_size)
        three_rows = catch_up_metadata([5], [3], table[:1], block_size, block_size)  # no graph for 3 rows
        step(torch.tensor([3, 4, 5]), torch.arange(5, 8), three_rows, g=torch.randn(3, head.hidden_size))
    assert step.num_eager_calls == 2 and step.num_compiled_calls == 0
    with pytest.raises(ValueError, match=r"cpu_compile row counts must be in 1\.\.8, got \[9\]"):
        CompiledHeadStep(head, (1, 9))
    with caplog.at_level("WARNING", logger="foretell"):
        assert install_cpu_compile_head(proposer, (1, K + 1), tensor_parallel_size=2) is False
        assert install_cpu_compile_head(object(), (1,)) is False  # not an EAGLE3 drafter: nothing to do
    assert "the EAGLE3 head's step stays eager: tensor parallelism is not covered" in caplog.text
    assert proposer.cpu_head_step is None


@pytest.mark.slow
def test_eagle3_equals_plain_with_the_head_compiled(qwen3_checkpoint, eagle3_head):
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    plain = LLM(qwen3_checkpoint, dtype="float32", device="cpu", num_kv_blocks=32, num_cpu_threads=1,
                max_num_seqs=1)
    want = [o.outputs[0].token_ids for o in plain.generate(prompts, params)]
    spec, proposer = cpu_drafter(qwen3_checkpoint, eagle3_head, cpu_compile=True)
    assert [o.outputs[0].token_ids for o in spec.generate(prompts, params)] == want
    step = proposer.cpu_head_step
    assert step is not None and step.row_counts == (1, K + 1)
    assert step.num_compiled_calls > 2 * step.num_eager_calls  # the verify steps' drafting compiled
