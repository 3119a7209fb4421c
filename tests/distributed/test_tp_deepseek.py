"""DeepSeek-V3 (with its MTP layer), the Kimi-K2.5 layout and DeepSeek-V2-Lite (no q LoRA, two
shared experts) split over 2 ranks (gloo, CPU, float32), tensor parallel inside each expert and
expert parallel, against the same models on one rank.

Each rank loads its slices of the ordinary checkpoint, runs a varlen prefill, a chunked
continuation and decode steps over its paged latent cache, then the MTP layer over the target's
hidden states; logits must equal the one-rank logits within float32 rounding (the sums over ranks
add in another order) and the greedy tokens (picked without gathering the logits) must be the
one-rank argmax. Also, in this process: which slices a rank loads (its experts only under
expert parallelism, never reading the others'), and the start-up errors for sizes that do not
divide.
"""

from __future__ import annotations

import re

import pytest
import torch

from fixtures import PagedRunner
from fixtures import deepseek as ds
from fixtures.tensor_parallel import fake_rank
from foretell.distributed.tensor_parallel import TensorParallel
from foretell.loader import load_weights
from foretell.models import loading as model_loading
from foretell.models.base import HFConfig, ModelOptions
from foretell.models.mtp import DeepseekMTP
from foretell.models.registry import resolve_model_class
from foretell.ops.attention.reference import TorchAttentionBackend

MODELS = {"v3": "", "kimi_k25": None, "v2_lite": None}  # name -> MTP prefix (None: no MTP layers)
MODES = ["tp", "ep"]
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


def options_for(tp: TensorParallel, mode: str) -> ModelOptions:
    return ModelOptions(torch.float32, torch.device("cpu"), TorchAttentionBackend(), tensor_parallel=tp,
                        expert_parallel=mode == "ep")


def build(folder: str, tp: TensorParallel, mode: str = "tp") -> torch.nn.Module:
    return model_loading.build_model(folder, HFConfig.from_folder(folder), options_for(tp, mode))


def build_mtp(folder: str, target: torch.nn.Module, prefix: str, tp: TensorParallel, mode: str) -> DeepseekMTP:
    config = HFConfig.from_folder(folder).language_model()
    mtp = DeepseekMTP(config, options_for(tp, mode), prefix)
    load_weights(mtp, folder)
    mtp.share_embedding(target.get_input_embeddings())
    return mtp.eval()


@torch.no_grad()
def run_steps(tp: TensorParallel, folder: str, mode: str, mtp_prefix: str | None) -> list[dict]:
    """Per step: the target's logits [T, vocab] and greedy tokens [T], and the MTP layer's (fed
    the target's hidden states and the step's tokens shifted by one)."""
    model = build(folder, tp, mode)
    runner = PagedRunner(model, num_blocks=32, block_size=4)
    mtp = build_mtp(folder, model, mtp_prefix, tp, mode) if mtp_prefix is not None else None
    mtp_runner = PagedRunner(mtp, num_blocks=32, block_size=4) if mtp is not None else None
    out = []
    for chunks in STEPS:
        ids, positions, metadata = runner.metadata(chunks)
        hidden, _ = model(ids, positions, metadata)
        step = {"logits": model.compute_logits(hidden), "greedy": model.compute_greedy_tokens(hidden)}
        if mtp is not None:
            _, _, mtp_metadata = mtp_runner.metadata(chunks)
            state = mtp.step(0, positions, ids.roll(-1), hidden, mtp_metadata)
            step["mtp_logits"] = mtp.compute_logits(0, state)
            step["mtp_greedy"] = mtp.compute_greedy_tokens(0, state)
        out.append(step)
    return out


def run_all(tp: TensorParallel, folders: dict[str, str]) -> dict[tuple[str, str], list[dict]]:
    return {(name, mode): run_steps(tp, folders[name], mode, MODELS[name]) for name in MODELS for mode in MODES}


@pytest.fixture(scope="module")
def folders(checkpoint_root, tokenizer_dir) -> dict[str, str]:
    return {name: ds.checkpoint(checkpoint_root, tokenizer_dir, name) for name in MODELS}


@pytest.fixture(scope="module")
def single(folders) -> dict[str, list[dict]]:
    return {name: run_steps(TensorParallel(), folders[name], "tp", MODELS[name]) for name in MODELS}


@pytest.fixture(scope="module")
def sharded(tp_ranks, folders) -> list[dict]:
    return tp_ranks.run(run_all, folders)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", list(MODELS))
def test_two_ranks_match_one(name, mode, single, sharded):
    heads = ["", "mtp_"] if MODELS[name] is not None else [""]
    for step, want in enumerate(single[name]):
        for head in heads:
            want_logits, want_greedy = want[head + "logits"], want[head + "greedy"]
            assert torch.equal(want_greedy, want_logits.argmax(-1))  # the one-rank path is argmax
            top2 = want_logits.topk(2, dim=-1).values
            clear = (top2[:, 0] - top2[:, 1]) > GREEDY_MARGIN
            for rank, results in enumerate(sharded):
                got = results[(name, mode)][step]
                logits, greedy = got[head + "logits"], got[head + "greedy"]
                what = f"{name} {mode} {head or 'target'} step {step} rank {rank}"
                assert logits.shape == want_logits.shape, what
                torch.testing.assert_close(logits, want_logits, rtol=0, atol=ATOL, msg=what)
                assert torch.equal(greedy, logits.argmax(-1)), what  # no gather, the same pick
                assert torch.equal(greedy[clear], want_greedy[clear]), what
            assert torch.equal(sharded[0][(name, mode)][step][head + "greedy"],
                               sharded[1][(name, mode)][step][head + "greedy"])  # every rank agrees


# ------------------------------------------------------------------------- loading, in-process


def whole_state(folder: str) -> dict[str, torch.Tensor]:
    from fixtures.checkpoints import read_checkpoint

    state = {}
    for _, tensors in read_checkpoint(folder).values():
        state.update({key: tensor.float() for key, tensor in tensors.items()})
    return state


def test_each_rank_holds_its_heads_and_expert_slices(folders):
    folder = folders["v3"]
    whole = whole_state(folder)
    inter = 32  # moe_intermediate_size
    layer = "model.layers.1."
    for rank in range(2):
        model = build(folder, fake_rank(rank, 2))
        attn, mlp = model.model.layers[1].self_attn, model.model.layers[1].mlp
        assert attn.dims.num_heads == 2 and attn.attn.num_heads == 2
        rows = whole[layer + "self_attn.q_b_proj.weight"].shape[0] // 2
        assert torch.equal(attn.q_b_proj.weight, whole[layer + "self_attn.q_b_proj.weight"][rank * rows:(rank + 1) * rows])
        cols = whole[layer + "self_attn.o_proj.weight"].shape[1] // 2
        assert torch.equal(attn.o_proj.weight, whole[layer + "self_attn.o_proj.weight"][:, rank * cols:(rank + 1) * cols])
        assert torch.equal(attn.fused_qkv_a_proj.weight[48:], whole[layer + "self_attn.kv_a_proj_with_mqa.weight"])
        part = slice(rank * inter // 2, (rank + 1) * inter // 2)
        gate_up, down = mlp.experts.gate_up_proj, mlp.experts.down_proj  # [8 + 1, 2 * 16, H], [9, H, 16]
        assert gate_up.shape[:2] == (9, inter)
        for e in (0, 5):
            assert torch.equal(gate_up[e, :16], whole[f"{layer}mlp.experts.{e}.gate_proj.weight"][part])
            assert torch.equal(gate_up[e, 16:], whole[f"{layer}mlp.experts.{e}.up_proj.weight"][part])
            assert torch.equal(down[e], whole[f"{layer}mlp.experts.{e}.down_proj.weight"][:, part])
        assert torch.equal(gate_up[8, 16:], whole[f"{layer}mlp.shared_experts.up_proj.weight"][part])
        assert torch.equal(down[8], whole[f"{layer}mlp.shared_experts.down_proj.weight"][:, part])
        dense = model.model.layers[0].mlp  # first_k_dense_replace 1: a column/row-parallel MLP
        rows = whole["model.layers.0.mlp.gate_proj.weight"].shape[0] // 2
        assert torch.equal(dense.gate_up_proj.weight[:rows], whole["model.layers.0.mlp.gate_proj.weight"][rank * rows:(rank + 1) * rows])


def test_two_shared_experts_split_into_contiguous_parts(folders):
    """V2-Lite's shared MLP (2 x 32 wide): rank r holds its 32 contiguous rows, cut into two packed
    experts of 16; no q LoRA: the q rows of its heads beside the whole kv_a."""
    folder = folders["v2_lite"]
    whole = whole_state(folder)
    layer = "model.layers.1."
    shared_gate = whole[layer + "mlp.shared_experts.gate_proj.weight"]  # [64, H]
    q = whole[layer + "self_attn.q_proj.weight"]  # [4 heads * 24, H]
    for rank in range(2):
        model = build(folder, fake_rank(rank, 2))
        gate_up = model.model.layers[1].mlp.experts.gate_up_proj  # [8 + 2, 2 * 16, H]
        mine = shared_gate[rank * 32:(rank + 1) * 32]
        assert torch.equal(gate_up[8, :16], mine[:16]) and torch.equal(gate_up[9, :16], mine[16:])
        fused = model.model.layers[1].self_attn.fused_qkv_a_proj.weight
        assert torch.equal(fused[:48], q[rank * 48:(rank + 1) * 48])
        assert torch.equal(fused[48:], whole[layer + "self_attn.kv_a_proj_with_mqa.weight"])


def test_expert_parallel_reads_only_its_experts(folders, monkeypatch):
    import safetensors

    folder = folders["v3"]
    whole = whole_state(folder)
    read: list[str] = []

    class Recording:
        def __init__(self, real):
            self.real = real

        def __call__(self, *args, **kwargs):
            handle = self.real(*args, **kwargs)

            class Wrapped:
                def __enter__(self_inner):
                    self_inner.inner = handle.__enter__()
                    return self_inner

                def __exit__(self_inner, *exc):
                    return handle.__exit__(*exc)

                def get_tensor(self_inner, key):
                    read.append(key)
                    return self_inner.inner.get_tensor(key)

                def get_slice(self_inner, key):
                    read.append(key)
                    return self_inner.inner.get_slice(key)

                def __getattr__(self_inner, name):
                    return getattr(self_inner.inner, name)

            return Wrapped()

    monkeypatch.setattr(safetensors, "safe_open", Recording(safetensors.safe_open))
    layer = "model.layers.2."
    for rank in range(2):
        read.clear()
        model = build(folder, fake_rank(rank, 2), "ep")
        mlp = model.model.layers[2].mlp
        assert mlp.experts.gate_up_proj.shape[:2] == (4, 64)  # experts 4r .. 4r+3, whole
        for local in range(4):
            e = 4 * rank + local
            assert torch.equal(mlp.experts.gate_up_proj[local, :32], whole[f"{layer}mlp.experts.{e}.gate_proj.weight"])
            assert torch.equal(mlp.experts.down_proj[local], whole[f"{layer}mlp.experts.{e}.down_proj.weight"])
        rows = slice(rank * 16, (rank + 1) * 16)
        assert torch.equal(mlp.shared_experts.gate_up_proj.weight[16:], whole[layer + "mlp.shared_experts.up_proj.weight"][rows])
        assert torch.equal(mlp.shared_experts.down_proj.weight, whole[layer + "mlp.shared_experts.down_proj.weight"][:, rows])
        experts_read = {int(m.group(1)) for key in read if (m := re.search(r"\.experts\.(\d+)\.", key))}
        assert experts_read == set(range(4 * rank, 4 * rank + 4))


# ----------------------------------------------------------------------------- start-up errors


def test_sizes_that_do_not_divide_are_named():
    config = HFConfig(ds.v3_config(), "deepseek/config.json")  # 4 heads, 8 experts, I 96 / 32
    with pytest.raises(ValueError) as error:
        resolve_model_class(config)(config, options_for(fake_rank(0, 3), "tp"))
    message = str(error.value)
    assert message.startswith("deepseek/config.json: tensor_parallel_size = 3 does not divide")
    assert "num_attention_heads = 4" in message and "moe_intermediate_size = 32" in message
    assert " intermediate_size" not in message  # 96 divides
    data = {**ds.v3_config(), "n_routed_experts": 6, "num_attention_heads": 8, "n_group": 2,
            "moe_intermediate_size": 24}
    config = HFConfig(data, "deepseek/config.json")
    resolve_model_class(config)(config, options_for(fake_rank(0, 4), "tp"))  # 24 / 4: inside experts is fine
    with pytest.raises(ValueError, match=r"tensor_parallel_size = 4 does not divide n_routed_experts = 6"):
        resolve_model_class(config)(config, options_for(fake_rank(0, 4), "ep"))


def test_kimi_k25_layout_names_its_text_config():
    config = HFConfig({"architectures": ["KimiK25ForConditionalGeneration"], "text_config": ds.kimi_k25_text_config()},
                      "kimi/config.json")
    with pytest.raises(ValueError, match=r"kimi/config.json:text_config: tensor_parallel_size = 8 does not divide "
                                         r"num_attention_heads = 4"):
        resolve_model_class(config)(config, options_for(fake_rank(0, 8), "ep"))
