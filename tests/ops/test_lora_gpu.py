"""Multi-LoRA Triton kernels at real shapes in bf16 on a CUDA GPU (``pytest -m gpu``), against the reference in fp32.

Shapes of an 8B Llama (K = 4096): qkv N = 6144 with bounds (4096, 5120), gate_up N = 28672 with bound 14336;
S = 8 adapter slots, ranks 16 and 64, batches 1 to 256 with every slot, repeats and -1 mixed in.
"""

import functools

import pytest
import torch

import infercore.ops  # noqa: F401
from infercore.devices import implementation, resolve
from infercore.ops import lora_expand_, lora_shrink
from infercore.ops.lora import triton as lora_triton

pytestmark = pytest.mark.gpu
DEV = "cuda"
BF16 = torch.bfloat16
K, S = 4096, 8
SHAPES = {"qkv": (6144, (4096, 5120)), "gate_up": (28672, (14336,))}


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def indices(T: int) -> torch.Tensor:
    idx = torch.arange(T, device=DEV, dtype=torch.int32) * 5 % S  # every slot once T >= 8, then repeats
    idx[1::7] = -1
    return idx


def test_triton_selected_on_cuda():
    assert resolve("lora_shrink", DEV).name == "triton"
    assert resolve("lora_expand_", DEV).name == "triton"


@pytest.mark.parametrize("T", [1, 4, 8, 16, 64, 256])
@pytest.mark.parametrize("rank", [16, 64])
@pytest.mark.parametrize("proj", ["qkv", "gate_up"])
@pytest.mark.parametrize("kernel", ["default", "grouped", "grouped-sorted"])
def test_shrink_expand_bf16(proj, rank, T, kernel):
    torch.manual_seed(T + rank)
    N, bounds = SHAPES[proj]
    ns = len(bounds) + 1
    x = torch.randn(T, K, device=DEV, dtype=BF16)
    a = (torch.randn(S, ns * rank, K, device=DEV) * K**-0.5).to(BF16)
    b = (torch.randn(S, N, rank, device=DEV) * rank**-0.5).to(BF16)
    y = (torch.randn(T, N, device=DEV) * 0.1).to(BF16)  # the LoRA delta (~1) dominates, so its error shows
    idx = indices(T)
    # the public ops (their default kernels), or the grouped kernels with the engine's order (sorted on the host)
    # or none given (they sort themselves)
    kw = dict(order=torch.argsort(idx.cpu(), stable=True).to(DEV)) if kernel == "grouped-sorted" else {}
    shrink, expand = lora_shrink, lora_expand_
    if kernel != "default":
        shrink = functools.partial(lora_triton.lora_shrink, grouped=True)
        expand = functools.partial(lora_triton.lora_expand_, grouped=True)
    s = shrink(x, a, idx, **kw)
    s_ref = implementation("lora_shrink", "reference")(x.float(), a.float(), idx)
    assert s.dtype == torch.float32 and rel(s, s_ref) < 1e-5
    y0 = y.clone()
    out = expand(y, s_ref, b, idx, slice_bounds=bounds, **kw)
    y_ref = implementation("lora_expand_", "reference")(y0.float(), s_ref, b.float(), idx, slice_bounds=bounds)
    assert out is y and rel(y, y_ref) < 5e-3  # one bf16 rounding
    none = idx < 0
    if none.any():
        assert torch.equal(y[none], y0[none]) and torch.equal(s[none], torch.zeros_like(s[none]))


@pytest.mark.parametrize("T", [4, 16])
@pytest.mark.parametrize("grouped", [False, True])
def test_graph_capture_reads_indices_on_device(T, grouped, monkeypatch):
    # Captured once, replayed with other slots (and their slot order) written into the same buffers: the kernels
    # must read both on the device (no host copy of them baked into the graph). Grouped: from 8 tokens, as the engine
    # runs them with GROUPED_MIN_TOKENS set.
    if grouped:
        monkeypatch.setattr(lora_triton, "GROUPED_MIN_TOKENS", 8)
    N, bounds = SHAPES["qkv"]
    rank = 16
    x = torch.randn(T, K, device=DEV, dtype=BF16)
    a = (torch.randn(S, 3 * rank, K, device=DEV) * K**-0.5).to(BF16)
    b = (torch.randn(S, N, rank, device=DEV) * rank**-0.5).to(BF16)
    y = torch.zeros(T, N, device=DEV, dtype=BF16)
    idx = torch.zeros(T, device=DEV, dtype=torch.int32)
    order = torch.arange(T, device=DEV)
    lora_expand_(y, lora_shrink(x, a, idx, order=order), b, idx, slice_bounds=bounds, order=order)  # compile first
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        y.zero_()
        lora_expand_(y, lora_shrink(x, a, idx, order=order), b, idx, slice_bounds=bounds, order=order)
    for new in (indices(T), torch.full((T,), 3, device=DEV, dtype=torch.int32)):
        idx.copy_(new)
        order.copy_(torch.argsort(new.cpu(), stable=True))
        g.replay()
        want = torch.zeros(T, N, device=DEV)
        s_ref = implementation("lora_shrink", "reference")(x.float(), a.float(), new)
        implementation("lora_expand_", "reference")(want, s_ref, b.float(), new, slice_bounds=bounds)
        assert rel(y, want) < 5e-3
