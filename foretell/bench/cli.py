"""`foretell bench` (offline sweep), `foretell bench serve` (load against a server) and `foretell
bench kernels` (kernel timings, foretell/bench/kernels/): flags and the command functions. Importing this module is cheap; torch, matplotlib and httpx load only
when a command runs."""

from __future__ import annotations

import argparse
import asyncio
import math

from foretell.bench.kernels.command import add_kernels_parser
from foretell.cli_args import add_engine_args, engine_kwargs_from_args, speculative_config_from_args

DESCRIPTION = """\
Sweep speculative methods x k x batch sizes on a prompt set and report acceptance (rate, mean
length, per position, accepted-count distribution), draft and verify step times, tokens/s and
speedup over no speculation measured in the same run, against the speedup predicted from the
measured acceptance and costs. Example:

  foretell bench Qwen3-8B --methods eagle3 --draft-model EAGLE3-Qwen3-8B \\
      --k 1,2,3,5 --batch-sizes 1,8 --dataset mt_bench --num-prompts 32 --max-tokens 256 \\
      --output-json bench.json --plot-dir plots/

With no model folder (first argument or --model) it runs the shipped default family
(--default-family): its target, against its EAGLE3 head unless --method / --methods say otherwise
(eagle3 and draft_model then use the family's head and draft LM).

`foretell bench serve --help` for the load generator against an OpenAI-compatible server,
`foretell bench kernels --help` for kernel timings at model shapes.
"""


class ModeOrModel(argparse._SubParsersAction):
    """The first argument of `foretell bench`: `serve` (the load generator) or `kernels` (kernel
    timings) picks a sub-parser of its own; anything else is the model folder of the offline sweep (`foretell bench DIR`, like
    `--model DIR`), whose remaining flags the bench parser reads."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.choices = None  # argparse checks the first value against choices: any name is fine

    def __call__(self, parser, namespace, values, option_string=None):
        if values[0] in self._name_parser_map:
            return super().__call__(parser, namespace, values, option_string)
        setattr(namespace, self.dest, None)
        namespace.model_positional = values[0]
        _, unknown = parser.parse_known_args(values[1:], namespace)
        if unknown:
            parser.error(f"unrecognized arguments: {' '.join(unknown)}")


def add_dataset_args(g, default_dataset: str) -> None:
    g.add_argument(
        "--dataset", default=default_dataset,
        help="gsm8k | mt_bench | humaneval | repetitive (answers that repeat earlier text: "
        "suffix decoding's workload) | random, or the path of a .jsonl file (one prompt per "
        "line: a string or an object with prompt / text / question / prompt_token_ids)",
    )
    g.add_argument("--num-prompts", type=int, default=16, help="how many prompts of the dataset")
    g.add_argument("--input-len", type=int, default=128, help="prompt length of --dataset random")
    g.add_argument("--max-tokens", "--output-len", dest="max_tokens", type=int, default=128,
                   help="tokens to generate per request")
    g.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    g.add_argument("--ignore-eos", action="store_true",
                   help="always generate --max-tokens tokens (fixed output lengths)")
    g.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bar")


def add_bench_parser(sub) -> None:
    p = sub.add_parser(
        "bench", help="benchmark speculative configurations (or a server: bench serve)",
        description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_engine_args(p, model_required=False, model_positional=False)  # MODEL: see ModeOrModel
    g = p.add_argument_group("sweep")
    g.add_argument("--methods", help="comma-separated methods to sweep (default: --method)")
    g.add_argument("--k", help="comma-separated num_speculative_tokens values, e.g. 1,2,3,auto "
                   "(auto: adaptive, 0 to 4 drafts per step; default: --num-speculative-tokens, else 3)")
    g.add_argument("--batch-sizes", default="1",
                   help="comma-separated numbers of concurrent requests, e.g. 1,8")
    g.add_argument("--method-model", action="append", metavar="METHOD=DIR",
                   help="draft folder for one method when sweeping several (repeatable)")
    add_dataset_args(g, "gsm8k")
    g.add_argument("--chat", action="store_true", help="wrap text prompts in the chat template")
    g.add_argument("--no-warmup", dest="warmup", action="store_false",
                   help="measure from the first request (kernels may compile inside the runs)")
    g.add_argument("--compare", action="append", choices=["hf"], default=[],
                   help="hf: also run transformers' generate (assisted for draft_model)")
    g.add_argument("--output-json", help="write the full report here")
    g.add_argument("--plot-dir", help="write PNG plots here")
    p.set_defaults(func=run_bench_command)
    modes = p.add_subparsers(dest="bench_mode", metavar="MODEL | serve | kernels", action=ModeOrModel,
                             help="the model folder to sweep (same as --model), `serve`: the "
                                  "load generator against a running server, or `kernels`: kernel timings")
    add_serve_parser(modes)
    add_kernels_parser(modes)


def add_serve_parser(modes) -> None:
    p = modes.add_parser(
        "serve", help="load generator against an OpenAI-compatible server",
        description="Send streaming requests to an OpenAI-compatible server and report TTFT, "
        "TPOT, ITL and latency percentiles, throughput, and acceptance read from /metrics.",
    )
    p.add_argument("--base-url", default="http://127.0.0.1:8000", help="the server (default: %(default)s)")
    p.add_argument("--api", choices=["completions", "chat"], default="completions",
                   help="which OpenAI endpoint to load")
    p.add_argument("--endpoint",
                   help="request path (default: /v1/completions or /v1/chat/completions)")
    p.add_argument("--model", dest="served_model",
                   help="model name (default: the first of /v1/models)")
    p.add_argument("--tokenizer", dest="serve_tokenizer",
                   help="tokenizer folder; --dataset random draws token ids from it")
    p.add_argument("--request-rate", type=float, default=math.inf,
                   help="requests per second, Poisson arrivals (default inf: all at once)")
    p.add_argument("--max-concurrency", type=int, help="requests in flight at most")
    p.add_argument("--concurrency",
                   help="latency under load: comma-separated levels, e.g. 1,16,64; one closed-loop "
                        "run of --num-prompts requests per level (that many in flight), prompts of "
                        "distinct lengths and none shared between levels; a table of TTFT, TPOT and "
                        "ITL percentiles per level")
    p.add_argument("--seed", dest="serve_seed", type=int, default=0,
                   help="seed of the prompt sample and the Poisson arrival times")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per request")
    p.add_argument("--metrics-url",
                   help="Prometheus endpoint (default: BASE_URL/metrics; '' to skip)")
    p.add_argument("--percentiles", default="50,90,99", help="latency percentiles to report")
    p.add_argument("--output-json", dest="serve_output_json", help="write the full report here")
    p.add_argument("--per-request-json", dest="serve_per_request_json",
                   help="write one row per request here (send time, TTFT, latency, tokens; per "
                        "level with --concurrency) and print the first wave's and later "
                        "requests' mean TTFT")
    add_dataset_args(p, "mt_bench")
    p.set_defaults(func=run_serve_command)


def build_bench_settings(args: argparse.Namespace):
    from foretell.bench.offline import BenchSettings
    from foretell.bench.sweep import (
        DRAFT_MODEL_METHODS, parse_int_list, parse_k_list, parse_methods, speculative_configs,
    )

    default_members: dict[str, str] = {}
    if not args.model:  # the shipped default family, drafting with its own members
        from foretell.defaults import default_target, member_path

        args.model = default_target(args.default_family)
        if args.methods is None and args.method is None and args.speculative_config is None:
            args.method = "eagle3"
        default_members = {m: member_path(m, args.default_family) for m in DRAFT_MODEL_METHODS}
    spec = speculative_config_from_args(args) or {}
    method = spec.pop("method", None)
    draft = spec.pop("model", None)
    single_k = spec.pop("num_speculative_tokens", None)
    methods = parse_methods(args.methods) if args.methods else ([method] if method else [])
    if args.k and not methods:
        raise ValueError("--k needs speculative methods: add --methods (or --method)")
    ks = parse_k_list(args.k) if args.k else [single_k or 3]
    batch_sizes = parse_int_list(args.batch_sizes, "--batch-sizes")
    method_models = {m: draft for m in methods if draft and m in DRAFT_MODEL_METHODS}
    for m in methods:
        if m in default_members and m not in method_models:
            method_models[m] = default_members[m]
    for item in args.method_model or []:
        name, sep, folder = item.partition("=")
        if not sep or not folder or name not in methods:
            raise ValueError(
                f"--method-model {item!r}: expected METHOD=DIR with METHOD one of {methods}"
            )
        method_models[name] = folder
    kwargs = engine_kwargs_from_args(args)
    kwargs.pop("speculative_config", None)
    return BenchSettings(
        model=args.model, engine_kwargs=kwargs,
        speculative_configs=speculative_configs(methods, ks, method_models, spec),
        batch_sizes=batch_sizes, dataset=args.dataset, num_prompts=args.num_prompts,
        input_len=args.input_len, max_tokens=args.max_tokens, temperature=args.temperature,
        ignore_eos=args.ignore_eos, chat=args.chat, seed=args.seed, warmup=args.warmup,
        progress=args.progress, compare=list(args.compare),
    )


def run_bench_command(args: argparse.Namespace) -> int:
    from foretell.bench.offline import run_bench
    from foretell.bench.report import sweep_summary, write_json

    report = run_bench(build_bench_settings(args))
    print(sweep_summary(report))
    if args.output_json:
        write_json(args.output_json, report)
        print(f"\nwrote {args.output_json}")
    if args.plot_dir:
        from foretell.bench.plots import write_plots

        paths = write_plots(report, args.plot_dir)
        print(f"wrote {len(paths)} plots to {args.plot_dir}")
    return 0


def run_serve_command(args: argparse.Namespace) -> int:
    from foretell.bench.datasets import load_prompts, ordinary_vocab
    from foretell.bench.report import write_json
    from foretell.bench.serve_load import ServeSettings, parse_concurrencies, run_concurrency_sweep, run_serve_load
    from foretell.bench.serve_summary import format_serve_report, format_sweep_report, per_request_tables
    from foretell.bench.sweep import parse_float_list

    vocab = None
    if args.dataset == "random":
        if not args.serve_tokenizer:
            raise ValueError("--dataset random needs --tokenizer DIR to draw token ids from")
        from foretell.tokenizer import Tokenizer

        vocab = ordinary_vocab(Tokenizer(args.serve_tokenizer))
    levels = parse_concurrencies(args.concurrency) if args.concurrency else None
    # A sweep draws distinct prompts for every level from the whole dataset.
    wanted = None if levels and args.dataset != "random" else args.num_prompts * len(levels or [1])
    prompts = load_prompts(args.dataset, wanted, args.serve_seed, args.input_len, vocab)
    settings = ServeSettings(
        base_url=args.base_url, prompts=prompts, model=args.served_model, api=args.api,
        endpoint=args.endpoint, max_tokens=args.max_tokens, temperature=args.temperature,
        ignore_eos=args.ignore_eos, request_rate=args.request_rate,
        max_concurrency=args.max_concurrency, seed=args.serve_seed, timeout_s=args.timeout,
        metrics_url=args.metrics_url, progress=args.progress,
        percentiles=parse_float_list(args.percentiles, "--percentiles"),
        per_request=bool(args.serve_per_request_json),
    )
    if levels:
        report = asyncio.run(run_concurrency_sweep(settings, levels, args.num_prompts,
                                                   distinct_lengths=args.dataset != "random"))
        print(format_sweep_report(report))
        completed = all(level["completed"] for level in report["levels"])
    else:
        report = asyncio.run(run_serve_load(settings))
        print(format_serve_report(report))
        completed = bool(report["completed"])
    if args.serve_output_json:
        write_json(args.serve_output_json, report)
        print(f"\nwrote {args.serve_output_json}")
    if args.serve_per_request_json:
        write_json(args.serve_per_request_json, per_request_tables(report))
        print(f"wrote {args.serve_per_request_json}")
    return 0 if completed else 1
