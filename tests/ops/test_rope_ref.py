import pytest
import torch
from transformers import LlamaConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

from infercore.ops import apply_rope, rope_cos_sin_cache

HEAD_DIM = 64
SCALINGS = [
    None,
    {"rope_type": "default"},
    {"rope_type": "linear", "factor": 2.0},
    {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    },
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64},
    {
        "rope_type": "yarn",
        "factor": 4.0,
        "original_max_position_embeddings": 64,
        "beta_fast": 16,
        "beta_slow": 2,
        "mscale": 0.707,
        "mscale_all_dim": 1.0,
    },
    {"type": "yarn", "factor": 3.0, "original_max_position_embeddings": 128, "attention_factor": 0.9},
]


def _hf_inv_freq(scaling, base, rotary_dim):
    params = dict(scaling or {"rope_type": "default"})
    params["rope_type"] = params.pop("type", params.get("rope_type", "default"))
    params["rope_theta"] = base
    if rotary_dim != HEAD_DIM:
        params["partial_rotary_factor"] = rotary_dim / HEAD_DIM
    cfg = LlamaConfig(
        hidden_size=2 * HEAD_DIM,
        num_attention_heads=2,
        head_dim=HEAD_DIM,
        max_position_embeddings=256,
        rope_parameters=params,
    )
    if params["rope_type"] == "default":
        fn = ROPE_INIT_FUNCTIONS["linear"]  # factor 1 linear == default, and it honours partial_rotary_factor
        cfg.rope_parameters["factor"] = 1.0
        return fn(cfg)
    return ROPE_INIT_FUNCTIONS[params["rope_type"]](cfg)


@pytest.mark.parametrize("scaling", SCALINGS)
@pytest.mark.parametrize("rotary_dim", [HEAD_DIM, HEAD_DIM // 2])
def test_cache_matches_hf_rope_init(scaling, rotary_dim):
    base = 10000.0 if not scaling or scaling.get("rope_type") != "llama3" else 500000.0
    inv_freq, attn_factor = _hf_inv_freq(scaling, base, rotary_dim)
    cache = rope_cos_sin_cache(rotary_dim=rotary_dim, max_positions=300, base=base, scaling=scaling)
    assert cache.shape == (300, rotary_dim) and cache.dtype == torch.float32
    angles = torch.arange(300, dtype=torch.float32)[:, None] * inv_freq[None, :]
    torch.testing.assert_close(cache[:, : rotary_dim // 2], angles.cos() * attn_factor, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(cache[:, rotary_dim // 2 :], angles.sin() * attn_factor, rtol=1e-6, atol=1e-6)


def test_scaled_caches_differ_from_default():
    # Each scaling must actually change the table (guards against silently ignoring the dict).
    plain = rope_cos_sin_cache(rotary_dim=HEAD_DIM, max_positions=256, base=10000.0)
    for scaling in SCALINGS[2:]:
        scaled = rope_cos_sin_cache(rotary_dim=HEAD_DIM, max_positions=256, base=10000.0, scaling=scaling)
        assert (scaled - plain).abs().max() > 1e-2, scaling


def test_default_cache_matches_hf_rotary_embedding():
    cfg = LlamaConfig(
        hidden_size=128,
        num_attention_heads=2,
        head_dim=HEAD_DIM,
        max_position_embeddings=128,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    )
    pos = torch.arange(128)[None]
    cos, sin = LlamaRotaryEmbedding(cfg)(torch.zeros(1, dtype=torch.float32), pos)
    cache = rope_cos_sin_cache(rotary_dim=HEAD_DIM, max_positions=128, base=10000.0)
    torch.testing.assert_close(cache[:, :32], cos[0, :, :32])
    torch.testing.assert_close(cache[:, 32:], sin[0, :, :32])


def test_apply_rope_neox_matches_hf_llama():
    torch.manual_seed(0)
    t, hq, hk = 11, 4, 2
    q, k = torch.randn(t, hq, HEAD_DIM), torch.randn(t, hk, HEAD_DIM)
    positions = torch.randint(0, 200, (t,))
    cache = rope_cos_sin_cache(rotary_dim=HEAD_DIM, max_positions=256, base=10000.0)
    cos_h, sin_h = cache[positions].chunk(2, dim=-1)
    cos, sin = torch.cat([cos_h, cos_h], -1)[None], torch.cat([sin_h, sin_h], -1)[None]
    q_hf, k_hf = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos, sin)
    q_out, k_out = apply_rope(q, k, positions.int(), cache)
    torch.testing.assert_close(q_out, q_hf[0].transpose(0, 1), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(k_out, k_hf[0].transpose(0, 1), rtol=1e-5, atol=1e-5)


def test_apply_rope_partial_neox_rotates_prefix_only():
    torch.manual_seed(1)
    t, rd = 6, 16
    q, k = torch.randn(t, 3, HEAD_DIM), torch.randn(t, 1, HEAD_DIM)
    positions = torch.arange(40, 40 + t)
    cache = rope_cos_sin_cache(rotary_dim=rd, max_positions=64, base=10000.0)
    q_out, k_out = apply_rope(q, k, positions, cache)
    assert torch.equal(q_out[..., rd:], q[..., rd:]) and torch.equal(k_out[..., rd:], k[..., rd:])
    cos_h, sin_h = cache[positions].chunk(2, dim=-1)
    cos, sin = torch.cat([cos_h, cos_h], -1)[None], torch.cat([sin_h, sin_h], -1)[None]
    q_hf, k_hf = apply_rotary_pos_emb(
        q[..., :rd].transpose(0, 1)[None], k[..., :rd].transpose(0, 1)[None], cos, sin
    )
    torch.testing.assert_close(q_out[..., :rd], q_hf[0].transpose(0, 1), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(k_out[..., :rd], k_hf[0].transpose(0, 1), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("rotary_dim", [HEAD_DIM, 32])
def test_apply_rope_interleaved_is_complex_rotation_of_pairs(rotary_dim):
    torch.manual_seed(2)
    t = 9
    q, k = torch.randn(t, 2, HEAD_DIM), torch.randn(t, 2, HEAD_DIM)
    positions = torch.randint(0, 100, (t,))
    cache = rope_cos_sin_cache(rotary_dim=rotary_dim, max_positions=100, base=10000.0)
    q_out, k_out = apply_rope(q, k, positions, cache, is_neox=False)
    inv_freq = 1.0 / 10000.0 ** (torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim)
    rot = torch.polar(torch.ones(t, rotary_dim // 2, dtype=torch.float64), positions[:, None] * inv_freq)
    for x, out in ((q, q_out), (k, k_out)):
        z = torch.view_as_complex(x[..., :rotary_dim].double().reshape(t, 2, rotary_dim // 2, 2).contiguous())
        expected = torch.view_as_real(z * rot[:, None, :]).reshape(t, 2, rotary_dim)
        torch.testing.assert_close(out[..., :rotary_dim].double(), expected, rtol=1e-5, atol=1e-5)
        assert torch.equal(out[..., rotary_dim:], x[..., rotary_dim:])
    # neox and interleaved really are different layouts
    assert not torch.allclose(apply_rope(q, k, positions, cache, is_neox=True)[0], q_out, atol=1e-3)


def test_apply_rope_bf16_output_dtype_and_inputs_untouched():
    torch.manual_seed(3)
    q, k = torch.randn(4, 2, 32, dtype=torch.bfloat16), torch.randn(4, 1, 32, dtype=torch.bfloat16)
    q0 = q.clone()
    cache = rope_cos_sin_cache(rotary_dim=32, max_positions=16, base=10000.0)
    qo, ko = apply_rope(q, k, torch.arange(4), cache)
    assert qo.dtype == ko.dtype == torch.bfloat16
    assert torch.equal(q, q0)
    ref, _ = apply_rope(q.float(), k.float(), torch.arange(4), cache)
    assert torch.equal(qo, ref.to(torch.bfloat16))


def test_rope_errors_name_the_argument():
    cache = rope_cos_sin_cache(rotary_dim=16, max_positions=8, base=10000.0)
    q, k, pos = torch.randn(3, 2, 16), torch.randn(3, 1, 16), torch.arange(3)
    with pytest.raises(ValueError, match="apply_rope: q"):
        apply_rope(q[0], k, pos, cache)
    with pytest.raises(TypeError, match="apply_rope: k"):
        apply_rope(q, k.half(), pos, cache)
    with pytest.raises(ValueError, match="apply_rope: k"):
        apply_rope(q, k[:2], pos, cache)
    with pytest.raises(TypeError, match="apply_rope: positions"):
        apply_rope(q, k, pos.float(), cache)
    with pytest.raises(ValueError, match="apply_rope: positions"):
        apply_rope(q, k, pos[:2], cache)
    with pytest.raises(ValueError, match="apply_rope: cos_sin_cache"):
        apply_rope(q[..., :8], k[..., :8], pos, cache)
    with pytest.raises(ValueError, match="rope_cos_sin_cache: rotary_dim"):
        rope_cos_sin_cache(rotary_dim=15, max_positions=8, base=10000.0)
    with pytest.raises(ValueError, match="rope_cos_sin_cache: base"):
        rope_cos_sin_cache(rotary_dim=16, max_positions=8, base=-1.0)
    with pytest.raises(ValueError, match="rope_cos_sin_cache: scaling rope_type 'dynamic'"):
        rope_cos_sin_cache(rotary_dim=16, max_positions=8, base=1e4, scaling={"rope_type": "dynamic"})
    with pytest.raises(ValueError, match="rope_cos_sin_cache: scaling is missing key 'short_factor'"):
        rope_cos_sin_cache(rotary_dim=16, max_positions=8, base=1e4,
                           scaling={"rope_type": "longrope", "original_max_position_embeddings": 4})
    longrope = {"rope_type": "longrope", "original_max_position_embeddings": 4, "factor": 2.0,
                "short_factor": [1.0] * 8, "long_factor": [1.0] * 7}
    with pytest.raises(ValueError, match=r"rope_cos_sin_cache: scaling\['long_factor'\] must be a list of 8"):
        rope_cos_sin_cache(rotary_dim=16, max_positions=8, base=1e4, scaling=longrope)
    no_factor = {k: v for k, v in longrope.items() if k != "factor"} | {"long_factor": [1.0] * 8}
    with pytest.raises(ValueError, match="rope_cos_sin_cache: scaling is missing key 'factor'"):
        rope_cos_sin_cache(rotary_dim=16, max_positions=8, base=1e4, scaling=no_factor)
    with pytest.raises(ValueError, match="rope_cos_sin_cache: seq_len"):
        rope_cos_sin_cache(rotary_dim=16, max_positions=8, base=1e4, seq_len=0)
    with pytest.raises(ValueError, match="rope_cos_sin_cache: scaling is missing key 'factor'"):
        rope_cos_sin_cache(rotary_dim=16, max_positions=8, base=1e4, scaling={"rope_type": "linear"})
