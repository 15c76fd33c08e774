"""The Engine on CUDA: Triton kernels and CUDA-graph decode against transformers (run with -m gpu)."""

import pytest
import torch
from engine_helpers import hf_greedy, tiny_hf

from infercore import Engine, SamplingParams
from infercore.models import ModelConfig, build_model

pytestmark = pytest.mark.gpu


def _assert_greedy_like_transformers(hf, eng, prompts, n):
    outs = eng.generate(prompts, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
    for p, o in zip(prompts, outs):
        assert o.token_ids == hf_greedy(hf, p, n)


def _ours_on_cuda(hf, dtype):
    model = build_model(ModelConfig.from_hf(hf.config.to_dict()), dtype=dtype, device=torch.device("cuda"))
    model.load_weights(hf.state_dict().items())
    return model


@pytest.mark.parametrize("kind", ["llama", "qwen3", "mistral"])
def test_cuda_graph_greedy_matches_transformers(kind):
    hf = tiny_hf(kind)
    eng = Engine(_ours_on_cuda(hf, torch.float32), page_size=16, num_pages=128, max_num_batched_tokens=24)
    assert eng.graph_runner is not None and eng.graph_runner.graphs
    _assert_greedy_like_transformers(hf, eng, [[(7 * i + j) % 96 for j in range(5 + 9 * i)] for i in range(5)], 32)


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_cuda_graph_greedy_with_rope_fused_into_decode_attention(kind, monkeypatch):
    # INFERCORE_FUSED_ROPE_ATTENTION=1 (every decode-only step, eager and in CUDA graphs, not only the
    # <= 4-row ones of the default) rotate and write the new K/V inside the decode kernel; greedy tokens
    # stay those of transformers.
    from infercore.models import llama

    monkeypatch.setattr(llama, "FUSED_ROPE_ATTENTION", "1")
    hf = tiny_hf(kind)
    eng = Engine(_ours_on_cuda(hf, torch.float32), page_size=16, num_pages=128, max_num_batched_tokens=24)
    assert llama._fused_rope_attention(torch.device("cuda"), 5)
    _assert_greedy_like_transformers(hf, eng, [[(7 * i + j) % 96 for j in range(5 + 9 * i)] for i in range(5)], 32)


@pytest.mark.parametrize("kind", ["llama", "mistral"])
def test_mixed_steps_with_decodes_split_off_match_transformers(kind, monkeypatch):
    # Twelve requests through a 40-token budget: many steps mix prefill chunks with >= 2 decodes, whose
    # attention goes through the decode kernel (runner.SPLIT_DECODES_MIN lowered to 2); greedy tokens stay
    # those of transformers.
    from infercore.engine import runner
    from infercore.models import llama

    monkeypatch.setattr(runner, "SPLIT_DECODES_MIN", 2)
    seen = []
    real = llama.attend_split_decodes

    def attend(o, q, k_cache, v_cache, meta, *a, **kw):
        seen.append(meta.num_split_decodes)
        return real(o, q, k_cache, v_cache, meta, *a, **kw)

    monkeypatch.setattr(llama, "attend_split_decodes", attend)
    hf = tiny_hf(kind)
    eng = Engine(_ours_on_cuda(hf, torch.float32), page_size=16, num_pages=256, max_num_batched_tokens=40,
                 cuda_graph_max_batch=4)  # fmt: skip
    prompts = [[(3 * i + 5 * j) % 96 for j in range(4 + (11 * i) % 37)] for i in range(12)]
    _assert_greedy_like_transformers(hf, eng, prompts, 24)
    assert seen and max(seen) >= 4


@pytest.mark.parametrize("name", ["gemma3", "qwen3_next"])
def test_hybrid_mixed_steps_with_decodes_split_off_keep_the_tokens(name, monkeypatch):
    # The hybrid models' attention (ops.paged_attention) with mixed steps' decodes through the decode
    # kernel gives the tokens of the same engine with the split off.
    from infercore.engine import runner
    from infercore.models import Gemma3Config, Qwen3NextConfig
    from infercore.ops import attention

    if name == "gemma3":
        cfg = Gemma3Config(
            vocab_size=96, hidden_size=32, intermediate_size=48, num_layers=6, num_heads=2, num_kv_heads=1,
            head_dim=16, sliding_window=8, layer_types=["sliding_attention"] * 5 + ["full_attention"],
            max_position_embeddings=512, query_pre_attn_scalar=16.0, tie_word_embeddings=True)  # fmt: skip
    else:
        cfg = Qwen3NextConfig(
            vocab_size=96, hidden_size=32, intermediate_size=48, num_layers=4, num_heads=4, num_kv_heads=2,
            head_dim=8, layer_types=["linear_attention", "full_attention"] * 2, linear_key_head_dim=8,
            linear_value_head_dim=8, linear_num_key_heads=2, linear_num_value_heads=4, num_experts=4,
            num_experts_per_tok=2, moe_intermediate_size=16, shared_expert_intermediate_size=16,
            max_position_embeddings=512, partial_rotary_factor=0.5)  # fmt: skip
    torch.manual_seed(0)
    model = build_model(cfg, dtype=torch.float32, device=torch.device("cuda"))
    prompts = [[(3 * i + 5 * j) % 96 for j in range(4 + (11 * i) % 37)] for i in range(12)]
    sp = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    kw = dict(page_size=4, kv_cache_bytes=4_000_000, max_num_batched_tokens=40, cuda_graph_max_batch=4)
    monkeypatch.setattr(runner, "SPLIT_DECODES_MIN", 10**9)
    want = [o.token_ids for o in Engine(model, **kw).generate(prompts, sp)]
    calls = []
    real = attention.attend_split_decodes
    monkeypatch.setattr(attention, "attend_split_decodes", lambda *a, **k: calls.append(1) or real(*a, **k))
    monkeypatch.setattr(runner, "SPLIT_DECODES_MIN", 2)
    got = [o.token_ids for o in Engine(model, **kw).generate(prompts, sp)]
    assert got == want and calls


def test_bf16_batched_rows_agree_with_single_rows():
    hf = tiny_hf("llama", hidden_size=128, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2)
    eng = Engine(_ours_on_cuda(hf, torch.bfloat16), page_size=16, num_pages=256)
    prompts = [[(5 * i + 3 * j) % 96 for j in range(20 + 7 * i)] for i in range(6)]
    sp = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    batched = eng.generate(prompts, sp)
    for p, o in zip(prompts, batched):
        single = eng.generate([p], sp)[0]
        # bf16 rows can differ in the last bits between batch sizes; demand the first tokens agree
        assert o.token_ids[:4] == single.token_ids[:4]


def test_async_scheduling_matches_sync_on_cuda():
    """Overlapped scheduling (default on CUDA) against the synchronous loop with CUDA graphs:
    stop tokens, max_tokens, seeded sampling, aborts, a pool small enough to preempt, prefix hits."""
    import random

    hf = tiny_hf("llama")
    rng = random.Random(0)
    shared = [rng.randrange(96) for _ in range(24)]
    prompts = [shared[: rng.randint(8, 24)] + [rng.randrange(96) for _ in range(rng.randint(1, 20))]
               for _ in range(12)]
    params = [SamplingParams(temperature=0.0 if i % 3 else 0.8, seed=i, max_tokens=5 + 3 * (i % 5),
                             stop_token_ids=[7, 11] if i % 4 == 0 else [], ignore_eos=True) for i in range(12)]

    def run(async_scheduling, num_pages):
        eng = Engine(_ours_on_cuda(hf, torch.float32), page_size=4, num_pages=num_pages, max_num_seqs=8,
                     max_num_batched_tokens=32, async_scheduling=async_scheduling)
        assert eng.async_scheduling is async_scheduling and eng.graph_runner is not None
        final, step = {}, 0
        for i, (p, sp) in enumerate(zip(prompts, params)):
            eng.add_request(p, sp, request_id=f"r{i}")
        while eng.has_unfinished():
            if step == 6:
                eng.abort("r5")
            for o in eng.step():
                assert o.request_id not in final
                if o.finished:
                    final[o.request_id] = (o.token_ids, o.finish_reason)
            step += 1
        assert eng.block_manager.num_free_pages == num_pages
        return final, eng

    want, _ = run(False, 256)
    for pages in (256, 40):
        got, eng = run(True, pages)
        want.pop("r5", None), got.pop("r5", None)
        assert got == want
    assert Engine(_ours_on_cuda(hf, torch.float32), num_pages=16).async_scheduling  # on by default on CUDA


def test_requests_moved_between_cuda_engines_keep_their_tokens():
    """Engine.settle / take_requests / adopt_request with async scheduling and CUDA graphs: requests taken mid-run
    (one step in flight settled first) and continued by another engine, their KV moved by read_prefix_kv /
    write_prefix_kv, give the unmoved tokens."""
    hf = tiny_hf("llama")
    prompts = [[(5 * i + j) % 96 for j in range(4 + 7 * i)] for i in range(6)]
    params = [SamplingParams(temperature=0.0 if i % 2 else 0.9, seed=i, max_tokens=10 + 2 * i, ignore_eos=True)
              for i in range(6)]
    want = [o.token_ids for o in Engine(_ours_on_cuda(hf, torch.float32), page_size=4, num_pages=256,
                                        async_scheduling=False).generate(prompts, params)]
    a, b = (Engine(_ours_on_cuda(hf, torch.float32), page_size=4, num_pages=256, max_num_batched_tokens=32)
            for _ in range(2))
    assert a.async_scheduling and a.graph_runner is not None
    ids = [a.add_request(p, sp) for p, sp in zip(prompts, params)]
    final = {}
    for _ in range(6):
        final.update({o.request_id: o.token_ids for o in a.step() if o.finished})
    with pytest.raises(RuntimeError, match="settle"):
        a.take_requests()  # a step is in flight
    final.update({o.request_id: o.token_ids for o in a.settle() if o.finished})
    moved = 0
    for req in a.take_requests():  # with their KV (through b's prefix cache)
        moved += b.write_prefix_kv(req.all_token_ids, a.read_prefix_kv(req.all_token_ids)[1])
        b.adopt_request(req)
    assert moved > 0
    assert a.block_manager.num_free_pages == 256 and not a.has_unfinished()
    while b.has_unfinished():
        final.update({o.request_id: o.token_ids for o in b.step() if o.finished})
    assert [final[i] for i in ids] == want


@pytest.mark.parametrize("name,layout", [("qwen3_next", "multi"), ("qwen3_next", "uniform"), ("gemma3", "multi")])
def test_hybrid_cuda_graph_decode_matches_eager(name, layout):
    """Hybrid models decode through captured graphs (padding rows, sliding and linear groups, MoE
    routed on the device) with the eager engine's greedy tokens; a small pool preempts."""
    from infercore.models import Gemma3Config, Qwen3NextConfig

    if name == "qwen3_next":
        cfg = Qwen3NextConfig(
            vocab_size=96, hidden_size=64, intermediate_size=96, num_layers=4, num_heads=4, num_kv_heads=2,
            head_dim=16, layer_types=["linear_attention", "full_attention"] * 2, linear_key_head_dim=16,
            linear_value_head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4, num_experts=8,
            num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32,
            max_position_embeddings=512, partial_rotary_factor=0.5,
        )  # fmt: skip
    else:
        cfg = Gemma3Config(
            vocab_size=96, hidden_size=64, intermediate_size=96, num_layers=6, num_heads=2, num_kv_heads=1,
            head_dim=32, sliding_window=8, layer_types=["sliding_attention"] * 5 + ["full_attention"],
            max_position_embeddings=512, query_pre_attn_scalar=32.0, tie_word_embeddings=True,
        )  # fmt: skip
    torch.manual_seed(0)
    model = build_model(cfg, dtype=torch.float32, device=torch.device("cuda"))
    prompts = [[(7 * i + 3 * j) % 96 for j in range(5 + 6 * i)] for i in range(7)]
    sp = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    kw = dict(page_size=4, kv_cache_bytes=400_000, kv_layout=layout, max_num_batched_tokens=32, checkpoint_interval=8)
    want = [o.token_ids for o in Engine(model, cuda_graph_max_batch=0, **kw).generate(prompts, sp)]
    eng = Engine(model, **kw)
    assert eng.graph_runner is not None and eng.graph_runner.graphs
    replays = []
    orig = eng.graph_runner.launch
    eng.graph_runner.launch = lambda batch, gather=None: (replays.append(len(batch)), orig(batch, gather))[1]
    assert [o.token_ids for o in eng.generate(prompts, sp)] == want
    assert replays
    assert eng.block_manager.memory()["used"] == 0


@pytest.mark.parametrize("scheme", ["w4a16-g128", "fp8-wo"])
def test_quantized_cuda_graph_decode_matches_eager_through_mode9(scheme, monkeypatch):
    """Six requests decode together: the quantized linears (K a multiple of 128) take MODE 9 (``cuda_mma``) at 6 rows
    eagerly and at the 8-row bucket in the captured graphs (programmatic dependent launch); the greedy tokens equal
    the eager engine's."""
    if torch.cuda.get_device_capability()[0] < 9:
        pytest.fail("MODE 9's default dispatch is for sm90+: run on a Hopper GPU")
    from infercore.quant import cuda_mma as CM
    from infercore.quant import quantize

    calls = []
    real = CM.matmul
    monkeypatch.setattr(CM, "matmul", lambda *a, **kw: calls.append(a[0].shape[0]) or real(*a, **kw))
    hf = tiny_hf("llama", hidden_size=256, intermediate_size=512)
    prompts = [[(5 * i + 3 * j + 1) % 96 for j in range(8)] for i in range(6)]  # one prefill, then 6 rows a step
    outs = []
    for graphs in (256, 0):
        model = quantize(_ours_on_cuda(hf, torch.bfloat16), scheme)
        eng = Engine(model, page_size=16, num_pages=128, max_num_batched_tokens=64, cuda_graph_max_batch=graphs)
        assert (eng.graph_runner is not None) == (graphs > 0)
        outs.append([o.token_ids for o in eng.generate(prompts, SamplingParams(temperature=0, max_tokens=24,
                                                                                ignore_eos=True))])
    assert 6 in calls
    assert outs[0] == outs[1]



@pytest.mark.parametrize("quantization", ["w4a16-g128", "fp8-wo"])
def test_from_pretrained_quantized_on_cuda(quantization, tmp_path):
    """``from_pretrained(quantization=...)`` on CUDA (bf16, CUDA graphs) from a safetensors checkpoint: the same
    greedy tokens as the model quantized by hand before the Engine is built."""
    from infercore.quant import QuantLinear, quantize

    hf = tiny_hf("llama", hidden_size=256, intermediate_size=512)
    hf.save_pretrained(tmp_path)
    prompts = [[(5 * i + 3 * j + 1) % 96 for j in range(8)] for i in range(3)]
    sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    kw = dict(page_size=16, num_pages=64, max_num_batched_tokens=64)
    eng = Engine.from_pretrained(str(tmp_path), device="cuda", quantization=quantization, **kw)
    assert sum(isinstance(m, QuantLinear) for m in eng.model.modules()) == 2 * 4  # qkv, o, gate_up, down
    want = Engine(quantize(_ours_on_cuda(hf, torch.bfloat16), quantization), **kw).generate(prompts, sp)
    assert [o.token_ids for o in eng.generate(prompts, sp)] == [o.token_ids for o in want]


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_logprobs_from_cuda_graph_steps_match_transformers(async_scheduling):
    """SamplingParams.logprobs on CUDA: the decode steps replay captured graphs (the values are read from the
    graph's logits buffer before the next replay overwrites it, also under async scheduling), and they equal
    transformers' log_softmax at every generated position."""
    hf = tiny_hf("llama")
    eng = Engine(_ours_on_cuda(hf, torch.float32), page_size=16, num_pages=128, max_num_batched_tokens=24,
                 async_scheduling=async_scheduling)
    assert eng.graph_runner is not None and eng.graph_runner.graphs
    replays = []
    orig = eng.graph_runner.launch
    eng.graph_runner.launch = lambda batch, gather=None: (replays.append(len(batch)), orig(batch, gather))[1]
    prompts = [[(5 * i + j) % 96 for j in range(4 + 7 * i)] for i in range(4)]
    params = [SamplingParams(temperature=0 if i % 2 else 0.9, seed=i, max_tokens=20, ignore_eos=True,
                             logprobs=None if i == 3 else 2 * i) for i in range(4)]
    outs = eng.generate(prompts, params)
    assert replays
    for p, o, sp in zip(prompts, outs, params):
        if sp.logprobs is None:
            assert o.logprobs is None
            continue
        ids = torch.tensor([p + o.token_ids])
        with torch.inference_mode():
            want = hf(ids).logits[0, len(p) - 1 : -1].float().log_softmax(-1)
        assert len(o.logprobs) == len(o.token_ids) == 20
        for pos, (tok, d) in enumerate(zip(o.token_ids, o.logprobs)):
            assert d[tok] == pytest.approx(want[pos, tok].item(), abs=1e-3)
            top_v, top_i = want[pos].topk(sp.logprobs)
            assert set(d) == set(top_i.tolist()) | {tok}
            for t, v in zip(top_i.tolist(), top_v.tolist()):
                assert d[t] == pytest.approx(v, abs=1e-3)
        assert o.cumulative_logprob == pytest.approx(sum(d[t] for t, d in zip(o.token_ids, o.logprobs)), abs=1e-4)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_presence_frequency_penalties_on_cuda_match_the_cpu_engine(async_scheduling):
    """Penalized requests sample outside the captured graph from the host's tokens (async steps settle first);
    their greedy tokens equal the CPU engine's, next to unpenalized requests that sample inside the graph."""
    from engine_helpers import ours_from_hf

    hf = tiny_hf("llama")
    prompts = [[(3 * i + 5 * j) % 96 for j in range(6 + 5 * i)] for i in range(4)]
    params = [SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, frequency_penalty=1.5),
              SamplingParams(temperature=0, max_tokens=16, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, presence_penalty=-1.0,
                             repetition_penalty=1.5),
              SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, presence_penalty=1.0)]
    want = [o.token_ids for o in Engine(ours_from_hf(hf), page_size=16, num_pages=64).generate(prompts, params)]
    eng = Engine(_ours_on_cuda(hf, torch.float32), page_size=16, num_pages=128, max_num_batched_tokens=24,
                 async_scheduling=async_scheduling)
    assert eng.graph_runner is not None and eng.graph_runner.graphs
    assert [o.token_ids for o in eng.generate(prompts, params)] == want


@pytest.mark.parametrize("method", ["gptq", "awq", "gptq-act-order"])
def test_prequantized_checkpoint_on_cuda(method, tmp_path):
    """A GPTQ / AWQ directory on CUDA (bf16, the INT4 kernels, CUDA graphs), checked as
    ``engine_helpers.check_prequantized_on_cuda`` says."""
    from engine_helpers import check_prequantized_on_cuda, write_prequantized

    act_order = method == "gptq-act-order"
    path, ref = write_prequantized(tmp_path, method.split("-")[0], 4, 128, act_order=act_order, hidden_size=256,
                                   intermediate_size=512)
    check_prequantized_on_cuda(path, ref)


@pytest.mark.parametrize("kind", ["llama", "mistral"])
def test_speculative_decoding_on_cuda(kind):
    """n-gram drafts on CUDA: verification steps through the prefill kernels over the cached prefix, steps
    without drafts through the captured graphs; greedy tokens equal transformers' and seeded samples the plain
    CUDA engine's (fp32)."""
    hf = tiny_hf(kind)
    model = _ours_on_cuda(hf, torch.float32)
    loopy = [[5, 6, 7, 8, 9] * 3, [1, 2, 3, 4] * 2 + [1, 2], [40, 41, 40, 41, 40, 42, 40, 41]]
    prompts = loopy + [[(7 * i + 3 * j) % 96 for j in range(5 + 4 * i)] for i in range(3)]
    eng = Engine(model, page_size=16, num_pages=128, max_num_batched_tokens=64, num_speculative_tokens=4)
    gr = eng.graph_runner
    assert gr is not None and gr.graphs and gr.draft_rows and not eng.async_scheduling
    drafted_rows = []
    stage = gr.stage
    gr.stage = lambda batch, gather=None: drafted_rows.append(batch.num_tokens - len(batch)) or stage(batch, gather)
    outs = eng.generate(prompts, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
    assert [o.token_ids for o in outs] == [hf_greedy(hf, p, 40) for p in prompts]
    # one request of 4 rows (PDL on: the decode kernel must not read the cache before the step's KV write)
    one = eng.generate(loopy[:1], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))[0]
    assert one.token_ids == outs[0].token_ids and max(drafted_rows) > 0  # verifications replayed graphs
    kept = sum(o.metrics.num_accepted_tokens for o in outs)
    assert 0 < kept < sum(o.metrics.num_draft_tokens for o in outs)
    params = [SamplingParams(temperature=t, seed=5 + i, max_tokens=32, ignore_eos=True)
              for i, t in enumerate([0.05, 0.1, 0.08, 1.0, 0.05, 0.6])]
    plain = Engine(model, page_size=16, num_pages=128, max_num_batched_tokens=64).generate(prompts, params)
    assert [o.token_ids for o in eng.generate(prompts, params)] == [o.token_ids for o in plain]


class _PrintableTokenizer:
    """Token t < 95 decodes to chr(32 + t); token 95 is EOS (the tiny models' vocabulary is 96)."""

    vocab_size = 96
    eos_token_ids = {95}
    bos_token_id = None

    def decode(self, ids, *, skip_special_tokens=True):
        return "".join(chr(32 + t) for t in ids if t != 95)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_guided_decoding_on_cuda_matches_the_cpu_engine(async_scheduling):
    """Guided requests (a tiny random model, fp32) sample outside the captured graph from the host's tokens (async
    steps settle first), their logits masked; their tokens equal the CPU engine's, next to an unguided request that
    samples inside the graph."""
    import json
    import re

    from engine_helpers import ours_from_hf

    hf = tiny_hf("llama")
    tok = _PrintableTokenizer()
    schema = {"type": "object", "properties": {"name": {"type": "string", "pattern": "[A-Z][a-z]{1,10}"},
                                               "age": {"type": "integer", "minimum": 0, "maximum": 150}}}
    prompts = [[(3 * i + 7 * j) % 95 for j in range(5 + 4 * i)] for i in range(4)]
    params = [SamplingParams(temperature=0, max_tokens=40, guided_json=schema),
              SamplingParams(temperature=0, max_tokens=12, guided_regex=r"\d{3}-\d{4}"),
              SamplingParams(temperature=0, max_tokens=6, guided_choice=["yes", "no"]),
              SamplingParams(temperature=0, max_tokens=8)]
    want = Engine(ours_from_hf(hf), tok, page_size=16, num_pages=64).generate(prompts, params)
    eng = Engine(_ours_on_cuda(hf, torch.float32), tok, page_size=16, num_pages=128, max_num_batched_tokens=24,
                 async_scheduling=async_scheduling)
    assert eng.graph_runner is not None and eng.graph_runner.graphs
    outs = eng.generate(prompts, params)
    assert [o.token_ids for o in outs] == [o.token_ids for o in want]
    if outs[0].finish_reason == "stop":  # a random model may run out of tokens inside the object
        assert isinstance(json.loads(outs[0].text), dict)
    assert re.fullmatch(r"\d{3}-\d{4}", outs[1].text) and outs[1].finish_reason == "stop"
    assert outs[2].text in ("yes", "no")


def test_embeddings_on_cuda_match_transformers():
    """Embeddings (last and mean pooling) on CUDA, a one-token prompt among them (it must not replay a decode graph,
    which returns no hidden state), equal transformers' on the CPU."""
    hf = tiny_hf("llama")
    eng = Engine(_ours_on_cuda(hf, torch.float32), page_size=16, num_pages=128, max_num_batched_tokens=24)
    assert eng.graph_runner is not None and eng.graph_runner.graphs
    prompts = [[5], [(3 * j + 1) % 96 for j in range(9)], [(7 * j + 2) % 96 for j in range(40)]]
    for pooling in ("last", "mean"):
        for p, e in zip(prompts, eng.embed(prompts, pooling=pooling)):
            with torch.inference_mode():
                h = hf.model(torch.tensor([p])).last_hidden_state[0]
            want = torch.nn.functional.normalize(h[-1] if pooling == "last" else h.mean(0), dim=0)
            torch.testing.assert_close(e, want, atol=1e-4, rtol=1e-3)


def test_beam_search_on_cuda_matches_transformers():
    hf = tiny_hf("llama")
    eng = Engine(_ours_on_cuda(hf, torch.float32), page_size=16, num_pages=128)
    prompt = [(5 * j + 3) % 96 for j in range(11)]
    beams = eng.beam_search(prompt, beam_width=4, max_tokens=8, ignore_eos=True)[0]
    x = torch.tensor([prompt])
    with torch.inference_mode():
        out = hf.generate(x, attention_mask=torch.ones_like(x), num_beams=4, num_return_sequences=4, max_new_tokens=8,
                          min_new_tokens=8, do_sample=False, eos_token_id=None, pad_token_id=0, early_stopping=False)
    assert [b.token_ids for b in beams] == [s[len(prompt):].tolist() for s in out]


def test_draft_model_on_cuda_equals_plain_decoding():
    """Draft-model speculative decoding on CUDA (the verification through the decode graphs' draft rows): the tokens
    of the engine without drafts, greedy and seeded."""
    hf = tiny_hf("llama")
    draft_hf = tiny_hf("llama", num_hidden_layers=1)
    prompts = [[(3 * i + 7 * j) % 96 for j in range(5 + 6 * i)] for i in range(4)]
    params = [SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),
              SamplingParams(temperature=0.8, seed=3, max_tokens=20, ignore_eos=True)] * 2
    want = Engine(_ours_on_cuda(hf, torch.float32), page_size=16, num_pages=128).generate(prompts, params)
    eng = Engine(_ours_on_cuda(hf, torch.float32), page_size=16, num_pages=128, num_speculative_tokens=3,
                 draft_model=_ours_on_cuda(draft_hf, torch.float32))
    outs = eng.generate(prompts, params)
    assert [o.token_ids for o in outs] == [o.token_ids for o in want]
    assert sum(o.metrics.num_draft_tokens for o in outs) > 0
