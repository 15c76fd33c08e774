"""Shared fixtures for the loading tests: the real SmolLM2-135M GGUF and transformers' view of it."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

# infercore is imported inside the fixtures: a directory's conftest is loaded before tests/conftest.py's
# pytest_configure picks TRITON_INTERPRET when the directory is named on the command line (`pytest tests/loading`).


@pytest.fixture(scope="session")
def smollm_path() -> Path:
    from infercore.loading import default_model_path

    return default_model_path()


@pytest.fixture(scope="session")
def smollm(smollm_path: Path):
    from infercore.loading import GGUFFile

    return GGUFFile(smollm_path)


@pytest.fixture(scope="session")
def ref_reader(smollm_path: Path):
    """The reference `gguf` package's reader of the real file (slow to open: share it)."""
    import gguf

    return gguf.GGUFReader(smollm_path)


@pytest.fixture(scope="session")
def hf_gguf_state_dict(smollm_path: Path) -> dict[str, torch.Tensor]:
    """transformers' own GGUF loading of the file (dequantized with the `gguf` package, q/k rows
    un-permuted), as fp32. `from_pretrained(gguf_file=...)` needs `accelerate`, which is not a
    dependency, so this calls the function it delegates to for llama: `load_gguf_checkpoint`."""
    from transformers import AutoConfig, LlamaForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    config = AutoConfig.from_pretrained(smollm_path.parent, gguf_file=smollm_path.name)
    with torch.device("meta"):  # only its parameter names are used
        model = LlamaForCausalLM(config)
    out = load_gguf_checkpoint(
        str(smollm_path), return_tensors=True, model_to_load=model, torch_dtype=torch.float32
    )
    return out["tensors"]


@pytest.fixture(scope="session")
def hf_gguf_tokenizer(smollm_path: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm_path.parent, gguf_file=smollm_path.name)


def _write_gguf(
    path: Path,
    *,
    arch: str = "llama",
    tensors: dict[str, tuple[np.ndarray, Any]] | None = None,
    kv: Callable[[Any], Any] | None = None,
    alignment: int | None = None,
) -> Path:
    """Write a GGUF with the reference `gguf` package. `tensors` maps name -> (array, raw_dtype):
    raw_dtype None stores a float array as-is (F32/F16); otherwise the array holds that type's
    blocks as uint8 in gguf's byte shape. `kv(writer)` adds metadata."""
    import gguf

    w = gguf.GGUFWriter(str(path), arch)
    if alignment is not None:
        w.add_custom_alignment(alignment)
    if kv is not None:
        kv(w)
    for name, (arr, raw_dtype) in (tensors or {}).items():
        w.add_tensor(name, arr, raw_dtype=raw_dtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture
def write_gguf() -> Callable[..., Path]:
    return _write_gguf
