"""Build a model from a Hugging Face checkpoint directory (safetensors, single file or sharded).

Which files are read::

    model.safetensors.index.json present  -> the shards its weight_map names
    else model.safetensors present        -> that file
    else *.safetensors                    -> all of them (sorted)

Every tensor the model needs must appear exactly once with exactly the expected shape; any
tensor the model does not know is an error (except the few ``ignorable_checkpoint_tensor``
names). Problems are collected and reported together in one ``ModelLoadError``.
"""
from __future__ import annotations

import glob
import json
import logging
import os
from typing import Protocol

import torch
from safetensors import safe_open

from common.attention.base import AttentionBackend
from common.models.arch import ModelArchConfig, ModelLoadError
from common.models.registry import model_class
from common.models.sharding import ShardTarget
from common.parallel import SINGLE_RANK, TPGroup

log = logging.getLogger(__name__)

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
_MAX_LISTED = 8  # names listed per problem kind; the count says how many there were


class LoadableModel(Protocol):
    arch: ModelArchConfig

    def checkpoint_targets(self) -> dict[str, torch.Tensor | ShardTarget]: ...

    def ignorable_checkpoint_tensor(self, name: str) -> bool: ...


def load_model(
    model_path: str, dtype: torch.dtype | str, device: torch.device | str, attn_backend: AttentionBackend,
    tp: TPGroup = SINGLE_RANK,
) -> torch.nn.Module:
    """Parse config.json, build the registered model class on ``device`` in ``dtype``, load weights.

    With ``tp.size > 1`` the model holds (and the loader reads from disk) only rank ``tp.rank``'s
    shard; head or width counts that do not divide raise ``ShardingError``.

    Raises ``ModelLoadError`` (naming the directory) for an unknown architecture, missing weight
    files, and missing, unexpected, duplicated or wrongly shaped tensors.
    """
    torch_dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
    if not isinstance(torch_dtype, torch.dtype):
        raise ModelLoadError(f"unknown dtype {dtype!r}")
    arch = ModelArchConfig.from_model_dir(model_path)
    cls = model_class(arch.architecture)
    files = checkpoint_files(model_path)  # fail on missing files before allocating anything
    with torch.device(device):
        model = cls(arch, attn_backend, torch_dtype, tp)
    model.to(device)  # buffers computed on the host (RoPE frequencies) follow the parameters
    load_weights(model, files, model_path)
    model.eval()
    log.info("loaded %s from %s (%d layers, %s on %s%s)", arch.architecture, model_path, arch.num_layers, torch_dtype,
             device, f", tp rank {tp.rank} of {tp.size}" if tp.size > 1 else "")
    return model


def checkpoint_files(model_path: str) -> list[str]:
    """The safetensors files holding the weights, in load order."""
    index_path = os.path.join(model_path, INDEX_FILE)
    if os.path.isfile(index_path):
        try:
            with open(index_path, encoding="utf-8") as f:
                weight_map = json.load(f)["weight_map"]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise ModelLoadError(f"{index_path}: unreadable shard index ({exc!r})") from exc
        names = sorted(set(weight_map.values()))
        missing = [n for n in names if not os.path.isfile(os.path.join(model_path, n))]
        if missing:
            raise ModelLoadError(f"{model_path}: shard file(s) named in {INDEX_FILE} are missing: {', '.join(missing)}")
        return [os.path.join(model_path, n) for n in names]
    single = os.path.join(model_path, SINGLE_FILE)
    if os.path.isfile(single):
        return [single]
    found = sorted(glob.glob(os.path.join(model_path, "*.safetensors")))
    if found:
        return found
    other = [n for n in ("pytorch_model.bin", "pytorch_model.bin.index.json") if os.path.isfile(os.path.join(model_path, n))]
    hint = f" (found {other[0]}: only safetensors weights are supported)" if other else ""
    raise ModelLoadError(f"{model_path}: no {SINGLE_FILE}, {INDEX_FILE} or *.safetensors file{hint}")


def load_weights(model: LoadableModel, files: list[str], model_path: str) -> None:
    """Copy every checkpoint tensor (or this rank's slice of it) into its target view (casting
    dtype, moving device). Shapes are checked against the whole checkpoint tensor."""
    targets = model.checkpoint_targets()
    seen: dict[str, str] = {}  # tensor name -> file it came from
    unexpected: list[str] = []
    duplicated: list[str] = []
    mismatched: list[str] = []
    for path in files:
        fname = os.path.basename(path)
        try:
            handle = safe_open(path, framework="pt", device="cpu")
        except Exception as exc:  # safetensors raises its own SafetensorError, not an OSError
            raise ModelLoadError(f"{path}: not a readable safetensors file ({exc})") from exc
        with handle as f:
            for name in f.keys():
                if model.ignorable_checkpoint_tensor(name):
                    continue
                dest = targets.get(name)
                if dest is None:
                    unexpected.append(f"{name} ({fname})")
                    continue
                if name in seen:
                    duplicated.append(f"{name} ({seen[name]} and {fname})")
                    continue
                seen[name] = fname
                part = f.get_slice(name)
                shape = tuple(part.get_shape())
                expected = dest.checkpoint_shape if isinstance(dest, ShardTarget) else tuple(dest.shape)
                if shape != expected:
                    mismatched.append(f"{name} ({fname}): checkpoint {shape}, config expects {expected}")
                    continue
                if isinstance(dest, ShardTarget) and dest.dest.shape[dest.dim] != dest.full:
                    # Only this rank's rows/columns are read from the file.
                    index = (slice(None),) * dest.dim + (slice(dest.start, dest.stop),)
                    dest.dest.copy_(part[index])
                else:
                    (dest.dest if isinstance(dest, ShardTarget) else dest).copy_(f.get_tensor(name))
    missing = [n for n in targets if n not in seen]
    problems = [
        _describe("missing tensors", missing),
        _describe("unexpected tensors", unexpected),
        _describe("tensors stored twice", duplicated),
        _describe("shape mismatches", mismatched),
    ]
    problems = [p for p in problems if p]
    if problems:
        raise ModelLoadError(
            f"{model_path}: checkpoint does not match {model.arch.architecture} as configured by config.json: "
            + "; ".join(problems)
        )


def _describe(kind: str, items: list[str]) -> str:
    if not items:
        return ""
    more = f", ... ({len(items) - _MAX_LISTED} more)" if len(items) > _MAX_LISTED else ""
    return f"{len(items)} {kind}: " + ", ".join(items[:_MAX_LISTED]) + more
