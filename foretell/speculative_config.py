"""speculative_config: the drafter (method, its model, k, adaptive speculation, trees, suffix
decoding and its hybrid, simulated acceptance), checked as a whole when it is built. Part of the
typed configuration (config.py, which re-exports it); imports no torch.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from typing import Any

SPECULATIVE_METHODS = ("eagle3", "mtp", "draft_model", "ngram", "suffix")
# Model drafters suffix decoding can fall back on (speculative_config["hybrid"]).
SUFFIX_HYBRID_METHODS = ("eagle3", "mtp", "draft_model")
TREE_METHODS = ("eagle3", "draft_model", "suffix")  # topk > 1


@dataclass
class SpeculativeConfig:
    method: str
    model: str | None = None
    # None: 1 for mtp (DeepSeek trained its layer one token ahead; acceptance falls fast past
    # it), 3 for the other methods. "auto": adaptive speculation up to 4 drafts.
    num_speculative_tokens: int | str | None = None
    # Adaptive speculation (spec_decode/adaptive.py): each step drafts 0..num_speculative_tokens
    # tokens, the count with the most expected tokens per second for the batch, from step costs
    # measured at start-up and running acceptance estimates.
    # None: as num_speculative_tokens says (true for "auto", else false).
    adaptive: bool | None = None
    # Under adaptive speculation, a step whose whole batch drafts 0 for the next one runs no drafter
    # at all when the drafter reads the target's hidden states each step (EAGLE3, MTP): its KV cache
    # keeps holes at the skipped positions (later drafts a little worse, output exact). False: the
    # drafter still catches up on every accepted token. A draft LM always catches up.
    adaptive_skip_catch_up: bool = True
    # Read as "input of layer i" (vLLM's reading). None: the head's config, else 2, N//2, N-3.
    eagle3_aux_layer_ids: list[int] | None = None
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 5
    # suffix (vLLM's names; spec_decode/suffix.py): depth of the suffix tries (longest match
    # + draft per walk), finished responses kept in the global cache (and foretell's own bound on
    # their tokens, which bounds its memory), draft tokens per matched token, and the lowest
    # empirical probability of a drafted path; foretell's shortest match that drafts at all.
    suffix_decoding_max_tree_depth: int = 24
    suffix_decoding_max_cached_requests: int = 10000
    suffix_decoding_max_cached_tokens: int = 1 << 17
    suffix_decoding_max_spec_factor: float = 1.0
    suffix_decoding_min_token_prob: float = 0.1
    suffix_decoding_min_match_length: int = 4
    # foretell's acceptance gate: a sequence whose drafts accept fewer tokens than this on
    # average stops drafting for a while (its steps then decode plainly, queued ahead); 0: off;
    # "auto": the break-even bar of this machine, from timed steps (spec_decode/suffix_gate.py)
    suffix_decoding_min_accepted_tokens: float | str = "auto"
    # suffix with a model drafter (eagle3 | mtp | draft_model, spec_decode/hybrid.py): sequences
    # whose suffix match is shorter than hybrid_min_match_length take the model's k drafts,
    # hybrid_num_speculative_tokens (default: that method's k; at most num_speculative_tokens).
    hybrid: str | None = None
    hybrid_num_speculative_tokens: int | None = None
    hybrid_min_match_length: int = 4
    draft_block_size: int | None = None  # None: the target's block size
    # An EAGLE3 head (also under hybrid) split over the target's tensor-parallel ranks (vLLM's
    # name): 1 replicates it on every rank; the target's tensor_parallel_size splits its layers
    # and vocabulary like the target's (large heads: Kimi-K2.5's is about 3B parameters).
    draft_tensor_parallel_size: int = 1
    # Synthetic acceptance for benchmarks: per-position rates or a mean acceptance length.
    simulate_acceptance: dict[str, Any] | None = None
    # Draft trees (SGLang's names; spec_decode/tree/, runner/tree_step.py): num_speculative_tokens is
    # the depth, topk the children expanded per node and nodes kept per depth, num_draft_tokens the
    # verify rows per sequence (the root included; None: depth * topk + 1). topk 1 is the chain.
    # Methods eagle3, draft_model and suffix (its trees: each node's topk likeliest next tokens, best
    # first).
    topk: int = 1
    num_draft_tokens: int | None = None
    revision: str | None = None  # of a draft model given as a Hub id
    # Structured outputs (structured/forced_drafts.py): where a request's grammar forces tokens,
    # they replace a host drafter's drafts and are appended past k. False: drafts are the
    # proposer's, only cut at the first one the grammar rejects (never past k).
    structured_forced_drafts: bool = True

    def __post_init__(self) -> None:
        if self.method not in SPECULATIVE_METHODS:
            raise ValueError(
                f"speculative method must be one of {', '.join(SPECULATIVE_METHODS)}, "
                f"got {self.method!r}"
            )
        if self.method in ("eagle3", "draft_model") and not self.model:
            raise ValueError(
                f"speculative method {self.method!r} needs a draft model folder: set "
                f"speculative_config['model'] (CLI: --draft-model DIR)"
            )
        self._resolve_adaptive()
        if self.num_speculative_tokens is None:
            from foretell.defaults import default_num_speculative_tokens

            self.num_speculative_tokens = default_num_speculative_tokens(self.method)
        k = self.num_speculative_tokens
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise ValueError(
                f"num_speculative_tokens must be an integer >= 1 or 'auto', got {self.num_speculative_tokens!r}"
            )
        self._check_adaptive()
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ValueError(
                f"need 1 <= prompt_lookup_min <= prompt_lookup_max, got "
                f"{self.prompt_lookup_min} and {self.prompt_lookup_max}"
            )
        self._check_suffix()
        self._check_draft_tensor_parallel()
        if self.eagle3_aux_layer_ids is not None and len(self.eagle3_aux_layer_ids) != 3:
            raise ValueError(
                f"eagle3_aux_layer_ids must name 3 layers, got {self.eagle3_aux_layer_ids}"
            )
        self._check_tree()
        if not isinstance(self.adaptive_skip_catch_up, bool):
            raise ValueError(
                f"speculative_config adaptive_skip_catch_up must be true or false, got "
                f"{self.adaptive_skip_catch_up!r}"
            )
        if not isinstance(self.structured_forced_drafts, bool):
            raise ValueError(
                f"speculative_config structured_forced_drafts must be true or false, got "
                f"{self.structured_forced_drafts!r}"
            )

    def _check_tree(self) -> None:
        """topk / num_draft_tokens (TreeShape's rule, without torch): a chain for topk 1, else a
        tree of at most the candidates depth steps of topk expansions draft, plus the root."""
        topk, depth, nodes = self.topk, self.num_speculative_tokens, self.num_draft_tokens
        if isinstance(topk, bool) or not isinstance(topk, int) or topk < 1:
            raise ValueError(f"speculative_config topk must be an integer >= 1, got {topk!r}")
        if topk == 1:
            if nodes is not None and nodes != depth + 1:
                raise ValueError(
                    f"speculative_config topk 1 is a chain of num_speculative_tokens={depth} drafts: "
                    f"num_draft_tokens must be {depth + 1} (or left out), got {nodes!r}"
                )
            self.num_draft_tokens = depth + 1
            return
        if self.method not in TREE_METHODS:
            raise ValueError(
                f"draft trees (speculative_config topk={topk} > 1) need method 'eagle3', 'draft_model' or "
                f"'suffix' for now (MTP's MLA layers take no tree mask yet), "
                f"got method {self.method!r}; use topk 1 (a chain) with {self.method!r}"
            )
        taken = {"draft_tensor_parallel_size": self.draft_tensor_parallel_size != 1,
                 "adaptive": bool(getattr(self, "adaptive", False)), "hybrid": self.hybrid is not None}
        for name, set_ in taken.items():
            if set_:
                raise ValueError(f"draft trees (topk={topk} > 1) do not take speculative_config {name} yet")
        pool = topk + (depth - 1) * topk * topk  # candidates drafted: topk, then topk x topk per depth
        if nodes is None:
            nodes = self.num_draft_tokens = depth * topk + 1
        if isinstance(nodes, bool) or not isinstance(nodes, int) or not 2 <= nodes <= pool + 1:
            raise ValueError(
                f"speculative_config num_draft_tokens counts the tree's nodes with the root: with "
                f"num_speculative_tokens={depth} and topk={topk} it must be an integer in [2, {pool + 1}], "
                f"got {nodes!r}"
            )

    @property
    def uses_tree(self) -> bool:
        return self.topk > 1

    @property
    def num_draft_kv_slots(self) -> int:
        """KV slots the drafter writes past a sequence's verified tokens: k for a chain; for a tree
        the frontier rows of every depth but the last (topk each), at least the depth, and one more
        for a draft LM, whose catch-up also writes the root's row (tree/proposer.py)."""
        depth = self.num_speculative_tokens
        if not self.uses_tree:
            return depth
        return max(depth, (depth - 1) * self.topk) + (1 if self.method == "draft_model" else 0)

    def _resolve_adaptive(self) -> None:
        """num_speculative_tokens "auto" is adaptive with its default maximum; adaptive true takes
        num_speculative_tokens as the maximum (the default maximum when it is not given)."""
        from foretell.spec_decode.adaptive import ADAPTIVE_DEFAULT_MAX_K

        if self.adaptive is not None and not isinstance(self.adaptive, bool):
            raise ValueError(f"speculative_config adaptive must be true or false, got {self.adaptive!r}")
        k = self.num_speculative_tokens
        if isinstance(k, str):
            if k != "auto":
                raise ValueError(f"num_speculative_tokens must be an integer >= 1 or 'auto', got {k!r}")
            if self.adaptive is False:
                raise ValueError(
                    "num_speculative_tokens 'auto' is adaptive speculation, but adaptive is false: "
                    "drop adaptive, or give num_speculative_tokens an integer"
                )
            self.adaptive, self.num_speculative_tokens = True, ADAPTIVE_DEFAULT_MAX_K
        elif self.adaptive and k is None:
            self.num_speculative_tokens = ADAPTIVE_DEFAULT_MAX_K
        self.adaptive = bool(self.adaptive)

    def _check_adaptive(self) -> None:
        from foretell.spec_decode.adaptive import ADAPTIVE_LARGEST_MAX_K

        if self.adaptive and self.topk != 1:
            raise ValueError(
                f"adaptive speculation sizes chains: it takes topk 1, got topk {self.topk} (a draft tree)"
            )
        if self.adaptive and self.num_speculative_tokens > ADAPTIVE_LARGEST_MAX_K:
            raise ValueError(
                f"adaptive speculation learns the step cost of every draft length 0..num_speculative_tokens: "
                f"num_speculative_tokens must be at most {ADAPTIVE_LARGEST_MAX_K}, got "
                f"{self.num_speculative_tokens}"
            )

    def _check_draft_tensor_parallel(self) -> None:
        size = self.draft_tensor_parallel_size
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise ValueError(f"draft_tensor_parallel_size must be an integer >= 1, got {size!r}")
        if size != 1 and "eagle3" not in (self.method, self.hybrid):
            raise ValueError(
                f"draft_tensor_parallel_size = {size} splits an EAGLE3 head; method {self.method!r} "
                f"takes 1 (MTP layers always run under the target's tensor parallelism, draft models "
                f"are replicated on every rank, n-gram and suffix run on the front process)"
            )

    def check_draft_tensor_parallel(self, tensor_parallel_size: int) -> None:
        """draft_tensor_parallel_size is 1 (replicated) or the target's tensor_parallel_size."""
        size = self.draft_tensor_parallel_size
        if size not in (1, tensor_parallel_size):
            raise ValueError(
                f"draft_tensor_parallel_size = {size} must be 1 (the head replicated on every rank) "
                f"or the target's tensor_parallel_size = {tensor_parallel_size} (the head split like "
                f"the target)"
            )

    def _check_suffix(self) -> None:
        def integer(name: str, minimum: int) -> None:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
                raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")

        integer("suffix_decoding_max_tree_depth", 2)
        integer("suffix_decoding_max_cached_requests", 0)
        integer("suffix_decoding_max_cached_tokens", 0)
        integer("suffix_decoding_min_match_length", 1)
        integer("hybrid_min_match_length", 1)
        factor = self.suffix_decoding_max_spec_factor
        if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not factor > 0:
            raise ValueError(f"suffix_decoding_max_spec_factor must be a number > 0, got {factor!r}")
        prob = self.suffix_decoding_min_token_prob
        if isinstance(prob, bool) or not isinstance(prob, (int, float)) or not 0 <= prob <= 1:
            raise ValueError(f"suffix_decoding_min_token_prob must be a number in [0, 1], got {prob!r}")
        bar = self.suffix_decoding_min_accepted_tokens
        if bar != "auto" and (isinstance(bar, bool) or not isinstance(bar, (int, float))
                              or not 0 <= bar <= self.num_speculative_tokens):
            raise ValueError(f"suffix_decoding_min_accepted_tokens must be 'auto' or a number in [0, "
                             f"num_speculative_tokens {self.num_speculative_tokens}] (0: the acceptance gate off), "
                             f"got {bar!r}")
        if self.hybrid is None:
            if self.hybrid_num_speculative_tokens is not None:
                raise ValueError("hybrid_num_speculative_tokens needs a hybrid drafter: set hybrid")
            return
        if self.method != "suffix":
            raise ValueError(
                f"hybrid combines suffix decoding with a model drafter: it needs method 'suffix', "
                f"got method {self.method!r}"
            )
        if self.hybrid not in SUFFIX_HYBRID_METHODS:
            raise ValueError(
                f"hybrid must be one of {', '.join(SUFFIX_HYBRID_METHODS)}, got {self.hybrid!r}"
            )
        if self.hybrid in ("eagle3", "draft_model") and not self.model:
            raise ValueError(
                f"hybrid {self.hybrid!r} needs a draft model folder: set speculative_config['model'] "
                f"(CLI: --draft-model DIR)"
            )
        if self.hybrid_num_speculative_tokens is None:
            from foretell.defaults import default_num_speculative_tokens

            self.hybrid_num_speculative_tokens = min(
                default_num_speculative_tokens(self.hybrid), self.num_speculative_tokens
            )
        integer("hybrid_num_speculative_tokens", 1)
        if self.hybrid_num_speculative_tokens > self.num_speculative_tokens:
            raise ValueError(
                f"hybrid_num_speculative_tokens {self.hybrid_num_speculative_tokens} is more than "
                f"num_speculative_tokens {self.num_speculative_tokens} (the most drafts a step verifies)"
            )

    @classmethod
    def from_any(cls, value: "SpeculativeConfig | dict | str | None") -> "SpeculativeConfig | None":
        """Accept a config, a dict with the same keys, or a JSON string (the CLI's form)."""
        if value is None or isinstance(value, cls):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise ValueError(f"--speculative-config is not valid JSON: {e}") from e
        if not isinstance(value, dict):
            raise ValueError(f"speculative_config must be a dict, got {type(value).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(
                f"unknown speculative_config keys {unknown}; known keys: {sorted(known)}"
            )
        if "method" not in value:
            raise ValueError(f"speculative_config needs a 'method' ({', '.join(SPECULATIVE_METHODS)})")
        return cls(**value)
