"""Where a model comes from: a local folder, or a Hugging Face Hub id resolved to a local snapshot.

resolve_model_path("Qwen/Qwen3-8B") -> the snapshot folder in the Hub cache
(<cache>/models--Qwen--Qwen3-8B/snapshots/<commit>), downloading it when it is not cached and the
machine is online. A folder that exists is returned as it is, without touching the Hub library.

The huggingface_hub library does the Hub work: where its cache is (download_dir, else HF_HUB_CACHE
/ HF_HOME), whether downloads are off (HF_HUB_OFFLINE), the token (HF_TOKEN or `hf auth login`'s
stored one), and which commit a branch or tag names (the cache's refs/<revision>). This module
only picks which files a model needs, looks in the cache before the network, and turns the
library's errors into messages that say what to do. It imports no torch, and the Hub library only
when a name is not a local folder.
"""

from __future__ import annotations

import json
import logging
import os

logger = logging.getLogger("foretell")

# What each kind of folder is for: it names the folder in messages and picks the files to fetch.
KINDS = ("model", "draft model", "tokenizer")

# Files a tokenizer may need (fast or slow, a chat template, custom tokenizer code), and the
# configs whose eos_token_id the tokenizer wrapper reads.
TOKENIZER_PATTERNS = ["*.json", "*.model", "*.txt", "*.tiktoken", "*.jinja", "*.py"]
# A model's weights: safetensors when the repo has them, else the PyTorch .bin files.
SAFETENSORS_PATTERNS = ["*.safetensors"]
PT_PATTERNS = ["*.bin", "*.pt"]
# Copies of the weights in other layouts that some repos also ship (Meta's original/ folder,
# Mistral's consolidated file): never needed, often as large as the model itself.
IGNORE_PATTERNS = ["original/*", "consolidated*"]

LOCAL_PATH_PREFIXES = ("/", "./", "../", "~", ".\\", "..\\")


def resolve_model_path(
    name_or_path: str,
    revision: str | None = None,
    download_dir: str | None = None,
    what: str = "model",
    need_weights: bool = True,
) -> str:
    """A local folder holding `name_or_path`: the folder itself, or the Hub snapshot of that id.

    revision: a branch, tag or commit of the Hub repo (default: main); ignored for local folders.
    download_dir: the Hub cache folder (default: the library's, HF_HUB_CACHE or HF_HOME/hub).
    what: "model", "draft model" or "tokenizer" (which files are fetched; named in errors).
    need_weights: fetch (and require in the cache) the weight files; False for a model loaded
    with random weights from its config.json alone (load_format="dummy").
    """
    if what not in KINDS:
        raise ValueError(f"what must be one of {', '.join(KINDS)}, got {what!r}")
    if not isinstance(name_or_path, str) or not name_or_path:
        raise ValueError(f"the {what} must be a folder or a Hugging Face Hub id, got {name_or_path!r}")
    path = os.path.expanduser(name_or_path)
    if os.path.isdir(path):
        return path
    if os.path.exists(path):
        raise ValueError(
            f"{what} {name_or_path} is a file; give the folder that holds config.json and the "
            f"weights (a Hugging Face model folder) or a Hub id such as Qwen/Qwen3-8B"
        )
    if not looks_like_hub_id(name_or_path):
        raise ValueError(
            f"{what} folder {name_or_path} does not exist (give a local Hugging Face model "
            f"folder, or a Hub id such as Qwen/Qwen3-8B)"
        )
    return _resolve_hub_id(name_or_path, revision, download_dir, what, need_weights)


def looks_like_hub_id(name: str) -> bool:
    """`org/name` or `name` as the Hub spells repo ids; a path-like string never is one."""
    if name.startswith(LOCAL_PATH_PREFIXES) or os.path.isabs(name) or name.count("/") > 1:
        return False
    if "\\" in name:
        return False
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(name)
    except HFValidationError:
        return False
    return True


def patterns_for(what: str, need_weights: bool, weights: list[str]) -> list[str]:
    """allow_patterns for snapshot_download: the tokenizer and config files, plus `weights`."""
    if what == "tokenizer" or not need_weights:
        return list(TOKENIZER_PATTERNS)
    return TOKENIZER_PATTERNS + weights


def missing_files(folder: str, what: str, need_weights: bool) -> list[str]:
    """What a snapshot folder lacks to be loaded as `what` (empty: complete enough).

    The Hub library already refuses a snapshot its cached file listing shows incomplete; this also
    catches one filled file by file (transformers' AutoConfig caches config.json alone).
    """
    def has(name: str) -> bool:
        return os.path.isfile(os.path.join(folder, name))

    if what == "tokenizer":
        names = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")
        return [] if any(has(n) for n in names) else ["tokenizer.json or tokenizer_config.json"]
    missing = [] if has("config.json") else ["config.json"]
    if not need_weights:
        return missing
    for index_name in ("model.safetensors.index.json", "pytorch_model.bin.index.json"):
        if has(index_name):
            with open(os.path.join(folder, index_name)) as f:
                shards = sorted(set(json.load(f).get("weight_map", {}).values()))
            return missing + [s for s in shards if not has(s)]
    names = os.listdir(folder)
    if not any(n.endswith((".safetensors", ".bin", ".pt")) for n in names):
        missing.append("weights (*.safetensors or pytorch_model.bin)")
    return missing


def _resolve_hub_id(repo_id: str, revision: str | None, download_dir: str | None, what: str,
                    need_weights: bool) -> str:
    from huggingface_hub import constants

    cache_dir = download_dir or constants.HF_HUB_CACHE
    at = f"{repo_id}" + (f" (revision {revision})" if revision else "")
    cached = _cached_snapshot(repo_id, revision, download_dir, what, need_weights)
    if cached is not None and not missing_files(cached, what, need_weights):
        return cached
    if constants.is_offline_mode():
        if cached is not None:
            raise ValueError(
                f"{what} {at}: the Hugging Face Hub cache holds {cached} but it lacks "
                f"{', '.join(missing_files(cached, what, need_weights))}, and downloads are off "
                f"(HF_HUB_OFFLINE is set): unset HF_HUB_OFFLINE to complete it"
            )
        raise ValueError(
            f"{what} {at} is neither a local folder nor in the Hugging Face Hub cache "
            f"({cache_dir}), and downloads are off (HF_HUB_OFFLINE is set): unset HF_HUB_OFFLINE "
            f"to download it, pass the cache that holds it (download_dir / --download-dir), or "
            f"give a local folder"
        )
    return _download(repo_id, revision, download_dir, what, need_weights, cache_dir)


def _cached_snapshot(repo_id: str, revision: str | None, download_dir: str | None, what: str,
                     need_weights: bool) -> str | None:
    """The cached snapshot of the revision, or None when the cache has none.

    A snapshot the library calls incomplete (its cached file listing names files that are not
    there, a README or example code, say) is still returned: missing_files() decides whether
    what foretell loads is there.
    """
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import IncompleteSnapshotError, LocalEntryNotFoundError

    partial = None
    for weights in (SAFETENSORS_PATTERNS, PT_PATTERNS):
        try:
            return snapshot_download(
                repo_id, revision=revision, cache_dir=download_dir, local_files_only=True,
                allow_patterns=patterns_for(what, need_weights, weights),
                ignore_patterns=IGNORE_PATTERNS,
            )
        except IncompleteSnapshotError as e:
            partial = e.snapshot_path
        except LocalEntryNotFoundError:  # no snapshot of this revision at all
            return None
        if what == "tokenizer" or not need_weights:
            break
    return partial


def _download(repo_id: str, revision: str | None, download_dir: str | None, what: str,
              need_weights: bool, cache_dir: str) -> str:
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError, HfHubHTTPError, LocalEntryNotFoundError, RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    at = f"{repo_id}" + (f" (revision {revision})" if revision else "")
    logger.info("%s %s is not a local folder: fetching it from the Hugging Face Hub into %s",
                what, at, cache_dir)

    def fetch(weights: list[str]) -> str:
        return snapshot_download(
            repo_id, revision=revision, cache_dir=download_dir,
            allow_patterns=patterns_for(what, need_weights, weights), ignore_patterns=IGNORE_PATTERNS,
        )

    try:
        folder = fetch(SAFETENSORS_PATTERNS)
        if need_weights and what != "tokenizer" and missing_files(folder, what, need_weights):
            folder = fetch(PT_PATTERNS)  # a repo without safetensors: its PyTorch .bin files
    except GatedRepoError as e:
        raise ValueError(
            f"{what} {at} is a gated repo on the Hugging Face Hub: accept its terms on "
            f"https://huggingface.co/{repo_id} and log in (`hf auth login` or HF_TOKEN)"
        ) from e
    except RevisionNotFoundError as e:
        raise ValueError(f"{what} {repo_id} has no revision {revision!r} on the Hugging Face Hub") from e
    except RepositoryNotFoundError as e:
        raise ValueError(
            f"{what} {repo_id} is neither a local folder nor a repo on the Hugging Face Hub "
            f"(a private repo needs a login: `hf auth login` or HF_TOKEN)"
        ) from e
    except LocalEntryNotFoundError as e:  # the Hub could not be reached and nothing is cached
        reason = f" ({type(e.__cause__).__name__}: {e.__cause__})" if e.__cause__ else ""
        raise ValueError(
            f"{what} {at} is neither a local folder nor in the Hugging Face Hub cache "
            f"({cache_dir}), and the Hub could not be reached to download it{reason}: check the "
            f"connection, or give a local folder"
        ) from e
    except HfHubHTTPError as e:
        raise ValueError(f"downloading {what} {at} from the Hugging Face Hub failed: {e}") from e
    lacking = missing_files(folder, what, need_weights)
    if lacking:
        raise ValueError(
            f"{what} {at} on the Hugging Face Hub lacks {', '.join(lacking)} (downloaded to "
            f"{folder}): it is not a Hugging Face {'tokenizer' if what == 'tokenizer' else 'model'}"
            f" folder foretell can load"
        )
    return folder


def resolve_engine_sources(model_config, speculative_config) -> None:
    """Replace the model, tokenizer and draft model names of freshly built configs by local
    folders (build_engine_config calls this once; later code only ever sees folders)."""
    mc = model_config
    name = mc.model
    need_weights = mc.load_format != "dummy"
    mc.model = resolve_model_path(name, mc.revision, mc.download_dir, "model", need_weights)
    if mc.tokenizer is not None or mc.tokenizer_revision is not None:
        mc.tokenizer = resolve_model_path(
            mc.tokenizer or name, mc.tokenizer_revision or (None if mc.tokenizer else mc.revision),
            mc.download_dir, "tokenizer",
        )
    if speculative_config is not None and speculative_config.model:
        speculative_config.model = resolve_model_path(
            speculative_config.model, speculative_config.revision, mc.download_dir, "draft model",
            need_weights,
        )
