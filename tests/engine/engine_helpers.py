import contextlib
import json
import random
import zlib

import torch

from infercore.models import ModelConfig, build_model


def tiny_hf(kind: str = "llama", **overrides):
    """A tiny random transformers model (the reference) and its config dict."""
    import transformers

    base = dict(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                rms_norm_eps=1e-6, tie_word_embeddings=False)
    base.update(overrides)
    if kind == "llama":
        cfg = transformers.LlamaConfig(**base)
        cls = transformers.LlamaForCausalLM
    elif kind == "qwen3":
        cfg = transformers.Qwen3Config(**base, head_dim=8)
        cls = transformers.Qwen3ForCausalLM
    elif kind == "mistral":
        cfg = transformers.MistralConfig(**base, sliding_window=6)
        cls = transformers.MistralForCausalLM
    else:
        raise ValueError(kind)
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    model = cls(cfg).eval()
    # Spread logits so greedy choices are far from ties.
    with torch.no_grad():
        model.lm_head.weight.mul_(4.0)
    return model


def random_prompts(n: int, seed: int, lo: int = 3, hi: int = 30, vocab: int = 96) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def ours_from_hf(hf_model):
    cfg = ModelConfig.from_hf(hf_model.config.to_dict())
    model = build_model(cfg, dtype=torch.float32, device=torch.device("cpu"))
    model.load_weights(hf_model.state_dict().items())
    return model


@torch.inference_mode()
def hf_greedy(hf_model, prompt: list[int], n: int) -> list[int]:
    ids = torch.tensor([prompt])
    out = hf_model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                            do_sample=False, pad_token_id=0, eos_token_id=None)
    return out[0, len(prompt):].tolist()


class EagerGraph:
    """Stands in for a captured graph on the CPU: replays the graph's forward eagerly into the
    static output buffers, so a CUDA-graph runner's staging, padding and gather run for real."""

    def __init__(self, gr, b):
        self.gr, self.b = gr, b

    def replay(self):
        logits, tokens = self.gr._forward(self.b)
        self.gr.logits[self.b].copy_(logits)
        if tokens is not None:
            self.gr.tokens[self.b].copy_(tokens)


def with_fake_graphs(eng, cls, *, max_batch, buckets, **kw):
    """Give ``eng`` a graph runner of class ``cls`` whose graphs are :class:`EagerGraph` stand-ins."""
    from infercore.engine.graph_runner import _TOPP

    gr = cls(eng.runner, max_batch=max_batch, max_model_len=eng.max_model_len, page_size=eng.config.page_size,
             buckets=buckets, **kw)  # fmt: skip
    gr._row(gr.floats, _TOPP, gr.B).fill_(1.0)  # top_p of padded rows, as capture() does
    vocab = eng.runner.model.config.vocab_size
    for b in gr.buckets:
        gr.logits[b] = torch.zeros(b, vocab)
        gr.tokens[b] = torch.zeros(b, dtype=torch.long) if gr.graph_samples else None
        gr.graphs[b] = EagerGraph(gr, b)
    eng.graph_runner = gr
    return gr


LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


def _rtn(w: torch.Tensor, bits: int, group: int):
    """Asymmetric round-to-nearest per group along K: codes int64 [N, K], scales [N, K/g], zeros int64 [N, K/g]."""
    n, k = w.shape
    g = w.float().reshape(n, k // group, group)
    lo, hi = g.amin(-1).clamp(max=0), g.amax(-1).clamp(min=0)
    qmax = 2**bits - 1
    scale = ((hi - lo) / qmax).clamp(min=1e-8)
    zero = torch.round(-lo / scale).clamp(1, qmax)  # >= 1: a v1 checkpoint cannot store a zero of 0
    q = torch.clamp(torch.round(g / scale[..., None]) + zero[..., None], 0, qmax)
    scale16 = scale.half()
    deq = ((q - zero[..., None]) * scale16.float()[..., None]).reshape(n, k)
    return q.reshape(n, k).long(), scale16, zero.long(), deq


def _words(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack int64 codes [..., W * 32/bits] along the last dim, code j of a word at bits*j, into int32."""
    pack = 32 // bits
    c = codes.reshape(*codes.shape[:-1], -1, pack)
    acc = torch.zeros(c.shape[:-1], dtype=torch.int64)
    for j in range(pack):
        acc |= c[..., j] << (bits * j)
    return (acc - (acc >= 2**31).long() * 2**32).to(torch.int32)


def _gptq(q, scale, zero, bits, group, v2, g_idx=None):
    n, k = q.shape
    return {"qweight": _words(q.t().contiguous().reshape(k // (32 // bits), 32 // bits, n).transpose(1, 2), bits)
            .reshape(k // (32 // bits), n),
            "qzeros": _words((zero if v2 else zero - 1).t().contiguous(), bits),
            "scales": scale.t().contiguous(),
            "g_idx": torch.arange(k, dtype=torch.int32) // group if g_idx is None else g_idx}


def _awq(q, scale, zero):
    def pack(c):  # [R, N] -> [R, N/8]: nibble j of word c holds column 8c + AWQ_ORDER[j]
        r, n = c.shape
        return _words(c.reshape(r, n // 8, 8)[..., list(AWQ_ORDER)].reshape(r, n), 4)

    return {"qweight": pack(q.t().contiguous()), "qzeros": pack(zero.t().contiguous()),
            "scales": scale.t().contiguous()}


def write_prequantized(tmp_path, method, bits=4, group=16, v2=False, skip=(), extra_cfg=None, group_cfg=None,
                       act_order=False, **hf_overrides):
    """A tiny Llama GPTQ / AWQ checkpoint directory with its decoder linears quantized (``skip``: left dense),
    packed by this file's own code from the formats' descriptions (AutoGPTQ's ``pack``: codes along K, zeros
    stored minus one in v1; AutoAWQ's GEMM packing: along N in the order 0 2 4 6 1 3 5 7), not by
    ``infercore.quant.packing``. Returns the dir and the transformers model holding the dequantized weights
    ``(q - z) * s``.

    ``act_order`` (GPTQ): each layer input gets a random channel order (shared by the projections that read the
    same input, as GPTQ's Hessian order is), the groups are consecutive channels in that order, and ``g_idx``
    gives each original channel's group. ``act_order="split"`` gives k_proj an order of its own."""
    from safetensors.torch import save_file

    hf = tiny_hf("llama", **hf_overrides)
    state = {k: v.contiguous() for k, v in hf.state_dict().items()}
    for name in list(state):
        base, _, leaf = name.rpartition(".")
        if leaf != "weight" or base.rpartition(".")[2] not in LINEARS or base.rpartition(".")[2] in skip:
            continue
        w = state.pop(name)
        g = w.shape[1] if group == -1 else group
        proj = base.rpartition(".")[2]
        g_idx = None
        if act_order:
            shared = {"k_proj": "q_proj" if act_order != "split" else "k_proj", "v_proj": "q_proj",
                      "up_proj": "gate_proj"}
            key = base.rpartition(".")[0] + "." + shared.get(proj, proj)
            order = torch.randperm(w.shape[1], generator=torch.Generator().manual_seed(zlib.crc32(key.encode())))
            q, scale, zero, deq = _rtn(w[:, order], bits, g)  # groups: consecutive channels of the order
            back = torch.argsort(order)
            q, deq = q[:, back], deq[:, back]
            g_idx = (torch.argsort(order) // g).to(torch.int32)  # original channel k is at position back[k]
        else:
            q, scale, zero, deq = _rtn(w, bits, g)
        parts = _awq(q, scale, zero) if method == "awq" else _gptq(q, scale, zero, bits, g, v2, g_idx)
        state.update({f"{base}.{k}": v for k, v in parts.items()})
        hf.get_submodule(base).weight.data.copy_(deq)
    save_file(state, str(tmp_path / "model.safetensors"))
    cfg = hf.config.to_dict()
    qc = {"quant_method": method, "bits": bits, "group_size": group if group_cfg is None else group_cfg}
    gptq = {"desc_act": bool(act_order), "sym": False, "checkpoint_format": "gptq_v2" if v2 else "gptq"}
    qc.update(gptq if method == "gptq" else {"zero_point": True, "version": "gemm"})
    qc.update(extra_cfg or {})
    cfg["quantization_config"] = qc
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    return tmp_path, hf


def _ref_top5(ref, prompt: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' ``ref``: the 5 largest next-token log-probabilities after ``prompt`` and their token ids."""
    with torch.inference_mode():
        return ref(torch.tensor([prompt])).logits[0, -1].float().log_softmax(-1).topk(5)


def check_greedy_and_first_logprobs(eng, ref, prompts: list[list[int]], n: int, *, abs_tol: float = 1e-3) -> None:
    """The engine's greedy ``n`` tokens of each prompt equal transformers' ``ref``'s, and its first step's
    log-probabilities of ``ref``'s 5 most likely tokens equal ``ref``'s within ``abs_tol``."""
    import pytest

    from infercore import SamplingParams

    outs = eng.generate(prompts, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, logprobs=10))
    for p, o in zip(prompts, outs):
        assert o.token_ids == hf_greedy(ref, p, n)
        top_v, top_i = _ref_top5(ref, p)
        for t, v in zip(top_i.tolist(), top_v.tolist()):
            assert o.logprobs[0][t] == pytest.approx(v, abs=abs_tol)


def check_prequantized_on_cuda(path, ref, n_quant: int = 8) -> None:
    """A pre-quantized directory on CUDA (bf16, CUDA graphs): ``n_quant`` QuantLinears; the log-probabilities of
    each prompt's first generated token equal transformers' ``ref`` (the dequantized weights, fp32, CPU) within
    bf16 error, and the first token is ``ref``'s greedy choice where that is not a near tie."""
    import pytest

    from infercore import Engine, SamplingParams
    from infercore.quant import QuantLinear

    eng = Engine.from_pretrained(str(path), device="cuda", page_size=16, num_pages=64, max_num_batched_tokens=64)
    assert eng.dtype == torch.bfloat16 and eng.graph_runner is not None and eng.graph_runner.graphs
    assert sum(isinstance(m, QuantLinear) for m in eng.model.modules()) == n_quant
    prompts = [[(5 * i + 3 * j + 1) % 96 for j in range(8)] for i in range(3)]
    # the engine's 10 most likely tokens, so a 5th / 6th-rank near tie between the two models cannot hide one
    outs = eng.generate(prompts, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=10))
    for p, o in zip(prompts, outs):
        top_v, top_i = _ref_top5(ref, p)
        got = o.logprobs[0]
        if top_v[0] - top_v[1] > 0.2:
            assert o.token_ids[0] == int(top_i[0])
        for t, v in zip(top_i.tolist(), top_v.tolist()):
            assert got[t] == pytest.approx(v, abs=0.1)


def adopt_and_finish(eng, taken, ids: list[str]) -> list[list[int]]:
    """``eng`` adopts the requests ``taken`` (``Engine.take_requests`` of another engine) and runs them to the end;
    the finished requests' tokens in the order of ``ids``."""
    for req in taken:
        eng.adopt_request(req)
    got = {}
    while eng.has_unfinished():
        got.update({o.request_id: o.token_ids for o in eng.step() if o.finished})
    return [got[i] for i in ids]


def post(server, path: str, body, *, raw: bool = False):
    """POST ``body`` as JSON to a running server; ``(status, decoded JSON)``, or the raw bytes with ``raw``."""
    import http.client

    conn = http.client.HTTPConnection(*server.server_address[:2], timeout=120)
    conn.request("POST", path, body=json.dumps(body), headers={"Content-Type": "application/json"})
    resp = conn.getresponse()
    data = resp.read()
    conn.close()
    return resp.status, (data if raw else json.loads(data))


def sse_events(data: bytes) -> list:
    """A server-sent stream's JSON chunks (its closing ``[DONE]`` checked and dropped)."""
    chunks = [c[len(b"data: "):] for c in data.split(b"\n\n") if c.startswith(b"data: ")]
    assert chunks[-1] == b"[DONE]"
    return [json.loads(c) for c in chunks[:-1]]


@contextlib.contextmanager
def serving(engine, model_name: str = "tiny"):
    """Serve ``engine`` over HTTP on a free port for the block; yields ``call(method, path, body=None)`` ->
    ``(status, decoded JSON)``. The server is shut down and its engine loop closed afterwards."""
    import http.client
    import threading

    from infercore.serve import make_server

    server = make_server(engine, port=0, model_name=model_name)
    threading.Thread(target=server.serve_forever, daemon=True).start()

    def call(method: str, path: str, body=None):
        conn = http.client.HTTPConnection(*server.server_address[:2], timeout=60)
        conn.request(method, path, body=None if body is None else json.dumps(body),
                     headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        out = resp.status, json.loads(resp.read())
        conn.close()
        return out

    try:
        yield call
    finally:
        server.shutdown()
        server.server_close()
        server.loop.close()
