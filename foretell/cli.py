"""`foretell generate | serve | bench | eval | train-eagle3`: the command line.

Each command lives in its own module and registers itself in COMMANDS (an explicit table).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys

from foretell.cli_args import add_engine_args, engine_kwargs_from_args


def add_generate_parser(sub) -> None:
    p = sub.add_parser("generate", help="generate text for one or more prompts")
    add_engine_args(p, model_required=False)
    p.add_argument("--prompt", action="append", required=True, help="repeat for several prompts")
    p.add_argument("--chat", action="store_true", help="wrap each prompt with the chat template")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=-1)
    p.add_argument("--min-p", type=float, default=0.0)
    p.add_argument("--sampling-seed", type=int, help="per-request seed (reproducible sampling)")
    p.add_argument("--stop", action="append", help="stop string (repeatable)")
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--n", type=int, default=1)
    p.add_argument("--stats", action="store_true", help="print engine and speculative stats")
    p.set_defaults(func=run_generate)


def run_generate(args: argparse.Namespace) -> int:
    from foretell import LLM, SamplingParams
    from foretell.defaults import fill_default_models

    fill_default_models(args)
    params = SamplingParams(
        n=args.n, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
        min_p=args.min_p, seed=args.sampling_seed, max_tokens=args.max_tokens, stop=args.stop,
        ignore_eos=args.ignore_eos,
    )
    llm = LLM(args.model, **engine_kwargs_from_args(args))
    if args.chat:
        outs = llm.chat([[{"role": "user", "content": p}] for p in args.prompt], params)
    else:
        outs = llm.generate(args.prompt, params)
    for prompt, out in zip(args.prompt, outs):
        for completion in out.outputs:
            print(f"--- prompt: {prompt!r} ({completion.finish_reason})")
            print(prompt + completion.text if not args.chat else completion.text)
    if args.stats:
        print(json.dumps(llm.get_stats(), indent=2))
    return 0


COMMANDS = {
    "generate": add_generate_parser,
    "bench": lambda sub: __import__("foretell.bench.cli", fromlist=["cli"]).add_bench_parser(sub),
    "eval": lambda sub: __import__("foretell.eval.cli", fromlist=["cli"]).add_eval_parser(sub),
    "serve": lambda sub: __import__("foretell.server.cli", fromlist=["cli"]).add_serve_parser(sub),
    "train-eagle3": lambda sub: __import__("foretell.training.cli", fromlist=["cli"]).add_train_parser(sub),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="foretell", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for add in COMMANDS.values():
        add(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
