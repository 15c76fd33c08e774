"""Bad arguments to the public ops raise TypeError / ValueError naming the argument (not AttributeError,
ZeroDivisionError, IndexError, silent NaN...). (Negative state slots are padding, not bad input:
tests/hybrid/test_padding_slots.py.)"""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import dataclasses  # noqa: E402
import math  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

from infercore import ops  # noqa: E402
from infercore.ops.conv1d import triton as conv_triton  # noqa: E402
from infercore.ops.gated_delta import triton as gdr_triton  # noqa: E402
from infercore.ops.mamba import triton as mamba_triton  # noqa: E402

_KERNELS = (conv_triton, gdr_triton, mamba_triton)  # importing them registers the "triton" implementations
i32 = torch.int32
inf = math.inf


def _t(*shape):
    return torch.randn(*shape)


def _slots(*s):
    return torch.tensor(s, dtype=i32)


# Small valid inputs; each case below breaks one argument.
Q, KC = _t(2, 4, 8), _t(4, 2, 2, 8)
ATT = dict(seq_lens=_slots(3, 2), block_table=_slots(0, 1, 2, 3).view(2, 2), scale=0.35)
K1, POS, SM = _t(2, 2, 8), _slots(2, 1), _slots(2, 5)
CS = ops.rope_cos_sin_cache(rotary_dim=8, max_positions=16, base=1e4)
CU1, NO_INIT = _slots(0, 3), torch.tensor([False])
X2, W8 = _t(3, 8), _t(8)
PREV = torch.ones(2, 1, dtype=i32)
LINEAR0 = {"type": "linear", "factor": 0}


def _decode(k_cache=KC, v_cache=None, **kw):
    return ops.paged_attention_decode(Q, k_cache, k_cache.clone() if v_cache is None else v_cache, **{**ATT, **kw})


def _prefill(k_cache):
    return ops.paged_attention_prefill(Q, k_cache, KC.clone(), cu_seqlens_q=_slots(0, 1, 2), **ATT)


def _rope_write(k=K1, v=None, k_cache=None, v_cache=None, **kw):
    kc = torch.zeros(4, 2, 2, 8) if k_cache is None else k_cache
    vc = torch.zeros(4, 2, 2, 8) if v_cache is None else v_cache
    return ops.rope_and_write_kv_cache_(Q, k, k.clone() if v is None else v, POS, CS, kc, vc, SM, **kw)


def _rope_decode(k_cache):
    return ops.rope_write_decode_attention(Q, K1, K1.clone(), POS, CS, k_cache, KC.clone(), SM, **ATT)


def _gdr_chunk(T=3, hk=2, pool_slots=2, **kw):
    return ops.chunk_gated_delta_rule_(
        _t(T, hk, 4), _t(T, hk, 4), _t(T, 2, 4), -torch.rand(T, 2), torch.rand(T, 2), torch.zeros(pool_slots, 2, 4, 4),
        cu_seqlens=CU1, state_slots=_slots(0), has_initial_state=NO_INIT, **kw,
    )  # fmt: skip


def _gdr_decode(hk=2):
    return ops.fused_recurrent_gated_delta_rule_(
        _t(3, hk, 4), _t(3, hk, 4), _t(3, 2, 4), -torch.rand(3, 2), torch.rand(3, 2), torch.zeros(4, 2, 4, 4),
        state_slots=_slots(0, 1, 2),
    )  # fmt: skip


def _mamba_scan(G=1, pool_slots=2, **kw):
    return ops.mamba_chunk_scan_(
        _t(3, 2, 4), _t(3, 2), -torch.rand(2), _t(3, G, 8), _t(3, G, 8), torch.zeros(pool_slots, 2, 4, 8),
        cu_seqlens=CU1, state_slots=_slots(0), has_initial_state=NO_INIT, **kw,
    )  # fmt: skip


def _ssu(x=None, G=1):
    return ops.selective_state_update_(
        _t(2, 2, 4) if x is None else x, _t(2, 2), -torch.rand(2), _t(2, G, 8), _t(2, G, 8), torch.zeros(3, 2, 4, 8),
        state_slots=_slots(0, 1),
    )  # fmt: skip


def _conv_prefill(conv_state):
    return ops.causal_conv1d_prefill_(
        _t(3, 4), _t(4, 3), conv_state, cu_seqlens=CU1, state_slots=_slots(0), has_initial_state=NO_INIT
    )


def _sample_params(b=2):
    return ops.SamplingTensors.from_lists(temperature=[1.0] * b)


BAD = {
    # 1. non-finite Python scalars
    "rms_norm offset inf": (lambda: ops.rms_norm(X2, W8, eps=1e-6, offset=inf), ValueError, "rms_norm: offset"),
    "rms_norm eps inf": (lambda: ops.rms_norm(X2, W8, eps=inf), ValueError, "rms_norm: eps"),
    "rms_norm eps -inf": (lambda: ops.rms_norm(X2, W8, eps=-inf), ValueError, "rms_norm: eps"),
    "attention scale inf": (lambda: _decode(scale=inf), ValueError, "paged_attention_decode: scale"),
    "attention softcap inf": (lambda: _decode(softcap=inf), ValueError, "paged_attention_decode: softcap"),
    # 2. a non-tensor KV cache
    "decode k_cache str": (lambda: _decode("kc", KC), TypeError, "paged_attention_decode: k_cache"),
    "prefill k_cache str": (lambda: _prefill("kc"), TypeError, "paged_attention_prefill: k_cache"),
    "rope decode k_cache str": (lambda: _rope_decode("kc"), TypeError, "rope_write_decode_attention: k_cache"),
    "rope write k_cache str": (lambda: _rope_write(k_cache="kc"), TypeError, "rope_and_write_kv_cache_: k_cache"),
    "rope write v_cache str": (lambda: _rope_write(v_cache="vc"), TypeError, "rope_and_write_kv_cache_: v_cache"),
    # 3. a non-tensor x
    "conv update x str": (
        lambda: ops.causal_conv1d_update_("x", _t(4, 3), torch.zeros(3, 4, 2), state_slots=_slots(0, 1)),
        TypeError, "causal_conv1d_update_: x",
    ),
    "selective update x str": (lambda: _ssu(x="x"), TypeError, "selective_state_update_: x"),
    # 4. zero heads / groups / pages / page size
    "gdr chunk 0 heads": (lambda: _gdr_chunk(hk=0), ValueError, "chunk_gated_delta_rule_: q must have heads"),
    "gdr decode 0 heads": (lambda: _gdr_decode(hk=0), ValueError, "fused_recurrent_gated_delta_rule_: q"),
    "mamba scan 0 groups": (lambda: _mamba_scan(G=0), ValueError, "mamba_chunk_scan_: B must have groups"),
    "selective update 0 groups": (lambda: _ssu(G=0), ValueError, "selective_state_update_: B"),
    "decode page_size 0": (lambda: _decode(_t(4, 0, 2, 8)), ValueError, "decode: k_cache must have page_size"),
    "decode 0 pages": (lambda: _decode(_t(0, 2, 2, 8)), ValueError, "decode: k_cache must have num_pages"),
    "prefill 0 pages": (lambda: _prefill(_t(0, 2, 2, 8)), ValueError, "prefill: k_cache must have num_pages"),
    "rope write 0 pages": (
        lambda: _rope_write(k_cache=_t(0, 2, 2, 8), v_cache=_t(0, 2, 2, 8)), ValueError, "k_cache must have num_pages",
    ),
    "write_kv page_size 0": (
        lambda: ops.write_kv_cache_(K1, K1, _t(4, 0, 2, 8), _t(4, 0, 2, 8), SM), ValueError, "write_kv_cache_: k_cache",
    ),
    # 5. empty state pools
    "conv prefill empty pool": (
        lambda: _conv_prefill(torch.zeros(0, 4, 2)), ValueError, "conv_state must have num_slots",
    ),
    "conv update empty pool": (
        lambda: ops.causal_conv1d_update_(_t(2, 4), _t(4, 3), torch.zeros(0, 4, 2), state_slots=_slots(0, 1)),
        ValueError, "causal_conv1d_update_: conv_state",
    ),
    "gdr chunk empty pool": (lambda: _gdr_chunk(pool_slots=0), ValueError, "state_pool must have num_slots"),
    "mamba scan empty pool": (lambda: _mamba_scan(pool_slots=0), ValueError, "mamba_chunk_scan_: state_pool"),
    # 7. empty vocab
    "sample vocab 0": (lambda: ops.sample(_t(2, 0), _sample_params()), ValueError, "sample: logits must have vocab"),
    # 8. filters and penalty
    "top_k rows": (
        lambda: ops.apply_top_k_top_p_min_p(_t(2, 8), _slots(1, 2, 3), torch.ones(2), torch.zeros(2)),
        ValueError, "apply_top_k_top_p_min_p: top_k",
    ),
    "top_k float tensor": (
        lambda: ops.apply_top_k_top_p_min_p(_t(2, 8), torch.ones(2), 0.9, 0.0), TypeError, "top_k",
    ),
    "top_k float": (lambda: ops.apply_top_k_top_p_min_p(_t(2, 8), 1.5, 0.9, 0.0), TypeError, "top_k"),
    "top_k -5": (lambda: ops.apply_top_k_top_p_min_p(_t(2, 8), -5, 0.9, 0.0), ValueError, "top_k must be >= 0"),
    "top_p 1.5": (lambda: ops.apply_top_k_top_p_min_p(_t(2, 8), 3, 1.5, 0.0), ValueError, "top_p must be in"),
    "top_p int tensor": (lambda: ops.apply_top_k_top_p_min_p(_t(2, 8), 3, _slots(1, 1), 0.0), TypeError, "top_p"),
    "min_p -1": (lambda: ops.apply_top_k_top_p_min_p(_t(2, 8), 3, 0.9, -1), ValueError, "min_p must be in"),
    "min_p 2-D": (lambda: ops.apply_top_k_top_p_min_p(_t(2, 8), 3, 0.9, torch.zeros(2, 1)), ValueError, "min_p"),
    "top_k 1-D logits": (
        lambda: ops.apply_top_k_top_p_min_p(_t(8), _slots(1), torch.ones(1), torch.zeros(1)), ValueError, "logits",
    ),
    "top_k vocab 0": (lambda: ops.apply_top_k_top_p_min_p(_t(2, 0), 3, 0.9, 0.0), ValueError, "logits must have"),
    "penalty prev rows": (
        lambda: ops.apply_repetition_penalty(_t(2, 8), torch.tensor([[1], [2], [3]]), torch.ones(2)),
        ValueError, "apply_repetition_penalty: prev_tokens",
    ),
    "penalty float prev": (
        lambda: ops.apply_repetition_penalty(_t(2, 8), torch.tensor([[1.0], [2.0]]), torch.ones(2)),
        TypeError, "apply_repetition_penalty: prev_tokens",
    ),
    "penalty rows": (
        lambda: ops.apply_repetition_penalty(_t(2, 8), PREV, torch.ones(3)), ValueError, r"penalty must be \[2\]",
    ),
    "penalty 0": (lambda: ops.apply_repetition_penalty(_t(2, 8), PREV, 0.0), ValueError, "penalty must be > 0"),
    "penalty int logits": (
        lambda: ops.apply_repetition_penalty(torch.ones(2, 8, dtype=i32), PREV, 1.2),
        TypeError, "apply_repetition_penalty: logits",
    ),
    # 9. SamplingTensors.from_lists checks its Python values
    "from_lists top_k 1.5": (
        lambda: ops.SamplingTensors.from_lists(temperature=[1.0], top_k=[1.5]), TypeError, "SamplingTensors: top_k",
    ),
    "from_lists top_k 2**40": (
        lambda: ops.SamplingTensors.from_lists(temperature=[1.0], top_k=[2**40]), ValueError, "SamplingTensors: top_k",
    ),
    "from_lists seeds 2**70": (
        lambda: ops.SamplingTensors.from_lists(temperature=[1.0], seeds=[2**70]), ValueError, "SamplingTensors: seeds",
    ),
    "from_lists temperature scalar": (
        lambda: ops.SamplingTensors.from_lists(temperature=1.0), TypeError, "SamplingTensors: temperature",
    ),
    "from_lists temperature str": (
        lambda: ops.SamplingTensors.from_lists(temperature=["a"]), TypeError, "SamplingTensors: temperature",
    ),
    "from_lists temperature inf": (
        lambda: ops.SamplingTensors.from_lists(temperature=[inf]), ValueError, "SamplingTensors: temperature",
    ),
    "from_lists penalty inf": (
        lambda: ops.SamplingTensors.from_lists(temperature=[1.0], repetition_penalty=[inf]),
        ValueError, "SamplingTensors: repetition_penalty",
    ),
    # 10. no experts
    "moe 0 experts": (
        lambda: ops.moe_experts_routed(_t(3, 8), _t(0, 8, 8), _t(0, 8, 4), torch.rand(3, 2), torch.zeros(3, 2).long()),
        ValueError, "moe_experts_routed: gate_up must have num_experts",
    ),
    # 11. rope tables
    "inv_freq scaling str": (
        lambda: ops.rope_inv_freq(rotary_dim=8, base=1e4, scaling="linear"), TypeError, "rope_inv_freq: scaling",
    ),
    "inv_freq no factor": (
        lambda: ops.rope_inv_freq(rotary_dim=8, base=1e4, scaling={"rope_type": "linear"}),
        ValueError, "rope_inv_freq: scaling is missing key 'factor'",
    ),
    "inv_freq unknown type": (
        lambda: ops.rope_inv_freq(rotary_dim=8, base=1e4, scaling={"rope_type": "dynamic"}),
        ValueError, "rope_inv_freq: scaling rope_type",
    ),
    "inv_freq rotary_dim 7": (lambda: ops.rope_inv_freq(rotary_dim=7, base=1e4), ValueError, "rotary_dim must be"),
    "inv_freq rotary_dim 8.5": (
        lambda: ops.rope_inv_freq(rotary_dim=8.5, base=1e4), TypeError, "rope_inv_freq: rotary_dim",
    ),
    "inv_freq rotary_dim 0": (lambda: ops.rope_inv_freq(rotary_dim=0, base=1e4), ValueError, "rotary_dim must be"),
    "inv_freq base -1": (lambda: ops.rope_inv_freq(rotary_dim=8, base=-1.0), ValueError, "rope_inv_freq: base"),
    "cache linear factor 0": (
        lambda: ops.rope_cos_sin_cache(rotary_dim=8, max_positions=4, base=1e4, scaling=LINEAR0),
        ValueError, r"rope_cos_sin_cache: scaling\['factor'\] must be",
    ),
    "cache yarn factor -2": (
        lambda: ops.rope_cos_sin_cache(rotary_dim=8, max_positions=4, base=1e4, scaling={
            "rope_type": "yarn", "factor": -2.0, "original_max_position_embeddings": 16}),
        ValueError, r"scaling\['factor'\]",
    ),
    "cache yarn original max 0": (
        lambda: ops.rope_cos_sin_cache(rotary_dim=8, max_positions=4, base=1e4, scaling={
            "rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 0}),
        ValueError, r"scaling\['original_max_position_embeddings'\]",
    ),
    "cache llama3 low_freq_factor 0": (
        lambda: ops.rope_cos_sin_cache(rotary_dim=8, max_positions=4, base=1e4, scaling={
            "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 16}),
        ValueError, r"scaling\['low_freq_factor'\]",
    ),
    "cache max_positions 2.0": (
        lambda: ops.rope_cos_sin_cache(rotary_dim=8, max_positions=2.0, base=1e4), TypeError, "max_positions",
    ),
    # 12. rope + KV write dtypes and flags
    "rope write v dtype": (lambda: _rope_write(v=K1.half()), TypeError, "rope_and_write_kv_cache_: v must have"),
    "rope write is_neox str": (lambda: _rope_write(is_neox="no"), TypeError, "rope_and_write_kv_cache_: is_neox"),
    "apply_rope is_neox str": (
        lambda: ops.apply_rope(Q, K1, POS, CS, is_neox="no"), TypeError, "apply_rope: is_neox",
    ),
    "gated norm flag str": (
        lambda: ops.gated_rms_norm(X2, X2, W8, eps=1e-6, norm_before_gate="no"), TypeError, "norm_before_gate",
    ),
    "gdr use_qk_l2norm str": (lambda: _gdr_chunk(use_qk_l2norm="no"), TypeError, "use_qk_l2norm"),
    "mamba dt_softplus None": (lambda: _mamba_scan(dt_softplus=None), TypeError, "dt_softplus"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_argument_raises_naming_it(case):
    call, exc, match = BAD[case]
    with pytest.raises(exc, match=match):
        call()


def test_filters_take_python_scalars_for_every_row():
    logits = _t(3, 16)
    k, p, m = torch.full((3,), 4, dtype=i32), torch.full((3,), 0.9), torch.full((3,), 0.05)
    want = ops.apply_top_k_top_p_min_p(logits, k, p, m)
    torch.testing.assert_close(ops.apply_top_k_top_p_min_p(logits, 4, 0.9, 0.05), want)
    # any k >= vocab is "off", so a huge Python int is fine
    torch.testing.assert_close(ops.apply_top_k_top_p_min_p(logits, 2**40, 1.0, 0), ops.apply_top_k_top_p_min_p(
        logits, 0, 1.0, 0.0))  # fmt: skip
    prev = torch.tensor([[1, -1], [2, 3], [-1, -1]])
    torch.testing.assert_close(ops.apply_repetition_penalty(logits, prev, 1.3),
                               ops.apply_repetition_penalty(logits, prev, torch.full((3,), 1.3)))  # fmt: skip


@pytest.mark.parametrize("field", ["temperature", "repetition_penalty"])
def test_check_values_refuses_inf_in_tensors_built_directly(field):
    """``from_lists`` refuses inf in its Python lists; tensors put in a SamplingTensors directly are only
    checked by ``check_values`` (it reads them back: one sync), which must refuse inf too."""
    params = dataclasses.replace(_sample_params(), **{field: torch.tensor([1.0, inf])})
    with pytest.raises(ValueError, match=f"sample: {field}"):
        params.check_values()
