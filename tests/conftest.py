import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

# Triton kernels are tested on the CPU through the interpreter; it must be chosen before the kernels' modules are
# first imported (by any test module), and it holds for the whole process. So the run's marker selection picks it:
# `-m gpu` on a CUDA machine compiles the kernels; any other run (the CPU tests, also on a CUDA machine) interprets.
# Test modules that also say `os.environ.setdefault("TRITON_INTERPRET", "1")` then change nothing;
# without this, collecting one of them in a `-m gpu` run put every GPU test of that worker on the interpreter.


def _selects_gpu_tests(markexpr: str) -> bool:
    return "gpu" in markexpr and "not gpu" not in markexpr


def pytest_configure(config):
    gpu = torch.cuda.is_available() and _selects_gpu_tests(config.getoption("markexpr") or "")
    os.environ.setdefault("TRITON_INTERPRET", "0" if gpu else "1")


# GPU tests carry the `gpu` marker and are deselected by default (pyproject addopts);
# run them on a CUDA machine with `pytest -m gpu`.
torch.manual_seed(0)


@pytest.fixture
def split_attention_through_triton(monkeypatch):
    """``route(module)``: ``module``'s paged-attention ops (its ``dispatch``) go to the Triton kernels
    (the interpreter on the CPU), and engine steps that mix prefill chunks with 2 or more one-query
    rows put those rows through the decode kernel. Returns the list that collects each split
    call's row count (``module.attend_split_decodes``)."""
    from infercore.devices import implementation
    from infercore.engine import runner

    def route(module) -> list[int]:
        kernels = {op: implementation(op, "triton") for op in ("paged_attention_prefill", "paged_attention_decode")}
        real_dispatch, real_attend, split = module.dispatch, module.attend_split_decodes, []
        monkeypatch.setattr(module, "dispatch", lambda op, device: kernels.get(op) or real_dispatch(op, device))

        def attend(o, q, k_cache, v_cache, meta, *a, **kw):
            split.append(meta.num_split_decodes)
            return real_attend(o, q, k_cache, v_cache, meta, *a, **kw)

        monkeypatch.setattr(module, "attend_split_decodes", attend)
        monkeypatch.setattr(runner, "SPLIT_DECODES_MIN", 2)
        return split

    return route


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
