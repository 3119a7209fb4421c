"""Where each output token came from under speculative decoding (SamplingParams.return_token_origins).

A step that verifies drafts d_0 .. d_{k-1} and accepts the first a of them emits a + 1 tokens:
d_0 .. d_{a-1} ("accepted", at draft positions 0 .. a-1), then one token the target sampled
itself at position a: its "correction" of the first rejected draft d_a, or, when every usable
draft was accepted, a "bonus" token. A step without drafts (the end of a prefill, a request that
runs without speculation, a drafter that proposed nothing) emits one plain "target" token.

Only computed when a request asks (the default hot path builds nothing), from what the engine
already holds: the scheduled drafts and the runner's accepted count. No torch here.
"""

from __future__ import annotations

from dataclasses import dataclass

ACCEPTED = "accepted"  # a draft token the target verified
CORRECTED = "corrected"  # the target's token where it rejected a draft
BONUS = "bonus"  # the target's token after every usable draft was accepted
TARGET = "target"  # the target's token on a step that verified no drafts
ORIGIN_KINDS = (ACCEPTED, CORRECTED, BONUS, TARGET)


@dataclass(frozen=True)
class TokenOrigin:
    token_id: int
    kind: str  # one of ORIGIN_KINDS
    step: int  # the sequence's step that emitted it (0: the step that ended its prefill)
    position: int  # its row among the step's drafts: d_i at i, the target's token at a
    num_drafts: int  # usable drafts the step verified (0 for a "target" token)
    replaced_draft: int | None = None  # "corrected" only: the draft token the target rejected


def step_origins(
    draft_token_ids: list[int],
    num_usable_drafts: int,
    new_token_ids: list[int],
    num_accepted: int,
    step: int,
) -> list[TokenOrigin]:
    """The origins of one step's new tokens (the accepted drafts, then the target's token).

    num_usable_drafts counts the drafts that could be accepted (a step capped near max_tokens
    verifies more rows than it may accept); reaching it makes the target's token a bonus.
    """
    if not 0 <= num_accepted <= num_usable_drafts <= len(draft_token_ids):
        raise ValueError(
            f"a step accepted {num_accepted} of {num_usable_drafts} usable drafts "
            f"({len(draft_token_ids)} drafted): expected 0 <= accepted <= usable <= drafted"
        )
    if len(new_token_ids) != num_accepted + 1:
        raise ValueError(
            f"a step that accepted {num_accepted} drafts emits {num_accepted + 1} tokens, "
            f"got {len(new_token_ids)}"
        )
    origins = [
        TokenOrigin(token, ACCEPTED, step, i, num_usable_drafts)
        for i, token in enumerate(new_token_ids[:num_accepted])
    ]
    last = new_token_ids[-1]
    if num_usable_drafts == 0:
        origins.append(TokenOrigin(last, TARGET, step, 0, 0))
    elif num_accepted == num_usable_drafts:
        origins.append(TokenOrigin(last, BONUS, step, num_accepted, num_usable_drafts))
    else:
        origins.append(TokenOrigin(last, CORRECTED, step, num_accepted, num_usable_drafts,
                                   replaced_draft=draft_token_ids[num_accepted]))
    return origins
