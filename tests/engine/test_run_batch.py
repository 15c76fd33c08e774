"""``infercore run-batch`` / :func:`infercore.batch.run_batch`: a JSONL file of OpenAI Batch API requests answered
in input order through the server's routes, with the same texts the engine gives directly (SmolLM2-135M)."""

import json

import pytest
import torch

from infercore import Engine, SamplingParams
from infercore.batch import run_batch
from infercore.cli import main


@pytest.fixture(scope="module")
def engine():
    return Engine.from_pretrained(device="cpu", dtype=torch.float32, max_num_batched_tokens=256,
                                  async_scheduling=False)


def _lines():
    chat = {"model": "m", "messages": [{"role": "user", "content": "What is the capital of France?"}],
            "temperature": 0, "max_tokens": 10}
    return [
        json.dumps({"custom_id": "chat", "method": "POST", "url": "/v1/chat/completions", "body": chat}),
        json.dumps({"custom_id": "text", "method": "POST", "url": "/v1/completions",
                    "body": {"model": "m", "prompt": "The capital of France is", "temperature": 0, "max_tokens": 6}}),
        "",  # blank lines are skipped
        "{not json",
        json.dumps({"custom_id": "url", "method": "POST", "url": "/v1/files", "body": {}}),
        json.dumps({"custom_id": "stream", "url": "/v1/completions", "body": {"prompt": "a", "stream": True}}),
        json.dumps({"custom_id": "refused", "url": "/v1/completions", "body": {"prompt": "a", "max_tokens": -3}}),
        json.dumps({"custom_id": "embed", "url": "/v1/embeddings", "body": {"input": ["Paris", "Rome"]}}),
    ]


def test_run_batch_answers_in_order_like_the_engine(engine):
    want_chat = engine.generate(["What is the capital of France?"], SamplingParams(temperature=0, max_tokens=10),
                                chat=True)[0].text
    want_text = engine.generate(["The capital of France is"], SamplingParams(temperature=0, max_tokens=6))[0].text
    want_emb = engine.embed(["Paris", "Rome"])
    outs = list(run_batch(engine, _lines(), model_name="m", concurrency=3))
    assert [o["custom_id"] for o in outs] == ["chat", "text", None, "url", "stream", "refused", "embed"]
    chat, text, bad_json, bad_url, stream, refused, embed = outs
    assert chat["error"] is None and chat["response"]["status_code"] == 200
    assert chat["response"]["body"]["choices"][0]["message"]["content"] == want_chat
    assert chat["response"]["request_id"] == chat["response"]["body"]["id"]
    assert text["response"]["body"]["choices"][0]["text"] == want_text
    assert bad_json["response"] is None and bad_json["error"]["code"] == "invalid_json" and "line 4" in \
        bad_json["error"]["message"]
    assert bad_url["error"]["code"] == "invalid_url" and "/v1/files" in bad_url["error"]["message"]
    assert "stream" in stream["error"]["message"]
    assert refused["error"] is None and refused["response"]["status_code"] == 400
    assert "max_tokens" in json.dumps(refused["response"]["body"])
    got = torch.tensor([d["embedding"] for d in embed["response"]["body"]["data"]])
    torch.testing.assert_close(got, torch.stack(want_emb), atol=1e-5, rtol=1e-5)
    assert len({o["id"] for o in outs}) == len(outs)
    with pytest.raises(ValueError, match="concurrency"):
        next(run_batch(engine, [], concurrency=0))


def test_cli_run_batch_file(tmp_path, capsys):
    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text("\n".join(_lines()[:2]) + "\n")
    assert main(["run-batch", "-i", str(src), "-o", str(dst), "--device", "cpu", "--dtype", "float32",
                 "--concurrency", "2"]) == 0
    outs = [json.loads(line) for line in dst.read_text().splitlines()]
    assert [o["custom_id"] for o in outs] == ["chat", "text"]
    assert all(o["response"]["status_code"] == 200 for o in outs)
    assert "2 requests answered (0 with an error)" in capsys.readouterr().err
    assert main(["run-batch", "-i", str(tmp_path / "missing.jsonl"), "-o", str(dst)]) == 2
