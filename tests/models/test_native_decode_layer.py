"""A Llama decoder layer's CPU decode step in one native call (``cpu_native.llama_decode_layer``) against the
op-by-op path it replaces: the same logits and KV caches bit for bit, over paged caches with shuffled pages,
ragged batches, GQA and a sliding window; and which layers / steps take it."""

from __future__ import annotations

import pytest
import torch
from paged_harness import PagedRunner, ours_from_hf, tiny_hf_model

from infercore.models.layout import pack_linears_for_cpu_
from infercore.ops import AttentionMetadata
from infercore.ops.moe import cpu_native
from infercore.quant import QuantScheme, quantize

PROMPTS = [[1, 17, 42, 99, 5, 230, 7, 64, 12, 150, 33], [1, 250, 4, 4, 19], [1, 88, 120, 7, 56, 290, 14, 3, 77, 101,
                                                                             9, 66, 240, 31, 2, 180, 55, 123]]


# GGUF formats only loaded from files (no quantizer): random blocks per linear, each decoder layer's qkv / o /
# gate_up / down in these; the INT4 GEMV in groups of 32 (Q4_K) and the INT8 one in groups of 32 and 16 (Q6_K).
# "gguf-mixed": merged projections whose parts are in several formats (one "mixed" weight each)
_KQUANTS = {"qkv_proj": ("q4_k",), "o_proj": ("q5_k",), "gate_up_proj": ("q6_k",), "down_proj": ("q5_0",)}
_MIXED = {"qkv_proj": ("q4_k", "q4_k", "q6_k"), "o_proj": ("q4_k",), "gate_up_proj": ("q4_k", "q5_1"),
          "down_proj": ("q4_k",)}
_MAG = {"q4_k": 2e-3, "q5_k": 1e-3, "q6_k": 3e-4, "q5_0": 4e-3, "q5_1": 4e-3}


def _gguf_blocks_(model, formats: dict, seed: int = 0) -> None:
    from infercore.quant import GGUFWeight, QuantLinear
    from infercore.quant.gguf import BLOCK_BYTES, BLOCK_ELEMS

    g = torch.Generator().manual_seed(seed)
    for layer in model.model.layers:
        for parent in (layer.self_attn, layer.mlp):
            for name, qtypes in formats.items():
                old = getattr(parent, name, None)
                if old is None:
                    continue
                n, k = old.weight.shape
                if name == "qkv_proj" and len(qtypes) == 3:
                    hd, nq, nkv = parent.head_dim, parent.num_heads, parent.num_kv_heads
                    rows = [nq * hd, nkv * hd, nkv * hd]
                else:
                    rows = [n // len(qtypes)] * len(qtypes)
                parts = []
                for qtype, r in zip(qtypes, rows):
                    raw = torch.randint(0, 256, (r, k // BLOCK_ELEMS[qtype], BLOCK_BYTES[qtype]), generator=g,
                                        dtype=torch.uint8)
                    for off in (208,) if qtype == "q6_k" else (0, 2):  # finite fp16 d (and dmin / m)
                        f = ((torch.rand(r, raw.shape[1], 1, generator=g) * 2 - 1) * _MAG[qtype]).half()
                        raw[..., off : off + 2] = f.view(torch.uint8)
                    parts.append(GGUFWeight.from_blocks(raw, qtype))
                setattr(parent, name, QuantLinear(GGUFWeight.concat(parts), old.bias))


def _models(kind: str, dtype: torch.dtype, tmp_path, scheme=None, **cfg):
    """Two copies of our model from one tiny HF model, their linears prepared for the CPU as the Engine does
    (packed, or quantized by ``scheme``; "gguf-kquants" / "gguf-mixed": random GGUF blocks of :data:`_KQUANTS` /
    :data:`_MIXED`, the same in both)."""
    hf = tiny_hf_model(kind, **cfg)
    models = [ours_from_hf(hf, tmp_path / str(i), dtype=dtype)[0] for i in range(2)]
    for m in models:
        if scheme is None:
            assert pack_linears_for_cpu_(m) > 0
        elif scheme in ("gguf-kquants", "gguf-mixed"):
            _gguf_blocks_(m, _KQUANTS if scheme == "gguf-kquants" else _MIXED)
        else:
            quantize(m, scheme)
    return models


# Quantized schemes the fused layer takes: INT4 with K = 64 padded to 128 for groups of 128; GGUF blocks of 32 over
# K = 96 and 160, whose last 32 elements are a tail of 16 code bytes in the kernel's layout; INT8 per channel; FP8
_G32 = QuantScheme("test-w4a16-g32", "int4", "INT4, groups of 32", group_size=32)
_QUANT = [("w4a16-g128", {}), (_G32, {"hidden_size": 96, "intermediate_size": 160}),
          ("gguf-q4_1", {"hidden_size": 96, "intermediate_size": 160}), ("gguf-q4_0", {}),
          ("w8a16", {"hidden_size": 80, "intermediate_size": 136}),  # INT8: K % 32 != 0, the masked tail
          ("gguf-q8_0", {}), ("gguf-kquants", {"hidden_size": 256, "intermediate_size": 512}),
          ("gguf-mixed", {"hidden_size": 256, "intermediate_size": 512}),
          # "+a8": the INT4 / INT8 GEMVs on 8-bit activations (cpu_native.set_int8_activations), fused and op by op
          # alike
          ("w4a16-g128+a8", {}), ("gguf-q4_1+a8", {"hidden_size": 96, "intermediate_size": 160}),
          ("gguf-mixed+a8", {"hidden_size": 256, "intermediate_size": 512}), ("gguf-q8_0+a8", {}),
          ("w8a16+a8", {"hidden_size": 80, "intermediate_size": 136}),  # K % 64 != 0: INT8 keeps bf16 there
          # FP8 e4m3 codes as stored (cpu_native.linear_fp8's rows): per channel over K = 80 / 136 (masked tails),
          # 128 x 128 blocks over K = 160 / 200 (partial blocks)
          ("fp8-wo", {"hidden_size": 80, "intermediate_size": 136}),
          ("fp8-wo-block", {"hidden_size": 160, "intermediate_size": 200}),
          # 4-bit codebook (NF4) codes as stored with the codebook and absmax (cpu_native.lut4_operands)
          ("w4a16-nf4", {"hidden_size": 128, "intermediate_size": 192})]


# Qwen3 (per-head q / k RMSNorms before RoPE, in the fused layers' RoPE step) and Qwen2 (a qkv bias): dense and a few
# quantized schemes
_QWEN3 = [(kind, {}, dt, None, {}) for kind in ("qwen3", "qwen2") for dt in (torch.float32, torch.bfloat16)] + [
    (kind, {}, torch.bfloat16, s, c) for kind in ("qwen3", "qwen2") for s, c in _QUANT
    if s in ("w4a16-g128", "gguf-q4_0", "gguf-q8_0+a8")]


@pytest.mark.parametrize("kind,kcfg,dtype,scheme,cfg",
                         [(k, kc, d, s, c) for k, kc in (("llama", {}), ("mistral", {"sliding_window": 8}))
                          for d, s, c in [(torch.float32, None, {}), (torch.bfloat16, None, {})]
                          + [(torch.bfloat16, s, c) for s, c in _QUANT]] + _QWEN3)
@pytest.mark.parametrize("stack", [True, False])
def test_fused_decode_equals_the_op_by_op_path(kind, kcfg, dtype, scheme, cfg, stack, tmp_path, monkeypatch, request):
    """Fused: all layers in one call (``llama_decode_layers``), or (stack=False) one call per layer."""
    if scheme is not None:
        assert cpu_native.q4_supported(), cpu_native.status()  # the CI machine has AVX512-BF16
    a8 = isinstance(scheme, str) and scheme.endswith("+a8")
    if a8:
        scheme = scheme[: -len("+a8")]
        request.addfinalizer(lambda: cpu_native.set_int8_activations(False))
        assert cpu_native.set_int8_activations(True)  # AVX512-VNNI, as AVX512-BF16 above
    fused_model, ops_model = _models(kind, dtype, tmp_path, scheme, **kcfg, **cfg)
    if not stack:
        monkeypatch.setattr(cpu_native, "_layer_stack_on", False)  # as within cpu_native.layer_stack_disabled()
    fused, ops = PagedRunner(fused_model, seed=3), PagedRunner(ops_model, seed=3)
    taken = []  # layers run fused, per native call
    for name in ("llama_decode_layer", "llama_decode_layers"):
        real = getattr(cpu_native, name)

        def spy(*a, _r=real, _n=name):
            taken.append(len(a[1]) if _n == "llama_decode_layers" else 1)
            return _r(*a)

        monkeypatch.setattr(cpu_native, name, spy)

    def op_by_op(batch):
        with cpu_native.fused_layers_disabled():
            return ops.step(batch)

    prefill = list(enumerate(PROMPTS))
    assert torch.equal(fused.step(prefill), op_by_op(prefill))
    assert not taken  # prefill rows keep the op-by-op path
    steps = [[(0, [5]), (1, [9]), (2, [11])], [(1, [30])], [(2, [7]), (0, [60])], [(0, [2]), (1, [3]), (2, [4])]]
    for _ in range(3):  # past page boundaries (page size 4) and the window (8)
        for batch in steps:
            a, b = fused.step(batch), op_by_op(batch)
            assert torch.equal(a, b)
    n_layers = len(fused_model.model.layers)
    assert sum(taken) == n_layers * len(steps) * 3  # every decode step of every layer
    assert set(taken) == ({n_layers} if stack else {1})  # in one call a step, or one a layer
    for (ka, va), (kb, vb) in zip(fused.kv_caches, ops.kv_caches):
        assert torch.equal(ka, kb) and torch.equal(va, vb)
    if a8:  # the 8-bit path ran: the next step without it differs (w8a16 here: rows of 80 / 136, bf16 kept)
        with_a8 = fused.step(steps[0])
        cpu_native.set_int8_activations(False)
        assert torch.equal(with_a8, op_by_op(steps[0])) == (scheme == "w8a16")


def test_the_stack_table_is_kept_until_the_model_changes(tmp_path, monkeypatch):
    """Steps after the first skip the layers' checks while nothing changed; a weight's storage swapped through
    ``.data`` (which registers nothing) or a module assigned anywhere makes the next step check again, and the fused
    stack runs the new weights: the same output as the op-by-op path of a model changed alike."""
    from infercore.models.llama import LlamaDecoderLayer

    fused_model, ops_model = _models("llama", torch.bfloat16, tmp_path)
    fused, ops = PagedRunner(fused_model, seed=1), PagedRunner(ops_model, seed=1)

    def both(batch):
        with cpu_native.fused_layers_disabled():
            b = ops.step(batch)
        a = fused.step(batch)
        assert torch.equal(a, b)

    both([(0, [1, 2, 3])])
    both([(0, [4])])
    checks = []
    real = LlamaDecoderLayer._native_linears
    monkeypatch.setattr(LlamaDecoderLayer, "_native_linears", lambda self, *a: checks.append(1) or real(self, *a))
    both([(0, [5])])
    assert not checks
    for m in (fused_model, ops_model):
        norm = m.model.layers[0].post_attention_layernorm
        norm.weight.data = norm.weight.data * 2  # new storage, no registration
    both([(0, [6])])
    assert len(checks) == len(fused_model.model.layers)
    both([(0, [7])])
    n_layers = len(fused_model.model.layers)
    assert len(checks) == n_layers  # kept again
    torch.nn.Linear(2, 2)  # a registration anywhere in the process: the layers are checked once more, then kept
    both([(0, [8])])
    both([(0, [9])])
    assert len(checks) == 2 * n_layers
    for m in (fused_model, ops_model):
        mlp = m.model.layers[1].mlp
        old = mlp.down_proj
        down = type(old)(old.in_features, old.out_features, bias=False, dtype=old.weight.dtype)
        with torch.no_grad():
            down.weight.copy_(old.weight * -0.5)
        mlp.down_proj = down
    both([(0, [10])])
    assert len(checks) >= 3 * n_layers


def test_which_layers_and_steps_take_it(tmp_path, monkeypatch):
    model, _ = _models("llama", torch.bfloat16, tmp_path)
    runner = PagedRunner(model, seed=1)
    runner.step([(0, [1, 2, 3])])
    calls = []
    for name in ("llama_decode_layer", "llama_decode_layers"):
        real = getattr(cpu_native, name)
        monkeypatch.setattr(cpu_native, name, lambda *a, _r=real, _n=name, **kw: calls.append(_n) or _r(*a, **kw))
    runner.step([(0, [4])])
    assert calls == ["llama_decode_layers"]  # both layers in one call
    with cpu_native.layer_ops_disabled():  # the A/B switch turns it off with the other layer ops
        runner.step([(0, [5])])
    with cpu_native.fused_layers_disabled():  # and its own switch alone
        runner.step([(0, [5])])
    with cpu_native.layer_stack_disabled():  # one call per layer
        runner.step([(0, [5])])
    assert calls == ["llama_decode_layers", "llama_decode_layer", "llama_decode_layer"]
    del calls[1:]
    monkeypatch.setenv("INFERCORE_BACKEND", "paged_attention_decode:reference")  # a backend override is honoured
    runner.step([(0, [6])])
    monkeypatch.delenv("INFERCORE_BACKEND")
    assert len(calls) == 1
    runner.step([(0, [7]), (1, [1, 2])])  # a mixed step (a prefill row) is not decode
    assert len(calls) == 1
    batch = [(i + 10, [1, 2]) for i in range(5)]
    runner.step(batch)
    runner.step([(i + 10, [3]) for i in range(5)])  # more rows than the native GEMVs take
    assert len(calls) == 1
    runner.step([(0, [8])])
    assert calls == ["llama_decode_layers"] * 2
    # a layer the fused step cannot take (a linear with a bias) leaves the stack: the other one runs fused alone
    down = model.model.layers[1].mlp.down_proj
    down.bias = torch.nn.Parameter(torch.zeros(down.out_features, dtype=torch.bfloat16), requires_grad=False)
    runner.step([(0, [9])])
    assert calls[2:] == ["llama_decode_layer"]


def test_out_of_range_indices_raise_before_writing(tmp_path):
    model, _ = _models("llama", torch.float32, tmp_path)
    runner = PagedRunner(model, num_pages=8, seed=2)
    runner.step([(0, [1, 2, 3])])
    layer = model.model.layers[0]
    k_cache, v_cache = runner.kv_caches[0]
    before = k_cache.clone(), v_cache.clone()
    caches0 = [(k.clone(), v.clone()) for k, v in runner.kv_caches]
    x = torch.randn(1, 64)
    pos = torch.tensor([3])
    cos_sin = model.cos_sin_cache

    def meta(slot, seq_len, table):
        return AttentionMetadata.from_lists(query_lens=[1], seq_lens=[seq_len], block_tables=[table],
                                            slot_mapping=[slot])  # fmt: skip

    page = runner.seqs[0].pages[0]
    lin = [cpu_native.layer_linear(m, torch.float32) for m in (layer.self_attn.qkv_proj, layer.self_attn.o_proj,
                                                               layer.mlp.gate_up_proj, layer.mlp.down_proj)]

    def run(slot, seq_len, table, p=pos):
        return cpu_native.llama_decode_layer(x, None, layer, p, cos_sin, k_cache, v_cache, meta(slot, seq_len, table),
                                             lin)  # fmt: skip

    with pytest.raises(IndexError, match=r"slot_mapping\[0\] = 32 is outside the cache's 32 slots"):
        run(32, 4, [page])
    with pytest.raises(IndexError, match="needs more than the 1 pages of block_table row 0"):
        run(page * 4 + 3, 5, [page])
    with pytest.raises(IndexError, match="names a page outside the cache's 8 pages"):
        run(page * 4 + 3, 4, [9])
    with pytest.raises(IndexError, match="outside the rotary table"):
        run(page * 4 + 3, 4, [page], torch.tensor([10**6]))
    assert torch.equal(k_cache, before[0]) and torch.equal(v_cache, before[1])
    # slot -1 (a row whose K/V are not stored) is what the op-by-op path accepts too: nothing is written
    out, res = run(-1, 4, [page])
    assert torch.equal(k_cache, before[0]) and torch.equal(v_cache, before[1]) and torch.isfinite(out).all()
    with pytest.raises(IndexError, match=r"slot_mapping\[0\] = -2"):
        run(-2, 4, [page])
    # the whole stack checks every layer's indices before the first one runs
    stack = model._native_stack(x, cos_sin, runner.kv_caches, meta(page * 4 + 3, 4, [page]))
    assert stack is not None
    for bad, match in ((meta(32, 4, [page]), "slot_mapping"), (meta(page * 4 + 3, 4, [9]), "names a page outside")):
        with pytest.raises(IndexError, match=match):
            cpu_native.llama_decode_layers(x, model.model.layers, pos, cos_sin, runner.kv_caches, bad, stack)
    assert all(torch.equal(a, b) for kv, kv0 in zip(runner.kv_caches, caches0) for a, b in zip(kv, kv0))


def test_the_cached_checks_keep_no_kv_cache_alive(tmp_path):
    import gc
    import weakref

    model, _ = _models("llama", torch.bfloat16, tmp_path)
    runner = PagedRunner(model, seed=1)
    runner.step([(0, [1, 2, 3])])
    runner.step([(0, [4])])  # the fused stack: its checks are cached on the layers and the model
    refs = [weakref.ref(t) for kv in runner.kv_caches for t in kv]
    del runner
    gc.collect()
    assert all(r() is None for r in refs)  # a dropped engine's KV pool is freed


@pytest.mark.parametrize("kind,kcfg", [("llama", {}), ("mistral", {"sliding_window": 300})])
def test_fused_decode_with_key_splits_equals_the_op_by_op_path(kind, kcfg, tmp_path, monkeypatch):
    """One long sequence on few KV heads: decode attention cuts its keys into parts (``cpu_native.attention_splits``),
    in the fused layers as in the standalone op, so the two paths still agree bit for bit."""
    monkeypatch.setattr(torch, "get_num_threads", lambda: 4)
    assert cpu_native.attention_splits(1, 2, 16, 2, 700) > 1  # the tiny model: 2 KV heads of 16, groups of 2
    fused_model, ops_model = _models(kind, torch.bfloat16, tmp_path, max_position_embeddings=1024, **kcfg)
    fused, ops = PagedRunner(fused_model, num_pages=200, seed=5), PagedRunner(ops_model, num_pages=200, seed=5)
    prompt = torch.randint(2, 300, (700,), generator=torch.Generator().manual_seed(0)).tolist()

    def op_by_op(batch):
        with cpu_native.fused_layers_disabled():
            return ops.step(batch)

    assert torch.equal(fused.step([(0, prompt)]), op_by_op([(0, prompt)]))
    for tok in (5, 9, 11):
        assert torch.equal(fused.step([(0, [tok])]), op_by_op([(0, [tok])]))


def _quantized_caches_(runner, kv_dtype) -> None:
    """The runner's caches as int8 / float8_e4m3fn codes with fp32 scales (its random values quantized)."""
    from infercore.kv.cache import QuantizedKVCache
    from infercore.ops.kv_cache.quant import quantize_kv_ref

    caches = []
    for k, v in runner.kv_caches:
        (kc, ks), (vc, vs) = quantize_kv_ref(k, kv_dtype), quantize_kv_ref(v, kv_dtype)
        caches.append(QuantizedKVCache(kc, vc, ks.contiguous(), vs.contiguous()))
    runner.kv_caches = caches


@pytest.mark.parametrize("kv_dtype", [torch.int8, torch.float8_e4m3fn])
@pytest.mark.parametrize("dtype,scheme", [(torch.bfloat16, None), (torch.float32, None), (torch.bfloat16, "gguf-q4_0")])
@pytest.mark.parametrize("kind,kcfg", [("llama", {}), ("mistral", {"sliding_window": 8}), ("qwen3", {}),
                                       ("qwen2", {})])
@pytest.mark.parametrize("stack", [True, False])
def test_fused_decode_over_quantized_kv_equals_the_op_by_op_path(kv_dtype, dtype, scheme, kind, kcfg, stack, tmp_path,
                                                                  monkeypatch):
    """int8 / fp8 KV caches: the fused layers quantize the new rows in their RoPE step and read the codes in their
    attention, as the op-by-op path's native RoPE-write and decode attention do: the same logits, codes and scales."""
    fused_model, ops_model = _models(kind, dtype, tmp_path, scheme, **kcfg)
    if not stack:
        monkeypatch.setattr(cpu_native, "_layer_stack_on", False)
    fused, ops = PagedRunner(fused_model, seed=3), PagedRunner(ops_model, seed=3)
    for r in (fused, ops):
        _quantized_caches_(r, kv_dtype)
    taken = []
    for name in ("llama_decode_layer", "llama_decode_layers"):
        real = getattr(cpu_native, name)
        monkeypatch.setattr(cpu_native, name, lambda *a, _r=real, **kw: taken.append(1) or _r(*a, **kw))

    def op_by_op(batch):
        with cpu_native.fused_layers_disabled():
            return ops.step(batch)

    prefill = list(enumerate(PROMPTS))
    assert torch.equal(fused.step(prefill), op_by_op(prefill))
    steps = [[(0, [5]), (1, [9]), (2, [11])], [(1, [30])], [(2, [7]), (0, [60])]]
    for _ in range(3):
        for batch in steps:
            assert torch.equal(fused.step(batch), op_by_op(batch))
    assert len(taken) == (1 if stack else len(fused_model.model.layers)) * len(steps) * 3
    for a, b in zip(fused.kv_caches, ops.kv_caches):
        for x, y in zip((*a, a.k_scale, a.v_scale), (*b, b.k_scale, b.v_scale)):
            assert torch.equal(x.view(torch.uint8) if x.element_size() == 1 else x,
                               y.view(torch.uint8) if y.element_size() == 1 else y)
    if stack and kind == "llama" and scheme is None and dtype == torch.bfloat16:
        # the attention's scalar loops read no codes: the step goes op by op (dequantizing), no fused call
        with cpu_native.scalar_attention():
            n = len(taken)
            fused.step(steps[0])
            assert len(taken) == n
