"""ops.moe.naive.moe_experts_loop (the host loop the packed / quantized expert kernels plug into) against the
reference loop: bit-identical in fp32 (same order), within bf16 rounding in bf16 (one rounding per token instead of
one per pair), expert-parallel offsets, the out-of-range id named."""

import pytest
import torch

from infercore.ops import silu_and_mul
from infercore.ops.moe.naive import moe_experts_loop, moe_experts_ref


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("T,k", [(1, 2), (9, 3), (40, 4)])
def test_loop_equals_the_reference_bit_for_bit(dtype, T, k):
    torch.manual_seed(T * 10 + k)
    E, H, I = 7, 24, 12
    x = torch.randn(T, H, dtype=dtype)
    gate_up = (torch.randn(E, 2 * I, H) * 0.3).to(dtype)
    down = (torch.randn(E, H, I) * 0.3).to(dtype)
    ids = torch.stack([torch.randperm(E)[:k] for _ in range(T)])
    w = torch.softmax(torch.randn(T, k), -1).to(dtype)

    def expert(e, rows):
        return silu_and_mul(rows @ gate_up[e].t()) @ down[e].t()

    def same(a, b):
        if dtype == torch.float32:
            assert torch.equal(a, b)
        else:
            torch.testing.assert_close(a, b, atol=2e-2, rtol=1e-2)

    same(moe_experts_loop(x, w, ids, None, E, expert), moe_experts_ref(x, gate_up, down, w, ids))
    # expert parallelism: this rank holds experts [3, 5) of 7
    part = moe_experts_loop(x, w, ids, 3, 2, lambda e, rows: expert(e + 3, rows))
    same(part, moe_experts_ref(x, gate_up[3:5], down[3:5], w, ids, 3))
    bad = ids.clone()
    bad[0, 0] = E
    with pytest.raises(ValueError, match="expert id 7"):
        moe_experts_loop(x, w, bad, None, E, expert)
