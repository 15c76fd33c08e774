"""GPTQ: error-feedback quantization of a linear layer's weight from its input Hessian.

Frantar et al., "GPTQ: Accurate Post-Training Quantization for Generative Pre-trained
Transformers" (2022). For a layer ``y = x @ W^T`` the layer-wise objective
``||X W^T - X Q^T||^2`` has Hessian ``H = 2 X^T X`` (shared by every output row). Columns are
quantized one at a time; the rounding error of column ``i`` is pushed onto the not yet
quantized columns through the inverse Hessian's Cholesky factor, so later columns absorb it.
Group scales/zeros are fixed when their group's first column is reached, from the already
error-corrected weights, which is what makes GPTQ work with group-wise formats.

The result is an ordinary :class:`~infercore.quant.formats.IntWeight` (same packing, same
kernels): GPTQ only changes which codes are chosen.
"""

from __future__ import annotations

import math

import torch

from .formats import IntWeight, _check_int

_CLIP_RATIOS = (1.0, 0.95, 0.9, 0.85, 0.8, 0.75)


def _group_params(
    x: torch.Tensor, *, bits: int, symmetric: bool, clip_search: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Scale and zero point ``fp32 [N]`` for the columns ``x [N, g]`` (least-MSE clipping).

    Same grid and search as :meth:`IntWeight.quantize`, so GPTQ and RTN codes are comparable.
    """
    qmax = 2**bits - 1
    best_s = best_z = best_err = None
    for r in _CLIP_RATIOS if clip_search else (1.0,):
        if symmetric:
            s = (x.abs().amax(1) * r / (2 ** (bits - 1) - 1)).clamp_min(1e-10)
            z = torch.full_like(s, float(2 ** (bits - 1)))
        else:
            mx = x.amax(1).clamp_min(0) * r
            mn = x.amin(1).clamp_max(0) * r
            s = ((mx - mn) / qmax).clamp_min(1e-10)
            z = torch.round(-mn / s).clamp(0, qmax)
        q = torch.clamp(torch.round(x / s[:, None]) + z[:, None], 0, qmax)
        err = (((q - z[:, None]) * s[:, None] - x) ** 2).sum(1)
        if best_err is None:
            best_s, best_z, best_err = s, z, err
        else:
            better = err < best_err
            best_s = torch.where(better, s, best_s)
            best_z = torch.where(better, z, best_z)
            best_err = torch.minimum(err, best_err)
    return best_s, best_z


def gptq_quantize(
    w: torch.Tensor, hessian: torch.Tensor, *, bits: int = 4, group_size: int | None = 128,
    symmetric: bool = False, damp: float = 0.01, block_size: int = 128, act_order: bool = False,
    clip_search: bool = True, static_groups: bool = False,
) -> IntWeight:
    """GPTQ-quantize ``w [N, K]`` given the input Hessian ``hessian [K, K]`` (any positive scale).

    Args:
        w: float weight ``[N, K]`` (``y = x @ w^T``).
        hessian: ``X^T X`` (or any positive multiple) over calibration inputs ``X [T, K]``, fp32.
        bits: 4 or 8. ``group_size``: groups along K (``None``: one per output channel).
        symmetric: zero point fixed at ``2^(bits-1)`` (else asymmetric uint zeros).
        damp: ``damp * mean(diag H)`` is added to the diagonal (1% in the paper) so the Cholesky
            factorization exists when calibration did not excite every direction.
        block_size: columns updated eagerly together; the rest get one lazy rank-``block`` update
            per block (same result, far fewer memory passes).
        act_order: quantize columns in order of decreasing ``diag(H)`` (most-excited inputs
            first, while the most freedom is left to absorb their error). Groups stay contiguous
            in K (no ``g_idx``, so the stored format and kernels are unchanged): a group's
            scale/zero is fixed when the first of its columns comes up in that order, from the
            group's error-corrected weights at that moment.
        clip_search: least-MSE clipping of each group's range, as in :meth:`IntWeight.quantize`.
        static_groups: with ``act_order``, fix every group's scale/zero up front from the
            original weights instead (AutoGPTQ's ``static_groups``; measured worse here).

    Returns:
        :class:`IntWeight` with the layout of :meth:`IntWeight.quantize` (K padded to the group).
    """
    if not isinstance(w, torch.Tensor) or w.dim() != 2 or not w.is_floating_point():
        raise TypeError(f"w: expected a floating-point [N, K] tensor, got {getattr(w, 'shape', w)}")
    n, k = w.shape
    if not isinstance(hessian, torch.Tensor) or hessian.shape != (k, k):
        raise ValueError(f"hessian: expected [{k}, {k}], got {tuple(getattr(hessian, 'shape', ()))}")
    _check_int("bits", bits, "4 or 8", lambda b: b in (4, 8))
    if group_size is not None:  # refused, not coerced, as in IntWeight.quantize
        _check_int("group_size", group_size, "a positive even int or None", lambda g: g > 0 and g % 2 == 0)
    g = k if group_size is None else group_size
    if not 0.0 <= damp < 1.0:
        raise ValueError(f"damp: expected a fraction in [0, 1), got {damp}")
    if block_size <= 0:
        raise ValueError(f"block_size: expected a positive int, got {block_size}")
    qmax = 2**bits - 1
    dev = w.device
    W = w.detach().float().clone()
    H = hessian.detach().to(device=dev, dtype=torch.float64).clone()
    # Inputs that were never non-zero carry no information: their weights cannot matter.
    dead = torch.diag(H) == 0
    H[dead, dead] = 1.0
    W[:, dead] = 0.0
    n_groups = math.ceil(k / g)
    scales = torch.empty(n, n_groups, device=dev)
    zeros = torch.empty(n, n_groups, device=dev)
    if act_order and static_groups:
        for j in range(n_groups):  # static groups from the original weights
            scales[:, j], zeros[:, j] = _group_params(W[:, j * g:(j + 1) * g], bits=bits,
                                                      symmetric=symmetric, clip_search=clip_search)
    if act_order:
        perm = torch.argsort(torch.diag(H), descending=True)
    else:
        perm = torch.arange(k, device=dev)
    W = W[:, perm]
    H = H[perm][:, perm]
    H.diagonal().add_(damp * H.diagonal().mean())
    # Upper Cholesky factor of H^-1: row i holds the update coefficients for column i's error
    # onto the columns after it (the sequential form of the OBS update). fp64 for the solve.
    hinv = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(H)), upper=True).float()
    codes = torch.empty(n, k, device=dev)
    group_of = perm // g  # group of each permuted column
    pos_of = torch.argsort(perm)  # permuted position of each original column
    done = [static_groups and act_order] * n_groups
    for i1 in range(0, k, block_size):
        i2 = min(i1 + block_size, k)
        w1 = W[:, i1:i2].clone()
        err1 = torch.empty_like(w1)
        h1 = hinv[i1:i2, i1:i2]
        for i in range(i2 - i1):
            col = i1 + i
            j = int(group_of[col])
            if not done[j]:
                # The group's range from its error-corrected weights as they are now: columns of
                # this block from w1, later ones from W plus this block's pending updates.
                pos = pos_of[j * g:min((j + 1) * g, k)]
                cur = torch.empty(n, pos.numel(), device=dev)
                here = pos < i2
                cur[:, here] = w1[:, pos[here] - i1]
                if (~here).any():
                    later = pos[~here]
                    cur[:, ~here] = W[:, later] - err1[:, :i] @ hinv[i1:col, later]
                scales[:, j], zeros[:, j] = _group_params(cur, bits=bits, symmetric=symmetric,
                                                          clip_search=clip_search)
                done[j] = True
            s, z = scales[:, j], zeros[:, j]
            x = w1[:, i]
            q = torch.clamp(torch.round(x / s) + z, 0, qmax)
            codes[:, col] = q
            e = (x - (q - z) * s) / h1[i, i]
            w1[:, i:] -= e[:, None] * h1[i, i:][None, :]
            err1[:, i] = e
        W[:, i2:] -= err1 @ hinv[i1:i2, i2:]
    out = torch.empty_like(codes)
    out[:, perm] = codes
    kp = n_groups * g
    z_full = zeros.repeat_interleave(g, 1)  # padding holds the zero point: it dequantizes to 0
    q = torch.cat([out, z_full[:, k:kp]], 1).to(torch.uint8)
    if bits == 4:
        q = q[:, 0::2] | (q[:, 1::2] << 4)
    return IntWeight(q.contiguous(), scales.contiguous(), None if symmetric else zeros.to(torch.uint8).contiguous(),
                     bits, g, k)
