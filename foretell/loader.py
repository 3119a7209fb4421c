"""Checkpoint files -> model parameters, for every model, with no per-model branches.

A model says how checkpoint names map onto its parameters through `model.weight_rules` (fused
rules with a shard id, and keys to ignore); each parameter's `weight_loader(param, tensor, shard)`
copies its slice, converting dtype by value. Everything else here is finding files, reading them,
and saying exactly what is wrong when a checkpoint does not fit the model.

Reading is in one place, `iter_checkpoint_tensors`, which yields (key, tensor, file) from
safetensors (single or sharded with model.safetensors.index.json) or pytorch_model.bin (single or
sharded). It pairs FP8 block-quantized weights (checkpoint_fp8.py) as DeepSeek-V3/R1 and Kimi-K2 ship them,
`X.weight` (float8) with `X.weight_scale_inv` (float32, [ceil(out/b0), ceil(in/b1)], blocks
`quantization_config.weight_block_size`, default 128 x 128), wherever the two sit in the shards.
The model decides what becomes of a pair by its parameters: where it holds the weight in FP8
(an FP8 layer, layers/linear.py, or FP8 experts, layers/moe.py) both tensors are loaded as they
are, bit for bit; where it holds a float parameter (a layer kept in the model dtype, MLA's
kv_b_proj, a model built without its quantization) the pair becomes one float32 `X.weight` equal
to each block times its scale.

Under tensor parallelism a parameter holding one rank's part of a checkpoint tensor says which
part through `param.rank_slices` (shard id -> RankSlice, layers/rank_slices.py). The loader hands
its weight_loader only that part: from safetensors it reads only those bytes (get_slice; FP8
weights kept in FP8 and their scales too, the layer having checked that the cut falls on block
boundaries), elsewhere (.bin files, FP8 tensors dequantized whole) it cuts the part from the
whole tensor. The whole tensor's shape is checked either way.

`load_format="dummy"` reads no file: every parameter gets deterministic random values (normal,
std 0.02 or the parameter's `dummy_std`, seeded per parameter name), parameters that declare
`dummy_value` (norm weights, FP8 scales) are filled with it, and integer ones are zero, or random
bits where they declare `dummy_random_bits` (packed int4 weights).
"""

from __future__ import annotations

import json
import os
import re
import zipfile
import zlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from foretell.checkpoint_errors import CheckpointError, list_names
from foretell.checkpoint_fp8 import FP8_DTYPES, FP8_SCALE_SUFFIX, Fp8Pairing
from foretell.layers.rank_slices import RankSlice
from foretell.layers.weight_loaders import default_weight_loader
from foretell.weight_rules import WeightRules

LOAD_FORMATS = ("auto", "safetensors", "pt", "dummy")
DUMMY_STD = 0.02

SAFETENSORS_INDEX = "model.safetensors.index.json"
SAFETENSORS_SINGLE = "model.safetensors"
PT_INDEX = "pytorch_model.bin.index.json"
PT_SINGLE = "pytorch_model.bin"
# Mistral's repos also hold consolidated.safetensors in Mistral's own naming; never pick it up.
_NOT_HF_WEIGHTS = ("consolidated",)


def _read_index(index_path: str) -> dict[str, list[str]]:
    """Shard file -> the keys the index says it holds, in index order."""
    try:
        with open(index_path) as f:
            weight_map = json.load(f)["weight_map"]
    except (OSError, json.JSONDecodeError, KeyError, TypeError) as e:
        raise CheckpointError(
            f"{index_path} is not a readable weight index (a JSON object with a 'weight_map' "
            f"of tensor name -> file): {type(e).__name__}: {e}"
        ) from e
    by_file: dict[str, list[str]] = {}
    for key, file_name in weight_map.items():
        by_file.setdefault(file_name, []).append(key)
    folder = os.path.dirname(index_path)
    for file_name in by_file:
        if not os.path.isfile(os.path.join(folder, file_name)):
            raise CheckpointError(
                f"{index_path} lists shard {file_name!r} (holding e.g. {by_file[file_name][0]!r}),"
                f" but {os.path.join(folder, file_name)} does not exist"
            )
    return by_file


def find_weight_files(
    folder: str, load_format: str = "auto"
) -> tuple[str, list[tuple[str, list[str] | None]]]:
    """(format, [(file path, keys the index expects in it or None)]) for a model folder."""
    if load_format not in LOAD_FORMATS or load_format == "dummy":
        raise ValueError(
            f"load_format {load_format!r} has no files; expected one of "
            f"{', '.join(f for f in LOAD_FORMATS if f != 'dummy')}"
        )
    if not os.path.isdir(folder):
        raise CheckpointError(f"model folder {folder} does not exist or is not a folder")
    looked_for = []
    candidates = []
    if load_format in ("auto", "safetensors"):
        candidates.append(("safetensors", SAFETENSORS_INDEX, SAFETENSORS_SINGLE, "*.safetensors"))
    if load_format in ("auto", "pt"):
        candidates.append(("pt", PT_INDEX, PT_SINGLE, None))
    for fmt, index_name, single_name, pattern in candidates:
        index_path = os.path.join(folder, index_name)
        looked_for.append(index_name)
        if os.path.isfile(index_path):
            by_file = _read_index(index_path)
            return fmt, [(os.path.join(folder, f), keys) for f, keys in sorted(by_file.items())]
        looked_for.append(single_name)
        if os.path.isfile(os.path.join(folder, single_name)):
            return fmt, [(os.path.join(folder, single_name), None)]
        if pattern is not None:
            looked_for.append(pattern)
            suffix = pattern.lstrip("*")
            others = sorted(
                n for n in os.listdir(folder)
                if n.endswith(suffix) and not n.startswith(_NOT_HF_WEIGHTS)
            )
            if others:
                return fmt, [(os.path.join(folder, n), None) for n in others]
    raise CheckpointError(
        f"no weight files in {folder} for load_format={load_format!r}; looked for: "
        f"{', '.join(looked_for)}"
    )


# cut(key, shape, safetensors dtype name, path) -> the part of the tensor to read, or None for all
Cut = Callable[[str, tuple[int, ...], str, str], RankSlice | None]


def _iter_safetensors(
    path: str, skip: Callable[[str], bool], cut: Cut | None = None
) -> Iterator[tuple[str, torch.Tensor | None]]:
    from safetensors import safe_open

    try:
        with safe_open(path, framework="pt", device="cpu") as f:
            for key in f.keys():
                if skip(key):
                    yield key, None
                    continue
                if cut is None:
                    yield key, f.get_tensor(key)
                    continue
                lazy = f.get_slice(key)
                part = cut(key, tuple(lazy.get_shape()), lazy.get_dtype(), path)
                if part is None:
                    yield key, f.get_tensor(key)
                else:
                    index = (slice(None),) * part.dim + (slice(part.start, part.start + part.size),)
                    yield key, lazy[index]
    except CheckpointError:
        raise
    except Exception as e:  # SafetensorError, OSError: header or data unreadable / truncated
        raise CheckpointError(
            f"{path} is not a readable safetensors file (truncated or corrupt?): "
            f"{type(e).__name__}: {e}"
        ) from e


def _iter_pt(path: str, skip: Callable[[str], bool], cut: Cut | None = None) -> Iterator[tuple[str, torch.Tensor | None]]:
    try:
        # mmap avoids a second copy of the file in memory; only the zip format supports it.
        state = torch.load(
            path, map_location="cpu", weights_only=True, mmap=zipfile.is_zipfile(path)
        )
    except Exception as e:  # pickle errors, zip errors, OSError on truncated files
        raise CheckpointError(
            f"{path} is not a readable PyTorch weights file (truncated, corrupt, or holding "
            f"more than tensors?): {type(e).__name__}: {e}"
        ) from e
    if not isinstance(state, dict):
        raise CheckpointError(
            f"{path} holds a {type(state).__name__}, expected a dict of tensor name -> tensor"
        )
    for key, tensor in state.items():
        if skip(key):
            yield key, None
            continue
        if not isinstance(tensor, torch.Tensor):
            raise CheckpointError(
                f"{path}: entry {key!r} is a {type(tensor).__name__}, not a tensor"
            )
        yield key, tensor


def iter_checkpoint_tensors(
    folder: str,
    load_format: str = "auto",
    dequantize_fp8: bool = True,
    skip: Callable[[str], bool] | None = None,
    cut: Cut | None = None,
    keep_fp8: Callable[[str], bool] | None = None,
) -> Iterator[tuple[str, torch.Tensor, str]]:
    """Yield (checkpoint key, CPU tensor, file path) for every tensor of a checkpoint.

    With an index, each shard must hold the keys the index assigns to it. With dequantize_fp8,
    an FP8 `X.weight` and its `X.weight_scale_inv` are yielded once, as a float32 `X.weight`
    (the file is the one that held the second of the two), unless keep_fp8(`X.weight`) says the
    model holds that weight in FP8: then both are yielded as they are (and still checked to come
    in pairs). Keys for which skip(key) is true are
    neither read nor yielded (a target ignoring MTP layers, a drafter taking one layer).
    Safetensors tensors for which cut(...) gives a RankSlice are read as that part only (a
    .bin file's tensors are yielded whole: the caller cuts them).
    """
    fmt, files = find_weight_files(folder, load_format)
    read = _iter_safetensors if fmt == "safetensors" else _iter_pt
    fp8 = Fp8Pairing(folder, keep_fp8) if dequantize_fp8 else None
    skip = skip or (lambda key: False)
    for path, expected_keys in files:
        seen = set()
        for key, tensor in read(path, skip, cut):
            seen.add(key)
            if tensor is None:
                continue
            if fp8 is None:
                yield key, tensor, path
            else:
                yield from ((k, t, path) for k, t in fp8.add(key, tensor, path))
        if expected_keys is not None:
            absent = [k for k in expected_keys if k not in seen]
            if absent:
                raise CheckpointError(
                    f"the weight index says {path} holds {list_names(absent)}, but it does not"
                )
    if fp8 is not None:
        fp8.check_complete()


def checkpoint_keys(folder: str, load_format: str = "auto") -> dict[str, tuple[int, ...]]:
    """Key -> shape of every tensor in a checkpoint, read without loading the data where the
    format allows (safetensors headers; .bin files are memory-mapped)."""
    fmt, files = find_weight_files(folder, load_format)
    shapes: dict[str, tuple[int, ...]] = {}
    for path, _ in files:
        try:
            if fmt == "safetensors":
                from safetensors import safe_open

                with safe_open(path, framework="pt") as f:
                    for key in f.keys():
                        shapes[key] = tuple(f.get_slice(key).get_shape())
            else:
                state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
                shapes.update({k: tuple(v.shape) for k, v in state.items()})
        except Exception as e:  # safetensors and torch raise several types for bad files
            raise CheckpointError(f"{path} could not be read: {e}") from e
    return shapes


def _map_name(key: str, rules: WeightRules) -> tuple[str, Any]:
    for rule in rules.fused:
        mapped = rule.apply(key)
        if mapped is not None:
            return mapped
    return key, None


def _shard_label(name: str, shard: Any) -> str:
    return name if shard is None else f"{name} (shard {shard!r})"


def load_weights(
    model: nn.Module, folder: str, load_format: str = "auto", seed: int = 0
) -> list[str]:
    """Fill every parameter of `model` from the checkpoint in `folder`; return the files read.

    Raises CheckpointError for missing, unexpected or misshapen tensors and unreadable files.
    """
    if load_format == "dummy":
        fill_dummy_weights(model, seed)
        return []
    rules: WeightRules = getattr(model, "weight_rules", None) or WeightRules()
    ignored = [re.compile(p) for p in rules.ignored]
    params = dict(model.named_parameters())
    loaded: dict[tuple[str, Any], tuple[str, str]] = {}  # (param, shard) -> (key, file)
    unexpected: list[str] = []
    files: list[str] = []
    def is_ignored(key: str) -> bool:
        base = key[: -len(FP8_SCALE_SUFFIX)] if key.endswith(FP8_SCALE_SUFFIX) else key
        return any(p.search(base) for p in ignored)

    cut_at_read: set[str] = set()  # keys read as this rank's part already

    def rank_slice(name: str, shard: Any) -> RankSlice | None:
        param = params.get(name)
        return None if param is None else getattr(param, "rank_slices", {}).get(shard)

    def keep_fp8(key: str) -> bool:  # the model holds this FP8 weight as it is
        param = params.get(_map_name(key, rules)[0])
        return param is not None and param.dtype in FP8_DTYPES

    def cut(key: str, shape: tuple[int, ...], dtype: str, path: str) -> RankSlice | None:
        part = rank_slice(*_map_name(key, rules))
        if part is None or (dtype.startswith("F8") and not keep_fp8(key)):  # dequantized whole, then cut
            return None
        try:
            part.check_full_shape(shape)
        except ValueError as e:
            raise CheckpointError(f"{path}: tensor {key!r} does not fit parameter "
                                  f"{_map_name(key, rules)[0]}: {e}") from e
        cut_at_read.add(key)
        return part

    any_cut = any(getattr(p, "rank_slices", None) for p in params.values())
    for key, tensor, path in iter_checkpoint_tensors(folder, load_format, skip=is_ignored,
                                                     cut=cut if any_cut else None, keep_fp8=keep_fp8):
        if not files or files[-1] != path:
            files.append(path)
        name, shard = _map_name(key, rules)
        param = params.get(name)
        if param is None:
            unexpected.append(f"{key} (in {os.path.basename(path)})")
            continue
        if (name, shard) in loaded:
            first_key, first_path = loaded[(name, shard)]
            raise CheckpointError(
                f"{path}: tensor {key!r} fills {_shard_label(name, shard)}, which was already "
                f"loaded from {first_key!r} in {first_path}"
            )
        weight_loader = getattr(param, "weight_loader", default_weight_loader)
        try:
            part = rank_slice(name, shard)
            if part is not None and key not in cut_at_read:
                tensor = part.take(tensor)
            weight_loader(param, tensor, shard)
        except ValueError as e:
            raise CheckpointError(
                f"{path}: tensor {key!r} does not fit parameter {name}: {e}"
            ) from e
        loaded[(name, shard)] = (key, path)

    missing = [
        _shard_label(name, shard)
        for name, param in params.items()
        for shard in getattr(param, "shard_ids", (None,))
        if (name, shard) not in loaded
    ]
    problems = []
    if missing:
        problems.append(
            f"{len(missing)} parameter(s) found no tensor in the checkpoint: {list_names(missing)}"
        )
    if unexpected:
        problems.append(
            f"{len(unexpected)} checkpoint tensor(s) match no parameter of "
            f"{type(model).__name__}: {list_names(unexpected)}"
        )
    if problems:
        raise CheckpointError(
            f"checkpoint in {folder} does not fit {type(model).__name__}: " + "; ".join(problems)
        )
    return files


def fill_dummy_weights(model: nn.Module, seed: int = 0) -> None:
    """Deterministic random weights from the parameter names alone (no file is read).

    Each parameter is drawn from a generator seeded by (seed, name), on the parameter's own
    device (an 8B model is drawn in seconds on a GPU), so the values do not depend on the
    parameter order or which other parameters exist; they do differ between CPU and GPU.
    """
    with torch.no_grad():
        for name, param in model.named_parameters():
            value = getattr(param, "dummy_value", None)
            if value is not None:
                param.fill_(value)
                continue
            # The CPU generator keeps only 32 bits of its seed: mix seed and name into 32.
            mixed = zlib.crc32(name.encode(), zlib.crc32(seed.to_bytes(8, "little", signed=True)))
            generator = torch.Generator(device=param.device).manual_seed(mixed)
            if param.dtype.is_floating_point:
                values = torch.randn(param.shape, generator=generator, device=param.device)
                param.copy_(values.mul_(getattr(param, "dummy_std", DUMMY_STD)))
            elif getattr(param, "dummy_random_bits", False):
                info = torch.iinfo(param.dtype)
                param.copy_(torch.randint(info.min, info.max, param.shape, generator=generator,
                                          device=param.device, dtype=param.dtype))
            else:
                param.zero_()
