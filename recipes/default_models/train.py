"""Train foretell's default model family (issue 8, part 2) from public data, on one GPU.

  python -m recipes.default_models.train            # full recipe: one H200, about 13 minutes
  python -m recipes.default_models.train --smoke    # tiny sizes on the CPU, a couple of minutes

Corpus: the Python standard library's source on this machine + GSM8K train (corpus.py). Steps:
  1. a byte-level BPE tokenizer with a ChatML chat template (bpe.py), shared by every member
  2. the Qwen3 family:
     qwen3-target: a Qwen3-layout LM pretrained from scratch (pretrain.py, transformers' class)
     qwen3-draft:  a smaller Qwen3-layout LM, same tokenizer and corpus
     qwen3-eagle3: an EAGLE3 head for the target, trained with foretell train-eagle3 on the
                   target's own greedy answers to GSM8K train questions and Python prompts
  3. the DeepSeek family:
     deepseek-target: a DeepSeek-V3-layout LM (MLA + MoE) trained jointly with one MTP layer
                      (deepseek_pretrain.py: DeepSeek-V3's MTP loss, aux-loss-free balancing)
     deepseek-eagle3: an EAGLE3 head for it, trained like qwen3-eagle3
  4. measurement on GSM8K test prompts (greedy, k=3; measure.py): online acceptance of
     every drafter (EAGLE3, draft model, MTP, n-gram) and the trainer's teacher-forced
     acceptance of each head on the same prompts (the fidelity check)
Each member is a plain HF folder with a README card under --out (default foretell/default_models);
intermediate files go to --work. On a GPU the two families train at the same time in two
processes (small models leave most of the GPU idle). Time budgets bound every training phase,
so the run fits its slot whatever the GPU's speed; the learning-rate schedules follow them.
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

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)

from recipes.default_models import bpe, corpus, cards  # noqa: E402
from recipes.default_models.deepseek_pretrain import deepseek_v3_config, pretrain_deepseek_mtp, save_deepseek_mtp  # noqa: E402
from recipes.default_models.pretrain import PretrainOptions, pretrain_causal_lm, qwen3_config, save_lm  # noqa: E402
from foretell.bench.datasets import gsm8k_test_prompts  # noqa: E402
from recipes.default_models.measure import free_memory, measure_methods, teacher_forced  # noqa: E402
from foretell.training.trainer import TrainConfig, train_eagle3  # noqa: E402

log = logging.getLogger("recipe")
NAMES = {"target": "qwen3-target", "draft": "qwen3-draft", "eagle3": "qwen3-eagle3",
         "ds_target": "deepseek-target", "ds_eagle3": "deepseek-eagle3"}
FAMILIES = {"qwen3": ("target", "draft", "eagle3"), "deepseek": ("ds_target", "ds_eagle3")}
LM_ROLES = ("target", "draft", "ds_target")  # pretrained LMs (kept by --reuse-lms); the rest are heads

# Sizes and budgets. "gpu" fits about 8 minutes on one H200 and 40 MB of bf16 weights in all;
# "smoke" runs in a couple of minutes on a CPU.
PRESETS = {
    "gpu": dict(
        vocab_size=4096, max_corpus_mb=30.0, tokenizer_corpus_mb=12.0, seq_len=512, stdlib_tests=True,
        target=dict(hidden=256, layers=8, heads=4, kv_heads=2, head_dim=64, intermediate=768),
        draft=dict(hidden=128, layers=4, heads=2, kv_heads=1, head_dim=64, intermediate=384),
        ds_target=dict(hidden=192, layers=4, dense_layers=1, heads=4, q_lora_rank=96, kv_lora_rank=64,
                       qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32, intermediate=512,
                       moe_intermediate=96, experts=8, shared_experts=1, experts_per_token=2, groups=2,
                       topk_groups=1),
        target_steps=20000, target_batch=64, target_lr=3e-3, target_minutes=2.3,
        draft_steps=20000, draft_batch=64, draft_lr=4e-3, draft_minutes=0.5,
        ds_target_steps=20000, ds_target_batch=64, ds_target_lr=3e-3, ds_target_minutes=2.6, mtp_weight=0.3,
        # The shipped Qwen3 head: each GSM8K train question asked 3 more times with fresh numbers.
        head_gsm8k_prompts=7473, head_perturbed_prompts=7473, head_perturbed_copies=3, head_code_prompts=1500,
        head_regen_tokens=128, head_max_len=512, head_epochs=8, head_batch=64, head_lr=1.5e-3, head_minutes=5.0,
        ds_head_minutes=1.5, draft_vocab_size=2048,
        ds_head_aux_layers=[1, 2, 3],
        measure_prompts=200, measure_tokens=128, device="cuda",
    ),
    "smoke": dict(
        vocab_size=512, max_corpus_mb=0.3, tokenizer_corpus_mb=0.3, seq_len=64, stdlib_tests=False,
        target=dict(hidden=64, layers=4, heads=4, kv_heads=2, head_dim=16, intermediate=128),
        draft=dict(hidden=32, layers=2, heads=2, kv_heads=1, head_dim=16, intermediate=64),
        ds_target=dict(hidden=64, layers=4, dense_layers=1, heads=4, q_lora_rank=32, kv_lora_rank=32,
                       qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, intermediate=128,
                       moe_intermediate=32, experts=8, shared_experts=1, experts_per_token=2, groups=2,
                       topk_groups=1),
        target_steps=40, target_batch=8, target_lr=3e-3, target_minutes=0.2,
        draft_steps=20, draft_batch=8, draft_lr=3e-3, draft_minutes=0.1,
        ds_target_steps=30, ds_target_batch=8, ds_target_lr=3e-3, ds_target_minutes=0.2, mtp_weight=0.3,
        head_gsm8k_prompts=24, head_perturbed_prompts=8, head_perturbed_copies=1, head_code_prompts=8, head_regen_tokens=24, head_max_len=128,
        head_epochs=2, head_batch=8, head_lr=3e-3, head_minutes=0.2, ds_head_minutes=0.2, draft_vocab_size=256,
        ds_head_aux_layers=[1, 2, 3],
        measure_prompts=6, measure_tokens=24, device="cpu",
    ),
}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--smoke", action="store_true", help="tiny sizes, CPU")
    p.add_argument("--out", default=os.path.join(REPO, "foretell", "default_models"))
    p.add_argument("--work", default="/tmp/foretell-recipe", help="intermediate files")
    p.add_argument("--gsm8k", help="GSM8K train JSONL (default: foretell/data, else ../shared/data)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--family", choices=["all", *FAMILIES], default="all",
                   help="train one family only (reuses the tokenizer and corpus in --work if there)")
    p.add_argument("--sequential", action="store_true", help="on a GPU too, one family after the other")
    p.add_argument("--reuse-lms", action="store_true",
                   help="keep the pretrained LMs already in --out (their stats from its recipe_metrics.json); "
                        "retrain the heads and measure again")
    p.add_argument("--cards-only", action="store_true",
                   help="rewrite the model cards in --out from its recipe_metrics.json, train nothing")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)  # the recipe's second process
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


# ------------------------------------------------------------------------------ corpus, tokenizer


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


def prepare_data(args) -> dict:
    """Tokenizer + encoded corpus in --work (made once; a --family run reuses them)."""
    p, work = args.p, args.work
    path = os.path.join(work, "data.pt")
    if os.path.isfile(path) and args.family != "all":
        return torch.load(path)
    t0 = time.time()
    gsm8k_path = corpus.find_gsm8k_train(args.gsm8k)
    docs, corpus_info = build_corpus(p, gsm8k_path, args.seed)
    log.info("corpus: %d documents, %.1fM characters", len(docs), sum(map(len, docs)) / 1e6)
    tokenizer_dir = os.path.join(work, "tokenizer")
    sample_budget, sample = int(p.tokenizer_corpus_mb * 1e6), []
    for d in docs:
        if sum(map(len, sample)) + len(d) > sample_budget and sample:
            break
        sample.append(d)
    special = bpe.train_bpe_tokenizer(sample, p.vocab_size, tokenizer_dir)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    train, held = encode_corpus(tokenizer, docs, special["<|endoftext|>"])
    corpus_info.update(train_tokens=train.numel(), held_out_tokens=held.numel(), tokenizer_s=time.time() - t0)
    log.info("tokenizer %d ids; %d train / %d held-out tokens (%.0f s)", len(tokenizer), train.numel(),
             held.numel(), time.time() - t0)
    data = {"train": train, "held": held, "special": special, "corpus": corpus_info,
            "tokenizer_dir": tokenizer_dir, "gsm8k": gsm8k_path}
    torch.save(data, path)
    return data


# ------------------------------------------------------------------------------------ members


def options(p, role: str, seed: int) -> PretrainOptions:
    steps = getattr(p, f"{role}_steps")
    return PretrainOptions(steps=steps, batch_size=getattr(p, f"{role}_batch"), seq_len=p.seq_len,
                           lr=getattr(p, f"{role}_lr"), device=p.device, seed=seed,
                           time_budget_s=60 * getattr(p, f"{role}_minutes"), warmup_steps=min(100, max(1, steps // 10)))


def train_qwen3(role: str, p, data: dict, folder: str, seed: int) -> dict:
    d = getattr(p, role)
    config = qwen3_config(p.vocab_size, d["hidden"], d["layers"], d["heads"], d["kv_heads"], d["head_dim"],
                          d["intermediate"], max(2048, p.seq_len * 4), data["special"])
    opts = options(p, role, seed)
    model, stats = pretrain_causal_lm(config, data["train"], opts, data["held"])
    save_lm(model, folder)
    finish_hf_folder(folder, data)
    stats.update(config=config, options=vars(opts))
    log_lm(role, stats)
    del model
    free_memory()
    return stats


def train_deepseek(p, data: dict, folder: str, seed: int) -> dict:
    config = deepseek_v3_config(p.vocab_size, max_positions=max(2048, p.seq_len * 4), special_ids=data["special"],
                                **p.ds_target)
    opts = options(p, "ds_target", seed)
    model, stats = pretrain_deepseek_mtp(config, data["train"], opts, data["held"], mtp_weight=p.mtp_weight)
    save_deepseek_mtp(model, folder)
    finish_hf_folder(folder, data)
    stats.update(config=config, options=vars(opts))
    log_lm("ds_target", stats)
    del model
    free_memory()
    return stats


def log_lm(role: str, stats: dict) -> None:
    log.info("%s: %d params, %d steps in %.0f s, train loss %.3f %s, held-out loss %s", role, stats["parameters"],
             stats["steps"], stats["train_time_s"], stats["final_train_loss"] or float("nan"),
             stats.get("final_train_parts", {}), stats.get("eval_loss"))


def finish_hf_folder(folder: str, data: dict) -> None:
    """Tokenizer files, both rope spellings and torch_dtype (older readers), EOS ids."""
    special = data["special"]
    for name in bpe.TOKENIZER_FILES:
        shutil.copy(os.path.join(data["tokenizer_dir"], name), folder)
    path = os.path.join(folder, "config.json")
    config = json.load(open(path))
    config.update(rope_theta=config.get("rope_parameters", {}).get("rope_theta", config.get("rope_theta", 10000.0)),
                  rope_scaling=None, torch_dtype="bfloat16", dtype="bfloat16")
    write_json(path, config)
    eos = [special["<|endoftext|>"], special["<|im_end|>"]]
    write_json(os.path.join(folder, "generation_config.json"),
               {"bos_token_id": special["<|endoftext|>"], "eos_token_id": eos, "pad_token_id": special["<|endoftext|>"]})


def head_prompts(path: str, gsm8k_path: str, p, seed: int) -> tuple[str, dict]:
    """Prompts the target answers for the head's training data: GSM8K train questions in the
    benchmark's plain format and (a quarter of them) as chats, the first head_perturbed_prompts
    of them again head_perturbed_copies times with fresh numbers (answered as unseen questions
    are, not from memory), and openings of stdlib files."""
    rng = random.Random(seed)
    problems = corpus.read_gsm8k(gsm8k_path)[: p.head_gsm8k_prompts]
    questions = [pr["question"] for pr in problems]
    copies = p.head_perturbed_copies
    originals = questions[: p.head_perturbed_prompts]
    questions += [corpus.perturb_numbers(q, rng) for _ in range(copies) for q in originals]
    records = []
    for i, question in enumerate(questions):
        if i % 4 == 3:
            records.append({"messages": [{"role": "user", "content": question}]})
        else:
            records.append({"prompt": f"Question: {question}\nAnswer:"})
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
    fresh = min(p.head_perturbed_prompts, len(problems)) * copies
    return path, {"gsm8k": len(problems), "gsm8k_fresh_numbers": fresh, "code": len(records) - len(problems) - fresh}


def train_head(p, target_dir: str, data: dict, work: str, out: str, minutes: float, seed: int,
               aux_layers: list[int] | None = None) -> dict:
    """An EAGLE3 head on the target's own greedy answers; aux_layers are layer inputs (None: the
    default 2, N // 2, N - 3)."""
    shutil.rmtree(work, ignore_errors=True)
    os.makedirs(work)
    prompts, sources = head_prompts(os.path.join(work, "head_prompts.jsonl"), data["gsm8k"], p, seed)
    cfg = TrainConfig(target=target_dir, data=[prompts], out=work, regenerate=True,
                      regen_max_tokens=p.head_regen_tokens, regen_max_num_seqs=512, draft_vocab_size=p.draft_vocab_size,
                      ttt_steps=7, max_len=p.head_max_len, epochs=p.head_epochs, batch_size=p.head_batch,
                      lr=p.head_lr, time_budget_s=60 * minutes, eval_fraction=0.05, device=p.device,
                      seed=seed, warmup_ratio=0.05, aux_layer_ids=aux_layers)
    metrics = dict(train_eagle3(cfg), prompt_sources=sources)
    os.makedirs(out, exist_ok=True)
    for name in ("config.json", "model.safetensors"):
        shutil.copy(os.path.join(work, name), out)
    free_memory()
    return metrics


# ----------------------------------------------------------------------------------- families


def qwen3_family(args, data: dict, dirs: dict) -> dict:
    p, work = args.p, os.path.join(args.work, "qwen3")
    if args.reuse_lms:
        target, draft = data["previous"]["target"], data["previous"]["draft"]
    else:
        target = train_qwen3("target", p, data, dirs["target"], args.seed)
        draft = train_qwen3("draft", p, data, dirs["draft"], args.seed + 1)
    head = train_head(p, dirs["target"], data, os.path.join(work, "eagle3"), dirs["eagle3"], p.head_minutes, args.seed)
    prompts = gsm8k_test_prompts(p.measure_prompts)
    spec = dict(num_speculative_tokens=3)
    measured = measure_methods(dirs["target"], {
        "plain": None, "eagle3": {"method": "eagle3", "model": dirs["eagle3"], **spec},
        "draft_model": {"method": "draft_model", "model": dirs["draft"], **spec}, "ngram": {"method": "ngram", **spec},
    }, prompts, p.measure_tokens, p.device)
    measured["teacher_forced"] = teacher_forced(dirs["target"], dirs["eagle3"], prompts, p.measure_tokens, p.device, work)
    s = {"target": target, "draft": draft, "head": head, "measured": measured}
    write_qwen3_cards(dirs, s, data)
    return s


def write_qwen3_cards(dirs: dict, s: dict, data: dict) -> None:
    hw, c, measured = data["hardware"], data["corpus"], s["measured"]
    cards.write_card(dirs["target"], "qwen3-target (foretell default model family)", cards.qwen3_card("target", s["target"], c, hw))
    cards.write_card(dirs["draft"], "qwen3-draft (foretell default model family)", cards.qwen3_card("draft", s["draft"], c, hw) + [
        "", "## Measured acceptance (greedy, k=3, GSM8K test prompts)", "",
        *cards.drafter_lines(measured, "draft_model", "as the draft model of qwen3-target")])
    cards.write_card(dirs["eagle3"], "qwen3-eagle3 (foretell default model family)", cards.head_card(
        "qwen3-target", s["target"]["config"]["hidden_size"], s["head"], measured, hw))


def deepseek_family(args, data: dict, dirs: dict) -> dict:
    p, work = args.p, os.path.join(args.work, "deepseek")
    if args.reuse_lms:
        target = data["previous"]["ds_target"]
    else:
        target = train_deepseek(p, data, dirs["ds_target"], args.seed + 2)
    head = train_head(p, dirs["ds_target"], data, os.path.join(work, "eagle3"), dirs["ds_eagle3"], p.ds_head_minutes,
                      args.seed + 3, p.ds_head_aux_layers)
    prompts = gsm8k_test_prompts(p.measure_prompts)
    measured = measure_methods(dirs["ds_target"], {
        "plain": None, "mtp_k1": {"method": "mtp", "num_speculative_tokens": 1},
        "mtp": {"method": "mtp", "num_speculative_tokens": 3},
        "eagle3": {"method": "eagle3", "model": dirs["ds_eagle3"], "num_speculative_tokens": 3},
        "ngram": {"method": "ngram", "num_speculative_tokens": 3},
    }, prompts, p.measure_tokens, p.device)
    measured["teacher_forced"] = teacher_forced(dirs["ds_target"], dirs["ds_eagle3"], prompts, p.measure_tokens,
                                                p.device, work)
    s = {"ds_target": target, "ds_head": head, "ds_measured": measured}
    write_deepseek_cards(dirs, s, data)
    return s


def write_deepseek_cards(dirs: dict, s: dict, data: dict) -> None:
    hw, measured = data["hardware"], s["ds_measured"]
    cards.write_card(dirs["ds_target"], "deepseek-target (foretell default model family)",
                     cards.deepseek_card(s["ds_target"], data["corpus"], hw) + [
                         "", "## Measured acceptance of the MTP layer (greedy, GSM8K test prompts)", "",
                         *cards.drafter_lines(measured, "mtp_k1", "MTP, k=1"),
                         *cards.drafter_lines(measured, "mtp", "MTP, k=3 (the one layer reused for each step)")])
    cards.write_card(dirs["ds_eagle3"], "deepseek-eagle3 (foretell default model family)", cards.head_card(
        "deepseek-target (MLA + MoE)", s["ds_target"]["config"]["hidden_size"], s["ds_head"], measured, hw))


def main(argv=None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    args = parse_args(argv)
    p, t0 = args.p, time.time()
    if args.cards_only:
        return rewrite_cards(args.out, os.path.join(args.out, "recipe_metrics.json"))
    if p.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("the full recipe needs a CUDA GPU; use --smoke for a CPU run")
    os.makedirs(args.work, exist_ok=True)
    previous_path = os.path.join(args.out, "recipe_metrics.json")
    if args.reuse_lms:  # no corpus or tokenizer to build: the LMs are there
        previous = json.load(open(previous_path))
        data = {"gsm8k": corpus.find_gsm8k_train(args.gsm8k), "corpus": previous["corpus"], "previous": previous}
    else:
        data = prepare_data(args)
    data["hardware"] = torch.cuda.get_device_name() if p.device == "cuda" else "CPU"
    dirs = {role: os.path.join(args.out, name) for role, name in NAMES.items()}
    families = list(FAMILIES) if args.family == "all" else [args.family]
    for family in families:
        for role in FAMILIES[family]:
            if not (args.reuse_lms and role in LM_ROLES):
                shutil.rmtree(dirs[role], ignore_errors=True)
    run = {"hardware": data["hardware"], "commit": _commit(), "preset": vars(p), "family": args.family,
           "reuse_lms": args.reuse_lms}
    summary = {"corpus": data["corpus"], **run}
    background = None
    if families == list(FAMILIES) and p.device == "cuda" and not args.sequential:
        # The DeepSeek family in a second process, sharing the GPU and the prepared data.
        cmd = [sys.executable, os.path.abspath(__file__), "--family", "deepseek", "--child", "--out", args.out,
               "--work", args.work, "--seed", str(args.seed)] + [f"--set={s}" for s in args.set]
        cmd += ["--reuse-lms"] if args.reuse_lms else []
        background = subprocess.Popen(cmd)
        families = ["qwen3"]
    for family in families:
        result = qwen3_family(args, data, dirs) if family == "qwen3" else deepseek_family(args, data, dirs)
        summary.update(result)
        write_json(os.path.join(args.work, f"{family}_metrics.json"), result)
    if background is not None:
        code = background.wait()
        path = os.path.join(args.work, "deepseek_metrics.json")
        if code != 0 or not os.path.isfile(path):
            log.error("the DeepSeek family's process failed (exit %d)", code)
            summary["ds_error"] = f"exit {code}"
        else:
            summary.update(json.load(open(path)))
    summary["total_s"] = time.time() - t0
    if not args.child:
        if args.family != "all" and os.path.isfile(previous_path):
            # One family again: the other family's entries stay; each run is listed.
            merged = json.load(open(previous_path))
            runs = merged.pop("runs", [{k: merged.get(k) for k in ("hardware", "commit", "preset", "total_s")}])
            merged.update(summary)
            merged["runs"] = runs + [dict(run, total_s=summary["total_s"])]
            summary = merged
        write_json(os.path.join(args.work, "recipe_metrics.json"), summary)
        write_json(previous_path, summary)
    log.info("done in %.0f s; models in %s", summary["total_s"], args.out)
    print(json.dumps({"total_s": summary["total_s"], **{k: v for k, v in summary.items() if "measured" in k}},
                     indent=2, default=str))
    return 0 if "ds_error" not in summary else 1


def rewrite_cards(out: str, metrics_path: str) -> int:
    summary = json.load(open(metrics_path))
    dirs = {role: os.path.join(out, name) for role, name in NAMES.items()}
    data = {"hardware": summary["hardware"], "corpus": summary["corpus"]}
    for measured in ("measured", "ds_measured"):  # metrics written before the dtype was recorded
        summary[measured].setdefault("dtype", "float32" if summary["hardware"] == "CPU" else "bfloat16")
    write_qwen3_cards(dirs, summary, data)
    write_deepseek_cards(dirs, summary, data)
    log.info("cards rewritten in %s", out)
    return 0


def _commit() -> str | None:
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True).stdout.strip() or None
    except OSError:
        return None


def write_json(path: str, data) -> None:
    with open(path, "w") as f:
        json.dump(data, f, indent=2, default=str)
        f.write("\n")


if __name__ == "__main__":
    sys.exit(main())
