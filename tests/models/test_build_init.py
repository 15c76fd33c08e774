"""build_model(init="normal") gives identity norms for both RMSNorm forms (random-weight speed runs)."""

import torch

from infercore.models import build_model
from infercore.models.gemma3 import Gemma3Config
from infercore.models.llama import RMSNorm


def test_random_init_norms_are_identity_for_offset_and_plain_forms():
    cfg = Gemma3Config.from_hf(dict(
        model_type="gemma3_text", vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, head_dim=16, sliding_window=4,
        layer_types=["sliding_attention", "full_attention"]))
    model = build_model(cfg, dtype=torch.float32, device="cpu", init="normal")
    norms = [m for m in model.modules() if isinstance(m, RMSNorm)]
    assert norms and all(m.offset == 1.0 for m in norms)
    x = torch.randn(3, 32)
    for m in norms:
        if m.weight.shape[0] == 32:
            y = m(x)
            torch.testing.assert_close(y, x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + m.eps))


def test_forward_rejects_bad_step_arguments():
    """Every family shares models.hybrid.check_step: bad ids/positions/cache lists name the argument."""
    import pytest

    from infercore.models import ModelConfig

    llama = build_model(ModelConfig.from_hf(dict(
        model_type="llama", vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1)), dtype=torch.float32, device="cpu", init="normal")
    gemma = build_model(Gemma3Config.from_hf(dict(
        model_type="gemma3_text", vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, head_dim=16, sliding_window=4,
        layer_types=["sliding_attention", "full_attention"])), dtype=torch.float32, device="cpu", init="normal")
    ids = torch.zeros(3, dtype=torch.long)
    for model in (llama, gemma):
        with pytest.raises(ValueError, match="input_ids and positions"):
            model(ids[None], ids[None], [None, None], None)
        with pytest.raises(ValueError, match="input_ids and positions"):
            model(ids, ids[:2], [None, None], None)
        with pytest.raises(ValueError, match="kv_caches"):
            model(ids, ids, [None], None)


def test_build_skips_module_init_and_keeps_torch_init_intact():
    """Building on the meta device runs no module initialisation (a meta normal_ would import torch._dynamo and
    sympy, seconds of a one-shot CLI run) and leaves torch.nn.init as it was; tied weights stay tied."""
    import subprocess
    import sys

    code = (
        "import sys, torch\n"
        "from infercore.models import ModelConfig, build_model\n"
        "init = torch.nn.init.normal_\n"
        "m = build_model(ModelConfig.from_hf(dict(model_type='llama', vocab_size=64, hidden_size=32,"
        " intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,"
        " tie_word_embeddings=True)), dtype=torch.float32, device='cpu', init='empty')\n"
        "assert torch.nn.init.normal_ is init\n"
        "assert m.lm_head.weight is m.model.embed_tokens.weight\n"
        "assert all(p.device.type == 'cpu' for p in m.parameters())\n"
        "print(sorted(k for k in ('torch._dynamo', 'sympy') if k in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
