import os

import pytest
import torch

# Triton kernels are tested on the CPU through the interpreter; it must be chosen before triton is
# first imported (by any test module). On a CUDA machine the compiled kernels run instead.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

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
