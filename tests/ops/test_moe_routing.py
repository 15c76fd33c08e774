"""Fused softmax-top-k routing (Triton, CPU interpreter) against the torch sequence HF runs."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

import infercore.ops  # noqa: E402,F401
from infercore.devices import implementation  # noqa: E402
from infercore.ops import moe_route_topk  # noqa: E402


@pytest.mark.parametrize("T,E,k", [(5, 8, 2), (3, 60, 4), (2, 128, 8), (4, 40, 10), (1, 16, 3), (0, 8, 2)])
@pytest.mark.parametrize("renormalize", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_matches_reference(T, E, k, renormalize, dtype):
    torch.manual_seed(T * 1000 + E + k)
    logits = (torch.randn(T, E) * 3).to(dtype)
    ref = implementation("moe_route_topk", "reference")
    fused = implementation("moe_route_topk", "triton")
    w_ref, i_ref = ref(logits, top_k=k, renormalize=renormalize, out_dtype=dtype)
    w, i = fused(logits, top_k=k, renormalize=renormalize, out_dtype=dtype)
    assert w.dtype == dtype and i.dtype == torch.int32 and w.shape == i.shape == (T, k)
    if dtype == torch.float32:
        assert torch.equal(i.long(), i_ref)
    else:  # bf16 logits tie often: any order among equal probabilities, any of them at the k-th place
        probs = torch.softmax(logits.float(), -1)
        assert torch.equal(probs.gather(1, i.long()), probs.gather(1, i_ref))
        assert all(len(set(row)) == k for row in i.tolist())
    torch.testing.assert_close(w.float(), w_ref.float(), rtol=1e-5 if dtype == torch.float32 else 1e-2, atol=1e-6)
    if renormalize and T:
        torch.testing.assert_close(w.float().sum(-1), torch.ones(T), rtol=1e-2, atol=1e-2)


def test_ties_take_the_lower_id_and_bad_inputs_are_named():
    logits = torch.zeros(1, 8)
    logits[0, 5] = logits[0, 2] = 1.0
    w, i = implementation("moe_route_topk", "triton")(logits, top_k=3, renormalize=False)
    assert i.tolist() == [[2, 5, 0]]
    with pytest.raises(ValueError, match="top_k"):
        moe_route_topk(logits, top_k=9, renormalize=True)
    with pytest.raises(ValueError, match="router_logits"):
        moe_route_topk(logits[0], top_k=2, renormalize=True)
    with pytest.raises(TypeError, match="router_logits"):
        moe_route_topk(logits.long(), top_k=2, renormalize=True)
    with pytest.raises(TypeError, match="renormalize"):
        moe_route_topk(logits, top_k=2, renormalize=1)
    with pytest.raises(TypeError, match="out_dtype"):
        moe_route_topk(logits, top_k=2, renormalize=True, out_dtype=torch.int32)


@pytest.mark.gpu
@pytest.mark.parametrize("E,k", [(128, 8), (512, 10), (8, 2)])
def test_on_cuda_at_real_sizes(E, k):
    torch.manual_seed(E)
    logits = torch.randn(64, E, device="cuda") * 2
    w_ref, i_ref = implementation("moe_route_topk", "reference")(logits, top_k=k, renormalize=True)
    w, i = moe_route_topk(logits, top_k=k, renormalize=True)  # dispatched: the Triton kernel
    assert i.dtype == torch.int32 and torch.equal(i.long(), i_ref)
    torch.testing.assert_close(w, w_ref, rtol=1e-5, atol=1e-6)
