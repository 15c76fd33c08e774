"""Routed experts kept and computed on the host (infercore.offload.offload_experts_): tiny Mixtral / Qwen2-MoE /
Qwen3-MoE models from transformers. On the CPU the Engine's greedy tokens equal transformers' with the experts on
the host, through the host path and through the staging path (a forward of at least ``device_min_tokens``
tokens); the refusals. On CUDA (``gpu``): the device model with host experts against transformers, eager decode
(no graphs), both paths taken."""

import os
import sys

import pytest
import torch

HERE = os.path.dirname(__file__)
sys.path.insert(0, os.path.join(HERE, "..", "models"))

PROMPTS = [[5, 17, 42, 99, 3, 8], [250, 11, 4, 60, 60, 7, 19, 2, 33, 71, 12], [1, 2, 3]]


def _models(kind, tmp_path, **overrides):
    from paged_harness import ours_from_hf
    from test_moe_llama import tiny_moe

    hf = tiny_moe(kind, **overrides)
    return hf, ours_from_hf(hf, str(tmp_path / kind))[0]


@pytest.mark.parametrize("kind", ["mixtral", "qwen2_moe", "qwen3_moe"])
@pytest.mark.parametrize("pack", [False, True])
def test_host_experts_give_transformers_tokens(kind, pack, tmp_path):
    from paged_harness import hf_greedy

    from infercore import Engine, SamplingParams
    from infercore.models.layout import cpu_packing_supported
    from infercore.offload import HostExperts, offload_experts_

    assert cpu_packing_supported(torch.float32)  # x86 builds of torch: oneDNN packs fp32
    hf, model = _models(kind, tmp_path)
    want = [hf_greedy(hf, p, 10) for p in PROMPTS]
    moe_layers = [i for i, layer in enumerate(model.model.layers) if hasattr(layer.mlp, "host_experts")]
    # a long prompt takes the staging path (device_min_tokens=8), decode steps (3 tokens) the host path
    info = offload_experts_(model, device_min_tokens=8, pack=pack)
    assert info["layers"] == moe_layers and info["host_bytes"] > 0 and info["staging_bytes"] > 0
    assert info["packed"] is pack and all((h.packed is not None) is pack for h in model.host_experts.values())
    assert sorted(model.host_experts) == moe_layers
    assert all(isinstance(h, HostExperts) for h in model.host_experts.values())
    assert model.host_synchronizing is False  # nothing to wait for on the CPU
    greedy = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    got = [o.token_ids for o in Engine(model, page_size=4, num_pages=64).generate(PROMPTS, greedy)]
    assert got == want
    h = next(iter(model.host_experts.values()))
    assert h.calls_host > 0 and h.calls_device > 0


def test_packed_only_host_experts(tmp_path):
    """Without the staging path the packed copies are the only ones: the expert parameters are empty, and the
    tokens are still transformers'."""
    from paged_harness import hf_greedy

    from infercore import Engine, SamplingParams
    from infercore.models.layout import cpu_packing_supported
    from infercore.offload import offload_experts_

    assert cpu_packing_supported(torch.float32)
    hf, model = _models("qwen3_moe", tmp_path)
    want = [hf_greedy(hf, p, 10) for p in PROMPTS]
    info = offload_experts_(model, device_min_tokens=None, pack=True)
    assert info["staging_bytes"] == 0 and info["host_bytes"] == 8 * 3 * 64 * 24 * 4
    h = next(iter(model.host_experts.values()))
    assert h.gate_up.numel() == 0 and h.down.numel() == 0
    greedy = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    assert [o.token_ids for o in Engine(model, page_size=4, num_pages=64).generate(PROMPTS, greedy)] == want
    with pytest.raises(TypeError, match="packed for torch.float32"):
        h(torch.zeros(2, 64, dtype=torch.bfloat16), torch.ones(2, 2), torch.zeros(2, 2, dtype=torch.long), None)


def test_some_layers_and_a_tensor_parallel_like_wrapper(tmp_path):
    """``layers`` picks MoE layers (indices, or the first N); the others keep their experts where they were.
    Qwen2-MoE's dense layer (1) is refused by name."""
    from infercore.offload import offload_experts_

    _, model = _models("qwen2_moe", tmp_path)
    with pytest.raises(ValueError, match="layer 1 has no routed experts"):
        offload_experts_(model, layers=[1])
    with pytest.raises(ValueError, match="outside"):
        offload_experts_(model, layers=[7])
    with pytest.raises(ValueError, match="the model has 2"):
        offload_experts_(model, layers=3)
    with pytest.raises(ValueError, match="MoE layers asked for"):
        offload_experts_(model, layers=0)
    offload_experts_(model, layers=[2])
    assert model.model.layers[2].mlp.host_experts is not None and model.model.layers[0].mlp.host_experts is None
    with pytest.raises(ValueError, match="already offloaded"):
        offload_experts_(model)
    from infercore.offload import offload_weights_

    with pytest.raises(ValueError, match="experts are on the host"):
        offload_weights_(model, gpu_budget_bytes=1 << 20)


def test_host_region_views_hold_the_experts():
    """The plain host copies are views into a shared region (a slice of it per block, at its own offset)."""
    from infercore.models.moe import SparseMoeBlock
    from infercore.offload.host_experts import HostExperts

    torch.manual_seed(0)
    block = SparseMoeBlock(16, num_experts=3, top_k=2, intermediate=8)
    with torch.no_grad():
        for p in block.parameters():
            p.copy_(torch.randn_like(p))
    gu, dn = block.experts.gate_up_proj.detach().clone(), block.experts.down_proj.detach().clone()
    region = torch.zeros(8192, dtype=torch.uint8)
    h = HostExperts(block, torch.device("cpu"), None, 0, region[1024:])
    assert torch.equal(h.gate_up, gu) and torch.equal(h.down, dn)
    base = region.data_ptr() + 1024
    assert h.gate_up.data_ptr() == base and h.down.data_ptr() == base + gu.numel() * 4  # 3072 bytes: aligned
    assert torch.count_nonzero(region[:1024]) == 0


def test_first_n_moe_layers(tmp_path):
    from infercore.offload import offload_experts_

    _, model = _models("qwen2_moe", tmp_path)  # MoE layers 0 and 2
    assert offload_experts_(model, layers=1)["layers"] == [0]
    assert model.model.layers[2].mlp.host_experts is None


def test_refusals(tmp_path):
    from infercore.models import ModelConfig, build_model
    from infercore.offload import offload_experts_

    _, model = _models("qwen3_moe", tmp_path)
    for kwargs, err, match in [
        (dict(layers=[True]), TypeError, "layers"),
        (dict(layers="3"), TypeError, "layers"),
        (dict(device_min_tokens=0), ValueError, "device_min_tokens"),
        (dict(device_min_tokens="many"), TypeError, "device_min_tokens"),
        (dict(num_threads=0), ValueError, "num_threads"),
        (dict(num_threads=1.5), TypeError, "num_threads"),
        (dict(pack="yes"), TypeError, "pack"),
    ]:
        with pytest.raises(err, match=match):
            offload_experts_(model, **kwargs)
    assert not getattr(model, "host_experts", None)  # a refused call changed nothing
    dense = build_model(ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                                    num_kv_heads=2, head_dim=8), dtype=torch.float32, device="cpu")  # fmt: skip
    with pytest.raises(ValueError, match="no routed-expert"):
        offload_experts_(dense)
    with pytest.raises(TypeError, match="model"):
        offload_experts_(torch.nn.Linear(2, 2))


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["qwen2_moe", "qwen3_moe"])
@pytest.mark.parametrize("mode,graphs", [("staging", True), ("packed", True), ("packed", False), ("int4", True)])
def test_cuda_host_experts_match_transformers(kind, mode, graphs, tmp_path):
    """The model on the GPU with its experts in host memory: plain page-locked copies with a staging threshold
    (short forwards on the host, the long prompt and decode graphs of 32+ rows through the device staging), the
    default oneDNN-packed copies, or INT4 ones. Greedy tokens equal transformers' (fp32) for the first two. The
    Engine decodes through CUDA graphs captured in segments (one host break per MoE layer), or eagerly."""
    from paged_harness import hf_greedy

    from infercore import Engine, SamplingParams
    from infercore.offload import offload_experts_

    hf, model = _models(kind, tmp_path)
    long_prompt = [(7 * i) % 300 for i in range(40)]
    prompts = PROMPTS + [long_prompt]
    want = [hf_greedy(hf, p, 10) for p in prompts]
    kwargs = {"staging": dict(device_min_tokens=32), "packed": {}, "int4": dict(quantization="w4a16-g128")}[mode]
    info = offload_experts_(model, device="cuda", **kwargs)
    h = next(iter(model.host_experts.values()))
    assert info["packed"] is (mode == "packed") and (info["staging_bytes"] > 0) is (mode == "staging")
    if mode == "staging":
        assert h.gate_up.device.type == "cpu" and h.gate_up.is_pinned()
    assert model.model.embed_tokens.weight.device.type == "cuda" and model.host_synchronizing
    eng = Engine(model, page_size=4, num_pages=128, max_num_seqs=64, cuda_graph_max_batch=64 if graphs else 0)
    if graphs:
        breaks = {b: g.num_host_breaks for b, g in eng.graph_runner.graphs.items()}
        # graphs of fewer rows than the staging threshold stop for the host at every MoE layer; the others stage
        n = len(model.host_experts)
        assert breaks == {b: 0 if mode == "staging" and b >= 32 else n for b in breaks}, breaks
    else:
        assert eng.graph_runner is None
    calls = h.calls_host
    greedy = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    got = [o.token_ids for o in eng.generate(prompts, greedy)]
    if mode == "int4":
        assert all(len(t) == 10 for t in got)
    else:
        assert got == want
    assert h.calls_host - calls >= 9 and (h.calls_device > 0) is (mode == "staging")  # each decode step at least


@pytest.mark.parametrize("scheme", ["w4a16-g128", "w8a16"])
def test_quantized_host_experts(scheme, tmp_path):
    """Quantized host experts: fp32 (the reference kernel path) gives the greedy tokens of the same model whose
    experts hold the dequantized weights; bf16 (the packed INT4 / INT8 CPU kernels, the IntWeight dropped) gives a
    block output close to the reference over the dequantized weights."""
    from infercore import Engine, SamplingParams
    from infercore.models.moe import SparseMoeBlock
    from infercore.offload import offload_experts_
    from infercore.ops.moe.naive import moe_experts_ref
    from infercore.quant.api import quantize_weight

    def dequantized_(model, dtype):
        with torch.no_grad():
            for layer in model.model.layers:
                if isinstance(layer.mlp, SparseMoeBlock):
                    for p in (layer.mlp.experts.gate_up_proj, layer.mlp.experts.down_proj):
                        p.copy_(torch.stack([quantize_weight(w, scheme).dequantize(dtype) for w in p]))

    _, model = _models("qwen3_moe", tmp_path)
    _, twin = _models("qwen3_moe", tmp_path / "twin")
    dequantized_(twin, torch.float32)
    info = offload_experts_(model, quantization=scheme)
    h = next(iter(model.host_experts.values()))
    assert info["quantization"] == scheme and h.gate_up.numel() == 0 and h.quantized is not None
    assert info["host_bytes"] < 8 * 3 * 64 * 24 * 4 / 2  # fp32 experts (K padded to a group at these widths)
    greedy = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    want = [o.token_ids for o in Engine(twin, page_size=4, num_pages=64).generate(PROMPTS, greedy)]
    assert [o.token_ids for o in Engine(model, page_size=4, num_pages=64).generate(PROMPTS, greedy)] == want

    from infercore.ops.moe import cpu_native

    class Wrapper(torch.nn.Module):
        def __init__(self, block):
            super().__init__()
            self.model = torch.nn.Module()
            self.model.layers = torch.nn.ModuleList([torch.nn.Module()])
            self.model.layers[0].mlp = block

    native = cpu_native.q4_supported()  # the native kernels where they build, else ATen's
    kind = ("native4" if native else "int4") if scheme == "w4a16-g128" else ("native8" if native else "int8")
    # INT4: hidden 64 / intermediate 48 pad K to a group: per-expert calls; 128 / 128: one native call per layer.
    # INT8 (no padding): one native call per layer at both.
    for hidden, inter in ((64, 48), (128, 128)):
        torch.manual_seed(0)
        block = SparseMoeBlock(hidden, num_experts=6, top_k=2, intermediate=inter, dtype=torch.bfloat16)
        with torch.no_grad():
            for p in block.parameters():
                p.copy_(torch.randn_like(p) * 0.1)
        gu = torch.stack([quantize_weight(w, scheme).dequantize(torch.bfloat16) for w in block.experts.gate_up_proj])
        dn = torch.stack([quantize_weight(w, scheme).dequantize(torch.bfloat16) for w in block.experts.down_proj])
        offload_experts_(Wrapper(block), quantization=scheme)
        h = block.host_experts
        stacked = h.native is not None
        assert stacked is (native and (scheme == "w8a16" or hidden == 128))
        if stacked:
            assert h.native.kind == kind
        else:
            assert h.quantized[0][0].kind == kind
        x = torch.randn(5, hidden, dtype=torch.bfloat16)
        w = torch.softmax(torch.randn(5, 2), -1)
        ids = torch.randint(0, 6, (5, 2))
        got = h(x, w, ids, None)
        torch.testing.assert_close(got, moe_experts_ref(x, gu, dn, w, ids), atol=2e-2, rtol=2e-2)


def test_quantized_host_experts_refusals(tmp_path):
    from infercore.offload import offload_experts_

    _, model = _models("qwen3_moe", tmp_path)
    for kwargs, err, match in [
        (dict(quantization="nope"), ValueError, "unknown"),
        (dict(quantization="fp8-wo"), ValueError, "weight-only INT"),
        (dict(quantization="w4a16-g128", device_min_tokens=8), ValueError, "device_min_tokens=None"),
        (dict(quantization="w4a16-g128", pack=True), ValueError, "pack"),
    ]:
        with pytest.raises(err, match=match):
            offload_experts_(model, **kwargs)
    assert not getattr(model, "host_experts", None)
