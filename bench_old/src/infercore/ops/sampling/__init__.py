"""Token sampling: repetition penalty, temperature, top-k / top-p / min-p, seeded exponential race."""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, fields

import torch

from ...devices import dispatch, register
from .. import _validate as V
from . import naive
from .naive import row_seed, sample_ref

__all__ = ["SamplingTensors", "apply_presence_frequency_penalty", "apply_repetition_penalty",
           "apply_top_k_top_p_min_p", "row_seed", "sample", "token_logprobs"]

_DTYPES = {
    "temperature": torch.float32,
    "top_k": torch.int32,
    "top_p": torch.float32,
    "min_p": torch.float32,
    "repetition_penalty": torch.float32,
    "seeds": torch.int64,
    "offsets": torch.int64,
}
_DEFAULTS = {"temperature": 1.0, "top_k": 0, "top_p": 1.0, "min_p": 0.0, "repetition_penalty": 1.0,
             "seeds": 0, "offsets": 0}


@dataclass
class SamplingTensors:
    """Per-row sampling parameters of a batch, all ``[B]`` on the logits' device.

    Attributes:
        temperature: fp32; 0 = greedy (argmax after the repetition penalty).
        top_k: int32; 0 = off.
        top_p: fp32 in (0, 1]; 1 = off.
        min_p: fp32 in [0, 1]; 0 = off.
        repetition_penalty: fp32 > 0; 1 = off.
        seeds: int64 per-request seed.
        offsets: int64 number of tokens the request has generated so far (advances the random stream).
    """

    temperature: torch.Tensor
    top_k: torch.Tensor
    top_p: torch.Tensor
    min_p: torch.Tensor
    repetition_penalty: torch.Tensor
    seeds: torch.Tensor
    offsets: torch.Tensor

    def __post_init__(self) -> None:
        self.check_layout()

    @property
    def batch_size(self) -> int:
        return self.temperature.shape[0]

    @classmethod
    def from_lists(
        cls,
        *,
        temperature: Sequence[float],
        top_k: Sequence[int] | None = None,
        top_p: Sequence[float] | None = None,
        min_p: Sequence[float] | None = None,
        repetition_penalty: Sequence[float] | None = None,
        seeds: Sequence[int] | None = None,
        offsets: Sequence[int] | None = None,
        device: torch.device | str | None = None,
    ) -> SamplingTensors:
        """Build from per-row Python values; an omitted field means "off" (seed/offset 0) for all rows.
        Each entry must be a finite number, an int for top_k / seeds / offsets within its dtype's range;
        the ranges of the parameters are then validated (see :meth:`check_values`)."""
        given = dict(top_k=top_k, top_p=top_p, min_p=min_p, repetition_penalty=repetition_penalty, seeds=seeds,
                     offsets=offsets)  # fmt: skip
        cols = {"temperature": _column("temperature", temperature, device)}
        b = cols["temperature"].shape[0]
        for name, values in given.items():
            cols[name] = _column(name, [_DEFAULTS[name]] * b if values is None else values, device)
            if cols[name].shape[0] != b:
                raise ValueError(f"SamplingTensors: {name} has {cols[name].shape[0]} entries but temperature has {b}")
        out = cls(**cols)
        out.check_values()
        return out

    def check_layout(self) -> None:
        """dtype / shape / device of every field (metadata only, no device sync)."""
        op = "SamplingTensors"
        ref = V.tensor(op, "temperature", self.temperature)
        for f in fields(self):
            t = V.tensor(op, f.name, getattr(self, f.name))
            if t.dtype != _DTYPES[f.name]:
                raise TypeError(f"{op}: {f.name} must have dtype {_DTYPES[f.name]}, got {t.dtype}")
            V.ndim(op, f.name, t, 1, "[batch]")
            if t.shape != ref.shape:
                raise ValueError(f"{op}: {f.name} has {t.shape[0]} rows but temperature has {ref.shape[0]}")
            V.same_device(op, "temperature", ref, **{f.name: t})

    def check_values(self) -> None:
        """Raise ValueError naming the first field with an out-of-range value (one device sync)."""
        bad = torch.stack([
            (~self.temperature.isfinite() | (self.temperature < 0)).any(),
            (self.top_k < 0).any(),
            (self.top_p.isnan() | (self.top_p <= 0) | (self.top_p > 1)).any(),
            (self.min_p.isnan() | (self.min_p < 0) | (self.min_p > 1)).any(),
            (~self.repetition_penalty.isfinite() | (self.repetition_penalty <= 0)).any(),
        ]).tolist()
        rules = [
            ("temperature", "must be finite and >= 0 (0 = greedy)", self.temperature),
            ("top_k", "must be >= 0 (0 = off)", self.top_k),
            ("top_p", "must be in (0, 1]", self.top_p),
            ("min_p", "must be in [0, 1]", self.min_p),
            ("repetition_penalty", "must be finite and > 0 (1 = off)", self.repetition_penalty),
        ]
        for is_bad, (name, need, t) in zip(bad, rules):
            if is_bad:
                raise ValueError(f"sample: {name} {need}, got {t.tolist()}")


def _column(name: str, values: object, device: torch.device | str | None) -> torch.Tensor:
    """One field of :meth:`SamplingTensors.from_lists` as a ``[B]`` tensor. The Python entries are
    checked first: ``torch.tensor`` would truncate 1.5 to an int, overflow on 2**40 and keep inf."""
    op = "SamplingTensors"
    if isinstance(values, (str, bytes)) or not isinstance(values, Iterable):
        raise TypeError(f"{op}: {name} must be a sequence of numbers (one per row), got {type(values).__name__}")
    values = list(values)
    dtype = _DTYPES[name]
    for i, x in enumerate(values):
        if dtype.is_floating_point:
            if isinstance(x, bool) or not isinstance(x, numbers.Real):
                raise TypeError(f"{op}: {name}[{i}] must be a number, got {type(x).__name__}")
            if not math.isfinite(x):
                raise ValueError(f"{op}: {name}[{i}] must be a finite number, got {x}")
        else:
            if isinstance(x, bool) or not isinstance(x, numbers.Integral):
                raise TypeError(f"{op}: {name}[{i}] must be an int, got {type(x).__name__}")
            info = torch.iinfo(dtype)
            if not info.min <= x <= info.max:
                raise ValueError(f"{op}: {name}[{i}] must fit in {dtype}, got {x}")
    return torch.tensor(values, dtype=dtype, device=device)


def _logits(op: str, logits: object) -> torch.Tensor:
    V.tensor(op, "logits", logits)
    if not logits.is_floating_point():
        raise TypeError(f"{op}: logits must be a floating tensor, got {logits.dtype}")
    V.ndim(op, "logits", logits, 2, "[batch, vocab]")
    return logits


def _token_rows(op: str, name: str, tokens: object, logits: torch.Tensor) -> None:
    """``tokens`` must be an int32/int64 ``[B, L]`` (``-1``-padded token ids) for the ``B`` rows of ``logits``,
    on its device."""
    V.integer(op, name, tokens)
    V.ndim(op, name, tokens, 2, "[batch, max_len]")
    if tokens.shape[0] != logits.shape[0]:
        raise ValueError(f"{op}: {name} has {tokens.shape[0]} rows but logits has {logits.shape[0]}")
    V.same_device(op, "logits", logits, **{name: tokens})


def _per_row(op: str, name: str, x: object, logits: torch.Tensor, dtype: torch.dtype, ok: Callable[[float], bool],
             need: str) -> torch.Tensor:  # fmt: skip
    """``x`` as a ``[B]`` tensor for the ``B`` rows of ``logits``. A tensor's dtype kind, shape and
    device are checked, never its values (that would sync); a Python number must pass ``ok`` (else
    ValueError "``name`` ``need``") and is broadcast to every row in ``dtype``."""
    b = logits.shape[0]
    if isinstance(x, torch.Tensor):
        if dtype.is_floating_point:
            V.floating(op, name, x)
        else:
            V.integer(op, name, x)
        if x.shape != (b,):
            raise ValueError(f"{op}: {name} must be [{b}] (one value per row of logits), got shape {tuple(x.shape)}")
        V.same_device(op, "logits", logits, **{name: x})
        return x
    if dtype.is_floating_point:
        x = V.number(op, name, x)
    elif isinstance(x, bool) or not isinstance(x, int):
        raise TypeError(f"{op}: {name} must be an int or an integer tensor, got {type(x).__name__}")
    if not ok(x):
        raise ValueError(f"{op}: {name} {need}, got {x}")
    if not dtype.is_floating_point:
        x = min(x, torch.iinfo(dtype).max)  # only top_k takes ints, and any k >= vocab means "off"
    return torch.full((b,), x, dtype=dtype, device=logits.device)


def apply_repetition_penalty(
    logits: torch.Tensor, prev_tokens: torch.Tensor, penalty: torch.Tensor | float
) -> torch.Tensor:
    """HF repetition penalty over the ids in ``prev_tokens`` (semantics: :func:`.naive.apply_repetition_penalty`).

    ``logits`` float ``[B, V]``; ``prev_tokens`` int32/int64 ``[B, L]`` padded with ``-1``; ``penalty``
    float ``[B]`` or one Python number > 0 for every row. Returns a new ``[B, V]`` in ``logits.dtype``.
    """
    op = "apply_repetition_penalty"
    _logits(op, logits)
    _token_rows(op, "prev_tokens", prev_tokens, logits)
    penalty = _per_row(op, "penalty", penalty, logits, torch.float32, lambda p: p > 0, "must be > 0 (1 = off)")
    return naive.apply_repetition_penalty(logits, prev_tokens, penalty)


def apply_presence_frequency_penalty(
    logits: torch.Tensor, output_tokens: torch.Tensor, presence: torch.Tensor | float, frequency: torch.Tensor | float
) -> torch.Tensor:
    """OpenAI presence / frequency penalties over each row's generated tokens (semantics:
    :func:`.naive.apply_presence_frequency_penalty`).

    ``logits`` float ``[B, V]``; ``output_tokens`` int32/int64 ``[B, L]`` padded with ``-1``; ``presence`` and
    ``frequency`` float ``[B]`` or one finite Python number for every row (0 = off; OpenAI allows [-2, 2]).
    Returns a new fp32 ``[B, V]``.
    """
    op = "apply_presence_frequency_penalty"
    _logits(op, logits)
    _token_rows(op, "output_tokens", output_tokens, logits)
    presence = _per_row(op, "presence", presence, logits, torch.float32, math.isfinite, "must be finite")
    frequency = _per_row(op, "frequency", frequency, logits, torch.float32, math.isfinite, "must be finite")
    return naive.apply_presence_frequency_penalty(logits, output_tokens, presence, frequency)


def apply_top_k_top_p_min_p(
    logits: torch.Tensor, top_k: torch.Tensor | int, top_p: torch.Tensor | float, min_p: torch.Tensor | float
) -> torch.Tensor:
    """Mask (``-inf``) the tokens removed by top-k, then top-p, then min-p (semantics:
    :func:`.naive.apply_top_k_top_p_min_p`).

    ``logits`` float ``[B, V]`` with ``V >= 1``; each parameter is a ``[B]`` tensor (top_k int32/int64,
    top_p / min_p float; values not checked) or one Python number for every row: ``top_k >= 0``
    (0 = off), ``top_p`` in (0, 1], ``min_p`` in [0, 1]. Returns a new ``[B, V]`` in ``logits.dtype``.
    """
    op = "apply_top_k_top_p_min_p"
    _logits(op, logits)
    V.dim_at_least_one(op, "logits", logits, 1, "vocab")
    top_k = _per_row(op, "top_k", top_k, logits, torch.int32, lambda k: k >= 0, "must be >= 0 (0 = off)")
    top_p = _per_row(op, "top_p", top_p, logits, torch.float32, lambda p: 0 < p <= 1, "must be in (0, 1]")
    min_p = _per_row(op, "min_p", min_p, logits, torch.float32, lambda p: 0 <= p <= 1, "must be in [0, 1]")
    return naive.apply_top_k_top_p_min_p(logits, top_k, top_p, min_p)


def sample(
    logits: torch.Tensor,
    params: SamplingTensors,
    *,
    prev_tokens: torch.Tensor | None = None,
    check_values: bool = True,
) -> torch.Tensor:
    """Draw one token per row.

    Order per row: repetition penalty (over the ids in ``prev_tokens``) -> if ``temperature == 0``
    argmax, else temperature -> top-k -> top-p -> min-p -> exponential race ``argmax(p / E)`` with
    ``E ~ Exp(1)`` from a generator seeded by the row's ``(seed, offset)`` alone.

    Args:
        logits: ``[B, V]`` any float dtype (math in fp32).
        params: :class:`SamplingTensors` with ``B`` rows on the logits' device.
        prev_tokens: optional int32/int64 ``[B, L]`` token ids padded with ``-1``, for the penalty.
        check_values: validate the parameter values (one host sync); callers that validated them
            already (the engine does, per request) pass False to keep the step sync-free and
            capturable in a CUDA graph.

    Returns:
        int64 ``[B]`` token ids.
    """
    op = "sample"
    _logits(op, logits)
    V.dim_at_least_one(op, "logits", logits, 1, "vocab")
    if not isinstance(params, SamplingTensors):
        raise TypeError(f"{op}: params must be a SamplingTensors, got {type(params).__name__}")
    params.check_layout()
    if params.batch_size != logits.shape[0]:
        raise ValueError(f"{op}: params has {params.batch_size} rows but logits has {logits.shape[0]}")
    V.same_device(op, "logits", logits, params=params.temperature)
    if prev_tokens is not None:
        _token_rows(op, "prev_tokens", prev_tokens, logits)
    if check_values:
        params.check_values()
    return dispatch(op, logits.device)(logits, params, prev_tokens=prev_tokens)


def token_logprobs(
    logits: torch.Tensor, tokens: torch.Tensor, num_top: int = 0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Log-probabilities of ``tokens`` under ``logits`` and the ``num_top`` most likely tokens per row.

    ``logits`` float ``[B, V]`` (math in fp32: ``log_softmax`` of the logits as given, so pass them before
    any temperature or filter for the model's own distribution); ``tokens`` int32/int64 ``[B]`` ids in
    ``[0, V)`` (not checked: that would sync); ``num_top`` int in ``[0, V]``.

    Returns ``(token_logprob fp32 [B], top_logprobs fp32 [B, num_top], top_ids int64 [B, num_top])``, the top
    ones in descending order (ties in the order ``torch.topk`` gives).
    """
    op = "token_logprobs"
    _logits(op, logits)
    V.dim_at_least_one(op, "logits", logits, 1, "vocab")
    V.integer(op, "tokens", tokens)
    if tokens.shape != (logits.shape[0],):
        raise ValueError(f"{op}: tokens must be [{logits.shape[0]}] (one per row of logits), got {tuple(tokens.shape)}")
    V.same_device(op, "logits", logits, tokens=tokens)
    if isinstance(num_top, bool) or not isinstance(num_top, int):
        raise TypeError(f"{op}: num_top must be an int, got {type(num_top).__name__}")
    if not 0 <= num_top <= logits.shape[1]:
        raise ValueError(f"{op}: num_top must be in [0, {logits.shape[1]}] (the vocabulary), got {num_top}")
    lp = torch.log_softmax(logits.float(), dim=-1)
    picked = lp.gather(1, tokens.long()[:, None])[:, 0]
    top, ids = lp.topk(num_top, dim=-1) if num_top else (lp[:, :0], tokens.long()[:, None][:, :0])
    return picked, top, ids


register("sample", "reference", sample_ref)
