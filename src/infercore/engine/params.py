"""Per-request sampling and stopping parameters."""

from __future__ import annotations

import math
from dataclasses import dataclass, field


@dataclass
class SamplingParams:
    """How one request samples and when it stops.

    ``temperature=0`` is greedy. ``top_k=0``, ``top_p=1``, ``min_p=0`` and
    ``repetition_penalty=1`` switch those filters off. A fixed ``seed`` makes the request's
    tokens a function of its own logits alone, whatever else shares the batch.
    """

    max_tokens: int = 256
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    min_tokens: int = 0

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.validate()

    def validate(self) -> None:
        def real(name: str, v) -> float:
            if isinstance(v, bool) or not isinstance(v, (int, float)):
                raise TypeError(f"SamplingParams.{name} must be a number, got {type(v).__name__}")
            if math.isnan(v) or math.isinf(v):
                raise ValueError(f"SamplingParams.{name} must be finite, got {v}")
            return float(v)

        def integer(name: str, v) -> int:
            if isinstance(v, bool) or not isinstance(v, int):
                raise TypeError(f"SamplingParams.{name} must be an int, got {type(v).__name__}")
            return v

        if integer("max_tokens", self.max_tokens) < 1:
            raise ValueError(f"SamplingParams.max_tokens must be >= 1, got {self.max_tokens}")
        if integer("min_tokens", self.min_tokens) < 0 or self.min_tokens > self.max_tokens:
            raise ValueError(f"SamplingParams.min_tokens must be in [0, max_tokens], got {self.min_tokens}")
        if real("temperature", self.temperature) < 0:
            raise ValueError(f"SamplingParams.temperature must be >= 0, got {self.temperature}")
        if integer("top_k", self.top_k) < 0:
            raise ValueError(f"SamplingParams.top_k must be >= 0 (0 = off), got {self.top_k}")
        if not 0.0 < real("top_p", self.top_p) <= 1.0:
            raise ValueError(f"SamplingParams.top_p must be in (0, 1], got {self.top_p}")
        if not 0.0 <= real("min_p", self.min_p) <= 1.0:
            raise ValueError(f"SamplingParams.min_p must be in [0, 1], got {self.min_p}")
        if real("repetition_penalty", self.repetition_penalty) <= 0:
            raise ValueError(f"SamplingParams.repetition_penalty must be > 0, got {self.repetition_penalty}")
        if self.seed is not None:
            integer("seed", self.seed)
        if not all(isinstance(s, str) and s for s in self.stop):
            raise ValueError("SamplingParams.stop must be a list of non-empty strings")
        if not all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids):
            raise ValueError("SamplingParams.stop_token_ids must be a list of non-negative ints")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
