"""``QuantLinear``: an ``nn.Linear`` replacement over any quantized format.

The format's tensors are module buffers (so ``.to()``, ``state_dict()`` and safetensors save/load
work unchanged); ``forward`` rebuilds the small format dataclass and dispatches to the op for its
kind. W8A8 layers quantize activations per token on the fly; MixQ layers additionally keep a set
of outlier input channels in high precision, predicted online (see :meth:`QuantLinear._mixed`).
"""

from __future__ import annotations

import torch
from torch import nn

from .formats import (
    FP4Weight,
    FP8Weight,
    GGUFWeight,
    Int8Weight,
    IntWeight,
    NF4Weight,
    QuantizedWeight,
    _check_int,
    _check_real,
)
from .ops import fp4_matmul, fp8_wo_matmul, gguf_matmul, nf4_matmul, per_token_quant, w8a8_matmul, wq_matmul


class QuantLinear(nn.Module):
    """``y = x @ W^T + b`` with ``W`` held in a :class:`QuantizedWeight`.

    Args:
        weight: the quantized weight ``[N, K]``.
        bias: optional ``[N]``.
        outlier_threshold: MixQ only (an :class:`Int8Weight` with ``act="int8"``): an input channel
            whose ``|x|`` exceeds this joins the high-precision outlier set (default 6.0 in the
            ``w8a8-mixed`` scheme). ``None`` disables online growth.
        max_outliers: cap on the outlier set (growth stops there; later misses are only counted).
        in_perm: optional int ``[K]`` permutation of the input channels (an :class:`IntWeight` only): the layer
            computes ``x[..., in_perm] @ W^T`` with ``W`` stored in that order (act-order GPTQ checkpoints,
            :func:`~infercore.quant.packing.from_gptq_act_order`). A buffer, so it is saved with the model.
    """

    def __init__(
        self, weight: QuantizedWeight, bias: torch.Tensor | None = None, *,
        outlier_threshold: float | None = None, max_outliers: int = 256, in_perm: torch.Tensor | None = None,
    ) -> None:
        super().__init__()
        if not isinstance(weight, QuantizedWeight):
            raise TypeError(f"weight: expected a QuantizedWeight, got {type(weight).__name__}")
        n, k = weight.shape
        if bias is not None:
            if not isinstance(bias, torch.Tensor) or not bias.is_floating_point():
                raise TypeError(f"bias: expected a floating-point [{n}] tensor or None, got {type(bias).__name__}")
            if bias.shape != (n,):
                raise ValueError(f"bias: expected shape ({n},), got {tuple(bias.shape)}")
        if outlier_threshold is not None:
            if not (isinstance(weight, Int8Weight) and weight.act == "int8"):
                raise ValueError("outlier_threshold: only INT8 W8A8 weights carry an outlier set")
            _check_real("outlier_threshold", outlier_threshold, "a positive number or None", lambda t: t > 0)
        _check_int("max_outliers", max_outliers, "a non-negative int", lambda m: m >= 0)
        if in_perm is not None:
            if not isinstance(weight, IntWeight):
                raise ValueError("in_perm: only INT weight-only layers take an input permutation")
            if not isinstance(in_perm, torch.Tensor) or in_perm.dtype not in (torch.int32, torch.int64):
                raise TypeError(f"in_perm: expected an int32 / int64 [{k}] tensor, got {type(in_perm).__name__}")
            if in_perm.shape != (k,) or not torch.equal(torch.sort(in_perm.cpu().long()).values, torch.arange(k)):
                raise ValueError(f"in_perm: expected a permutation of range({k})")
            in_perm = in_perm.to(device=weight.qweight.device, dtype=torch.long)
        self.register_buffer("in_perm", in_perm)
        self._meta = weight.meta()
        self._names: list[str] = []
        self._set_weight(weight)
        self.bias = None if bias is None else nn.Parameter(bias.detach().clone(), requires_grad=False)
        self.out_features, self.in_features = n, k
        self.outlier_threshold = outlier_threshold
        self.max_outliers = max_outliers
        # Online outlier prediction statistics: tokens seen, tokens fully covered by the
        # predicted set (no new outlier), and how many times the set grew.
        self.outlier_stats = {"tokens": 0, "covered": 0, "grown": 0}

    def _set_weight(self, weight: QuantizedWeight) -> None:
        for name in self._names:
            delattr(self, name)
        self._names = []
        for name, t in weight.tensors().items():
            self.register_buffer(name, t)
            self._names.append(name)

    @property
    def qweight_format(self) -> QuantizedWeight:
        return QuantizedWeight.from_parts(self._meta, {n: getattr(self, n) for n in self._names})

    @property
    def kind(self) -> str:
        return self._meta["kind"]

    def extra_repr(self) -> str:
        meta = {k: v for k, v in self._meta.items() if k != "kind"}
        perm = ", in_perm" if self.in_perm is not None else ""
        return f"in_features={self.in_features}, out_features={self.out_features}, {self.kind} {meta}{perm}"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x [..., in_features]`` (fp32/fp16/bf16) -> ``[..., out_features]`` in ``x.dtype``, through the
        format's op (weight-only INT / FP8 / FP4, GGUF, or W8A8 with per-token activation quantization)."""
        x = self._permute(x)
        w = self.qweight_format
        if isinstance(w, IntWeight):
            return wq_matmul(x, w, bias=self.bias)
        if isinstance(w, FP8Weight):
            return fp8_wo_matmul(x, w, bias=self.bias)
        if isinstance(w, GGUFWeight):
            return gguf_matmul(x, w, bias=self.bias)
        if isinstance(w, FP4Weight):
            return fp4_matmul(x, w, bias=self.bias)
        if isinstance(w, NF4Weight):
            return nf4_matmul(x, w, bias=self.bias)
        # The weight-only ops above check x themselves; the W8A8 path starts with a reshape. Metadata only.
        if not isinstance(x, torch.Tensor) or x.dtype not in (torch.float32, torch.float16, torch.bfloat16):
            raise TypeError(f"QuantLinear: x must be a fp32/fp16/bf16 tensor, got {getattr(x, 'dtype', type(x))}")
        if x.dim() < 1 or x.shape[-1] != self.in_features:
            raise ValueError(f"QuantLinear: x must be [..., {self.in_features}], got {tuple(x.shape)}")
        if x.device != w.qweight.device:
            raise ValueError(f"QuantLinear: x is on {x.device} but the weight is on {w.qweight.device}")
        x2 = x.reshape(-1, self.in_features)
        if self.outlier_threshold is not None:
            y = self._mixed(x2, w)
        else:
            q, s, xo = per_token_quant(x2, act=w.act, smooth=w.smooth, outlier_idx=w.outlier_idx)
            y = w8a8_matmul(q, s, w, x_out=xo, bias=self.bias, out_dtype=x.dtype)
        return y.reshape(*x.shape[:-1], self.out_features)

    def forward_act(self, x: torch.Tensor, act: str) -> torch.Tensor:
        """``act(gate) * up`` ``[..., N // 2]`` of this merged ``[gate; up]`` projection (``act``: ``"silu"``,
        ``"gelu_tanh"`` or ``"gelu"``). On CUDA, for INT/FP8 weight-only weights and at most
        ``triton_wo.GEMV_M_MAX`` rows, one kernel with the activation in its epilogue where its tuned
        path allows; otherwise :meth:`forward`, then the ``*_and_mul`` op."""
        from ..ops.activation import GATED_ACTS, gated_act_and_mul

        if act not in GATED_ACTS:
            raise ValueError(f"act: expected one of {GATED_ACTS}, got {act!r}")
        w = self.qweight_format
        # A non-tensor x falls through to forward, which names what it expected (and permutes x itself).
        if (isinstance(x, torch.Tensor) and x.is_cuda and isinstance(w, (IntWeight, FP8Weight)) and x.dim() >= 1
                and x.shape[-1] == self.in_features):
            from . import triton_wo

            x2 = x.reshape(-1, self.in_features)
            if 0 < x2.shape[0] <= triton_wo.GEMV_M_MAX:
                x2 = self._permute(x2)
                fn = triton_wo.wq_matmul_triton if isinstance(w, IntWeight) else triton_wo.fp8_wo_matmul_triton
                y = fn(x2, w, self.bias, act=act)
                return y.reshape(*x.shape[:-1], y.shape[-1])
        return gated_act_and_mul(self.forward(x), act)

    def _permute(self, x: torch.Tensor) -> torch.Tensor:
        """``x[..., in_perm]`` when the layer has an input permutation and x fits it (else x: the op names what
        is wrong)."""
        p = self.in_perm
        if p is None or not isinstance(x, torch.Tensor) or x.dim() < 1 or x.shape[-1] != p.shape[0]:
            return x
        return x.index_select(-1, p if p.device == x.device else p.to(x.device))

    def _mixed(self, x2: torch.Tensor, w: Int8Weight) -> torch.Tensor:
        """MixQ: per-token INT8 over ordinary channels + high-precision outlier channels.

        The per-token scale is computed anyway; a token whose scale exceeds ``threshold / 127``
        has a channel outside the predicted set above the threshold. Only then are the
        activations scanned for the new channels, which join the set for this and every later
        call (outlier positions are stable across tokens, so this is rare after warm-up).
        """
        thr = float(self.outlier_threshold)
        q, s, xo = per_token_quant(x2, act="int8", smooth=w.smooth, outlier_idx=w.outlier_idx)
        miss = s > thr / 127.0
        n_miss = int(miss.sum())
        self.outlier_stats["tokens"] += x2.shape[0]
        self.outlier_stats["covered"] += x2.shape[0] - n_miss
        if n_miss and w.num_outliers < self.max_outliers:
            known = torch.zeros(self.in_features, dtype=torch.bool, device=x2.device)
            if w.num_outliers:
                known[w.outlier_idx.long()] = True
            xs = x2[miss].float()
            if w.smooth is not None:
                xs = xs / w.smooth
            new = ((xs.abs() > thr).any(0) & ~known).nonzero().flatten()
            new = new[: self.max_outliers - w.num_outliers]
            if new.numel():
                w = w.with_outliers(new.to(torch.int32))
                self._set_weight(w)
                self._meta = w.meta()
                self.outlier_stats["grown"] += 1
                q, s, xo = per_token_quant(x2, act="int8", smooth=w.smooth, outlier_idx=w.outlier_idx)
        return w8a8_matmul(q, s, w, x_out=xo, bias=self.bias, out_dtype=x2.dtype)
