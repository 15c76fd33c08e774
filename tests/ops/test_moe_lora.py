"""Multi-LoRA on routed experts (``moe_experts_routed(..., lora=MoELoRA)``): the Triton paths (CPU interpreter) and
the reference against a per-pair computation written out here."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import infercore.ops  # noqa: E402,F401
from infercore.devices import implementation  # noqa: E402
from infercore.ops import moe_experts_routed  # noqa: E402
from infercore.ops.moe import MoELoRA  # noqa: E402


def _case(T, E, H, I, k, S, r, dtype, seed=0, skew=False, none_rows=()):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=g).to(dtype)
    gate_up = (torch.randn(E, 2 * I, H, generator=g) * 0.3).to(dtype)
    down = (torch.randn(E, H, I, generator=g) * 0.3).to(dtype)
    logits = torch.randn(T, E, generator=g)
    if skew:
        logits[:, :2] += 10.0
    w, ids = torch.topk(torch.softmax(logits, -1), k, dim=-1)
    lora = MoELoRA(
        (torch.randn(S * E, 2 * r, H, generator=g) * 0.2).to(dtype),
        (torch.randn(S * E, 2 * I, r, generator=g) * 0.2).to(dtype),
        (torch.randn(S * E, r, I, generator=g) * 0.2).to(dtype),
        (torch.randn(S * E, H, r, generator=g) * 0.2).to(dtype),
        torch.randint(-1, S, (T,), generator=g),
    )
    for t in none_rows:
        lora.slots[t] = -1
    return x, gate_up, down, w, ids, lora


def _by_pair(x, gate_up, down, w, ids, lora, offset=0):
    """Each pair on its own, the merged weights ``W + B A`` of its (slot, expert), in fp64."""
    x, gate_up, down = x.double(), gate_up.double(), down.double()
    T, k = ids.shape
    E, two_i, _ = gate_up.shape
    I, r = two_i // 2, lora.a_down.shape[1]
    out = torch.zeros(T, x.shape[1], dtype=torch.float64)
    for t in range(T):
        s = int(lora.slots[t])
        for j in range(k):
            e = int(ids[t, j]) - offset
            if not 0 <= e < E:
                continue
            wgu, wd = gate_up[e].clone(), down[e].clone()
            if s >= 0:
                row = s * E + e
                a1, b1 = lora.a_gate_up[row].double(), lora.b_gate_up[row].double()
                wgu[:I] += b1[:I] @ a1[:r]
                wgu[I:] += b1[I:] @ a1[r:]
                wd += lora.b_down[row].double() @ lora.a_down[row].double()
            h = wgu @ x[t]
            out[t] += float(w[t, j]) * (wd @ (F.silu(h[:I]) * h[I:]))
    return out


@pytest.mark.parametrize("T,E,H,I,k,S,r,skew", [
    (5, 6, 40, 24, 2, 3, 4, False),  # ragged tiles, some experts without tokens
    (40, 4, 32, 16, 2, 2, 8, True),  # several BLOCK_M chunks per expert
    (1, 8, 16, 16, 3, 2, 4, False),  # one decode token
])  # fmt: skip
@pytest.mark.parametrize("path", ["reference", "grouped", "gemv", "grouped-sgmv", "gemv-sgmv"])
def test_moe_lora_matches_merged_weights(T, E, H, I, k, S, r, skew, path, monkeypatch):
    # "-sgmv": the pairs' LoRA through the grouped (SGMV) lora kernels instead of per-pair BGMV
    from infercore.ops.moe import triton as moe_triton

    if path.endswith("-sgmv"):
        monkeypatch.setattr(moe_triton, "LORA_GROUPED_MIN_PAIRS", 1)
        path = path[: -len("-sgmv")]

    x, gate_up, down, w, ids, lora = _case(T, E, H, I, k, S, r, torch.float32, skew=skew, none_rows=(0,))
    want = _by_pair(x, gate_up, down, w, ids, lora).float()
    if path == "reference":
        fn = implementation("moe_experts_routed", "reference")
    elif path == "gemv":
        fn = moe_triton.moe_experts_gemv
    else:
        monkeypatch.setattr(moe_triton, "GEMV_MAX_PAIRS", 0)
        fn = moe_triton.moe_experts_triton
    got = fn(x, gate_up, down, w, ids, None, lora=lora)
    torch.testing.assert_close(got, want, atol=3e-4, rtol=3e-4)
    # no token with an adapter: the base experts exactly as without LoRA
    none = MoELoRA(lora.a_gate_up, lora.b_gate_up, lora.a_down, lora.b_down, torch.full((T,), -1))
    base = implementation("moe_experts_routed", "reference")(x, gate_up, down, w, ids)
    torch.testing.assert_close(fn(x, gate_up, down, w, ids, None, lora=none), base, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("path", ["reference", "grouped", "mblock", "gemv"])
def test_moe_lora_expert_offset(path, monkeypatch):
    """Expert parallelism: this holder's experts [2, 5) of 8, pairs routed elsewhere skipped, adapters by local
    expert."""
    from infercore.ops.moe import triton as moe_triton

    x, gate_up, down, w, ids, lora = _case(6, 8, 24, 16, 2, 2, 4, torch.float32, seed=3)
    held = slice(2, 5)
    sub = MoELoRA(*(t.view(2, 8, *t.shape[1:])[:, held].reshape(-1, *t.shape[1:])
                    for t in (lora.a_gate_up, lora.b_gate_up, lora.a_down, lora.b_down)), lora.slots)
    want = _by_pair(x, gate_up[held], down[held], w, ids, sub, offset=2).float()
    if path in ("grouped", "mblock"):  # mblock: a program per block of an expert's rows (the prefill form)
        monkeypatch.setattr(moe_triton, "GEMV_MAX_PAIRS", 0)
        monkeypatch.setattr(moe_triton, "MBLOCK_MIN_ROWS", 0 if path == "mblock" else 10**9)
    fn = {"reference": implementation("moe_experts_routed", "reference"), "gemv": moe_triton.moe_experts_gemv,
          "grouped": moe_triton.moe_experts_triton, "mblock": moe_triton.moe_experts_triton}[path]
    got = fn(x, gate_up[held].contiguous(), down[held].contiguous(), w, ids, 2, lora=sub)
    torch.testing.assert_close(got, want, atol=3e-4, rtol=3e-4)


def test_moe_lora_bf16_gemv_close_to_reference():
    x, gate_up, down, w, ids, lora = _case(3, 8, 32, 16, 2, 2, 4, torch.bfloat16, seed=5)
    from infercore.ops.moe import triton as moe_triton

    want = _by_pair(x, gate_up, down, w, ids, lora).float()
    got = moe_triton.moe_experts_gemv(x, gate_up, down, w.to(torch.bfloat16), ids, lora=lora)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want, atol=5e-2, rtol=3e-2)


def test_moe_lora_bad_operands():
    x, gate_up, down, w, ids, lora = _case(3, 4, 16, 8, 2, 2, 4, torch.float32)
    with pytest.raises(TypeError, match="lora"):
        moe_experts_routed(x, gate_up, down, w, ids, lora=(1, 2))
    bad = MoELoRA(lora.a_gate_up[:, :5], lora.b_gate_up, lora.a_down, lora.b_down, lora.slots)
    with pytest.raises(ValueError, match="lora.a_gate_up"):
        moe_experts_routed(x, gate_up, down, w, ids, lora=bad)
    bad = MoELoRA(lora.a_gate_up, lora.b_gate_up, lora.a_down, lora.b_down, lora.slots[:2])
    with pytest.raises(ValueError, match="lora.slots"):
        moe_experts_routed(x, gate_up, down, w, ids, lora=bad)
    bad = MoELoRA(lora.a_gate_up[:7], lora.b_gate_up[:7], lora.a_down[:7], lora.b_down[:7], lora.slots)
    with pytest.raises(ValueError, match="S \\* E"):
        moe_experts_routed(x, gate_up, down, w, ids, lora=bad)
    bad = MoELoRA(lora.a_gate_up, lora.b_gate_up, lora.a_down, lora.b_down, lora.slots.float())
    with pytest.raises(TypeError, match="lora.slots"):
        moe_experts_routed(x, gate_up, down, w, ids, lora=bad)
    for live in (torch.ones(3, dtype=torch.int32), torch.ones(2, dtype=torch.int64)):
        bad = MoELoRA(lora.a_gate_up, lora.b_gate_up, lora.a_down, lora.b_down, lora.slots, live)
        with pytest.raises(ValueError, match="lora.live"):
            moe_experts_routed(x, gate_up, down, w, ids, lora=bad)


@pytest.mark.parametrize("path", ["grouped", "gemv", "gemv-sgmv"])
def test_moe_lora_live_flags_skip_slots(path, monkeypatch):
    # MoELoRA.live: the GPU kernels skip the pairs of a slot flagged 0 (its rows are zeros in a real manager, so the
    # result is unchanged; here they are not, to show the pairs really are skipped), the others' pairs as before.
    from infercore.ops.moe import triton as moe_triton

    if path == "grouped":
        monkeypatch.setattr(moe_triton, "GEMV_MAX_PAIRS", 0)
    if path.endswith("-sgmv"):
        monkeypatch.setattr(moe_triton, "LORA_GROUPED_MIN_PAIRS", 1)
    fn = moe_triton.moe_experts_triton if path == "grouped" else moe_triton.moe_experts_gemv
    x, gate_up, down, w, ids, lora = _case(9, 6, 32, 16, 2, 3, 4, torch.float32, seed=7)
    lora.slots[:3] = torch.tensor([0, 1, 2])
    live = torch.tensor([1, 0, 1], dtype=torch.int32)
    flagged = MoELoRA(lora.a_gate_up, lora.b_gate_up, lora.a_down, lora.b_down, lora.slots, live)
    without = MoELoRA(lora.a_gate_up, lora.b_gate_up, lora.a_down, lora.b_down,
                      torch.where(lora.slots == 1, -1, lora.slots))  # fmt: skip
    want = _by_pair(x, gate_up, down, w, ids, without).float()
    torch.testing.assert_close(fn(x, gate_up, down, w, ids, None, lora=flagged), want, atol=3e-4, rtol=3e-4)
