"""Hub ids and missing folders (foretell/model_source.py), and a device this machine lacks.

The Hub cache is built here by hand the way huggingface_hub lays it out
(models--Org--Name/refs/<ref> holding a commit, snapshots/<commit>/<file> symlinked into blobs/),
with downloads off (HF_HUB_OFFLINE), so no test touches the network. The download path is
exercised with snapshot_download replaced by a fake that fills the same layout.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil

import httpx2
import huggingface_hub
import pytest
import torch
from huggingface_hub import constants
from huggingface_hub.errors import (
    IncompleteSnapshotError, LocalEntryNotFoundError, RepositoryNotFoundError,
)

from foretell import LLM, SamplingParams
from foretell.cli import main
from foretell.config import build_engine_config
from foretell.model_source import looks_like_hub_id, resolve_model_path
from foretell.tokenizer import Tokenizer

COMMIT_A = "a" * 40
COMMIT_B = "b" * 40


def put_in_hub_cache(cache: str, repo_id: str, folder: str, commit: str,
                     refs: tuple[str, ...] = ("main",), only: tuple[str, ...] | None = None) -> str:
    """Copy `folder`'s top-level files into `cache` as huggingface_hub stores a snapshot;
    returns the snapshot folder."""
    repo = os.path.join(cache, "models--" + repo_id.replace("/", "--"))
    snapshot = os.path.join(repo, "snapshots", commit)
    os.makedirs(snapshot, exist_ok=True)
    os.makedirs(os.path.join(repo, "blobs"), exist_ok=True)
    os.makedirs(os.path.join(repo, "refs"), exist_ok=True)
    for name in sorted(os.listdir(folder)):
        source = os.path.join(folder, name)
        if not os.path.isfile(source) or (only is not None and name not in only):
            continue
        with open(source, "rb") as f:
            data = f.read()
        blob = hashlib.sha256(data).hexdigest()
        with open(os.path.join(repo, "blobs", blob), "wb") as f:
            f.write(data)
        os.symlink(os.path.join("..", "..", "blobs", blob), os.path.join(snapshot, name))
    for ref in refs:
        with open(os.path.join(repo, "refs", ref), "w") as f:
            f.write(commit)
    return snapshot


@pytest.fixture
def offline(monkeypatch):
    """Downloads off. huggingface_hub reads HF_HUB_OFFLINE when it is imported, so the
    library's constant is set too (that is what it consults at call time)."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)


@pytest.fixture
def online(monkeypatch):
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)


def greedy_tokens(model: str, **kwargs) -> list[list[int]]:
    llm = LLM(model, dtype="float32", num_kv_blocks=64, **kwargs)
    outs = llm.generate(["Hello world", "The cat"], SamplingParams(temperature=0.0, max_tokens=8),
                        use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


# ---- hub ids from the cache ---------------------------------------------------------------------
def test_hub_id_in_the_cache_generates_what_the_folder_does(qwen3_checkpoint, tmp_path, offline):
    cache = str(tmp_path / "hub")
    snapshot = put_in_hub_cache(cache, "Org/Name", qwen3_checkpoint, COMMIT_A)
    assert os.path.islink(os.path.join(snapshot, "config.json"))
    assert resolve_model_path("Org/Name", download_dir=cache) == snapshot
    assert greedy_tokens("Org/Name", download_dir=cache) == greedy_tokens(qwen3_checkpoint)


def test_hub_cache_from_the_libraries_setting(qwen3_checkpoint, tmp_path, offline, monkeypatch):
    """No download_dir: the library's cache (HF_HUB_CACHE, read by huggingface_hub at import)."""
    cache = str(tmp_path / "hf_home" / "hub")
    snapshot = put_in_hub_cache(cache, "Org/Name", qwen3_checkpoint, COMMIT_A)
    monkeypatch.setenv("HF_HUB_CACHE", cache)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", cache)
    assert resolve_model_path("Org/Name") == snapshot
    assert build_engine_config("Org/Name").model.model == snapshot


def test_revision_picks_the_snapshot_of_that_ref(qwen3_checkpoint, tmp_path, offline):
    cache = str(tmp_path / "hub")
    main_snapshot = put_in_hub_cache(cache, "Org/Name", qwen3_checkpoint, COMMIT_A, refs=("main",))
    v2_snapshot = put_in_hub_cache(cache, "Org/Name", qwen3_checkpoint, COMMIT_B, refs=("v2",))
    assert resolve_model_path("Org/Name", download_dir=cache) == main_snapshot
    assert resolve_model_path("Org/Name", revision="v2", download_dir=cache) == v2_snapshot
    assert resolve_model_path("Org/Name", revision=COMMIT_B, download_dir=cache) == v2_snapshot
    config = build_engine_config("Org/Name", revision="v2", download_dir=cache)
    assert config.model.model == v2_snapshot
    with pytest.raises(ValueError, match=r"Org/Name \(revision v3\) is neither a local folder"):
        resolve_model_path("Org/Name", revision="v3", download_dir=cache)


def test_tokenizer_and_draft_model_resolve_too(qwen3_checkpoint, tokenizer_dir, eagle3_head,
                                               tmp_path, offline):
    cache = str(tmp_path / "hub")
    put_in_hub_cache(cache, "Org/Name", qwen3_checkpoint, COMMIT_A)
    tokenizer_main = put_in_hub_cache(cache, "Org/Tok", tokenizer_dir, COMMIT_A)
    tokenizer_v2 = put_in_hub_cache(cache, "Org/Tok", tokenizer_dir, COMMIT_B, refs=("v2",))
    head = put_in_hub_cache(cache, "Org/Head", eagle3_head, COMMIT_A)
    head_v2 = put_in_hub_cache(cache, "Org/Head", eagle3_head, COMMIT_B, refs=("v2",))

    config = build_engine_config(
        "Org/Name", tokenizer="Org/Tok", download_dir=cache,
        speculative_config={"method": "eagle3", "model": "Org/Head", "num_speculative_tokens": 2},
    )
    assert config.model.tokenizer == tokenizer_main
    assert config.speculative.model == head
    config = build_engine_config(
        "Org/Name", tokenizer="Org/Tok", tokenizer_revision="v2", download_dir=cache,
        speculative_config={"method": "eagle3", "model": "Org/Head", "revision": "v2"},
    )
    assert config.model.tokenizer == tokenizer_v2
    assert config.speculative.model == head_v2

    tokenizer = Tokenizer("Org/Tok", download_dir=cache)
    assert tokenizer.encode("Hello world") == Tokenizer(tokenizer_dir).encode("Hello world")

    spec = {"method": "eagle3", "model": "Org/Head", "num_speculative_tokens": 2}
    assert greedy_tokens("Org/Name", download_dir=cache, speculative_config=spec) == greedy_tokens(
        qwen3_checkpoint
    )


def test_a_local_folder_is_taken_as_it_is(qwen3_checkpoint, tmp_path, monkeypatch):
    """Even one named like a hub id: the folder wins, the Hub is never asked."""
    monkeypatch.setattr(huggingface_hub, "snapshot_download", None)  # would fail if called
    monkeypatch.chdir(tmp_path)
    os.makedirs("Org")
    shutil.copytree(qwen3_checkpoint, "Org/Name")
    assert resolve_model_path("Org/Name", revision="v2") == "Org/Name"
    assert resolve_model_path(qwen3_checkpoint) == qwen3_checkpoint


# ---- clear errors ---------------------------------------------------------------------------
def test_not_cached_and_offline_is_a_clear_error(tmp_path, offline):
    cache = str(tmp_path / "hub")
    with pytest.raises(ValueError) as e:
        resolve_model_path("Org/Missing", download_dir=cache)
    message = str(e.value)
    assert "model Org/Missing is neither a local folder nor in the Hugging Face Hub cache" in message
    assert cache in message and "HF_HUB_OFFLINE" in message
    with pytest.raises(ValueError, match="draft model Org/Missing is neither"):
        resolve_model_path("Org/Missing", download_dir=cache, what="draft model")


def test_an_incomplete_cached_snapshot_offline_names_what_it_lacks(qwen3_checkpoint, tmp_path, offline):
    """transformers' AutoConfig caches config.json alone: that is no model to load."""
    cache = str(tmp_path / "hub")
    snapshot = put_in_hub_cache(cache, "Org/Name", qwen3_checkpoint, COMMIT_A, only=("config.json",))
    with pytest.raises(ValueError, match=r"holds .*" + COMMIT_A + r" but it lacks weights"):
        resolve_model_path("Org/Name", download_dir=cache)
    # random weights from config.json alone need nothing more
    assert resolve_model_path("Org/Name", download_dir=cache, need_weights=False) == snapshot


def write_tree_listing(cache: str, repo_id: str, commit: str, names: list[str]) -> None:
    """The file listing snapshot_download keeps per commit (trees/<commit>.json), by which
    huggingface_hub calls a cached snapshot incomplete."""
    repo = os.path.join(cache, "models--" + repo_id.replace("/", "--"))
    os.makedirs(os.path.join(repo, "trees"), exist_ok=True)
    files = {name: {"size": 1, "blob_id": "0" * 40} for name in names}
    with open(os.path.join(repo, "trees", f"{commit}.json"), "w") as f:
        json.dump({"format_version": 1, "files": files}, f)


def test_a_snapshot_the_library_calls_incomplete_loads_when_it_has_what_foretell_needs(
        qwen3_checkpoint, tmp_path, offline):
    cache = str(tmp_path / "hub")
    snapshot = put_in_hub_cache(cache, "Org/Name", qwen3_checkpoint, COMMIT_A)
    names = sorted(os.listdir(snapshot))
    write_tree_listing(cache, "Org/Name", COMMIT_A, names + ["modeling_extra.py"])
    with pytest.raises(IncompleteSnapshotError):  # the library's own verdict
        huggingface_hub.snapshot_download("Org/Name", cache_dir=cache, local_files_only=True)
    assert resolve_model_path("Org/Name", download_dir=cache) == snapshot

    partial = put_in_hub_cache(cache, "Org/Part", qwen3_checkpoint, COMMIT_A, only=("config.json",))
    write_tree_listing(cache, "Org/Part", COMMIT_A, names)
    with pytest.raises(ValueError, match=r"Org/Part: the Hugging Face Hub cache holds .* but it "
                                         r"lacks weights"):
        resolve_model_path("Org/Part", download_dir=cache)
    assert resolve_model_path("Org/Part", download_dir=cache, need_weights=False) == partial


@pytest.mark.parametrize("path", ["/nonexistent", "/no/such/model", "./no_such_model", "../nope",
                                  "a/b/c", "~/no_such_model_here"])
def test_a_missing_local_path_does_not_exist(path):
    with pytest.raises(ValueError, match="folder .* does not exist"):
        resolve_model_path(path)


def test_a_file_is_not_a_model_folder(qwen3_checkpoint):
    with pytest.raises(ValueError, match="is a file"):
        resolve_model_path(os.path.join(qwen3_checkpoint, "config.json"))


def test_hub_id_shapes():
    assert looks_like_hub_id("Qwen/Qwen3-8B") and looks_like_hub_id("gpt2")
    assert looks_like_hub_id("meta-llama/Llama-3.1-8B-Instruct")
    for not_an_id in ("/abs/path", "./x", "../x", "~/x", "a/b/c", "a--b/c", "org/name.git", "a b"):
        assert not looks_like_hub_id(not_an_id), not_an_id


def test_cli_missing_model_folder(capsys):
    assert main(["generate", "--model", "/nonexistent", "--prompt", "hi"]) == 2
    err = capsys.readouterr().err
    assert "model folder /nonexistent does not exist" in err
    assert "Traceback" not in err and "Repo id" not in err


def test_cli_missing_tokenizer_and_draft(qwen3_checkpoint, capsys):
    assert main(["generate", "--model", qwen3_checkpoint, "--tokenizer", "./no_tok",
                 "--prompt", "hi"]) == 2
    assert "tokenizer folder ./no_tok does not exist" in capsys.readouterr().err
    assert main(["generate", "--model", qwen3_checkpoint, "--method", "eagle3",
                 "--draft-model", "/no/head", "--prompt", "hi"]) == 2
    assert "draft model folder /no/head does not exist" in capsys.readouterr().err


def test_cli_hub_id_from_the_cache(qwen3_checkpoint, tmp_path, offline, capsys):
    cache = str(tmp_path / "hub")
    put_in_hub_cache(cache, "Org/Name", qwen3_checkpoint, COMMIT_A)
    assert main(["generate", "--model", "Org/Name", "--download-dir", cache, "--prompt", "Hello",
                 "--max-tokens", "4", "--num-kv-blocks", "32"]) == 0
    assert "Hello" in capsys.readouterr().out


def test_cli_hub_id_not_cached_offline(tmp_path, offline, capsys):
    assert main(["generate", "--model", "Org/Missing", "--download-dir", str(tmp_path),
                 "--revision", "v1", "--prompt", "hi"]) == 2
    err = capsys.readouterr().err
    assert "Org/Missing (revision v1) is neither a local folder nor in the Hugging Face Hub cache" in err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error of a machine without CUDA")
def test_device_cuda_without_cuda_is_a_clear_error(qwen3_checkpoint, capsys):
    with pytest.raises(ValueError, match=r"--device cuda was asked for, but this machine has no CUDA "
                                         r"GPU \(torch.cuda.is_available\(\) is False\): use --device "
                                         r"cpu or auto"):
        LLM(qwen3_checkpoint, device="cuda")
    assert main(["generate", "--model", qwen3_checkpoint, "--device", "cuda:0", "--prompt", "hi"]) == 2
    err = capsys.readouterr().err
    assert "--device cuda:0 was asked for, but this machine has no CUDA GPU" in err
    assert "Traceback" not in err


def test_a_device_name_torch_does_not_know(qwen3_checkpoint):
    with pytest.raises(ValueError, match="device must be auto, cpu, cuda or cuda:N, got 'gpu'"):
        LLM(qwen3_checkpoint, device="gpu")


# ---- downloads (snapshot_download faked) ------------------------------------------------------
class FakeHub:
    """snapshot_download over a dict of repos: local_files_only looks in the cache folder only;
    otherwise it "downloads" the files the patterns allow into the same layout."""

    def __init__(self, repos: dict[str, str], cache: str, unreachable: bool = False):
        self.repos, self.cache, self.calls, self.unreachable = repos, cache, [], unreachable

    def __call__(self, repo_id, *, revision=None, cache_dir=None, local_files_only=False,
                 allow_patterns=None, ignore_patterns=None, **_):
        from huggingface_hub.utils import filter_repo_objects

        self.calls.append({"local_files_only": local_files_only, "allow": allow_patterns,
                           "ignore": ignore_patterns, "cache_dir": cache_dir})
        assert cache_dir == self.cache
        snapshot = os.path.join(cache_dir, "models--" + repo_id.replace("/", "--"), "snapshots", COMMIT_A)
        if local_files_only:
            if not os.path.isdir(snapshot):
                raise LocalEntryNotFoundError("not cached")
            return snapshot
        if self.unreachable:
            try:
                raise httpx2.ConnectError("Name or service not known")
            except httpx2.ConnectError as e:
                raise LocalEntryNotFoundError("cannot reach the Hub") from e
        if repo_id not in self.repos:
            response = httpx2.Response(404, request=httpx2.Request("GET", "https://huggingface.co"))
            raise RepositoryNotFoundError("404 Repository Not Found", response=response)
        folder = self.repos[repo_id]
        wanted = set(filter_repo_objects(sorted(os.listdir(folder)), allow_patterns=allow_patterns,
                                         ignore_patterns=ignore_patterns))
        have = set(os.listdir(snapshot)) if os.path.isdir(snapshot) else set()
        return put_in_hub_cache(cache_dir, repo_id, folder, COMMIT_A, only=tuple(wanted - have))


def test_download_when_online_and_not_cached(qwen3_checkpoint, tmp_path, online, monkeypatch):
    cache = str(tmp_path / "hub")
    source = tmp_path / "repo"
    shutil.copytree(qwen3_checkpoint, source)
    (source / "pytorch_model.bin").write_bytes(b"a second copy of the weights: never fetched")
    (source / "consolidated.safetensors").write_bytes(b"mistral's layout: never fetched")
    hub = FakeHub({"Org/Name": str(source)}, cache)
    monkeypatch.setattr(huggingface_hub, "snapshot_download", hub)

    folder = resolve_model_path("Org/Name", download_dir=cache)
    assert [c["local_files_only"] for c in hub.calls] == [True, False]
    assert "*.safetensors" in hub.calls[-1]["allow"] and "*.bin" not in hub.calls[-1]["allow"]
    fetched = sorted(os.listdir(folder))
    assert "model.safetensors" in fetched and "config.json" in fetched
    assert "pytorch_model.bin" not in fetched and "consolidated.safetensors" not in fetched
    # now cached: no download
    hub.calls.clear()
    assert resolve_model_path("Org/Name", download_dir=cache) == folder
    assert [c["local_files_only"] for c in hub.calls] == [True]


def test_download_falls_back_to_bin_weights(llama2_bin_checkpoint, tmp_path, online, monkeypatch):
    cache = str(tmp_path / "hub")
    hub = FakeHub({"Org/Bin": llama2_bin_checkpoint}, cache)
    monkeypatch.setattr(huggingface_hub, "snapshot_download", hub)
    folder = resolve_model_path("Org/Bin", download_dir=cache)
    assert any(n.endswith(".bin") for n in os.listdir(folder))
    assert "*.bin" in hub.calls[-1]["allow"]


def test_download_of_an_unknown_repo_is_a_clear_error(tmp_path, online, monkeypatch):
    cache = str(tmp_path / "hub")
    monkeypatch.setattr(huggingface_hub, "snapshot_download", FakeHub({}, cache))
    with pytest.raises(ValueError, match="model Org/Nope is neither a local folder nor a repo on "
                                         "the Hugging Face Hub"):
        resolve_model_path("Org/Nope", download_dir=cache)


def test_downloaded_repo_without_a_model_is_a_clear_error(tokenizer_dir, tmp_path, online, monkeypatch):
    cache = str(tmp_path / "hub")
    monkeypatch.setattr(huggingface_hub, "snapshot_download", FakeHub({"Org/Tok": tokenizer_dir}, cache))
    with pytest.raises(ValueError, match="lacks config.json"):
        resolve_model_path("Org/Tok", download_dir=cache)
    # the same repo is a fine tokenizer
    assert os.path.isfile(os.path.join(resolve_model_path("Org/Tok", download_dir=cache,
                                                          what="tokenizer"), "tokenizer.json"))


def test_hub_unreachable_and_not_cached_is_a_clear_error(tmp_path, online, monkeypatch):
    cache = str(tmp_path / "hub")
    monkeypatch.setattr(huggingface_hub, "snapshot_download", FakeHub({}, cache, unreachable=True))
    with pytest.raises(ValueError, match=r"model Org/Name is neither a local folder nor in the "
                                         r"Hugging Face Hub cache .* could not be reached to "
                                         r"download it \(ConnectError: Name or service not known\)"):
        resolve_model_path("Org/Name", download_dir=cache)
