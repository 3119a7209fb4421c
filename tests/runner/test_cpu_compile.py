"""cpu_compile (runner/cpu_compile.py): the target's decode and verify forward compiled by Inductor's
C++ backend on the CPU. Logprobs agree with Hugging Face's, greedy tokens with the eager engine's,
speculative output equals plain output
under the flag, the compiled forward agrees with the eager one (hidden, aux states, KV writes),
a growing context never recompiles, and bad input is refused with a clear message.

Compiling takes tens of seconds on 2 cores per row count, so the engine tests are marked slow."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from foretell import LLM, SamplingParams
from foretell.config import ModelConfig
from foretell.runner.cpu_compile import install_cpu_compile
from foretell.runner.input_batch import build_input_batch

PROMPTS = [[11, 42, 7, 99, 3, 250, 18, 64, 5], [5, 17, 200, 31, 9, 77, 140, 2, 66, 8, 19]]


@pytest.fixture(autouse=True)
def fresh_dynamo():
    """Each engine compiles for its own model object: drop the compiled code of earlier tests so
    they do not count against torch._dynamo's per-function cache limit."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def unique_graphs() -> int:
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"]


@pytest.mark.slow
def test_greedy_matches_hf_and_spec_equals_plain(qwen3_checkpoint, eagle3_head):
    from transformers import AutoModelForCausalLM

    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=1)
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    common = dict(dtype="float32", device="cpu", num_kv_blocks=32, num_cpu_threads=1,
                  max_num_seqs=1)  # batch 1: what the compiled forward covers
    plain = LLM(qwen3_checkpoint, **common, cpu_compile=True)
    outs = [o.outputs[0] for o in plain.generate(prompts, params)]
    plain_tokens = [o.token_ids for o in outs]
    forward = plain.engine.runner.model.model.cpu_forward
    assert forward is not None and forward.row_counts == (1,)
    assert forward.num_compiled_calls >= 2 * (params.max_tokens - 1)  # every decode step compiled

    # Each token's logprob against Hugging Face's forward over the same tokens (teacher forced)
    hf = AutoModelForCausalLM.from_pretrained(qwen3_checkpoint, dtype=torch.float32)
    for prompt, out in zip(PROMPTS, outs):
        logits = hf(torch.tensor([prompt + out.token_ids])).logits[0, len(prompt) - 1: -1]  # [12, vocab]
        want = torch.log_softmax(logits.double(), -1).gather(1, torch.tensor(out.token_ids)[:, None])[:, 0]
        got = torch.tensor([lp.logprob for lp in out.logprobs], dtype=torch.float64)
        torch.testing.assert_close(got, want, rtol=0, atol=1e-4)

    eager = LLM(qwen3_checkpoint, **common)
    assert [o.outputs[0].token_ids for o in eager.generate(prompts, params)] == plain_tokens

    spec = LLM(qwen3_checkpoint, **common, cpu_compile=True, speculative_config={
        "method": "eagle3", "model": eagle3_head, "num_speculative_tokens": 3})
    spec_tokens = [o.outputs[0].token_ids for o in spec.generate(prompts, params)]
    assert spec_tokens == plain_tokens
    forward = spec.engine.runner.model.model.cpu_forward
    assert forward.row_counts == (1, 4) and forward.num_compiled_calls > 0


@pytest.mark.slow
def test_compiled_forward_matches_eager_without_recompiles(qwen3_checkpoint):
    llm = LLM(qwen3_checkpoint, dtype="float32", device="cpu", num_kv_blocks=32, num_cpu_threads=1,
              cpu_compile=True, speculative_config=None)
    engine, runner = llm.engine, llm.engine.runner
    decoder = runner.model.model
    compiled = decoder.cpu_forward
    decoder.cpu_forward = None  # the prefill eagerly; the compiled forward is called by hand below
    prompt = [(7 * i + 3) % 250 + 1 for i in range(40)]  # 3 blocks of 16 hold it and a verify's 4 rows
    engine.add_request("r", {"prompt_token_ids": prompt},
                       SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True))
    engine.step()  # the prefill
    item = engine.scheduler.schedule().scheduled[0]
    block_size = runner.cache_plan.block_size
    caches = [layer.self_attn.attn.kv_cache for layer in decoder.layers]
    graphs_before = unique_graphs()
    aux_layers = (0, 2)
    with torch.inference_mode():
        compiled.row_counts = (1, 4)
        for rows in (1, 4):  # a decode row, a verify's 4 rows, at contexts of 3 and 2 blocks
            for fewer in range(0, 21, 5):  # the same step as if the context were `fewer` tokens shorter
                scheduled = replace(item, num_new_tokens=rows, draft_token_ids=PROMPTS[0][: rows - 1])
                batch = build_input_batch([scheduled], block_size, runner.device)
                meta = batch.attn_metadata
                meta.seq_lens_cpu = [meta.seq_lens_cpu[0] - fewer]
                meta.slot_mapping = meta.slot_mapping - fewer
                positions = batch.positions - fewer
                before = [c.clone() for c in caches]
                want, want_aux = decoder.forward_torch(batch.input_ids, positions, meta, aux_layers)
                eager_caches = [c.clone() for c in caches]
                for c, b in zip(caches, before):
                    c.copy_(b)
                got, got_aux = compiled(batch.input_ids, positions, meta, aux_layers)
                torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
                for g, w in zip(got_aux, want_aux):
                    torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)
                for c, e in zip(caches, eager_caches):
                    torch.testing.assert_close(c, e, rtol=1e-5, atol=1e-5)
    assert compiled.num_compiled_calls == 10 and compiled.num_eager_calls == 0
    assert compiled.compiled.num_direct_calls == 8  # after each graph's first call, no Dynamo entry
    assert unique_graphs() - graphs_before == 2  # one per row count, whatever the context length


def test_cpu_compile_refused_on_cuda_and_checked(qwen3_checkpoint):
    with pytest.raises(ValueError, match="cpu_compile applies to the CPU only.*cuda"):
        install_cpu_compile(object(), torch.device("cuda", 0))
    with pytest.raises(ValueError, match="cpu_compile must be True or False, got 'yes'"):
        ModelConfig(model=qwen3_checkpoint, cpu_compile="yes")


def test_cpu_compile_uncovered_model_stays_eager(caplog):
    class NotLlama(torch.nn.Module):
        pass

    with caplog.at_level("WARNING", logger="foretell"):
        assert install_cpu_compile(NotLlama(), torch.device("cpu")) is False
    assert "NotLlama has no compiled CPU forward" in caplog.text
