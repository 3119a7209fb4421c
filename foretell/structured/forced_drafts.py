"""Grammar-forced tokens as drafts (issue 27): where a sequence's grammar admits one continuation
only (JSON syntax, a schema's keys, the fixed parts of a regex), that text is what the target
emits under the grammar's mask, so its tokens are drafts for free, whatever the proposer said.

llguidance computes them: LLMatcher.compute_ff_tokens() is the forced text ("fast-forward"),
tokenized as the tokenizer would, without a last token that more text could merge into. They are
the canonical tokens of that text; the masked target almost always takes them (it could prefer
another split of the same text, which the grammar also allows: then the verify rejects the draft
as any other, and nothing but the draft is lost). The token held back is drafted too
(forced_tail: the first token of the forced bytes left, LLMatcher.compute_ff_bytes(), as the
tokenizer splits them alone): a JSON array's "[" before its first item, the '"' that opens a
string value. The target takes that split or a merged token (such as '["' or '",'); a rejected
one costs its verify row only, which the padded step computes anyway (it verifies K + 1 rows a
sequence whatever the drafts).

drafts_under_grammar() turns a proposer's drafts for one sequence into the drafts to verify:
  - walking them through the grammar (the sequence's matcher after this step's tokens, rolled
    back at the end), where the state forces a token other than the proposer's draft, the
    proposer's drafts from there on are replaced by the forced run (its later drafts followed
    the one replaced, so they are dropped); a model drafter's loop on the host step already
    drafted the forced token at each position (draft_mask.DraftGrammar.force), the padded
    step's draft loop and host drafters (n-gram, suffix) did not;
  - a draft the grammar rejects cuts the drafts there (it cannot be accepted); what the grammar
    forces at that point (a held-back token, then its forced run) takes its place;
  - after the last draft the grammar took, its forced run is appended, up to max_drafts (the
    padded step verifies at most K drafts a sequence: StructuredOutputs.limit_drafts; on the
    host step, runner/host_step.py, any number, past the proposer's k; the scheduler still cuts
    a verify at its token budget, max_model_len, max_tokens and adaptive speculation's limit).

Exactness. Greedy: the drafts are only proposals; the masked target's argmax decides each token.
Sampled requests whose drafts carry a distribution q (a model drafter's draws) keep their drafts
untouched (replacing or cutting a drawn draft would bias rejection sampling); the appended forced
drafts get a one-hot q (a forced draft was certain): rejection sampling then accepts it with the
masked target's probability p(x) and otherwise draws from p without x, the target's distribution.
Sampled requests with deterministic drafts (n-gram's: q one-hot already) take the full treatment.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from foretell.structured.matcher import SequenceMatcher


@dataclass
class GrammarDrafts:
    token_ids: list[int]  # the drafts to verify
    num_forced: int  # how many at the end are the grammar's forced run (appended or replacing)
    num_replaced: int  # proposer drafts the forced run replaced
    num_held_back: int = 0  # forced drafts that are a token the fast-forward held back (forced_tail)


MAX_FORCED_TAIL = 64  # most tokens forced_tail() walks without a limit (a guard: grammars force far fewer)


def forced_tail(matcher, limit: int | None,
                tokenize: Callable[[bytes], list[int]] | None) -> tuple[list[int], int]:
    """The tokens the grammar forces from matcher's state, at most limit (None: MAX_FORCED_TAIL):
    its fast-forward tokens, and, with tokenize (the tokenizer's bytes -> ids), the token they
    hold back at the end of the forced text (one more text could merge into, such as a JSON
    array's "[" before its first item): the first token of the forced bytes left, drafted as if
    nothing merged (the target takes that split or another the grammar allows: then the verify
    rejects it), then whatever the grammar forces after it. Each is checked by consuming it; the
    matcher ends where it started. Returns the tokens and how many of them were held back."""
    most = MAX_FORCED_TAIL if limit is None else max(0, limit)
    tail: list[int] = []
    num_held_back = 0
    while len(tail) < most:
        run = matcher.compute_ff_tokens()[: most - len(tail)]
        held_back = not run and tokenize is not None
        if held_back:
            rest = matcher.compute_ff_bytes()
            run = tokenize(rest)[:1] if rest else []
        taken = matcher.try_consume_tokens(run) if run else 0
        tail += run[:taken]
        num_held_back += int(held_back and taken > 0)
        if taken == 0:
            break
    if tail:
        matcher.rollback(len(tail))
    return tail, num_held_back


def drafts_under_grammar(
    sequence: SequenceMatcher,  # at the sequence's output after this step's tokens
    drafts: list[int],  # the proposer's next drafts
    replaceable: bool,  # the drafts may be cut or replaced (greedy, or deterministic drafts)
    max_drafts: int | None,  # most drafts in all (None: no bound beyond the scheduler's)
    tokenize: Callable[[bytes], list[int]] | None = None,  # forced_tail's: None drafts no held-back token
) -> GrammarDrafts:
    """The drafts to verify for one sequence (see the module docstring). The matcher ends where
    it started."""
    matcher = sequence.matcher
    kept: list[int] = []
    forced: list[int] | None = None  # the grammar's tail, replacing the proposer's drafts from len(kept) on
    num_held_back = 0
    num_consumed = 0

    def room() -> int | None:
        return None if max_drafts is None else max_drafts - len(kept)

    for token in drafts:
        if replaceable:
            run = matcher.compute_ff_tokens()
            if run and run[0] != token:
                forced, num_held_back = forced_tail(matcher, room(), tokenize)
                if forced:
                    break
                forced = None
        if token in sequence.eos_token_ids or not matcher.try_consume_tokens([token]):
            if not replaceable:  # a drawn draft stays (rejection sampling judges it)
                kept = list(drafts)
                forced = []
            elif token in sequence.eos_token_ids and matcher.is_accepting():
                kept.append(token)  # the output may end here: nothing after it
                forced = []
            else:  # cut here; what the grammar forces instead (a held-back token) is drafted
                forced, num_held_back = forced_tail(matcher, room(), tokenize)
            break
        kept.append(token)
        num_consumed += 1
    replacing = bool(forced)
    if forced is None:  # every draft taken: the grammar's forced tail after them
        forced, num_held_back = forced_tail(matcher, room(), tokenize)
    if num_consumed:
        matcher.rollback(num_consumed)
    return GrammarDrafts(kept + forced, len(forced), len(drafts) - len(kept) if replacing else 0, num_held_back)
