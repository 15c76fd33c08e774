"""FP8 checkpoint directories (``quant_method`` ``"fp8"`` / ``"fbgemm_fp8"``, ModelOpt FP8, compressed-tensors
``float-quantized`` / ``naive-quantized``) through ``Engine.from_pretrained`` / ``load_model``.

The ``"fp8"`` checkpoints are quantized by transformers' own ``Fp8Quantize`` (``finegrained_fp8``: e4m3 weights
and a multiplied ``weight_scale_inv``) and dequantized for the reference by its ``_dequantize_fp8_weight``; a
quantized lm_head with a partial block, the straddling-shard case, the fbgemm and the ModelOpt checkpoints are
written by this file's own code from the formats' descriptions (``scale = amax / 448``, ``weight = e4m3(w /
scale)``); the compressed-tensors checkpoints are quantized by compressed-tensors itself and dequantized by its
``dequantize``. The reference is the transformers model whose linears hold the dequantized weights."""

import json
import math
from types import SimpleNamespace

import pytest
import torch
from engine_helpers import LINEARS, check_prequantized_on_cuda, hf_greedy, tiny_hf

from infercore import Engine, SamplingParams
from infercore.loading.prequantized import prequantized_config
from infercore.models import load_model
from infercore.quant import QuantLinear

PROMPTS = [[(7 * i + 3 * j + 1) % 96 for j in range(5 + 4 * i)] for i in range(3)]
GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
# q / k / v, gate / up and down hold whole 128-row blocks (a merged projection's block scales concatenate exactly)
BLOCKED = dict(hidden_size=256, intermediate_size=384, num_attention_heads=4, num_key_value_heads=2)
L0 = "model.layers.0.self_attn.k_proj"


def _targets(state, skip=()):
    return [
        n.rpartition(".")[0]
        for n in state
        if n.endswith(".weight") and n.split(".")[-2] in LINEARS and n.split(".")[-2] not in skip
    ]


def _save(tmp_path, hf, state, qc, *, hf_quant=None, mutate=None):
    from safetensors.torch import save_file

    if mutate is not None:
        mutate(state)
    save_file({k: v.contiguous() for k, v in state.items()}, str(tmp_path / "model.safetensors"))
    cfg = hf.config.to_dict()
    if qc is not None:
        cfg["quantization_config"] = qc
    if hf_quant is not None:
        (tmp_path / "hf_quant_config.json").write_text(json.dumps(hf_quant))
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    return tmp_path, hf


def per_tensor(w):
    """``(e4m3 weight, fp32 scale, dequantized)`` with one scale ``amax / 448`` (ModelOpt / AutoFP8)."""
    s = (w.abs().amax() / 448.0).float()
    q = (w / s).clamp(-448, 448).to(torch.float8_e4m3fn)
    return q, s, q.float() * s


def per_block(w, b=128):
    """``(e4m3 weight, fp32 [ceil(N/b), ceil(K/b)] scales, dequantized)``; partial blocks at the edges."""
    n, k = w.shape
    nb, kb = math.ceil(n / b), math.ceil(k / b)
    pad = torch.zeros(nb * b, kb * b)
    pad[:n, :k] = w
    s = pad.reshape(nb, b, kb, b).abs().amax((1, 3)) / 448.0
    full = s.repeat_interleave(b, 0).repeat_interleave(b, 1)[:n, :k]
    q = (w / full).clamp(-448, 448).to(torch.float8_e4m3fn)
    return q, s, q.float() * full


def write_native(tmp_path, *, block=True, scale_leaf=None, exclude_key="modules_to_not_convert", quant_lm_head=False,
                 static=False, mutate=None, own=False, **hf_overrides):
    """A tiny Llama ``quant_method: "fp8"`` directory quantized by transformers' ``Fp8Quantize`` (``own``: by
    :func:`per_block`), and the reference. ``scale_leaf`` renames the per-tensor scale (``"weight_scale"``: vLLM /
    AutoFP8); ``static`` adds ``input_scale`` s and ``activation_scheme: "static"``; ``quant_lm_head`` quantizes the
    lm_head (96 rows: a partial block) with :func:`per_block`."""
    size = [128, 128] if block else None
    if not own:
        from transformers.integrations.finegrained_fp8 import Fp8Quantize, _dequantize_fp8_weight

        quantizer = Fp8Quantize(SimpleNamespace(quantization_config=SimpleNamespace(weight_block_size=size,
                                                                                    scale_fmt=None)))
    hf = tiny_hf("llama", **hf_overrides)
    state = {k: v.contiguous() for k, v in hf.state_dict().items()}
    for base in _targets(state):
        if own:
            q, s, deq = per_block(state.pop(f"{base}.weight"))
            out = {f"{base}.weight": q, f"{base}.weight_scale_inv": s}
        else:
            out = quantizer._quantize_one(f"{base}.weight", state.pop(f"{base}.weight"))
            assert out[f"{base}.weight"].dtype == torch.float8_e4m3fn, base  # every target quantized
            deq = _dequantize_fp8_weight(out[f"{base}.weight"], out[f"{base}.weight_scale_inv"], size, torch.float32)
        if scale_leaf is not None:
            out[f"{base}.{scale_leaf}"] = out.pop(f"{base}.weight_scale_inv").reshape(())
        if static:
            out[f"{base}.input_scale"] = torch.tensor(0.02)
        state.update(out)
        hf.get_submodule(base).weight.data.copy_(deq)
    if quant_lm_head:
        q, s, deq = per_block(state.pop("lm_head.weight"))
        state.update({"lm_head.weight": q, "lm_head.weight_scale_inv": s})
        hf.lm_head.weight.data.copy_(deq)
    qc = {"quant_method": "fp8", "activation_scheme": "static" if static else "dynamic", "fmt": "e4m3",
          "weight_block_size": size, exclude_key: [] if quant_lm_head else ["lm_head"]}
    return _save(tmp_path, hf, state, qc, mutate=mutate)


def write_modelopt(tmp_path, *, algo="FP8", style="config", exclude=("lm_head",), skip=(), kv_scales=False,
                   inner=None, mutate=None, **hf_overrides):
    """A tiny Llama ModelOpt FP8 directory (``algo`` ``FP8``: a scale per tensor, each shard its own;
    ``FP8_PER_CHANNEL_PER_TOKEN``: ``[N]``; ``FP8_PB_WO``: ``[N/128, 1, K/128, 1]``) and the reference."""
    hf = tiny_hf("llama", **hf_overrides)
    state = {k: v.contiguous() for k, v in hf.state_dict().items()}
    targets = _targets(state, skip) + ([] if "lm_head" in exclude else ["lm_head"])
    for base in targets:
        w = state.pop(f"{base}.weight")
        if algo == "FP8":
            q, s, deq = per_tensor(w)
            state[f"{base}.input_scale"] = torch.tensor(0.02)
        elif algo == "FP8_PER_CHANNEL_PER_TOKEN":
            s = w.abs().amax(1) / 448.0
            q = (w / s[:, None]).to(torch.float8_e4m3fn)
            deq = q.float() * s[:, None]
        else:
            q, s, deq = per_block(w)
            s = s[:, None, :, None]
        state.update({f"{base}.weight": q, f"{base}.weight_scale": s})
        if kv_scales and base.endswith(("k_proj", "v_proj")):
            state[f"{base}.{base[-6]}_scale"] = torch.tensor(0.01)
        hf.get_submodule(base).weight.data.copy_(deq)
    quant = {"quant_algo": algo, "exclude_modules": list(exclude), "kv_cache_quant_algo": "FP8" if kv_scales else None}
    quant.update(inner or {})
    if style == "config":
        qc = {"quant_method": "modelopt", "quant_algo": quant.pop("quant_algo"), "ignore": quant.pop("exclude_modules"),
              "producer": {"name": "modelopt", "version": "0.39.0"}}
        qc.update({k: v for k, v in quant.items() if k != "kv_cache_quant_algo"})
        return _save(tmp_path, hf, state, qc, mutate=mutate)
    return _save(tmp_path, hf, state, None, hf_quant={"producer": {"name": "modelopt"}, "quantization": quant},
                 mutate=mutate)


def write_ct(tmp_path, *, preset="FP8_DYNAMIC", weight_only=False, ignore=("lm_head",), cfg_update=None,
             **hf_overrides):
    """A tiny Llama compressed-tensors FP8 directory quantized by compressed-tensors (``weight_only``: the preset's
    weights without input activations, ``naive-quantized``) and the reference holding its own dequantization."""
    from compressed_tensors.compressors.naive_quantized import NaiveQuantizationCompressor
    from compressed_tensors.quantization import QuantizationConfig, QuantizationScheme, preset_name_to_scheme
    from compressed_tensors.quantization.lifecycle.forward import dequantize
    from compressed_tensors.quantization.utils import calculate_qparams

    scheme = preset_name_to_scheme(preset, ["Linear"])
    if weight_only:
        scheme = QuantizationScheme(targets=["Linear"], weights=scheme.weights)
    args = scheme.weights
    hf = tiny_hf("llama", **hf_overrides)
    state = {k: v.contiguous() for k, v in hf.state_dict().items()}
    for base in _targets(state):
        w = state.pop(f"{base}.weight")
        if args.strategy == "tensor":
            lo, hi = w.amin().reshape(1), w.amax().reshape(1)
        elif args.strategy == "channel":
            lo, hi = w.amin(1, keepdim=True), w.amax(1, keepdim=True)
        else:
            blocks = w.reshape(w.shape[0] // 128, 128, w.shape[1] // 128, 128)
            lo, hi = blocks.amin((1, 3)), blocks.amax((1, 3))
        scale, zp = calculate_qparams(lo, hi, args)
        out = NaiveQuantizationCompressor.compress({"weight": w, "weight_scale": scale, "weight_zero_point": zp},
                                                   scheme)
        state.update({f"{base}.{k}": v for k, v in out.items()})
        if preset == "FP8" and not weight_only:  # the static activation scale
            state[f"{base}.input_scale"] = torch.tensor([0.02])
        deq = dequantize(out["weight"], out["weight_scale"], args=args, dtype=torch.float32)
        hf.get_submodule(base).weight.data.copy_(deq)
    qc = QuantizationConfig(
        config_groups={"group_0": scheme},
        format="naive-quantized" if weight_only else "float-quantized",
        ignore=list(ignore),
        quantization_status="compressed",
    ).model_dump(mode="json")
    qc.update(cfg_update or {})
    return _save(tmp_path, hf, state, qc)


def _engine(path, **kw):
    return Engine.from_pretrained(str(path), device="cpu", page_size=4, num_pages=128, **kw)


def _check(eng, ref, *, block=None, n_quant=8, lm_head=False):
    """Every linear of the layers is a QuantLinear whose merged weights equal torch.cat of the references' exactly,
    and greedy tokens equal the reference's."""
    quant = [m for m in eng.model.modules() if isinstance(m, QuantLinear)]
    assert len(quant) == n_quant + lm_head  # qkv, o, gate_up, down per layer: q/k/v and gate/up merged
    assert isinstance(eng.model.lm_head, QuantLinear) == lm_head
    for i in range(2):
        attn, ref_attn = eng.model.model.layers[i].self_attn, ref.model.layers[i].self_attn
        w = attn.qkv_proj.qweight_format
        assert w.kind == "fp8" and w.block_size == block
        want = torch.cat([ref_attn.q_proj.weight, ref_attn.k_proj.weight, ref_attn.v_proj.weight])
        torch.testing.assert_close(w.dequantize(), want, rtol=0, atol=0)
        torch.testing.assert_close(attn.o_proj.qweight_format.dequantize(), ref_attn.o_proj.weight, rtol=0, atol=0)
        mlp, ref_mlp = eng.model.model.layers[i].mlp, ref.model.layers[i].mlp
        want = torch.cat([ref_mlp.gate_proj.weight, ref_mlp.up_proj.weight])
        torch.testing.assert_close(mlp.gate_up_proj.qweight_format.dequantize(), want, rtol=0, atol=0)
    if lm_head:
        torch.testing.assert_close(eng.model.lm_head.qweight_format.dequantize(), ref.lm_head.weight, rtol=0, atol=0)
    outs = eng.generate(PROMPTS, GREEDY)
    for p, o in zip(PROMPTS, outs):
        assert o.token_ids == hf_greedy(ref, p, GREEDY.max_tokens)


def test_block_fp8_checkpoint_matches_the_dequantized_reference(tmp_path):
    """Qwen3-FP8 / DeepSeek style: weight_scale_inv [ceil(N/128), ceil(K/128)] multiplied, lm_head's 96 rows a
    partial block."""
    path, ref = write_native(tmp_path, quant_lm_head=True, **BLOCKED)
    q = prequantized_config(json.loads((path / "config.json").read_text()))
    assert q == {"method": "fp8", "format": "fp8", "strategies": ["block"], "exclude": []}
    eng = _engine(path, dtype=torch.float32)
    assert eng.model.lm_head.qweight_format.scales.shape == (1, 2)
    _check(eng, ref, block=128, lm_head=True)


@pytest.mark.parametrize("scale_leaf, static, exclude_key", [(None, False, "modules_to_not_convert"),
                                                             ("weight_scale", True, "ignored_layers")])
def test_per_tensor_fp8_checkpoint_becomes_per_channel(tmp_path, scale_leaf, static, exclude_key):
    """transformers' per-tensor weight_scale_inv [1, 1], or vLLM / AutoFP8's scalar weight_scale with static
    input scales (dropped): each shard's scale is spread over its rows, so q / k / v merge exactly."""
    path, ref = write_native(tmp_path, block=False, scale_leaf=scale_leaf, static=static, exclude_key=exclude_key)
    eng = _engine(path, dtype=torch.float32)
    qkv = eng.model.model.layers[0].self_attn.qkv_proj.qweight_format
    assert qkv.scales.shape == (64,) and len(set(qkv.scales.tolist())) == 3  # q, k and v keep their own scale
    _check(eng, ref)


def write_fbgemm(tmp_path, *, mutate=None):
    """A tiny Llama ``quant_method: "fbgemm_fp8"`` directory written from the format's description (fbgemm's
    ``quantize_fp8_per_row``: each row's scale ``amax / 448`` in ``weight_scale`` [N, 1]), an ``input_scale_ub``
    beside each weight, lm_head dense."""
    hf = tiny_hf("llama")
    state = {k: v.contiguous() for k, v in hf.state_dict().items()}
    for base in _targets(state):
        w = state.pop(f"{base}.weight")
        s = (w.abs().amax(1, keepdim=True) / 448.0).float()
        q = (w / s).clamp(-448, 448).to(torch.float8_e4m3fn)
        state.update({f"{base}.weight": q, f"{base}.weight_scale": s, f"{base}.input_scale_ub": torch.tensor([1200.0])})
        hf.get_submodule(base).weight.data.copy_(q.float() * s)
    qc = {"quant_method": "fbgemm_fp8", "activation_scale_ub": 1200.0, "modules_to_not_convert": ["lm_head"]}
    tmp_path.mkdir(parents=True, exist_ok=True)
    return _save(tmp_path, hf, state, qc, mutate=mutate)


def test_fbgemm_fp8_checkpoint_matches_the_dequantized_reference(tmp_path):
    path, ref = write_fbgemm(tmp_path)
    q = prequantized_config(json.loads((path / "config.json").read_text()))
    assert q == {"method": "fp8", "format": "fbgemm", "strategies": ["channel"], "exclude": ["lm_head"]}
    _check(_engine(path, dtype=torch.float32), ref)
    bad, _ = write_fbgemm(tmp_path / "bad", mutate=_set(f"{L0}.weight_scale", torch.ones(1, 3)))
    with pytest.raises(ValueError, match=r"k_proj.weight_scale holds \[1, 3\], expected \[16\] or \[16, 1\]"):
        _engine(bad)


def test_block_scales_straddling_merged_shards_are_refused(tmp_path):
    path, _ = write_native(tmp_path, own=True)  # q / k / v of 32 / 16 / 16 rows: one 128-row block over all three
    with pytest.raises(ValueError, match=r"shards of model.layers.0.mlp.gate_up_proj have .*gate_proj: 64, .*"
                                         r"up_proj: 64 rows; 128x128 block scales can be merged only"):
        _engine(path)


@pytest.mark.parametrize("algo, style, blocked", [("FP8", "config", False), ("FP8", "hf_quant_config", False),
                                                  ("FP8_PER_CHANNEL_PER_TOKEN", "config", False),
                                                  ("FP8_PB_WO", "hf_quant_config", True)])
def test_modelopt_fp8_checkpoint_matches_the_dequantized_reference(tmp_path, algo, style, blocked):
    path, ref = write_modelopt(tmp_path, algo=algo, style=style, kv_scales=True, **(BLOCKED if blocked else {}))
    eng = _engine(path, dtype=torch.float32)
    _check(eng, ref, block=128 if blocked else None)


def test_modelopt_fp8_quantized_lm_head_bias_and_a_dense_projection(tmp_path):
    path, ref = write_modelopt(tmp_path, exclude=("model.layers.*.self_attn.o_proj",), skip=("o_proj",),
                               attention_bias=True)
    eng = _engine(path)
    assert eng.dtype == torch.bfloat16  # pre-quantized: bf16 by default
    assert len(eng.generate(PROMPTS[:1], GREEDY)[0].token_ids) == GREEDY.max_tokens
    model, _, _ = load_model(str(path), dtype=torch.float32, device="cpu")
    assert isinstance(model.lm_head, QuantLinear)
    assert not isinstance(model.model.layers[1].self_attn.o_proj, QuantLinear)
    o_proj = model.model.layers[1].self_attn.o_proj
    torch.testing.assert_close(o_proj.weight, ref.model.layers[1].self_attn.o_proj.weight)
    qkv, attn = model.model.layers[0].self_attn.qkv_proj, ref.model.layers[0].self_attn
    torch.testing.assert_close(qkv.bias, torch.cat([attn.q_proj.bias, attn.k_proj.bias, attn.v_proj.bias]))
    assert sum(isinstance(m, QuantLinear) for m in model.modules()) == 7


@pytest.mark.parametrize("preset, weight_only", [("FP8", False), ("FP8_DYNAMIC", False), ("FP8_DYNAMIC", True),
                                                 ("FP8_BLOCK", False)])
def test_compressed_tensors_fp8_checkpoint_matches_the_dequantized_reference(tmp_path, preset, weight_only):
    blocked = preset == "FP8_BLOCK"
    path, ref = write_ct(tmp_path, preset=preset, weight_only=weight_only, **(BLOCKED if blocked else {}))
    q = prequantized_config(json.loads((path / "config.json").read_text()))
    assert q["method"] == "fp8" and q["format"] == "compressed-tensors" and q["exclude"] == ["lm_head"]
    eng = _engine(path, dtype=torch.float32)
    _check(eng, ref, block=128 if blocked else None)


def _set(name, value):
    def mutate(state):
        state[name] = value(state[name]) if callable(value) else value

    return mutate


@pytest.mark.parametrize(
    "kw, match",
    [
        (dict(mutate=lambda s: s.pop(f"{L0}.weight_scale")), rf"{L0} has .* but misses 'weight_scale'"),
        (dict(mutate=_set(f"{L0}.weight_scale", torch.ones(3))),
         rf"{L0}.weight_scale holds \[3\], expected one value \(per tensor\) for {L0}.weight \[16, 32\]"),
        (dict(mutate=_set(f"{L0}.weight_scale", torch.tensor(float("nan")))), rf"{L0}.weight_scale holds negative"),
        (dict(mutate=_set(f"{L0}.weight_scale", lambda t: t.to(torch.int32))), rf"{L0}.weight_scale must be float32"),
        (dict(mutate=_set(f"{L0}.weight", lambda t: t.float().to(torch.float8_e5m2))),
         rf"{L0}.weight must be float8_e4m3fn \[N, K\]"),
        (dict(mutate=_set(f"{L0}.weight_zero_point", torch.zeros(1))), rf"{L0}.weight_zero_point: FP8 weights"),
        (dict(mutate=lambda s: [_set(f"{L0}.{p}", lambda t: t[:8])(s) for p in ("weight",)]),
         rf"{L0} holds a \[8, 32\] weight, expected \[16, 32\]"),
        (dict(mutate=_set(f"{L0}.weight", lambda t: t.float())), rf"{L0} has \['input_scale', 'weight_scale'\] but "
                                                                  r"its weight is not stored as float8_e4m3fn"),
        (dict(exclude=("lm_head", "model.layers.0.self_attn*")), r"model.layers.0.self_attn.\w_proj is excluded"),
        (dict(skip=("v_proj",), exclude=("lm_head", "*.v_proj")), "quantized only in part"),
        (dict(algo="FP8_PER_CHANNEL_PER_TOKEN", mutate=_set(f"{L0}.weight_scale", lambda t: t[:4])),
         rf"{L0}.weight_scale holds \[4\], expected \[16\] or \[16, 1\]"),
        (dict(algo="FP8_PB_WO"), r"shards of model.layers.0.mlp.gate_up_proj .* block scales can be merged only"),
        (dict(inner={"quant_algo": "FP8_XYZ"}, style="hf_quant_config"),
         r"hf_quant_config.json.quantization: ModelOpt quant_algo 'FP8_XYZ' is not supported"),
    ],
)
def test_bad_modelopt_fp8_checkpoints_are_refused(tmp_path, kw, match):
    path, _ = write_modelopt(tmp_path, **kw)
    with pytest.raises(ValueError, match=match):
        _engine(path)


def test_fp8_config_over_nvfp4_tensors_is_refused(tmp_path):
    from test_prequantized_nvfp4 import write_modelopt as write_nvfp4

    path, _ = write_nvfp4(tmp_path, inner={"quant_algo": "FP8"}, style="hf_quant_config")
    with pytest.raises(ValueError, match=r"\.weight must be float8_e4m3fn \[N, K\] \(FP8 weights\), got torch.uint8"):
        _engine(path)


def test_requantizing_an_fp8_checkpoint_is_refused(tmp_path):
    path, _ = write_modelopt(tmp_path, style="hf_quant_config")
    with pytest.raises(ValueError, match="is a FP8 checkpoint"):
        Engine.from_pretrained(str(path), device="cpu", quantization="w8a16")


def test_fp8_configs_are_checked():
    native = {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
    weights = {"num_bits": 8, "type": "float", "strategy": "channel", "symmetric": True, "dynamic": False}
    ct = {"quant_method": "compressed-tensors", "format": "float-quantized", "quantization_status": "compressed",
          "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights}}, "ignore": ["lm_head"]}
    # weight-only: any activation scheme is accepted (and ignored)
    assert prequantized_config({"quantization_config": {**native, "activation_scheme": "per-token-whatever"}}) == {
        "method": "fp8", "format": "fp8", "strategies": ["block"], "exclude": []}
    assert prequantized_config({"quantization_config": {"quant_method": "fp8", "activation_scheme": "static",
                                                        "ignored_layers": ["a"], "modules_to_not_convert": ["b"]}}
                               )["exclude"] == ["a", "b"]
    assert prequantized_config({"quantization_config": ct})["strategies"] == ["channel"]
    for q, match in [
        ({**native, "weight_block_size": [64, 64]}, r"weight_block_size: expected \[128, 128\] .*got \[64, 64\]"),
        ({**native, "weight_block_size": [128]}, r"weight_block_size: expected \[128, 128\]"),
        ({**native, "fmt": "e5m2"}, r"fmt: only 'e4m3'"),
        ({**native, "ignored_layers": "lm_head"}, r"quantization_config.ignored_layers: expected a list"),
        ({"quant_method": "modelopt", "quant_algo": "FP8_PB_W4"}, r"quant_algo 'FP8_PB_W4' is not supported"),
    ]:
        with pytest.raises(ValueError, match=match):
            prequantized_config({"quantization_config": q})
    for change, match in [
        ({"strategy": "group", "group_size": 128}, r"strategy: expected one of .* got 'group'"),
        ({"strategy": "block", "block_structure": [64, 64]}, r"block_structure: expected \[128, 128\]"),
        ({"symmetric": False}, "zero points"),
        ({"dynamic": True}, "dynamic weight scales"),
    ]:
        q = json.loads(json.dumps(ct))
        q["config_groups"]["group_0"]["weights"].update(change)
        with pytest.raises(ValueError, match=match):
            prequantized_config({"quantization_config": q})
    for change, match in [
        ({"format": "pack-quantized"}, r"format 'pack-quantized' is not supported for FP8 weights"),
        ({"quantization_status": "frozen"}, r"quantization_status: expected 'compressed'"),
    ]:
        with pytest.raises(ValueError, match=match):
            prequantized_config({"quantization_config": {**ct, **change}})


def test_bad_compressed_tensors_fp8_checkpoints_are_refused(tmp_path):
    path, _ = write_ct(tmp_path, ignore=["lm_head", "re:.*\\.mlp\\.down_proj$"])
    with pytest.raises(ValueError, match="model.layers.0.mlp.down_proj is excluded"):
        _engine(path)


@pytest.mark.gpu
def test_fp8_checkpoint_on_cuda(tmp_path):
    """A block-128 ``quant_method: "fp8"`` directory (this file's own quantizer; emulated FP8 kernels) on CUDA, checked
    as ``engine_helpers.check_prequantized_on_cuda`` says (lm_head excluded: dense)."""
    path, ref = write_native(tmp_path, own=True, **BLOCKED)
    check_prequantized_on_cuda(path, ref)


@pytest.mark.gpu
def test_fbgemm_fp8_checkpoint_on_cuda(tmp_path):
    """A ``quant_method: "fbgemm_fp8"`` directory (per-row scales; the FP8 weight-only kernels) on CUDA, checked as
    ``engine_helpers.check_prequantized_on_cuda`` says (lm_head excluded: dense)."""
    path, ref = write_fbgemm(tmp_path)
    check_prequantized_on_cuda(path, ref)
