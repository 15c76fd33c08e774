"""Token sampling: repetition penalty, temperature, top-k / top-p / min-p, seeded exponential race."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields

import torch

from ...devices import dispatch, register
from .. import _validate as V
from .naive import apply_repetition_penalty, apply_top_k_top_p_min_p, row_seed, sample_ref

__all__ = ["SamplingTensors", "apply_repetition_penalty", "apply_top_k_top_p_min_p", "row_seed", "sample"]

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
        Values are validated (see :meth:`check_values`)."""
        given = dict(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
                     repetition_penalty=repetition_penalty, seeds=seeds, offsets=offsets)
        b = len(temperature)
        cols = {}
        for name, values in given.items():
            values = [_DEFAULTS[name]] * b if values is None else list(values)
            if len(values) != b:
                raise ValueError(f"SamplingTensors: {name} has {len(values)} entries but temperature has {b}")
            cols[name] = torch.tensor(values, dtype=_DTYPES[name], device=device)
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
            (self.temperature.isnan() | (self.temperature < 0)).any(),
            (self.top_k < 0).any(),
            (self.top_p.isnan() | (self.top_p <= 0) | (self.top_p > 1)).any(),
            (self.min_p.isnan() | (self.min_p < 0) | (self.min_p > 1)).any(),
            (self.repetition_penalty.isnan() | (self.repetition_penalty <= 0)).any(),
        ]).tolist()
        rules = [
            ("temperature", "must be >= 0 and not NaN (0 = greedy)", self.temperature),
            ("top_k", "must be >= 0 (0 = off)", self.top_k),
            ("top_p", "must be in (0, 1]", self.top_p),
            ("min_p", "must be in [0, 1]", self.min_p),
            ("repetition_penalty", "must be > 0 (1 = off)", self.repetition_penalty),
        ]
        for is_bad, (name, need, t) in zip(bad, rules):
            if is_bad:
                raise ValueError(f"sample: {name} {need}, got {t.tolist()}")


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
    V.tensor(op, "logits", logits)
    if not logits.is_floating_point():
        raise TypeError(f"{op}: logits must be a floating tensor, got {logits.dtype}")
    V.ndim(op, "logits", logits, 2, "[batch, vocab]")
    if not isinstance(params, SamplingTensors):
        raise TypeError(f"{op}: params must be a SamplingTensors, got {type(params).__name__}")
    params.check_layout()
    if params.batch_size != logits.shape[0]:
        raise ValueError(f"{op}: params has {params.batch_size} rows but logits has {logits.shape[0]}")
    V.same_device(op, "logits", logits, params=params.temperature)
    if prev_tokens is not None:
        V.integer(op, "prev_tokens", prev_tokens)
        V.ndim(op, "prev_tokens", prev_tokens, 2, "[batch, max_len]")
        if prev_tokens.shape[0] != logits.shape[0]:
            raise ValueError(
                f"{op}: prev_tokens has {prev_tokens.shape[0]} rows but logits has {logits.shape[0]}"
            )
        V.same_device(op, "logits", logits, prev_tokens=prev_tokens)
    if check_values:
        params.check_values()
    return dispatch(op, logits.device)(logits, params, prev_tokens=prev_tokens)


register("sample", "reference", sample_ref)
