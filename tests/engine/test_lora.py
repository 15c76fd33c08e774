"""Multi-LoRA serving against PEFT: adapters saved by ``peft`` over tiny random transformers models, loaded into the
engine's slots; each request's greedy tokens equal the PEFT model's with its adapter (or the base model's), in
mixed batches, with prefix caching kept apart per adapter."""

import functools
import json
import os

import numpy as np
import peft
import pytest
import torch
from engine_helpers import hf_greedy, ours_from_hf, serving, tiny_hf

from infercore import Engine, SamplingParams
from infercore.lora import LoRAAdapter, enable_lora_, load_lora_adapter

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _save_adapter(hf, path, *, r, alpha, targets, seed, rslora=False, layers=None, params=None, std=0.3,
                  merge=True):
    """A PEFT LoRA adapter over ``hf`` with random A and B of ``std`` (B is zero at PEFT's init), saved to ``path``
    (``params``: PEFT's ``target_parameters``, e.g. stacked expert tensors). Returns PEFT's merged model, the
    reference (its forward equals the unmerged one), or with ``merge=False`` the PEFT model itself."""
    cfg = peft.LoraConfig(r=r, lora_alpha=alpha, target_modules=list(targets), lora_dropout=0.0, use_rslora=rslora,
                          init_lora_weights=False, layers_to_transform=layers, target_parameters=params or None)
    torch.manual_seed(seed)
    model = peft.get_peft_model(hf, cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.normal_(0, std)
    model.save_pretrained(path)
    return model.merge_and_unload() if merge else model


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    base = tiny_hf("llama")
    state = {k: v.clone() for k, v in base.state_dict().items()}
    d = tmp_path_factory.mktemp("lora")
    refs = {}
    specs = {"all": dict(r=8, alpha=16, targets=ALL, seed=1),
             "attn": dict(r=4, alpha=8, targets=["q_proj", "v_proj"], seed=2, rslora=True),
             "mlp1": dict(r=16, alpha=4, targets=["gate_proj", "down_proj"], seed=3, layers=[1])}
    for name, spec in specs.items():
        hf = tiny_hf("llama")
        hf.load_state_dict(state)
        refs[name] = _save_adapter(hf, os.path.join(d, name), **spec)
    base.load_state_dict(state)
    return base, refs, d


def _prompts():
    return [[(5 * i + 3 * j) % 96 for j in range(4 + 7 * i)] for i in range(5)]


def test_loaded_adapter_reads_peft_layout(setup):
    _, _, d = setup
    a = load_lora_adapter(os.path.join(d, "attn"))
    assert a.name == "attn" and a.rank == 4
    assert {m for _, m in a.weights} == {"q_proj", "v_proj"} and len(a.weights) == 4
    mlp = load_lora_adapter(os.path.join(d, "mlp1"), name="x")
    assert {k for k in mlp.weights} == {(1, "gate_proj"), (1, "down_proj")} and mlp.rank == 16


@pytest.mark.parametrize("packed", [False, True])
def test_mixed_batch_matches_peft(setup, packed):
    """Five prompts, each under a different adapter or none, in one batch: greedy tokens equal PEFT's merged model
    per adapter and transformers' base model; a prompt long enough for the grouped-GEMM path (> 64 tokens) too."""
    base, refs, d = setup
    eng = Engine(ours_from_hf(base), page_size=4, num_pages=256, max_loras=3, max_lora_rank=16,
                 cpu_packed_linears=packed)
    for name in refs:
        eng.add_lora(name, os.path.join(d, name))
    assert eng.list_loras() == sorted(refs)
    prompts = _prompts() + [[(11 * j + 1) % 96 for j in range(90)]]
    loras = ["all", None, "attn", "mlp1", "all", "attn"]
    outs = eng.generate(prompts, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True), lora=loras)
    for p, la, o in zip(prompts, loras, outs):
        ref = base if la is None else refs[la]
        assert o.token_ids == hf_greedy(ref, p, 10), la
        if la is not None:  # the adapter changes what the model says (the check above could not pass by accident)
            assert o.token_ids != hf_greedy(base, p, 10), la


def test_merged_projection_adapters_of_phi3_match_peft(tmp_path):
    """Phi-3 checkpoints keep qkv_proj / gate_up_proj merged, and PEFT adapters target them so: one A per projection,
    B cut by slice when the adapter is placed; greedy tokens equal PEFT's, beside the base model. An adapter
    targeting a slice both alone and through its merged projection is refused."""
    import transformers

    from infercore.models import ModelConfig, build_model

    def make():
        cfg = transformers.Phi3Config(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                                      pad_token_id=0, bos_token_id=1, eos_token_id=2)
        cfg._attn_implementation = "eager"
        torch.manual_seed(0)
        hf = transformers.Phi3ForCausalLM(cfg).eval()
        with torch.no_grad():
            hf.lm_head.weight.mul_(4.0)
        return hf

    base = make()
    ref = _save_adapter(make(), tmp_path / "a", r=8, alpha=16, targets=["qkv_proj", "o_proj", "gate_up_proj",
                                                                         "down_proj"], seed=6)
    a = load_lora_adapter(tmp_path / "a")
    assert {m for _, m in a.weights} == {"qkv_proj", "o_proj", "gate_up_proj", "down_proj"}
    ours = build_model(ModelConfig.from_hf(base.config.to_dict()), dtype=torch.float32, device=torch.device("cpu"))
    ours.load_weights(base.state_dict().items())
    eng = Engine(ours, page_size=4, num_pages=128, max_loras=1, max_lora_rank=8)
    eng.add_lora("a", a)
    prompts = _prompts()[1:4]
    outs = eng.generate(prompts, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), lora=["a", None, "a"])
    for p, la, o in zip(prompts, ["a", None, "a"], outs):
        assert o.token_ids == hf_greedy(ref if la else base, p, 8), la
        if la:
            assert o.token_ids != hf_greedy(base, p, 8)
    both = LoRAAdapter("both", {**a.weights, (0, "q_proj"): (a.weights[(0, "o_proj")][0],
                                                              a.weights[(0, "o_proj")][1])})
    with pytest.raises(ValueError, match="both alone and through"):
        eng.add_lora("both", both)


def _tiny_gemma3():
    """A tiny random Gemma 3 (sliding and global layers), greedy far from ties."""
    import transformers

    cfg = transformers.Gemma3TextConfig(
        vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, max_position_embeddings=256, sliding_window=6,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"], query_pre_attn_scalar=8,
    )  # fmt: skip
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    hf = transformers.Gemma3ForCausalLM(cfg).eval()
    with torch.no_grad():
        hf.model.embed_tokens.weight.mul_(4.0)
    return hf


@pytest.mark.parametrize("kind", ["qwen3", "mistral", "gemma3"])
def test_other_families_match_peft(kind, tmp_path):
    """Qwen3 (per-head q / k norms), Mistral (sliding window) and Gemma 3 (its multi-granularity KV layout, sliding
    and global layers): an adapter over every projection, next to the base model, equals PEFT's."""
    from infercore.models import Gemma3Config, ModelConfig, build_model

    def make():
        return _tiny_gemma3() if kind == "gemma3" else tiny_hf(kind)

    base = make()
    ref = _save_adapter(make(), tmp_path / "a", r=8, alpha=16, targets=ALL, seed=4)
    cfg = (Gemma3Config if kind == "gemma3" else ModelConfig).from_hf(base.config.to_dict())
    ours = build_model(cfg, dtype=torch.float32, device=torch.device("cpu"))
    ours.load_weights(base.state_dict().items())
    eng = Engine(ours, page_size=4, num_pages=128, max_loras=1, max_lora_rank=8)
    assert eng.kv_layout == ("multi" if kind == "gemma3" else "dense")
    eng.add_lora("a", tmp_path / "a")
    prompts = _prompts()[1:4]
    outs = eng.generate(prompts, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True),
                        lora=["a", None, "a"])
    for p, la, o in zip(prompts, ["a", None, "a"], outs):
        assert o.token_ids == hf_greedy(ref if la else base, p, 10), la
    assert outs[0].token_ids != hf_greedy(base, prompts[0], 10)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_more_adapters_than_slots_take_turns(setup, async_scheduling):
    """Three adapters, one slot: each request waits for the slot, its adapter is copied in when the slot is idle,
    and every request's tokens still equal PEFT's; the slot is given back at the end."""
    base, refs, d = setup
    eng = Engine(ours_from_hf(base), page_size=4, num_pages=256, max_loras=1, max_lora_rank=16,
                 async_scheduling=async_scheduling)
    for name in refs:
        eng.add_lora(name, os.path.join(d, name))
    assert eng.list_loras() == sorted(refs) and eng.lora.loads == 1  # the first one went into the free slot
    prompts = _prompts()
    loras = ["mlp1", "all", None, "attn", "all"]
    outs = eng.generate(prompts, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), lora=loras)
    for p, la, o in zip(prompts, loras, outs):
        assert o.token_ids == hf_greedy(base if la is None else refs[la], p, 8), la
    assert eng.lora.loads >= 3 and eng.lora.refs == [0]
    # a request of an adapter that is not in the slot, while the slot is held, waits; one of the base model does not
    eng.add_request(prompts[1], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True), request_id="a",
                    lora="all")
    eng.step()
    eng.add_request(prompts[2], SamplingParams(temperature=0, max_tokens=2, ignore_eos=True), request_id="b",
                    lora="attn")
    eng.add_request(prompts[3], SamplingParams(temperature=0, max_tokens=2, ignore_eos=True), request_id="c")
    done = []
    while eng.has_unfinished():
        done += [o.request_id for o in eng.step() if o.finished]
    assert done.index("c") < done.index("a") < done.index("b")


@pytest.mark.parametrize("async_scheduling,kernels", [(False, "reference"), (True, "reference"), (True, "grouped")])
def test_graph_runner_stages_each_rows_adapter(setup, async_scheduling, kernels, monkeypatch):
    """The CUDA-graph runner's path on the CPU (its graphs replayed eagerly, as captured: LoRA on for every row,
    the slots and their slot order read from the staged buffers, the batched shrink / expand ops): tokens equal
    PEFT's per adapter. ``grouped``: the Triton grouped kernels (interpreted) run every step, tiling the rows in
    the staged order."""
    from engine_helpers import EagerGraph, with_fake_graphs

    from infercore.engine.graph_runner import CUDAGraphRunner
    from infercore.lora import layers as lora_layers

    if kernels == "grouped":
        from infercore.ops.lora import triton as lora_triton

        monkeypatch.setattr(lora_layers, "lora_shrink", functools.partial(lora_triton.lora_shrink, grouped=True))
        monkeypatch.setattr(lora_layers, "lora_expand_", functools.partial(lora_triton.lora_expand_, grouped=True))

    base, refs, d = setup
    eng = Engine(ours_from_hf(base), page_size=4, num_pages=256, max_num_seqs=8, max_loras=2, max_lora_rank=16,
                 async_scheduling=async_scheduling)  # two slots for three adapters: they take turns
    for name in refs:
        eng.add_lora(name, os.path.join(d, name))
    gr = with_fake_graphs(eng, CUDAGraphRunner, max_batch=8, buckets=(1, 2, 4))
    lora = eng.lora

    class Captured(EagerGraph):
        def replay(self):
            lora.capturing()  # what the captured kernels do whatever the last eager step set
            idx = lora.indices[: self.b].numpy()
            assert np.array_equal(lora.order[: self.b].numpy(), np.argsort(idx, kind="stable"))  # staged with them
            super().replay()

    replays = []
    for b in gr.buckets:
        gr.graphs[b] = Captured(gr, b)
    orig = gr.launch
    gr.launch = lambda batch, gather=None: (replays.append(len(batch)), orig(batch, gather))[1]
    prompts = _prompts()
    loras = ["all", None, "attn", "mlp1", "all"]
    outs = eng.generate(prompts, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), lora=loras)
    assert replays and 4 in replays  # "mlp1" waits for a slot: the four others decode together, then it runs
    for p, la, o in zip(prompts, loras, outs):
        assert o.token_ids == hf_greedy(base if la is None else refs[la], p, 8), la


def test_prefix_cache_is_kept_apart_per_adapter(setup):
    base, refs, d = setup
    eng = Engine(ours_from_hf(base), page_size=4, num_pages=128, max_loras=2, max_lora_rank=8)
    eng.add_lora("all", os.path.join(d, "all"))
    prompt = [(7 * j + 2) % 96 for j in range(33)]
    sp = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    first = eng.generate([prompt], sp)[0]
    lora = eng.generate([prompt], sp, lora="all")[0]
    assert lora.metrics.num_cached_tokens == 0  # the base model's pages are not the adapter's KV
    assert lora.token_ids == hf_greedy(refs["all"], prompt, 6) and first.token_ids == hf_greedy(base, prompt, 6)
    again = eng.generate([prompt], sp, lora="all")[0]
    assert again.metrics.num_cached_tokens == 32 and again.token_ids == lora.token_ids
    # the same weights under another name share the KV; removing frees the slot
    eng.add_lora("same", load_lora_adapter(os.path.join(d, "all")))
    same = eng.generate([prompt], sp, lora="same")[0]
    assert same.metrics.num_cached_tokens == 32 and same.token_ids == lora.token_ids
    eng.remove_lora("same")
    assert eng.list_loras() == ["all"]


def test_streamed_request_and_moved_request_keep_their_adapter(setup):
    base, refs, d = setup
    a = Engine(ours_from_hf(base), page_size=4, num_pages=64, max_loras=1, max_lora_rank=8)
    b = Engine(ours_from_hf(base), page_size=4, num_pages=64, max_loras=1, max_lora_rank=8)
    for e in (a, b):
        e.add_lora("all", os.path.join(d, "all"))
    prompt = _prompts()[3]
    sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    streamed = [t for o in a.stream(prompt, sp, lora="all") for t in o.new_token_ids]
    want = hf_greedy(refs["all"], prompt, 12)
    assert streamed == want
    a.add_request(prompt, sp, request_id="m", lora="all")
    for _ in range(4):
        a.step()
    (req,) = a.take_requests()
    b.adopt_request(req)
    outs = []
    while b.has_unfinished():
        outs += b.step()
    assert outs[-1].token_ids == want


def test_errors(setup, tmp_path):
    base, refs, d = setup
    with pytest.raises(ValueError, match="max_loras"):
        Engine(ours_from_hf(base), page_size=4, num_pages=16, max_loras=-1)
    plain = Engine(ours_from_hf(base), page_size=4, num_pages=64)
    with pytest.raises(ValueError, match="no LoRA slots"):
        plain.add_lora("x", os.path.join(d, "all"))
    with pytest.raises(ValueError, match="no adapter named"):
        plain.add_request([1, 2, 3], lora="x")
    eng = Engine(ours_from_hf(base), page_size=4, num_pages=64, max_loras=1, max_lora_rank=8)
    with pytest.raises(ValueError, match="rank 16 > max_lora_rank=8"):
        eng.add_lora("mlp1", os.path.join(d, "mlp1"))
    eng.add_lora("all", os.path.join(d, "all"))
    with pytest.raises(ValueError, match="already loaded"):
        eng.add_lora("all", os.path.join(d, "all"))
    with pytest.raises(TypeError, match="lora must be"):
        eng.add_request([1, 2, 3], lora=3)
    eng.add_request([1, 2, 3], SamplingParams(max_tokens=2), lora="all")
    with pytest.raises(ValueError, match="in use"):
        eng.remove_lora("all")
    while eng.has_unfinished():
        eng.step()
    eng.remove_lora("all")
    # a layer the model does not have, a shape that does not match
    bad = LoRAAdapter("bad", {(5, "q_proj"): (torch.zeros(2, 32), torch.zeros(32, 2))})
    with pytest.raises(ValueError, match="layer 5 q_proj"):
        eng.add_lora("bad", bad)
    bad = LoRAAdapter("bad", {(0, "k_proj"): (torch.zeros(2, 32), torch.zeros(32, 2))})
    with pytest.raises(ValueError, match="k_proj"):
        eng.add_lora("bad", bad)
    with pytest.raises(ValueError, match="not one of"):
        LoRAAdapter("bad", {(0, "embed"): (torch.zeros(2, 32), torch.zeros(32, 2))})
    # unsupported PEFT settings
    cfg = json.load(open(os.path.join(d, "all", "adapter_config.json")))
    (tmp_path / "dora").mkdir()
    json.dump({**cfg, "use_dora": True}, open(tmp_path / "dora" / "adapter_config.json", "w"))
    with pytest.raises(ValueError, match="use_dora"):
        load_lora_adapter(tmp_path / "dora")
    with pytest.raises(FileNotFoundError):
        load_lora_adapter(tmp_path)
    with pytest.raises(ValueError, match="already enabled"):
        enable_lora_(eng.model)


def test_server_routes_requests_by_model_name(setup):
    """``model`` picks the adapter; adapters load and unload over HTTP; an unknown name is a 404."""
    base, refs, d = setup
    eng = Engine(ours_from_hf(base), page_size=4, num_pages=128, max_loras=2, max_lora_rank=8)
    eng.add_lora("all", os.path.join(d, "all"))
    with serving(eng) as call:
        prompt = _prompts()[2]
        req = {"prompt": prompt, "max_tokens": 6, "temperature": 0, "ignore_eos": True, "logprobs": 0}
        for model, ref in (("tiny", base), ("all", refs["all"]), (None, base)):
            status, body = call("POST", "/v1/completions", {**req, **({} if model is None else {"model": model})})
            assert status == 200, body
            # without a tokenizer the logprobs name each token by its id
            assert [int(t) for t in body["choices"][0]["logprobs"]["tokens"]] == hf_greedy(ref, prompt, 6), model
        status, body = call("POST", "/v1/completions", {**req, "model": "attn"})
        assert status == 404 and body["error"]["param"] == "model"
        status, body = call("POST", "/v1/load_lora_adapter",
                            {"lora_name": "attn", "lora_path": os.path.join(d, "attn")})
        assert status == 200, body
        status, body = call("GET", "/v1/models")
        assert [m["id"] for m in body["data"]] == ["tiny", "all", "attn"] and body["data"][2]["parent"] == "tiny"
        status, body = call("POST", "/v1/load_lora_adapter", {"lora_name": "x", "lora_path": os.path.join(d, "mlp1")})
        assert status == 400 and "max_lora_rank" in body["error"]["message"]
        status, body = call("POST", "/v1/unload_lora_adapter", {"lora_name": "attn"})
        assert status == 200 and eng.list_loras() == ["all"]
        status, body = call("POST", "/v1/unload_lora_adapter", {"lora_name": "attn"})
        assert status == 400


def _smollm2_adapter(path, *, scale, seed=0):
    """A PEFT-format adapter for SmolLM2-135M's shapes (30 layers, hidden 576, 9 / 3 heads of 64), q / v only."""
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for i in range(30):
        for mod, out in (("q_proj", 576), ("v_proj", 192)):
            pre = f"base_model.model.model.layers.{i}.self_attn.{mod}"
            tensors[f"{pre}.lora_A.weight"] = torch.randn(4, 576, generator=g) * 0.05
            tensors[f"{pre}.lora_B.weight"] = torch.randn(out, 4, generator=g) * scale
    os.makedirs(path, exist_ok=True)
    save_file(tensors, os.path.join(path, "adapter_model.safetensors"))
    with open(os.path.join(path, "adapter_config.json"), "w") as f:
        json.dump({"peft_type": "LORA", "r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"]}, f)


def test_cli_generate_through_an_adapter(tmp_path, capsys):
    """``infercore generate --lora PATH`` on the real SmolLM2 weights: an all-zero adapter answers as the base
    model does, a random one otherwise; errors exit with 2."""
    from infercore import cli

    _smollm2_adapter(tmp_path / "zero", scale=0.0)
    _smollm2_adapter(tmp_path / "rand", scale=0.5)
    args = ["generate", "What is the capital of France?", "--device", "cpu", "--dtype", "float32",
            "--max-tokens", "8"]
    outs = {}
    for name, extra in (("base", []), ("zero", ["--lora", str(tmp_path / "zero")]),
                        ("rand", ["--lora", f"mine={tmp_path / 'rand'}"])):
        assert cli.main(args + extra) == 0
        outs[name] = capsys.readouterr().out
    assert outs["zero"] == outs["base"] and outs["rand"] != outs["base"]
    assert cli.main(args + ["--lora", str(tmp_path / "zero"), "--lora", str(tmp_path / "rand")]) == 2
    assert cli.main(args + ["--lora", str(tmp_path / "missing")]) == 2
    assert cli.main(args + ["--lora", str(tmp_path / "rand"), "--max-lora-rank", "2"]) == 2


def test_cli_generate_through_an_adapter_over_three_ranks(tmp_path, capfd):
    """``infercore generate --lora PATH --tensor-parallel 3`` (real SmolLM2 weights, fp32): each rank's slots hold its
    slice of the adapter, and rank 0 prints the single-process answer, also as an adaptive TP / DP group;
    --expert-parallel with --lora is refused."""
    from infercore import cli

    _smollm2_adapter(tmp_path / "rand", scale=0.5)
    args = ["generate", "What is the capital of France?", "--device", "cpu", "--dtype", "float32",
            "--max-tokens", "8", "--lora", f"mine={tmp_path / 'rand'}"]
    assert cli.main(args) == 0
    one = capfd.readouterr().out
    assert cli.main(args + ["--tensor-parallel", "3"]) == 0
    out, err = capfd.readouterr()
    assert out == one and "tokens/s" in err
    assert cli.main(args[:-2] + ["--tensor-parallel", "3"]) == 0  # the adapter changes the answer
    assert capfd.readouterr().out != one
    assert cli.main(args + ["--tensor-parallel", "3", "--adaptive"]) == 0  # the TP / DP group: both engines have it
    assert capfd.readouterr().out == one
    assert cli.main(args + ["--tensor-parallel", "3", "--expert-parallel"]) == 2
    assert "--expert-parallel" in capfd.readouterr().err


@pytest.mark.gpu
@pytest.mark.parametrize("async_scheduling", [False, True])
def test_mixed_adapters_on_cuda_match_peft(setup, async_scheduling):
    """On CUDA (fp32): decode steps replay the captured graphs with each row's adapter slot staged beside its
    inputs (the batched shrink / expand kernels), prefill steps take the kernels or the grouped GEMMs; every
    request's greedy tokens equal PEFT's model with its adapter."""
    from test_engine_gpu import _ours_on_cuda

    base, refs, d = setup
    eng = Engine(_ours_on_cuda(base, torch.float32), page_size=16, num_pages=256, max_num_batched_tokens=128,
                 max_num_seqs=8, max_loras=3, max_lora_rank=16, async_scheduling=async_scheduling)
    assert eng.graph_runner is not None and eng.graph_runner.graphs
    for name in refs:
        eng.add_lora(name, os.path.join(d, name))
    prompts = _prompts() + [[(11 * j + 1) % 96 for j in range(90)], [3, 4, 5]]
    loras = ["all", None, "attn", "mlp1", "all", "attn", "mlp1"]
    outs = eng.generate(prompts, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True), lora=loras)
    for p, la, o in zip(prompts, loras, outs):
        assert o.token_ids == hf_greedy(base if la is None else refs[la], p, 24), la


def test_adapter_over_a_quantized_base_matches_peft_on_the_dequantized_weights(setup):
    """LoRA over INT8 weight-only linears (``quantize(model, "w8a16")``): equals PEFT's adapter over transformers
    holding the same dequantized weights."""
    from infercore.quant import quantize
    from infercore.quant.linear import QuantLinear

    base, refs, d = setup
    ours = ours_from_hf(base)
    quantize(ours, "w8a16")
    hf = tiny_hf("llama")
    sd = {k: v.clone() for k, v in base.state_dict().items()}
    for i, layer in enumerate(ours.model.layers):
        attn, mlp = layer.self_attn, layer.mlp
        assert isinstance(attn.qkv_proj, QuantLinear)
        q, k, v = attn.qkv_proj.qweight_format.dequantize().split([attn.q_size, attn.kv_size, attn.kv_size])
        g, u = mlp.gate_up_proj.qweight_format.dequantize().chunk(2)
        for name, w in (("self_attn.q_proj", q), ("self_attn.k_proj", k), ("self_attn.v_proj", v),
                        ("self_attn.o_proj", attn.o_proj.qweight_format.dequantize()), ("mlp.gate_proj", g),
                        ("mlp.up_proj", u), ("mlp.down_proj", mlp.down_proj.qweight_format.dequantize())):
            sd[f"model.layers.{i}.{name}.weight"] = w
    hf.load_state_dict(sd)
    ref = peft.PeftModel.from_pretrained(hf, os.path.join(d, "all")).merge_and_unload()
    eng = Engine(ours, page_size=4, num_pages=128, max_loras=1, max_lora_rank=8)
    eng.add_lora("all", os.path.join(d, "all"))
    prompts = _prompts()[1:4]
    outs = eng.generate(prompts, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True), lora="all")
    for p, o in zip(prompts, outs):
        assert o.token_ids == hf_greedy(ref, p, 10)
