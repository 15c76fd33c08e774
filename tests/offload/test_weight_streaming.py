"""Weight streaming (infercore.offload) on the CPU: an offloaded tiny Llama's logits equal the unoffloaded model's
exactly (fp32, and a w8a16-quantized model), the Engine's greedy tokens are the same, the plan under various
budgets, the cost model, and the refusals. GPU tests (CUDA streams, events, CUDA graphs, overlap) are in
test_weight_streaming_gpu.py."""

import os
import sys

import pytest
import torch
from torch import nn

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "engine"))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "models"))

LAYERS = 8


@pytest.fixture(scope="module")
def hf():
    from engine_helpers import tiny_hf

    return tiny_hf("llama", num_hidden_layers=LAYERS, attention_bias=True)


@pytest.fixture(scope="module")
def want(hf):
    return _logits(_ours(hf), PROMPTS)


def _ours(hf):
    from engine_helpers import ours_from_hf

    return ours_from_hf(hf)


def _plan(model, budget, prefetch=2):
    from infercore.offload.plan import make_plan

    return make_plan(model, budget, prefetch=prefetch, device=torch.device("cpu"))


def _budgets(model, prefetch):
    """(all resident, 3 layers resident and the rest streaming, the minimum) for ``model``."""
    p = _plan(model, 1 << 40, prefetch)
    always, layer, slot = p.always_resident_bytes, p.layer_bytes[0], max(_plan_min(model, prefetch).slot_bytes, 1)
    return {"all": p.all_resident_bytes, "some": always + 3 * layer + prefetch * slot,
            "min": always + prefetch * slot}


def _plan_min(model, prefetch):
    from infercore.offload.plan import make_plan

    with pytest.raises(ValueError, match=r"at least (\d+) bytes") as e:
        make_plan(model, 1, prefetch=prefetch, device=torch.device("cpu"))
    need = int(str(e.value).split("at least ")[1].split(" ")[0])
    return make_plan(model, need, prefetch=prefetch, device=torch.device("cpu"))


def _logits(model, prompts, steps=4):
    """fp32 logits of a batched prefill of ``prompts`` and ``steps`` batched greedy decode steps, stacked."""
    from paged_harness import PagedRunner

    run = PagedRunner(model, num_pages=64, page_size=4)
    out = [run.step(list(enumerate(prompts)))]
    ends = torch.tensor([len(p) for p in prompts]).cumsum(0) - 1
    nxt = out[0][ends].argmax(-1).tolist()
    for _ in range(steps):
        out.append(run.step([(i, [t]) for i, t in enumerate(nxt)]))
        nxt = out[-1].argmax(-1).tolist()
    return torch.cat(out)


PROMPTS = [[1, 2, 3, 4, 5, 6, 7], [9, 8, 7], [40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50]]


@pytest.fixture
def lazy_copies(monkeypatch, request):
    """Run the CPU copy "stream" lazily (each copy when its layer waits for it) or eagerly (when issued)."""
    from infercore.offload import streaming

    monkeypatch.setattr(streaming._HostCopier, "lazy", request.param)
    return request.param


@pytest.mark.parametrize("lazy_copies", [False, True], ids=["copy-at-issue", "copy-at-wait"], indirect=True)
@pytest.mark.parametrize("prefetch", [1, 2, 3])
@pytest.mark.parametrize("budget", ["all", "some", "min"])
def test_offloaded_logits_equal_unoffloaded_exactly(hf, want, budget, prefetch, lazy_copies):
    from infercore.offload import OffloadedLayer, offload_weights_

    model = _ours(hf)
    b = _budgets(model, prefetch)[budget]
    plan = offload_weights_(model, gpu_budget_bytes=b, prefetch=prefetch)
    expect_streamed = {"all": 0, "some": LAYERS - 3, "min": LAYERS}[budget]
    assert len(plan.streamed_layers) == expect_streamed
    assert plan.device_bytes <= b
    assert all(isinstance(layer, OffloadedLayer) for layer in model.model.layers)
    got = _logits(model, PROMPTS)
    assert torch.equal(got, want)
    # again: every forward streams its layers anew
    assert torch.equal(_logits(model, PROMPTS), want)
    assert model.offload_streamer.forwards == 2 * (1 + 4)


def test_streamed_layers_are_views_of_their_slot(hf):
    from infercore.offload import offload_weights_

    model = _ours(hf)
    plan = offload_weights_(model, gpu_budget_bytes=_budgets(model, 3)["some"], prefetch=3)
    s = model.offload_streamer
    assert plan.num_slots == 3 and len(s.slots) == 3 and plan.streamed_layers == tuple(range(3, LAYERS))
    assert all(slot.numel() == plan.slot_bytes for slot in s.slots)
    assert plan.staging_bytes == 3 * plan.slot_bytes
    assert s.host.numel() == plan.streamed_bytes_per_forward == sum(plan.packed_layer_bytes)
    for k, i in enumerate(plan.streamed_layers):
        wrapper = model.model.layers[i]
        assert wrapper.streamed and wrapper.slot == k % 3
        slot = s.slots[k % 3]
        lo, hi = slot.data_ptr(), slot.data_ptr() + slot.numel()
        for name, p in wrapper.layer.named_parameters():
            assert lo <= p.data_ptr() and p.data_ptr() + p.numel() * p.element_size() <= hi, name
            assert (p.data_ptr() - lo) % 256 == 0, name
    for i in plan.resident_layers:
        assert not model.model.layers[i].streamed
        assert all(p.data_ptr() != s.slots[0].data_ptr() for p in model.model.layers[i].parameters())
    # the wrapper shows the layer's attributes (kv_specs reads layer.self_attn)
    assert model.model.layers[LAYERS - 1].self_attn is model.model.layers[LAYERS - 1].layer.self_attn
    assert len(model.kv_specs()) == LAYERS


def test_engine_greedy_identical(hf):
    # The CPU engine swaps linears for oneDNN-packed ones (the packed copy is rebuilt when the weight's version
    # changes: every copy into a slot bumps it) and runs chunked prefill, batched decode and prefix caching.
    from engine_helpers import random_prompts

    from infercore import Engine, SamplingParams
    from infercore.offload import offload_weights_

    prompts = random_prompts(5, seed=11) + [[5, 6, 7, 8, 9] * 3]
    sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    want = [o.token_ids for o in Engine(_ours(hf), page_size=4, num_pages=256, max_num_batched_tokens=24)
            .generate(prompts, sp)]
    model = _ours(hf)
    offload_weights_(model, gpu_budget_bytes=_budgets(model, 2)["min"], prefetch=2)
    eng = Engine(model, page_size=4, num_pages=256, max_num_batched_tokens=24)
    assert [o.token_ids for o in eng.generate(prompts, sp)] == want
    assert eng.device.type == "cpu" and eng.graph_runner is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantized_model_streams_its_buffers(hf, dtype):
    # w8a16: QuantLinear buffers (int8 codes, scales) and the biases stream; bf16 takes the packed CPU INT8 kernel
    from infercore.models import ModelConfig, build_model
    from infercore.offload import offload_weights_
    from infercore.quant import QuantLinear, quantize

    def quantized():
        m = build_model(ModelConfig.from_hf(hf.config.to_dict()), dtype=dtype, device=torch.device("cpu"))
        m.load_weights(hf.state_dict().items())
        return quantize(m, "w8a16")

    want = _logits(quantized(), PROMPTS)
    model = quantized()
    plan = offload_weights_(model, gpu_budget_bytes=_budgets(model, 2)["some"], prefetch=2)
    assert len(plan.streamed_layers) == LAYERS - 3
    s = model.offload_streamer
    last = model.model.layers[LAYERS - 1].layer
    q = last.self_attn.qkv_proj
    assert isinstance(q, QuantLinear)
    slot = s.slots[model.model.layers[LAYERS - 1].slot]
    bufs = [t for t in q.buffers()]
    assert bufs and all(slot.data_ptr() <= t.data_ptr() < slot.data_ptr() + slot.numel() for t in bufs)
    assert torch.equal(_logits(model, PROMPTS), want)


def test_plan_budgets(hf):
    from infercore.offload.plan import make_plan

    model = _ours(hf)
    full = _plan(model, 1 << 40)
    L, layer = LAYERS, full.layer_bytes[0]
    assert full.streamed_layers == () and full.num_slots == 0 and full.staging_bytes == 0
    assert full.device_bytes == full.all_resident_bytes == sum(p.numel() * 4 for p in model.parameters()) + \
        model.cos_sin_cache.numel() * 4
    assert _plan(model, full.all_resident_bytes).streamed_layers == ()
    # one byte less: streaming starts, and the staging ring costs two slots, so 3 layers leave
    p = _plan(model, full.all_resident_bytes - 1)
    assert p.streamed_layers == (L - 3, L - 2, L - 1) and p.num_slots == 2
    assert p.streamed_bytes_per_forward == 3 * p.slot_bytes and p.slot_bytes >= layer
    for prefetch in (1, 2, 3):
        mn = _plan_min(model, prefetch)
        assert mn.streamed_layers == tuple(range(L)) and mn.num_slots == prefetch
        assert mn.device_bytes == mn.always_resident_bytes + prefetch * mn.slot_bytes == mn.gpu_budget_bytes
        with pytest.raises(ValueError, match="gpu_budget_bytes"):
            make_plan(model, mn.gpu_budget_bytes - 1, prefetch=prefetch, device=torch.device("cpu"))
    # every budget in between: the fewest layers stream, and the plan fits
    mn = _plan_min(model, 2).gpu_budget_bytes
    prev = L + 1
    for b in range(mn, full.all_resident_bytes + 1, max(1, (full.all_resident_bytes - mn) // 40)):
        p = _plan(model, b)
        assert p.device_bytes <= b and len(p.streamed_layers) <= prev
        prev = len(p.streamed_layers)
        if p.streamed_layers:  # one more resident layer would not fit
            assert p.device_bytes + layer > b or len(p.streamed_layers) <= 2
    r = repr(_plan(model, mn))
    assert "streamed: 8/8 decoder layers (layers 0..7)" in r and "staging: 2 slot(s)" in r


def test_cost_model(hf):
    from infercore.offload import plan_offload, simulate_step

    model = _ours(hf)
    mn = _plan_min(model, 2).gpu_budget_bytes
    full = _plan(model, 1 << 40).all_resident_bytes
    c = plan_offload(model, full, h2d_bytes_per_s=50e9, hbm_bytes_per_s=4e12)
    assert c.step_s == c.compute_s and c.slowdown == 1.0 and "no streaming" in repr(c)
    # copy-bound: PCIe 80x slower than HBM; the step is the copies plus what cannot overlap them
    c = plan_offload(model, mn, h2d_bytes_per_s=50e9, hbm_bytes_per_s=4e12, flops_per_s=1e15)
    assert c.copy_bound and c.copy_s <= c.step_s <= c.serialized_s
    assert c.copy_s == pytest.approx(c.plan.streamed_bytes_per_forward / 50e9)
    assert c.slowdown > 10 and "copy-bound" in repr(c) and "pays only when" in repr(c)
    linear = sum(m.weight.numel() for m in model.modules() if isinstance(m, nn.Linear))
    assert c.hide_tokens == pytest.approx(c.copy_s * 1e15 / (2 * linear))
    read = sum(p.numel() * 4 for n, p in model.named_parameters() if "embed" not in n)
    assert c.compute_s == pytest.approx(max(read / 4e12, 2 * linear / 1e15))
    # measured step time given: compute-bound when the step is long; the copies then hide (but the first one)
    slow = plan_offload(model, mn, h2d_bytes_per_s=50e9, step_s=100 * c.copy_s)
    first = slow.plan.packed_layer_bytes[0] / 50e9  # nothing resident runs before layer 0's copy
    assert not slow.copy_bound and slow.step_s == pytest.approx(slow.compute_s + first)
    assert slow.step_s < slow.serialized_s
    # deeper prefetch hides more when copy and compute are alike (per layer)
    even = [plan_offload(model, mn, h2d_bytes_per_s=50e9, step_s=c.copy_s * 1.2, prefetch=p).step_s for p in (1, 2)]
    assert even[1] < even[0]
    # the simulation by hand: no overlap possible with one slot and nothing resident: copy, compute, copy, ...
    p1 = _plan_min(model, 1)
    t = simulate_step(p1, 1e-3, 1e9)
    per_layer = 1e-3 * p1.layer_bytes[0] / (p1.always_resident_bytes + sum(p1.layer_bytes))
    copy = p1.packed_layer_bytes[0] / 1e9
    tail = 1e-3 - LAYERS * per_layer
    assert t == pytest.approx(LAYERS * (copy + per_layer) + tail)


def test_bad_inputs(hf):
    from infercore.offload import offload_weights_, plan_offload

    model = _ours(hf)
    mn = _plan_min(model, 2).gpu_budget_bytes
    with pytest.raises(ValueError, match=f"gpu_budget_bytes={mn - 1} is too small.*at least {mn} bytes"):
        offload_weights_(model, gpu_budget_bytes=mn - 1)
    for bad in (0, -5):
        with pytest.raises(ValueError, match="gpu_budget_bytes"):
            offload_weights_(model, gpu_budget_bytes=bad)
    for bad in (1.5e9, "1GB", True, None):
        with pytest.raises(TypeError, match="gpu_budget_bytes"):
            offload_weights_(model, gpu_budget_bytes=bad)
    for bad in (0, -1):
        with pytest.raises(ValueError, match="prefetch"):
            offload_weights_(model, gpu_budget_bytes=1 << 30, prefetch=bad)
    for bad in (2.0, True, None):
        with pytest.raises(TypeError, match="prefetch"):
            offload_weights_(model, gpu_budget_bytes=1 << 30, prefetch=bad)
    with pytest.raises(ValueError, match="device"):
        offload_weights_(model, gpu_budget_bytes=1 << 30, device="meta")
    with pytest.raises(TypeError, match="model"):
        offload_weights_(nn.Linear(4, 4), gpu_budget_bytes=1 << 30)
    with pytest.raises(TypeError, match="model"):
        offload_weights_("llama", gpu_budget_bytes=1 << 30)
    empty = _ours(hf)
    empty.model.layers = nn.ModuleList()
    with pytest.raises(TypeError, match="no decoder layers"):
        offload_weights_(empty, gpu_budget_bytes=1 << 30)
    # nothing was changed by the refusals
    assert not hasattr(model, "offload_plan") and type(model.model.layers[0]).__name__ == "LlamaDecoderLayer"
    offload_weights_(model, gpu_budget_bytes=mn)
    with pytest.raises(ValueError, match="already offloaded"):
        offload_weights_(model, gpu_budget_bytes=1 << 40)
    with pytest.raises(ValueError, match="already offloaded"):
        plan_offload(model, 1 << 40, h2d_bytes_per_s=5e10, hbm_bytes_per_s=4e12)
    # the cost model's own arguments
    fresh = _ours(hf)
    with pytest.raises(ValueError, match="step_s / hbm_bytes_per_s"):
        plan_offload(fresh, mn, h2d_bytes_per_s=5e10)
    for bad in (0, -1.0, float("inf")):
        with pytest.raises(ValueError, match="h2d_bytes_per_s"):
            plan_offload(fresh, mn, h2d_bytes_per_s=bad, hbm_bytes_per_s=4e12)
    with pytest.raises(TypeError, match="h2d_bytes_per_s"):
        plan_offload(fresh, mn, h2d_bytes_per_s="fast", hbm_bytes_per_s=4e12)
    with pytest.raises(ValueError, match="tokens_per_step"):
        plan_offload(fresh, mn, h2d_bytes_per_s=5e10, hbm_bytes_per_s=4e12, tokens_per_step=0)


def test_refuses_what_cannot_stream(hf):
    import transformers

    from infercore.models import Mamba2Config, build_model
    from infercore.offload import offload_weights_
    from infercore.quant import quantize

    # a forward that calls the blocks' submodules directly would never run the wrapper
    cfg = Mamba2Config.from_hf(transformers.Mamba2Config(
        vocab_size=96, hidden_size=32, num_hidden_layers=2, num_heads=8, head_dim=8, state_size=16, n_groups=2,
        expand=2, conv_kernel=4, chunk_size=8).to_dict())
    with pytest.raises(TypeError, match="Llama-family"):
        offload_weights_(build_model(cfg, dtype=torch.float32, device="cpu"), gpu_budget_bytes=1 << 30)
    # a tensor shared between a streamed layer and the resident part
    model = _ours(hf)
    model.model.layers[LAYERS - 1].input_layernorm.weight = model.model.norm.weight
    with pytest.raises(ValueError, match="shares memory"):
        offload_weights_(model, gpu_budget_bytes=_budgets(model, 2)["min"])
    # ... or between two streamed layers
    model = _ours(hf)
    model.model.layers[LAYERS - 1].input_layernorm.weight = model.model.layers[LAYERS - 2].input_layernorm.weight
    with pytest.raises(ValueError, match="share a tensor"):
        offload_weights_(model, gpu_budget_bytes=_budgets(model, 2)["min"])
    # MixQ grows (replaces) its buffers at run time
    model = quantize(_ours(hf), "w8a8-mixed")
    with pytest.raises(ValueError, match="MixQ"):
        offload_weights_(model, gpu_budget_bytes=_budgets(model, 2)["min"])


def test_layers_out_of_order_are_refused(hf):
    from infercore.offload import offload_weights_

    model = _ours(hf)
    offload_weights_(model, gpu_budget_bytes=_budgets(model, 2)["min"])
    layers = model.model.layers
    layers[0], layers[1] = layers[1], layers[0]
    with pytest.raises(RuntimeError, match="decoder layer 1 ran, expected layer 0"):
        _logits(model, PROMPTS, steps=0)


def test_swaps_after_offloading_are_refused(hf):
    # The wrapper sees the layer's modules: a quantize() after offloading would build its QuantLinears from whatever
    # the slot held and keep them off the stream; the next forward refuses instead of computing with them.
    from infercore.offload import offload_weights_
    from infercore.quant import quantize

    model = _ours(hf)
    offload_weights_(model, gpu_budget_bytes=_budgets(model, 2)["some"])
    _logits(model, PROMPTS, steps=0)
    quantize(model, "w8a16")
    with pytest.raises(RuntimeError, match="decoder layer 3 streams, but its modules or tensors changed"):
        _logits(model, PROMPTS, steps=0)
    # a device layout's class swap keeps the tensors: still streams (the CPU engine's packed linears, above)
    from infercore.models.layout import pack_linears_for_cpu_

    model = _ours(hf)
    offload_weights_(model, gpu_budget_bytes=_budgets(model, 2)["some"])
    assert pack_linears_for_cpu_(model) > 0
    _logits(model, PROMPTS, steps=0)
