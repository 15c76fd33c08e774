"""Weight streaming on CUDA (run with -m gpu): a side copy stream ordered by events against the compute stream,
eager and inside the Engine's CUDA-graph decode; page-locked host memory; the copies overlap compute."""

import os
import sys
import time

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "models"))

pytestmark = pytest.mark.gpu

CUDA = torch.device("cuda")


def _config(layers=8, hidden=1024, inter=3584, vocab=8192):
    from infercore.models import ModelConfig

    return ModelConfig.from_hf(dict(
        model_type="llama", architectures=["LlamaForCausalLM"], vocab_size=vocab, hidden_size=hidden,
        intermediate_size=inter, num_hidden_layers=layers, num_attention_heads=hidden // 128, num_key_value_heads=2,
        max_position_embeddings=40960, rms_norm_eps=1e-5, rope_theta=500000.0, tie_word_embeddings=False,
        hidden_act="silu"))


def _model(cfg, device=CUDA, seed=0):
    """A random bf16 model; the same ``seed`` gives the same weights on any device."""
    from infercore.models import build_model

    torch.manual_seed(seed)
    model = build_model(cfg, dtype=torch.bfloat16, device=CUDA)
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)  # spread the logits: greedy choices far from ties
    return model.to(device)


def _budget(model, kind, prefetch=2):
    from infercore.offload.plan import make_plan

    full = make_plan(model, 1 << 50, prefetch=prefetch, device=CUDA)
    slot = max(full.layer_bytes) + 64 * 256  # packing alignment: a little more than the layer
    return {"some": full.always_resident_bytes + 3 * max(full.layer_bytes) + prefetch * slot,
            "min": full.always_resident_bytes + prefetch * slot}[kind]


def _greedy_logits(model, prompts, steps):
    from paged_harness import PagedRunner

    run = PagedRunner(model, num_pages=128, page_size=16)
    out = [run.step(list(enumerate(prompts)))]
    ends = torch.tensor([len(p) for p in prompts]).cumsum(0) - 1
    nxt = out[0][ends].argmax(-1).tolist()
    toks = [nxt]
    for _ in range(steps):
        out.append(run.step([(i, [t]) for i, t in enumerate(nxt)]))
        nxt = out[-1].argmax(-1).tolist()
        toks.append(nxt)
    return torch.cat(out), toks


PROMPTS = [[(13 * i + 7 * j) % 8000 for j in range(9 + 17 * i)] for i in range(4)]


@pytest.mark.parametrize("prefetch", [1, 2, 3])
@pytest.mark.parametrize("kind", ["some", "min"])
def test_eager_logits_and_tokens_match(kind, prefetch):
    from infercore.offload import offload_weights_

    cfg = _config()
    want, want_toks = _greedy_logits(_model(cfg), PROMPTS, 12)
    model = _model(cfg)
    plan = offload_weights_(model, gpu_budget_bytes=_budget(model, kind, prefetch), prefetch=prefetch)
    assert plan.streamed_layers and plan.num_slots == min(prefetch, len(plan.streamed_layers))
    assert model.offload_streamer.host.is_pinned()
    got, toks = _greedy_logits(model, PROMPTS, 12)
    assert toks == want_toks
    assert torch.equal(got, want) or (got - want).abs().max() <= 1e-2 * want.abs().max()


def test_missing_wait_is_observable(monkeypatch):
    # The check above can fail: without the compute stream's wait for a copy, layers run on whatever their slot
    # held (another layer's weights, or a half-finished copy), and the logits change.
    from infercore.offload import offload_weights_, streaming

    cfg = _config()
    want, _ = _greedy_logits(_model(cfg), PROMPTS, 2)
    model = _model(cfg)
    offload_weights_(model, gpu_budget_bytes=_budget(model, "min"), prefetch=2)
    monkeypatch.setattr(streaming._CudaCopier, "wait", lambda self, k: None)
    got, _ = _greedy_logits(model, PROMPTS, 2)
    assert not torch.allclose(got, want, atol=1e-2, rtol=1e-2)


@pytest.mark.parametrize("from_cpu", [False, True], ids=["cuda-model", "cpu-model-to-cuda"])
def test_engine_cuda_graphs_greedy_equal(from_cpu):
    from infercore import Engine, SamplingParams
    from infercore.offload import offload_weights_

    cfg = _config()
    sp = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    prompts = PROMPTS + [[5, 6, 7, 8, 9] * 7, [100]]
    kw = dict(page_size=16, num_pages=256, max_num_batched_tokens=64, max_num_seqs=8, cuda_graph_max_batch=8)
    ref = Engine(_model(cfg), **kw)
    want = [o.token_ids for o in ref.generate(prompts, sp)]
    want_reversed = [o.token_ids for o in ref.generate(prompts[::-1], sp)]  # other chunk boundaries
    model = _model(cfg, device=torch.device("cpu") if from_cpu else CUDA)
    free0 = torch.cuda.mem_get_info()[0]
    plan = offload_weights_(model, gpu_budget_bytes=_budget(model, "some"), prefetch=2, device="cuda")
    assert len(plan.streamed_layers) == cfg.num_layers - 3
    assert model.model.embed_tokens.weight.is_cuda and model.offload_streamer.host.is_pinned()
    assert all(p.is_cuda for p in model.parameters())
    if not from_cpu:  # the streamed layers' device memory was given back
        assert torch.cuda.mem_get_info()[0] - free0 > 0.5 * (plan.streamed_bytes_per_forward - plan.staging_bytes)
    eng = Engine(model, **kw)
    assert eng.graph_runner is not None and eng.graph_runner.graphs
    forwards = model.offload_streamer.forwards
    got = [o.token_ids for o in eng.generate(prompts, sp)]
    assert got == want
    # decode steps replayed graphs: most of the 24 steps did not run the Python forward
    assert model.offload_streamer.forwards - forwards < 24
    # and again, interleaving eager prefills with replays
    assert [o.token_ids for o in eng.generate(prompts[::-1], sp)] == want_reversed


def _prefill_meta(T, page=16):
    from infercore.ops import AttentionMetadata

    pages = -(-T // page)
    return AttentionMetadata.from_lists(query_lens=[T], seq_lens=[T], block_tables=[list(range(pages))],
                                        slot_mapping=list(range(T)), device=CUDA), pages


def _time(fn, reps=5):
    fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        ts.append(time.perf_counter() - t)
    return sorted(ts)[len(ts) // 2]


@torch.inference_mode()
def test_copies_overlap_compute():
    # A forward that streams 5 of 8 layers takes clearly less than its copies plus its compute done one after the
    # other. The prompt length is chosen so that compute and copies take comparable time (else either hides the
    # other trivially or nothing can be seen).
    from infercore.kv import allocate_kv_caches
    from infercore.offload import offload_weights_

    cfg = _config(layers=8, hidden=2048, inter=8192, vocab=4096)
    ref = _model(cfg)
    model = _model(cfg)
    plan = offload_weights_(model, gpu_budget_bytes=_budget(model, "some"), prefetch=2)
    s = model.offload_streamer

    def copies():
        for dst, src in zip(s.dst, s.hosts):
            dst.copy_(src, non_blocking=True)

    t_copy = _time(copies)
    for T in (2048, 4096, 8192, 16384, 32768):
        meta, pages = _prefill_meta(T)
        kv = allocate_kv_caches(ref.kv_specs(), pages, 16, dtype=torch.bfloat16, device=CUDA)
        ids = torch.randint(0, 4000, (T,), device=CUDA)
        pos = torch.arange(T, device=CUDA)
        step = (ids, pos, kv, meta)
        t_compute = _time(lambda: ref(*step))  # noqa: B023 -- called before the next iteration
        if t_compute >= 0.5 * t_copy:
            break
    t_stream = _time(lambda: model(*step))
    print(f"T={T}: copies {t_copy * 1e3:.2f} ms ({plan.streamed_bytes_per_forward / t_copy / 1e9:.1f} GB/s), "
          f"resident compute {t_compute * 1e3:.2f} ms, streamed forward {t_stream * 1e3:.2f} ms")
    assert t_stream < 0.85 * (t_copy + t_compute)
    assert t_stream >= 0.95 * max(t_copy, t_compute)  # and it did not skip work
