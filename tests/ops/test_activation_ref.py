import pytest
import torch
import torch.nn.functional as F

from infercore.ops import gelu_and_mul, silu_and_mul


def test_silu_and_mul_fp32():
    torch.manual_seed(0)
    x = torch.randn(3, 5, 64)
    y = silu_and_mul(x)
    assert y.shape == (3, 5, 32)
    gate, up = x[..., :32], x[..., 32:]
    torch.testing.assert_close(y, gate * torch.sigmoid(gate) * up)
    # Gate and up are not interchangeable: the first half is the gate.
    assert not torch.allclose(y, up * torch.sigmoid(up) * gate)


@pytest.mark.parametrize("approximate", ["tanh", "none"])
def test_gelu_and_mul(approximate):
    torch.manual_seed(1)
    x = torch.randn(7, 48) * 3
    y = gelu_and_mul(x, approximate=approximate)
    g, u = x[:, :24].double(), x[:, 24:].double()
    if approximate == "tanh":
        act = 0.5 * g * (1 + torch.tanh((2 / torch.pi) ** 0.5 * (g + 0.044715 * g**3)))
    else:
        act = 0.5 * g * (1 + torch.erf(g / 2**0.5))
    torch.testing.assert_close(y.double(), act * u, rtol=1e-5, atol=1e-5)


def test_gelu_default_is_tanh_and_differs_from_erf():
    x = torch.linspace(-4, 4, 64).reshape(2, 32)
    assert torch.equal(gelu_and_mul(x), gelu_and_mul(x, approximate="tanh"))
    assert not torch.equal(gelu_and_mul(x, approximate="tanh"), gelu_and_mul(x, approximate="none"))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_low_precision_rounds_once(dtype):
    torch.manual_seed(2)
    x = (torch.randn(16, 128) * 4).to(dtype)
    y = silu_and_mul(x)
    assert y.dtype == dtype
    xf = x.float()
    assert torch.equal(y, (F.silu(xf[:, :64]) * xf[:, 64:]).to(dtype))


def test_activation_errors_name_the_argument():
    with pytest.raises(ValueError, match="silu_and_mul: x last dimension must be even"):
        silu_and_mul(torch.randn(2, 7))
    with pytest.raises(TypeError, match="silu_and_mul: x"):
        silu_and_mul(torch.ones(2, 8, dtype=torch.int64))
    with pytest.raises(ValueError, match="gelu_and_mul: approximate"):
        gelu_and_mul(torch.randn(2, 8), approximate="erf")
    with pytest.raises(ValueError, match="gelu_and_mul: x"):
        gelu_and_mul(torch.tensor(1.0))


def test_gated_act_and_mul_by_name():
    from infercore.ops.activation import gated_act_and_mul

    x = torch.randn(3, 8)
    assert torch.equal(gated_act_and_mul(x, "silu"), silu_and_mul(x))
    assert torch.equal(gated_act_and_mul(x, "gelu_tanh"), gelu_and_mul(x, approximate="tanh"))
    assert torch.equal(gated_act_and_mul(x, "gelu"), gelu_and_mul(x, approximate="none"))
    with pytest.raises(ValueError, match="act"):
        gated_act_and_mul(x, "relu")
