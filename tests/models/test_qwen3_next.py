"""Qwen3-Next (gated DeltaNet + gated attention + sparse MoE) against transformers'
Qwen3NextForCausalLM, through the engine's hybrid KV manager; and the MoE implementations."""

import random

import pytest
import torch
from hybrid_harness import engine_prefill_logits, hf_greedy, hf_logits

from infercore import Engine, SamplingParams
from infercore.models import Qwen3NextConfig, build_model
from infercore.models.moe import (
    moe_experts_dense,
    moe_experts_grouped,
    moe_experts_reference,
    route_topk,
)

GREEDY = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
KV = dict(page_size=4, kv_cache_bytes=1 << 20, checkpoint_interval=8)


def _prompts(n, seed, lo=5, hi=30, vocab=96):
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def _tiny_pair(seed: int):
    """A tiny random transformers Qwen3-Next and ours with its weights."""
    import transformers

    cfg = transformers.Qwen3NextConfig(
        vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, max_position_embeddings=256,
        rope_parameters={"rope_type": "default", "rope_theta": 1000.0, "partial_rotary_factor": 0.5},
        linear_conv_kernel_dim=4, linear_key_head_dim=8, linear_value_head_dim=8, linear_num_key_heads=2,
        linear_num_value_heads=4, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=16,
        shared_expert_intermediate_size=24, decoder_sparse_step=1, mlp_only_layers=[1],
        layer_types=["linear_attention", "linear_attention", "full_attention", "linear_attention"],
    )  # fmt: skip
    cfg._attn_implementation = "eager"
    torch.manual_seed(seed)
    hf = transformers.Qwen3NextForCausalLM(cfg).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "norm" in name or "dt_bias" in name:
                p.normal_(0.0, 0.3)
        hf.lm_head.weight.mul_(4.0)
    ours = build_model(Qwen3NextConfig.from_hf(cfg.to_dict()), dtype=torch.float32, device="cpu", init="empty")
    ours.load_weights(hf.state_dict().items())
    return hf, ours


@pytest.fixture(scope="module")
def pair():
    return _tiny_pair(0)


def test_moe_implementations_agree():
    torch.manual_seed(1)
    T, E, H, I, k = 13, 6, 16, 8, 3
    x = torch.randn(T, H)
    gate_up, down = torch.randn(E, 2 * I, H) * 0.3, torch.randn(E, H, I) * 0.3
    w, ids = route_topk(torch.randn(T, E), top_k=k, renormalize=True)
    torch.testing.assert_close(w.sum(-1), torch.ones(T))
    # The spec, written out token by token.
    want = torch.zeros(T, H)
    for t in range(T):
        for j in range(k):
            e = ids[t, j]
            h = gate_up[e] @ x[t]
            want[t] += w[t, j] * (down[e] @ (torch.nn.functional.silu(h[:I]) * h[I:]))
    for fn in (moe_experts_reference, moe_experts_grouped, moe_experts_dense):
        torch.testing.assert_close(fn(x, gate_up, down, w, ids), want, atol=1e-5, rtol=1e-5)
    # Prefill on accelerators: the routed op in chunks of ROUTED_MAX_TOKENS (here 4: 13 = 4+4+4+1).
    from infercore.models import moe as moe_mod

    old = moe_mod.ROUTED_MAX_TOKENS
    moe_mod.ROUTED_MAX_TOKENS = 4
    try:
        torch.testing.assert_close(moe_mod._routed_in_chunks(x, gate_up, down, w, ids), want, atol=1e-5, rtol=1e-5)
    finally:
        moe_mod.ROUTED_MAX_TOKENS = old
    # unset, the chunk bounds the fp32 per-pair outputs (rows * k * H * 4 bytes), from 1024 rows up
    assert moe_mod.routed_chunk_rows(6, 2048) == moe_mod.ROUTED_CHUNK_BYTES // (4 * 6 * 2048) > 1024
    assert moe_mod.routed_chunk_rows(8, 16384) == moe_mod.ROUTED_MIN_CHUNK
    with pytest.raises(ValueError, match="top_k"):
        route_topk(torch.randn(T, E), top_k=E + 1, renormalize=False)


def test_loads_per_expert_hub_names(pair):
    hf, ours = pair
    sd = dict(hf.state_dict())
    split = {}
    for name, t in sd.items():
        if name.endswith("mlp.experts.gate_up_proj"):
            i = t.shape[1] // 2
            for e in range(t.shape[0]):
                split[name.replace("gate_up_proj", f"{e}.gate_proj.weight")] = t[e, :i]
                split[name.replace("gate_up_proj", f"{e}.up_proj.weight")] = t[e, i:]
        elif name.endswith("mlp.experts.down_proj"):
            for e in range(t.shape[0]):
                split[name.replace("down_proj", f"{e}.down_proj.weight")] = t[e]
        else:
            split[name] = t
    other = build_model(ours.config, dtype=torch.float32, device="cpu", init="empty")
    other.load_weights(split.items())
    for (n, a), (_, b) in zip(ours.state_dict().items(), other.state_dict().items()):
        assert torch.equal(a, b), n
    with pytest.raises(ValueError, match="not \\(fully\\)"):
        other.load_weights((n, t) for n, t in split.items() if ".experts.3.up_proj" not in n)


@pytest.mark.parametrize("layout", ["multi", "uniform"])
def test_prefill_logits_match(pair, layout):
    hf, ours = pair
    ps = _prompts(3, seed=1)
    # Without prefix caching no checkpoint boundary cuts the prompts: one step holds them all.
    eng = Engine(ours, kv_layout=layout, enable_prefix_caching=False, **KV)
    for p, got in zip(ps, engine_prefill_logits(eng, ps)):
        torch.testing.assert_close(got, hf_logits(hf, p), atol=2e-4, rtol=1e-4)


@pytest.mark.parametrize("layout", ["multi", "uniform"])
def test_batched_chunked_greedy_matches_transformers(pair, layout):
    hf, ours = pair
    ps = _prompts(3, seed=2)
    eng = Engine(ours, max_num_batched_tokens=11, kv_layout=layout, **KV)
    outs = eng.generate(ps, GREEDY)
    for p, o in zip(ps, outs):
        assert o.token_ids == hf_greedy(hf, p, 32)
    eng.block_manager.check_invariants()


def test_prefix_hit_restores_checkpointed_state(pair):
    hf, ours = pair
    shared = _prompts(1, seed=3, lo=22, hi=22)[0]
    a, b = shared + [5, 6, 7], shared + [8, 9]
    eng = Engine(ours, **KV)
    assert eng.kv_layout == "multi" and eng.scheduler.chunk_boundary == 8
    first = eng.generate([a], GREEDY)[0]
    second = eng.generate([b], GREEDY)[0]
    third = eng.generate([a], GREEDY)[0]
    assert first.metrics.num_cached_tokens == 0
    assert second.metrics.num_cached_tokens == 16  # the last checkpoint inside the shared 22 tokens
    assert third.metrics.num_cached_tokens == 24
    assert second.token_ids == hf_greedy(hf, b, 32)
    assert third.token_ids == first.token_ids == hf_greedy(hf, a, 32)
    eng.block_manager.check_invariants()


def test_host_experts_in_the_hybrid_model():
    """Qwen3-Next with its routed experts on the host (offload.offload_experts_, oneDNN-packed): the greedy tokens
    are transformers' (the shared expert runs beside them), through the multi-granularity KV layout."""
    from infercore.offload import offload_experts_

    hf, ours = _tiny_pair(3)
    info = offload_experts_(ours, pack=True)
    assert info["layers"] == [0, 2, 3]  # layer 1 is a dense MLP
    ps = _prompts(3, seed=4)
    outs = Engine(ours, kv_layout="multi", **KV).generate(ps, GREEDY)
    for p, o in zip(ps, outs):
        assert o.token_ids == hf_greedy(hf, p, 32)
    assert all(h.calls_host > 0 for h in ours.host_experts.values())


@pytest.mark.gpu
def test_cuda_host_experts_in_the_hybrid_model_through_segmented_graphs():
    """Qwen3-Next on the GPU with its routed experts on the host: the hybrid graph runner captures the decode in
    segments (a host break per MoE layer, the shared expert overlapping the host); its greedy tokens equal the eager
    engine's on the same model."""
    from infercore.offload import offload_experts_

    _, ours = _tiny_pair(3)
    offload_experts_(ours, device="cuda", pack=True)
    ps = _prompts(3, seed=4)
    eager = Engine(ours, kv_layout="multi", cuda_graph_max_batch=0, **KV).generate(ps, GREEDY)
    eng = Engine(ours, kv_layout="multi", max_num_seqs=4, **KV)
    assert eng.graph_runner is not None
    assert {g.num_host_breaks for g in eng.graph_runner.graphs.values()} == {3}  # layers 0, 2 and 3
    calls = [h.calls_host for h in ours.host_experts.values()]
    got = eng.generate(ps, GREEDY)
    assert [o.token_ids for o in got] == [o.token_ids for o in eager]
    assert all(h.calls_host - c >= 31 for h, c in zip(ours.host_experts.values(), calls))  # each decode step


def test_prompt_logprobs_through_the_hybrid_runner(pair):
    """``prompt_logprobs`` over recurrent and attention layers, in 7-token chunks: transformers' log_softmax."""
    hf, ours = pair
    p = _prompts(1, seed=9, lo=17, hi=17)[0]
    eng = Engine(ours, max_num_batched_tokens=7, **KV)
    out = eng.generate([p], SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=1))[0]
    want = hf_logits(hf, p).log_softmax(-1)
    assert len(out.prompt_logprobs) == len(p) and out.prompt_logprobs[0] is None
    for i in range(1, len(p)):
        assert out.prompt_logprobs[i][p[i]] == pytest.approx(want[i - 1, p[i]].item(), abs=2e-4)
