"""Build a model on the meta device, materialise it on the target device/dtype, and fill it from safetensors."""

from __future__ import annotations

import dataclasses
import glob
import json
import os

import torch
from safetensors import safe_open
from torch import nn

from asyncspec.errors import ModelLoadError
from asyncspec.layers.tensor_parallel import TensorParallel
from asyncspec.models.checkpoint import WeightTarget
from asyncspec.models.llama import LlamaForCausalLM
from asyncspec.models.model_config import ModelConfig
from asyncspec.models.registry import get_model_class

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
_PICKLE_PATTERNS = ("pytorch_model*.bin", "*.bin", "*.pt", "*.pth", "*.ckpt", "pytorch_model.bin.index.json")
# Checkpoint tensors that carry no weights we need (recomputed buffers, or the duplicate of a tied head).
_HARMLESS_SUFFIXES = ("rotary_emb.inv_freq",)
_TIED_HEAD, _EMBEDDING = "lm_head.weight", "model.embed_tokens.weight"
_TIED_CHECK_ROWS = 8192  # rows of the head compared with the embedding at a time


def load_model(
    model_path: str,
    model_config: ModelConfig,
    dtype: torch.dtype,
    device: torch.device,
    load_format: str = "safetensors",
    seed: int = 0,
    tp: TensorParallel | None = None,
    max_position: int | None = None,
) -> LlamaForCausalLM:
    """The model of `model_config` on `device` in `dtype`, in eval mode, with weights from `model_path`;
    under tensor parallelism (`tp`) this rank's shard, sliced straight from the files. Its RoPE tables hold
    `max_position` positions (the engine's max_model_len: no real token sits past it, and the GPU kernels clamp
    a padding row's) where that is fewer than the model's own limit: a model of a million positions would
    otherwise hold hundreds of MiB of them, on every rank and for the draft."""
    device = torch.device(device)
    if max_position is not None and max_position < model_config.max_position_embeddings:
        model_config = dataclasses.replace(model_config, max_position_embeddings=max_position)
    if load_format not in ("safetensors", "dummy"):
        raise ModelLoadError(f"load_format {load_format!r} is not supported (safetensors, dummy)")
    files = _find_weight_files(model_path) if load_format == "safetensors" else {}
    cls = get_model_class(model_config.architecture)
    with torch.device("meta"):
        model = cls(model_config, tp)
    _materialize(model, device, dtype)
    targets = model.checkpoint_tensors()
    with torch.no_grad():
        # Padding rows of the last vocabulary shard, and row-parallel biases off rank 0, stay zero
        # (every other parameter is overwritten in full).
        for target in targets.values():
            if target.zero or (target.dim is not None and target.length < target.tensor.shape[target.dim]):
                target.tensor.zero_()
        if load_format == "dummy":
            _fill_dummy(targets, device, seed)
        else:
            _fill_from_files(targets, files, model_config.tie_word_embeddings)
    return model.eval()


def _materialize(model: nn.Module, device: torch.device, dtype: torch.dtype) -> None:
    """Replace meta parameters by uninitialised ones on `device` (no fp32 copy of the whole model)."""
    for module in model.modules():
        for name, p in list(module._parameters.items()):
            if p is not None:
                module._parameters[name] = nn.Parameter(
                    torch.empty(p.shape, dtype=dtype, device=device), requires_grad=False
                )
        reset = getattr(module, "reset_non_persistent_buffers", None)
        if reset is not None:
            reset(device)


def _fill_dummy(targets: dict[str, WeightTarget], device: torch.device, seed: int) -> None:
    """Random weights that do not depend on the sharding: each checkpoint tensor is drawn whole, in
    checkpoint order from one generator, and each rank keeps its slice (tensor-parallel ranks then
    hold the same model as a single GPU)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    for name, target in targets.items():
        if name.endswith("norm.weight"):
            target.tensor.fill_(1.0)
            continue
        # Drawn on every rank, also where it stays zero, so that the generator's state is the same.
        full = torch.empty(target.checkpoint_shape, dtype=target.tensor.dtype, device=device)
        full.normal_(0.0, 0.02, generator=gen)
        if not target.zero:
            _copy_slice(target, full)


def _copy_slice(target: WeightTarget, full: torch.Tensor) -> None:
    if target.dim is None:
        target.tensor.copy_(full)
    else:
        target.destination().copy_(full.narrow(target.dim, target.start, target.length))


def _find_weight_files(model_path: str) -> dict[str, str]:
    """Tensor name -> safetensors file path, from the index or by listing single files."""
    if not os.path.isdir(model_path):
        raise ModelLoadError(f"model directory {model_path!r} does not exist or is not a directory")
    index_path = os.path.join(model_path, INDEX_FILE)
    if os.path.isfile(index_path):
        return _read_index(model_path, index_path)
    candidates = [os.path.join(model_path, SINGLE_FILE)]
    if not os.path.isfile(candidates[0]):
        candidates = sorted(glob.glob(os.path.join(model_path, "*.safetensors")))
    if not candidates:
        pickles = sorted(
            {os.path.basename(p) for pat in _PICKLE_PATTERNS for p in glob.glob(os.path.join(model_path, pat))}
        )
        if pickles:
            raise ModelLoadError(
                f"{model_path}: only pickle weights found ({', '.join(pickles)}); pickle weights are not loaded "
                "for safety; convert to safetensors"
            )
        raise ModelLoadError(
            f"{model_path}: no weight file found; looked for {SINGLE_FILE}, {INDEX_FILE} and *.safetensors"
        )
    mapping: dict[str, str] = {}
    for path in candidates:
        with _open(path) as f:
            for name in f.keys():
                mapping[name] = path
    return mapping


def _read_index(model_path: str, index_path: str) -> dict[str, str]:
    try:
        with open(index_path, encoding="utf-8") as f:
            weight_map = json.load(f)["weight_map"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ModelLoadError(f"{index_path}: cannot read its 'weight_map': {e}") from e
    mapping = {name: os.path.join(model_path, shard) for name, shard in weight_map.items()}
    for shard in sorted(set(mapping.values())):
        if not os.path.isfile(shard):
            raise ModelLoadError(f"{index_path} references shard {os.path.basename(shard)!r}, which does not exist")
    return mapping


def _open(path: str):
    try:
        # Read on the host (memory-mapped); copy_ into the device parameter converts dtype in one pass.
        return safe_open(path, framework="pt", device="cpu")
    except Exception as e:  # safetensors raises its own error types for corrupt headers
        raise ModelLoadError(f"{path}: not a readable safetensors file: {e}") from e


def _fill_from_files(targets: dict[str, WeightTarget], files: dict[str, str], tied: bool) -> None:
    missing = [n for n in targets if n not in files]
    if missing:
        shown = ", ".join(missing[:5]) + (f" (and {len(missing) - 5} more)" if len(missing) > 5 else "")
        raise ModelLoadError(f"tensor {shown} missing from checkpoint {', '.join(sorted(set(files.values())))}")
    for name, path in files.items():
        if name not in targets and not _is_harmless(name, tied):
            raise ModelLoadError(f"unexpected tensor {name!r} in {path}: the model has no such parameter")
    if tied and _TIED_HEAD in files and _EMBEDDING in files:
        _check_tied_head_equals_embedding(files[_TIED_HEAD], files[_EMBEDDING])
    by_file: dict[str, list[str]] = {}
    for name in targets:
        by_file.setdefault(files[name], []).append(name)
    for path, names in by_file.items():
        with _open(path) as f:
            present = set(f.keys())
            for name in names:
                if name not in present:
                    raise ModelLoadError(f"tensor {name!r} is mapped to {path} but that file does not contain it")
                target = targets[name]
                view = f.get_slice(name)
                found = tuple(view.get_shape())
                expected = target.checkpoint_shape
                if found != expected:
                    raise ModelLoadError(
                        f"shape mismatch for tensor {name!r} in {path}: expected {expected}, found {found}"
                    )
                if target.zero:
                    continue
                if target.dim is None:
                    target.tensor.copy_(f.get_tensor(name))
                else:
                    # Only this rank's rows (or columns) are read from the memory-mapped file.
                    index = [slice(None)] * len(found)
                    index[target.dim] = slice(target.start, target.start + target.length)
                    target.destination().copy_(view[tuple(index)])


def _is_harmless(name: str, tied: bool) -> bool:
    return name.endswith(_HARMLESS_SUFFIXES) or (tied and name == _TIED_HEAD)


def _check_tied_head_equals_embedding(head_path: str, embedding_path: str) -> None:
    """A tied model's checkpoint may carry its head, as a copy of the embedding. A different head would be thrown
    away silently (transformers 5 keeps it untied instead): refused, in row chunks to bound host memory."""
    with _open(head_path) as head_file, _open(embedding_path) as embedding_file:
        head, embedding = head_file.get_slice(_TIED_HEAD), embedding_file.get_slice(_EMBEDDING)
        rows = head.get_shape()[0]
        same = head.get_shape() == embedding.get_shape()
        for start in range(0, rows, _TIED_CHECK_ROWS):
            if not same:
                break
            chunk = slice(start, min(start + _TIED_CHECK_ROWS, rows))
            same = torch.equal(head[chunk], embedding[chunk])
    if not same:
        raise ModelLoadError(
            f"config.json sets tie_word_embeddings, but {_TIED_HEAD!r} in {head_path} differs from {_EMBEDDING!r}: "
            "set tie_word_embeddings to false to use that head, or remove it from the checkpoint to tie them"
        )
