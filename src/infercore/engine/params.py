"""Per-request sampling and stopping parameters."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

# The runner keeps these per request in fixed-width host rows and device tensors (runner.RowTable,
# ops.SamplingTensors): floats as fp32, top_k as int32, the seed as int64. A value outside those
# ranges would overflow on assignment inside a step, or wrap silently, so it is refused here.
_FLOAT32_MAX = 3.4028234663852886e38
_INT32_MAX = 2**31 - 1
_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1
# Most alternatives a request may ask log-probabilities for (each costs a top-k over the vocabulary).
MAX_LOGPROBS = 20


def _show(v) -> str:
    # Python refuses to print ints of more than 4300 digits; a message must not fail on one.
    return f"an int of {v.bit_length()} bits" if isinstance(v, int) and v.bit_length() > 64 else repr(v)


@dataclass
class SamplingParams:
    """How one request samples and when it stops.

    ``temperature=0`` is greedy. ``top_k=0``, ``top_p=1``, ``min_p=0`` and
    ``repetition_penalty=1`` switch those filters off. A fixed ``seed`` makes the request's
    tokens a function of its own logits alone, whatever else shares the batch.

    ``presence_penalty`` / ``frequency_penalty`` (OpenAI's, in [-2, 2], 0 = off) subtract ``presence`` from the
    logit of every token already generated and ``frequency`` times its count, after the repetition penalty
    (which also counts the prompt) and before temperature, as vLLM does.

    ``logprobs`` (None = off, or 0 to :data:`MAX_LOGPROBS`): report, for every generated token, its
    log-probability and those of the ``logprobs`` most likely tokens (``RequestOutput.logprobs``). They are
    the model's own distribution: ``log_softmax`` of the fp32 logits, before the repetition penalty,
    temperature and the top-k / top-p / min-p filters (vLLM's ``raw_logprobs``).

    Guided decoding (at most one; see ``engine/guided.py``): ``guided_regex`` (the output matches it whole,
    ``re.fullmatch`` semantics, a subset of Python's syntax), ``guided_choice`` (the output is one of these
    strings), ``guided_json`` (a JSON schema, as a dict or JSON text, or ``True`` for any JSON object; a regex
    where the schema allows one, else a grammar: recursive ``$ref`` and free values of any depth, see
    ``engine/json_grammar.py``) or ``guided_grammar`` (a context-free grammar in llama.cpp's GBNF, start rule
    ``root``; see ``engine/grammar.py``; left recursion is refused). The
    request ends with end-of-sequence once its output is a whole match and nothing more can follow, or when
    the model picks end-of-sequence at a whole match; it needs an engine with a tokenizer.

    ``prompt_logprobs`` (None = off, or 0 to :data:`MAX_LOGPROBS`): ``RequestOutput.prompt_logprobs``, for every
    prompt position after the first, the log-probability of the prompt's token there and those of the
    ``prompt_logprobs`` most likely ones (None at position 0), from the prefill's own logits; such a request takes
    no prefix-cache hit (every prompt position is computed).

    ``logit_bias`` (OpenAI's: ``{token id: bias}``, biases in [-100, 100]) adds to those logits; ``allowed_token_ids``
    (a non-empty list) masks every other token. Both apply before the penalties, temperature and filters, and
    before a guided mask.

    ``truncate_prompt_tokens`` (None = off, or k >= 1): the request keeps only the last ``k`` tokens of its prompt
    (left truncation, vLLM's), applied when it is submitted.

    ``bad_words`` (vLLM's): words the output never contains as the tokenizer writes them, each tokenized as it is
    and after a space (the form inside a text; kept where it is a different word of as many tokens). A word's last
    token is masked whenever the output so far ends with its other tokens (a one-token word: always). Needs an
    engine with a tokenizer; not with speculative decoding.
    """

    max_tokens: int = 256
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    min_tokens: int = 0
    logprobs: int | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_json: dict | str | bool | None = None
    guided_grammar: str | None = None
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    prompt_logprobs: int | None = None
    truncate_prompt_tokens: int | None = None
    bad_words: list[str] | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.validate()

    def validate(self) -> None:
        def real(name: str, v) -> float:
            if isinstance(v, bool) or not isinstance(v, (int, float)):
                raise TypeError(f"SamplingParams.{name} must be a number, got {type(v).__name__}")
            try:
                f = float(v)
            except OverflowError:  # an int beyond any float
                f = math.inf
            if math.isnan(f) or abs(f) > _FLOAT32_MAX:
                raise ValueError(f"SamplingParams.{name} must be finite (as fp32), got {_show(v)}")
            return f

        def integer(name: str, v) -> int:
            if isinstance(v, bool) or not isinstance(v, int):
                raise TypeError(f"SamplingParams.{name} must be an int, got {type(v).__name__}")
            return v

        def sequence(name: str, v) -> None:
            # a list or tuple; anything else (None, a bare int) would fail later with no name attached
            if not isinstance(v, (list, tuple)):
                raise TypeError(f"SamplingParams.{name} must be a list, got {type(v).__name__}")

        if integer("max_tokens", self.max_tokens) < 1:
            raise ValueError(f"SamplingParams.max_tokens must be >= 1, got {_show(self.max_tokens)}")
        if integer("min_tokens", self.min_tokens) < 0 or self.min_tokens > self.max_tokens:
            raise ValueError(f"SamplingParams.min_tokens must be in [0, max_tokens], got {_show(self.min_tokens)}")
        if real("temperature", self.temperature) < 0:
            raise ValueError(f"SamplingParams.temperature must be >= 0, got {self.temperature}")
        if not 0 <= integer("top_k", self.top_k) <= _INT32_MAX:
            raise ValueError(f"SamplingParams.top_k must be in [0, {_INT32_MAX}] (0 = off), got {_show(self.top_k)}")
        if not 0.0 < real("top_p", self.top_p) <= 1.0:
            raise ValueError(f"SamplingParams.top_p must be in (0, 1], got {self.top_p}")
        if not 0.0 <= real("min_p", self.min_p) <= 1.0:
            raise ValueError(f"SamplingParams.min_p must be in [0, 1], got {self.min_p}")
        if real("repetition_penalty", self.repetition_penalty) <= 0:
            raise ValueError(f"SamplingParams.repetition_penalty must be > 0, got {self.repetition_penalty}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= real(name, getattr(self, name)) <= 2.0:
                raise ValueError(f"SamplingParams.{name} must be in [-2, 2] (0 = off), got {getattr(self, name)}")
        if self.seed is not None and not _INT64_MIN <= integer("seed", self.seed) <= _INT64_MAX:
            raise ValueError(f"SamplingParams.seed must fit in int64, got {_show(self.seed)}")
        if self.logprobs is not None and not 0 <= integer("logprobs", self.logprobs) <= MAX_LOGPROBS:
            raise ValueError(
                f"SamplingParams.logprobs must be None or in [0, {MAX_LOGPROBS}], got {_show(self.logprobs)}")
        plp = self.prompt_logprobs
        if plp is not None and not 0 <= integer("prompt_logprobs", plp) <= MAX_LOGPROBS:
            raise ValueError(f"SamplingParams.prompt_logprobs must be None or in [0, {MAX_LOGPROBS}], got "
                             f"{_show(self.prompt_logprobs)}")
        k = self.truncate_prompt_tokens
        if k is not None and integer("truncate_prompt_tokens", k) < 1:
            raise ValueError(f"SamplingParams.truncate_prompt_tokens must be None or >= 1, got {_show(k)}")
        sequence("stop", self.stop)
        if not all(isinstance(s, str) and s for s in self.stop):
            raise ValueError("SamplingParams.stop must be a list of non-empty strings")
        sequence("stop_token_ids", self.stop_token_ids)
        # bool is an int subclass, but True is no token id
        if not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in self.stop_token_ids):
            raise ValueError("SamplingParams.stop_token_ids must be a list of non-negative ints")
        if self.bad_words is not None:
            sequence("bad_words", self.bad_words)
            if not all(isinstance(w, str) and w.strip() for w in self.bad_words):
                raise ValueError("SamplingParams.bad_words must be a list of non-blank strings")
        guided = [n for n in ("guided_regex", "guided_choice", "guided_json", "guided_grammar")
                  if getattr(self, n) not in (None, False)]
        if len(guided) > 1:
            raise ValueError("SamplingParams: at most one of guided_regex, guided_choice, guided_json, guided_grammar, "
                             f"got {guided}")
        if self.guided_regex is not None and not isinstance(self.guided_regex, str):
            raise TypeError(f"SamplingParams.guided_regex must be a str, got {type(self.guided_regex).__name__}")
        if self.guided_choice is not None:
            sequence("guided_choice", self.guided_choice)
        if self.guided_json is not None and not isinstance(self.guided_json, (dict, str, bool)):
            raise TypeError(f"SamplingParams.guided_json must be a dict, a JSON string or True, got "
                            f"{type(self.guided_json).__name__}")
        if self.guided_grammar is not None:
            if not isinstance(self.guided_grammar, str):
                raise TypeError(
                    f"SamplingParams.guided_grammar must be a str, got {type(self.guided_grammar).__name__}")
            if not self.guided_grammar.strip():
                raise ValueError("SamplingParams.guided_grammar must be a non-empty GBNF grammar")
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict):
                raise TypeError(f"SamplingParams.logit_bias must be a dict, got {type(self.logit_bias).__name__}")
            for t, b in self.logit_bias.items():
                if isinstance(t, bool) or not isinstance(t, int) or t < 0:
                    raise ValueError(f"SamplingParams.logit_bias: keys must be non-negative token ids, got {t!r}")
                if not -100.0 <= real("logit_bias", b) <= 100.0:
                    raise ValueError(f"SamplingParams.logit_bias: biases must be in [-100, 100], got {b!r}")
        if self.allowed_token_ids is not None:
            sequence("allowed_token_ids", self.allowed_token_ids)
            if not self.allowed_token_ids or not all(
                    isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in self.allowed_token_ids):
                raise ValueError("SamplingParams.allowed_token_ids must be a non-empty list of non-negative ints")
        if guided and self.allowed_token_ids is not None:
            raise ValueError("SamplingParams: allowed_token_ids and guided decoding exclude each other")
        if guided:
            kind, text = self.guided_spec()
            if kind == "grammar":
                from .grammar import compile_gbnf

                compile_gbnf(text)  # a bad grammar is refused here, with its line and column (cached)
            else:
                from .fsm import CharDFA

                CharDFA(text)  # a pattern the DFA cannot take is refused here, with its construct

    def guided_spec(self) -> tuple[str, str] | None:
        """The language guided decoding constrains the output to: ``("regex", pattern)`` (``guided_regex``, a
        choice list, a JSON schema a regex can express) or ``("grammar", gbnf)`` (``guided_grammar``, a JSON schema
        that recurses or leaves a value free); None when not guided."""
        from .fsm import choice_regex
        from .json_grammar import json_schema_guide

        if self.guided_regex is not None:
            return "regex", self.guided_regex
        if self.guided_choice is not None:
            return "regex", choice_regex(list(self.guided_choice))
        if self.guided_json is True:
            return json_schema_guide({"type": "object"})
        if self.guided_json not in (None, False):
            return json_schema_guide(self.guided_json)
        if self.guided_grammar is not None:
            return "grammar", self.guided_grammar
        return None

    def guided_pattern(self) -> str | None:
        """A regex for the guide: :meth:`guided_spec`'s where it is one; for a JSON schema that takes a grammar,
        the regex path's bounded restriction of it (free values two levels deep; a recursive ``$ref`` raises
        ValueError); None with ``guided_grammar`` or unguided. :meth:`guided_lowered` keeps the grammar."""
        from .fsm import json_object_regex, json_schema_regex

        spec = self.guided_spec()
        if spec is None or spec[0] == "regex":
            return None if spec is None else spec[1]
        if self.guided_grammar is not None:
            return None
        return json_object_regex() if self.guided_json is True else json_schema_regex(self.guided_json)

    def guided_lowered(self) -> SamplingParams:
        """These parameters with their guide as ``guided_regex`` or ``guided_grammar`` alone (a choice list or a
        JSON schema compiled once, for a request to keep)."""
        spec = self.guided_spec()
        if spec is None:
            return self
        kind, text = spec
        return replace(self, guided_regex=text if kind == "regex" else None, guided_choice=None, guided_json=None,
                       guided_grammar=text if kind == "grammar" else None)

    @property
    def guided(self) -> bool:
        return (self.guided_regex is not None or self.guided_choice is not None
                or self.guided_json not in (None, False) or self.guided_grammar is not None)

    @property
    def processes_logits(self) -> bool:
        """Whether the sampler changes this request's logits before sampling (a bias, an allowed set, a guide)."""
        return bool(self.logit_bias) or self.allowed_token_ids is not None or self.guided or bool(self.bad_words)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def reads_history(self) -> bool:
        """Whether sampling reads the request's earlier tokens (a repetition, presence or frequency penalty, guided
        decoding) or changes its logits (``logit_bias``, ``allowed_token_ids``): such steps sample outside the
        captured graph, from tokens the host has read back."""
        return (self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
                or self.processes_logits)
