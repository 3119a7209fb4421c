"""Llama-family models split over 2 tensor-parallel ranks (gloo, CPU, float32) against the same
model on one rank: each rank loads only its slices of the ordinary checkpoint, runs a varlen
prefill, a chunked continuation and decode steps over its paged KV cache, and must give the
one-rank logits (within float32 rounding: the row-parallel sums add in another order) and the
same greedy tokens, picked without gathering the logits.

Also in this process: which bytes the loader reads for a rank (safetensors slices only; .bin
tensors cut after reading), and the start-up errors for sizes the ranks cannot split.
"""

from __future__ import annotations

import os

import pytest
import torch

from fixtures import PagedRunner
from fixtures.checkpoints import _write_folder, qwen3_config, read_checkpoint, save_safetensors
from fixtures.tensor_parallel import fake_rank
from foretell.distributed.tensor_parallel import TensorParallel
from foretell.models import loading as model_loading
from foretell.models.base import HFConfig, ModelOptions
from foretell.models.registry import resolve_model_class
from foretell.ops.attention.reference import TorchAttentionBackend

FAMILIES = ["llama31", "qwen3", "qwen3_tied", "qwen2", "mistral", "llama2_bin"]
ATOL = 2e-5
GREEDY_MARGIN = 1e-4  # rows whose top two one-rank logits are closer may pick either


def prompt(length: int, seed: int) -> list[int]:
    return torch.randint(0, 448, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


FULL = {"a": prompt(9, 1), "b": prompt(6, 2), "c": prompt(3, 3)}
STEPS = [  # varlen prefill; a continuation beside a new prompt; two decode steps
    [("a", FULL["a"][:5]), ("b", FULL["b"][:6])],
    [("a", FULL["a"][5:8]), ("c", FULL["c"][:3]), ("b", [7])],
    [("a", FULL["a"][8:9]), ("b", [11]), ("c", [5])],
    [("a", [13]), ("c", [17])],
]


def build(folder: str, tp: TensorParallel) -> torch.nn.Module:
    options = ModelOptions(torch.float32, torch.device("cpu"), TorchAttentionBackend(), tensor_parallel=tp)
    return model_loading.build_model(folder, HFConfig.from_folder(folder), options)


@torch.no_grad()
def run_steps(tp: TensorParallel, folder: str) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(logits [T, vocab], greedy tokens [T]) of every step."""
    model = build(folder, tp)
    runner = PagedRunner(model, num_blocks=32, block_size=4)
    out = []
    for chunks in STEPS:
        ids, positions, metadata = runner.metadata(chunks)
        hidden, _ = model(ids, positions, metadata)
        out.append((model.compute_logits(hidden), model.compute_greedy_tokens(hidden)))
    return out


def run_families(tp: TensorParallel, folders: dict[str, str]) -> dict[str, list]:
    return {name: run_steps(tp, folder) for name, folder in folders.items()}


@pytest.fixture(scope="module")
def kv1_checkpoint(tmp_path_factory, tokenizer_dir) -> str:
    """Qwen3 layout with one KV head: each of the 2 ranks holds it whole (replicated)."""
    config = {**qwen3_config(), "num_key_value_heads": 1, "num_hidden_layers": 2}
    return _write_folder(str(tmp_path_factory.mktemp("kv1")), config, tokenizer_dir, 5, save_safetensors)


@pytest.fixture(scope="module")
def folders(request, kv1_checkpoint) -> dict[str, str]:
    found = {name: request.getfixturevalue(f"{name}_checkpoint") for name in FAMILIES}
    return {**found, "qwen3_kv1": kv1_checkpoint}


@pytest.fixture(scope="module")
def sharded(tp_ranks, folders) -> list[dict[str, list]]:
    return tp_ranks.run(run_families, folders)


@pytest.mark.parametrize("family", FAMILIES + ["qwen3_kv1"])
def test_two_ranks_match_one(family, folders, sharded):
    single = run_steps(TensorParallel(), folders[family])
    for step, (want_logits, want_greedy) in enumerate(single):
        assert torch.equal(want_greedy, want_logits.argmax(-1))  # the one-rank path is argmax
        top2 = want_logits.topk(2, dim=-1).values
        clear = (top2[:, 0] - top2[:, 1]) > GREEDY_MARGIN
        for rank, results in enumerate(sharded):
            logits, greedy = results[family][step]
            assert logits.shape == want_logits.shape, (family, step, rank)
            torch.testing.assert_close(logits, want_logits, rtol=0, atol=ATOL, msg=f"{family} step {step} rank {rank}")
            assert torch.equal(greedy, logits.argmax(-1)), (family, step, rank)  # no gather, same pick
            assert torch.equal(greedy[clear], want_greedy[clear]), (family, step, rank)
        assert torch.equal(sharded[0][family][step][1], sharded[1][family][step][1])  # every rank agrees


# ------------------------------------------------------------------------- loading, in-process


class RecordingSafeOpen:
    """safetensors.safe_open that records which keys were read whole."""

    def __init__(self, real, whole: list[str]):
        self.real, self.whole = real, whole

    def __call__(self, *args, **kwargs):
        recorder = self

        class Handle:
            def __init__(self, handle):
                self.handle = handle

            def __enter__(self):
                self.inner = self.handle.__enter__()
                return self

            def __exit__(self, *exc):
                return self.handle.__exit__(*exc)

            def get_tensor(self, key):
                recorder.whole.append(key)
                return self.inner.get_tensor(key)

            def __getattr__(self, name):
                return getattr(self.inner, name)

        return Handle(recorder.real(*args, **kwargs))


def whole_checkpoint(folder: str) -> dict[str, torch.Tensor]:
    state = {}
    for _, tensors in read_checkpoint(folder).values():
        state.update(tensors)
    return state


@pytest.mark.parametrize("family", ["qwen3", "llama2_bin"])
def test_each_rank_loads_its_slices(family, request, monkeypatch):
    import safetensors

    folder = request.getfixturevalue(f"{family}_checkpoint")
    whole = whole_checkpoint(folder)
    read_whole: list[str] = []
    monkeypatch.setattr(safetensors, "safe_open", RecordingSafeOpen(safetensors.safe_open, read_whole))
    q = whole["model.layers.0.self_attn.q_proj.weight"].float()  # [heads * head_dim, hidden]
    k = whole["model.layers.0.self_attn.k_proj.weight"].float()
    o = whole["model.layers.1.self_attn.o_proj.weight"].float()  # [hidden, heads * head_dim]
    up = whole["model.layers.1.mlp.up_proj.weight"].float()
    embed = whole["model.embed_tokens.weight"].float()  # [vocab, hidden]
    vocab = embed.shape[0]
    for rank in range(2):
        model = build(folder, fake_rank(rank, 2))
        layer0, layer1 = model.model.layers[0], model.model.layers[1]
        qkv = layer0.self_attn.qkv_proj
        q_rows, kv_rows = q.shape[0] // 2, k.shape[0] // 2
        assert torch.equal(qkv.weight[:q_rows], q[rank * q_rows:(rank + 1) * q_rows])
        assert torch.equal(qkv.weight[q_rows:q_rows + kv_rows], k[rank * kv_rows:(rank + 1) * kv_rows])
        cols = o.shape[1] // 2
        assert torch.equal(layer1.self_attn.o_proj.weight, o[:, rank * cols:(rank + 1) * cols])
        rows = up.shape[0] // 2
        gate_up = layer1.mlp.gate_up_proj.weight
        assert torch.equal(gate_up[rows:], up[rank * rows:(rank + 1) * rows])
        start, held, real = fake_rank(rank, 2).padded_shard(vocab)
        assert torch.equal(model.model.embed_tokens.weight[:real], embed[start:start + real])
        assert torch.equal(model.model.norm.weight, whole["model.norm.weight"].float())  # replicated
    if family == "qwen3":  # safetensors: the split tensors were read as slices, never whole
        split = [key for key in read_whole if key.endswith(("proj.weight", "embed_tokens.weight", "lm_head.weight"))]
        assert split == [] and any(key.endswith("norm.weight") for key in read_whole)


def test_a_misshapen_checkpoint_tensor_is_reported_before_cutting(qwen3_checkpoint, tmp_path):
    from fixtures.checkpoints import make_variant
    from foretell.loader import CheckpointError

    key = "model.layers.0.self_attn.q_proj.weight"
    shape = whole_checkpoint(qwen3_checkpoint)[key].shape
    bad = make_variant(qwen3_checkpoint, str(tmp_path / "bad"), reshape={key: (shape[0] // 2, shape[1])})
    with pytest.raises(CheckpointError, match=rf"{key}.*expected size {shape[0]} along dim 0.*found shape"):
        build(bad, fake_rank(0, 2))


# ----------------------------------------------------------------------------- start-up errors


def test_heads_and_intermediate_size_must_divide(llama31_checkpoint):
    config = HFConfig.from_folder(llama31_checkpoint)  # 4 heads, intermediate_size 128
    options = ModelOptions(torch.float32, torch.device("cpu"), TorchAttentionBackend(), tensor_parallel=fake_rank(0, 3))
    with pytest.raises(ValueError) as error:
        resolve_model_class(config)(config, options)
    message = str(error.value)
    assert "config.json" in message and "tensor_parallel_size = 3" in message
    assert "num_attention_heads = 4" in message and "intermediate_size = 128" in message


def test_kv_heads_must_split_or_replicate(llama31_checkpoint):
    data = {**HFConfig.from_folder(llama31_checkpoint).to_dict(), "num_attention_heads": 6,
            "num_key_value_heads": 3, "hidden_size": 48}
    config = HFConfig(data, os.path.join("some", "config.json"))
    options = ModelOptions(torch.float32, torch.device("cpu"), TorchAttentionBackend(), tensor_parallel=fake_rank(1, 2))
    with pytest.raises(ValueError, match=r"some/config.json: num_key_value_heads = 3 is not divisible by tensor_parallel_size = 2"):
        resolve_model_class(config)(config, options)


def test_models_not_yet_split_say_so(llama31_checkpoint):
    from foretell.models.base import CausalLM

    class NotSplitYet(CausalLM):  # a model class that has not declared supports_tensor_parallel
        pass

    config = HFConfig(HFConfig.from_folder(llama31_checkpoint).to_dict(), "some/config.json")
    options = ModelOptions(torch.float32, torch.device("cpu"), TorchAttentionBackend(), tensor_parallel=fake_rank(0, 2))
    with pytest.raises(ValueError, match=r"NotSplitYet \(some/config.json\) does not run tensor-parallel yet"):
        NotSplitYet(config, options)
    NotSplitYet(config, ModelOptions(torch.float32, torch.device("cpu"), TorchAttentionBackend()))  # one rank: fine
