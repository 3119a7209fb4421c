"""Typed configuration: model, cache, scheduler, parallel, speculative decoding (its own module,
speculative_config.py), and the engine's bundle.

Every knob of the engine is a field here (and a CLI flag); each dataclass validates itself in
__post_init__ and says what to do when a value is wrong.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any

from foretell.speculative_config import SpeculativeConfig

if TYPE_CHECKING:  # annotations only: the config imports no torch (device_util.py holds its use)
    import torch

DTYPE_NAMES = ("bfloat16", "float16", "float32")
SMALL_M_GEMM_MODES = ("auto", "on", "off")
# auto: the model's dtype; fp8 / fp8_e4m3: float8_e4m3fn with per-layer scales (ops/attention/fp8_kv.py)
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3")
ASYNC_SCHEDULING_MODES = ("auto", "on", "off")


@dataclass
class ModelConfig:
    model: str
    tokenizer: str | None = None
    dtype: str = "auto"  # auto | bfloat16 | float16 | float32
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    load_format: str = "auto"  # auto | safetensors | pt | dummy
    # "fp8": a float checkpoint's linears (and MoE experts) quantized at load into FP8 128x128
    # blocks, read in 8 bits. None: as the checkpoint ships (FP8 and int4 checkpoints are
    # detected from config.json's quantization_config and kept in their precision either way).
    quantization: str | None = None
    max_model_len: int | None = None
    seed: int = 0
    # Hub ids (model_source.py): the branch, tag or commit of the model and of the tokenizer, and
    # the Hub cache folder (None: HF_HUB_CACHE / HF_HOME, the Hub library's own default).
    revision: str | None = None
    tokenizer_revision: str | None = None
    download_dir: str | None = None
    attention_backend: str = "auto"  # auto | torch | triton
    enforce_eager: bool = False
    # torch's intra-op threads on CPU; None leaves torch's default. Small models on few cores
    # often run faster with 1 (thread start-up costs more than the tiny matmuls).
    num_cpu_threads: int | None = None
    # No tokenizer: prompts must be token ids and outputs carry no text (benchmarks with
    # --load-format dummy from a bare config.json).
    skip_tokenizer_init: bool = False
    # Few-row matmuls on CUDA with graphs (ops/gemm/dispatch.py): on: the Triton GEMV for
    # single-row inputs (batch-1 decode), which streams its weights while the kernel before it
    # finishes (faster than cuBLAS in the Llama-8B decode graph on the H200: docs/perf-log.md);
    # auto: times cuBLAS against the GEMV once per shape up to 4 rows and keeps the faster; off:
    # always cuBLAS.
    small_m_gemm: str = "on"
    # Run a few dummy requests at start-up so Triton compiles its kernels' shape variants before
    # the first real request (engine/warm_up.py). auto: on CUDA only.
    warm_up: str = "auto"
    # After start-up, move every object the engine made into the collector's permanent generation
    # (gc.freeze; gc.unfreeze at shutdown), so full collections, which otherwise walk the engine's
    # hundreds of thousands of objects (tens of ms at batch 256) while the device idles, skip
    # them. auto: on CUDA only (the host's time is the step's there).
    gc_freeze: str = "auto"
    # Bitwise-exact mode (issue 23): every token's logits the same bits however its step was
    # formed (decode, verify, prefill chunk; batch size, order and companions; prefix-cache hit
    # or recompute), because every op reduces a row in an order set by that row's own sizes
    # (the batch_invariant variants in ops/*/). Off by default until its cost is measured.
    batch_invariant: bool = False
    # The CPU fast path (runner/cpu_compile.py): a Llama-family target's decode and verify forward
    # of one sequence compiled by torch.compile (Inductor's C++ backend; needs a C++ compiler at
    # run time and compiles once per row count, tens of seconds). CPU only: refused on CUDA.
    cpu_compile: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.cpu_compile, bool):
            raise ValueError(f"cpu_compile must be True or False, got {self.cpu_compile!r}")
        if not isinstance(self.batch_invariant, bool):
            raise ValueError(f"batch_invariant must be True or False, got {self.batch_invariant!r}")
        if self.warm_up not in ("auto", "on", "off"):
            raise ValueError(f"warm_up must be auto, on or off, got {self.warm_up!r}")
        if self.gc_freeze not in ("auto", "on", "off"):
            raise ValueError(f"gc_freeze must be auto, on or off, got {self.gc_freeze!r}")
        if self.dtype != "auto" and self.dtype not in DTYPE_NAMES:
            raise ValueError(f"dtype must be auto, bfloat16, float16 or float32, got {self.dtype!r}")
        if self.load_format not in ("auto", "safetensors", "pt", "dummy"):
            raise ValueError(
                f"load_format must be auto, safetensors, pt or dummy, got {self.load_format!r}"
            )
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"max_model_len must be >= 1, got {self.max_model_len}")
        if self.quantization is not None and self.quantization not in ("fp8",):
            raise ValueError(f"quantization must be None or 'fp8', got {self.quantization!r}")
        if self.num_cpu_threads is not None and self.num_cpu_threads < 1:
            raise ValueError(f"num_cpu_threads must be >= 1, got {self.num_cpu_threads}")
        if self.attention_backend not in ("auto", "torch", "triton"):
            raise ValueError(
                f"attention_backend must be auto, torch or triton, got {self.attention_backend!r}"
            )
        if self.small_m_gemm not in SMALL_M_GEMM_MODES:
            raise ValueError(f"small_m_gemm must be auto, on or off, got {self.small_m_gemm!r}")

    def resolve_device(self) -> torch.device:
        from foretell.device_util import resolve_device

        return resolve_device(self.device)

    def resolve_dtype(self, checkpoint_dtype: str | None, device: torch.device) -> torch.dtype:
        """auto: the checkpoint's torch_dtype, except half precision on CPU becomes float32."""
        from foretell.device_util import resolve_dtype

        return resolve_dtype(self.dtype, checkpoint_dtype, device)


@dataclass
class CacheConfig:
    block_size: int = 16
    # Memory for the KV cache (target and draft together). None: on CUDA,
    # gpu_memory_utilization of the device minus what weights and activations take; on CPU 1 GiB.
    kv_cache_memory_bytes: int | None = None
    gpu_memory_utilization: float = 0.90
    num_kv_blocks: int | None = None  # override the budget with an exact number of target blocks
    enable_prefix_caching: bool = True
    # What the KV cache stores (target and draft): auto, the model's dtype; fp8 (= fp8_e4m3, vLLM's
    # names), e4m3 with each layer's k_scale / v_scale from the checkpoint (else 1.0): one byte an
    # element, twice the tokens of a bf16 cache in the same memory (ops/attention/fp8_kv.py).
    kv_cache_dtype: str = "auto"

    def __post_init__(self) -> None:
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two >= 1, got {self.block_size}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(
                f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}"
            )
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError(f"num_kv_blocks must be >= 1, got {self.num_kv_blocks}")
        if self.kv_cache_memory_bytes is not None and self.kv_cache_memory_bytes < 1:
            raise ValueError(f"kv_cache_memory_bytes must be >= 1, got {self.kv_cache_memory_bytes}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(
                f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {self.kv_cache_dtype!r}"
            )


@dataclass
class SchedulerConfig:
    max_num_seqs: int = 128
    max_num_batched_tokens: int = 2048  # token budget per step; prefills are chunked to fit
    enable_chunked_prefill: bool = True
    # Plain decode steps and graphed greedy verify steps queue the next step on the device before
    # the host reads this step's results, so the host's work between steps overlaps the GPU
    # (runner/decode_ahead.py). auto: on CUDA only (on the CPU the forward runs in the call, so
    # there is nothing to overlap).
    async_scheduling: str = "auto"

    def __post_init__(self) -> None:
        if self.async_scheduling not in ASYNC_SCHEDULING_MODES:
            raise ValueError(
                f"async_scheduling must be auto, on or off, got {self.async_scheduling!r}"
            )
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(
                f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}"
            )


@dataclass
class ParallelConfig:
    """How a model is spread over devices (vLLM's names). tensor_parallel_size ranks each hold a
    slice of every layer (heads, MLP columns, vocabulary); with enable_expert_parallel the MoE
    layers' routed experts are partitioned over those ranks instead of split inside each expert.
    The head counts and sizes that must divide are checked where the model config is read."""

    tensor_parallel_size: int = 1
    enable_expert_parallel: bool = False

    def __post_init__(self) -> None:
        size = self.tensor_parallel_size
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise ValueError(f"tensor_parallel_size must be an integer >= 1, got {size!r}")
        if not isinstance(self.enable_expert_parallel, bool):
            raise ValueError(
                f"enable_expert_parallel must be True or False, got {self.enable_expert_parallel!r}"
            )


@dataclass
class EngineConfig:
    model: ModelConfig
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    speculative: SpeculativeConfig | None = None
    log_stats_interval_s: float = 10.0
    parallel: ParallelConfig = field(default_factory=ParallelConfig)


def build_engine_config(model: str, **kwargs: Any) -> EngineConfig:
    """Route flat keyword arguments (the LLM(...) and CLI surface) to the typed configs."""
    groups = {"model": ModelConfig, "cache": CacheConfig, "scheduler": SchedulerConfig,
              "parallel": ParallelConfig}
    values: dict[str, dict[str, Any]] = {name: {} for name in groups}
    speculative = kwargs.pop("speculative_config", None)
    log_interval = kwargs.pop("log_stats_interval_s", 10.0)
    for key, value in kwargs.items():
        for name, cls in groups.items():
            if key in {f.name for f in fields(cls)}:
                values[name][key] = value
                break
        else:
            known = sorted(f.name for cls in groups.values() for f in fields(cls) if f.name != "model")
            raise TypeError(f"unknown engine option {key!r}; known options: {', '.join(known)}")
    from foretell.model_source import resolve_engine_sources

    model_config = ModelConfig(model=model, **values["model"])
    parallel_config = ParallelConfig(**values["parallel"])
    speculative_config = SpeculativeConfig.from_any(speculative)
    if speculative_config is not None:
        speculative_config.check_draft_tensor_parallel(parallel_config.tensor_parallel_size)
    resolve_engine_sources(model_config, speculative_config)  # Hub ids -> local snapshot folders
    return EngineConfig(
        model=model_config,
        cache=CacheConfig(**values["cache"]),
        scheduler=SchedulerConfig(**values["scheduler"]),
        speculative=speculative_config,
        log_stats_interval_s=log_interval,
        parallel=parallel_config,
    )
