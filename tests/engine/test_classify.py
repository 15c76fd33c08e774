"""Sequence classification (``Engine.classify``, the server's ``/classify``): tiny random transformers
``{Llama,Qwen3,Qwen2,Mistral,Phi3,Olmo2,Gemma2,Gemma3Text,Qwen3Moe,Mixtral}ForSequenceClassification`` checkpoints
saved with ``save_pretrained``, loaded through ``from_pretrained``; our probabilities against
``softmax(hf(input_ids).logits)``, through chunked prefill and the prefix cache; and the refusals (classify on a
causal LM, generate on a classifier)."""

import pytest
import torch
from engine_helpers import ours_from_hf, serving, tiny_hf

from infercore import Engine, SamplingParams

LABELS = {0: "negative", 1: "neutral", 2: "positive"}


def _prompts():
    # no pad token (0): HF pools the last non-pad token, we pool the last token
    return [[1 + (5 * i + 11 * j) % 95 for j in range(2 + 7 * i)] for i in range(4)]  # 2 .. 23 tokens


def _save_classifier(kind, path):
    import transformers

    kw = dict(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=False, pad_token_id=0,
              id2label=LABELS, label2id={v: k for k, v in LABELS.items()})
    if kind == "qwen3":
        cfg, cls = transformers.Qwen3Config(**kw, head_dim=8), transformers.Qwen3ForSequenceClassification
    elif kind == "qwen2":  # q/k/v biases
        cfg, cls = transformers.Qwen2Config(**kw), transformers.Qwen2ForSequenceClassification
    elif kind == "phi3":  # merged qkv / gate_up in the checkpoint, partial rotary
        cfg = transformers.Phi3Config(**kw, partial_rotary_factor=0.5)
        cls = transformers.Phi3ForSequenceClassification
    elif kind == "olmo2":  # post-norms, q / k norms over the whole projections
        cfg, cls = transformers.Olmo2Config(**kw), transformers.Olmo2ForSequenceClassification
    elif kind == "gemma2":  # softcapped attention, sliding layers, the head not softcapped
        kw.update(head_dim=8, sliding_window=6, attn_logit_softcapping=30.0, final_logit_softcapping=5.0)
        cfg, cls = transformers.Gemma2Config(**kw), transformers.Gemma2ForSequenceClassification
    elif kind == "gemma3":
        kw.update(head_dim=8, sliding_window=6, layer_types=["sliding_attention", "full_attention"])
        cfg, cls = transformers.Gemma3TextConfig(**kw), transformers.Gemma3TextForSequenceClassification
    elif kind == "qwen3_moe":  # routed experts
        kw.update(head_dim=8, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16)
        cfg, cls = transformers.Qwen3MoeConfig(**kw), transformers.Qwen3MoeForSequenceClassification
    elif kind == "mixtral":
        cfg = transformers.MixtralConfig(**kw, num_local_experts=4, num_experts_per_tok=2)
        cls = transformers.MixtralForSequenceClassification
    elif kind == "mistral":  # a window shorter than the longer prompts
        cfg, cls = transformers.MistralConfig(**kw, sliding_window=6), transformers.MistralForSequenceClassification
    else:
        cfg, cls = transformers.LlamaConfig(**kw), transformers.LlamaForSequenceClassification
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    hf = cls(cfg).eval()
    with torch.no_grad():
        hf.score.weight.mul_(20.0)  # spread the labels' probabilities away from uniform
    hf.save_pretrained(path)
    return hf


@torch.inference_mode()
def _hf_probs(hf, prompt):
    return torch.softmax(hf(torch.tensor([prompt])).logits[0].float(), dim=-1)


@pytest.mark.parametrize("kind", ["llama", "qwen3", "qwen2", "mistral", "phi3", "olmo2", "gemma2", "gemma3",
                                  "qwen3_moe", "mixtral"])
def test_classify_matches_transformers(kind, tmp_path):
    hf = _save_classifier(kind, tmp_path)
    # chunks of 8 tokens: the longer prompts are classified over several steps
    eng = Engine.from_pretrained(str(tmp_path), device="cpu", dtype=torch.float32, page_size=4, num_pages=128,
                                 max_num_batched_tokens=8)
    assert eng.model.config.id2label == LABELS
    prompts = _prompts()
    outs = eng.classify(prompts)
    assert len(outs) == len(prompts)
    seen = set()
    for p, o in zip(prompts, outs):
        want = _hf_probs(hf, p)
        assert o.probs.shape == (3,) and o.probs.dtype == torch.float32 and o.num_classes == 3
        torch.testing.assert_close(o.probs, want, atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(o.logits, hf(torch.tensor([p])).logits[0].detach(), atol=1e-4, rtol=1e-4)
        assert o.label == LABELS[int(want.argmax())] and o.prompt_token_ids == p
        assert float(want.max()) > 0.4  # not uniform: a wrong head or row would show
        seen.add(o.label)
    assert len(seen) > 1  # the prompts are told apart
    # the same prompts again: all but each last token from the prefix cache
    hits = eng.block_manager.stats.hit_tokens
    again = eng.classify(prompts)
    for a, b in zip(outs, again):
        torch.testing.assert_close(a.probs, b.probs, atol=1e-6, rtol=1e-5)
    # the whole 4-token pages of each prompt but its last token
    assert eng.block_manager.stats.hit_tokens - hits == sum(4 * ((len(p) - 1) // 4) for p in prompts) > 0
    # one prompt, and the last k tokens only
    one = eng.classify(prompts[3], truncate_prompt_tokens=5)
    assert len(one) == 1 and one[0].prompt_token_ids == prompts[3][-5:]
    torch.testing.assert_close(one[0].probs, _hf_probs(hf, prompts[3][-5:]), atol=1e-5, rtol=1e-4)


def test_quantized_classifier_keeps_its_head(tmp_path):
    """quantize()'s default skip leaves the score head (like lm_head) in full precision; the quantized decoder's
    probabilities stay close to transformers'."""
    from infercore.quant import QuantLinear

    hf = _save_classifier("llama", tmp_path)
    eng = Engine.from_pretrained(str(tmp_path), device="cpu", dtype=torch.float32, quantization="w8a16",
                                 page_size=4, num_pages=64)
    assert not isinstance(eng.model.score, QuantLinear)  # full precision (packed for the CPU)
    assert any(isinstance(m, QuantLinear) for m in eng.model.modules())
    for p, o in zip(_prompts(), eng.classify(_prompts())):
        torch.testing.assert_close(o.probs, _hf_probs(hf, p), atol=3e-2, rtol=0)


def test_refusals(tmp_path):
    _save_classifier("llama", tmp_path)
    eng = Engine.from_pretrained(str(tmp_path), device="cpu", dtype=torch.float32, page_size=4, num_pages=64)
    for call in (lambda: eng.generate([[1, 2, 3]], SamplingParams(max_tokens=2)),
                 lambda: eng.add_request([1, 2, 3]),
                 lambda: eng.beam_search([[1, 2, 3]], beam_width=2, max_tokens=2)):
        with pytest.raises(ValueError, match="sequence classifier"):
            call()
    assert not eng.has_unfinished()
    assert len(eng.embed([[1, 2, 3]])[0]) == 32  # pooling still serves it
    causal = Engine(ours_from_hf(tiny_hf("llama")), page_size=4, num_pages=64)
    with pytest.raises(ValueError, match="no sequence-classification head"):
        causal.classify([[1, 2, 3]])


def test_classify_endpoint(tmp_path):
    hf = _save_classifier("qwen3", tmp_path)
    eng = Engine.from_pretrained(str(tmp_path), device="cpu", dtype=torch.float32, page_size=4, num_pages=128)
    prompts = _prompts()[:3]
    with serving(eng) as call:
        status, body = call("POST", "/classify", {"model": "tiny", "input": prompts})
        assert status == 200, body
        assert body["object"] == "list" and body["model"] == "tiny" and body["id"].startswith("classify-")
        assert [d["index"] for d in body["data"]] == [0, 1, 2]
        assert body["usage"] == {"prompt_tokens": sum(map(len, prompts)), "total_tokens": sum(map(len, prompts))}
        for d, p in zip(body["data"], prompts):
            want = _hf_probs(hf, p)
            assert d["num_classes"] == 3 and d["label"] == LABELS[int(want.argmax())]
            torch.testing.assert_close(torch.tensor(d["probs"]), want, atol=1e-5, rtol=1e-4)
        status, body = call("POST", "/classify", {"input": prompts[1]})  # one prompt of token ids
        assert status == 200 and len(body["data"]) == 1 and body["usage"]["prompt_tokens"] == len(prompts[1])
        for bad in ({}, {"input": []}, {"input": [[]]}, {"input": 3}, {"input": [[1, "a"]]}):
            status, body = call("POST", "/classify", bad)
            assert status == 400 and body["error"]["param"] == "input", (bad, body)
        status, body = call("POST", "/classify", {"input": "text"})  # no tokenizer
        assert status == 400
        status, body = call("POST", "/v1/completions", {"prompt": prompts[0], "max_tokens": 2})
        assert status == 400 and "classif" in body["error"]["message"]
    with serving(Engine(ours_from_hf(tiny_hf("llama")), page_size=4, num_pages=64)) as call:
        status, body = call("POST", "/classify", {"input": prompts[0]})
        assert status == 400 and "classification" in body["error"]["message"]
