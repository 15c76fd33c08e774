"""Weights in place and sleep mode (``engine/weights.py``), what RL trainers use between steps: an engine built from
model A, updated with model B's HF-named tensors (all, or some layers), generates what transformers' B (or the mixed
model) does, through the plain, oneDNN-packed and fused native CPU paths, LoRA-wrapped projections and the hybrid KV
manager; prefix-cache pages computed under A are not reused; refused updates change nothing; sleep / wake_up (levels
1 and 2, the memory really given back where ``frees_memory`` says so) come back to the same tokens."""

import copy
import os
import sys

import pytest
import torch
from engine_helpers import hf_greedy, ours_from_hf, random_prompts, serving, tiny_hf

from infercore import Engine, SamplingParams
from infercore.engine import engine as engine_mod
from infercore.engine.weights import model_parameters
from infercore.ops.moe import cpu_native

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "models"))
from test_qwen3_next import _tiny_pair  # noqa: E402

N = 8
GREEDY = SamplingParams(temperature=0, max_tokens=N, ignore_eos=True)
PROMPTS = random_prompts(3, seed=5, lo=9, hi=20)


def _perturbed(hf, seed: int):
    """A copy of ``hf`` with other random weights of the same scale (norm weights moved off 1 too)."""
    other = copy.deepcopy(hf)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in other.parameters():
            noise = torch.randn(p.shape, generator=g)
            if torch.all(p == 1):  # a norm's weight
                p.add_(0.3 * noise)
            else:
                p.copy_(noise * p.std())
    return other


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def models(request):
    a = tiny_hf(request.param)
    b = _perturbed(a, 1)
    refs = {name: [hf_greedy(m, p, N) for p in PROMPTS] for name, m in (("a", a), ("b", b))}
    assert all(x != y for x, y in zip(refs["a"], refs["b"]))  # the update is visible in every prompt's tokens
    return a, b, refs


def _engine(hf, **kw):
    kw.setdefault("page_size", 4)
    kw.setdefault("num_pages", 96)
    return Engine(ours_from_hf(hf), **kw)


def _tokens(eng, prompts=PROMPTS):
    return [o.token_ids for o in eng.generate(prompts, GREEDY)]


def _cached(eng, prompts=PROMPTS):
    return [o.metrics.num_cached_tokens for o in eng.generate(prompts, GREEDY)]


def _same_as(eng, hf) -> bool:
    """Whether ``eng``'s parameters and buffers (RoPE tables) equal those of ``hf`` loaded anew, bit for bit."""
    ref = ours_from_hf(hf)
    mine, want = model_parameters(eng.model), model_parameters(ref)
    bufs, want_bufs = dict(eng.model.named_buffers()), dict(ref.named_buffers())
    return mine.keys() == want.keys() and all(torch.equal(mine[k], want[k]) for k in want) and all(
        torch.equal(bufs[k], v) for k, v in want_bufs.items())


def _fused_native_ran(eng) -> bool:
    """Whether the last decode steps went through the fused native CPU decoder layers."""
    cache = eng.model.model.layers[0].__dict__.get("_native_linears_cache")
    return cache is not None and cache[3] is not None


@pytest.mark.parametrize("packed", [False, True])
def test_update_generates_the_new_model_and_drops_old_prefix_pages(models, packed):
    a, b, refs = models
    eng = _engine(a, cpu_packed_linears=packed)
    assert _tokens(eng) == refs["a"]
    assert eng.generate(PROMPTS, GREEDY)[0].metrics.num_cached_tokens > 0  # cached under A
    if packed and cpu_native.available():
        assert _fused_native_ran(eng)
    assert eng.update_weights(b.state_dict().items()) == len(b.state_dict())
    assert _same_as(eng, b)
    outs = eng.generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in outs] == refs["b"]
    assert [o.metrics.num_cached_tokens for o in outs] == [0] * len(PROMPTS)  # nothing computed under A reused
    assert eng.block_manager.stats.hit_tokens == 0
    assert min(_cached(eng)) > 0  # the cache serves pages computed under B
    assert _tokens(eng) == refs["b"]
    if packed and cpu_native.available():
        assert _fused_native_ran(eng)
    # and back, from a state-dict mapping
    eng.update_weights(a.state_dict())
    assert _tokens(eng) == refs["a"]


def test_partial_updates(models):
    a, b, _ = models
    eng = _engine(a)  # oneDNN-packed linears and fused native layers: the CPU default
    sa, sb = a.state_dict(), b.state_dict()
    layer1 = {k: v for k, v in sb.items() if k.startswith("model.layers.1.")}
    assert 0 < eng.update_weights(layer1.items()) < len(sb)
    mixed = copy.deepcopy(a)
    mixed.load_state_dict({**sa, **layer1})
    want = [hf_greedy(mixed, p, N) for p in PROMPTS]
    assert want != [hf_greedy(a, p, N) for p in PROMPTS]
    assert _same_as(eng, mixed)
    assert _tokens(eng) == want
    # the rest in a second call, one projection's slice of the merged qkv alone among them
    q0 = {"model.layers.0.self_attn.q_proj.weight": sb["model.layers.0.self_attn.q_proj.weight"]}
    eng.update_weights(q0.items())
    mixed.load_state_dict({**sa, **layer1, **q0})
    assert _same_as(eng, mixed)
    eng.update_weights((k, v) for k, v in sb.items() if k not in layer1 and k not in q0)
    assert _same_as(eng, b)
    assert _tokens(eng) == [hf_greedy(b, p, N) for p in PROMPTS]


def _snapshot(eng):
    return {k: v.clone() for k, v in eng.model.state_dict().items()}


@pytest.mark.parametrize("bad, error, match", [
    (("model.layers.0.self_attn.qq_proj.weight", torch.zeros(32, 32)), ValueError, "qq_proj"),
    (("model.layers.1.self_attn.k_proj.weight", torch.zeros(32, 32)), ValueError,
     r"model.layers.1.self_attn.k_proj.weight.*\(32, 32\).*qkv_proj.weight"),
    (("model.norm.weight", torch.zeros(33)), ValueError, "model.norm.weight"),
    (("model.layers.0.mlp.up_proj.weight", "zeros"), TypeError, "up_proj"),
    (("model.embed_tokens.weight", None), TypeError, "embed_tokens"),
])  # fmt: skip
def test_refused_update_changes_nothing(models, bad, error, match):
    a, b, refs = models
    eng = _engine(a)
    before = _snapshot(eng)
    good = list(b.state_dict().items())
    with pytest.raises(error, match=match):
        eng.update_weights(good[:5] + [bad] + good[5:])
    assert all(torch.equal(v, before[k]) for k, v in eng.model.state_dict().items())
    assert _tokens(eng) == refs["a"]


def test_duplicates_and_bare_decoder_names(models):
    a, b, refs = models
    eng = _engine(a)
    before = _snapshot(eng)
    w = b.state_dict()["model.norm.weight"]
    for dup in ([("model.norm.weight", w), ("model.norm.weight", w)], [("model.norm.weight", w), ("norm.weight", w)]):
        with pytest.raises(ValueError, match="twice"):
            eng.update_weights(dup)
    assert all(torch.equal(v, before[k]) for k, v in eng.model.state_dict().items())
    # names without "model." (a bare decoder's, as load_weights takes them), dtypes cast
    eng.update_weights((k.removeprefix("model."), v.double()) for k, v in b.state_dict().items())
    assert _tokens(eng) == refs["b"]


def test_update_and_reset_refused_while_requests_run(models):
    a, b, refs = models
    eng = _engine(a)
    eng.generate(PROMPTS[:1], GREEDY)
    rid = eng.add_request(PROMPTS[0], GREEDY)
    eng.step()  # admitted: it holds pages
    assert eng.reset_prefix_cache() is False
    assert eng.block_manager.num_cached_pages > 0
    with pytest.raises(ValueError, match="1 request"):
        eng.update_weights(b.state_dict().items())
    with pytest.raises(ValueError, match="1 request"):
        eng.sleep()
    eng.abort(rid)
    assert eng.reset_prefix_cache() is True
    assert eng.block_manager.num_cached_pages == 0
    assert _cached(eng, PROMPTS[:1]) == [0]
    # a queued request that holds no pages yet does not stop a reset (vLLM's rule), but does stop an update
    eng.add_request(PROMPTS[1], GREEDY)
    assert eng.reset_prefix_cache() is True
    with pytest.raises(ValueError, match="unfinished"):
        eng.update_weights(b.state_dict().items())
    while eng.has_unfinished():
        eng.step()
    eng.update_weights(b.state_dict().items())
    assert _tokens(eng) == refs["b"]


def test_update_through_lora_wrapped_projections(models):
    a, b, refs = models
    eng = _engine(a, max_loras=2, max_lora_rank=4)
    assert _tokens(eng) == refs["a"]
    eng.update_weights(b.state_dict().items())
    assert _same_as(eng, b)
    assert _tokens(eng) == refs["b"]


def test_quantized_linears_refused_by_name():
    from infercore.quant import quantize

    a = tiny_hf("llama")
    model = ours_from_hf(a)
    quantize(model, "w8a16")
    eng = Engine(model, page_size=4, num_pages=64)
    state = a.state_dict()
    before = _snapshot(eng)
    o_proj = "model.layers.0.self_attn.o_proj.weight"
    with pytest.raises(ValueError, match=rf"{o_proj}.*quantized"):
        eng.update_weights([("model.norm.weight", state["model.norm.weight"] * 2), (o_proj, state[o_proj])])
    assert all(torch.equal(v, before[k]) for k, v in eng.model.state_dict().items())
    # what stayed dense takes updates
    assert eng.update_weights([("model.norm.weight", state["model.norm.weight"] * 2)]) == 1
    assert torch.equal(eng.model.model.norm.weight, state["model.norm.weight"] * 2)


def test_hybrid_model_update_and_sleep(monkeypatch):
    """Qwen3-Next through the hybrid KV manager (recurrent-state rows, checkpoints), its routed experts packed for
    the CPU: an update equals an engine loaded with the new weights; sleep / wake with the memory given back."""
    from infercore.models import Qwen3NextConfig, build_model

    hfa, hfb = _tiny_pair(0)[0], _tiny_pair(1)[0]  # transformers' Qwen3-Next of two seeds

    def engine(hf):
        m = build_model(Qwen3NextConfig.from_hf(hf.config.to_dict()), dtype=torch.float32, device="cpu")
        m.load_weights(hf.state_dict().items())
        return Engine(m, page_size=4, kv_cache_bytes=1 << 20, checkpoint_interval=8)

    eng, ref_b = engine(hfa), engine(hfb)
    assert eng.kv_layout != "dense"
    assert any(getattr(m, "cpu_packed_experts", None) is not None for m in eng.model.modules())
    want_a, want_b = _tokens(eng), _tokens(ref_b)
    assert want_a != want_b
    eng.update_weights(hfb.state_dict().items())
    assert _tokens(eng) == want_b
    monkeypatch.setattr(engine_mod, "frees_memory", lambda device: True)
    eng.sleep(1)
    assert all(t.untyped_storage().nbytes() == 0 for t in eng._kv_tensors())
    eng.wake_up()
    assert _cached(eng) == [0] * len(PROMPTS)
    assert _tokens(eng) == want_b


@pytest.mark.parametrize("frees", [False, True])
def test_sleep_wake_round_trip(models, monkeypatch, frees):
    """Level 1: the same tokens after wake_up, nothing of the old KV reused; with ``frees`` the storages are really
    emptied while asleep (what happens on CUDA), here on host tensors."""
    a, _, refs = models
    monkeypatch.setattr(engine_mod, "frees_memory", lambda device: frees)
    eng = _engine(a, cpu_kv_cache_bytes=1 << 20)
    assert _tokens(eng) == refs["a"] and not eng.is_sleeping
    eng.sleep(level=1)
    assert eng.is_sleeping
    kv, weights = eng._kv_tensors(), list(eng.model.parameters())
    assert all(t.untyped_storage().nbytes() == 0 for t in kv + weights) == frees
    if not frees:
        assert all(not t.any() for t in kv)  # the KV pool is wiped
    with pytest.raises(RuntimeError, match="sleeps"):
        eng.generate(PROMPTS, GREEDY)
    with pytest.raises(RuntimeError, match="sleeps"):
        eng.add_request(PROMPTS[0], GREEDY)
    assert not eng.has_unfinished()
    assert eng.read_prefix_kv(PROMPTS[0]) == (0, [])
    with pytest.raises(RuntimeError, match="already sleeps"):
        eng.sleep(1)
    with pytest.raises(RuntimeError, match="wake_up"):
        eng.update_weights([])
    eng.wake_up()
    assert not eng.is_sleeping and _same_as(eng, a)
    outs = eng.generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in outs] == refs["a"]
    assert [o.metrics.num_cached_tokens for o in outs] == [0] * len(PROMPTS)
    eng.wake_up()  # awake: nothing to do
    assert _tokens(eng) == refs["a"]


def test_sleep_with_quantized_kv(models, monkeypatch):
    """int8 KV codes and their fp32 scales are freed and come back (zeroed) with the pool."""
    a, _, _ = models
    monkeypatch.setattr(engine_mod, "frees_memory", lambda device: True)
    eng = _engine(a, kv_cache_dtype="int8")
    want = _tokens(eng)
    scales = [t for kv in eng.runner.kv_caches for t in (kv.k_scale, kv.v_scale)]
    assert scales and all(any(s is t for t in eng._kv_tensors()) for s in scales)
    eng.sleep()
    assert all(t.untyped_storage().nbytes() == 0 for t in scales)
    eng.wake_up()
    assert all(not t.any() for t in scales)
    assert _tokens(eng) == want


@pytest.mark.parametrize("frees", [False, True])
def test_level2_sleep_needs_weights_before_generating(models, monkeypatch, frees):
    a, b, refs = models
    monkeypatch.setattr(engine_mod, "frees_memory", lambda device: frees)
    eng = _engine(a)
    eng.generate(PROMPTS, GREEDY)
    eng.sleep(level=2)
    eng.wake_up()
    assert all(not p.any() for p in eng.model.parameters())  # discarded: zeros came back
    with pytest.raises(RuntimeError, match="update_weights"):
        eng.generate(PROMPTS, GREEDY)
    sb = b.state_dict()
    eng.update_weights((k, v) for k, v in sb.items() if "layers.1." not in k)
    with pytest.raises(RuntimeError, match=r"model.layers.1"):
        eng.generate(PROMPTS, GREEDY)
    eng.update_weights((k, v) for k, v in sb.items() if "layers.1." in k and "k_proj" not in k)
    with pytest.raises(RuntimeError, match=r"1 parameters not written yet.*qkv_proj"):  # its k rows still missing
        eng.generate(PROMPTS, GREEDY)
    eng.update_weights((k, v) for k, v in sb.items() if "layers.1." in k and "k_proj" in k)
    assert _same_as(eng, b)
    assert _tokens(eng) == refs["b"]


def test_level2_wake_weights_first_then_kv(models, monkeypatch):
    """vLLM's RL pattern: wake the weights alone, load them, then the KV pool."""
    a, b, refs = models
    monkeypatch.setattr(engine_mod, "frees_memory", lambda device: True)
    eng = _engine(b)
    eng.sleep(2)
    eng.wake_up(tags=["weights"])
    assert eng.is_sleeping and all(t.untyped_storage().nbytes() == 0 for t in eng._kv_tensors())
    eng.update_weights(a.state_dict().items())
    with pytest.raises(RuntimeError, match="sleeps"):
        eng.generate(PROMPTS, GREEDY)
    eng.wake_up(tags=["kv_cache"])
    assert not eng.is_sleeping
    assert _same_as(eng, a)
    assert _tokens(eng) == refs["a"]


def test_sleep_keeps_a_draft_model(models, monkeypatch):
    """A draft model equal to the target: every draft token is accepted before and after a level-2 sleep (the
    draft's weights come back from host memory, its KV pool and shadows are dropped with the target's)."""
    a, _, refs = models
    monkeypatch.setattr(engine_mod, "frees_memory", lambda device: True)
    eng = _engine(a, num_speculative_tokens=3, draft_model=ours_from_hf(a))

    def run():
        outs = eng.generate(PROMPTS, GREEDY)
        assert [o.token_ids for o in outs] == refs["a"]
        drafted = sum(o.metrics.num_draft_tokens for o in outs)
        assert drafted > 0 and sum(o.metrics.num_accepted_tokens for o in outs) == drafted

    run()
    eng.sleep(2)
    assert all(t.untyped_storage().nbytes() == 0 for t in eng.draft.model.parameters())
    eng.wake_up()
    assert not eng.draft.shadows
    eng.update_weights(a.state_dict().items())
    run()


def test_sleep_argument_checks(models):
    a, _, _ = models
    eng = _engine(a)
    for level in (0, 3, True, "1"):
        with pytest.raises(ValueError, match="level"):
            eng.sleep(level)
    with pytest.raises(ValueError, match="tags"):
        eng.wake_up(tags=["weight"])
    with pytest.raises(ValueError, match="tags"):
        eng.wake_up(tags="weights")
    assert not eng.is_sleeping


def test_server_routes(models):
    a, _, refs = models
    eng = _engine(a)
    with serving(eng) as call:
        body = {"prompt": PROMPTS[0], "max_tokens": N, "temperature": 0, "ignore_eos": True}
        status, out = call("POST", "/v1/completions", body)
        assert status == 200
        assert call("POST", "/reset_prefix_cache") == (200, {"reset": True})
        assert call("POST", "/sleep?level=3")[0] == 400
        assert call("POST", "/sleep?level=1") == (200, {"status": "ok"})
        assert call("GET", "/is_sleeping") == (200, {"is_sleeping": True})
        status, out = call("POST", "/v1/completions", body)
        assert status >= 400 and "sleeps" in out["error"]["message"]
        assert call("POST", "/wake_up") == (200, {"status": "ok"})
        assert call("GET", "/is_sleeping") == (200, {"is_sleeping": False})
        assert call("POST", "/sleep", {"level": 2})[0] == 200
        assert call("POST", "/wake_up?tags=weights")[0] == 200
        assert call("GET", "/is_sleeping") == (200, {"is_sleeping": True})
        assert call("POST", "/wake_up", {"tags": ["kv_cache"]})[0] == 200
        assert call("GET", "/is_sleeping") == (200, {"is_sleeping": False})
    eng.update_weights(a.state_dict().items())
    assert _tokens(eng) == refs["a"]


@pytest.mark.gpu
def test_cuda_graphs_update_and_sleep():
    """On CUDA with captured decode graphs: an update reaches the replayed graphs (parameters written in place);
    sleep gives the weights' and the KV pool's memory back; wake_up captures the graphs again."""
    from infercore.models import ModelConfig, build_model

    a = tiny_hf("llama", hidden_size=256, intermediate_size=512, vocab_size=96)
    b = _perturbed(a, 1)
    want_a = [hf_greedy(a, p, 24) for p in PROMPTS]
    want_b = [hf_greedy(b, p, 24) for p in PROMPTS]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    model = build_model(ModelConfig.from_hf(a.config.to_dict()), dtype=torch.float32, device=torch.device("cuda"))
    model.load_weights(a.state_dict().items())
    eng = Engine(model, page_size=16, num_pages=2048)
    assert eng.graph_runner is not None and eng.graph_runner.graphs

    def tokens():
        return [o.token_ids for o in eng.generate(PROMPTS, params)]

    assert tokens() == want_a
    ptrs = [p.data_ptr() for p in model.parameters()]
    eng.update_weights(b.state_dict().items())
    assert [p.data_ptr() for p in model.parameters()] == ptrs
    assert tokens() == want_b
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    kv_bytes = sum(t.untyped_storage().nbytes() for t in eng._kv_tensors())
    eng.sleep(1)
    assert torch.cuda.memory_allocated() <= before - kv_bytes
    assert not eng.graph_runner.graphs
    eng.wake_up()
    assert eng.graph_runner.graphs
    assert tokens() == want_b
    eng.sleep(2)
    eng.wake_up(tags=["weights"])
    eng.update_weights(a.state_dict().items())
    eng.wake_up(tags=["kv_cache"])
    assert tokens() == want_a
