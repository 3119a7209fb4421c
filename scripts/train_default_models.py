"""Train foretell's default model family (issue 8, part 2) from public data, on one GPU.

  python scripts/train_default_models.py            # full recipe: one H200, about 8 minutes
  python scripts/train_default_models.py --smoke    # tiny sizes on the CPU, under a minute

Corpus: the Python standard library's source on this machine + GSM8K train (corpus.py). Steps:
  1. a byte-level BPE tokenizer with a ChatML chat template (bpe.py)
  2. qwen3-target: a Qwen3-layout LM pretrained from scratch (pretrain.py, transformers' class)
  3. qwen3-draft:  a smaller Qwen3-layout LM, same tokenizer and corpus
  4. qwen3-eagle3: an EAGLE3 head for the target, trained with foretell train-eagle3 on the
     target's own greedy answers to GSM8K train questions and Python prompts (--regenerate)
  5. measurement on GSM8K test prompts (greedy, k=3): online acceptance for the head and the draft
     model, and the trainer's teacher-forced acceptance on the same prompts (the fidelity check)
Each member is written as a plain HF folder with a README card under --out (default
foretell/default_models); intermediate files go to --work. Time budgets bound every training
phase, so the run fits its slot whatever the GPU's speed; the learning-rate schedules follow them.
The DeepSeek-V3-layout member (MLA + MoE with an MTP layer) is not part of this recipe yet.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import random
import shutil
import subprocess
import sys
import time

import numpy as np
import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from foretell.training import bpe, corpus  # noqa: E402
from foretell.training.pretrain import PretrainOptions, pretrain_causal_lm, qwen3_config, save_lm  # noqa: E402
from foretell.training.trainer import TrainConfig, train_eagle3  # noqa: E402

log = logging.getLogger("recipe")
NAMES = {"target": "qwen3-target", "draft": "qwen3-draft", "eagle3": "qwen3-eagle3"}

# Sizes and budgets. "gpu" fits about 8 minutes on one H200; "smoke" under a minute on a CPU.
PRESETS = {
    "gpu": dict(
        vocab_size=8192, max_corpus_mb=30.0, tokenizer_corpus_mb=12.0, seq_len=512, stdlib_tests=True,
        target=dict(hidden=256, layers=8, heads=4, kv_heads=2, head_dim=64, intermediate=768),
        draft=dict(hidden=128, layers=4, heads=2, kv_heads=1, head_dim=64, intermediate=384),
        target_steps=20000, target_batch=64, target_lr=3e-3, target_minutes=3.0,
        draft_steps=20000, draft_batch=64, draft_lr=4e-3, draft_minutes=0.75,
        head_gsm8k_prompts=7473, head_code_prompts=1000, head_regen_tokens=160, head_max_len=512,
        head_epochs=8, head_batch=32, head_lr=1e-3, head_minutes=2.0, draft_vocab_size=4096,
        measure_prompts=200, measure_tokens=128, device="cuda",
    ),
    "smoke": dict(
        vocab_size=512, max_corpus_mb=0.3, tokenizer_corpus_mb=0.3, seq_len=64, stdlib_tests=False,
        target=dict(hidden=64, layers=4, heads=4, kv_heads=2, head_dim=16, intermediate=128),
        draft=dict(hidden=32, layers=2, heads=2, kv_heads=1, head_dim=16, intermediate=64),
        target_steps=40, target_batch=8, target_lr=3e-3, target_minutes=0.2,
        draft_steps=20, draft_batch=8, draft_lr=3e-3, draft_minutes=0.1,
        head_gsm8k_prompts=24, head_code_prompts=8, head_regen_tokens=24, head_max_len=128,
        head_epochs=2, head_batch=8, head_lr=3e-3, head_minutes=0.2, draft_vocab_size=256,
        measure_prompts=6, measure_tokens=24, device="cpu",
    ),
}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--smoke", action="store_true", help="tiny sizes, CPU, under a minute")
    p.add_argument("--out", default=os.path.join(REPO, "foretell", "default_models"))
    p.add_argument("--work", default="/tmp/foretell-recipe", help="intermediate files")
    p.add_argument("--gsm8k", help="GSM8K train JSONL (default: foretell/data, else ../shared/data)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--set", action="append", default=[], metavar="KEY=JSON",
                   help="override a preset value, e.g. --set target_minutes=4 --set head_epochs=3 "
                        "--set 'target={\"hidden\": 320, ...}'")
    args = p.parse_args(argv)
    preset = dict(PRESETS["smoke" if args.smoke else "gpu"])
    for item in args.set:
        key, _, value = item.partition("=")
        if key not in preset:
            p.error(f"--set {key}: unknown; known keys: {', '.join(sorted(preset))}")
        preset[key] = json.loads(value)
    args.p = argparse.Namespace(**preset)
    return args


# ------------------------------------------------------------------------------------ corpus


def build_corpus(p, gsm8k_path: str, seed: int) -> tuple[list[str], dict]:
    problems = corpus.read_gsm8k(gsm8k_path)
    gsm8k_docs = corpus.gsm8k_documents(problems, seed)
    gsm8k_chars = sum(map(len, gsm8k_docs))
    budget = int(p.max_corpus_mb * 1e6)
    if gsm8k_chars > budget // 2:  # smoke runs: keep a mix of both sources
        gsm8k_docs = gsm8k_docs[: max(4, len(gsm8k_docs) * (budget // 2) // gsm8k_chars)]
        gsm8k_chars = sum(map(len, gsm8k_docs))
    code_docs = corpus.stdlib_documents(p.stdlib_tests, max_chars=budget - gsm8k_chars)
    docs = code_docs + gsm8k_docs
    random.Random(seed).shuffle(docs)
    info = {"stdlib_files": len(code_docs), "stdlib_chars": sum(map(len, code_docs)),
            "gsm8k_problems": len(problems), "gsm8k_documents": len(gsm8k_docs), "gsm8k_chars": gsm8k_chars,
            "python": sys.version.split()[0]}
    return docs, info


def encode_corpus(tokenizer, docs: list[str], eot: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(train, eval) token streams, documents separated by <|endoftext|>; the last 1% of
    documents (at least one) held out."""
    ids = tokenizer(docs, add_special_tokens=False)["input_ids"]
    n_eval = max(1, len(ids) // 100)

    def stream(parts):
        separator = np.array([eot], dtype=np.int64)
        return torch.from_numpy(np.concatenate([x for doc in parts for x in (np.asarray(doc, np.int64), separator)]))

    return stream(ids[:-n_eval]), stream(ids[-n_eval:])


# ------------------------------------------------------------------------------------ models


def train_lm(role: str, p, vocab: int, special: dict, train, held, folder: str, tokenizer_dir: str, seed: int) -> dict:
    dims = getattr(p, role)
    config = qwen3_config(vocab, dims["hidden"], dims["layers"], dims["heads"], dims["kv_heads"],
                          dims["head_dim"], dims["intermediate"], max(2048, p.seq_len * 4), special)
    opts = PretrainOptions(steps=getattr(p, f"{role}_steps"), batch_size=getattr(p, f"{role}_batch"),
                           seq_len=p.seq_len, lr=getattr(p, f"{role}_lr"), device=p.device, seed=seed,
                           time_budget_s=60 * getattr(p, f"{role}_minutes"),
                           warmup_steps=min(100, max(1, getattr(p, f"{role}_steps") // 10)))
    model, stats = pretrain_causal_lm(config, train, opts, held)
    save_lm(model, folder)
    _finish_hf_folder(folder, tokenizer_dir, special)
    stats.update(config=config, options=vars(opts))
    log.info("%s: %d params, %d steps in %.0f s, train loss %.3f, held-out loss %s", role, stats["parameters"],
             stats["steps"], stats["train_time_s"], stats["final_train_loss"] or float("nan"), stats.get("eval_loss"))
    del model
    _free()
    return stats


def _finish_hf_folder(folder: str, tokenizer_dir: str, special: dict) -> None:
    """Tokenizer files, both rope spellings and torch_dtype (older readers), EOS ids."""
    for name in bpe.TOKENIZER_FILES:
        shutil.copy(os.path.join(tokenizer_dir, name), folder)
    path = os.path.join(folder, "config.json")
    config = json.load(open(path))
    config.update(rope_theta=config.get("rope_parameters", {}).get("rope_theta", 10000.0), rope_scaling=None,
                  torch_dtype="bfloat16", dtype="bfloat16")
    _write_json(path, config)
    eos = [special["<|endoftext|>"], special["<|im_end|>"]]
    _write_json(os.path.join(folder, "generation_config.json"),
                {"bos_token_id": special["<|endoftext|>"], "eos_token_id": eos,
                 "pad_token_id": special["<|endoftext|>"]})


def head_prompts(path: str, gsm8k_path: str, p, seed: int) -> str:
    """Prompts the target answers for the head's training data: GSM8K train questions in the
    benchmark's plain format and (a quarter of them) as chats, plus openings of stdlib files."""
    rng = random.Random(seed)
    problems = corpus.read_gsm8k(gsm8k_path)[: p.head_gsm8k_prompts]
    records = []
    for i, problem in enumerate(problems):
        if i % 4 == 3:
            records.append({"messages": [{"role": "user", "content": problem["question"]}]})
        else:
            records.append({"prompt": f"Question: {problem['question']}\nAnswer:"})
    files = corpus.stdlib_files(include_tests=False)
    for f in rng.sample(files, min(p.head_code_prompts, len(files))):
        try:
            lines = open(f, encoding="utf-8").read().splitlines()
        except (UnicodeDecodeError, OSError):
            continue
        opening = "\n".join(lines[: rng.randint(4, 16)]).strip()
        if opening:
            records.append({"prompt": opening + "\n"})
    with open(path, "w") as f:
        for r in records:
            f.write(json.dumps(r) + "\n")
    return path


def train_head(p, target_dir: str, data: str, work: str, seed: int) -> dict:
    cfg = TrainConfig(target=target_dir, data=[data], out=work, regenerate=True,
                      regen_max_tokens=p.head_regen_tokens, regen_max_num_seqs=512, draft_vocab_size=p.draft_vocab_size,
                      ttt_steps=7, max_len=p.head_max_len, epochs=p.head_epochs, batch_size=p.head_batch,
                      lr=p.head_lr, time_budget_s=60 * p.head_minutes, eval_fraction=0.05, device=p.device,
                      seed=seed, warmup_ratio=0.05)
    metrics = train_eagle3(cfg)
    _free()
    return metrics


# ------------------------------------------------------------------------------- measurement


def measure(p, target_dir: str, draft_dir: str, head_dir: str, work: str) -> dict:
    """Greedy on GSM8K test prompts: plain, EAGLE3 k=3 and draft model k=3 (online acceptance,
    outputs must equal plain greedy), and the teacher-forced acceptance of the head on the same
    prompts (its engine-walk replay is what the online number should equal)."""
    from foretell import LLM, SamplingParams
    from foretell.bench.datasets import data_path, read_jsonl

    questions = [r["question"] for r in read_jsonl(data_path("gsm8k_test.jsonl"))[: p.measure_prompts]]
    prompts = [f"Question: {q}\nAnswer:" for q in questions]
    params = SamplingParams(temperature=0.0, max_tokens=p.measure_tokens)
    engine = dict(device=p.device, kv_cache_memory_bytes=2 << 30, max_num_seqs=256)
    results = {"prompts": len(prompts), "max_tokens": p.measure_tokens}
    baseline = None
    for name, spec in [("plain", None),
                       ("eagle3", {"method": "eagle3", "model": head_dir, "num_speculative_tokens": 3}),
                       ("draft_model", {"method": "draft_model", "model": draft_dir, "num_speculative_tokens": 3})]:
        llm = LLM(target_dir, speculative_config=spec, **engine)
        llm.generate(prompts[:4], params, use_tqdm=False)  # warm-up (CUDA graphs, allocator)
        before = llm.get_stats()
        start = time.time()
        outs = llm.generate(prompts, params, use_tqdm=False)
        elapsed = time.time() - start
        tokens = [o.outputs[0].token_ids for o in outs]
        entry = {"seconds": elapsed, "output_tokens": sum(map(len, tokens))}
        if baseline is None:
            baseline = tokens
        else:
            after = llm.get_stats()
            drafts = after["num_drafts"] - before["num_drafts"]
            accepted = [a - b for a, b in zip(after["accepted_per_position"], before["accepted_per_position"])]
            # Prompts whose output differs from plain greedy, and the first differing position.
            differ = [next(i for i, (a, b) in enumerate(zip(x + [None], y + [None])) if a != b)
                      for x, y in zip(tokens, baseline) if x != y]
            entry.update(num_drafts=drafts, acceptance_per_position=[a / max(drafts, 1) for a in accepted],
                         mean_acceptance_length=1 + sum(accepted) / max(drafts, 1), greedy_equal=not differ,
                         greedy_mismatch_prompts=len(differ), greedy_first_mismatch_positions=differ)
        results[name] = entry
        del llm
        _free()
    data = os.path.join(work, "gsm8k_test_prompts.jsonl")
    with open(data, "w") as f:
        for prompt in prompts:
            f.write(json.dumps({"prompt": prompt}) + "\n")
    tf = train_eagle3(TrainConfig(target=target_dir, data=[data], out=head_dir, regenerate=True,
                                  regen_max_tokens=p.measure_tokens, max_len=4096, eval_only=True,
                                  device=p.device, ttt_steps=7, batch_size=32))
    results["teacher_forced"] = {k: tf[k] for k in ("acceptance_per_position", "mean_acceptance_length", "engine_walk")}
    return results


# ----------------------------------------------------------------------------------- cards


def folder_files(folder: str) -> dict[str, int]:
    return {f: os.path.getsize(os.path.join(folder, f)) for f in sorted(os.listdir(folder))}


def write_card(folder: str, title: str, body: list[str]) -> None:
    sizes = folder_files(folder)
    lines = [f"# {title}", "", *body, "", "## Files", ""]
    lines += [f"- `{name}`: {size / 2**20:.2f} MiB" for name, size in sizes.items()]
    lines += ["", "## Data and license", "",
              "Trained from scratch on the Python standard library's source (Python Software Foundation "
              "License) and GSM8K train (MIT, github.com/openai/grade-school-math). Rebuild with "
              "`python scripts/train_default_models.py` (see its docstring).", ""]
    with open(os.path.join(folder, "README.md"), "w") as f:
        f.write("\n".join(lines))


def lm_card(folder: str, role: str, stats: dict, corpus_info: dict, hardware: str) -> list[str]:
    c = stats["config"]
    o = stats["options"]
    return [
        f"The {role} of foretell's default model family: a Qwen3-layout causal LM "
        f"(`Qwen3ForCausalLM`, tied embeddings), bfloat16 safetensors, byte-level BPE tokenizer with a "
        f"ChatML chat template.", "",
        "## Architecture", "",
        f"- {stats['parameters'] / 1e6:.2f}M parameters: hidden {c['hidden_size']}, {c['num_hidden_layers']} layers, "
        f"{c['num_attention_heads']} query / {c['num_key_value_heads']} KV heads of {c['head_dim']}, "
        f"MLP {c['intermediate_size']}, vocabulary {c['vocab_size']}, RoPE theta {c['rope_theta']:g}", "",
        "## Training", "",
        f"- corpus: {corpus_info['stdlib_files']} standard-library files of Python {corpus_info['python']} "
        f"({corpus_info['stdlib_chars'] / 1e6:.1f}M characters) + GSM8K train ({corpus_info['gsm8k_problems']} "
        f"problems, plain `Question: ...\\nAnswer: ...` and ChatML), {corpus_info['train_tokens'] / 1e6:.2f}M tokens",
        f"- {stats['steps']} steps of {o['batch_size']} x {o['seq_len']} tokens ({stats['tokens_seen'] / 1e6:.0f}M "
        f"tokens), AdamW lr {o['lr']} cosine, {stats['train_time_s']:.0f} s on {hardware}",
        f"- final train loss {stats['final_train_loss']:.3f}, held-out loss {stats.get('eval_loss', float('nan')):.3f}",
    ]


def main(argv=None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    args = parse_args(argv)
    p, t0 = args.p, time.time()
    if p.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("the full recipe needs a CUDA GPU; use --smoke for a CPU run")
    hardware = torch.cuda.get_device_name() if p.device == "cuda" else "CPU"
    os.makedirs(args.work, exist_ok=True)
    dirs = {role: os.path.join(args.out, name) for role, name in NAMES.items()}
    for folder in dirs.values():
        shutil.rmtree(folder, ignore_errors=True)
    gsm8k_path = corpus.find_gsm8k_train(args.gsm8k)
    docs, corpus_info = build_corpus(p, gsm8k_path, args.seed)
    log.info("corpus: %d documents, %.1fM characters", len(docs), sum(map(len, docs)) / 1e6)

    tokenizer_dir = os.path.join(args.work, "tokenizer")
    sample_budget, sample = int(p.tokenizer_corpus_mb * 1e6), []
    for d in docs:
        if sum(map(len, sample)) + len(d) > sample_budget and sample:
            break
        sample.append(d)
    special = bpe.train_bpe_tokenizer(sample, p.vocab_size, tokenizer_dir)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    train_tokens, held_tokens = encode_corpus(tokenizer, docs, special["<|endoftext|>"])
    corpus_info.update(train_tokens=train_tokens.numel(), held_out_tokens=held_tokens.numel(),
                       tokenizer_s=time.time() - t0)
    log.info("tokenizer %d ids; %d train / %d held-out tokens (%.0f s)", len(tokenizer), train_tokens.numel(),
             held_tokens.numel(), time.time() - t0)

    target = train_lm("target", p, p.vocab_size, special, train_tokens, held_tokens, dirs["target"], tokenizer_dir, args.seed)
    draft = train_lm("draft", p, p.vocab_size, special, train_tokens, held_tokens, dirs["draft"], tokenizer_dir, args.seed + 1)
    head_work = os.path.join(args.work, "eagle3")
    shutil.rmtree(head_work, ignore_errors=True)
    data = head_prompts(os.path.join(args.work, "head_prompts.jsonl"), gsm8k_path, p, args.seed)
    head = train_head(p, dirs["target"], data, head_work, args.seed)
    os.makedirs(dirs["eagle3"], exist_ok=True)
    for name in ("config.json", "model.safetensors"):
        shutil.copy(os.path.join(head_work, name), dirs["eagle3"])
    results = measure(p, dirs["target"], dirs["draft"], dirs["eagle3"], args.work)
    # measure()'s teacher-forced pass ran on the shipped folder; keep only the head files there.
    for name in os.listdir(dirs["eagle3"]):
        if name not in ("config.json", "model.safetensors"):
            path = os.path.join(dirs["eagle3"], name)
            shutil.rmtree(path) if os.path.isdir(path) else os.remove(path)
    summary = {"corpus": corpus_info, "target": target, "draft": draft, "head": head, "measured": results,
               "total_s": time.time() - t0, "hardware": hardware, "commit": _commit(), "preset": vars(p)}
    _write_json(os.path.join(args.work, "recipe_metrics.json"), summary)
    _write_cards(dirs, summary)
    log.info("done in %.0f s; models in %s, metrics in %s", summary["total_s"], args.out,
             os.path.join(args.work, "recipe_metrics.json"))
    print(json.dumps({"total_s": summary["total_s"], "measured": results}, indent=2))
    return 0


def _write_cards(dirs: dict, s: dict) -> None:
    m, hw = s["measured"], s["hardware"]
    for role in ("target", "draft"):
        body = lm_card(dirs[role], role, s[role], s["corpus"], hw)
        if role == "draft":
            body += ["", "## Measured acceptance", "",
                     f"- as the draft model of qwen3-target, greedy, k=3, {m['prompts']} GSM8K test prompts: "
                     f"mean acceptance length {m['draft_model']['mean_acceptance_length']:.2f}, per position "
                     f"{_fmt(m['draft_model']['acceptance_per_position'])}; {_equal(m, 'draft_model')}"]
        write_card(dirs[role], f"{NAMES[role]} (foretell default model family)", body)
    h, tf = s["head"], m["teacher_forced"]
    ev = h.get("eval", {})
    write_card(dirs["eagle3"], f"{NAMES['eagle3']} (foretell default model family)", [
        "An EAGLE3 draft head for qwen3-target (`LlamaForCausalLMEagle3`, one Llama layer, EAGLE/AngelSlim "
        "layout: `midlayer.*`, no embed_tokens, the target's embedding is shared).", "",
        "## Architecture", "",
        f"- hidden {s['target']['config']['hidden_size']}, draft vocabulary {h['draft_vocab_size']} "
        f"(d2t / t2d), aux hidden states: inputs of target layers {h['aux_layer_ids']} (config ids "
        f"{[i - 1 for i in h['aux_layer_ids']]}, SpecForge's 'output of layer j' convention)", "",
        "## Training", "",
        f"- `foretell train-eagle3 --regenerate`: the target's own greedy answers to {h['num_train_examples'] + h['num_eval_examples']} "
        f"prompts (GSM8K train questions, plain and chat, and openings of standard-library files)",
        f"- training-time test with 7 steps, {h['steps']} steps, {h['train_time_s']:.0f} s on {hw}, final loss "
        f"{h['final_loss']:.3f}",
        f"- held-out teacher-forced acceptance per position: {_fmt(ev.get('acceptance_per_position', []))}", "",
        "## Measured acceptance (greedy, k=3, GSM8K test prompts)", "",
        f"- online (engine): mean acceptance length {m['eagle3']['mean_acceptance_length']:.2f}, per position "
        f"{_fmt(m['eagle3']['acceptance_per_position'])}; {_equal(m, 'eagle3')}",
        f"- teacher-forced, replaying the engine's walk: {_fmt(tf['engine_walk']['acceptance_per_position'])}; "
        f"over all rows: {_fmt(tf['acceptance_per_position'][:3])}",
    ])


def _equal(m: dict, method: str) -> str:
    return (f"greedy output identical to plain greedy on {m['prompts'] - m[method]['greedy_mismatch_prompts']} "
            f"of {m['prompts']} prompts")


def _fmt(values) -> str:
    return " / ".join(f"{v:.3f}" for v in values)


def _commit() -> str | None:
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True).stdout.strip() or None
    except OSError:
        return None


def _write_json(path: str, data) -> None:
    with open(path, "w") as f:
        json.dump(data, f, indent=2, default=str)
        f.write("\n")


def _free() -> None:
    import gc

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


if __name__ == "__main__":
    sys.exit(main())
