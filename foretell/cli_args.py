"""Engine flags shared by every CLI command (generate, serve, bench, eval): one flag per config
field, and the speculative flags that build a speculative_config."""

from __future__ import annotations

import argparse
import json
from typing import Any

from foretell.defaults import default_num_speculative_tokens


def float_or_auto(text: str) -> float | str:
    """--suffix-decoding-min-accepted-tokens: a number, or auto (learned from the steps)."""
    if text == "auto":
        return text
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number or auto, got {text!r}") from None


# Suffix decoding's flags: each sets the SpeculativeConfig field it is named after (--field-name),
# with these add_argument options.
SUFFIX_FLAGS: dict[str, dict[str, Any]] = {
    "suffix_decoding_max_tree_depth": dict(
        type=int, help="suffix: depth of the suffix tries, longest match + draft per walk (24)"),
    "suffix_decoding_max_cached_requests": dict(
        type=int, help="suffix: finished responses kept in the global cache (10000; 0: none)"),
    "suffix_decoding_max_cached_tokens": dict(
        type=int, help="suffix: tokens the global cache holds at most, oldest evicted (131072)"),
    "suffix_decoding_max_spec_factor": dict(
        type=float, help="suffix: draft at most this many tokens per matched token (1.0)"),
    "suffix_decoding_min_token_prob": dict(
        type=float, help="suffix: stop drafting below this empirical path probability (0.1)"),
    "suffix_decoding_min_match_length": dict(
        type=int, help="suffix: draft only after a match of at least this many tokens (4)"),
    "suffix_decoding_min_accepted_tokens": dict(
        type=float_or_auto, metavar="BAR|auto",
        help="suffix: a sequence whose drafts accept fewer tokens than this on average pauses drafting, then "
             "probes again (auto, the default: the break-even bar of this machine's timed steps, "
             "t_draft / t_plain - 1; 0: never pauses)"),
    "hybrid": dict(
        choices=["eagle3", "mtp", "draft_model"],
        help="suffix: the model drafter for sequences whose suffix match is short"),
    "hybrid_num_speculative_tokens": dict(
        type=int, help="suffix with --hybrid: the model drafter's k (default: its method's)"),
    "hybrid_min_match_length": dict(
        type=int, help="suffix with --hybrid: shortest suffix match that drafts instead of the model (4)"),
}


def add_engine_args(parser: argparse.ArgumentParser, model_required: bool = True,
                    model_positional: bool = True) -> None:
    """The engine flags; with model_positional, the model folder may also come first without
    --model (`foretell serve DIR`, as vLLM takes it)."""
    if model_positional:
        parser.add_argument("model_positional", nargs="?", metavar="MODEL",
                            help="the model folder (same as --model)")
    g = parser.add_argument_group("model")
    g.add_argument("--model", required=model_required,
                   help="Hugging Face model folder, or Hub id such as Qwen/Qwen3-8B "
                        "(default: the shipped default family)")
    g.add_argument("--tokenizer", help="tokenizer folder or Hub id (default: the model's)")
    g.add_argument("--revision", help="branch, tag or commit of a Hub model id (default: main)")
    g.add_argument("--tokenizer-revision", help="branch, tag or commit of the tokenizer's Hub id")
    g.add_argument("--download-dir",
                   help="Hugging Face Hub cache for Hub ids (default: HF_HUB_CACHE or HF_HOME/hub)")
    g.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float16", "float32"],
                   help="weights and activations (auto: the checkpoint's; float32 on CPU)")
    g.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N")
    g.add_argument("--load-format", default="auto", choices=["auto", "safetensors", "pt", "dummy"],
                   help="dummy: random weights from config.json alone (benchmarks at real sizes)")
    g.add_argument("--quantization", choices=["fp8"],
                   help="fp8: quantize a float checkpoint's linears and experts at load into FP8 128x128 "
                        "blocks (FP8 and int4 checkpoints are detected from their config.json)")
    g.add_argument("--max-model-len", type=int,
                   help="longest prompt + output in tokens (default: the model's context length)")
    g.add_argument("--seed", type=int, default=0, help="seed of the engine's random draws")
    g.add_argument("--attention-backend", default="auto", choices=["auto", "torch", "triton"],
                   help="attention kernels (auto: Triton on CUDA, torch elsewhere)")
    g.add_argument("--enforce-eager", action="store_true", help="never use CUDA graphs")
    g.add_argument("--small-m-gemm", default="on", choices=["auto", "on", "off"],
                   help="few-row matmuls on CUDA: on = the Triton GEMV for batch-1 decode (7%% faster "
                        "Llama-8B steps on the H200), auto = time it against cuBLAS per shape, off = cuBLAS")
    g.add_argument("--batch-invariant", action="store_true", default=None,
                   help="bitwise-exact mode: a token's logits do not depend on its step's query length, "
                        "batch or prefix-cache hits (speculative output equals plain output bit for bit)")
    g.add_argument("--num-cpu-threads", type=int, help="torch intra-op threads on CPU")
    g.add_argument("--cpu-compile", action="store_true", default=None,
                   help="CPU only: compile the target's decode and verify forward with torch.compile "
                        "(Inductor's C++ backend, needs a C++ compiler; compiles at the first steps)")
    g.add_argument("--warm-up", default="auto", choices=["auto", "on", "off"],
                   help="dummy requests at start-up so no kernel compiles during serving (auto: on CUDA)")
    g.add_argument("--gc-freeze", default="auto", choices=["auto", "on", "off"],
                   help="after start-up, exempt the engine's objects from full garbage collections (gc.freeze; "
                        "auto: on CUDA)")
    g.add_argument("--skip-tokenizer-init", action="store_true", help="token-id prompts only")
    par = parser.add_argument_group("parallelism")
    par.add_argument("--tensor-parallel-size", "-tp", type=int, default=1,
                     help="devices (ranks) each holding a slice of every layer (default 1)")
    par.add_argument("--enable-expert-parallel", action="store_true",
                     help="MoE models: partition the routed experts over the ranks instead of "
                          "splitting each expert")
    c = parser.add_argument_group("KV cache")
    c.add_argument("--block-size", type=int, default=16, help="tokens per KV cache block")
    c.add_argument("--kv-cache-memory-bytes", type=int, help="KV cache budget (target + draft)")
    c.add_argument("--gpu-memory-utilization", type=float, default=0.90,
                   help="share of the GPU's memory for weights, activations and the KV cache")
    c.add_argument("--num-kv-blocks", type=int, help="exact number of target KV blocks")
    c.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8", "fp8_e4m3"],
                   help="what the KV cache stores: auto = the model's dtype; fp8 = e4m3 with per-layer "
                        "k/v scales from the checkpoint (else 1.0), twice the tokens in the same memory")
    c.add_argument("--no-enable-prefix-caching", dest="enable_prefix_caching", action="store_false",
                   help="do not reuse the KV blocks of a shared prompt prefix")
    s = parser.add_argument_group("scheduler")
    s.add_argument("--max-num-seqs", type=int, default=128, help="sequences in one step at most")
    s.add_argument("--max-num-batched-tokens", type=int, default=2048,
                   help="tokens in one step at most (longer prefills are chunked)")
    s.add_argument("--no-enable-chunked-prefill", dest="enable_chunked_prefill", action="store_false",
                   help="prefill each prompt in one step")
    s.add_argument("--async-scheduling", default="auto", choices=["auto", "on", "off"],
                   help="queue the next decode step before reading this one's tokens (auto: on CUDA)")
    sp = parser.add_argument_group("speculative decoding")
    sp.add_argument("--speculative-config", help="JSON with the keys of SpeculativeConfig")
    sp.add_argument("--method", choices=["eagle3", "mtp", "draft_model", "ngram", "suffix", "none"],
                    help="none: no speculation (also with the default models)")
    sp.add_argument("--draft-model", help="EAGLE3 head or draft LM: folder or Hub id")
    sp.add_argument("--default-family", choices=["qwen3", "deepseek"], default="qwen3",
                    help="with no --model: the shipped Qwen3-layout target, or the DeepSeek-V3-layout "
                         "(MLA + MoE) one with its MTP layer (--method mtp) and EAGLE3 head")
    sp.add_argument("--num-speculative-tokens", type=int_or_auto,
                    help="k, draft tokens per step (default: 1 for mtp, 3 for the others); auto: "
                         "adaptive, 0 to 4 per step as the batch's costs and acceptance say")
    sp.add_argument("--adaptive-speculation", dest="adaptive", action="store_true", default=None,
                    help="draft 0 to --num-speculative-tokens tokens per step, the count with the most "
                         "expected tokens per second (step costs measured at start-up)")
    sp.add_argument("--adaptive-skip-catch-up", choices=["on", "off"],
                    help="adaptive, eagle3 / mtp: on (default): a step whose batch drafts nothing next runs no "
                         "drafter (its KV cache keeps holes there); off: the drafter still catches up")
    sp.add_argument("--topk", type=int,
                    help="eagle3: draft a tree, expanding this many children per node and keeping this many "
                         "nodes per depth (--num-speculative-tokens is its depth); suffix: a tree of each node's "
                         "topk likeliest next tokens, best first; 1 (default): a chain")
    sp.add_argument("--num-draft-tokens", type=int,
                    help="with --topk > 1: verify rows per sequence, the root included (default depth x topk + 1)")
    sp.add_argument("--eagle3-aux-layer-ids", help="comma-separated, read as inputs of layers i")
    sp.add_argument("--prompt-lookup-min", type=int, help="ngram: shortest n-gram to look up (2)")
    sp.add_argument("--prompt-lookup-max", type=int, help="ngram: longest n-gram to look up (5)")
    for field, options in SUFFIX_FLAGS.items():
        sp.add_argument("--" + field.replace("_", "-"), **options)
    sp.add_argument("--draft-block-size", type=int,
                    help="KV block size of the draft's cache (default: --block-size)")
    sp.add_argument("--structured-forced-drafts", choices=["on", "off"],
                    help="on (default): tokens a request's grammar forces are drafted (past k, replacing "
                         "a host drafter's); off: drafts are the drafter's, cut where the grammar rejects one")
    sp.add_argument("--draft-tensor-parallel-size", type=int,
                    help="eagle3: 1 replicates the head on every rank (default); the target's "
                         "--tensor-parallel-size splits it like the target (large heads)")


def int_or_auto(text: str) -> int | str:
    """--num-speculative-tokens: an integer, or auto (adaptive speculation)."""
    if text == "auto":
        return text
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer or auto, got {text!r}") from None


def take_model_positional(args: argparse.Namespace) -> None:
    """`foretell serve DIR` means `foretell serve --model DIR`; both, naming different folders,
    is a mistake."""
    positional = getattr(args, "model_positional", None)
    if positional is None:
        return
    if args.model is not None and args.model != positional:
        raise ValueError(
            f"the model is given twice: {positional!r} as the first argument and {args.model!r} "
            f"as --model; give one of them"
        )
    args.model = positional


def speculative_config_from_args(args: argparse.Namespace) -> dict[str, Any] | None:
    if args.method == "none":
        return None
    config: dict[str, Any] = {}
    if args.speculative_config:
        try:
            config = json.loads(args.speculative_config)
        except json.JSONDecodeError as e:
            raise SystemExit(f"--speculative-config is not valid JSON: {e}")
    flags = {
        "method": args.method,
        "model": args.draft_model,
        "num_speculative_tokens": args.num_speculative_tokens,
        "prompt_lookup_min": args.prompt_lookup_min,
        "prompt_lookup_max": args.prompt_lookup_max,
        "draft_block_size": args.draft_block_size,
        "topk": getattr(args, "topk", None),
        "num_draft_tokens": getattr(args, "num_draft_tokens", None),
        "draft_tensor_parallel_size": getattr(args, "draft_tensor_parallel_size", None),
        "adaptive": getattr(args, "adaptive", None),
        "structured_forced_drafts": {"on": True, "off": False}.get(getattr(args, "structured_forced_drafts", None)),
        "adaptive_skip_catch_up": {"on": True, "off": False}.get(getattr(args, "adaptive_skip_catch_up", None)),
        **{name: getattr(args, name, None) for name in SUFFIX_FLAGS},
    }
    if args.eagle3_aux_layer_ids:
        try:
            flags["eagle3_aux_layer_ids"] = [int(x) for x in args.eagle3_aux_layer_ids.split(",")]
        except ValueError:
            raise SystemExit(
                f"--eagle3-aux-layer-ids must be comma-separated integers, got {args.eagle3_aux_layer_ids!r}"
            )
    config.update({k: v for k, v in flags.items() if v is not None})
    if config.get("method") and "num_speculative_tokens" not in config:
        config["num_speculative_tokens"] = default_num_speculative_tokens(config["method"])
    return config or None


def engine_kwargs_from_args(args: argparse.Namespace) -> dict[str, Any]:
    names = [
        "revision", "tokenizer_revision", "download_dir",
        "tokenizer", "dtype", "device", "load_format", "quantization", "max_model_len", "seed", "attention_backend",
        "enforce_eager", "small_m_gemm", "batch_invariant", "warm_up", "gc_freeze", "num_cpu_threads", "cpu_compile",
        "skip_tokenizer_init", "block_size", "kv_cache_memory_bytes", "gpu_memory_utilization",
        "num_kv_blocks", "kv_cache_dtype", "enable_prefix_caching", "max_num_seqs", "max_num_batched_tokens",
        "enable_chunked_prefill", "async_scheduling", "tensor_parallel_size", "enable_expert_parallel",
    ]
    kwargs = {name: getattr(args, name) for name in names if getattr(args, name) is not None}
    kwargs["speculative_config"] = speculative_config_from_args(args)
    return kwargs


def add_logits_control_args(group) -> None:
    """Flags for SamplingParams' logits controls (generate; the server takes them per request)."""
    group.add_argument("--presence-penalty", type=float, default=0.0,
                       help="subtracted once from each token the output already holds, in [-2, 2]")
    group.add_argument("--frequency-penalty", type=float, default=0.0,
                       help="subtracted per occurrence in the output so far, in [-2, 2]")
    group.add_argument("--repetition-penalty", type=float, default=1.0,
                       help="tokens seen in the prompt or output: positive logits divided, negative "
                            "multiplied by it (> 0; 1: off)")
    group.add_argument("--min-tokens", type=int, default=0, help="no EOS or stop before this many tokens")
    group.add_argument("--logit-bias", help='JSON object of token id -> bias in [-100, 100], e.g. \'{"42": -100}\'')
    group.add_argument("--bad-words", action="append", help="a word never to generate (repeatable)")
    group.add_argument("--allowed-token-ids", help="comma-separated token ids: only these may be generated")


def logits_control_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """SamplingParams keyword arguments from add_logits_control_args' flags."""
    kwargs: dict[str, Any] = dict(
        presence_penalty=args.presence_penalty, frequency_penalty=args.frequency_penalty,
        repetition_penalty=args.repetition_penalty, min_tokens=args.min_tokens, bad_words=args.bad_words,
    )
    if args.logit_bias is not None:
        try:
            bias = json.loads(args.logit_bias)
            kwargs["logit_bias"] = {int(token): value for token, value in bias.items()}
        except (ValueError, AttributeError):
            raise SystemExit(f'--logit-bias must be a JSON object of token ids to numbers, e.g. \'{{"42": -100}}\', '
                             f"got {args.logit_bias!r}")
    if args.allowed_token_ids is not None:
        try:
            kwargs["allowed_token_ids"] = [int(x) for x in args.allowed_token_ids.split(",")]
        except ValueError:
            raise SystemExit(f"--allowed-token-ids must be comma-separated integers, got {args.allowed_token_ids!r}")
    return kwargs
