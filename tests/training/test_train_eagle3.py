"""foretell train-eagle3: the TTT mask, the training twin against the engine's head, data
formats and errors, the draft vocabulary, end to end on the tiny target (loss falls, the head
loads and keeps greedy output unchanged), resume, and teacher-forced vs online acceptance."""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import load_file

from foretell import LLM, SamplingParams
from foretell.cli import main
from foretell.spec_decode.proposer import catch_up_metadata
from foretell.training.checkpoint import save_head
from foretell.training.data import Example, ExampleBuilder, build_examples, read_records, split_eval
from foretell.training.evaluate import engine_walk
from foretell.training.head import Eagle3TrainHead, head_config
from foretell.training.trainer import TrainConfig, train_eagle3
from foretell.training.ttt import ttt_attention_mask, ttt_forward
from foretell.training.vocab import DraftVocab, build_draft_vocab

AUX = [1, 2, 3]  # inputs of layers 1..3 of the 4-layer tiny target
PROMPTS = [f"The cat reads the book {i}. A dog" for i in range(24)] + [
    "def add(x):\n    return x + 1\n", "Question: what is 3 plus 7? Answer:", "a b a b a b",
    "for i in range(len(values)):\n", "Our team builds the server.", "x += 1; y -= 2",
]
MAX_TOKENS = 40


def write_jsonl(path, records) -> str:
    with open(path, "w") as f:
        for r in records:
            f.write(json.dumps(r) + "\n")
    return str(path)


def tiny_config(target: str, out: str, data: list[str], **kw) -> TrainConfig:
    base = dict(target=target, data=data, out=out, draft_vocab_size=256, aux_layer_ids=AUX,
                ttt_steps=3, batch_size=8, lr=3e-3, progress=False, log_every=1, device="cpu")
    base.update(kw)
    return TrainConfig(**base)


@pytest.fixture(scope="module")
def prompt_file(tmp_path_factory) -> str:
    return write_jsonl(tmp_path_factory.mktemp("data") / "prompts.jsonl", [{"prompt": p} for p in PROMPTS])


@pytest.fixture(scope="module")
def trained(qwen3_checkpoint, prompt_file, tmp_path_factory):
    """A head trained on the target's own greedy continuations of PROMPTS (all of them)."""
    out = str(tmp_path_factory.mktemp("head"))
    cfg = tiny_config(qwen3_checkpoint, out, [prompt_file], regenerate=True, regen_max_tokens=MAX_TOKENS,
                      epochs=25, eval_fraction=0.0)
    return out, train_eagle3(cfg)


# --------------------------------------------------------------------------- TTT mask and twin


@pytest.mark.parametrize("seq_len, step", [(1, 0), (4, 0), (5, 1), (6, 3)])
def test_ttt_mask_matches_hand_built(seq_len, step):
    expected = torch.zeros(seq_len, (step + 1) * seq_len, dtype=torch.bool)
    for query in range(seq_len):
        for key_step in range(step + 1):
            for key in range(seq_len):
                # Step 0: the causal prefix; later steps: only the query's own chain.
                allowed = key <= query if key_step == 0 else key == query
                expected[query, key_step * seq_len + key] = allowed
    assert torch.equal(ttt_attention_mask(seq_len, step), expected)


def random_head(target: str, draft_vocab: int = 200, seed: int = 3) -> tuple[Eagle3TrainHead, DraftVocab]:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32)
    config = json.load(open(os.path.join(target, "config.json")))
    gen = torch.Generator().manual_seed(seed)
    vocab = DraftVocab(torch.sort(torch.randperm(config["vocab_size"], generator=gen)[:draft_vocab]).values)
    head = Eagle3TrainHead(head_config(config, vocab.size, tuple(AUX)), hf.model.embed_tokens.weight)
    head.set_vocab(vocab.d2t(), vocab.t2d(config["vocab_size"]))
    head.init_weights(None, std=0.15, seed=seed)
    with torch.no_grad():  # norms away from 1, so a swapped norm would show
        for name, p in head.named_parameters():
            if name.endswith("norm.weight"):
                p.add_(0.1 * torch.randn(p.shape, generator=gen))
    return head, vocab


def test_twin_equals_engine_head_along_the_ttt_chain(qwen3_checkpoint, tmp_path, monkeypatch):
    """Every TTT step of the twin equals the engine's head run as the engine runs it: catch-up
    over rows 0..t with the target's features, then chained single-row steps (the head's float32
    weights: not the CPU's fp16 packing, layers/cpu_draft_weights.py)."""
    monkeypatch.setenv("FORETELL_CPU_DRAFT_WEIGHTS", "fp32")
    from transformers import AutoModelForCausalLM

    head, vocab = random_head(qwen3_checkpoint)
    folder = save_head(head, str(tmp_path / "head"), torch.float32)
    llm = LLM(qwen3_checkpoint, dtype="float32", num_kv_blocks=32,
              speculative_config={"method": "eagle3", "model": folder, "num_speculative_tokens": 2})
    proposer = llm.engine.runner.proposer
    assert proposer.aux_hidden_state_layers == tuple(AUX)  # written as AUX - 1, read back + 1
    engine_head = proposer.head
    hf = AutoModelForCausalLM.from_pretrained(qwen3_checkpoint, dtype=torch.float32)
    ids = torch.tensor([[11, 42, 7, 99, 3, 250, 18, 64, 5, 77, 300, 12]])
    out = hf(ids, output_hidden_states=True)
    aux = torch.cat([out.hidden_states[i] for i in AUX], -1)
    K, L = 3, ids.shape[1]
    states = []
    original = head.step
    head.step = lambda *a: states.append(original(*a)) or states[-1]
    ttt_forward(head, aux, ids, torch.ones(1, L), out.logits[..., vocab.used], out.logits.argmax(-1), K)
    head.step = original
    table = torch.arange(4, dtype=torch.int32)[None]
    block = llm.engine.runner.cache_plan.block_size
    aux_list = [out.hidden_states[i][0] for i in AUX]
    with torch.no_grad():
        for t in range(L - K):
            meta = catch_up_metadata([0], [t + 1], table, block, proposer.draft_block_size)
            g = engine_head.combine([a[: t + 1] for a in aux_list])
            h = engine_head(ids[0, 1 : t + 2], torch.arange(t + 1), g, meta)
            torch.testing.assert_close(engine_head.compute_logits(h), head.compute_logits(states[0][0, : t + 1]),
                                       atol=1e-4, rtol=1e-4)
            state = h[-1:]
            for k in range(1, K):
                meta = catch_up_metadata([t + k], [1], table, block, proposer.draft_block_size)
                state = engine_head(ids[0, t + 1 + k : t + 2 + k], torch.tensor([t + k]), state, meta)
                torch.testing.assert_close(engine_head.compute_logits(state)[0],
                                           head.compute_logits(states[k][0, t]), atol=1e-4, rtol=1e-4)
    assert torch.equal(proposer.to_target_ids(torch.arange(vocab.size)), vocab.used)


# --------------------------------------------------------------------------------------- data


@pytest.fixture(scope="module")
def builder(qwen3_checkpoint):
    from transformers import AutoTokenizer

    return ExampleBuilder(AutoTokenizer.from_pretrained(qwen3_checkpoint), max_len=64)


def decode_masked(builder, example) -> str:
    return builder.tokenizer.decode([t for t, m in zip(example.input_ids, example.loss_mask) if m])


def test_record_formats_and_masks(builder, tmp_path):
    jsonl = write_jsonl(tmp_path / "d.jsonl", [
        "plain string record",
        {"text": "a text record"},
        {"prompt": "Question: what is 3 plus 7?", "response": " It is 10."},
        {"question": "What is 2 + 2?", "answer": "2+2=<<2+2=4>>4\n#### 4"},
        {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "the cat"},
                      {"role": "user", "content": "more"}, {"role": "assistant", "content": "a dog"}]},
        {"conversations": [{"from": "human", "value": "hello"}, {"from": "gpt", "value": "the data."}]},
    ])
    text_file = tmp_path / "notes.txt"
    text_file.write_text("x = 1\n" * 40)
    records = read_records([jsonl, str(text_file)])
    assert [r.kind for r in records] == ["text", "text", "completion", "completion", "chat", "chat", "text"]
    examples = [builder.examples(r) for r in records]
    assert all(all(e.loss_mask) for e in examples[0] + examples[1])
    assert decode_masked(builder, examples[2][0]) == " It is 10."
    assert records[3].prompt == "Question: What is 2 + 2?\nAnswer:"
    assert decode_masked(builder, examples[3][0]) == " 2+2=<<2+2=4>>4\n#### 4"
    # Assistant turns (with their end-of-turn token) only.
    assert decode_masked(builder, examples[4][0]) == "the cat<|im_end|>\na dog<|im_end|>\n"
    assert decode_masked(builder, examples[5][0]) == "the data.<|im_end|>\n"
    # A long plain text is cut into max_len pieces.
    assert len(examples[6]) > 1 and all(len(e.input_ids) <= 64 for e in examples[6])
    # --chat wraps prompt/response in the template; the prompt the target answers ends in the
    # generation prompt.
    chat = read_records([jsonl], chat=True)[2]
    assert chat.kind == "chat"
    prompt = builder.tokenizer.decode(builder.prompt_ids(chat))
    assert prompt == "<|im_start|>user\nQuestion: what is 3 plus 7?<|im_end|>\n<|im_start|>assistant\n"


@pytest.mark.parametrize("content, message", [
    ("", "has no records"),
    ("\n\n", "has no records"),
    ("{not json\n", "line 1: not valid JSON"),
    ('{"foo": 1}\n', "found none of the keys"),
    ('{"prompt": ""}\n', "prompt must be a non-empty string"),
    ('{"messages": []}\n', "non-empty list of turns"),
    ('{"conversations": [{"from": "robot", "value": "x"}]}\n', "unknown speaker"),
    ("[1, 2]\n", "expected a JSON object or string"),
])
def test_bad_data_errors(tmp_path, content, message):
    path = tmp_path / "bad.jsonl"
    path.write_text(content)
    with pytest.raises(ValueError, match=message):
        read_records([str(path)])


def test_missing_and_untrainable_data(builder, tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        read_records([str(tmp_path / "nope.jsonl")])
    with pytest.raises(ValueError, match="no --data"):
        read_records([])
    one_token = read_records([write_jsonl(tmp_path / "one.jsonl", [{"text": "a"}])])
    with pytest.raises(ValueError, match="no trainable tokens"):
        build_examples(one_token, builder)


def test_split_eval():
    items = list(range(20))
    train, held = split_eval(items, 0.25, seed=1)
    assert len(held) == 5 and sorted(train + held) == items
    assert split_eval(items, 0.25, seed=1) == (train, held)
    assert split_eval(items, 0.0, 0) == (items, [])
    with pytest.raises(ValueError, match="eval-fraction"):
        split_eval(items, 1.0, 0)


# ------------------------------------------------------------------------------------- vocab


def test_draft_vocab_most_frequent_then_fill():
    examples = [Example([5, 5, 5, 9, 9, 2, 7], [0, 1, 1, 1, 1, 1, 0])]  # counted: 5x2, 9x2, 2x1
    vocab = build_draft_vocab(examples, 4, 16)
    assert vocab.used.tolist() == [0, 2, 5, 9]  # 5, 9, 2, then the smallest unused id 0
    assert vocab.d2t().tolist() == [0, 1, 3, 6]
    t2d = vocab.t2d(16)
    assert t2d.sum() == 4 and t2d[vocab.used].all()
    assert build_draft_vocab(examples, 99, 16).used.tolist() == list(range(16))
    assert build_draft_vocab(examples, 2, 16).used.tolist() == [5, 9]  # ties: smaller id first
    with pytest.raises(ValueError, match="outside the target vocabulary"):
        build_draft_vocab([Example([1, 40], [1, 1])], 4, 16)


def test_engine_walk():
    # One sequence, prompt of 2 tokens, 10 tokens; k = 2. Matches at rows 1.. for steps 0, 1.
    match = torch.zeros(2, 1, 10, dtype=torch.bool)
    match[0, 0, 1] = match[1, 0, 1] = True  # row 1: both accepted -> next row 4
    match[0, 0, 4] = True  # row 4: one accepted -> next row 6; row 6: none -> row 7 (7 + 2 < 10)
    mask = torch.tensor([[0, 0] + [1] * 8])
    assert engine_walk(match, mask, torch.tensor([10]), 2) == (4, [2, 1])


# ------------------------------------------------------------------------------ end to end


def test_trainer_end_to_end(trained, qwen3_checkpoint, prompt_file):
    out, metrics = trained
    losses = [h["loss"] for h in metrics["loss_history"]]
    assert metrics["steps"] == 25 * 4 and min(losses[-5:]) < losses[0] - 0.5
    config = json.load(open(os.path.join(out, "config.json")))
    assert config["architectures"] == ["LlamaForCausalLMEagle3"]
    assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [i - 1 for i in AUX]
    assert config["draft_vocab_size"] == 256 and config["target_hidden_size"] == 64
    assert config["torch_dtype"] == "bfloat16" and config["rope_theta"] == 1000000
    state = load_file(os.path.join(out, "model.safetensors"))
    assert "embed_tokens.weight" not in state
    assert {k for k in state if not k.startswith("midlayer.")} == {"fc.weight", "norm.weight", "lm_head.weight", "d2t", "t2d"}
    assert state["fc.weight"].dtype == torch.bfloat16 and state["fc.weight"].shape == (64, 192)
    assert state["d2t"].dtype == torch.int64 and state["t2d"].dtype == torch.bool
    used = torch.arange(256) + state["d2t"]
    assert torch.all(used[1:] > used[:-1]) and state["t2d"].sum() == 256 and state["t2d"][used].all()
    # It loads in foretell and greedy output with it equals plain greedy.
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    plain = LLM(qwen3_checkpoint, dtype="float32", num_kv_blocks=64).generate(PROMPTS[-6:], params, use_tqdm=False)
    spec = LLM(qwen3_checkpoint, dtype="float32", num_kv_blocks=64, speculative_config={
        "method": "eagle3", "model": out, "num_speculative_tokens": 3})
    got = spec.generate(PROMPTS[-6:], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in plain]
    assert spec.get_stats()["num_accepted_tokens"] > 0


def test_teacher_forced_acceptance_vs_engine(trained, qwen3_checkpoint, prompt_file, capsys):
    """On the prompts it was trained on: teacher-forced acceptance > 0, and the replay of the
    engine's walk matches the engine's online acceptance (it differs only by the last drafts of
    each sequence, which run past the data)."""
    out, _ = trained
    tf = train_eagle3(tiny_config(qwen3_checkpoint, out, [prompt_file], regenerate=True,
                                  regen_max_tokens=MAX_TOKENS, eval_only=True))
    assert os.path.isfile(os.path.join(out, "eval_metrics.json"))
    llm = LLM(qwen3_checkpoint, dtype="float32", num_kv_blocks=128, speculative_config={
        "method": "eagle3", "model": out, "num_speculative_tokens": 3})
    llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS), use_tqdm=False)
    online = llm.get_stats()
    walk = tf["engine_walk"]
    with capsys.disabled():
        print(f"\nteacher-forced, all rows: {[round(a, 3) for a in tf['acceptance_per_position']]}"
              f"\nteacher-forced, engine walk: {[round(a, 3) for a in walk['acceptance_per_position']]} "
              f"({walk['num_drafts']} drafts)\nengine online: "
              f"{[round(a, 3) for a in online['acceptance_per_position']]} ({online['num_drafts']} drafts)")
    assert tf["acceptance_per_position"][0] > 0.05
    assert online["num_drafts"] - len(PROMPTS) <= walk["num_drafts"] <= online["num_drafts"]
    for a, b in zip(walk["acceptance_per_position"], online["acceptance_per_position"]):
        assert abs(a - b) < 0.03


def test_resume_continues_where_it_stopped(qwen3_checkpoint, prompt_file, tmp_path, monkeypatch):
    """A run killed after its step-3 checkpoint and resumed ends with the same weights as a run
    that was never interrupted."""
    import foretell.training.trainer as trainer

    data = [prompt_file]
    straight = train_eagle3(tiny_config(qwen3_checkpoint, str(tmp_path / "a"), data, max_steps=6, epochs=3))
    calls = []
    real = trainer.ttt_forward

    def dies_at_step_4(*args):
        calls.append(1)
        if len(calls) == 4:
            raise KeyboardInterrupt
        return real(*args)

    monkeypatch.setattr(trainer, "ttt_forward", dies_at_step_4)
    b = tiny_config(qwen3_checkpoint, str(tmp_path / "b"), data, max_steps=6, epochs=3, save_every=3)
    with pytest.raises(KeyboardInterrupt):
        train_eagle3(b)
    monkeypatch.setattr(trainer, "ttt_forward", real)
    b.resume = True
    resumed = train_eagle3(b)
    assert resumed["steps"] == straight["steps"] == 6
    assert [h["loss"] for h in resumed["loss_history"]] == pytest.approx([h["loss"] for h in straight["loss_history"]])
    a_state = load_file(str(tmp_path / "a" / "model.safetensors"))
    b_state = load_file(str(tmp_path / "b" / "model.safetensors"))
    for name in a_state:
        torch.testing.assert_close(a_state[name], b_state[name], atol=0, rtol=0)
    with pytest.raises(FileNotFoundError, match="nothing to resume"):
        train_eagle3(tiny_config(qwen3_checkpoint, str(tmp_path / "c"), data, max_steps=1, resume=True))


def test_cli(qwen3_checkpoint, prompt_file, tmp_path, capsys):
    out = str(tmp_path / "cli")
    args = ["train-eagle3", "--target", qwen3_checkpoint, "--data", prompt_file, "--out", out,
            "--draft-vocab-size", "300", "--max-steps", "2", "--ttt-steps", "2", "--device", "cpu",
            "--aux-layer-ids", "1", "2", "3", "--no-progress", "--save-every", "1", "--eval-fraction", "0.2"]
    assert main(args) == 0
    metrics = json.load(open(os.path.join(out, "train_metrics.json")))
    assert metrics["steps"] == 2 and len(metrics["eval"]["acceptance_per_position"]) == 2
    assert "teacher-forced acceptance per position" in capsys.readouterr().out
    bad = tmp_path / "empty.jsonl"
    bad.write_text("")
    assert main(args[:4] + [str(bad)] + args[5:]) == 2
    assert "has no records" in capsys.readouterr().err
    wrong_aux = args.copy()
    wrong_aux[wrong_aux.index("--aux-layer-ids") + 1] = "0"
    assert main(wrong_aux) == 2
    assert "aux layer ids" in capsys.readouterr().err


def test_teacher_forced_acceptance_in_bfloat16(trained, qwen3_checkpoint, prompt_file):
    """The evaluation casts a copy of the head to the engine's dtype (bfloat16 on GPUs)."""
    from foretell.training.checkpoint import head_from_state, load_head_state
    from foretell.training.evaluate import teacher_forced_acceptance
    from foretell.training.features import Batch, TargetFeatures

    out, _ = trained
    config, tensors = load_head_state(out)
    used = torch.arange(tensors["d2t"].numel()) + tensors["d2t"]
    features = TargetFeatures(qwen3_checkpoint, tuple(AUX), used, torch.device("cpu"), torch.bfloat16)
    head = head_from_state(config, tensors, features.embedding, "cpu")
    examples = [Example.from_json(json.loads(line)) for line in open(os.path.join(out, "regenerated.jsonl"))
                if "input_ids" in line][:8]
    metrics = teacher_forced_acceptance(head, features, [Batch.collate(examples, "cpu")], 3, torch.bfloat16)
    assert head.fc.weight.dtype == torch.float32  # the trained head itself is untouched
    assert metrics["acceptance_per_position"][0] > 0 and metrics["rows_per_position"][0] > 0
