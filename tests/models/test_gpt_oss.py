"""GPT-OSS vs Hugging Face transformers on a tiny random fp32 config (attention sinks, alternating sliding / full
layers with a window shorter than the prompts, 4 experts top-2 with biases and the clamped SwiGLU, YaRN RoPE):
prefill and decode logits through ``save_pretrained`` + ``load_model``, the Engine's greedy tokens
(``Engine.from_pretrained``, chunked prefill mixed with decodes, a prefix-cache hit) against ``generate``, the
config reader, the MXFP4 expert dequantization against transformers', and the refusals."""

from __future__ import annotations

import pytest
import torch
from paged_harness import PagedRunner, hf_greedy, hf_logits, ours_from_hf

from infercore.engine import Engine, SamplingParams
from infercore.models import GptOssConfig, GptOssForCausalLM, config_from_hf
from infercore.ops import rope_cos_sin_cache

PROMPTS = [[2, 17, 42, 90, 5, 23, 7, 64, 12, 15, 33, 8, 71, 20, 3, 91, 45, 18, 26], [2, 25, 4, 4, 19],
           [2, 88, 12, 7, 56, 29, 14, 3, 77, 10, 9, 66, 24, 31, 2, 18, 55, 12]]
YARN = {"rope_type": "yarn", "rope_theta": 150000.0, "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0,
        "truncate": False, "original_max_position_embeddings": 32}  # fmt: skip


def tiny_gpt_oss(seed: int = 0, **overrides):
    import transformers as tf

    cfg = tf.GptOssConfig(**{**dict(vocab_size=96, hidden_size=32, intermediate_size=24, num_hidden_layers=4,
                                    num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=6,
                                    num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=128,
                                    rope_parameters=dict(YARN), bos_token_id=2, eos_token_id=None, pad_token_id=0),
                             **overrides})  # fmt: skip
    cfg._attn_implementation = "eager"
    cfg._experts_implementation = "eager"
    torch.manual_seed(seed)
    model = tf.GptOssForCausalLM(cfg).eval()
    with torch.no_grad():  # HF zero-initialises biases and sets norms to 1: randomise them; spread the sinks
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(torch.randn_like(p) * 0.3)
            elif name.endswith("sinks"):
                p.copy_(torch.randn_like(p) * 2.0)
            elif "experts" in name:  # large enough for the SwiGLU's clamps to bite
                p.mul_(40.0)
        model.model.embed_tokens.weight.mul_(20.0)
    return model


def _close(ours: torch.Tensor, ref: torch.Tensor) -> None:
    err = (ours - ref).abs().max().item()
    assert err < 1e-4 * ref.abs().max().item() + 1e-5, f"max abs error {err}"


def test_config_reads_gpt_oss():
    hf = tiny_gpt_oss()
    d = hf.config.to_dict()
    cfg = config_from_hf(d)
    assert isinstance(cfg, GptOssConfig) and cfg.layer_types == ["sliding_attention", "full_attention"] * 2
    assert (cfg.sliding_window, cfg.num_experts, cfg.num_experts_per_tok, cfg.intermediate_size) == (6, 4, 2, 24)
    assert cfg.attention_bias and cfg.o_bias and (cfg.swiglu_alpha, cfg.swiglu_limit) == (1.702, 7.0)
    assert cfg.rope_theta == 150000.0 and cfg.rope_scaling["rope_type"] == "yarn"
    assert cfg.rope_scaling["truncate"] is False and cfg.rope_scaling["original_max_position_embeddings"] == 32
    # transformers 4.x keys (the released config.json): rope_theta + rope_scaling at the top level
    legacy = {k: v for k, v in d.items() if k not in ("rope_parameters", "layer_types")}
    legacy.update(rope_theta=150000.0, rope_scaling={k: v for k, v in YARN.items() if k != "rope_theta"})
    old = config_from_hf(legacy)
    assert old.layer_types == cfg.layer_types and old.rope_scaling == cfg.rope_scaling
    assert old.rope_theta == cfg.rope_theta
    for bad, match in (({"sliding_window": 0}, "sliding_window"), ({"num_experts_per_tok": 5}, "num_experts_per_tok"),
                       ({"architectures": ["GptOssModel"]}, "architectures"), ({"swiglu_limit": -1}, "swiglu_limit"),
                       ({"layer_types": ["full_attention"]}, "layer_types")):  # fmt: skip
        with pytest.raises(ValueError, match=match):
            config_from_hf({**d, **bad})


# gpt-oss-20b's config.json as released (transformers 4.x keys, no swiglu_alpha), quantization_config left out
RELEASED_20B = {
    "architectures": ["GptOssForCausalLM"], "attention_bias": True, "attention_dropout": 0.0, "eos_token_id": 200002,
    "experts_per_token": 4, "head_dim": 64, "hidden_act": "silu", "hidden_size": 2880, "initial_context_length": 4096,
    "initializer_range": 0.02, "intermediate_size": 2880,
    "layer_types": ["sliding_attention", "full_attention"] * 12, "max_position_embeddings": 131072,
    "model_type": "gpt_oss", "num_attention_heads": 64, "num_experts_per_tok": 4, "num_hidden_layers": 24,
    "num_key_value_heads": 8, "num_local_experts": 32, "output_router_logits": False, "pad_token_id": 199999,
    "rms_norm_eps": 1e-05, "rope_scaling": {"beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0,
                                            "original_max_position_embeddings": 4096, "rope_type": "yarn",
                                            "truncate": False},
    "rope_theta": 150000, "router_aux_loss_coef": 0.9, "sliding_window": 128, "swiglu_limit": 7.0,
    "tie_word_embeddings": False, "use_cache": True, "vocab_size": 201088,
}  # fmt: skip


def test_released_config_and_shapes():
    """The released 20B config reads as transformers reads it, and the model it builds (on the meta device) has the
    checkpoint's shapes and per-layer KV windows."""
    import transformers as tf

    from infercore.models import build_model

    cfg = config_from_hf(RELEASED_20B)
    hf_cfg = tf.GptOssConfig(**{k: v for k, v in RELEASED_20B.items() if k not in ("architectures", "model_type")})
    assert (cfg.num_layers, cfg.num_experts, cfg.num_experts_per_tok, cfg.head_dim) == (24, 32, 4, 64)
    assert cfg.swiglu_alpha == hf_cfg.swiglu_alpha == 1.702 and cfg.eos_token_ids == (200002,)
    assert cfg.rope_theta == hf_cfg.rope_parameters["rope_theta"] == 150000
    assert {k: cfg.rope_scaling[k] for k in ("factor", "truncate", "original_max_position_embeddings")} == {
        k: hf_cfg.rope_parameters[k] for k in ("factor", "truncate", "original_max_position_embeddings")}
    model = build_model(cfg, dtype=torch.bfloat16, device="meta", init="empty")
    layer = model.model.layers[0]
    assert layer.mlp.experts.gate_up_proj.shape == (32, 2880, 5760) and layer.mlp.experts.down_proj.shape == (
        32, 2880, 2880)
    assert layer.self_attn.qkv_proj.weight.shape == (64 * 64 + 2 * 8 * 64, 2880)
    assert layer.self_attn.sinks.shape == (64,)
    assert [s.sliding_window for s in model.kv_specs()] == [128, None] * 12
    # defaults when keys are absent: transformers' GptOssConfig()
    bare = config_from_hf({"model_type": "gpt_oss"})
    assert (bare.num_layers, bare.num_experts, bare.sliding_window, bare.rope_theta) == (36, 128, 128, 150000.0)
    assert bare.rope_scaling["factor"] == 32.0 and bare.layer_types[:2] == ["sliding_attention", "full_attention"]


def test_rope_table_is_transformers_yarn(tmp_path):
    """YaRN with ``truncate: false`` (the released configs'), which changes the ramp at this head_dim / original
    length, and its attention factor in the table."""
    hf = tiny_gpt_oss()
    model, _ = ours_from_hf(hf, tmp_path)
    pos = torch.arange(128)[None]
    cos, sin = hf.model.rotary_emb(torch.zeros(1, dtype=torch.float32), pos)
    table = model.cos_sin_cache  # [positions, rotary_dim]: cos halves then sin halves
    torch.testing.assert_close(table[:, :8], cos[0], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(table[:, 8:], sin[0], rtol=1e-6, atol=1e-6)
    truncated = rope_cos_sin_cache(rotary_dim=16, max_positions=128, base=150000.0, dtype=torch.float32, device="cpu",
                                   scaling={**model.config.rope_scaling, "truncate": True})  # fmt: skip
    assert (truncated - table).abs().max() > 1e-2


def test_prefill_and_decode_logits_match_hf(tmp_path):
    hf = tiny_gpt_oss()
    model, config = ours_from_hf(hf, tmp_path)
    assert isinstance(model, GptOssForCausalLM)
    assert [la.self_attn.sliding_window for la in model.model.layers] == [6, None, 6, None]
    # the clamps of the SwiGLU are reached on these inputs (a model without them would differ)
    x = torch.randn(64, 32) * 3
    with torch.no_grad():
        h = x @ hf.model.layers[0].mlp.experts.gate_up_proj[0]
    assert (h[:, ::2] > 7).any() and (h[:, 1::2].abs() > 7).any()
    runner = PagedRunner(model)
    logits = runner.step(list(enumerate(PROMPTS)))
    _close(logits, torch.cat([hf_logits(hf, p) for p in PROMPTS]))
    seqs = [list(p) for p in PROMPTS]
    for nxt in ([7, 11, 13], [40, 2, 9]):  # two decode steps
        logits = runner.step([(i, [t]) for i, t in enumerate(nxt)])
        for s, t in zip(seqs, nxt):
            s.append(t)
        _close(logits, torch.stack([hf_logits(hf, s)[-1] for s in seqs]))
    # sinks matter: zeroing them changes the logits
    for layer in model.model.layers:
        layer.self_attn.sinks.data.fill_(float("-inf"))
    assert (PagedRunner(model).step([(0, PROMPTS[0])]) - hf_logits(hf, PROMPTS[0])).abs().max() > 1e-2


@pytest.mark.parametrize("path", ["loop", "grouped", "dense"])
def test_expert_paths_match_transformers(tmp_path, monkeypatch, path):
    """Each way of running the experts (per routed expert, grouped GEMMs over the sorted pairs, all experts densely)
    equals transformers' MoE block on the same tokens, and through the whole model."""
    import infercore.models.gpt_oss as gpt_oss

    monkeypatch.setenv("INFERCORE_GPT_OSS_EXPERTS", path)
    hf = tiny_gpt_oss()
    model, _ = ours_from_hf(hf, tmp_path)
    x = torch.randn(40, 32, generator=torch.Generator().manual_seed(4)) * 3
    with torch.no_grad():
        ref = hf.model.layers[1].mlp(x[None])[0][0]
        assert gpt_oss.experts_path(x) == path
        torch.testing.assert_close(model.model.layers[1].mlp(x), ref, rtol=1e-5, atol=1e-5)
        # one token: two of the four experts get no rows (empty groups)
        torch.testing.assert_close(model.model.layers[1].mlp(x[:1]), hf.model.layers[1].mlp(x[None, :1])[0][0],
                                   rtol=1e-5, atol=1e-5)  # fmt: skip
        # expert parallelism: two holders of two experts each (global ids, expert_offset) sum to the whole
        mlp = model.model.layers[1].mlp
        weights, ids = mlp.route(x)
        whole = mlp.experts(x, ids, weights)
        halves = []
        for lo in (0, 2):
            part = gpt_oss.GptOssExperts(model.config)
            for name in ("gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias"):
                setattr(part, name, torch.nn.Parameter(getattr(mlp.experts, name)[lo : lo + 2].clone()))
            part.expert_offset = lo
            halves.append(part(x, ids, weights))
        torch.testing.assert_close(halves[0] + halves[1], whole, rtol=1e-5, atol=1e-4)
        assert (halves[0] - whole).abs().max() > 1e-2  # each alone is only a share
    _close(PagedRunner(model).step(list(enumerate(PROMPTS))), torch.cat([hf_logits(hf, p) for p in PROMPTS]))
    monkeypatch.setenv("INFERCORE_GPT_OSS_EXPERTS", "fast")
    with pytest.raises(ValueError, match="INFERCORE_GPT_OSS_EXPERTS"):
        gpt_oss.experts_path(x)


@pytest.mark.parametrize("kv_layout", ["dense", "multi"])
def test_engine_greedy_matches_hf_generate(tmp_path, kv_layout):
    """Prompts of 5 to 19 tokens (window 6) in one batch, chunked (12-token budget, 4-token pages) and mixed with
    decodes, then prompts sharing the first one's prefix: the prefix cache serves their first pages. In the dense
    KV pool and in the multi-granularity one (sliding layers' pages freed as they leave the window)."""
    hf = tiny_gpt_oss(seed=1)
    hf.save_pretrained(tmp_path, safe_serialization=True)
    engine = Engine.from_pretrained(str(tmp_path), device="cpu", dtype=torch.float32, page_size=4, num_pages=96,
                                    max_num_seqs=4, max_num_batched_tokens=12, kv_layout=kv_layout)  # fmt: skip
    assert engine.kv_layout == kv_layout
    sp = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    outs = engine.generate(PROMPTS, sp)
    for prompt, out in zip(PROMPTS, outs):
        assert out.token_ids == hf_greedy(hf, prompt, 8)
    again = [PROMPTS[0][:13] + [5, 61], PROMPTS[0] + [3]]
    outs = engine.generate(again, sp)
    assert all(o.metrics.num_cached_tokens >= 12 for o in outs)
    for prompt, out in zip(again, outs):
        assert out.token_ids == hf_greedy(hf, prompt, 8)


def test_triton_attention_kernels_with_sinks(tmp_path, split_attention_through_triton):
    """The GPU paged-attention kernels (Triton, interpreted on the CPU) with the sinks: chunked prefill reading this
    step's K/V contiguously, decode with split-K, mixed steps' decodes split off to the decode kernel. The tokens are
    transformers'."""
    from infercore.ops import attention

    split = split_attention_through_triton(attention)
    hf = tiny_gpt_oss(seed=1)
    hf.save_pretrained(tmp_path, safe_serialization=True)
    engine = Engine.from_pretrained(str(tmp_path), device="cpu", dtype=torch.float32, page_size=4, num_pages=96,
                                    max_num_seqs=4, max_num_batched_tokens=12)  # fmt: skip
    outs = engine.generate(PROMPTS, SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))
    assert [o.token_ids for o in outs] == [hf_greedy(hf, p, 3) for p in PROMPTS]
    assert split and max(split) >= 2


def test_quantized_kv_cache(tmp_path):
    """int8 KV (codes with per-(token, head) scales) through the Engine: the model writes and reads the scales, and
    the greedy tokens stay mostly those of the float cache (a random tiny model has near-tied logits)."""
    from infercore.kv.cache import QuantizedKVCache

    hf = tiny_gpt_oss(seed=1)
    hf.save_pretrained(tmp_path, safe_serialization=True)
    kw = dict(device="cpu", dtype=torch.float32, page_size=4, num_pages=96, max_num_seqs=4, max_num_batched_tokens=12)
    sp = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    ref = Engine.from_pretrained(str(tmp_path), **kw).generate(PROMPTS, sp)
    eng = Engine.from_pretrained(str(tmp_path), kv_cache_dtype="int8", kv_layout="dense", **kw)
    assert all(isinstance(c, QuantizedKVCache) for c in eng.runner.kv_caches)
    out = eng.generate(PROMPTS, sp)
    agree = sum(a == b for o, r in zip(out, ref) for a, b in zip(o.token_ids, r.token_ids))
    assert agree >= 0.75 * 8 * len(PROMPTS)


def test_bf16_on_the_cpu(tmp_path):
    """bf16 weights with the CPU layouts the Engine picks (oneDNN-packed linears, the router's included): logits
    near transformers' fp32 ones, prefill and decode. Rows, not all of them: bf16 rounding flips an expert choice
    now and then (transformers' own bf16 model is 0.4 off on one row of this prompt set)."""
    from infercore.models import load_model
    from infercore.models.layout import pack_linears_for_cpu_

    hf = tiny_gpt_oss()
    hf.save_pretrained(tmp_path, safe_serialization=True)
    model = load_model(tmp_path, dtype=torch.bfloat16, device="cpu")[0]
    assert pack_linears_for_cpu_(model) > 0
    runner = PagedRunner(model)

    def near(ours, ref):
        rows = (ours - ref).abs().max(-1).values < 3e-2 * ref.abs().max()
        assert rows.float().mean() > 0.9, rows

    near(runner.step(list(enumerate(PROMPTS))), torch.cat([hf_logits(hf, p) for p in PROMPTS]))
    ref = torch.stack([hf_logits(hf, p + [7])[-1] for p in PROMPTS])
    near(torch.cat([runner.step([(i, [7])]) for i in range(len(PROMPTS))]), ref)


def test_mxfp4_experts_dequantize_as_transformers():
    """The released checkpoints' MXFP4 experts (uint8 blocks of 32 e2m1 values, two a byte, and a power-of-two scale
    per block) against transformers' own conversion, and through load_weights."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    from infercore.models.gpt_oss import _dequantized, dequantize_mxfp4

    gen = torch.Generator().manual_seed(0)
    blocks = torch.randint(0, 256, (3, 10, 2, 16), generator=gen, dtype=torch.uint8)
    scales = torch.randint(118, 134, (3, 10, 2), generator=gen, dtype=torch.uint8)
    ours = dequantize_mxfp4(blocks, scales)
    assert ours.shape == (3, 64, 10)
    assert torch.equal(ours, convert_moe_packed_tensors(blocks, scales, dtype=torch.float32))
    got = dict(_dequantized([("a", torch.ones(1)), ("model.layers.0.mlp.experts.down_proj_scales", scales),
                             ("model.layers.0.mlp.experts.down_proj_blocks", blocks)]))  # fmt: skip
    assert torch.equal(got["model.layers.0.mlp.experts.down_proj"], ours) and "a" in got
    with pytest.raises(ValueError, match="down_proj_scales is missing"):
        list(_dequantized([("model.layers.0.mlp.experts.down_proj_blocks", blocks)]))
    with pytest.raises(ValueError, match="uint8"):
        dequantize_mxfp4(blocks.float(), scales)


def test_mxfp4_checkpoint_loads_into_the_model(tmp_path):
    """A checkpoint whose experts are MXFP4 (the dense experts of a tiny model quantized exactly: values on the
    e2m1 grid times powers of two) loads into the same logits as the dense one."""
    from infercore.models import build_model
    from infercore.models.gpt_oss import FP4_VALUES

    hf = tiny_gpt_oss()
    sd = {k: v.clone() for k, v in hf.state_dict().items()}
    gen = torch.Generator().manual_seed(2)
    lut = torch.tensor(FP4_VALUES)
    quantized = {}
    for name in [n for n in sd if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        e, k, r = sd[name].shape  # [E, K (input, multiple of 32), R] -> blocks [E, R, K / 32, 16]
        if k % 32:
            continue
        codes = torch.randint(0, 16, (e, r, k // 32, 32), generator=gen, dtype=torch.uint8)
        scales = torch.randint(122, 130, (e, r, k // 32), generator=gen, dtype=torch.uint8)
        dense = torch.ldexp(lut[codes.long()], (scales.int() - 127)[..., None].float()).reshape(e, r, k)
        sd[name] = dense.transpose(1, 2).contiguous()
        quantized[name + "_blocks"] = codes[..., 0::2] | (codes[..., 1::2] << 4)
        quantized[name + "_scales"] = scales
    assert quantized  # hidden 32: down_proj is [E, 24, 32]; gate_up_proj [E, 32, 48] quantizes
    cfg = config_from_hf(hf.config.to_dict())
    dense_model = build_model(cfg, dtype=torch.float32, device="cpu", init="empty")
    dense_model.load_weights(sd.items())
    mx = build_model(cfg, dtype=torch.float32, device="cpu", init="empty")
    stem = {n[: -len("_blocks")] for n in quantized if n.endswith("_blocks")}
    mx.load_weights([(k, v) for k, v in sd.items() if k not in stem] + list(quantized.items()))
    for (n, a), (_, b) in zip(dense_model.named_parameters(), mx.named_parameters()):
        assert torch.equal(a, b), n

    # The same as a released checkpoint's directory (quantization_config mxfp4, uint8 *_blocks / *_scales beside the
    # dense tensors): load_model and Engine.from_pretrained read it into the dense model's logits and tokens.
    import json

    from safetensors.torch import save_file

    from infercore.models import load_model

    hf.config.save_pretrained(tmp_path)
    conf = json.loads((tmp_path / "config.json").read_text())
    conf["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn"]}
    (tmp_path / "config.json").write_text(json.dumps(conf))
    save_file({**{k: v.contiguous() for k, v in sd.items() if k not in stem}, **quantized},
              str(tmp_path / "model.safetensors"))  # fmt: skip
    loaded, _, _ = load_model(tmp_path, dtype=torch.float32, device="cpu")
    for (n, a), (_, b) in zip(dense_model.named_parameters(), loaded.named_parameters()):
        assert torch.equal(a, b), n
    hf.load_state_dict(sd)  # the dense reference of the quantized experts
    eng = Engine.from_pretrained(str(tmp_path), device="cpu", dtype=torch.float32, page_size=4, num_pages=64)
    prompt = [3, 17, 29, 5, 11, 40, 2]
    out = eng.generate([prompt], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))[0]
    assert out.token_ids == hf_greedy(hf, prompt, 5)
    conf["model_type"] = "llama"  # MXFP4 is read for GPT-OSS's experts only
    with pytest.raises(ValueError, match="mxfp4"):
        from infercore.loading.prequantized import prequantized_config

        prequantized_config(conf)


def test_lora_refuses_expert_adapters():
    """GPT-OSS's experts (biased, interleaved, in x @ W layout) have no LoRA slots: an adapter on them is refused when
    added, with the reason; one on the attention projections loads."""
    from infercore.lora import LoRAAdapter
    from infercore.models import build_model

    hf = tiny_gpt_oss()
    cfg = config_from_hf(hf.config.to_dict())
    model = build_model(cfg, dtype=torch.float32, device="cpu")
    model.load_weights(hf.state_dict().items())
    eng = Engine(model, page_size=4, num_pages=32, max_loras=1, max_lora_rank=4)
    assert not any(key[1] == "experts" for key in eng.lora.layers)
    H, E, I = cfg.hidden_size, cfg.num_experts, cfg.intermediate_size  # noqa: E741
    experts = LoRAAdapter("e", {(0, "experts.down_proj"): (torch.zeros(E, 4, I), torch.zeros(E, H, 4))})
    with pytest.raises(ValueError, match="no experts that take LoRA"):
        eng.add_lora("e", experts)
    q = cfg.num_heads * cfg.head_dim
    eng.add_lora("a", LoRAAdapter("a", {(0, "q_proj"): (torch.zeros(4, H), torch.zeros(q, 4))}))
    assert eng.list_loras() == ["a"]


def test_refusals():
    hf = tiny_gpt_oss()
    cfg = config_from_hf(hf.config.to_dict())
    from infercore.models import build_model
    with pytest.raises(TypeError, match="GptOssConfig"):
        GptOssForCausalLM(cfg.__class__.__bases__[0](**{k: getattr(cfg, k) for k in (
            "vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads",
            "head_dim")}))  # fmt: skip
    with pytest.raises(ValueError, match="unexpected tensor"):
        build_model(cfg, dtype=torch.float32, device="cpu", init="empty").load_weights(
            [("model.layers.0.mlp.gate.weight", torch.zeros(4, 32))])


# ---------------------------------------------------------------------------------------------------- GPU
@pytest.mark.gpu
def test_cuda_engine_greedy_matches_hf(tmp_path):
    """On CUDA (Triton paged attention with sinks, decode CUDA graphs: the dense expert path in fp32, the grouped
    GEMMs in bf16): fp32 tokens equal transformers' greedy ones on the CPU; in bf16 the graphs give the eager
    engine's tokens."""
    from infercore.models import load_model

    hf = tiny_gpt_oss(seed=1)
    hf.save_pretrained(tmp_path, safe_serialization=True)
    sp = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    eng = Engine.from_pretrained(str(tmp_path), device="cuda", dtype=torch.float32, page_size=4, num_pages=96,
                                 max_num_seqs=4, max_num_batched_tokens=12)  # fmt: skip
    assert eng.graph_runner is not None
    assert [o.token_ids for o in eng.generate(PROMPTS, sp)] == [hf_greedy(hf, p, 10) for p in PROMPTS]
    model = load_model(tmp_path, dtype=torch.bfloat16, device="cuda")[0]
    eager = Engine(model, page_size=4, num_pages=96, max_num_seqs=4, cuda_graph_max_batch=0)
    graphs = Engine(model, page_size=4, num_pages=96, max_num_seqs=4)
    assert [o.token_ids for o in graphs.generate(PROMPTS, sp)] == [o.token_ids for o in eager.generate(PROMPTS, sp)]
