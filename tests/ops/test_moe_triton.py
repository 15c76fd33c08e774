"""Triton routed MoE experts against the reference (CPU interpreter, tiny shapes)."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

import infercore.ops  # noqa: E402,F401
from infercore.devices import implementation  # noqa: E402
from infercore.ops import moe_experts_routed  # noqa: E402


def _case(T, E, H, I, k, dtype, seed=0, skew=False):
    torch.manual_seed(seed)
    x = torch.randn(T, H).to(dtype)
    gate_up = (torch.randn(E, 2 * I, H) * 0.3).to(dtype)
    down = (torch.randn(E, H, I) * 0.3).to(dtype)
    logits = torch.randn(T, E)
    if skew:  # most tokens pick experts 0 and 1: more rows per expert than one BLOCK_M chunk
        logits[:, :2] += 10.0
    w, ids = torch.topk(torch.softmax(logits, -1), k, dim=-1)
    return x, gate_up, down, w, ids


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 2e-5), (torch.float16, 3e-3)])
@pytest.mark.parametrize("T,E,H,I,k,skew", [
    (5, 6, 40, 24, 2, False),  # H, I not multiples of the tiles; some experts get no token
    (40, 4, 32, 16, 2, True),  # 40 tokens on experts 0/1: several BLOCK_M chunks per expert
    (1, 8, 16, 16, 3, False),  # one decode token
])  # fmt: skip
@pytest.mark.parametrize("path", ["dispatch", "grouped", "mblock", "gemv"])
def test_routed_matches_reference(dtype, tol, T, E, H, I, k, skew, path, monkeypatch):
    """The op as dispatched, and each path of it: the grouped kernels over the sorted pairs (each program walking its
    expert's rows, or one block of them: the prefill form), the decode-size GEMVs."""
    from infercore.ops.moe import triton as moe_triton

    x, gate_up, down, w, ids = _case(T, E, H, I, k, dtype, skew=skew)
    want = implementation("moe_experts_routed", "reference")(x.float(), gate_up.float(), down.float(), w, ids)
    _pick_path(monkeypatch, path)
    fn = moe_triton.moe_experts_gemv if path == "gemv" else implementation("moe_experts_routed", "triton")
    got = fn(x, gate_up, down, w.to(dtype), ids)
    assert got.dtype == dtype and got.shape == (T, H)
    torch.testing.assert_close(got.float(), want, atol=tol, rtol=tol)
    got32 = fn(x, gate_up, down, w, ids.to(torch.int32))
    torch.testing.assert_close(got32.float(), want, atol=tol, rtol=tol)


def _pick_path(monkeypatch, path):
    """Route the Triton op to one path: "grouped" (a program per expert and tile), "mblock" (a program per block of
    an expert's rows and tile), "gemv" or the dispatcher's choice for anything else."""
    from infercore.ops.moe import triton as moe_triton

    if path in ("grouped", "mblock"):
        monkeypatch.setattr(moe_triton, "GEMV_MAX_PAIRS", 0)
        monkeypatch.setattr(moe_triton, "MBLOCK_MIN_ROWS", 0 if path == "mblock" else 10**9)
    elif path == "gemv":
        monkeypatch.setattr(moe_triton, "GEMV_MAX_PAIRS", 10**6)


def test_mblock_blocks_cover_every_row(monkeypatch):
    """The row-block form with many experts of uneven loads (several blocks for the crowded ones, none for the idle,
    more experts than one power of two), and with expert parallelism: every pair is computed once."""
    _pick_path(monkeypatch, "mblock")
    x, gate_up, down, w, ids = _case(37, 20, 24, 16, 3, torch.float32, seed=3, skew=True)
    want = implementation("moe_experts_routed", "reference")(x, gate_up, down, w, ids)
    fn = implementation("moe_experts_routed", "triton")
    torch.testing.assert_close(fn(x, gate_up, down, w, ids), want, atol=2e-5, rtol=2e-5)
    halves = [fn(x, gate_up[lo:lo + 10], down[lo:lo + 10], w, ids, lo) for lo in (0, 10)]
    torch.testing.assert_close(halves[0] + halves[1], want, atol=2e-5, rtol=2e-5)


def test_gemv_path_rule():
    """Few pairs against many experts take the GEMV path; as many pairs as half the experts, or more than
    GEMV_MAX_PAIRS, the grouped one."""
    from infercore.ops.moe.triton import GEMV_MAX_PAIRS, use_gemv

    assert use_gemv(1, 8, 128) and use_gemv(8, 8, 128) and use_gemv(1, 2, 8) and use_gemv(2, 2, 8)
    assert not use_gemv(4, 2, 8) and not use_gemv(0, 8, 128) and not use_gemv(GEMV_MAX_PAIRS + 1, 1, 10**6)


def test_routed_no_tokens():
    x, gate_up, down, w, ids = _case(0, 4, 16, 16, 2, torch.float32)
    assert implementation("moe_experts_routed", "triton")(x, gate_up, down, w, ids).shape == (0, 16)


def test_routed_bad_arguments_name_them():
    x, gate_up, down, w, ids = _case(3, 4, 16, 8, 2, torch.float32)
    with pytest.raises(ValueError, match="gate_up"):
        moe_experts_routed(x, gate_up[:, :5], down, w, ids)
    with pytest.raises(ValueError, match="ids"):
        moe_experts_routed(x, gate_up, down, w, ids[:, :1])
    with pytest.raises(TypeError, match="ids"):
        moe_experts_routed(x, gate_up, down, w, ids.float())
    with pytest.raises(TypeError, match="gate_up"):
        moe_experts_routed(x, gate_up.half(), down, w, ids)
    with pytest.raises(TypeError, match="x"):
        moe_experts_routed(x.numpy(), gate_up, down, w, ids)
    with pytest.raises(TypeError, match="x"):
        moe_experts_routed(x.int(), gate_up.int(), down.int(), w, ids)
    with pytest.raises(TypeError, match="weights"):
        moe_experts_routed(x, gate_up, down, w.int(), ids)


@pytest.mark.parametrize("path", ["grouped", "mblock", "gemv"])
@pytest.mark.parametrize("ids_dtype", [torch.int64, torch.int32])
def test_expert_offset_skips_the_experts_held_elsewhere(path, ids_dtype, monkeypatch):
    """Expert parallelism: two holders of half the experts each (global ids, expert_offset) sum to the whole
    result, in every Triton path and the reference; the reference refuses an id out of range without an offset."""
    from infercore.ops.moe import triton as moe_triton

    _pick_path(monkeypatch, path)
    x, gate_up, down, w, ids = _case(6, 8, 40, 24, 3, torch.float32)
    ids = ids.to(ids_dtype)
    ref = implementation("moe_experts_routed", "reference")
    want = ref(x, gate_up, down, w, ids)
    fn = moe_triton.moe_experts_gemv if path == "gemv" else implementation("moe_experts_routed", "triton")
    halves = [fn(x, gate_up[lo:lo + 4], down[lo:lo + 4], w, ids, lo) for lo in (0, 4)]
    torch.testing.assert_close(halves[0] + halves[1], want, atol=2e-5, rtol=2e-5)
    assert (halves[0] - want).abs().max() > 1e-2  # each half alone is only a share
    refs = [ref(x, gate_up[lo:lo + 4], down[lo:lo + 4], w, ids, lo) for lo in (0, 4)]
    torch.testing.assert_close(refs[0] + refs[1], want, atol=2e-5, rtol=2e-5)
    with pytest.raises(ValueError, match="outside"):
        ref(x, gate_up[:4], down[:4], w, ids)
    with pytest.raises(ValueError, match="expert_offset"):
        moe_experts_routed(x, gate_up, down, w, ids, expert_offset=-1)


def _relu2_want(x, up, down, w, ids):
    """``sum_k w[t, k] relu(x[t] @ up[e]^T) ** 2 @ down[e]^T`` written here, pair by pair in fp32."""
    out = torch.zeros(x.shape[0], down.shape[1])
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            h = torch.relu(x[t].float() @ up[e].float().t()).square()
            out[t] += w[t, j].float() * (h @ down[e].float().t())
    return out


# fp16: the squared intermediate is stored in fp16 between the two kernels (the plain computation keeps fp32)
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 2e-5), (torch.float16, 1e-2)])
@pytest.mark.parametrize("T,skew", [(5, False), (40, True), (1, False)])
@pytest.mark.parametrize("path", ["dispatch", "grouped", "mblock", "gemv", "reference"])
def test_relu2_experts_match_a_plain_computation(dtype, tol, T, skew, path, monkeypatch):
    """``activation="relu2"`` (Nemotron-H): ungated squared-ReLU experts, ``gate_up`` the up rows ``[E, I, H]``, in
    every path (grouped kernels, GEMVs, the reference, the public op) and with expert parallelism."""
    from infercore.ops.moe import triton as moe_triton

    x, gate_up, down, w, ids = _case(T, 6, 40, 24, 2, dtype, skew=skew)
    up = gate_up[:, :24].contiguous()  # [E, I, H]
    want = _relu2_want(x, up, down, w, ids)
    _pick_path(monkeypatch, path)
    fn = {"gemv": moe_triton.moe_experts_gemv, "reference": implementation("moe_experts_routed", "reference"),
          "dispatch": moe_experts_routed}.get(path) or implementation("moe_experts_routed", "triton")  # fmt: skip
    got = fn(x, up, down, w.to(dtype), ids, activation="relu2")
    assert got.dtype == dtype and got.shape == (T, 40)
    if path in ("dispatch", "reference") and dtype == torch.float16:
        tol = 2e-2  # on the CPU these are the reference, whose products round to fp16 too
    torch.testing.assert_close(got.float(), want, atol=tol, rtol=tol)
    if path in ("grouped", "mblock", "gemv"):  # two holders of three experts each sum to the whole
        halves = [fn(x, up[lo : lo + 3], down[lo : lo + 3], w.to(dtype), ids, lo, activation="relu2") for lo in (0, 3)]
        torch.testing.assert_close((halves[0].float() + halves[1].float()), want, atol=2 * tol, rtol=2 * tol)


def test_relu2_bad_arguments_name_them():
    x, gate_up, down, w, ids = _case(3, 4, 16, 8, 2, torch.float32)
    with pytest.raises(ValueError, match=r"\[E, I, H\] and \[E, H, I\] \(ungated relu2\)"):
        moe_experts_routed(x, gate_up, down, w, ids, activation="relu2")  # [E, 2I, H]: the gated layout
    with pytest.raises(ValueError, match="activation must be one of"):
        moe_experts_routed(x, gate_up, down, w, ids, activation="gelu")


@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 4, 64, 600])
def test_relu2_experts_gpu_bf16(T):
    """The relu2 kernels in bf16 at a Nemotron-3-like width on CUDA (GEMV path at decode sizes, grouped beyond),
    against the pair-by-pair fp32 computation, eager and in a CUDA graph."""
    x, gate_up, down, w, ids = _case(T, 64, 1024, 512, 6, torch.float32, seed=3)
    up = gate_up[:, :512].contiguous()
    want = _relu2_want(x, up, down, w, ids)
    args = [t.cuda() for t in (x.bfloat16(), up.bfloat16(), down.bfloat16(), w, ids)]
    got = moe_experts_routed(*args, activation="relu2")
    torch.testing.assert_close(got.float().cpu(), want, atol=3e-2 * want.abs().max().item(), rtol=3e-2)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = moe_experts_routed(*args, activation="relu2")
    graph.replay()
    torch.testing.assert_close(out, got)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("path", ["grouped", "mblock"])
@pytest.mark.parametrize("T", [300, 2500])
def test_routed_gpu_prefill_sizes(T, path, dtype, monkeypatch):
    """Prefill sizes on CUDA (tens to hundreds of rows per expert, uneven), bf16 and fp32 (whose row-block tiles
    take half the K width): both grouped forms against the fp32 reference, eager and replayed in a CUDA graph (the
    row-block grid depends on the shapes alone)."""
    _pick_path(monkeypatch, path)
    x, gate_up, down, w, ids = _case(T, 64, 1024, 704, 6, torch.float32, seed=4, skew=True)
    want = implementation("moe_experts_routed", "reference")(x.cuda(), gate_up.cuda(), down.cuda(), w.cuda(),
                                                            ids.cuda())  # fmt: skip
    args = [t.cuda() for t in (x.to(dtype), gate_up.to(dtype), down.to(dtype), w, ids)]
    got = moe_experts_routed(*args)
    tol = 3e-2 if dtype == torch.bfloat16 else 1e-4
    torch.testing.assert_close(got.float(), want, atol=tol * want.abs().max().item(), rtol=tol)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = moe_experts_routed(*args)
    graph.replay()
    torch.testing.assert_close(out, got)


def _quantize(w, kind):
    """int8 / fp8 codes of ``w [E, N, K]`` and fp32 scales: "int8" / "fp8" per output channel, "fp8-block" per
    16 x 16 block (ragged at the edges when N, K are not multiples of 16)."""
    from infercore.models.moe import quantize_expert_weights

    return quantize_expert_weights(w, kind, block=16)


@pytest.mark.parametrize("kind", ["int8", "fp8", "fp8-block"])
@pytest.mark.parametrize("T,skew", [(5, False), (40, True), (1, False)])
@pytest.mark.parametrize("path", ["dispatch", "grouped", "mblock", "gemv"])
def test_quantized_experts_match_the_dequantized_reference(kind, T, skew, path, monkeypatch):
    """Weight-only int8 / fp8 experts (per-channel or block scales) in every Triton path: the experts over the
    dequantized weights, as the reference computes them; also with expert parallelism and relu2."""
    from infercore.ops.moe import dequantize_experts
    from infercore.ops.moe import triton as moe_triton

    x, gate_up, down, w, ids = _case(T, 6, 40, 24, 2, torch.float32, seed=2, skew=skew)
    gq, gs = _quantize(gate_up, kind)
    dq, ds = _quantize(down, kind)
    ref = implementation("moe_experts_routed", "reference")
    want = ref(x, dequantize_experts(gq, gs, x.dtype), dequantize_experts(dq, ds, x.dtype), w, ids)
    assert (want - ref(x, gate_up, down, w, ids)).abs().max() < 0.3 * want.abs().max()  # codes near the weights
    _pick_path(monkeypatch, path)
    fn = {"gemv": moe_triton.moe_experts_gemv, "dispatch": moe_experts_routed}.get(path) or implementation(
        "moe_experts_routed", "triton")
    q = dict(gate_up_scale=gs, down_scale=ds)
    torch.testing.assert_close(fn(x, gq, dq, w, ids, **q), want, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(ref(x, gq, dq, w, ids, **q), want, atol=1e-5, rtol=1e-5)
    if path != "dispatch":  # two holders of three experts each sum to the whole
        halves = [fn(x, gq[lo:lo + 3], dq[lo:lo + 3], w, ids, lo, gate_up_scale=gs[lo:lo + 3],
                     down_scale=ds[lo:lo + 3]) for lo in (0, 3)]  # fmt: skip
        torch.testing.assert_close(halves[0] + halves[1], want, atol=2e-4, rtol=2e-4)
        up_q, up_s = gq[:, :24].contiguous(), gs[:, :24].contiguous() if kind != "fp8-block" else gs[:, :2].contiguous()
        want2 = _relu2_want(x, dequantize_experts(up_q, up_s, x.dtype), dequantize_experts(dq, ds, x.dtype), w, ids)
        got2 = fn(x, up_q, dq, w, ids, activation="relu2", gate_up_scale=up_s, down_scale=ds)
        torch.testing.assert_close(got2, want2, atol=1e-4, rtol=1e-4)


def test_quantized_experts_bad_scales_name_them():
    x, gate_up, down, w, ids = _case(3, 4, 16, 8, 2, torch.float32)
    gq, gs = _quantize(gate_up, "int8")
    dq, ds = _quantize(down, "int8")
    with pytest.raises(TypeError, match="gate_up_scale"):
        moe_experts_routed(x, gq, dq, w, ids, down_scale=ds)
    with pytest.raises(TypeError, match="down_scale"):
        moe_experts_routed(x, gq, dq, w, ids, gate_up_scale=gs, down_scale=ds.half())
    with pytest.raises(ValueError, match="gate_up_scale"):
        moe_experts_routed(x, gq, dq, w, ids, gate_up_scale=gs[:, :5], down_scale=ds)
    with pytest.raises(ValueError, match="down_scale"):
        moe_experts_routed(x, gq, dq, w, ids, gate_up_scale=gs, down_scale=torch.ones(4, 3, 7))
    with pytest.raises(ValueError, match="gate_up_scale"):
        moe_experts_routed(x, gate_up, down, w, ids, gate_up_scale=gs)
    with pytest.raises(TypeError, match="gate_up"):
        moe_experts_routed(x, gate_up.to(torch.int16), down, w, ids)


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["int8", "fp8", "fp8-block"])
@pytest.mark.parametrize("T", [1, 8, 300, 2500])
def test_quantized_experts_gpu_bf16(kind, T):
    """Weight-only int8 / fp8 experts with bf16 activations on CUDA at decode (GEMV), batch (grouped) and prefill
    (row blocks) sizes: the experts over the dequantized bf16 weights, eager and replayed in a CUDA graph."""
    from infercore.ops.moe import dequantize_experts

    x, gate_up, down, w, ids = _case(T, 64, 1024, 704, 6, torch.float32, seed=5, skew=T > 8)
    gq, gs = _quantize(gate_up, kind)
    dq, ds = _quantize(down, kind)
    args = [t.cuda() for t in (x.bfloat16(), gq, dq, w, ids)]
    q = dict(gate_up_scale=gs.cuda(), down_scale=ds.cuda())
    want = implementation("moe_experts_routed", "reference")(
        x.cuda(), dequantize_experts(gq, gs, torch.bfloat16).float().cuda(),
        dequantize_experts(dq, ds, torch.bfloat16).float().cuda(), w.cuda(), ids.cuda())  # fmt: skip
    got = moe_experts_routed(*args, **q)
    torch.testing.assert_close(got.float(), want, atol=3e-2 * want.abs().max().item(), rtol=3e-2)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = moe_experts_routed(*args, **q)
    graph.replay()
    torch.testing.assert_close(out, got)
