"""Grammar-forced tokens as drafts (issue 27): where a sequence's grammar admits one continuation
only (JSON syntax, a schema's keys, the fixed parts of a regex), that text is what the target
emits under the grammar's mask, so its tokens are drafts for free, whatever the proposer said.

llguidance computes them: LLMatcher.compute_ff_tokens() is the forced text ("fast-forward"),
tokenized as the tokenizer would, without a last token that more text could merge into. They are
the canonical tokens of that text; the masked target almost always takes them (it could prefer
another split of the same text, which the grammar also allows: then the verify rejects the draft
as any other, and nothing but the draft is lost).

drafts_under_grammar() turns a proposer's drafts for one sequence into the drafts to verify:
  - walking them through the grammar (the sequence's matcher after this step's tokens, rolled
    back at the end), where the state forces a token other than the proposer's draft, the
    proposer's drafts from there on are replaced by the forced run (its later drafts followed
    the one replaced, so they are dropped); a model drafter's loop already drafted the forced
    token at each position (draft_mask.DraftGrammar.force), so this matters for host drafters
    (n-gram, suffix);
  - a draft the grammar rejects cuts the drafts there (it cannot be accepted);
  - after the last draft the grammar took, its forced run is appended: those drafts go past the
    proposer's k. The step from host inputs (runner/host_step.py), which every structured
    request takes, verifies any number of drafts per sequence; the scheduler still cuts a
    verify at its token budget, max_model_len, max_tokens and adaptive speculation's limit.

Exactness. Greedy: the drafts are only proposals; the masked target's argmax decides each token.
Sampled requests whose drafts carry a distribution q (a model drafter's draws) keep their drafts
untouched (replacing or cutting a drawn draft would bias rejection sampling); the appended forced
drafts get a one-hot q (a forced draft was certain): rejection sampling then accepts it with the
masked target's probability p(x) and otherwise draws from p without x, the target's distribution.
Sampled requests with deterministic drafts (n-gram's: q one-hot already) take the full treatment.
"""

from __future__ import annotations

from dataclasses import dataclass

from foretell.structured.matcher import SequenceMatcher


@dataclass
class GrammarDrafts:
    token_ids: list[int]  # the drafts to verify
    num_forced: int  # how many at the end are the grammar's forced run (appended or replacing)
    num_replaced: int  # proposer drafts the forced run replaced


def forced_run(matcher, run: list[int], limit: int | None) -> list[int]:
    """The part of a forced run (from matcher.compute_ff_tokens(), at matcher's state) to draft:
    at most limit tokens (None: all), and only as many as the grammar takes in a row (checked
    by consuming them, then rolled back)."""
    if limit is not None:
        run = run[: max(0, limit)]
    if not run:
        return []
    taken = matcher.try_consume_tokens(run)
    if taken:
        matcher.rollback(taken)
    return run[:taken]


def drafts_under_grammar(
    sequence: SequenceMatcher,  # at the sequence's output after this step's tokens
    drafts: list[int],  # the proposer's next drafts
    replaceable: bool,  # the drafts may be cut or replaced (greedy, or deterministic drafts)
    max_drafts: int | None,  # most drafts in all (None: no bound beyond the scheduler's)
) -> GrammarDrafts:
    """The drafts to verify for one sequence (see the module docstring). The matcher ends where
    it started."""
    matcher = sequence.matcher
    kept: list[int] = []
    forced: list[int] = []  # the grammar's run, replacing the proposer's drafts from len(kept) on
    open_end = True  # whether the grammar's state after the kept drafts takes more
    num_consumed = 0
    for j, token in enumerate(drafts):
        if replaceable:
            run = matcher.compute_ff_tokens()
            if run and run[0] != token:
                forced = forced_run(matcher, run, None if max_drafts is None else max_drafts - j)
                if forced:
                    break
        if token in sequence.eos_token_ids or not matcher.try_consume_tokens([token]):
            open_end = False
            if not replaceable:  # a drawn draft stays (rejection sampling judges it)
                kept = list(drafts)
            elif token in sequence.eos_token_ids and matcher.is_accepting():
                kept.append(token)  # the output may end here: nothing after it
            break
        kept.append(token)
        num_consumed += 1
    appended = forced
    if open_end and not forced:
        appended = forced_run(matcher, matcher.compute_ff_tokens(), None if max_drafts is None else max_drafts - len(kept))
    if num_consumed:
        matcher.rollback(num_consumed)
    return GrammarDrafts(kept + appended, len(appended), len(drafts) - len(kept) if forced else 0)
