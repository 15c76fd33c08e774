import pytest
import torch
from torch import nn

from infercore.models.layout import CPUPackedLinear, cpu_packing_supported, pack_linears_for_cpu_


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_packed_linear_matches_f_linear_and_follows_weight_writes(dtype):
    if not cpu_packing_supported(dtype):
        # the engine then keeps plain nn.Linear: check that packing declines instead of converting
        m = nn.Sequential(nn.Linear(8, 4, dtype=dtype))
        assert pack_linears_for_cpu_(m) == 0
        return
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(96, 40, dtype=dtype), nn.Linear(40, 24, bias=False, dtype=dtype))
    ref = [nn.functional.linear, nn.functional.linear]
    x = torch.randn(5, 96, dtype=dtype)
    expect = model[1](model[0](x))
    assert pack_linears_for_cpu_(model) == 2
    assert all(isinstance(m, CPUPackedLinear) and isinstance(m, nn.Linear) for m in model)
    tol = dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else dict(atol=3e-2, rtol=3e-2)
    torch.testing.assert_close(model(x), expect, **tol)
    with torch.no_grad():
        model[0].weight.mul_(2.0)  # in-place write: the packed copy must follow
    w0, b0 = model[0].weight, model[0].bias
    torch.testing.assert_close(model[0](x), ref[0](x, w0, b0), **tol)
    assert pack_linears_for_cpu_(model) == 0  # already packed


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_packed_experts_match_the_reference_and_follow_weight_writes(dtype):
    """A MoE block's experts packed for oneDNN (pack_linears_for_cpu_): the block's output equals the reference
    loop's, with an expert-parallel offset too; a write to the weights repacks; an unknown expert is named."""
    from infercore.models.layout import CPUPackedExperts
    from infercore.models.moe import SparseMoeBlock
    from infercore.ops.moe.naive import moe_experts_ref

    torch.manual_seed(0)
    block = SparseMoeBlock(32, num_experts=6, top_k=2, intermediate=16, dtype=dtype)
    with torch.no_grad():
        for p in block.parameters():
            p.copy_(torch.randn_like(p) * 0.2)
    x = torch.randn(7, 32, dtype=dtype)
    expect = block(x)
    converted = pack_linears_for_cpu_(block)
    if not cpu_packing_supported(dtype):
        assert converted == 0 and block.cpu_packed_experts is None
        return
    assert isinstance(block.cpu_packed_experts, CPUPackedExperts)
    tol = dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else dict(atol=3e-2, rtol=3e-2)
    torch.testing.assert_close(block(x), expect, **tol)
    assert pack_linears_for_cpu_(block) == 0  # packed and current
    with torch.no_grad():
        block.experts.down_proj.mul_(-1.5)
    packed = block.cpu_packed_experts
    gu, dn = block.experts.gate_up_proj, block.experts.down_proj
    w = torch.softmax(torch.randn(7, 2), -1)
    ids = torch.randint(0, 6, (7, 2))
    torch.testing.assert_close(block(x), -1.5 * expect, **tol)
    assert block.cpu_packed_experts is not packed  # repacked after the write
    got = block.cpu_packed_experts(x, w, ids + 6, expert_offset=6)
    torch.testing.assert_close(got, moe_experts_ref(x, gu, dn, w, ids + 6, 6), **tol)
    skipped = block.cpu_packed_experts(x, w, ids, expert_offset=6)  # every pair routed elsewhere
    assert torch.count_nonzero(skipped) == 0
    with pytest.raises(ValueError, match="expert id 9"):
        block.cpu_packed_experts(x, w, ids + 9)
    with pytest.raises(ValueError, match="do not match"):
        block.cpu_packed_experts(x[:, :16], w, ids)
    other = torch.float32 if dtype == torch.bfloat16 else torch.bfloat16
    with pytest.raises(TypeError, match="packed for"):
        block.cpu_packed_experts(x.to(other), w, ids)
