"""SamplingParams: how one request samples and when it stops. Validated on construction."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 or 0: no top-k
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16  # None: up to the model's max length
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None  # top-n logprobs per generated token
    prompt_logprobs: int | None = None  # top-n logprobs per prompt token (the first has none)
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    # Report each output token's origin under speculation (accepted draft, the target's
    # correction, bonus, plain target token): CompletionOutput.token_origins. Off: nothing built.
    return_token_origins: bool = False
    # False: this request verifies no drafts (its tokens are the target's alone), e.g. to compare
    # one prompt with and without speculation on the same server. The output is the same either way.
    use_speculation: bool = True
    stop_strings: list[str] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.stop_strings = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        self._validate()

    def _validate(self) -> None:
        def bad(field_name: str, expected: str) -> ValueError:
            return ValueError(
                f"SamplingParams.{field_name} must be {expected}, got "
                f"{getattr(self, field_name)!r}"
            )

        if not isinstance(self.n, int) or self.n < 1:
            raise bad("n", "an integer >= 1")
        if self.temperature < 0:
            raise bad("temperature", ">= 0 (0 means greedy)")
        if not 0 < self.top_p <= 1:
            raise bad("top_p", "in (0, 1]")
        if not isinstance(self.top_k, int) or self.top_k < -1:
            raise bad("top_k", "an integer: -1 or 0 to disable, or >= 1")
        if not 0 <= self.min_p <= 1:
            raise bad("min_p", "in [0, 1]")
        if self.max_tokens is not None and (not isinstance(self.max_tokens, int) or self.max_tokens < 1):
            raise bad("max_tokens", "an integer >= 1 (or None for up to the model's max length)")
        if self.logprobs is not None and (not isinstance(self.logprobs, int) or not 0 <= self.logprobs <= 20):
            raise bad("logprobs", "an integer between 0 and 20")
        if self.prompt_logprobs is not None and (
            not isinstance(self.prompt_logprobs, int) or not 0 <= self.prompt_logprobs <= 20
        ):
            raise bad("prompt_logprobs", "an integer between 0 and 20")
        if self.seed is not None and not isinstance(self.seed, int):
            raise bad("seed", "an integer")
        for flag in ("return_token_origins", "use_speculation"):
            if not isinstance(getattr(self, flag), bool):
                raise bad(flag, "True or False")
        if any(not isinstance(s, str) or not s for s in self.stop_strings):
            raise bad("stop", "a non-empty string or a list of non-empty strings")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            raise bad("stop_token_ids", "a list of non-negative token ids")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
