"""Shared fixtures for the loading tests: the real SmolLM2-135M GGUF and transformers' view of it."""

from __future__ import annotations

from pathlib import Path

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
