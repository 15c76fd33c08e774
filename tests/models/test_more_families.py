"""Phi-3 (merged checkpoint projections, partial rotary, LongRoPE, sliding window), Granite (embedding / residual /
attention multipliers, logits scaling) and OLMo 2 (post-norms, q / k norms over the whole projections) against
transformers on tiny random fp32 configs, through ``save_pretrained`` and ``load_model``, the Engine's greedy
tokens against ``generate``, bf16 on the CPU against the fp32 reference with the path each family must take (the
fused native decode layers for Phi-3, op by op for the others), and bad configs."""

from __future__ import annotations

import pytest
import torch
from paged_harness import PagedRunner, hf_greedy, hf_logits

from infercore.engine import Engine, EngineConfig, SamplingParams
from infercore.models import (
    GraniteForCausalLM,
    LlamaForCausalLM,
    ModelConfig,
    Olmo2ForCausalLM,
    Phi3ForCausalLM,
    config_from_hf,
)
from infercore.models.layout import pack_linears_for_cpu_
from infercore.ops import rope_cos_sin_cache, rope_inv_freq
from infercore.ops.moe import cpu_native

COMMON = dict(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, rms_norm_eps=1e-6, initializer_range=0.1, bos_token_id=1, eos_token_id=None,
              pad_token_id=0)  # fmt: skip
ORIG = 16  # original_max_position_embeddings of the LongRoPE config
LONGROPE = {"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
            "short_factor": [1.0, 1.5, 2.0, 3.0], "long_factor": [2.0, 5.0, 11.0, 23.0]}  # fmt: skip

SHORT_PROMPTS = [
    [1, 17, 42, 99, 5, 230, 7, 64, 12, 150, 33, 8, 71, 200, 3, 91, 45, 18, 260],
    [1, 250, 4, 4, 19],
    [1, 88, 120, 7, 56, 290, 14, 3, 77, 101, 9, 66, 240, 31, 2, 180, 55, 123],
]
# longer than ORIG: transformers takes LongRoPE's long factors for them, as our table does
LONG_PROMPTS = [[(7 * i + 3 * j) % 297 + 2 for i in range(n)] for j, n in enumerate((21, 17, 26))]


def tiny(kind: str, *, seed: int = 0, **overrides):
    """A tiny random transformers model of ``kind`` with randomised norms and biases (HF sets them to 1 / 0)."""
    import transformers as tf

    if kind == "phi3":  # full rotary (so the fused CPU decode layer applies), a window on every layer
        cfg = tf.Phi3Config(**{**COMMON, "max_position_embeddings": 128, "sliding_window": 8, **overrides})
        cls = tf.Phi3ForCausalLM
    elif kind == "phi3_longrope":
        cfg = tf.Phi3Config(**{**COMMON, "max_position_embeddings": 64, "original_max_position_embeddings": ORIG,
                               "rope_parameters": dict(LONGROPE), **overrides})  # fmt: skip
        cls = tf.Phi3ForCausalLM
    elif kind.startswith("granite"):  # Granite 3's embeddings are tied; "_bias": the bias options on, untied
        bias = kind == "granite_bias"
        cfg = tf.GraniteConfig(**{**COMMON, "max_position_embeddings": 128, "embedding_multiplier": 6.0,
                                  "residual_multiplier": 0.35, "attention_multiplier": 0.07, "logits_scaling": 3.0,
                                  "attention_bias": bias, "mlp_bias": bias, "tie_word_embeddings": not bias,
                                  **overrides})  # fmt: skip
        cls = tf.GraniteForCausalLM
    elif kind.startswith("olmo2"):
        cfg = tf.Olmo2Config(**{**COMMON, "max_position_embeddings": 128, "attention_bias": kind == "olmo2_bias",
                                **overrides})  # fmt: skip
        cls = tf.Olmo2ForCausalLM
    else:
        raise ValueError(kind)
    cfg._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = cls(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(".bias") or "norm" in name:
                p.add_(torch.randn_like(p) * 0.2)
    return model


KINDS = ["phi3", "phi3_longrope", "granite", "olmo2"]
BIAS_KINDS = ["granite_bias", "olmo2_bias"]  # the bias options (the fused layer takes no o / MLP bias anyway)
CLASSES = {"phi3": Phi3ForCausalLM, "phi3_longrope": Phi3ForCausalLM, "granite": GraniteForCausalLM,
           "granite_bias": GraniteForCausalLM, "olmo2": Olmo2ForCausalLM, "olmo2_bias": Olmo2ForCausalLM}


def _prompts(kind: str) -> list[list[int]]:
    return LONG_PROMPTS if kind == "phi3_longrope" else SHORT_PROMPTS


def _close(ours: torch.Tensor, ref: torch.Tensor, rel: float = 1e-4) -> None:
    err = (ours - ref).abs().max().item()
    assert err < rel * ref.abs().max().item(), f"max abs error {err} vs max |logit| {ref.abs().max().item()}"


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """Each kind's HF model and its save_pretrained directory (written once)."""
    out = {}
    for kind in KINDS + BIAS_KINDS:
        hf = tiny(kind)
        path = tmp_path_factory.mktemp(kind)
        hf.save_pretrained(path, safe_serialization=True)
        out[kind] = hf, path
    return out


def _load(checkpoints, kind, dtype=torch.float32):
    from infercore.models import load_model

    hf, path = checkpoints[kind]
    model, _, config = load_model(path, dtype=dtype, device="cpu")
    return hf, model, config


# ------------------------------------------------------------------------------------------ configs
def test_configs_resolve_the_family_facts(checkpoints):
    cfg = _load(checkpoints, "phi3_longrope")[2]
    assert cfg.rotary_dim == 8 and cfg.rope_scaling["rope_type"] == "longrope"
    # HF's default factor is the context extension; it sets the attention factor of both sets
    assert cfg.rope_scaling["original_max_position_embeddings"] == ORIG and cfg.rope_scaling["factor"] == 64 / ORIG
    cfg = _load(checkpoints, "phi3")[2]
    assert cfg.sliding_window == 8 and set(cfg.layer_types) == {"sliding_attention"} and not cfg.attention_bias
    cfg = _load(checkpoints, "granite")[2]
    assert (cfg.embedding_multiplier, cfg.residual_multiplier, cfg.attention_multiplier, cfg.logits_scaling) == (
        6.0, 0.35, 0.07, 3.0)
    assert cfg.tie_word_embeddings and not (cfg.attention_bias or cfg.o_bias or cfg.mlp_bias)
    cfg = _load(checkpoints, "granite_bias")[2]
    assert cfg.attention_bias and cfg.o_bias and cfg.mlp_bias and not cfg.tie_word_embeddings
    cfg = _load(checkpoints, "olmo2")[2]
    assert cfg.post_norm and cfg.qk_proj_norm and not cfg.qk_norm and not cfg.attention_bias
    cfg = _load(checkpoints, "olmo2_bias")[2]
    assert cfg.attention_bias and cfg.o_bias and not cfg.mlp_bias
    # Phi-3's legacy "su" type is LongRoPE; a missing original_max_position_embeddings is Phi3Config's 4096
    hf = tiny("phi3_longrope").config.to_dict()
    hf.pop("original_max_position_embeddings")
    rope = {**hf.pop("rope_parameters"), "type": "su"}
    rope.pop("rope_type"), rope.pop("original_max_position_embeddings")
    cfg = ModelConfig.from_hf({**hf, "rope_scaling": rope, "max_position_embeddings": 8192})
    assert cfg.rope_scaling["rope_type"] == "longrope"
    assert cfg.rope_scaling["original_max_position_embeddings"] == 4096 and cfg.rope_scaling["factor"] == 2.0


def test_longrope_table_matches_transformers_rope_init():
    """Both factor sets and the attention factor, bit for bit against ``ROPE_INIT_FUNCTIONS["longrope"]``, chosen
    by the sequence length against original_max_position_embeddings as transformers chooses."""
    import transformers as tf
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    hf = tf.Phi3Config(**{**COMMON, "max_position_embeddings": 64, "original_max_position_embeddings": ORIG,
                          "rope_parameters": dict(LONGROPE)})  # fmt: skip
    scaling = ModelConfig.from_hf(hf.to_dict()).rope_scaling
    for seq_len in (None, ORIG, ORIG + 1, 64):
        ref, ref_factor = ROPE_INIT_FUNCTIONS["longrope"](hf, "cpu", seq_len=seq_len)
        inv, factor = rope_inv_freq(rotary_dim=8, base=10000.0, scaling=scaling, seq_len=seq_len)
        assert torch.equal(inv, ref) and factor == ref_factor and factor > 1.2
        table = rope_cos_sin_cache(rotary_dim=8, max_positions=64, base=10000.0, scaling=scaling, seq_len=seq_len)
        angles = torch.arange(64, dtype=torch.float32)[:, None] * ref[None, :]
        assert torch.equal(table, torch.cat([angles.cos() * ref_factor, angles.sin() * ref_factor], -1))
    short = rope_inv_freq(rotary_dim=8, base=10000.0, scaling=scaling, seq_len=ORIG)[0]
    long = rope_inv_freq(rotary_dim=8, base=10000.0, scaling=scaling, seq_len=ORIG + 1)[0]
    assert not torch.equal(short, long)


# ------------------------------------------------------------------------------------------ logits
@pytest.mark.parametrize("kind", KINDS + BIAS_KINDS)
def test_prefill_and_decode_logits_match_hf(kind, checkpoints):
    hf, model, config = _load(checkpoints, kind)
    assert type(model) is CLASSES[kind] and config.model_type == kind.split("_")[0]
    prompts = _prompts(kind)
    runner = PagedRunner(model)
    logits = runner.step(list(enumerate(prompts)))
    _close(logits, torch.cat([hf_logits(hf, p) for p in prompts]))
    nxt = [7, 11, 13]  # two decode steps per sequence after the prefill
    for step in range(2):
        logits = runner.step([(i, [t + step]) for i, t in enumerate(nxt)])
        ref = torch.stack([hf_logits(hf, p + [t + s for s in range(step + 1)])[-1] for p, t in zip(prompts, nxt)])
        _close(logits, ref)


def test_phi3_longrope_short_factors_when_the_context_is_the_original(checkpoints):
    """With max_position_embeddings lowered to original_max_position_embeddings the table takes the short factors,
    which transformers uses for sequences up to that length (same attention factor, from the checkpoint's config)."""
    hf, model, _ = _load(checkpoints, "phi3_longrope")
    prompts = [p[:ORIG - 3] for p in SHORT_PROMPTS]
    ref = torch.cat([hf_logits(hf, p) for p in prompts])
    long_logits = PagedRunner(model).step(list(enumerate(prompts)))
    assert (long_logits - ref).abs().max() > 1e-2  # the long set really differs on short sequences
    model.config.max_position_embeddings = ORIG
    model.finish_init()
    _close(PagedRunner(model).step(list(enumerate(prompts))), ref)
    eng = Engine(model, config=EngineConfig(page_size=4, num_pages=64, max_num_seqs=4))
    assert eng.max_model_len == ORIG
    outs = eng.generate(prompts, SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))
    assert [o.token_ids for o in outs] == [hf_greedy(hf, p, 3) for p in prompts]


def test_granite_multipliers_are_all_applied(checkpoints):
    """Each multiplier changes the logits (a model that dropped one would not match transformers above)."""
    _, model, _ = _load(checkpoints, "granite")
    base = PagedRunner(model).step([(0, SHORT_PROMPTS[0])])
    for name in ("embedding_multiplier", "residual_multiplier", "attention_multiplier", "logits_scaling"):
        _, m, _ = _load(checkpoints, "granite")
        setattr(m.config, name, 1.0)
        for layer in m.model.layers:  # the layers keep their own copies of two of them
            if name == "residual_multiplier":
                layer.residual_multiplier = 1.0
            elif name == "attention_multiplier":
                layer.self_attn.scale = 1.0
        assert (PagedRunner(m).step([(0, SHORT_PROMPTS[0])]) - base).abs().max() > 1e-2, name


# ------------------------------------------------------------------------------------------ engine
@pytest.mark.parametrize("kind", KINDS)
def test_engine_greedy_matches_hf_generate(kind, checkpoints):
    hf, model, _ = _load(checkpoints, kind)
    prompts = _prompts(kind)
    # page 4 and a 16-token budget: prompts are chunked and mixed with decodes
    engine = Engine(model, config=EngineConfig(page_size=4, num_pages=96, max_num_seqs=4, max_num_batched_tokens=16))
    outs = engine.generate(prompts, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    for prompt, out in zip(prompts, outs):
        assert out.token_ids == hf_greedy(hf, prompt, 8)


def test_phi3_longrope_generation_across_the_original_length(checkpoints):
    """A prompt shorter than original_max_position_embeddings, generation past it. transformers' generate takes the
    short factors while the sequence fits, then recomputes the whole sequence with the long ones; one RoPE table
    cannot, so the model keeps the long set throughout (its context is longer). What is well defined: every token
    is transformers' argmax at its position in a forward of the whole sequence (longer than the original length,
    so long factors everywhere)."""
    hf, model, _ = _load(checkpoints, "phi3_longrope")
    prompts = [p[:10] for p in LONG_PROMPTS]
    n = 14  # 10 + 14 > ORIG
    engine = Engine(model, config=EngineConfig(page_size=4, num_pages=96, max_num_seqs=4))
    outs = engine.generate(prompts, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))
    for prompt, out in zip(prompts, outs):
        seq = prompt + out.token_ids
        assert len(seq) > ORIG
        ref = hf_logits(hf, seq)[len(prompt) - 1 : -1]
        assert out.token_ids == ref.argmax(-1).tolist()


# ------------------------------------------------------------------------------------------ CPU bf16 paths
class _NativeCalls:
    """Counts the fused native decode-layer calls (``cpu_native.llama_decode_layer`` / ``llama_decode_layers``)."""

    def __init__(self, monkeypatch) -> None:
        self.n = 0
        for name in ("llama_decode_layer", "llama_decode_layers"):
            fn = getattr(cpu_native, name)

            def counted(*a, _fn=fn, **kw):
                self.n += 1
                return _fn(*a, **kw)

            monkeypatch.setattr(cpu_native, name, counted)


# Phi-3 with full rotary is the Llama layer: its decode steps take the fused native layers. Partial rotary
# (the LongRoPE config), Granite's multipliers and OLMo 2's post-norms are not what that layer computes: op by op.
NATIVE = {"phi3": True, "phi3_longrope": False, "granite": False, "olmo2": False}


@pytest.mark.parametrize("kind", KINDS)
def test_bf16_cpu_decode_path_and_accuracy(kind, checkpoints, monkeypatch):
    assert cpu_native.available(), cpu_native.status()  # built at first use, as the other native-kernel tests ask
    assert cpu_native.fused_layers_on()
    calls = _NativeCalls(monkeypatch)
    hf, model, _ = _load(checkpoints, kind, dtype=torch.bfloat16)
    assert pack_linears_for_cpu_(model) > 0  # as the Engine does: the native layer takes packed linears
    prompts = _prompts(kind)
    runner = PagedRunner(model)
    logits = runner.step(list(enumerate(prompts)))
    _close(logits, torch.cat([hf_logits(hf, p) for p in prompts]), rel=3e-2)
    assert calls.n == 0  # prefill never takes the decode layer
    seqs = [list(p) for p in prompts]
    for t in (7, 8, 9):
        logits = runner.step([(i, [t]) for i in range(len(prompts))])
        for s in seqs:
            s.append(t)
        _close(logits, torch.stack([hf_logits(hf, s)[-1] for s in seqs]), rel=3e-2)
    assert (calls.n > 0) == NATIVE[kind], calls.n


@pytest.mark.parametrize("kind", KINDS)
def test_bf16_cpu_engine_matches_fp32_reference(kind, checkpoints, monkeypatch):
    """The Engine in bf16 on the CPU (packed linears, the fused layers where they apply): every greedy token is
    within bf16 error of transformers' fp32 argmax, and its log-probability within bf16 error of the reference's."""
    calls = _NativeCalls(monkeypatch)
    hf, model, _ = _load(checkpoints, kind, dtype=torch.bfloat16)
    prompts = _prompts(kind)
    engine = Engine(model, config=EngineConfig(page_size=4, num_pages=96, max_num_seqs=4))
    outs = engine.generate(prompts, SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=1))
    for prompt, out in zip(prompts, outs):
        ref = torch.log_softmax(hf_logits(hf, prompt + out.token_ids)[len(prompt) - 1 : -1], -1)
        for i, tok in enumerate(out.token_ids):
            assert ref[i].max() - ref[i, tok] < 0.1, (i, tok)
            assert abs(out.logprobs[i][tok] - ref[i, tok].item()) < 0.1
    if cpu_native.available() and cpu_native.fused_layers_on():
        assert (calls.n > 0) == NATIVE[kind], calls.n


# ------------------------------------------------------------------------------------------ refusals
@pytest.mark.parametrize("kind, key, value", [
    ("phi3_longrope", "short_factor", [1.0, 2.0]),
    ("phi3_longrope", "long_factor", None),
    ("phi3_longrope", "long_factor", "x"),
    ("phi3_longrope", "original_max_position_embeddings", 0),
    ("granite", "logits_scaling", 0),
    ("granite", "embedding_multiplier", "6"),
    ("granite", "residual_multiplier", -0.5),
    ("granite", "attention_multiplier", True),
    ("olmo2", "num_key_value_heads", 3),
    ("olmo2", "architectures", ["Olmo2ForTokenClassification"]),
])  # fmt: skip
def test_bad_configs_name_the_key(kind, key, value):
    hf = tiny(kind).config.to_dict()
    if key in ("short_factor", "long_factor"):
        hf["rope_parameters"] = {**hf["rope_parameters"], key: value}
    else:
        hf[key] = value
    with pytest.raises(ValueError, match=key):
        config_from_hf(hf)


def test_family_classes_refuse_what_they_would_drop():
    granite = ModelConfig.from_hf(tiny("granite").config.to_dict())
    olmo2 = ModelConfig.from_hf(tiny("olmo2").config.to_dict())
    with pytest.raises(ValueError, match="GraniteForCausalLM"):
        LlamaForCausalLM(granite)
    with pytest.raises(ValueError, match="Olmo2ForCausalLM"):
        LlamaForCausalLM(olmo2)
    with pytest.raises(ValueError, match="qk_norm"):
        ModelConfig(**{**vars(olmo2), "qk_norm": True})
    # a Phi-3 checkpoint has merged projections; split ones are not its names
    model = Phi3ForCausalLM(ModelConfig.from_hf(tiny("phi3").config.to_dict()))
    with pytest.raises(ValueError, match="unexpected tensor 'model.layers.0.self_attn.q_proj.weight'"):
        model.load_weights([("model.layers.0.self_attn.q_proj.weight", torch.zeros(64, 64))])


def test_a_family_can_refuse_tensor_parallelism():
    """Every family shards now; a model class that cannot names why in ``tensor_parallel_unsupported`` and is refused
    up front (before the process group is even looked at)."""
    from infercore.parallel import tensor_parallel_

    class Unshardable(Phi3ForCausalLM):
        tensor_parallel_unsupported = "its projections cannot be split by heads"

    with pytest.raises(ValueError, match="Unshardable: its projections cannot be split by heads"):
        tensor_parallel_(Unshardable(ModelConfig.from_hf(tiny("phi3").config.to_dict())))
    with pytest.raises(ValueError, match="torch.distributed is not initialized"):
        tensor_parallel_(Olmo2ForCausalLM(ModelConfig.from_hf(tiny("olmo2").config.to_dict())))


@pytest.mark.gpu
@pytest.mark.parametrize("kind", KINDS + BIAS_KINDS)
def test_cuda_graph_greedy_matches_hf(kind, checkpoints):
    """On CUDA (the fused RoPE + KV write + decode attention, the GEMV linears and gated-MLP epilogue, decode steps
    in CUDA graphs): fp32 tokens equal transformers' fp32 greedy ones on the CPU; in bf16 the graphs give the eager
    engine's tokens."""
    from infercore.models import load_model

    hf, path = checkpoints[kind]
    prompts = _prompts(kind)
    sp = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    model, _, _ = load_model(path, dtype=torch.float32, device="cuda")
    eng = Engine(model, config=EngineConfig(page_size=4, num_pages=96, max_num_seqs=4))
    assert eng.graph_runner is not None and eng.graph_runner.graphs
    assert [o.token_ids for o in eng.generate(prompts, sp)] == [hf_greedy(hf, p, 12) for p in prompts]
    model, _, _ = load_model(path, dtype=torch.bfloat16, device="cuda")
    eager = Engine(model, config=EngineConfig(page_size=4, num_pages=96, max_num_seqs=4, cuda_graph_max_batch=0))
    graphs = Engine(model, config=EngineConfig(page_size=4, num_pages=96, max_num_seqs=4))
    assert [o.token_ids for o in graphs.generate(prompts, sp)] == [o.token_ids for o in eager.generate(prompts, sp)]
