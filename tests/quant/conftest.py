import os

import pytest
import torch

# The quant kernel tests run Triton under the CPU interpreter where there is no GPU; the flag must
# be set before any kernel module is imported (``triton.jit`` reads it at decoration time).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture
def graph_matches_eager():
    """``check(call, x=None, rounds=1, each=None)``: ``call()`` (a CUDA op returning a tensor) captured once in a
    CUDA graph; then ``rounds`` times ``x`` is refilled with new values (when given), the graph replayed, and
    its output compared bit for bit with an eager ``call()`` and passed to ``each``. Returns the graph's output.
    The first eager call (repacks, buffers) must come before: allocation is not allowed inside a capture."""

    def check(call, x=None, rounds=1, each=None):
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            y = call()
        for _ in range(rounds):
            if x is not None:
                x.copy_(torch.randn_like(x))
            g.replay()
            torch.cuda.synchronize()
            assert torch.equal(y, call())
            if each is not None:
                each(y)
        return y

    return check


@pytest.fixture
def mode9_calls(monkeypatch):
    """MODE 9 on for the codebook kinds (NF4, FP4) at every row count it can take, 1-16 (the defaults leave 1-2 rows
    to the GEMVs); the returned list records the rows of every ``cuda_mma.matmul`` call."""
    from infercore.quant import cuda_mma, triton_fp4, triton_nf4

    calls = []
    real = cuda_mma.matmul
    monkeypatch.setattr(cuda_mma, "matmul", lambda *a, **kw: calls.append(a[0].shape[0]) or real(*a, **kw))
    monkeypatch.setattr(triton_nf4, "MMA", True)
    monkeypatch.setattr(triton_fp4, "MMA", True)
    monkeypatch.setattr(triton_nf4, "MMA_ROWS", (1, 16))
    monkeypatch.setattr(triton_fp4, "MMA_ROWS", (1, 16))
    return calls
