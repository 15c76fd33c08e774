"""A request's state inside the engine and the output it reports."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any

from .params import SamplingParams

# Stands for a token sampled on the device but not read back yet; never fed to a model (the runner
# gathers the real token on the device) and never hashed (it lies past the computed prefix).
PLACEHOLDER = -1


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finish_time: float | None = None
    # prompt tokens not computed at the first admission, because their KV was cached: on the device
    # (num_gpu_cached_tokens) or loaded from the CPU tier (num_cpu_cached_tokens); the sum is num_cached_tokens
    num_cached_tokens: int = 0
    num_gpu_cached_tokens: int = 0
    num_cpu_cached_tokens: int = 0
    num_preemptions: int = 0
    # times the request was taken out of an engine to move to another (Engine.take_requests; the layout
    # switches of parallel.AdaptiveEngine)
    num_migrations: int = 0
    # speculative decoding: draft tokens fed for verification, and how many of them were kept
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0

    @property
    def time_to_first_token(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time


@dataclass
class RequestOutput:
    """What the engine reports for a request after a step (or at the end of ``generate``).

    ``new_token_ids``/``new_text`` hold what this step added (for streaming); ``token_ids``/``text``
    everything generated so far. With ``SamplingParams.logprobs`` set, ``logprobs[i]`` maps token ids to
    log-probabilities at generated position ``i`` (the sampled token and the ``logprobs`` most likely ones;
    the last ``len(new_token_ids)`` entries are this step's) and ``cumulative_logprob`` sums the sampled
    tokens'; both are None otherwise.
    """

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    new_token_ids: list[int]
    new_text: str
    finished: bool
    finish_reason: str | None
    metrics: RequestMetrics
    logprobs: list[dict[int, float]] | None = None
    cumulative_logprob: float | None = None
    # SamplingParams.prompt_logprobs: None for position 0, then one {token id: log-probability} per prompt position
    prompt_logprobs: list[dict[int, float] | None] | None = None
    # Engine.embed / add_request(pooling=...): the prompt's pooled final hidden state (fp32 [hidden] on the host,
    # not normalized), once finished
    embedding: Any = None


@dataclass
class ClassificationOutput:
    """One prompt's result from ``Engine.classify``: fp32 ``logits`` and ``probs`` (softmax) ``[num_labels]`` on the
    host, ``label`` the argmax's name (the checkpoint's ``id2label``), and the token ids that were classified."""

    label: str
    probs: Any
    logits: Any
    prompt_token_ids: list[int]

    @property
    def num_classes(self) -> int:
        return len(self.probs)


@dataclass(eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    eos_token_ids: frozenset[int] = frozenset()
    # the params' seed, or one drawn at arrival: sampling depends on (seed, position) alone
    seed: int = 0
    status: Status = Status.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    # Tokens whose KV is in the cache; the next forward feeds all_token_ids[num_computed:...].
    num_computed_tokens: int = 0
    finish_reason: str | None = None
    metrics: RequestMetrics = field(default_factory=lambda: RequestMetrics(time.perf_counter()))
    # prompt + output in one list, appended in place (never copied per step)
    _all: list[int] = field(default_factory=list)
    # the output's text so far, and the incremental detokenizer that extends it (engine/detok.py)
    text: str = ""
    _detok: Any = field(default=None, repr=False)
    # the runner's persistent host row (block table, sampling parameters); -1 = none
    _row: int = -1
    _reported_tokens: int = 0
    _reported_text: int = 0
    # Engine.generate's requests: no output until they finish, and, without stop strings, their text decoded
    # once at the end instead of token by token (nothing reads it before)
    _final_only: bool = False
    # SamplingParams.logprobs: one {token id: log-probability} per output token, and the sampled ones' sum
    logprobs: list[dict[int, float]] = field(default_factory=list)
    cumulative_logprob: float = 0.0
    # speculative decoding: this step's draft, fed after all_token_ids (the scheduler may shorten it)
    spec_token_ids: list[int] = field(default_factory=list)
    # SamplingParams.prompt_logprobs: position 0's None, then one dict per prompt position computed so far
    prompt_logprobs: list[dict[int, float] | None] = field(default_factory=list)
    # guided decoding: (the engine's guide's key, output tokens walked, the guide's state after them: a DFA state id,
    # or a grammar's set of parse stacks)
    _guide: tuple[int, int, Any] | None = None
    _bad_words: list[list[int]] | None = None  # SamplingParams.bad_words as token sequences (Engine._bad_word_ids)
    # LoRA: the adapter's name (None = the base model); the adapter's slot in the engine that runs it (-1 = none,
    # set at submission / adoption) and the prefix-cache salt that keeps its KV apart from other adapters'
    lora: str | None = None
    _lora_slot: int = -1
    cache_salt: bytes | None = None
    # pooling requests (Engine.embed): "last" or "mean" (None: an ordinary request); the pooled state so far (fp32
    # [hidden] on the device) and how many prompt positions it holds (a recomputed position is not added twice)
    pooling: str | None = None
    _pooled: Any = field(default=None, repr=False)
    _pooled_upto: int = 0
    embedding: Any = field(default=None, repr=False)  # the pooled state on the host once finished ("mean": the mean)
    # the scheduler's "priority" policy: lower runs first (ties by arrival, numbered at the first queueing)
    priority: int = 0
    _arrival: int = -1

    def __post_init__(self) -> None:
        self._all = list(self.prompt_token_ids) + list(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        """Prompt then output tokens; a live view, do not mutate."""
        return self._all

    @property
    def num_tokens(self) -> int:
        return len(self._all)

    @property
    def num_resolved_tokens(self) -> int:
        """Prompt plus output tokens whose values are known on the host."""
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_pending(self) -> int:
        """Placeholders at the tail of ``all_token_ids``: tokens sampled by a launched step that the
        host has not read yet (async scheduling; always 0 in the synchronous engine)."""
        return len(self._all) - self.num_resolved_tokens

    def add_placeholder(self) -> None:
        self._all.append(PLACEHOLDER)

    def drop_placeholders(self) -> None:
        del self._all[self.num_resolved_tokens :]

    def append_token(self, token: int) -> None:
        """Record the next output token; it takes the place of the oldest placeholder, if any."""
        i = self.num_resolved_tokens
        self.output_token_ids.append(token)
        if i < len(self._all):
            self._all[i] = token
        else:
            self._all.append(token)

    @property
    def is_finished(self) -> bool:
        return self.status is Status.FINISHED
