"""DeferredInputBatch (runner/input_batch.py): the scheduler's batch built at first use.

Checked: every field and property reads as build_input_batch's batch; reading only its device
and block size builds nothing; an attribute neither has still raises AttributeError; and on an
engine, a suffix drafter's padded steps of unequal draft counts never build the unpadded batch
(the padded verify builds its own), with greedy output unchanged.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from foretell import LLM, SamplingParams
from foretell.engine.scheduler import ScheduledSequence
from foretell.engine.sequence import Sequence
from foretell.runner import input_batch
from foretell.runner.graphed_verify import GraphedVerify
from foretell.runner.input_batch import DeferredInputBatch, build_input_batch
from foretell.sampling_params import SamplingParams as Params


def scheduled() -> list[ScheduledSequence]:
    """A prefill chunk, a decode row and a verify of two drafts, over blocks of 4."""
    items = []
    for seq_id, (tokens, computed, blocks, new, drafts, samples) in enumerate([
        (list(range(10)), 3, [7, 2, 5], 4, [], False),
        (list(range(6)), 5, [1, 9], 1, [], True),
        (list(range(9)), 8, [3, 4, 6, 8], 3, [11, 12], True),
    ]):
        seq = Sequence(seq_id, f"r{seq_id}", 0, tokens[:4], Params(max_tokens=8))
        seq.token_ids = list(tokens)
        seq.num_computed_tokens = computed
        seq.block_ids = blocks
        items.append(ScheduledSequence(seq, new, drafts, samples))
    return items


def test_reads_as_the_built_batch():
    items = scheduled()
    expected = build_input_batch(items, 4, torch.device("cpu"))
    deferred = DeferredInputBatch(items, 4, torch.device("cpu"))
    assert not deferred.is_built
    assert deferred.num_tokens == expected.num_tokens and deferred.is_built
    for field in dataclasses.fields(expected):
        assert getattr(deferred, field.name) == getattr(expected, field.name), field.name
    for name in ("num_seqs", "max_query_len", "block_table_width", "every_row_samples"):
        assert getattr(deferred, name) == getattr(expected, name), name
    assert torch.equal(deferred.input_ids, expected.input_ids)
    assert torch.equal(deferred.attn_metadata.slot_mapping, expected.attn_metadata.slot_mapping)


def test_device_and_block_size_build_nothing():
    deferred = DeferredInputBatch(scheduled(), 4, torch.device("cpu"))
    assert (deferred.device, deferred.block_size) == (torch.device("cpu"), 4)
    assert not deferred.is_built


def test_an_unknown_attribute_raises():
    deferred = DeferredInputBatch(scheduled(), 4, torch.device("cpu"))
    with pytest.raises(AttributeError):
        deferred.no_such_field
    assert deferred.is_built  # (the build ran; the field is still missing)
    with pytest.raises(AttributeError):
        deferred.no_such_field


def test_padded_steps_build_only_their_padded_batch(qwen3_checkpoint, monkeypatch):
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    prompts = ["The cat reads the book. The cat reads the book. The cat", "a b a b a b a b",
               "def add(x):\n    return x + 1\ndef add(x):\n    return", "1 2 3 1 2 3 1 2"]
    options = dict(dtype="float32", num_kv_blocks=128)
    plain = [o.outputs[0].token_ids for o in LLM(qwen3_checkpoint, **options).generate(prompts, params,
                                                                                         use_tqdm=False)]
    builds = []  # per build of the scheduler's batch: whether any of its sequences carried drafts
    build = input_batch.build_input_batch

    def counted(items, block_size, device):
        builds.append(any(item.draft_token_ids for item in items))
        return build(items, block_size, device)

    monkeypatch.setattr(input_batch, "build_input_batch", counted)
    spec = {"method": "suffix", "num_speculative_tokens": 8, "suffix_decoding_max_tree_depth": 10,
            "suffix_decoding_min_match_length": 2}
    llm = LLM(qwen3_checkpoint, speculative_config=spec, **options)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == plain
    kind = next(k for k in llm.engine.runner.pipeline.kinds if isinstance(k, GraphedVerify))
    drafting = kind.num_host_verified_steps  # every drafting step here (greedy rows only)
    assert kind.num_mixed_steps > 0
    # the runner's builds of drafting batches: only those whose drafts were all of one length
    # (the padded ones are built by GraphedVerify._padded_batch, its own import)
    assert builds.count(True) == drafting - kind.num_mixed_steps
