"""Where the host time of a graphed decode step goes (cProfile over engine steps).

    python scripts/profile_host.py OUT_DIR [--steps 128]

Llama-3.1-8B shape, bf16, dummy weights, batch 1, CUDA graphs. Prints the functions with the most
own time; the GPU wait shows up in the call that syncs (tolist / synchronize), everything else is
host work the GPU idles through. Writes OUT_DIR/profile_host.txt.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import sys
import time

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, ROOT)

from foretell import LLM, SamplingParams  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir")
    parser.add_argument("--steps", type=int, default=128)
    parser.add_argument("--model", default=os.path.join(ROOT, "foretell", "configs", "llama-3.1-8b"))
    args = parser.parse_args()
    llm = LLM(args.model, dtype="bfloat16", device="cuda", load_format="dummy", skip_tokenizer_init=True,
              max_num_seqs=4, log_stats_interval_s=0)
    prompt = {"prompt_token_ids": list(range(1, 129))}
    params = SamplingParams(temperature=0, max_tokens=args.steps, ignore_eos=True)
    llm.generate([prompt], params, use_tqdm=False)  # warm-up
    engine = llm.engine
    engine.add_request("p", prompt, params)
    engine.step()  # prefill
    profiler = cProfile.Profile()
    start = time.perf_counter()
    steps = 0
    profiler.enable()
    while engine.has_unfinished_requests():
        engine.step()
        steps += 1
    profiler.disable()
    wall = time.perf_counter() - start
    text = io.StringIO()
    text.write(f"{steps} decode steps, {1000 * wall / steps:.3f} ms per step (under cProfile)\n")
    stats = pstats.Stats(profiler, stream=text)
    stats.sort_stats("tottime").print_stats(30)
    stats.sort_stats("cumulative").print_stats(30)
    os.makedirs(args.out_dir, exist_ok=True)
    with open(os.path.join(args.out_dir, "profile_host.txt"), "w") as f:
        f.write(text.getvalue())
    print(text.getvalue()[:6000])


if __name__ == "__main__":
    main()
