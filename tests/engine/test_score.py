"""Pair scoring (``Engine.score``, the server's ``/score`` and ``/rerank``): cosine similarity of an embedding model's
last-token embeddings, and a one-label sequence classifier (a cross-encoder) over the joined pair against
transformers' ``sigmoid(logits)``."""

import pytest
import torch
from engine_helpers import ours_from_hf, serving, tiny_hf

from infercore import Engine

Q = [5, 9, 13, 2]
DOCS = [[7, 3, 3, 8, 1], [5, 9, 13], [40, 41, 42, 43, 44, 45, 46], [9, 13, 2]]


@pytest.fixture(scope="module")
def embedder():
    return Engine(ours_from_hf(tiny_hf("llama")), page_size=4, num_pages=128)


def test_cosine_scores_of_an_embedding_model(embedder):
    eng = embedder
    embs = eng.embed([Q, *DOCS])
    got = eng.score(Q, DOCS)
    want = [float(embs[0] @ e) for e in embs[1:]]
    assert got == pytest.approx(want, abs=1e-5) and len(set(round(v, 4) for v in got)) == len(DOCS)
    # pairwise: text_1[i] with text_2[i]
    pairs = eng.score(DOCS[:2], DOCS[2:])
    assert pairs == pytest.approx([float(embs[1] @ embs[3]), float(embs[2] @ embs[4])], abs=1e-5)
    assert eng.score(Q, [Q])[0] == pytest.approx(1.0, abs=1e-5)
    with pytest.raises(ValueError, match="text_1 has 2 entries for 3"):
        eng.score(DOCS[:2], DOCS[:3])


def _cross_encoder(path, num_labels=1):
    import transformers

    cfg = transformers.LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                                   tie_word_embeddings=False, pad_token_id=0, num_labels=num_labels)
    torch.manual_seed(1)
    hf = transformers.LlamaForSequenceClassification(cfg).eval()
    with torch.no_grad():
        hf.score.weight.mul_(20.0)
    hf.save_pretrained(path)
    return hf


def test_cross_encoder_scores_the_joined_pair(tmp_path):
    hf = _cross_encoder(tmp_path)
    eng = Engine.from_pretrained(str(tmp_path), device="cpu", dtype=torch.float32, page_size=4, num_pages=64)
    got = eng.score(Q, DOCS)
    with torch.inference_mode():
        want = [float(torch.sigmoid(hf(torch.tensor([Q + d])).logits[0, 0])) for d in DOCS]
    assert got == pytest.approx(want, abs=1e-5)
    assert max(want) - min(want) > 0.05  # the documents are told apart
    with serving(eng) as call:
        status, body = call("POST", "/rerank", {"query": Q, "documents": DOCS})
    assert status == 200 and [r["index"] for r in body["results"]] == sorted(range(4), key=lambda i: -want[i])
    assert [r["relevance_score"] for r in body["results"]] == pytest.approx(sorted(want, reverse=True), abs=1e-5)
    many = tmp_path / "three"
    _cross_encoder(many, num_labels=3)
    with pytest.raises(ValueError, match="one label"):
        Engine.from_pretrained(str(many), device="cpu", dtype=torch.float32).score(Q, DOCS)


def test_score_and_rerank_routes(embedder, tmp_path):
    want = embedder.score(Q, DOCS)
    pairwise = embedder.score(DOCS[:2], DOCS[2:])
    with serving(embedder) as call:
        status, body = call("POST", "/score", {"text_1": Q, "text_2": DOCS})
        assert status == 200 and body["object"] == "list"
        assert [d["index"] for d in body["data"]] == [0, 1, 2, 3]
        assert [d["score"] for d in body["data"]] == pytest.approx(want, abs=1e-5)
        assert body["usage"]["prompt_tokens"] == len(Q) + sum(map(len, DOCS))
        status, body = call("POST", "/v1/score", {"text_1": DOCS[:2], "text_2": DOCS[2:]})
        assert [d["score"] for d in body["data"]] == pytest.approx(pairwise, abs=1e-5)
        status, body = call("POST", "/rerank", {"query": Q, "documents": DOCS, "top_n": 2})
        assert status == 200
        best = sorted(range(4), key=lambda i: -want[i])[:2]
        assert [r["index"] for r in body["results"]] == best
        assert [r["relevance_score"] for r in body["results"]] == pytest.approx([want[i] for i in best], abs=1e-5)
        cases = (("/score", {"text_1": Q}, "text_2"), ("/score", {"text_1": 3, "text_2": DOCS}, "text_1"),
                 ("/score", {"text_1": DOCS[:2], "text_2": DOCS[:3]}, "text_2"),
                 ("/rerank", {"query": Q, "documents": []}, "documents"),
                 ("/rerank", {"query": [Q, Q], "documents": DOCS}, "query"),
                 ("/rerank", {"query": Q, "documents": DOCS, "top_n": 0}, "top_n"))
        for path, bad, param in cases:
            status, body = call("POST", path, bad)
            assert status == 400 and body["error"]["param"] == param, (path, bad, body)
        status, body = call("POST", "/rerank", {"query": "text", "documents": DOCS})  # no tokenizer here
        assert status == 400 and "tokenizer" in body["error"]["message"]
