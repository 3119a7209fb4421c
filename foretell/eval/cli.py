"""`foretell eval TASK`: flags and the command function (torch loads only when it runs)."""

from __future__ import annotations

import argparse

from foretell.cli_args import add_engine_args, engine_kwargs_from_args, speculative_config_from_args

TASKS = ("gsm8k",)


def add_eval_parser(sub) -> None:
    p = sub.add_parser(
        "eval", help="accuracy on a benchmark task, with speculative decoding statistics",
        description="Evaluate a model on a task shipped with foretell. With speculative flags, "
        "the questions also run without speculation and the report says whether greedy "
        "accuracy (and every output) is identical, as it must be. With no model folder (after "
        "TASK, or --model) it runs the shipped default family with its EAGLE3 head "
        "(--method none: without speculation).",
    )
    p.add_argument("task", choices=TASKS, help="the task: " + ", ".join(TASKS))
    add_engine_args(p, model_required=False)
    g = p.add_argument_group("evaluation")
    g.add_argument("--num-fewshot", type=int, default=5, help="worked examples before each question")
    g.add_argument("--fewshot-seed", type=int, default=1234, help="which train examples are shots")
    g.add_argument("--limit", type=int, help="evaluate the first N test questions only")
    g.add_argument("--max-tokens", type=int, default=256, help="tokens per answer at most")
    g.add_argument("--chat", action="store_true", help="send each prompt through the chat template")
    g.add_argument("--skip-greedy-check", dest="check_greedy", action="store_false",
                   help="with speculation, do not rerun without it")
    g.add_argument("--output-json", help="write the report here")
    g.add_argument("--log-samples", action="store_true",
                   help="include every completion in the JSON")
    g.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bar")
    p.set_defaults(func=run_eval_command)


def run_eval_command(args: argparse.Namespace) -> int:
    from foretell.bench.report import write_json
    from foretell.defaults import fill_default_models
    from foretell.eval.gsm8k import format_report, run_gsm8k

    fill_default_models(args)
    report = run_gsm8k(
        args.model, engine_kwargs_from_args(args), speculative_config_from_args(args),
        num_fewshot=args.num_fewshot, limit=args.limit, max_tokens=args.max_tokens,
        fewshot_seed=args.fewshot_seed, chat=args.chat, check_greedy=args.check_greedy,
        log_samples=args.log_samples, progress=args.progress,
    )
    print(format_report(report))
    if args.output_json:
        write_json(args.output_json, report)
        print(f"wrote {args.output_json}")
    check = report.get("greedy_check")
    return 1 if check is not None and not check["accuracy_identical"] else 0
