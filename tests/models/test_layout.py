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
