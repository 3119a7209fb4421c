"""EAGLE3 heads split over the target's tensor-parallel ranks (speculative_config
draft_tensor_parallel_size = tensor_parallel_size; models/eagle3.py, eagle3_mla.py).

Over 2 ranks (worker processes, gloo, CPU, float32): the engine with a sharded head gives the
tokens one rank gives without speculation, token for token, and the drafts and their acceptance
equal one rank's with the same (whole) head: the Qwen3 fixture with its EAGLE-layout head (own
lm_head over a 256-token draft vocabulary), the SpecForge-layout head (own embed_tokens, the full
vocabulary), and the DeepSeek-V3 fixture with an EAGLE3-MLA head; greedy runs gather no logits.

In this process (fake ranks: construction and loading need no collective): each rank holds
about half the head's parameter bytes, and its slices are the right parts of the checkpoint
(checked against the one-rank head's tensors); sizes that do not split and a
draft_tensor_parallel_size other than 1 or the target's give clear errors.
"""

from __future__ import annotations

import os

import pytest
import torch

from fixtures import deepseek as ds
from fixtures.tensor_parallel import fake_rank
from foretell import LLM, SamplingParams
from foretell.config import SpeculativeConfig, build_engine_config
from foretell.distributed.tensor_parallel import TensorParallel
from foretell.loader import load_weights
from foretell.models.base import HFConfig, ModelOptions
from foretell.models.eagle3 import Eagle3Head
from foretell.models.eagle3_mla import Eagle3MLAHead
from foretell.ops.attention.reference import TorchAttentionBackend

PROMPTS = [[5, 17, 250, 3, 99, 41, 7], [300, 12, 8, 8, 61, 2, 19, 77, 140, 33], [44], [9, 9, 9, 9, 9, 9]]
MAX_TOKENS = 10
ROOMY = dict(num_kv_blocks=64)
DRAFT_STATS = ("num_drafts", "num_draft_tokens", "num_accepted_tokens", "accepted_per_position")


def greedy() -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)


def draft_bytes_per_token(llm: LLM) -> int:
    return llm.engine.runner.describe().cache_plan.draft_bytes_per_token  # rank 0's under TP


def run(llm: LLM) -> tuple[list[list[int]], dict]:
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], greedy(), use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs], llm.get_stats()


@pytest.fixture(scope="module")
def folders(request, checkpoint_root, tokenizer_dir) -> dict[str, str]:
    v3 = ds.checkpoint(checkpoint_root, tokenizer_dir, "v3")
    mla_head = os.path.join(checkpoint_root, "tp_eagle3_head_v3_mla")
    if not os.path.isdir(mla_head):
        ds.write_eagle3_mla_head(mla_head, ds.read_config(v3), aux_ids=[0, 1, 2])
    return {
        "qwen3": request.getfixturevalue("qwen3_checkpoint"),
        "qwen3:eagle": request.getfixturevalue("eagle3_head"),
        "qwen3:specforge": request.getfixturevalue("eagle3_head_specforge"),
        "v3": v3,
        "v3:mla": mla_head,
    }


def check_sharded_head_equals_one_rank(folders, target: str, head: str, kv_share: float) -> None:
    """kv_share: the rank's draft KV bytes per token over one rank's (1/2 with KV heads split;
    1 for MLA, whose latent every rank caches whole)."""
    spec = {"method": "eagle3", "model": folders[f"{target}:{head}"], "num_speculative_tokens": 2}
    plain, _ = run(LLM(folders[target], dtype="float32", **ROOMY))
    one_llm = LLM(folders[target], dtype="float32", speculative_config=spec, **ROOMY)
    one_rank, expected = run(one_llm)
    assert one_rank == plain
    llm = LLM(folders[target], dtype="float32", tensor_parallel_size=2,
              speculative_config={**spec, "draft_tensor_parallel_size": 2}, **ROOMY)
    runner = llm.engine.runner
    try:
        assert draft_bytes_per_token(llm) == draft_bytes_per_token(one_llm) * kv_share
        before = runner.num_logit_gathers()
        sharded, stats = run(llm)
        gathers = runner.num_logit_gathers() - before
    finally:
        llm.engine.shutdown()
    assert sharded == plain
    assert stats["num_drafts"] > 0
    assert {k: stats[k] for k in DRAFT_STATS} == {k: expected[k] for k in DRAFT_STATS}
    assert gathers == 0  # greedy drafts from each rank's row maxima, as the target's tokens


def test_qwen3_with_sharded_eagle_head_equals_one_rank(folders):
    check_sharded_head_equals_one_rank(folders, "qwen3", "eagle", kv_share=0.5)


def test_qwen3_with_sharded_specforge_head_equals_one_rank(folders):
    """Its own embed_tokens split by vocabulary (the lookup summed over ranks)."""
    check_sharded_head_equals_one_rank(folders, "qwen3", "specforge", kv_share=0.5)


def test_v3_with_sharded_mla_head_equals_one_rank(folders):
    check_sharded_head_equals_one_rank(folders, "v3", "mla", kv_share=1)


# -------------------------------------------------------------------- one rank's share, in process


def build_head(folder: str, target_folder: str, tp: TensorParallel) -> Eagle3Head:
    config, target = HFConfig.from_folder(folder), HFConfig.from_folder(target_folder).language_model()
    options = ModelOptions(torch.float32, torch.device("cpu"), TorchAttentionBackend(), tensor_parallel=tp)
    head_class = Eagle3MLAHead if config.get("kv_lora_rank") else Eagle3Head
    has_embed = folder.endswith("specforge")  # the SpecForge-layout fixture ships embed_tokens
    head = head_class(config, target.hidden_size, target.get("max_position_embeddings", 2048), options,
                      has_embed, has_lm_head=True)
    load_weights(head, folder, "auto")
    return head


def param_bytes(module: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in module.parameters())


@pytest.mark.parametrize("target, head", [("qwen3", "eagle"), ("qwen3", "specforge"), ("v3", "mla")])
def test_each_rank_holds_about_half_the_head(folders, target, head):
    whole = build_head(folders[f"{target}:{head}"], folders[target], TensorParallel())
    ranks = [build_head(folders[f"{target}:{head}"], folders[target], fake_rank(r, 2)) for r in range(2)]
    for rank in ranks:
        assert 0.45 < param_bytes(rank) / param_bytes(whole) < 0.6
    if head == "mla":
        return
    # rank r's slices are the checkpoint's: query heads, KV heads, MLP columns, fc and o columns, vocabulary
    for r, rank in enumerate(ranks):
        attn, whole_attn = rank.midlayer.self_attn, whole.midlayer.self_attn
        q, k, v = attn.qkv_proj.split(attn.qkv_proj.weight.T)
        wq, wk, wv = whole_attn.qkv_proj.split(whole_attn.qkv_proj.weight.T)
        for part, full in ((q, wq), (k, wk), (v, wv)):
            width = part.shape[1]
            assert torch.equal(part, full[:, r * width:(r + 1) * width])
        width = rank.fc.weight.shape[1]
        assert torch.equal(rank.fc.weight, whole.fc.weight[:, r * width:(r + 1) * width])
        width = attn.o_proj.weight.shape[1]
        assert torch.equal(attn.o_proj.weight, whole_attn.o_proj.weight[:, r * width:(r + 1) * width])
        rows = rank.lm_head.weight.shape[0]
        assert torch.equal(rank.lm_head.weight, whole.lm_head.weight[r * rows:(r + 1) * rows])
        assert torch.equal(rank.d2t, whole.d2t)
        assert attn.attn.num_kv_heads == whole_attn.attn.num_kv_heads // 2  # the draft cache holds its KV heads


# ---------------------------------------------------------------------------------- bad input


def test_draft_tensor_parallel_size_must_be_one_or_the_targets(folders):
    spec = {"method": "eagle3", "model": folders["qwen3:eagle"], "draft_tensor_parallel_size": 3}
    with pytest.raises(ValueError, match=r"draft_tensor_parallel_size = 3 must be 1 .* tensor_parallel_size = 2"):
        build_engine_config(folders["qwen3"], tensor_parallel_size=2, speculative_config=spec)
    with pytest.raises(ValueError, match=r"draft_tensor_parallel_size = 2 must be 1"):
        build_engine_config(folders["qwen3"], speculative_config={**spec, "draft_tensor_parallel_size": 2})
    for bad in (0, -1, 1.5, True, "2"):
        with pytest.raises(ValueError, match="draft_tensor_parallel_size must be an integer >= 1"):
            SpeculativeConfig(**{**spec, "draft_tensor_parallel_size": bad})
    with pytest.raises(ValueError, match="splits an EAGLE3 head; method 'mtp' takes 1"):
        SpeculativeConfig(method="mtp", draft_tensor_parallel_size=2)
    # suffix with an EAGLE3 head under it may split that head
    SpeculativeConfig(method="suffix", hybrid="eagle3", model=folders["qwen3:eagle"], draft_tensor_parallel_size=2)
    assert SpeculativeConfig(method="eagle3", model=folders["qwen3:eagle"]).draft_tensor_parallel_size == 1


def test_a_head_that_does_not_split_names_its_config_field(folders):
    with pytest.raises(ValueError, match=r"config\.json.*tensor_parallel_size = 3 does not divide num_attention_heads = 4"):
        build_head(folders["qwen3:eagle"], folders["qwen3"], fake_rank(0, 3))
    with pytest.raises(ValueError, match=r"config\.json.*num_attention_heads = 4"):
        build_head(folders["v3:mla"], folders["v3"], fake_rank(0, 3))


def test_cli_flag_reaches_the_speculative_config():
    import argparse

    from foretell.cli_args import add_engine_args, speculative_config_from_args

    parser = argparse.ArgumentParser()
    add_engine_args(parser, model_required=False)
    args = parser.parse_args(["--method", "eagle3", "--draft-model", "head", "-tp", "2",
                              "--draft-tensor-parallel-size", "2"])
    assert speculative_config_from_args(args)["draft_tensor_parallel_size"] == 2
