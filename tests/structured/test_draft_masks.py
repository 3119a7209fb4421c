"""Grammar-masked drafters and batched masks (issue 27 follow-up).

- fill_verify_masks (one llguidance call for every sequence of a step) against SequenceMatcher's
  one-sequence walk, with valid, rejected, EOS and no drafts, and the matchers unmoved after;
  matchers copied from one kept per grammar stay independent, the kept ones bounded;
- DraftGrammar (the draft loop's masks): in target ids and through an EAGLE3-style d2t map, each
  position's mask equal to a fresh matcher's after the drafts so far, rows without a grammar
  unchanged, the sequence's own matcher never moved, a row ended by an EOS or outside the draft
  vocabulary left unmasked, a forced token drafted with one-hot probabilities;
- the engine: greedy output with masked drafters equals plain output (tests/structured/
  test_structured_spec.py holds that for every drafter); a masked self-drafting draft model accepts
  at least as much as the same drafter unmasked, and every draft under greedy; sampled output with
  a masked draft model has the plain target's distribution (chi-square).
"""

from __future__ import annotations

import collections

import numpy as np
import torch

from fixtures.grammar_stubs import VOCAB, FakeSeq, encode
from fixtures.chi_square import chi2_999, chi_square_two_samples
from foretell import LLM, SamplingParams
from foretell.structured.batched_fill import fill_verify_masks
from foretell.structured.bitmask import BitmaskBuffer, unpack_bitmask
from foretell.structured.draft_mask import DraftMask, MaskTimer
from foretell.structured.runtime import StructuredOutputs

PATTERN = r"[0-9]{2,3}-(ab|cd)x"


def allowed_ids(row: np.ndarray, width: int = VOCAB) -> set[int]:
    return set(np.nonzero(unpack_bitmask(torch.from_numpy(row[None].copy()), width)[0].numpy())[0].tolist())


def test_batched_fill_equals_the_one_sequence_walk(runtime, hf):
    eos = hf.eos_token_id
    regex_params = SamplingParams(temperature=0, structured_outputs={"regex": PATTERN})
    choice_params = SamplingParams(temperature=0, structured_outputs={"choice": ["yes", "no"]})
    cases = [  # (params, output so far, drafts)
        (regex_params, encode(hf, "4"), encode(hf, "2-ab") + encode(hf, "q") + encode(hf, "1")),  # rejected midway
        (regex_params, [], encode(hf, "12-cdx") + [eos, 7]),  # complete, then EOS, then past the end
        (regex_params, encode(hf, "77"), []),  # verifies no drafts
        (choice_params, encode(hf, "ye"), encode(hf, "s") + [eos]),  # the grammar's end, then EOS
        (choice_params, [], [eos, 5]),  # an EOS the grammar cannot take yet
        (regex_params, encode(hf, "1"), encode(hf, "z")),  # the first draft rejected
    ]
    matchers, drafts = [], []
    for seq_id, (params, output, draft) in enumerate(cases):
        matchers.append(runtime.matcher_for(FakeSeq(params, output, frozenset({eos}), seq_id)))
        drafts.append(draft)
    before = np.zeros((len(cases), runtime.num_words), dtype=np.int32)
    for m, row in zip(matchers, before):
        m.fill_mask(row)
    batched = np.full((sum(len(d) + 1 for d in drafts), runtime.num_words), 7, dtype=np.int32)
    taken = fill_verify_masks(runtime.executor, matchers, drafts, batched)
    first = 0
    for m, draft, t in zip(matchers, drafts, taken):
        expected = np.zeros((len(draft) + 1, runtime.num_words), dtype=np.int32)
        assert t == m.verify_masks(draft, expected)
        assert (batched[first: first + len(draft) + 1] == expected).all()
        first += len(draft) + 1
    assert taken[2] == 0 and taken[5] == 0 and taken[0] == len(encode(hf, "2-ab"))
    after = np.zeros_like(before)
    for m, row in zip(matchers, after):
        m.fill_mask(row)
    assert (after == before).all()  # every matcher back where it was


def test_sequences_of_one_grammar_get_independent_copies(runtime, hf, monkeypatch):
    """Matchers are copies of one kept per grammar (the lexer built once): each sequence's state is
    its own, and only the most recently used grammars are kept."""
    import foretell.structured.runtime as runtime_module

    monkeypatch.setattr(runtime_module, "MAX_CACHED_GRAMMARS", 2)
    eos = hf.eos_token_id
    params = SamplingParams(temperature=0, structured_outputs={"regex": PATTERN})
    first = FakeSeq(params, encode(hf, "12-"), frozenset({eos}), seq_id=30)
    second = FakeSeq(params, [], frozenset({eos}), seq_id=31)
    rows = np.zeros((2, runtime.num_words), dtype=np.int32)
    runtime.matcher_for(first).fill_mask(rows[0])
    runtime.matcher_for(second).fill_mask(rows[1])
    assert allowed_ids(rows[0]) == reference_mask(runtime, params, encode(hf, "12-"), eos)
    assert allowed_ids(rows[1]) == reference_mask(runtime, params, [], eos)
    assert allowed_ids(rows[0]) != allowed_ids(rows[1])
    for regex_text in ("a+", "b+", "c+"):
        runtime.matcher_for(FakeSeq(SamplingParams(temperature=0, structured_outputs={"regex": regex_text}), [],
                                    frozenset({eos}), seq_id=40))
        runtime.forget(40)
    assert len(runtime._grammars) == 2


def draft_mask_for(runtime, seqs, device="cpu") -> DraftMask:
    return DraftMask([None if s is None else runtime.matcher_for(s) for s in seqs], runtime.executor,
                     BitmaskBuffer(runtime.num_words, torch.device(device)), MaskTimer())


def reference_mask(runtime, params, tokens: list[int], eos: int) -> set[int]:
    """A fresh matcher after these tokens: the tokens it allows next."""
    seq = FakeSeq(params, tokens, frozenset({eos}), seq_id=999)
    row = np.zeros(runtime.num_words, dtype=np.int32)
    runtime.matcher_for(seq).fill_mask(row)
    runtime.forget(999)
    return allowed_ids(row)


def test_draft_grammar_follows_the_drafts_in_target_ids(runtime, hf):
    eos = hf.eos_token_id
    params = SamplingParams(temperature=0, structured_outputs={"regex": PATTERN})
    constrained = FakeSeq(params, encode(hf, "3"), frozenset({eos}), seq_id=1)
    mask = draft_mask_for(runtime, [None, None, constrained])  # sequences 0 and 1 have no grammar
    own_before = np.zeros(runtime.num_words, dtype=np.int32)
    runtime.matchers[1].fill_mask(own_before)
    grammar = mask.begin([2, 0], None)  # rows: the constrained sequence, then the free one
    drafted = encode(hf, "4-cd")
    gen = torch.Generator().manual_seed(0)
    for j, token in enumerate(drafted):
        logits = torch.randn(2, VOCAB, generator=gen)
        masked = grammar.mask(logits)
        expected = reference_mask(runtime, params, encode(hf, "3") + drafted[:j], eos)
        assert set(torch.isfinite(masked[0]).nonzero().flatten().tolist()) == expected
        assert torch.equal(masked[0][torch.isfinite(masked[0])], logits[0][torch.isfinite(masked[0])])
        assert torch.equal(masked[1], logits[1])  # no grammar: unchanged
        grammar.advance(torch.tensor([token, 5]))
    own_after = np.zeros_like(own_before)
    runtime.matchers[1].fill_mask(own_after)
    assert (own_after == own_before).all()  # the loop worked on copies
    assert mask.begin([0], None) is None  # no row with a grammar: nothing to do


def test_draft_grammar_through_a_draft_vocabulary(runtime, hf):
    """An EAGLE3 head's d2t: the mask is read in target ids and mapped; a row whose allowed
    tokens all lie outside the draft vocabulary keeps its logits and its grammar is dropped."""
    eos = hf.eos_token_id
    params = SamplingParams(temperature=0, structured_outputs={"regex": PATTERN})
    seq = FakeSeq(params, [], frozenset({eos}), seq_id=3)
    digits = sorted(reference_mask(runtime, params, [], eos))
    others = [t for t in range(VOCAB) if t not in digits]
    # Draft vocabulary: half the allowed first tokens and 40 others, in a shuffled order.
    order = torch.randperm(len(digits[::2]) + 40, generator=torch.Generator().manual_seed(1))
    d2t = torch.tensor(digits[::2] + others[:40])[order]
    grammar = draft_mask_for(runtime, [seq]).begin([0], d2t)
    logits = torch.randn(1, len(d2t))
    masked = grammar.mask(logits)
    finite = torch.isfinite(masked[0]).nonzero().flatten()
    assert set(d2t[finite].tolist()) == set(digits[::2])
    outside = draft_mask_for(runtime, [seq]).begin([0], torch.tensor(others[:40]))
    logits = torch.randn(1, 40)
    assert torch.equal(outside.mask(logits), logits)  # nothing of the grammar in the draft vocabulary
    outside.advance(torch.tensor([others[0]]))
    assert not outside.copies  # dropped: later positions are not masked


def test_draft_grammar_stops_at_eos(runtime, hf):
    eos = hf.eos_token_id
    params = SamplingParams(temperature=0, structured_outputs={"choice": ["yes", "no"]})
    seq = FakeSeq(params, encode(hf, "ye"), frozenset({eos}), seq_id=4)
    grammar = draft_mask_for(runtime, [seq]).begin([0], None)
    s = encode(hf, "s")
    for token in s:
        grammar.mask(torch.zeros(1, VOCAB))
        grammar.advance(torch.tensor([token]))
    masked = grammar.mask(torch.zeros(1, VOCAB))
    assert torch.isfinite(masked[0]).nonzero().flatten().tolist() == [eos]  # only the end
    grammar.advance(torch.tensor([eos]))
    logits = torch.randn(1, VOCAB)
    assert torch.equal(grammar.mask(logits), logits)  # after the end: unmasked


def test_forced_tokens_are_the_drafts_with_one_hot_probabilities(runtime, hf):
    """Where only one continuation is possible ("ye" -> "s"), that token is the draft whatever the
    drafter chose, and its draft probabilities are one-hot; a free row is left alone."""
    eos = hf.eos_token_id
    params = SamplingParams(temperature=1.0, structured_outputs={"choice": ["yes", "no"]})
    seq = FakeSeq(params, encode(hf, "ye"), frozenset({eos}), seq_id=5)
    grammar = draft_mask_for(runtime, [seq, None]).begin([0, 1], None)
    grammar.mask(torch.zeros(2, VOCAB))
    forced = encode(hf, "s")[0]
    assert grammar.forced == {0: forced}
    probs = torch.softmax(torch.randn(2, VOCAB), dim=-1)
    tokens, new_probs = grammar.force(torch.tensor([7, 9]), probs)
    assert tokens.tolist() == [forced, 9]
    assert torch.equal(new_probs[0], torch.nn.functional.one_hot(torch.tensor(forced), VOCAB).float())
    assert torch.equal(new_probs[1], probs[1])
    tokens, none = grammar.force(torch.tensor([7, 9]), None)  # greedy rows: no probabilities
    assert tokens.tolist() == [forced, 9] and none is None


# ---- the engine ---------------------------------------------------------------------------
PROMPTS = ["The cat reads the book. The cat", "def add(x):\n    return", "a b a b a b"]
REGEX = r"(the|cat|[0-9]{1,2})( (the|book|cat|[0-9]{1,2})){1,3}\."


def greedy_run(checkpoint, spec, mask_drafts: bool, monkeypatch) -> tuple[list, int, int]:
    """(tokens per prompt, drafts, accepted tokens) with the drafter masked or not."""
    with monkeypatch.context() as patch:
        if not mask_drafts:
            patch.setattr(StructuredOutputs, "draft_mask", lambda self, *args: None)
        with LLM(checkpoint, dtype="float32", num_kv_blocks=128, speculative_config=spec) as llm:
            params = SamplingParams(temperature=0, max_tokens=24, structured_outputs={"regex": REGEX})
            outs = llm.generate(PROMPTS, params, use_tqdm=False)
            stats = llm.get_stats()
    return [o.outputs[0].token_ids for o in outs], stats["num_draft_tokens"], stats["num_accepted_tokens"]


def test_masked_self_draft_accepts_every_draft(qwen3_checkpoint, monkeypatch):
    """The target drafting for itself, in fp32: masked, its drafts are the masked target's own
    greedy tokens, so every draft before the output's end is accepted; unmasked, fewer are."""
    spec = {"method": "draft_model", "model": qwen3_checkpoint, "num_speculative_tokens": 3}
    with LLM(qwen3_checkpoint, dtype="float32", num_kv_blocks=128) as llm:
        plain = [o.outputs[0].token_ids for o in llm.generate(
            PROMPTS, SamplingParams(temperature=0, max_tokens=24, structured_outputs={"regex": REGEX}), use_tqdm=False)]
    masked_tokens, masked_drafts, masked_accepted = greedy_run(qwen3_checkpoint, spec, True, monkeypatch)
    unmasked_tokens, unmasked_drafts, unmasked_accepted = greedy_run(qwen3_checkpoint, spec, False, monkeypatch)
    assert masked_tokens == plain and unmasked_tokens == plain
    # Unmasked drafts are still cut where the grammar rejects them and replaced where it forces a
    # token (StructuredOutputs.grammar_drafts), so what they lose is drafts, not their accept rate.
    assert masked_accepted > unmasked_accepted
    # Drafts are lost only at each output's end (past its EOS): at most k per prompt.
    assert masked_drafts - masked_accepted <= 3 * len(PROMPTS)


def test_sampled_output_with_a_masked_draft_model_keeps_the_distribution(qwen3_checkpoint, qwen3_tied_checkpoint):
    """Outputs under a small grammar, sampled at temperature 1: with a masked draft model the
    strings come with the plain target's frequencies (two-sample chi-square)."""
    params = SamplingParams(temperature=1.0, n=400, seed=3, max_tokens=6,
                            structured_outputs={"regex": r"[abc][abc ][abc]"})
    counts = []
    for spec in (None, {"method": "draft_model", "model": qwen3_tied_checkpoint, "num_speculative_tokens": 2}):
        with LLM(qwen3_checkpoint, dtype="float32", num_kv_blocks=512, max_num_seqs=128,
                 speculative_config=spec) as llm:
            out = llm.generate(["a b c"], params, use_tqdm=False)[0]
            stats = llm.get_stats()
        if spec is not None:
            assert stats["num_accepted_tokens"] > 0.1 * stats["num_draft_tokens"] > 0
        counts.append(collections.Counter(o.text for o in out.outputs))
    stat, dof = chi_square_two_samples(counts[0], counts[1])
    assert dof >= 3 and stat < chi2_999(dof), (stat, dof, counts)
