"""Suffix decoding (SuffixDecoding, arXiv 2411.04975; vLLM's method "suffix"): a model-free drafter
that matches the end of a sequence against what came before and drafts the most frequent
continuation, as long as the match and its frequency justify.

Two suffix indexes (suffix_tree.py: a suffix trie kept as occurrence positions): one per
sequence over its prompt and output so far, and the global cache (suffix_cache.py) over the
responses of recent finished requests. Each sequence keeps its match in both (the matched
length and the occurrences) between steps. Each step, for each sequence that sampled:
  1. observe: store the tokens new since the last step and move both matches on by them (a
     match whose occurrences all stop is looked up again from the context's last
     min_match_length tokens): host work in proportion to the new tokens; a step that looks
     nothing up (paused by the gate, a prefill chunk) only keeps them pending, indexed in bulk
     at the next lookup or when the sequence is forgotten (the same index, the same drafts);
  2. budget: at most min(k, floor(max_spec_factor * match length)) tokens; no draft at all
     without a match of min_match_length tokens (a step without drafts costs what a plain
     decode step costs);
  3. walk: follow the most frequent next token while the path's empirical probability stays
     >= min_token_prob;
  4. take the index whose draft scores higher (sum of the prefixes' probabilities).
The acceptance gate (min_accepted_tokens > 0): a draft costs a verify step, which the engine cannot queue
ahead as it queues a plain decode step (the drafts come from the host after the step is read), so a draft pays
only when enough of it is accepted. Each sequence keeps the draft it proposed and, when the next step's tokens
arrive, counts how many of them it got right; a moving average of that count (half each step) below
min_accepted_tokens stops the sequence's drafting for `pause` tokens (no lookup, no draft: its steps are plain
decode steps, queued ahead, and the drafter only stores their tokens; the probe indexes them in one extend),
after which one draft probes again: accepted well (the average, reset to the bar at the pause, stays at or
above it), drafting goes on and the pause length starts over; else it pauses again, twice as long (up to
MAX_PAUSE tokens). Drafts change speed only, never the tokens: the output stays the target's.
The sequence's average alone over-predicts the next draft (it is updated on drafted steps only and halves each
step: one whole acceptance lifts it over the bar, and on GSM8K the drafts after it accept far less;
bench/suffix_gate_sim.py replays the real drafter over recorded outputs and shows it). What predicts a draft
is the match it comes from: drafts from a match of min_match_length to twice that accept much less than those
from longer matches. So under a learned "auto" bar each draft is also held to its class (MatchCalibration: the
length of its match, key_length to 2 key_length - 1, to 4 key_length - 1, longer): expected accepted = the
share of drafted tokens the class's last CALIBRATION_WINDOW judged drafts accepted, times the draft's length
(suffix_calibration.py); below the bar the draft is not proposed (no pause: the match grows with the tokens
and may leave the class), except one in PROBE_EVERY, which keeps the class's share current, and a draft right
after one accepted whole (a run going on).
min_accepted_tokens "auto" (suffix_gate.py): the bar is what a draft must accept for a drafting step to pay on
this machine, t_draft / t_plain - 1, learned from the time between the drafter's calls (one engine step each);
once learned, a draft no longer than the bar is not proposed (even accepted whole it cannot pay), a bar of k
or more looks nothing up (and the batch's next calls only stamp the clock: suffix_skips.py), and the longest
pause grows with the bar (PAUSE_PER_BAR). The bar the drafts face is that break-even plus a margin learned
from what the admitted drafts accepted against it (suffix_margin.py), so a class that over-predicts stops. A
verify step is the whole batch's: a batch of n drafts at all only when its drafts' expected accepted tokens
together reach n x bar (MatchCalibration.expected_in_all), else nobody drafts that step. "auto" is the fixed
AUTO_PRIOR_BAR under a hybrid drafter (a paused sequence takes the model's drafts there: no plain step shows
what drafting costs) and under tensor parallelism (each rank drafts for itself, and ranks must draft alike: no
bar from a rank's clock).
Under topk > 1 each draft is a tree (suffix_draft_tree.py, verified on the tree step through
tree/host_drafter.py); the gate judges it by the path its verify accepted, up to its depth.

The drafts are deterministic (argmax of the empirical distribution): no draft probabilities, so
rejection sampling treats them as one-hot and sampling stays exact.

The runner's padded host step calls propose_step, not propose: most steps draft for nobody (no
sequence has a match, or the gate pauses every one), and such a quiet step is found from the
scheduled sequences without a DraftBatch, observe or the bar (the same drafts and states; the gate
still times it): a no-draft step's host work is then near a plain engine's. Under a learned bar of k
or more the steps of sequences with pending tokens or a match are quiet too while the gate is sure
the bar stays there (StepCostBar.barred_step: no bar worked out, only the clock read).

Per-sequence state is keyed by DraftBatch.seq_ids; forget(seq_id) (a finished, aborted or
preempted sequence) moves its response (the tokens after its prompt) into the global cache;
drop_cached_responses() empties the cache (the engine's warm-up does, after its dummy requests). A
batch without seq_ids is drafted from fresh indexes (slow, same drafts as a first step).
"""

from __future__ import annotations

from typing import Callable

from foretell.spec_decode.proposer import DraftBatch, Proposal, ProposerBase, ProposerCapabilities
from foretell.spec_decode.suffix_cache import GlobalSuffixCache
from foretell.spec_decode.suffix_calibration import MatchCalibration
from foretell.spec_decode.suffix_draft_tree import TreeDraft, draft_tree, judged_draft
from foretell.spec_decode.suffix_gate import AUTO_PRIOR_BAR, PAUSE_PER_BAR, StepCostBar
from foretell.spec_decode.suffix_margin import RealisedMargin
from foretell.spec_decode.suffix_skips import SkippedCalls
from foretell.spec_decode.suffix_state import FIRST_PAUSE, MAX_PAUSE, SequenceState, SuffixSettings
from foretell.spec_decode.suffix_tree import EMPTY_DRAFT, Draft, Match


class SuffixProposer(ProposerBase):
    method = "suffix"

    def __init__(self, num_speculative_tokens: int, settings: SuffixSettings | None = None):
        super().__init__(num_speculative_tokens)
        self.settings = settings or SuffixSettings()
        s = self.settings
        self.cache = GlobalSuffixCache(s.key_length, s.max_tree_depth, s.max_cached_requests, s.max_cached_tokens)
        self.states: dict[int, SequenceState] = {}
        bar = s.min_accepted_tokens
        if bar == "auto":  # learned from the steps (suffix_gate.py); k + 1: no draft can pay
            self.cost_bar: StepCostBar | None = StepCostBar(max_bar=num_speculative_tokens + 1)
            self.bar = self.break_even = self.cost_bar.bar
            self.calibration: MatchCalibration | None = MatchCalibration(s.key_length)
            # what the admitted drafts realised against their bar, added to it (suffix_margin.py)
            self.margin: RealisedMargin | None = RealisedMargin(num_speculative_tokens + 1)
        elif isinstance(bar, (int, float)) and not isinstance(bar, bool) and bar >= 0:
            self.cost_bar, self.bar = None, float(bar)
            self.calibration = self.margin = None
        else:
            raise ValueError(f"suffix min_accepted_tokens must be a number >= 0 or 'auto', got {bar!r}")
        self.skips = SkippedCalls()  # calls that only stamp the clock (suffix_skips.py)

    @property
    def capabilities(self) -> ProposerCapabilities:
        return ProposerCapabilities(deterministic=True, drafts_from_tokens=True)

    @classmethod
    def from_config(cls, config, target_hf_config, options) -> "SuffixProposer":
        settings = SuffixSettings.from_config(config)
        if settings.min_accepted_tokens == "auto" and options.tensor_parallel.world_size > 1:
            # every rank drafts for itself and must draft alike: no bar from each rank's own clock
            settings.min_accepted_tokens = AUTO_PRIOR_BAR
        return cls(config.num_speculative_tokens, settings)

    # ---- state ---------------------------------------------------------------------------
    def observe(self, key: int | None, history: list[int], samples: bool,
                lookup: bool = True) -> SequenceState | None:
        """The sequence's state brought up to `history`; None when it drafts nothing this step
        (it does not sample, the gate pauses it, or not `lookup`: no sequence drafts this step).
        The gate first learns how much of the last draft the new tokens accepted. A step without
        a lookup only stores the new tokens (pending); a step with one indexes every pending and
        new token, moves both matches on by them (looked up again when they end)."""
        num_tokens = len(history)
        state = self.states.get(key) if key is not None else None
        new = state.new_tokens(history) if state is not None else None
        if new is None:
            state = SequenceState(self.settings)
            if key is not None:
                self.states[key] = state
            new = history[:]
        if new and state.last_draft:
            self._judge(state, new, num_tokens)
        if samples and state.prompt_length is None:
            state.prompt_length = num_tokens - 1  # the first sampled token ends the history
        if not (samples and lookup) or num_tokens < state.resume_at:  # no lookup: the tokens wait, unindexed
            if new:
                if state.pending:
                    state.pending += new
                else:  # (new is a list of its own: a prompt is not copied again)
                    state.pending = new if type(new) is list else list(new)
            return None
        if state.pending:
            new = state.pending + new
            state.pending = []
        own = state.index
        if new:
            own.extend(new)
            if state.own_match.positions:
                state.own_match = own.advance(state.own_match, new)
            if state.cache_match.positions:
                state.cache_match = self.cache.index.advance(state.cache_match, new)
        key = own.tail_key  # the gram the context ends with; looked up only where it occurred
        context = own.tokens  # = history, as a list (history may be a TokenHistory view: no copy)
        if not state.own_match.positions and key in own.head:
            state.own_match = own.lookup(context, key)
        cache = self.cache.index
        if not state.cache_match.positions and key in cache.head:
            state.cache_match = cache.lookup(context, key)
        return state

    def _judge(self, state: SequenceState, new: list[int], num_tokens: int) -> None:
        """The gate: how many of the last draft's tokens `new` (the tokens its verify emitted)
        accepted, into the average; below the bar, a pause of state.pause tokens."""
        draft, state.last_draft = state.last_draft, []
        tree, state.last_tree = state.last_tree, None
        bar = self.bar
        if bar <= 0:
            return
        accepted, length = judged_draft(draft, tree, new)  # (a tree: the path the new tokens follow)
        state.run_going = accepted == length
        if self.calibration is not None:
            self.calibration.add(state.last_match_length, accepted, length)
            if self.cost_bar.learned:  # admitted under a learned break-even bar: the margin learns
                self.margin.judge(self.break_even, accepted, self.cost_bar.num_intervals)
        average = accepted if state.accepted_average == float("inf") else 0.5 * (state.accepted_average + accepted)
        if average >= bar:
            state.accepted_average, state.pause = average, FIRST_PAUSE
            return
        self._pause(state, num_tokens)

    def _pause(self, state: SequenceState, num_tokens: int) -> None:
        """No lookup for state.pause tokens, then one probe; the next pause twice as long."""
        state.resume_at = num_tokens + state.pause
        longest = MAX_PAUSE if self.cost_bar is None else max(MAX_PAUSE, int(PAUSE_PER_BAR * self.bar))
        state.pause = min(2 * state.pause, longest)
        state.accepted_average = self.bar  # the probe after the pause decides alone
        state.own_match, state.cache_match = Match(), Match()  # looked up again at the resume

    def forget(self, seq_id: int) -> None:
        """A sequence is done (or preempted): its response joins the global cache."""
        state = self.states.pop(seq_id, None)
        self.skips.wake_one(seq_id, state)  # (a dormant sequence's tokens first: suffix_skips.py)
        if state is not None and state.prompt_length is not None:
            self.cache.add(state.tokens_from(state.prompt_length))  # pending tokens included

    def drop_cached_responses(self) -> None:
        """Forget the finished requests' responses in the global cache (after the warm-up's
        synthetic requests, which no later request should draft from); the "auto" gate's step
        costs start afresh too (the warm-up's steps compile kernels)."""
        self.cache.clear()
        if self.cost_bar is not None:
            self.cost_bar.restart()
            self.margin = RealisedMargin(self.k + 1)
        self.skips.wake(self.states)
        self.skips.stop()

    def stats(self) -> dict:
        """For get_stats(): the acceptance gate's bar now, and under "auto" the step costs it
        comes from (suffix_gate.StepCostBar.as_dict: "bar" is the break-even) and the realised
        margin added to it (suffix_margin.py) with the count of drafts judged into it."""
        if self.cost_bar is None:
            return {"suffix_gate": {"auto": False, "bar": self.bar}}
        costs = self.cost_bar.as_dict()  # (first: it times the quiet steps' stamps, which the decay counts)
        margin = self.margin.value(self.cost_bar.num_intervals)
        return {"suffix_gate": {**costs, "margin": round(margin, 4), "margin_judged": self.margin.num_judged}}

    # ---- drafting ------------------------------------------------------------------------
    def draft(self, state: SequenceState, max_tokens: int, min_length: float = 0.0) -> Draft | TreeDraft:
        """The better of the two indexes' drafts longer than min_length for a sequence
        (EMPTY_DRAFT without one): chains, or under topk > 1 trees (suffix_draft_tree.py) of
        max_tokens depth (the longer: the deeper). min_length: the "auto" gate's bar (a draft no
        longer than it cannot pay for its step even accepted whole)."""
        best = EMPTY_DRAFT
        if max_tokens <= min_length:
            return best
        s = self.settings
        for index, match in ((state.index, state.own_match), (self.cache.index, state.cache_match)):
            if not match.positions:
                continue
            budget = min(max_tokens, int(s.max_spec_factor * match.length))
            if budget <= min_length:
                continue
            if s.topk > 1:
                draft = draft_tree(index, match, budget, s.max_tree_nodes, s.topk, s.min_token_prob)
            else:
                tokens, score = index.draft(match, budget, s.min_token_prob)
                draft = Draft(tokens, match.length, score)
            if draft.depth > min_length and draft.token_ids and draft.score > best.score:
                best = draft
        return best

    def propose_drafts(self, batch: DraftBatch) -> list[Draft]:
        """Every sequence's draft (empty for those that did not sample or that the gate
        pauses); states updated."""
        return self._draft_batch(batch, *self._begin_gate(batch.seq_ids, batch.samples))

    def _begin_gate(self, seq_ids: list | None, samples: list[bool]) -> tuple[bool, float]:
        """The gate's call of this step (under "auto": its bar from the steps timed so far):
        (whether sequences look up matches, the length a draft must exceed). After a call whose
        learned bar was k or more, the next calls of the same batch only stamp the clock
        (StepCostBar.stamp_same_batch) and look nothing up, the bar not worked out (suffix_skips.py)."""
        cost_bar = self.cost_bar
        if cost_bar is None:
            return True, 0.0
        skips = self.skips
        if skips.left > 0 and seq_ids and all(samples) and cost_bar.stamp_same_batch(tuple(seq_ids)):
            skips.left -= 1
            return False, self.bar
        self.bar = self.break_even = cost_bar.begin_step(seq_ids, samples)
        if cost_bar.learned:  # the bar the drafts face: break-even plus what they realised (suffix_margin.py)
            self.bar = min(self.bar + self.margin.value(cost_bar.num_intervals), cost_bar.max_bar)
        # (the prior bar is a guess: it only gates as a fixed bar does)
        min_length = self.bar if cost_bar.learned else 0.0  # a draft no longer cannot pay, accepted whole
        # explore: a plain step to time; a bar of k or more: no draft can pay
        lookup = not cost_bar.explore and min_length < self.k
        if cost_bar.learned and not cost_bar.explore and not lookup:
            skips.start_run()
        else:
            skips.left = 0  # (the runs start over short once a step drafts: _draft_batch)
        return lookup, min_length

    def _draft_batch(self, batch: DraftBatch, lookup: bool, min_length: float) -> list[Draft]:
        """propose_drafts after the gate's call (_begin_gate gave lookup and min_length)."""
        seq_ids = batch.seq_ids if batch.seq_ids else [None] * batch.num_seqs
        drafts = []
        for i, (key, history, samples) in enumerate(zip(seq_ids, batch.histories, batch.samples)):
            state = self.observe(key, history, samples, lookup)
            if state is None or not (state.own_match.positions or state.cache_match.positions):
                drafts.append(EMPTY_DRAFT)
                continue
            draft = self.draft(state, batch.num_useful_drafts(i, self.k), min_length)
            held = min_length > 0 and draft.token_ids and not (state.run_going or self._expected_to_pay(draft))
            if held:
                draft = EMPTY_DRAFT  # (no pause: a longer match next step may pay)
            state.last_draft, state.last_match_length = draft.token_ids, draft.match_length
            state.last_tree = draft if isinstance(draft, TreeDraft) and draft.token_ids else None
            if min_length > 0 and not draft.token_ids and not held:
                # A match, but no draft the learned bar lets pay: the next lookups would likely
                # find the same, each costing host time on a step that would be plain anyway.
                self._pause(state, len(history))
            drafts.append(draft)
        drafted = any(d.token_ids for d in drafts)
        # A verify is the whole batch's (every sequence waits for it): the drafts together must be
        # expected to accept the bar for each of its n sequences, else nobody drafts.
        if (drafted and min_length > 0 and len(drafts) > 1
                and self.calibration.expected_in_all(drafts) < self.bar * len(drafts)):
            for key in seq_ids:  # nobody drafts this step: nothing to judge at the next
                state = self.states.get(key)
                if state is not None:
                    state.last_draft, state.last_tree = [], None
            drafts, drafted = [EMPTY_DRAFT] * len(drafts), False
            self.skips.start_run()  # the batch's next calls look nothing up (its lookups cost host time)
        elif drafted:
            self.skips.stop()
        if self.cost_bar is not None:
            self.cost_bar.end_step(drafted)
        return drafts

    def _expected_to_pay(self, draft: Draft) -> bool:
        """Whether the draft's class expects it to accept at least the bar (MatchCalibration;
        yes before the class is calibrated, and for one in PROBE_EVERY of a failing class)."""
        expected = self.calibration.expected(draft.match_length, draft.depth)
        return expected is None or expected >= self.bar or self.calibration.probe(draft.match_length)

    def propose(self, batch: DraftBatch) -> Proposal:
        tokens = [draft.token_ids for draft in self.propose_drafts(batch)]
        return Proposal(tokens, [None] * len(tokens))

    def propose_step(self, items, results, make_batch: Callable[[], DraftBatch]) -> list[list[int]] | None:
        """propose() for the runner's host step (host_drafts.propose_from_tokens), the DraftBatch
        built only when some sequence may draft: the drafts per sequence, or None when nobody
        drafts (a quiet step: the gate timed it, each sequence stored its new tokens, the results'
        next_drafts are left empty). items: the step's scheduled sequences (.samples, .seq.seq_id,
        .seq.token_ids: the tokens before this step's), results: theirs (.new_token_ids),
        make_batch: the step's DraftBatch (runner/host_drafts.token_draft_batch).

        A sequence is quiet when it sampled, its state has seen exactly seq.token_ids and holds no
        draft to judge, and either the gate pauses it through the new tokens (they wait in
        pending, as observe keeps them) or it has no match in either index and its context after
        the step's one new token ends with a gram that occurs in neither (observe's lookup would
        find nothing; the token is indexed now, as that lookup indexes it). Any other sequence
        with such a state is quiet only when the gate looks nothing up this step (the learned bar
        is k or more, or an exploration step: its tokens wait in pending); one without (a new
        sequence, a prefill chunk, a draft to judge) takes the DraftBatch. Sequences handled here
        before the DraftBatch is built have their tokens stored already: observe finds them seen
        (the same states and drafts as propose()'s; a token indexed here where observe would keep
        it pending changes no draft: the next lookup indexes pending tokens first). Every call
        makes the gate's one call of the step, as propose() does."""
        skips = self.skips
        if skips.dormant_ids is not None:  # a dormant batch (suffix_skips.py): nothing per sequence
            if skips.left > 0 and skips.skips(items) and self.cost_bar.stamp_same_batch(skips.dormant_ids):
                skips.left -= 1
                return None
            skips.wake(self.states)
        states, cache_head = self.states, self.cache.index.head
        ids, waiting = [], None
        for item, result in zip(items, results):
            seq = item.seq
            state = states.get(seq.seq_id)
            if state is None or state.last_draft or not item.samples or state.prompt_length is None:
                return [d.token_ids for d in self.propose_drafts(make_batch())]
            stored, pending, new = seq.token_ids, state.pending, result.new_token_ids
            tokens = state.index.tokens
            if (len(stored) != len(tokens) + len(pending) or not stored
                    or stored[-1] != (pending[-1] if pending else tokens[-1])):  # not what it has seen
                return [d.token_ids for d in self.propose_drafts(make_batch())]
            if len(stored) + len(new) < state.resume_at:  # paused through the new tokens
                if pending:
                    pending += new
                else:
                    state.pending = new[:]
            elif (pending or len(new) != 1 or state.own_match.positions or state.cache_match.positions
                  or not state.index.append_if_unmatched(new[0], cache_head)):
                if waiting is None:
                    waiting = []
                waiting.append((state, new))  # quiet only if the gate looks nothing up
            ids.append(seq.seq_id)
        cost_bar = self.cost_bar
        if waiting is None and not skips.left:  # (within a run of skipped calls: counted below, as _begin_gate does)
            if cost_bar is not None:  # the gate times the step as propose_drafts would (nothing drafted)
                cost_bar.quiet_step(tuple(ids))
            return None
        # The gate's bar surely k or more (no lookup, a quiet step for the gate: StepCostBar.barred_step)
        # (the margin as last set: it only decays, so the bar it gives is a little high for a while)
        barred = cost_bar is not None and cost_bar.barred_step(tuple(ids), self.k - self.margin.margin)
        if barred:  # what _begin_gate would have done at this step (the same skips whichever path runs)
            if skips.left > 0:
                skips.left -= 1
            else:
                skips.start_run()
        if not barred:
            lookup, min_length = self._begin_gate(ids, [True] * len(ids))
            if lookup:
                return [d.token_ids for d in self._draft_batch(make_batch(), lookup, min_length)]
        for state, new in waiting or ():  # observe without a lookup: the tokens wait, unindexed
            if state.pending:
                state.pending += new
            else:
                state.pending = new[:]
        if not barred:
            cost_bar.end_step(False)
        if skips.left > 0:  # the batch's next calls are skipped: nothing stored per sequence till then
            skips.sleep(items)
        return None
