"""GPTQ / AWQ checkpoint directories through ``Engine.from_pretrained`` / ``load_model``.

The checkpoints are packed by ``engine_helpers.write_prequantized``, written from the formats' descriptions,
not by ``infercore.quant.packing``. The reference is the transformers model whose linears hold the dequantized
weights ``(q - z) * s``."""

import pytest
import torch
from engine_helpers import hf_greedy, write_prequantized

from infercore import Engine, SamplingParams
from infercore.models import load_model
from infercore.quant import QuantLinear

PROMPTS = [[(7 * i + 3 * j + 1) % 96 for j in range(5 + 4 * i)] for i in range(3)]
GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)


@pytest.mark.parametrize("method, bits, group, v2, act_order", [
    ("gptq", 4, 16, False, False), ("gptq", 8, 32, False, False), ("gptq", 4, 16, True, False),
    ("gptq", 4, -1, False, False), ("awq", 4, 16, False, False), ("gptq", 4, 16, False, True),
    ("gptq", 8, 16, True, True)])
def test_prequantized_checkpoint_matches_the_dequantized_reference(tmp_path, method, bits, group, v2, act_order):
    path, ref = write_prequantized(tmp_path, method, bits, group, v2, act_order=act_order)
    eng = Engine.from_pretrained(str(path), device="cpu", dtype=torch.float32, page_size=4, num_pages=128)
    quant = [m for m in eng.model.modules() if isinstance(m, QuantLinear)]
    assert len(quant) == 2 * 4  # qkv, o, gate_up, down per layer: q/k/v and gate/up merged
    outs = eng.generate(PROMPTS, GREEDY)
    for p, o in zip(PROMPTS, outs):
        assert o.token_ids == hf_greedy(ref, p, 16)
    # the merged weights equal the reference's dequantized ones
    qkv_proj = eng.model.model.layers[0].self_attn.qkv_proj
    qkv = qkv_proj.qweight_format.dequantize()
    attn = ref.model.layers[0].self_attn
    want = torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight])
    assert (qkv_proj.in_perm is not None) == act_order
    if act_order:  # stored in group order: column j is the layer's input channel in_perm[j]
        assert not torch.equal(qkv_proj.in_perm, torch.arange(want.shape[1]))
        want = want[:, qkv_proj.in_perm]
    torch.testing.assert_close(qkv, want, rtol=0, atol=1e-6)


def test_prequantized_defaults_to_bf16_and_runs_the_packed_cpu_path(tmp_path):
    path, ref = write_prequantized(tmp_path, "gptq", 4, 16)
    eng = Engine.from_pretrained(str(path), device="cpu", page_size=4, num_pages=64)
    assert eng.dtype == torch.bfloat16
    model, _, _ = load_model(str(path), dtype=torch.float32, device="cpu")
    assert sum(isinstance(m, QuantLinear) for m in model.modules()) == 8
    out = eng.generate(PROMPTS[:1], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))[0]
    assert len(out.token_ids) == 4


def test_partly_dense_projection_and_dense_lm_head(tmp_path):
    # o_proj left dense: it loads as an nn.Linear beside the quantized ones
    path, ref = write_prequantized(tmp_path, "gptq", 4, 16, skip=("o_proj",))
    eng = Engine.from_pretrained(str(path), device="cpu", dtype=torch.float32, page_size=4, num_pages=128)
    assert not isinstance(eng.model.model.layers[0].self_attn.o_proj, QuantLinear)
    assert [o.token_ids for o in eng.generate(PROMPTS, GREEDY)] == [hf_greedy(ref, p, 16) for p in PROMPTS]


@pytest.mark.parametrize("kw, match", [
    (dict(act_order="split"), "different act-order channel orders"),
    (dict(extra_cfg={"quant_method": "hqq"}), "quant_method 'hqq' is not supported"),
    (dict(extra_cfg={"quant_method": "bitsandbytes"}), "neither load_in_4bit nor load_in_8bit"),
    (dict(extra_cfg={"checkpoint_format": "marlin"}), "checkpoint_format 'marlin'"),
    (dict(method="awq", extra_cfg={"version": "gemv"}), "AWQ version 'gemv'"),
    (dict(group_cfg=0), "group_size"),
    (dict(skip=("k_proj",)), "quantized only in part"),
    (dict(group_cfg=12), "group_size"),  # the tensors say 16: 12 does not divide K
])
def test_bad_prequantized_checkpoints_are_refused(tmp_path, kw, match):
    args = {"method": kw.pop("method", "gptq")}
    path, _ = write_prequantized(tmp_path, args["method"], 4, 16, **kw)
    with pytest.raises(ValueError, match=match):
        Engine.from_pretrained(str(path), device="cpu", page_size=4, num_pages=64)


def test_missing_part_and_requantization_are_refused(tmp_path):
    from safetensors.torch import load_file, save_file

    path, _ = write_prequantized(tmp_path, "gptq", 4, 16)
    with pytest.raises(ValueError, match="already a GPTQ checkpoint|is a GPTQ checkpoint"):
        Engine.from_pretrained(str(path), device="cpu", quantization="w8a16")
    state = load_file(str(path / "model.safetensors"))
    del state["model.layers.1.mlp.down_proj.qzeros"]
    save_file(state, str(path / "model.safetensors"))
    with pytest.raises(ValueError, match=r"model.layers.1.mlp.down_proj .*misses \['qzeros'\]"):
        load_model(str(path), dtype=torch.float32, device="cpu")
