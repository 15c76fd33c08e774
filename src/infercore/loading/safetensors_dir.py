"""Hugging Face checkpoint directories: ``config.json`` + ``*.safetensors``.

A directory holds either one ``model.safetensors`` (or any single ``*.safetensors``) or shards
listed by ``model.safetensors.index.json`` (``{"weight_map": {hf_name: shard_file}}``). Tensors
are read one at a time through ``safetensors.safe_open`` (memory-mapped, no pickle), so peak
memory is one tensor beyond what the consumer keeps.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

INDEX_FILE = "model.safetensors.index.json"


def _corrupt(path: Path, detail: Any) -> ValueError:
    return ValueError(f"corrupt or truncated safetensors file {path}: {detail}")


def _check_dir(path: str | os.PathLike) -> Path:
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"path: expected a str or os.PathLike, got {type(path).__name__}")
    root = Path(path)
    if not root.exists():
        raise FileNotFoundError(f"checkpoint directory not found: {root}")
    if not root.is_dir():
        raise ValueError(f"expected a checkpoint directory, got a file: {root}")
    return root


def read_config(path: str | os.PathLike) -> dict[str, Any]:
    """The parsed ``config.json`` of an HF checkpoint directory."""
    root = _check_dir(path)
    config_file = root / "config.json"
    if not config_file.is_file():
        raise FileNotFoundError(f"no config.json in checkpoint directory {root}")
    return _read_json_object(config_file)


def _read_json_object(file: Path) -> dict[str, Any]:
    try:
        with open(file, encoding="utf-8") as f:
            obj = json.load(f, object_hook=_decode_special_floats)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"invalid JSON in {file}: {e}") from None
    if not isinstance(obj, dict):
        raise ValueError(f"{file} must hold a JSON object, got {type(obj).__name__}")
    return obj


def safetensors_files(path: str | os.PathLike) -> list[Path]:
    """The weight files of a directory: the shards named by the index, else every ``*.safetensors``."""
    root = _check_dir(path)
    index = root / INDEX_FILE
    if index.is_file():
        weight_map = _read_json_object(index).get("weight_map")
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise ValueError(f"invalid safetensors index {index}: expected a 'weight_map' of tensor name -> shard file")
        # Shards are plain file names next to the index; anything else would read outside the checkpoint.
        odd = [name for name in weight_map.values() if Path(name).name != name or name in ("", ".", "..")]
        if odd:
            raise ValueError(f"invalid safetensors index {index}: shard names must be file names, got {odd[:4]}")
        files = [root / name for name in dict.fromkeys(weight_map.values())]
        missing = [str(f) for f in files if not f.is_file()]
        if missing:
            raise FileNotFoundError(f"{index} lists shards that do not exist: {missing}")
        return files
    files = sorted(root.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files (and no {INDEX_FILE}) in {root}")
    return files


def iter_safetensors(
    path: str | os.PathLike, dtype: torch.dtype | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """``(hf_name, tensor)`` for every tensor of the directory, cast to ``dtype`` (None keeps the
    stored dtype), shard by shard in index order.

    Raises ``ValueError("... corrupt or truncated safetensors file <path>: <detail>")`` when a file's
    header does not parse or its data does not match the header (the safetensors library checks
    that the header's offsets cover the file exactly).
    """
    from safetensors import SafetensorError, safe_open

    if dtype is not None and not isinstance(dtype, torch.dtype):
        raise TypeError(f"dtype: expected a torch.dtype or None, got {dtype!r}")
    seen: set[str] = set()
    for file in safetensors_files(path):
        try:
            handle = safe_open(str(file), framework="pt", device="cpu")
        except SafetensorError as e:
            raise _corrupt(file, e) from None
        except (OSError, ValueError, RuntimeError) as e:
            raise _corrupt(file, e) from None
        with handle as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                if name in seen:
                    raise ValueError(f"tensor {name!r} appears in more than one shard (again in {file})")
                seen.add(name)
                try:
                    tensor = f.get_tensor(name)
                except SafetensorError as e:
                    raise _corrupt(file, f"tensor {name!r}: {e}") from None
                # Casting integer/bool data to a float dtype "works" and gives a silently wrong model. MXFP4 codes
                # and scales (uint8 ``*_blocks`` / ``*_scales``, GPT-OSS's experts) go uncast to the model's
                # loader, which decodes them (a model that takes none refuses the names).
                if dtype is not None and not tensor.is_floating_point():
                    if tensor.dtype == torch.uint8 and name.endswith(("_blocks", "_scales")):
                        yield name, tensor
                        continue
                    raise ValueError(
                        f"tensor {name!r} in {file} has dtype {tensor.dtype}, expected a floating-point weight"
                    )
                yield name, tensor if dtype is None else tensor.to(dtype)


def _decode_special_floats(obj: dict):
    # transformers writes non-finite floats as {"__float__": "Infinity"} (JSON has no inf/nan)
    if len(obj) == 1 and "__float__" in obj:
        return float(obj["__float__"])
    return obj
