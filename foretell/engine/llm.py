"""LLM: the offline Python API (generate, chat, get_stats) over one Engine."""

from __future__ import annotations

import gc
import itertools
from typing import Any

from foretell.config import build_engine_config
from foretell.defaults import default_speculative_config, default_target
from foretell.device_util import release_cached_device_memory
from foretell.engine.engine import Engine
from foretell.engine.outputs import RequestOutput
from foretell.progress import progress_bar
from foretell.sampling_params import SamplingParams


class LLM:
    """LLM(model="path/to/hf_folder", dtype="auto", device="auto", speculative_config={...}).

    Any field of ModelConfig, CacheConfig, SchedulerConfig or ParallelConfig is accepted as a
    keyword (block_size=16, max_num_seqs=..., num_kv_blocks=..., tensor_parallel_size=1, ...).
    With no model, the shipped default family: its Qwen3-layout target drafting with its EAGLE3
    head (k=3) unless speculative_config says otherwise; LLM.default(...) picks another member.
    """

    def __init__(self, model: str | None = None, speculative_config: Any = None, **kwargs: Any):
        if model is None:
            model = default_target("qwen3")
            if speculative_config is None:
                speculative_config = default_speculative_config("qwen3", "eagle3")
        config = build_engine_config(model, speculative_config=speculative_config, **kwargs)
        self._engine: Engine | None = Engine(config)
        self._ids = itertools.count()

    @property
    def engine(self) -> Engine:
        if self._engine is None:
            raise RuntimeError("this LLM was closed: make a new LLM(...) to generate again")
        return self._engine

    def close(self) -> None:
        """Free what the engine holds now (worker processes, weights, the KV cache), not whenever
        Python's garbage collector next runs: the first engine of a process can sit in a reference
        cycle (a traceback that an import made during its construction keeps its frames). The LLM
        cannot generate afterwards. Also `with LLM(...) as llm:`."""
        engine, self._engine = self._engine, None
        if engine is None:
            return
        engine.shutdown()
        del engine
        gc.collect()
        release_cached_device_memory()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.close()

    @classmethod
    def default(
        cls,
        family: str = "qwen3",
        method: str | None = "eagle3",
        num_speculative_tokens: int | None = None,
        **kwargs: Any,
    ) -> "LLM":
        """The shipped default family (foretell/default_models): family "qwen3" (Qwen3-layout
        target) or "deepseek" (DeepSeek-V3-layout MLA + MoE target); method "eagle3" (the
        family's head), "draft_model" (the small draft LM), "mtp" (deepseek's own MTP layer),
        "ngram", or None for no speculation. k defaults to 1 for mtp, 3 otherwise."""
        if method == "mtp" and family != "deepseek":
            raise ValueError('method "mtp" needs the deepseek family (its target has the MTP layer): '
                             'LLM.default(family="deepseek", method="mtp")')
        return cls(default_target(family),
                   speculative_config=default_speculative_config(family, method, num_speculative_tokens),
                   **kwargs)

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def generate(
        self,
        prompts: Any,
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Generate for one prompt or a list: strings, token-id lists, or
        {"prompt_token_ids": [...]} dicts. Outputs come back in the order of the prompts."""
        if isinstance(prompts, (str, dict)) or (
            isinstance(prompts, list) and prompts and isinstance(prompts[0], int)
        ):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params] * len(prompts)
        else:
            params_list = list(sampling_params)
            if len(params_list) != len(prompts):
                raise ValueError(
                    f"got {len(params_list)} SamplingParams for {len(prompts)} prompts; pass one "
                    f"SamplingParams or one per prompt"
                )
        ids = []
        try:
            for prompt, params in zip(prompts, params_list):
                request_id = str(next(self._ids))
                self.engine.add_request(request_id, prompt, params)
                ids.append(request_id)
        except Exception:
            for request_id in ids:
                self.engine.abort_request(request_id)
            raise
        return self._run(ids, use_tqdm)

    def chat(
        self,
        messages: list[dict] | list[list[dict]],
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Apply the tokenizer's chat template to one conversation or a list of them."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [
            {"prompt_token_ids": self.engine.tokenizer.apply_chat_template(conv)}
            for conv in conversations
        ]
        return self.generate(prompts, sampling_params, use_tqdm)

    def _run(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        wanted = set(ids)
        finished: dict[str, RequestOutput] = {}
        try:
            with progress_bar(len(ids), "generate", use_tqdm and len(ids) >= 2) as bar:
                while len(finished) < len(ids):
                    for out in self.engine.step():
                        if out.finished and out.request_id in wanted:
                            finished[out.request_id] = out
                            bar.update(1)
        except BaseException:
            for request_id in wanted - set(finished):
                self.engine.abort_request(request_id)
            raise
        return [finished[i] for i in ids]

    def get_stats(self) -> dict:
        return self.engine.get_stats()
