"""Embeddings (``Engine.embed``, ``add_request(pooling=...)``, the server's ``/v1/embeddings``): the final hidden
state of the last prompt token, or the mean over the prompt, against transformers' ``last_hidden_state`` of the same
tiny random models; through chunked prefill, the prefix cache, batches shared with generation, and a LoRA adapter."""

import pytest
import torch
from engine_helpers import hf_greedy, ours_from_hf, serving, tiny_hf

from infercore import Engine, SamplingParams


def _prompts():
    return [[(7 * i + 3 * j + 1) % 96 for j in range(1 + 9 * i)] for i in range(5)]  # 1 .. 37 tokens


@torch.inference_mode()
def _hf_embedding(hf, prompt, pooling):
    h = hf.model(torch.tensor([prompt])).last_hidden_state[0].float()  # after the final norm
    e = h[-1] if pooling == "last" else h.mean(0)
    return torch.nn.functional.normalize(e, dim=0)


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
@pytest.mark.parametrize("pooling", ["last", "mean"])
def test_embeddings_match_transformers(kind, pooling):
    hf = tiny_hf(kind)
    # chunks of 8 tokens: the longer prompts pool over several steps
    eng = Engine(ours_from_hf(hf), page_size=4, num_pages=128, max_num_batched_tokens=8)
    prompts = _prompts()
    embs = eng.embed(prompts, pooling=pooling)
    for p, e in zip(prompts, embs):
        assert e.shape == (hf.config.hidden_size,) and e.dtype == torch.float32
        torch.testing.assert_close(e, _hf_embedding(hf, p, pooling), atol=2e-5, rtol=1e-4)
    # again: "last" takes the prefix cache's pages (all but the last token), "mean" computes every position
    again = eng.embed(prompts, pooling=pooling)
    for a, b in zip(embs, again):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)
    raw = eng.embed(prompts[2], pooling=pooling, normalize=False)[0]
    torch.testing.assert_close(torch.nn.functional.normalize(raw, dim=0), embs[2], atol=1e-6, rtol=1e-5)
    assert raw.norm() > 1.5  # not normalized


def test_embedding_requests_share_steps_with_generation():
    hf = tiny_hf("llama")
    eng = Engine(ours_from_hf(hf), page_size=4, num_pages=128, max_num_batched_tokens=16)
    prompts = _prompts()
    sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    gen = [eng.add_request(p, sp) for p in prompts[1:3]]
    emb = [eng.add_request(p, pooling="mean") for p in prompts]
    outs = {}
    while eng.has_unfinished():
        for o in eng.step():
            if o.finished:
                outs[o.request_id] = o
    for rid, p in zip(gen, prompts[1:3]):
        assert outs[rid].token_ids == hf_greedy(hf, p, 12) and outs[rid].embedding is None
    for rid, p in zip(emb, prompts):
        e = torch.nn.functional.normalize(outs[rid].embedding, dim=0)
        torch.testing.assert_close(e, _hf_embedding(hf, p, "mean"), atol=2e-5, rtol=1e-4)
    with pytest.raises(ValueError, match="pooling must be one of"):
        eng.add_request([1, 2], pooling="cls")
    with pytest.raises(ValueError, match="pooling must be one of"):
        eng.embed([[1, 2]], pooling="max")


def test_embeddings_endpoint():
    hf = tiny_hf("llama")
    with serving(Engine(ours_from_hf(hf), page_size=4, num_pages=128)) as call:
        def post(body):
            return call("POST", "/v1/embeddings", body)

        prompts = _prompts()[1:4]
        status, body = post({"input": prompts, "model": "tiny"})
        assert status == 200, body
        assert body["object"] == "list" and [d["index"] for d in body["data"]] == [0, 1, 2]
        assert body["usage"]["prompt_tokens"] == sum(map(len, prompts))
        for d, p in zip(body["data"], prompts):
            assert d["object"] == "embedding"
            torch.testing.assert_close(torch.tensor(d["embedding"]), _hf_embedding(hf, p, "last"), atol=2e-5,
                                       rtol=1e-4)
        status, body = post({"input": prompts[0]})  # one prompt of token ids
        assert status == 200 and len(body["data"]) == 1
        status, body = post({"input": prompts[0], "pooling": "mean"})
        torch.testing.assert_close(torch.tensor(body["data"][0]["embedding"]), _hf_embedding(hf, prompts[0], "mean"),
                                   atol=2e-5, rtol=1e-4)
        for bad, param in (({}, "input"), ({"input": []}, "input"), ({"input": [[]]}, "input"),
                           ({"input": [1, 2], "pooling": "max"}, "pooling"),
                           ({"input": [1, 2], "encoding_format": "base64"}, "encoding_format")):
            status, body = post(bad)
            assert status == 400 and body["error"]["param"] == param, (bad, body)
        status, body = post({"input": "text"})  # no tokenizer
        assert status == 400


def test_real_smollm2_embeddings_match_transformers():
    """SmolLM2-135M-Instruct's own weights (fp32): last-token and mean embeddings of two texts equal transformers'
    LlamaModel on the same dequantized weights."""
    import transformers

    from infercore.loading import default_model_path, load_checkpoint

    eng = Engine.from_pretrained(device="cpu", dtype=torch.float32)
    ckpt = load_checkpoint(default_model_path())
    hf = transformers.LlamaForCausalLM(transformers.AutoConfig.for_model(**ckpt.config)).eval()
    hf.load_state_dict({k: v.float() for k, v in ckpt.weights()}, strict=False)
    texts = ["The capital of France is Paris.", "A lighthouse keeper wrote a letter to the sea every night."]
    for pooling in ("last", "mean"):
        embs = eng.embed(texts, pooling=pooling)
        for t, e in zip(texts, embs):
            want = _hf_embedding(hf, eng.tokenizer.encode(t), pooling)
            torch.testing.assert_close(e, want, atol=1e-4, rtol=1e-3)
    # different texts, different directions
    a, b = eng.embed(texts)
    assert float(a @ b) < 0.99


@pytest.mark.parametrize("kind", ["qwen3", "mistral"])
def test_bare_decoder_checkpoint_embeds_like_transformers(kind, tmp_path):
    """A bare decoder saved by transformers (``Qwen3Model`` / ``MistralModel``: no ``model.`` prefix, no head; what
    Qwen3-Embedding and e5-mistral ship) loads through ``from_pretrained`` and embeds as transformers does."""
    import transformers

    kw = dict(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=False)
    cfg = transformers.Qwen3Config(**kw, head_dim=8) if kind == "qwen3" else transformers.MistralConfig(**kw)
    torch.manual_seed(0)
    bare = (transformers.Qwen3Model if kind == "qwen3" else transformers.MistralModel)(cfg).eval()
    bare.save_pretrained(tmp_path)
    eng = Engine.from_pretrained(tmp_path, device="cpu", dtype=torch.float32)
    prompts = _prompts()[1:4]
    with torch.inference_mode():
        for p, e in zip(prompts, eng.embed(prompts)):
            want = torch.nn.functional.normalize(bare(torch.tensor([p])).last_hidden_state[0, -1], dim=0)
            torch.testing.assert_close(e, want, atol=2e-5, rtol=1e-4)


def test_dimensions_and_prompt_truncation():
    hf = tiny_hf("llama")
    eng = Engine(ours_from_hf(hf), page_size=4, num_pages=128)
    p = _prompts()[3]
    full = eng.embed([p], normalize=False)[0]
    cut = eng.embed([p], dimensions=8)[0]
    torch.testing.assert_close(cut, torch.nn.functional.normalize(full[:8], dim=0), atol=1e-6, rtol=1e-5)
    last = eng.embed([p], truncate_prompt_tokens=5)[0]  # only the prompt's last 5 tokens
    torch.testing.assert_close(last, _hf_embedding(hf, p[-5:], "last"), atol=2e-5, rtol=1e-4)
    # generation too: the request keeps its prompt's last k tokens
    sp = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, truncate_prompt_tokens=7)
    out = eng.generate([p], sp)[0]
    assert out.prompt_token_ids == p[-7:] and out.token_ids == hf_greedy(hf, p[-7:], 6)
    with pytest.raises(ValueError, match="dimensions"):
        eng.embed([p], dimensions=33)
    with pytest.raises(ValueError, match="truncate_prompt_tokens"):
        SamplingParams(truncate_prompt_tokens=0)
    with serving(eng) as call:
        status, body = call("POST", "/v1/embeddings", {"input": p, "dimensions": 8, "truncate_prompt_tokens": 5})
        assert status == 200 and len(body["data"][0]["embedding"]) == 8 and body["usage"]["prompt_tokens"] == 5
        want = torch.nn.functional.normalize(eng.embed([p[-5:]], normalize=False)[0][:8], dim=0)
        torch.testing.assert_close(torch.tensor(body["data"][0]["embedding"]), want, atol=1e-6, rtol=1e-5)
        status, body = call("POST", "/v1/embeddings", {"input": p, "dimensions": 0})
        assert status == 400 and body["error"]["param"] == "dimensions"
        status, body = call("POST", "/v1/completions", {"prompt": p, "max_tokens": 2, "truncate_prompt_tokens": 4})
        assert status == 200 and body["usage"]["prompt_tokens"] == 4
