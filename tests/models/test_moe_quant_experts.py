"""``quantize(model, scheme, experts=True)``: the stacked routed experts as weight-only int8 / fp8 codes (CPU).

The reference is the same model quantized without its experts, whose experts then hold the weights the codes stand
for (``dequantize_experts``): logits through prefill and decode must equal it; and they must differ from the
unquantized experts' (the codes are really used)."""

from __future__ import annotations

import pytest
import torch
from paged_harness import PagedRunner, ours_from_hf
from test_moe_llama import PROMPTS, tiny_moe

from infercore.models import load_model
from infercore.models.moe import SparseMoeBlock, StackedExperts, quantize_expert_weights
from infercore.ops.moe import dequantize_experts
from infercore.quant import quantize

SCHEMES = {"w8a16": torch.int8, "fp8-wo": torch.float8_e4m3fn, "fp8-wo-block": torch.float8_e4m3fn}


def _dequantized_experts_(model, scheme: str) -> None:
    """Give every stacked-experts module the weights its codes would stand for under ``scheme`` (in place)."""
    kind = {"w8a16": "int8", "fp8-wo": "fp8", "fp8-wo-block": "fp8-block"}[scheme]
    for mod in model.modules():
        if isinstance(mod, StackedExperts):
            for name in ("gate_up_proj", "down_proj"):
                w = getattr(mod, name)
                codes, scale = quantize_expert_weights(w.detach(), kind)
                with torch.no_grad():
                    w.copy_(dequantize_experts(codes, scale, w.dtype))


def _logits(model) -> list[torch.Tensor]:
    r = PagedRunner(model)
    out = [r.step(list(enumerate(PROMPTS)))]
    for step in range(2):
        out.append(r.step([(i, [5 + i + step]) for i in range(len(PROMPTS))]))
    return out


@pytest.mark.parametrize("scheme", list(SCHEMES))
@pytest.mark.parametrize("kind", ["mixtral", "qwen2_moe", "qwen3_moe"])
def test_quantized_experts_equal_their_dequantized_weights(kind, scheme, tmp_path):
    hf = tiny_moe(kind)
    model, _ = ours_from_hf(hf, tmp_path)
    quantize(model, scheme, experts=True)
    blocks = [m for m in model.modules() if isinstance(m, SparseMoeBlock)]
    assert blocks and all(b.experts.gate_up_proj.dtype == SCHEMES[scheme] for b in blocks)
    assert all(b.experts.down_scale.dtype == torch.float32 for b in blocks)
    ref = load_model(tmp_path, dtype=torch.float32, device="cpu")[0]
    quantize(ref, scheme)
    plain = _logits(ref)
    _dequantized_experts_(ref, scheme)
    for got, want, base in zip(_logits(model), _logits(ref), plain):
        err = (got - want).abs().max().item()
        assert err < 1e-4 * want.abs().max().item(), err
        assert (got - base).abs().max().item() > 10 * err  # the experts' codes are what ran


def test_deepseek_experts_quantized(tmp_path):
    """DeepSeek's MoE block (shared experts beside the routed ones) takes the quantized experts too."""
    from test_deepseek import tiny

    tiny("v3").save_pretrained(tmp_path, safe_serialization=True)
    model = load_model(tmp_path, dtype=torch.float32, device="cpu")[0]
    quantize(model, "fp8-wo-block", experts=True)
    assert any(isinstance(m, StackedExperts) and m.gate_up_proj.dtype == torch.float8_e4m3fn for m in model.modules())
    ref = load_model(tmp_path, dtype=torch.float32, device="cpu")[0]
    quantize(ref, "fp8-wo-block")
    _dequantized_experts_(ref, "fp8-wo-block")
    for got, want in zip(_logits(model), _logits(ref)):
        assert (got - want).abs().max().item() < 1e-4 * want.abs().max().item()


def test_cpu_packed_experts_dropped_when_quantized(tmp_path):
    """A model whose experts were oneDNN-packed for the CPU (bf16) drops those copies when its experts are quantized,
    and runs the codes."""
    from infercore.models.layout import cpu_packing_supported, pack_linears_for_cpu_

    model, _ = ours_from_hf(tiny_moe("mixtral"), tmp_path)
    model = model.to(torch.bfloat16)
    pack_linears_for_cpu_(model)
    block = next(m for m in model.modules() if isinstance(m, SparseMoeBlock))
    assert (block.cpu_packed_experts is not None) == cpu_packing_supported(torch.bfloat16)
    quantize(model, "w8a16", experts=True)
    assert block.cpu_packed_experts is None and block.experts.gate_up_proj.dtype == torch.int8
    assert torch.isfinite(_logits(model)[0]).all()


def test_save_and_load_quantized_keep_the_expert_codes(tmp_path):
    """``save_quantized`` / ``load_quantized`` carry the experts' codes and scales: the reloaded model gives the same
    logits."""
    from infercore.quant import load_quantized, save_quantized

    model, _ = ours_from_hf(tiny_moe("qwen2_moe"), tmp_path / "hf")
    quantize(model, "fp8-wo", experts=True)
    save_quantized(model, tmp_path / "q.safetensors")
    fresh = load_model(tmp_path / "hf", dtype=torch.float32, device="cpu")[0]
    load_quantized(fresh, tmp_path / "q.safetensors")
    ex = next(m for m in fresh.modules() if isinstance(m, StackedExperts))
    assert ex.gate_up_proj.dtype == torch.float8_e4m3fn and ex.down_scale is not None
    for got, want in zip(_logits(fresh), _logits(model)):
        torch.testing.assert_close(got, want)


def test_refusals_name_the_argument(tmp_path):
    from infercore.lora.layers import _lora_experts
    from infercore.parallel.tensor import _shard_moe_

    model, _ = ours_from_hf(tiny_moe("mixtral"), tmp_path)
    with pytest.raises(ValueError, match="experts"):
        quantize(model, "w4a16-g128", experts=True)
    with pytest.raises(ValueError, match="no stacked routed experts"):  # everything skipped: nothing to quantize
        quantize(model, "w8a16", experts=True, skip=("model",))
    assert all(m.gate_up_scale is None for m in model.modules() if isinstance(m, StackedExperts))  # nothing changed
    quantize(model, "w8a16", experts=True)
    block = next(m for m in model.modules() if isinstance(m, SparseMoeBlock))
    with pytest.raises(ValueError, match="quantize_"):
        block.experts.quantize_("int8")
    with pytest.raises(ValueError, match="kind"):
        StackedExperts(2, 8, 4).quantize_("int4")
    with pytest.raises(ValueError, match="block"):
        StackedExperts(2, 8, 4).quantize_("fp8-block", block=0)
    with pytest.raises(ValueError, match="tensor_parallel_"):
        _shard_moe_(block, 2, 0, by_expert=False)
    assert not _lora_experts(block, 1)  # no adapter slots on int8 / fp8 experts


def test_engine_from_pretrained_quantize_experts(tmp_path):
    """``Engine.from_pretrained(..., quantization="w8a16", quantize_experts=True)`` runs the int8 experts and gives
    the tokens of the model quantized by hand; the flag is checked before the load."""
    from infercore.engine import Engine, SamplingParams

    hf = tiny_moe("qwen3_moe")
    hf.save_pretrained(tmp_path, safe_serialization=True)
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    eng = Engine.from_pretrained(str(tmp_path), device="cpu", dtype=torch.float32, quantization="w8a16",
                                 quantize_experts=True, num_pages=64, page_size=4)  # fmt: skip
    assert any(isinstance(m, StackedExperts) and m.gate_up_proj.dtype == torch.int8 for m in eng.model.modules())
    model = load_model(tmp_path, dtype=torch.float32, device="cpu")[0]
    by_hand = Engine(quantize(model, "w8a16", experts=True), num_pages=64, page_size=4)
    assert [o.token_ids for o in eng.generate(PROMPTS, params)] == [
        o.token_ids for o in by_hand.generate(PROMPTS, params)]
    with pytest.raises(ValueError, match="quantize_experts"):
        Engine.from_pretrained(str(tmp_path), device="cpu", quantize_experts=True)
    with pytest.raises(ValueError, match="experts"):
        Engine.from_pretrained(str(tmp_path), device="cpu", quantization="w4a16-g128", quantize_experts=True)
