"""Reference for the routed expert computation of a sparse MoE layer (SiLU-gated experts, or ungated squared-ReLU
ones: ``activation="relu2"``, Nemotron-H's)."""

from __future__ import annotations

import torch

from ..activation import silu_and_mul

ACTIVATIONS = ("silu", "relu2")  # SiLU-gated (gate_up [E, 2I, H]); squared ReLU, ungated (up [E, I, H])


def expert_act(h: torch.Tensor, activation: str) -> torch.Tensor:
    """The experts' activation of the first projection's output ``h``: ``silu(gate) * up`` or ``relu(h) ** 2``."""
    return silu_and_mul(h) if activation == "silu" else torch.relu(h).square()


def check_moe_args(op: str, x, gate_up, down, weights, ids, activation: str = "silu") -> None:
    """Shapes of ``x [T, H]``, ``gate_up [E, 2I, H]`` (``[E, I, H]`` for the ungated ``relu2``), ``down [E, H, I]``,
    ``weights / ids [T, k]``."""
    for name, t in (("x", x), ("gate_up", gate_up), ("down", down), ("weights", weights), ("ids", ids)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{op}: {name} must be a torch.Tensor, got {type(t).__name__}")
    if x.ndim != 2:
        raise ValueError(f"{op}: x must be [tokens, hidden], got shape {tuple(x.shape)}")
    if gate_up.ndim != 3:
        raise ValueError(f"{op}: gate_up must be [E, 2I, H], got shape {tuple(gate_up.shape)}")
    if activation not in ACTIVATIONS:
        raise ValueError(f"{op}: activation must be one of {ACTIVATIONS}, got {activation!r}")
    gated = activation == "silu"
    E, rows, H = gate_up.shape
    if H != x.shape[1] or (gated and rows % 2) or down.shape != (E, H, rows // 2 if gated else rows):
        want = "[E, 2I, H] and [E, H, I]" if gated else "[E, I, H] and [E, H, I] (ungated relu2)"
        raise ValueError(
            f"{op}: gate_up_proj {tuple(gate_up.shape)} / down_proj {tuple(down.shape)} do not match "
            f"x {tuple(x.shape)} (expected {want})"
        )
    if weights.shape != ids.shape or weights.ndim != 2 or weights.shape[0] != x.shape[0]:
        raise ValueError(f"{op}: topk weights {tuple(weights.shape)} and ids {tuple(ids.shape)} must be [tokens, k]")
    if ids.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"{op}: ids must be int32 or int64, got {ids.dtype}")


QUANT_EXPERT_DTYPES = (torch.int8, torch.float8_e4m3fn)


def scale_blocks(shape: tuple[int, ...], scale: torch.Tensor) -> tuple[int, int]:
    """``(bn, bk)``: the block of weights ``[E, N, K]`` (``shape``) each entry of block scales
    ``[E, ceil(N / bn), ceil(K / bk)]`` covers."""
    return -(-shape[1] // scale.shape[1]), -(-shape[2] // scale.shape[2])


def dequantize_experts(w: torch.Tensor, scale: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """Stacked expert weights ``[E, N, K]`` in ``dtype``: ``w`` itself without a scale, else int8 / fp8 codes times
    their fp32 scales, per output channel (``[E, N]``) or per ``bn x bk`` block (``[E, ceil(N / bn), ceil(K / bk)]``,
    DeepSeek-V3's 128 x 128 layout among them)."""
    if scale is None:
        return w
    wf = w.float()
    if scale.ndim == 2:
        return (wf * scale.float()[..., None]).to(dtype)
    E, N, K = w.shape
    bn, bk = scale_blocks(w.shape, scale)
    s = scale.float().repeat_interleave(bn, 1)[:, :N].repeat_interleave(bk, 2)[:, :, :K]
    return (wf * s).to(dtype)


def check_expert_scales(op: str, x: torch.Tensor, name: str, w: torch.Tensor, scale) -> None:
    """``w`` in x's dtype with no scale, or int8 / float8_e4m3fn codes with fp32 scales ``[E, N]`` or
    ``[E, ceil(N / bn), ceil(K / bk)]``."""
    if w.dtype not in QUANT_EXPERT_DTYPES:
        if w.dtype != x.dtype:
            raise TypeError(f"{op}: {name} must have x's dtype {x.dtype} (or be int8 / float8_e4m3fn codes with "
                            f"{name}_scale), got {w.dtype}")  # fmt: skip
        if scale is not None:
            raise ValueError(f"{op}: {name}_scale is for int8 / float8_e4m3fn {name} only; {name} is {w.dtype}")
        return
    if not isinstance(scale, torch.Tensor):
        raise TypeError(f"{op}: {w.dtype} {name} needs {name}_scale (an fp32 tensor), got {type(scale).__name__}")
    if scale.dtype != torch.float32:
        raise TypeError(f"{op}: {name}_scale must be float32, got {scale.dtype}")
    if scale.device != w.device:
        raise ValueError(f"{op}: {name}_scale must be on {name}'s device {w.device}, got {scale.device}")
    E, N, K = w.shape
    ok = scale.ndim == 2 and tuple(scale.shape) == (E, N)
    if scale.ndim == 3 and scale.shape[0] == E and 0 < scale.shape[1] <= N and 0 < scale.shape[2] <= K:
        bn, bk = scale_blocks(w.shape, scale)
        ok = -(-N // bn) == scale.shape[1] and -(-K // bk) == scale.shape[2]
    if not ok:
        raise ValueError(f"{op}: {name}_scale must be [E, N] = [{E}, {N}] (per channel) or [E, ceil(N / bn), "
                         f"ceil(K / bk)] (blocks) for {name} {list(w.shape)}, got {list(scale.shape)}")  # fmt: skip


def moe_experts_ref(
    x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
    expert_offset: int | None = None, activation: str = "silu",
) -> torch.Tensor:
    """``sum_k weights[t, k] * expert_{ids[t, k]}(x[t])``, expert by expert (the HF loop).

    ``expert_e(v) = silu_and_mul(v @ gate_up[e]^T) @ down[e]^T`` (``relu(v @ gate_up[e]^T) ** 2 @ down[e]^T`` with
    ``activation="relu2"``); each expert's output is scaled in
    fp32 and summed in ``x.dtype``. Returns ``[T, H]`` in ``x.dtype``. With ``expert_offset`` the tensors hold
    experts ``[expert_offset, expert_offset + E)`` and pairs routed elsewhere are skipped.
    """
    out = torch.zeros_like(x)
    if expert_offset is not None:
        ids = ids - expert_offset
    for e in torch.unique(ids).tolist():
        if not 0 <= e < gate_up.shape[0]:
            if expert_offset is not None:
                continue
            raise ValueError(f"moe_experts: expert id {e} is outside [0, {gate_up.shape[0]})")
        tok, slot = torch.where(ids == e)
        y = expert_act(x[tok] @ gate_up[e].t(), activation) @ down[e].t()
        out.index_add_(0, tok, (y.float() * weights[tok, slot, None].float()).to(x.dtype))
    return out


def moe_experts_loop(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, expert_offset: int | None,
                     num_experts: int, expert) -> torch.Tensor:  # fmt: skip
    """:func:`moe_experts_ref`'s loop with the expert computation supplied (packed or quantized host kernels):
    ``expert(e, rows [n, H]) -> [n, H]``, for ``x [T, H]`` and ``weights / ids [T, k]`` (checked by the caller);
    returns ``[T, H]`` in ``x.dtype``. Fewer host ops than the reference: the pairs sorted by expert once, every
    pair's rows scaled in fp32 and added by one ``index_add_`` in the reference's order (expert, then token, then
    slot). In fp32 the sums are the reference's bit for bit; in bf16 / fp16 ``index_add_`` accumulates a token's
    pairs in fp32 and rounds once (the reference rounds after every pair)."""
    k = ids.shape[1]
    flat = ids.reshape(-1)
    if expert_offset is not None:
        flat = flat - expert_offset
    order = torch.argsort(flat, stable=True)
    experts, counts = torch.unique_consecutive(flat[order], return_counts=True)
    tok_all = order // k
    ys, toks, rows = [], [], []
    start = 0
    for e, n in zip(experts.tolist(), counts.tolist()):
        pos = order[start : start + n]
        start += n
        if not 0 <= e < num_experts:
            if expert_offset is not None:
                continue
            raise ValueError(f"moe_experts: expert id {e} is outside [0, {num_experts})")
        tok = tok_all[start - n : start]
        ys.append(expert(e, x[tok]))
        toks.append(tok)
        rows.append(pos)
    out = torch.zeros_like(x)
    if ys:
        y = torch.cat(ys) if len(ys) > 1 else ys[0]
        w = weights.reshape(-1)[torch.cat(rows)].float()
        out.index_add_(0, torch.cat(toks), (y.float() * w[:, None]).to(x.dtype))
    return out


def moe_lora_pairs(ids: torch.Tensor, slots: torch.Tensor, num_experts: int,
                   expert_offset: int | None = None) -> torch.Tensor:
    """Each (token, expert) pair's LoRA row, ``slot * E + (expert - offset)``, or -1 where the token has no adapter
    (``slots[t] < 0``) or the expert is held elsewhere: ``[T * k]`` int64, device-side (no sync)."""
    T, k = ids.shape
    e = ids.reshape(-1).long() - (expert_offset or 0)
    s = slots.to(device=ids.device, dtype=torch.int64).view(T, 1).expand(T, k).reshape(-1)
    ok = (s >= 0) & (e >= 0) & (e < num_experts)
    return torch.where(ok, s * num_experts + e, torch.full_like(e, -1))


def moe_experts_lora_ref(
    x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
    lora, expert_offset: int | None = None,
) -> torch.Tensor:
    """:func:`moe_experts_ref` with each token's LoRA on its experts (``lora``: an
    :class:`~infercore.ops.moe.MoELoRA`): expert ``e`` of a token in slot ``s`` computes
    ``h = x W_gu[e]^T + (x A_gu[s, e]^T) B_gu[s, e]^T``, ``a = silu(h_gate) * h_up``, ``y = a W_d[e]^T + (a A_d[s, e]^T)
    B_d[s, e]^T`` (each LoRA added in fp32 before the rounding to ``x.dtype``). Host syncs: not graph-capturable."""
    from ..lora.naive import lora_expand_ref, lora_shrink_ref

    E, two_i, _ = gate_up.shape
    rows = moe_lora_pairs(ids, lora.slots, E, expert_offset)
    out = torch.zeros_like(x)
    local = ids - (expert_offset or 0)
    k = ids.shape[1]
    for e in torch.unique(local).tolist():
        if not 0 <= e < E:
            if expert_offset is not None:
                continue
            raise ValueError(f"moe_experts: expert id {e} is outside [0, {E})")
        tok, j = torch.where(local == e)
        c = rows[tok * k + j]
        xs = x[tok]
        h = (xs @ gate_up[e].t()).float()
        lora_expand_ref(h, lora_shrink_ref(xs.to(lora.a_gate_up.dtype), lora.a_gate_up, c), lora.b_gate_up, c,
                        slice_bounds=(two_i // 2,))
        a = silu_and_mul(h.to(x.dtype))
        y = (a @ down[e].t()).float()
        lora_expand_ref(y, lora_shrink_ref(a.to(lora.a_down.dtype), lora.a_down, c), lora.b_down, c)
        out.index_add_(0, tok, (y.to(x.dtype).float() * weights[tok, j, None].float()).to(x.dtype))
    return out
