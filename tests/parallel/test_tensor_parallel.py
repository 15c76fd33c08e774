"""Tensor parallelism over torch.distributed (gloo, two CPU processes): the sharded model's logits and the
Engine's tokens on every rank against transformers and the unsharded engine."""

import os
import sys

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "engine"))
sys.path.insert(0, os.path.dirname(__file__))

from dist_helpers import _leave  # noqa: E402

WORLD = 2


def _worker(rank: int, init: str, kind: str) -> None:
    from engine_helpers import hf_greedy, ours_from_hf, random_prompts, tiny_hf

    from infercore import Engine, SamplingParams
    from infercore.parallel import tensor_parallel_

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=WORLD)
    try:
        hf = tiny_hf(kind, attention_bias=kind == "llama", num_key_value_heads=2)  # biases: sharded / rank 0's
        ref = ours_from_hf(hf)
        model = tensor_parallel_(ours_from_hf(hf))
        assert model.model.layers[0].self_attn.num_kv_heads == 1 and model.lm_head.linear.weight.shape[0] == 48
        with pytest.raises(ValueError, match="already sharded"):
            tensor_parallel_(model)
        prompts = random_prompts(4, seed=3) + [[5, 6, 7, 8, 9] * 3]
        greedy = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
        seeded = SamplingParams(temperature=0.8, top_p=0.9, seed=7, max_tokens=16, ignore_eos=True)
        unseeded = SamplingParams(temperature=1.0, max_tokens=16, ignore_eos=True)
        # pools sized from memory budgets that differ by rank: every rank gets the smallest
        budget = Engine(model, page_size=4, kv_cache_bytes=(1 << 20) * (1 + rank))
        assert budget.block_manager.num_pages == (1 << 20) // (2 * 4 * 1 * 8 * 4 * 2)
        eng = Engine(model, page_size=4, num_pages=128, max_num_batched_tokens=24)
        assert eng.runner.kv_caches[0][0].shape[2] == 1  # this rank's KV head only
        outs = {name: [o.token_ids for o in eng.generate(prompts, sp)]
                for name, sp in (("greedy", greedy), ("seeded", seeded), ("unseeded", unseeded))}
        spec = Engine(model, page_size=4, num_pages=128, num_speculative_tokens=3)
        outs["spec"] = [o.token_ids for o in spec.generate(prompts, greedy)]
        # every rank sampled the same tokens, unseeded requests included
        everyone = [None] * WORLD
        dist.all_gather_object(everyone, outs)
        assert all(o == outs for o in everyone)
        # every rank runs every step: the collectives are in the forward
        got = eng.generate([prompts[0]], SamplingParams(temperature=0, max_tokens=1, logprobs=5))[0]
        # quantized after sharding: each rank quantizes its shards, the wrappers keep their collectives
        from infercore.quant import quantize

        qmodel = tensor_parallel_(ours_from_hf(hf))
        quantize(qmodel, "w8a16")
        assert type(qmodel.model.layers[0].self_attn.o_proj.linear).__name__ == "QuantLinear"
        qgot = Engine(qmodel, page_size=4, num_pages=64).generate(
            [prompts[0]], SamplingParams(temperature=0, max_tokens=1, logprobs=5))[0]
        if rank == 0:
            assert outs["greedy"] == [hf_greedy(hf, p, 16) for p in prompts] == outs["spec"]
            for t, v in got.logprobs[0].items():  # INT8 weights: within 0.05 of the dense log-probabilities
                assert qgot.logprobs[0].get(t, v) == pytest.approx(v, abs=0.05)
            assert qgot.token_ids == got.token_ids
            plain = Engine(ref, page_size=4, num_pages=128)
            assert outs["seeded"] == [o.token_ids for o in plain.generate(prompts, seeded)]
            # the log-probabilities of the first token (the gathered vocabulary slices) equal transformers'
            with torch.inference_mode():
                want = hf(torch.tensor(prompts[0])[None]).logits[0, -1]
            top = want.float().log_softmax(-1).topk(5)
            for t, v in zip(top.indices.tolist(), top.values.tolist()):
                assert got.logprobs[0][t] == pytest.approx(v, abs=1e-4)
    finally:
        _leave()


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_two_ranks_match_one(kind, tmp_path):
    mp.spawn(_worker, args=(f"file://{tmp_path}/rdzv", kind), nprocs=WORLD, join=True)


def _errors_worker(rank: int, init: str) -> None:
    from engine_helpers import ours_from_hf, tiny_hf

    from infercore.parallel import tensor_parallel_

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=WORLD)
    try:
        with pytest.raises(ValueError, match="num_kv_heads=1"):
            tensor_parallel_(ours_from_hf(tiny_hf("llama", num_key_value_heads=1)))
        with pytest.raises(ValueError, match="vocab_size=95"):
            tensor_parallel_(ours_from_hf(tiny_hf("llama", vocab_size=95)))
    finally:
        _leave()


def test_errors(tmp_path):
    from engine_helpers import ours_from_hf, tiny_hf

    from infercore.parallel import tensor_parallel_

    with pytest.raises(ValueError, match="not initialized"):
        tensor_parallel_(ours_from_hf(tiny_hf("llama")))
    with pytest.raises(TypeError, match="Llama-family"):
        tensor_parallel_(torch.nn.Linear(2, 2))
    mp.spawn(_errors_worker, args=(f"file://{tmp_path}/rdzv",), nprocs=WORLD, join=True)


def _smollm2_worker(rank: int, init: str, world: int, prompt: str, want: list[int]) -> None:
    from infercore import Engine, SamplingParams
    from infercore.loading import default_model_path
    from infercore.models import load_model
    from infercore.parallel import tensor_parallel_

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    try:
        model, tok, _ = load_model(default_model_path(), dtype=torch.float32, device="cpu")
        tensor_parallel_(model)  # 9 query heads, 3 KV heads: 3 and 1 a rank
        eng = Engine(model, tok, page_size=16, num_pages=64)
        out = eng.generate([prompt], SamplingParams(temperature=0, max_tokens=len(want), ignore_eos=True),
                           chat=True)[0]
        assert out.token_ids == want, (rank, out.text)
    finally:
        _leave()


def test_real_smollm2_over_three_ranks(tmp_path):
    """The real SmolLM2-135M-Instruct weights (GGUF) sharded three ways answer as the unsharded engine does."""
    from infercore import Engine, SamplingParams

    prompt = "What is the capital of France?"
    want = Engine.from_pretrained(device="cpu", dtype=torch.float32, page_size=16, num_pages=64).generate(
        [prompt], SamplingParams(temperature=0, max_tokens=10, ignore_eos=True), chat=True)[0]
    assert "Paris" in want.text
    mp.spawn(_smollm2_worker, args=(f"file://{tmp_path}/rdzv", 3, prompt, want.token_ids), nprocs=3, join=True)


def test_cli_generate_over_three_ranks(capfd):
    """``infercore generate --tensor-parallel 3`` on the real SmolLM2 weights, dense and quantized (W8A16): rank 0
    prints the answer; a group size that does not divide the heads fails with the rank's message and exit code 2,
    and a GGUF file's blocks are not sharded."""
    from infercore import cli

    argv = ["generate", "What is the capital of France?", "--device", "cpu", "--max-tokens", "12"]
    assert cli.main(argv + ["--tensor-parallel", "3"]) == 0
    out, err = capfd.readouterr()
    assert "Paris" in out and "tokens/s" in err
    assert cli.main(argv + ["--tensor-parallel", "2"]) == 2
    assert "num_heads=9" in capfd.readouterr().err
    assert cli.main(argv + ["--tensor-parallel", "3", "--quantization", "gguf"]) == 2
    assert "GGUF" in capfd.readouterr().err
    assert cli.main(argv + ["--tensor-parallel", "3", "--quantization", "w8a16"]) == 0  # each rank its shards
    assert "Paris" in capfd.readouterr().out
    # --adaptive: the ranks hold the whole model too and switch between TP and DP with the load
    assert cli.main(argv + ["--tensor-parallel", "3", "--adaptive"]) == 0
    assert "Paris" in capfd.readouterr().out
    assert cli.main(argv + ["--adaptive"]) == 2
    assert "--adaptive needs --tensor-parallel" in capfd.readouterr().err
    with pytest.raises(SystemExit):
        cli.main(argv + ["--tensor-parallel", "3", "--adaptive", "2,2"])
    assert "LOW < HIGH" in capfd.readouterr().err


def _serve_worker(rank: int, init: str, world: int, want: str, adaptive: bool) -> None:
    import http.client
    import json
    import threading
    from concurrent.futures import ThreadPoolExecutor

    from infercore import Engine
    from infercore.loading import default_model_path
    from infercore.models import load_model
    from infercore.parallel import MirroredEngine, follow, tensor_parallel_
    from infercore.serve import make_server

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    try:
        model, tok, _ = load_model(default_model_path(), dtype=torch.float32, device="cpu")
        if adaptive:  # TP for one request, DP replicas from two on: the clients' requests move between them
            from infercore.parallel import LoadPolicy, build_adaptive

            kw = dict(page_size=16, num_pages=128, enable_prefix_caching=False)
            driver = build_adaptive(model, tok, tp_engine_kwargs=kw, dp_engine_kwargs=kw,
                                    policy=LoadPolicy(high_at=2, low_at=1, min_steps=1))
            if rank:
                assert driver.follow() > 0
                return
        else:
            engine = Engine(tensor_parallel_(model), tok, page_size=16, num_pages=128, enable_prefix_caching=False)
            if rank:
                with pytest.raises(ValueError, match="follows"):
                    MirroredEngine(engine)
                assert follow(engine) > 0
                return
            driver = MirroredEngine(engine)
        server = make_server(driver, port=0)
        threading.Thread(target=server.serve_forever, daemon=True).start()

        def ask(text):
            conn = http.client.HTTPConnection(*server.server_address[:2], timeout=300)
            body = {"messages": [{"role": "user", "content": text}], "max_tokens": 12, "temperature": 0}
            conn.request("POST", "/v1/chat/completions", body=json.dumps(body),
                         headers={"Content-Type": "application/json"})
            reply = json.loads(conn.getresponse().read())
            conn.close()
            return reply["choices"][0]["message"]["content"]

        try:
            with ThreadPoolExecutor(3) as pool:  # concurrent clients: their requests batch in mirrored steps
                answers = list(pool.map(ask, ["What is the capital of France?"] * 3))
            assert answers == [want] * 3
            assert not adaptive or [s["to"] for s in driver.switches][:1] == ["dp"]
        finally:
            server.shutdown()
            server.server_close()
            server.loop.close()
            server.loop.engine.close()
    finally:
        _leave()


@pytest.mark.parametrize("adaptive", [False, True])
def test_serve_over_three_ranks(tmp_path, adaptive):
    """``make_server`` over rank 0's MirroredEngine of a three-way sharded SmolLM2: the other ranks replay its calls
    (``follow``) and concurrent chat requests get the unsharded engine's answer. Likewise over rank 0's
    AdaptiveEngine, whose ranks switch to data parallelism for the concurrent requests."""
    from infercore import Engine, SamplingParams
    from infercore.parallel import MirroredEngine

    plain = Engine.from_pretrained(device="cpu", dtype=torch.float32, page_size=16, num_pages=64)
    want = plain.generate(["What is the capital of France?"], SamplingParams(temperature=0, max_tokens=12),
                          chat=True)[0].text
    with pytest.raises(ValueError, match="not sharded"):
        MirroredEngine(plain)
    mp.spawn(_serve_worker, args=(f"file://{tmp_path}/rdzv", 3, want, adaptive), nprocs=3, join=True)


def _cli_serve_worker(rank: int, init: str) -> None:
    import argparse
    import types

    import infercore.serve as serve
    from infercore import SamplingParams, cli

    class FakeServer:  # drives rank 0's engine as the HTTP handlers would, then stops like a ^C
        server_address = ("127.0.0.1", 0)

        def __init__(self, engine):
            self.engine, self.loop = engine, types.SimpleNamespace(close=lambda: None)

        def serve_forever(self):
            self.engine.add_request("What is the capital of France?", SamplingParams(temperature=0, max_tokens=8),
                                    chat=True)
            text = ""
            while self.engine.has_unfinished():
                text = next((o.text for o in self.engine.step()), text)
            assert "Paris" in text, text
            raise KeyboardInterrupt

        def server_close(self):
            pass

    serve.make_server = lambda engine, **kw: FakeServer(engine)
    args = argparse.Namespace(cmd="serve", tensor_parallel=3, device="cpu", dtype=None, model=None, quantization=None,
                              kv_cache_dtype="auto", num_speculative_tokens=0, served_model_name="m", host="127.0.0.1",
                              port=0, verbose=False)
    cli._tp_rank(rank, args, None, init)  # the followers return once rank 0 stops serving


def test_cli_serve_ranks(tmp_path):
    """``infercore serve --tensor-parallel 3``'s ranks: rank 0 serves through a MirroredEngine, the others follow
    it and exit when it stops."""
    mp.spawn(_cli_serve_worker, args=(f"file://{tmp_path}/rdzv",), nprocs=3, join=True)
