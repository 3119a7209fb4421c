"""`foretell generate | serve | bench | eval | train-eagle3`: the command line.

Each command lives in its own module and registers itself in COMMANDS (an explicit table).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from typing import TextIO

from foretell.cli_args import add_engine_args, engine_kwargs_from_args, take_model_positional
from foretell.cli_args import add_logits_control_args, logits_control_kwargs


def add_generate_parser(sub) -> None:
    p = sub.add_parser("generate", help="generate text for one or more prompts")
    add_engine_args(p, model_required=False)
    g = p.add_argument_group("generation")
    g.add_argument("--prompt", action="append", required=True, help="repeat for several prompts")
    g.add_argument("--chat", action="store_true", help="wrap each prompt with the chat template")
    g.add_argument("--max-tokens", type=int, default=64, help="tokens to generate at most")
    g.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    g.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling: keep this probability mass")
    g.add_argument("--top-k", type=int, default=-1, help="keep the k likeliest tokens (-1: all)")
    g.add_argument("--min-p", type=float, default=0.0,
                   help="drop tokens below this fraction of the likeliest one's probability")
    g.add_argument("--sampling-seed", type=int, help="per-request seed (reproducible sampling)")
    g.add_argument("--stop", action="append", help="stop string (repeatable)")
    g.add_argument("--ignore-eos", action="store_true",
                   help="keep generating past the end-of-sequence token")
    g.add_argument("--n", type=int, default=1, help="samples per prompt")
    add_logits_control_args(g)
    g.add_argument("--stream", default="auto", choices=["auto", "on", "off"],
                   help="print tokens as they come (auto: when stdout is a terminal; one prompt "
                        "and --n 1 only, else the text prints at the end)")
    g.add_argument("--stats", action="store_true",
                   help="print wall time, tokens/s and the engine and speculative stats")
    p.set_defaults(func=run_generate)


def run_generate(args: argparse.Namespace) -> int:
    from foretell import LLM, SamplingParams
    from foretell.defaults import fill_default_models

    fill_default_models(args)
    params = SamplingParams(
        n=args.n, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
        min_p=args.min_p, seed=args.sampling_seed, max_tokens=args.max_tokens, stop=args.stop,
        ignore_eos=args.ignore_eos, **logits_control_kwargs(args),
    )
    llm = LLM(args.model, **engine_kwargs_from_args(args))
    if args.chat:
        prompts = [{"prompt_token_ids": llm.tokenizer.apply_chat_template([{"role": "user", "content": p}])}
                   for p in args.prompt]
    else:
        prompts = list(args.prompt)
    stream = args.stream == "on" or (args.stream == "auto" and sys.stdout.isatty())
    start = time.perf_counter()
    if stream and len(prompts) == 1 and args.n == 1:
        print(f"--- prompt: {args.prompt[0]!r}")
        if not args.chat:
            print(args.prompt[0], end="", flush=True)
        out = stream_one(llm, prompts[0], params, sys.stdout)
        print()
        print(f"--- finish reason: {describe_finish(out.outputs[0], params, llm.engine.eos_token_ids)}")
        outs = [out]
    else:
        outs = llm.generate(prompts, params)
        for prompt, out in zip(args.prompt, outs):
            print(f"--- prompt: {prompt!r}")
            for completion in out.outputs:
                if args.n > 1:
                    print(f"[sample {completion.index}]")
                print(prompt + completion.text if not args.chat else completion.text)
                print(f"--- finish reason: "
                      f"{describe_finish(completion, params, llm.engine.eos_token_ids)}")
    wall_s = time.perf_counter() - start
    if args.stats:
        generated = sum(len(c.token_ids) for out in outs for c in out.outputs)
        print(f"--- {generated} tokens in {wall_s:.2f} s: {generated / wall_s:.1f} tokens/s "
              f"(wall time of generation, model loading excluded)")
        stats = {"wall_time_s": wall_s, "generated_tokens": generated,
                 "tokens_per_s": generated / wall_s, **llm.get_stats()}
        print(json.dumps(stats, indent=2))
    return 0


def stream_one(llm, prompt, params, out: TextIO):
    """Run one request through the engine's step loop, writing its text as it grows. The last
    (longest stop string - 1) characters wait until the request ends, since a stop string that
    completes later cuts them off."""
    engine = llm.engine
    request_id = "generate-stream"
    engine.add_request(request_id, prompt, params)
    hold = max((len(s) for s in params.stop_strings), default=1) - 1
    shown = 0
    try:
        while True:
            for result in engine.step():
                if result.request_id != request_id:
                    continue
                text = result.outputs[0].text
                visible = len(text) if result.finished else len(text) - hold
                if visible > shown:
                    out.write(text[shown:visible])
                    out.flush()
                    shown = visible
                if result.finished:
                    return result
    except BaseException:
        engine.abort_request(request_id)
        raise


def describe_finish(completion, params, eos_token_ids) -> str:
    """'stop (stop string '\\n')', 'length (--max-tokens 64 reached)', ..."""
    reason, why = completion.finish_reason, completion.stop_reason
    if reason == "stop":
        if isinstance(why, str):
            return f"stop (stop string {why!r})"
        if why in eos_token_ids:
            return f"stop (end-of-sequence token {why})"
        return f"stop (stop token id {why})" if why is not None else "stop"
    if reason == "length":
        if params.max_tokens is not None and len(completion.token_ids) >= params.max_tokens:
            return f"length (--max-tokens {params.max_tokens} reached)"
        return "length (the model's context, --max-model-len, is full)"
    return str(reason)


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
        take_model_positional(args)
        return args.func(args)
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
