"""Model cards (README.md) for the default family's folders, written by the recipe from what it
measured: architecture and sizes, data, how each member was trained, measured acceptance."""

from __future__ import annotations

import os

DATA_AND_LICENSE = (
    "Trained from scratch on the Python standard library's source (Python Software Foundation License) "
    "and GSM8K train (MIT, github.com/openai/grade-school-math). Rebuild with "
    "`python -m recipes.default_models.train` (see its docstring).")


def write_card(folder: str, title: str, body: list[str]) -> None:
    sizes = {f: os.path.getsize(os.path.join(folder, f)) for f in sorted(os.listdir(folder)) if f != "README.md"}
    lines = [f"# {title}", "", *body, "", "## Files", ""]
    lines += [f"- `{name}`: {size / 2**20:.2f} MiB" for name, size in sizes.items()]
    lines += ["", "## Data and license", "", DATA_AND_LICENSE, ""]
    with open(os.path.join(folder, "README.md"), "w") as f:
        f.write("\n".join(lines))


def corpus_line(corpus: dict) -> str:
    return (f"- corpus: {corpus['stdlib_files']} standard-library files of Python {corpus['python']} "
            f"({corpus['stdlib_chars'] / 1e6:.1f}M characters) + GSM8K train ({corpus['gsm8k_problems']} problems, "
            f"plain `Question: ...\\nAnswer: ...` and ChatML), {corpus['train_tokens'] / 1e6:.2f}M tokens")


def training_lines(stats: dict, hardware: str) -> list[str]:
    o = stats["options"]
    lines = [f"- {stats['steps']} steps of {o['batch_size']} x {o['seq_len']} tokens ({stats['tokens_seen'] / 1e6:.0f}M "
             f"tokens), AdamW lr {o['lr']} cosine, {stats['train_time_s']:.0f} s on {hardware}",
             f"- final train loss {stats['final_train_loss']:.3f}, held-out loss {stats.get('eval_loss', float('nan')):.3f}"]
    return lines


def qwen3_card(role: str, stats: dict, corpus: dict, hardware: str) -> list[str]:
    c = stats["config"]
    return [
        f"The {role} of foretell's default model family: a Qwen3-layout causal LM (`Qwen3ForCausalLM`, tied "
        "embeddings), bfloat16 safetensors, byte-level BPE tokenizer with a ChatML chat template.", "",
        "## Architecture", "",
        f"- {stats['parameters'] / 1e6:.2f}M parameters: hidden {c['hidden_size']}, {c['num_hidden_layers']} layers, "
        f"{c['num_attention_heads']} query / {c['num_key_value_heads']} KV heads of {c['head_dim']}, "
        f"MLP {c['intermediate_size']}, vocabulary {c['vocab_size']}, RoPE theta {c['rope_theta']:g}", "",
        "## Training", "", corpus_line(corpus), *training_lines(stats, hardware),
    ]


def deepseek_card(stats: dict, corpus: dict, hardware: str) -> list[str]:
    c = stats["config"]
    return [
        "The MLA + MoE target of foretell's default model family: the DeepSeek-V3 layout "
        "(`DeepseekV3ForCausalLM`) with one multi-token-prediction layer (`model.layers."
        f"{c['num_hidden_layers']}`, DeepSeek-V3's MTP: enorm/hnorm/eh_proj, a full MLA + MoE block, "
        "shared_head), bfloat16 safetensors (router biases float32), the family's BPE tokenizer.", "",
        "## Architecture", "",
        f"- {stats['parameters'] / 1e6:.2f}M parameters with the MTP layer: hidden {c['hidden_size']}, "
        f"{c['num_hidden_layers']} layers ({c['first_k_dense_replace']} dense, MLP {c['intermediate_size']}), "
        f"MLA with {c['num_attention_heads']} heads (q_lora {c['q_lora_rank']}, kv_lora {c['kv_lora_rank']}, "
        f"qk {c['qk_nope_head_dim']}+{c['qk_rope_head_dim']} rope, v {c['v_head_dim']}), MoE with "
        f"{c['n_routed_experts']} routed experts of {c['moe_intermediate_size']} (top {c['num_experts_per_tok']}, "
        f"{c['n_group']} groups keep {c['topk_group']}, sigmoid + bias noaux_tc) + {c['n_shared_experts']} shared, "
        f"vocabulary {c['vocab_size']}, untied output head", "",
        "## Training", "", corpus_line(corpus), *training_lines(stats, hardware),
        f"- joint MTP loss (weight {stats['mtp_weight']}): held-out MTP loss {stats.get('eval_mtp_loss', float('nan')):.3f}; "
        f"the MTP layer's argmax equals the main model's next argmax on "
        f"{100 * stats.get('eval_mtp_acceptance', float('nan')):.1f}% of held-out positions (teacher-forced)",
        "- experts balanced without an auxiliary loss (router bias updates, as in DeepSeek-V3)",
    ]


def head_card(target_name: str, target_hidden: int, head: dict, measured: dict, hardware: str) -> list[str]:
    ev, tf, online = head.get("eval", {}), measured["teacher_forced"], measured["eagle3"]
    return [
        f"An EAGLE3 draft head for {target_name} (`LlamaForCausalLMEagle3`, one Llama layer, EAGLE/AngelSlim "
        "layout: `midlayer.*`, no embed_tokens, the target's embedding is shared).", "",
        "## Architecture", "",
        f"- hidden {target_hidden}, draft vocabulary {head['draft_vocab_size']} (d2t / t2d), aux hidden states: "
        f"inputs of target layers {head['aux_layer_ids']} (config ids {[i - 1 for i in head['aux_layer_ids']]}, "
        "SpecForge's 'output of layer j' convention)", "",
        "## Training", "",
        f"- `foretell train-eagle3 --regenerate`: the target's own greedy answers to "
        f"{head['num_train_examples'] + head['num_eval_examples']} prompts ({prompt_sources(head)})",
        f"- training-time test with 7 steps, {head['steps']} steps, {head['train_time_s']:.0f} s on {hardware}, "
        f"final loss {head['final_loss']:.3f}",
        f"- held-out teacher-forced acceptance per position: {fmt(ev.get('acceptance_per_position', []))}", "",
        "## Measured acceptance (greedy, k=3, GSM8K test prompts)", "",
        f"- online (engine): mean acceptance length {online['mean_acceptance_length']:.2f}, per position "
        f"{fmt(online['acceptance_per_position'])}; {equal_line(measured, 'eagle3')}",
        f"- teacher-forced, replaying the engine's walk: {fmt(tf['engine_walk']['acceptance_per_position'])}; "
        f"over all rows: {fmt(tf['acceptance_per_position'][:3])}",
    ]


def prompt_sources(head: dict) -> str:
    counts = head.get("prompt_sources")
    if counts is None:  # recorded since the fresh-number questions were added
        return "GSM8K train questions, plain and chat, and openings of standard-library files"
    fresh = counts["gsm8k_fresh_numbers"]
    fresh = f", asked {fresh} more times with fresh numbers" if fresh else ""
    code = f"{counts['code']} openings" if counts.get("code") is not None else "openings"
    return f"{counts['gsm8k']} GSM8K train questions, plain and chat{fresh}, and {code} of standard-library files"


def drafter_lines(measured: dict, method: str, what: str) -> list[str]:
    m = measured.get(method, {})
    if "mean_acceptance_length" not in m:
        return [f"- {what}: not measured ({m.get('error', 'absent')})"]
    return [f"- {what}: mean acceptance length {m['mean_acceptance_length']:.2f}, per position "
            f"{fmt(m['acceptance_per_position'])}; {equal_line(measured, method)}"]


def equal_line(measured: dict, method: str) -> str:
    n = measured["prompts"]
    line = f"greedy output identical to plain greedy on {n - measured[method]['greedy_mismatch_prompts']} of {n} prompts"
    if measured.get("dtype") == "bfloat16":
        line += " (bfloat16: near-tied logits flip some greedy tokens; in float32 every output is identical, as the tests check)"
    return line


def fmt(values) -> str:
    return " / ".join(f"{v:.3f}" for v in values)
