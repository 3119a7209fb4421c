"""Suffix decoding's acceptance gate judged on a simulated clock: `python -m foretell.bench.suffix_gate_sim
[--dataset gsm8k] [--costs h200,slow-host] [--k 3]`.

Why: on the GPU the default family's steps are a fraction of a millisecond of host work, and a
bench's tok/s moves by tens of percent between calls and machines; whether a gate change helps is
lost in that noise. Here the real drafter (SuffixProposer, its gate, its StepCostBar) replays the
target's recorded greedy outputs (bench/suffix_traces.py) one engine step at a time at batch 1,
while a small event model of the engine says what each step costs; the clock the gate reads is the
model's. Same traces, same costs: the same result every run.

The event model (batch 1, steps queued ahead as runner/step_pipeline.py queues them; costs in ms,
StepCosts). The drafter is called once per engine step; the interval from call i to call i + 1
is step i + 1, and what it costs follows from what calls i, i - 1 and i - 2 drafted:
  - call i drafted: a drafting step (verify of 1 + draft rows): draft_first when call i - 1 did not
    draft (the plain step queued ahead is dropped but ran: it is in the interval), else draft;
  - call i did not draft, call i - 1 did: the fallback step, fallback (launched from the host
    after the verify was read, not queued ahead);
  - neither, call i - 2 drafted: after_fallback (default: plain; a pipeline slower to get back to
    steady state than the gate assumes);
  - neither: plain (queued ahead).
A step yields 1 + accepted tokens (accepted: the draft's agreement with the recorded output, at
most what is left of it). Each request costs `request` once (its prefill, admission and finish),
in both engines; the plain engine's decode steps cost plain_engine each (default: plain). Noise
(IntervalNoise, seeded, each factor of mean 1: the plain engine's mean is unchanged): jitter > 0
multiplies each interval by a log-normal factor of sigma jitter; spell in [0, 1) correlates the
log factors of consecutive intervals (AR(1): a host's slow and fast spells, same stationary sigma).
tail_share of the intervals (drawn independently) take tail_ms more (a host's occasional slow step:
a collection, a page fault, another process; the same time whatever the step, so it weighs most on
the cheapest, the plain step); the plain engine's steps pay its mean (tail_share * tail_ms each).
The run follows `foretell bench`: the engine's warm-up (costs restarted, cache emptied), the
bench's warm-up (every prompt for one token, then the first prompt for WARMUP_MAX_TOKENS, the
gate timing it), then the prompts in order, one at a time, each finished request's response
joining the global cache.

Reported per cost set: tok/s of the plain engine, of suffix under each gate (`auto`: the gate as
it is; a number: a fixed bar), and of an oracle: the fastest schedule of drafting and plain steps
under the same event model that knows what each draft would accept (dynamic programming over each
request's positions and the last two steps' kinds; the drafts are the ungated drafter's, one token
at a time). Also the mean acceptance length (tokens per drafting step), the share of steps that
drafted and the gate's last bar.

COST_SETS: "h200" holds the step intervals the gate read on the H200 (GSM8K and repetitive
sessions of docs/perf-log.md, issue 29); "slow-host" a host where a plain step costs more and a
drafting step relatively less; "h200-split" the H200 set with a drafting run's first step holding
the dropped queued plain step, its later steps not. Other costs: --costs P,D,F[,D1[,A]] in ms.
"""

from __future__ import annotations

import argparse
import math
import random
from dataclasses import dataclass, replace

from foretell.spec_decode.proposer import DraftBatch
from foretell.spec_decode.suffix import SuffixProposer, SuffixSettings
from foretell.spec_decode.suffix_gate import StepCostBar

WARMUP_MAX_TOKENS = 16  # bench/offline.py's warm-up run


@dataclass(frozen=True)
class StepCosts:
    """One machine's step costs in ms (the module docstring's event model)."""

    plain: float  # a plain step queued ahead
    draft: float  # a drafting step after a drafting step
    fallback: float  # the plain step after a drafting run (not queued ahead)
    draft_first: float | None = None  # a drafting step after a plain one (None: draft)
    after_fallback: float | None = None  # the step after the fallback (None: plain)
    request: float = 0.5  # per request, both engines (prefill, admission, finish)
    plain_engine: float | None = None  # the plain engine's decode step (None: plain)
    jitter: float = 0.0  # log-normal sigma of each interval's factor (0: exact)
    spell: float = 0.0  # correlation of consecutive intervals' log factors (AR(1))
    tail_share: float = 0.0  # share of intervals that take tail_ms more
    tail_ms: float = 0.0

    def step(self, drafted: bool, drafted_before: bool, drafted_2_before: bool) -> float:
        """The interval after a call that drafted (or not), given the two calls before it."""
        if drafted:
            if not drafted_before and self.draft_first is not None:
                return self.draft_first
            return self.draft
        if drafted_before:
            return self.fallback
        if drafted_2_before and self.after_fallback is not None:
            return self.after_fallback
        return self.plain

    @property
    def baseline(self) -> float:
        return (self.plain if self.plain_engine is None else self.plain_engine) + self.tail_share * self.tail_ms


COST_SETS = {
    "h200": StepCosts(plain=0.25, draft=0.99, fallback=0.52),
    "h200-split": StepCosts(plain=0.25, draft=0.74, draft_first=0.99, fallback=0.52),
    "slow-host": StepCosts(plain=0.35, draft=0.70, fallback=0.45),
}


def parse_costs(text: str) -> StepCosts:
    """A COST_SETS name or "P,D,F[,D1[,A]]" in ms (D1: draft_first, A: after_fallback)."""
    if text in COST_SETS:
        return COST_SETS[text]
    try:
        values = [float(v) for v in text.split(",")]
    except ValueError:
        values = []
    if not 3 <= len(values) <= 5 or min(values) <= 0:
        raise ValueError(f"costs must be one of {sorted(COST_SETS)} or P,D,F[,D1[,A]] in ms > 0, got {text!r}")
    names = ("plain", "draft", "fallback", "draft_first", "after_fallback")
    return StepCosts(**dict(zip(names, values)))


class IntervalNoise:
    """Each interval's noise (the module docstring's), from a seeded generator."""

    def __init__(self, costs: StepCosts, seed: int):
        self.costs, self.rng = costs, random.Random(seed)
        self.level = 0.0  # the AR(1) log factor (stationary sigma: jitter)
        if not (costs.jitter >= 0.0 and 0.0 <= costs.spell < 1.0 and 0.0 <= costs.tail_share <= 1.0
                and costs.tail_ms >= 0.0):
            raise ValueError(f"noise needs jitter >= 0, 0 <= spell < 1, 0 <= tail_share <= 1, tail_ms >= 0: {costs}")

    def apply(self, ms: float) -> float:
        """An interval of mean ms as timed: times the jitter's factor (mean 1), plus the tail."""
        c, rng = self.costs, self.rng
        if c.jitter:
            rho = c.spell
            self.level = rho * self.level + math.sqrt(1.0 - rho * rho) * rng.gauss(0.0, c.jitter)
            ms *= math.exp(self.level - 0.5 * c.jitter ** 2)
        if c.tail_share and rng.random() < c.tail_share:
            ms += c.tail_ms
        return ms


class SimClock:
    """The gate's clock: seconds, moved by the simulation."""

    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def batch_of(history: list[int], seq_id: int, k: int) -> DraftBatch:
    """A one-sequence DraftBatch as the runner hands a host drafter (only what it reads is real)."""
    return DraftBatch(
        start_positions=[len(history) - 2], num_valid_rows=[1], next_token_ids=[history[-1]], samples=[True],
        token_ids=None, hidden_states=None, aux_hidden_states=[], block_table=None, block_size=16,
        sampling_params=[None], sample_indices=[0], max_model_len=len(history) + 4 * k + 4096,
        histories=[history], seq_ids=[seq_id],
    )


def agreement(draft: list[int], output: list[int], pos: int) -> int:
    """How many of the draft's tokens a verify at output position pos accepts (its agreement with
    the output, leaving the last token of the output to the target)."""
    limit = min(len(draft), len(output) - pos - 1)
    a = 0
    while a < limit and draft[a] == output[pos + a]:
        a += 1
    return a


@dataclass
class RunResult:
    """One simulated run of a gate (or of the plain engine) over a trace."""

    tokens: int = 0
    seconds: float = 0.0
    steps: int = 0
    drafting_steps: int = 0
    drafted_tokens: int = 0  # tokens the drafting steps yielded (1 + accepted each)
    bar: float | None = None
    gate: dict | None = None  # the drafter's stats() at the end (an "auto" gate's step costs)

    @property
    def tok_s(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0

    @property
    def mean_length(self) -> float:
        return self.drafted_tokens / self.drafting_steps if self.drafting_steps else 0.0


def make_proposer(k: int, gate, clock: SimClock) -> SuffixProposer:
    """The real drafter with the gate under test; an "auto" gate reads the simulated clock."""
    proposer = SuffixProposer(k, SuffixSettings(min_accepted_tokens=gate))
    if proposer.cost_bar is not None:
        proposer.cost_bar = StepCostBar(max_bar=k + 1, clock=clock)
    return proposer


def simulate(trace: dict, costs: StepCosts, k: int, gate="auto", seed: int = 0,
             proposer_factory=None) -> RunResult:
    """The drafter with `gate` replaying the trace under the event model (module docstring).
    proposer_factory(k, gate, clock) -> a proposer (default: make_proposer)."""
    clock = SimClock()
    proposer = (proposer_factory or make_proposer)(k, gate, clock)
    noise = IntervalNoise(costs, seed)
    prompts, outputs = trace["prompts"], trace["outputs"]
    proposer.drop_cached_responses()  # the engine's warm-up
    seq_ids = iter(range(1 << 30))
    for prompt, output in zip(prompts, outputs):  # the bench's warm-up: one token each
        seq_id = next(seq_ids)
        proposer.propose_drafts(batch_of(prompt + output[:1], seq_id, k))
        proposer.forget(seq_id)
    result = RunResult()
    if prompts:
        _request(proposer, clock, costs, noise, k, prompts[0], outputs[0][:WARMUP_MAX_TOKENS], next(seq_ids), RunResult())
    for prompt, output in zip(prompts, outputs):
        _request(proposer, clock, costs, noise, k, prompt, output, next(seq_ids), result)
    result.bar = proposer.bar
    result.gate = proposer.stats().get("suffix_gate")
    return result


def _request(proposer, clock: SimClock, costs: StepCosts, noise: IntervalNoise, k: int, prompt: list[int],
             output: list[int], seq_id: int, result: RunResult) -> None:
    """One request from its prefill to its forget, into result."""
    clock.now += 1e-3 * costs.request
    result.seconds += 1e-3 * costs.request
    result.tokens += len(output)
    history = prompt + output[:1]
    pos, before, before_2 = 1, False, False
    while pos < len(output):
        draft = proposer.propose_drafts(batch_of(history, seq_id, k))[0].token_ids
        drafted = bool(draft)
        emitted = 1 + agreement(draft, output, pos) if drafted else 1
        seconds = 1e-3 * noise.apply(costs.step(drafted, before, before_2))
        clock.now += seconds
        result.seconds += seconds
        result.steps += 1
        if drafted:
            result.drafting_steps += 1
            result.drafted_tokens += emitted
        history = history + output[pos : pos + emitted]
        pos += emitted
        before, before_2 = drafted, before
    proposer.forget(seq_id)


def plain_run(trace: dict, costs: StepCosts) -> RunResult:
    """The plain engine: a request's cost, then one plain step per token after the first."""
    result = RunResult()
    for output in trace["outputs"]:
        result.tokens += len(output)
        result.steps += len(output) - 1
        result.seconds += 1e-3 * (costs.request + costs.baseline * (len(output) - 1))
    return result


def acceptance_table(trace: dict, k: int) -> list[list[tuple[int, int, float]]]:
    """Per request, per output position (from 1): (draft length, accepted, score) of the ungated
    drafter's draft there (called at every position, as a run drafting one token a step would
    be; the global cache filled as simulate() fills it)."""
    proposer = SuffixProposer(k, SuffixSettings(min_accepted_tokens=0.0))
    prompts, outputs = trace["prompts"], trace["outputs"]
    seq_ids = iter(range(1 << 30))
    for prompt, output in zip(prompts, outputs):
        seq_id = next(seq_ids)
        proposer.propose_drafts(batch_of(prompt + output[:1], seq_id, k))
        proposer.forget(seq_id)

    def replay(prompt, output, keep):
        seq_id, rows = next(seq_ids), []
        for pos in range(1, len(output)):
            draft = proposer.propose_drafts(batch_of(prompt + output[:pos], seq_id, k))[0]
            rows.append((len(draft.token_ids), agreement(draft.token_ids, output, pos), draft.score))
        proposer.forget(seq_id)
        return rows

    if prompts:
        replay(prompts[0], outputs[0][:WARMUP_MAX_TOKENS], False)
    return [replay(p, o, True) for p, o in zip(prompts, outputs)]


def oracle_seconds(table: list[list[tuple[int, int, float]]], outputs: list[list[int]], costs: StepCosts) -> float:
    """The fastest schedule's decode seconds (requests' costs included) knowing every draft's
    acceptance: per request, dynamic programming over (position, the last two calls' drafting)."""
    total = 0.0
    for rows, output in zip(table, outputs):
        n = len(output)
        # best[pos][(before, before_2)]: least ms from output position pos to the end
        best = [[0.0] * 4 for _ in range(n + 1)]
        for pos in range(n - 1, 0, -1):
            length, accepted, _ = rows[pos - 1]
            for state in range(4):
                before, before_2 = bool(state & 1), bool(state & 2)
                cost = costs.step(False, before, before_2) + best[pos + 1][0 | (2 if before else 0)]
                if length:
                    nxt = min(n, pos + 1 + accepted)
                    cost = min(cost, costs.step(True, before, before_2) + best[nxt][1 | (2 if before else 0)])
                best[pos][state] = cost
        total += costs.request + (best[1][0] if n > 1 else 0.0)
    return 1e-3 * total


def compare(trace: dict, costs: StepCosts, k: int, gates=("auto",), seed: int = 0) -> dict:
    """tok/s of the plain engine, of each gate and of the oracle under one cost set, with each
    gate's ratio to plain and to the oracle."""
    plain = plain_run(trace, costs)
    tokens = plain.tokens
    oracle = tokens / oracle_seconds(acceptance_table(trace, k), trace["outputs"], costs)
    rows = {"plain": {"tok_s": round(plain.tok_s, 1)}, "oracle": {"tok_s": round(oracle, 1),
                                                                   "vs_plain": round(oracle / plain.tok_s, 3)}}
    for gate in gates:
        run = simulate(trace, costs, k, gate, seed)
        rows[f"suffix {gate}"] = {
            "tok_s": round(run.tok_s, 1), "vs_plain": round(run.tok_s / plain.tok_s, 3),
            "vs_oracle": round(run.tok_s / oracle, 3), "mean_length": round(run.mean_length, 2),
            "drafting_share": round(run.drafting_steps / max(1, run.steps), 3),
            "bar": None if run.bar is None else round(run.bar, 2),
        }
    return rows


def main(argv: list[str] | None = None) -> None:
    from foretell.bench.suffix_traces import load_or_record

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dataset", default="gsm8k", help="gsm8k (EOS kept) or repetitive (ignore EOS)")
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--k", type=int, default=None, help="drafts per step (default: 3, repetitive 16)")
    parser.add_argument("--costs", default="h200,slow-host", help="comma-free list of sets split by ';' or ','")
    parser.add_argument("--gates", default="auto,1.0", help="gates to compare: auto and fixed bars")
    parser.add_argument("--jitter", type=float, default=0.0, help="log-normal sigma on each interval")
    parser.add_argument("--spell", type=float, default=0.0, help="correlation of consecutive intervals' jitter")
    parser.add_argument("--tail", default="0,0", help="SHARE,MS: a share of intervals MS slower")
    parser.add_argument("--trace", default=None, help="a trace file (default: recorded and cached)")
    args = parser.parse_args(argv)
    ignore_eos = args.dataset == "repetitive"
    k = args.k or (16 if args.dataset == "repetitive" else 3)
    trace = load_or_record(args.dataset, args.num_prompts, args.max_tokens, ignore_eos, args.trace)
    gates = [g if g == "auto" else float(g) for g in args.gates.split(",")]
    cost_names = args.costs.split(";") if ";" in args.costs else args.costs.split(",")
    if ";" not in args.costs and any(c not in COST_SETS for c in cost_names):
        cost_names = [args.costs]  # one "P,D,F" set
    for name in cost_names:
        share, tail_ms = (float(v) for v in args.tail.split(","))
        costs = replace(parse_costs(name), jitter=args.jitter, spell=args.spell, tail_share=share, tail_ms=tail_ms)
        print(f"{args.dataset} k={k} costs {name}: {costs}")
        for label, row in compare(trace, costs, k, gates).items():
            print(f"  {label:14s} " + "  ".join(f"{key} {value}" for key, value in row.items()))


if __name__ == "__main__":
    main()
