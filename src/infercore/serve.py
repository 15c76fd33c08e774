"""An OpenAI-compatible HTTP server over one :class:`~infercore.Engine` (``infercore serve``).

Endpoints: ``GET /v1/models``, ``GET /health``, ``GET /metrics`` (Prometheus text: request and token counters,
running / waiting requests, KV pool use, time-to-first-token and latency histograms; :class:`ServerMetrics`),
``POST /tokenize`` / ``POST /detokenize``, ``POST /v1/embeddings`` (``input``: a string, token ids or a list of
either; extensions ``pooling`` "last" / "mean" and ``normalize``), ``POST /classify`` (vLLM's: a
sequence-classification checkpoint's ``label`` / ``probs`` per ``input``), ``POST /v1/completions`` and
``POST /v1/chat/completions``, each with
``"stream": true`` (server-sent events ending in ``data: [DONE]``) or a single JSON reply. Sampling fields:
``max_tokens`` (``max_completion_tokens`` in chat), ``temperature``, ``top_p``, ``top_k``, ``min_p``, ``seed``,
``stop`` (a string or a list), ``presence_penalty``, ``frequency_penalty``, ``repetition_penalty``,
``ignore_eos``, ``min_tokens``, ``logprobs`` (completions: an int; chat: ``true`` with ``top_logprobs``), and
``prompt_logprobs`` (an int: each choice's ``prompt_logprobs``, not in streams), ``logit_bias``,
``allowed_token_ids``, and guided decoding: ``response_format`` (``json_object`` or
``json_schema``), ``guided_regex``, ``guided_choice``, ``guided_json``.
A completion's ``prompt`` is a string, a list of token ids, or a list of either, and ``n`` (up to
:data:`MAX_N`) asks for several samples of each: choice ``i * n + j`` is prompt ``i``'s sample ``j``, all of them
batched together (with a ``seed``, sample ``j`` uses ``seed + j``); streamed chunks carry their choice's index.

``priority`` (an int, lower first) orders requests when the engine's ``scheduling_policy`` is "priority".

vLLM's development routes: ``POST /reset_prefix_cache``, ``POST /sleep`` (``level``), ``POST /wake_up`` (``tags``),
``GET /is_sleeping`` (:meth:`Engine.sleep`; a request submitted while the engine sleeps is answered 500).

Tool calling (chat): ``tools`` (OpenAI function tools, handed to the chat template as ``tools=``; messages may be
``tool`` results with ``tool_call_id`` and assistant turns with ``tool_calls``) and ``tool_choice``, as vLLM does it:
a named function constrains the output to its ``parameters`` schema (guided decoding) and returns it as the one
``tool_calls`` entry (``finish_reason`` "stop"); "required" constrains it to a JSON array of at least one
``{"name", "parameters"}`` (one schema per tool) and returns each item as a call ("tool_calls"); "auto" (the
default with tools) generates freely and reads the calls out of the text with the server's tool-call parser
(:mod:`infercore.tool_parsers`, "hermes" unless ``make_server(tool_call_parser=...)`` says otherwise; the text
outside them stays ``content``; "tool_calls" when any was read); "none" (the default without tools) leaves the text
alone. Streamed, calls come as they are generated, vLLM's way: a call's first piece carries its ``index``, ``id``,
``type`` and ``name``, later ones ``function.arguments`` pieces (a required reply's calls in order, each once its
name is out: :func:`required_calls_so_far`); an "auto" reply is read as it comes by the parser's
:class:`~infercore.tool_parsers.ToolStream`: text outside the calls streams as ``content`` (a tail that may begin a
call's opening held back), each call goes out once its name is, then its arguments' text as it grows (the pieces
add up to the whole reply's ``arguments``), after a reasoning block that streams as ``reasoning_content``.

Beam search: ``use_beam_search: true`` (vLLM's extension; not with ``stream``, guided decoding, ``stop`` or
logprobs) returns each prompt's best ``n`` of ``beam_width`` (default ``n``) hypotheses by
:meth:`Engine.beam_search` (``length_penalty``, ``early_stopping``, ``ignore_eos``, ``max_tokens``); its
one-token steps run as requests through the engine loop, batched with everyone else's (and counted in the
metrics as requests).

``stream_options: {"include_usage": true}`` ends a stream with a chunk of empty ``choices`` and the request's
``usage`` (the other chunks then carry ``"usage": null``). ``echo: true`` (completions) puts each prompt's text
before its choices' text (with ``logprobs``, the prompt's tokens and log-probabilities before theirs, the first
None; streamed, the prompt text is each choice's first chunk).

LoRA (an engine with ``max_loras > 0``): a request's ``model`` names a loaded adapter to run it through, or the
served model for the base; any other name is a 404 there. ``GET /v1/models`` lists the adapters after the base
model (``"parent"``: the base), and ``POST /v1/load_lora_adapter`` (``{"lora_name", "lora_path"}``) /
``POST /v1/unload_lora_adapter`` (``{"lora_name"}``) load and unload them while serving.

One thread owns the engine and runs its loop (:class:`EngineLoop`); the HTTP handler threads only submit
requests and read their outputs from a queue, so any number of clients batch together in the engine's
continuous batching. A client that disconnects has its request aborted. Bad requests get HTTP 400 with an
OpenAI-style ``{"error": {"message", "type", "param"}}``; the engine's own checks (``SamplingParams``, prompt
length, pool size) name the field. Stdlib only (``http.server``).
"""

from __future__ import annotations

import itertools
import json
import queue
import threading
import time
from dataclasses import dataclass, replace
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import TYPE_CHECKING, Any

import torch

from .engine import Engine, RequestOutput, SamplingParams
from .engine.engine import POOLING, pair_scores, score_prompts
from .engine.json_grammar import json_schema_guide
from .reasoning_parsers import ReasoningParser, get_reasoning_parser
from .tool_parsers import ToolCall, ToolParser, ToolStream, get_tool_parser, new_call_id

if TYPE_CHECKING:
    from .parallel import AdaptiveEngine, MirroredEngine

_SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "min_p", "seed", "presence_penalty", "frequency_penalty",
                    "repetition_penalty", "ignore_eos", "min_tokens", "truncate_prompt_tokens")


class BadRequest(ValueError):
    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class NotFound(BadRequest):
    """A request for a model (LoRA adapter) the server does not have: HTTP 404."""


def _loras(engine) -> list[str]:
    """The loaded LoRA adapters of ``engine`` (none for engines without the method)."""
    fn = getattr(engine, "list_loras", None)
    return fn() if fn is not None else []


class EngineLoop:
    """The thread that owns ``engine``: it admits submitted requests, steps while any is unfinished, and puts
    each :class:`RequestOutput` (or the exception that refused the request) on the request's queue."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.metrics = ServerMetrics()
        self._inbox: queue.Queue = queue.Queue()
        self._ids = itertools.count()
        self._queues: dict[str, queue.Queue] = {}
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._run, name="infercore-engine", daemon=True)
        self.thread.start()

    def submit(self, prompt: list[int], params: SamplingParams | None, out: queue.Queue | None = None, *,
               lora: str | None = None, pooling: str | None = None, priority: int = 0) -> tuple[str, queue.Queue]:
        """Queue a request (through LoRA adapter ``lora``, or the base model); its outputs arrive on ``out`` (a new
        queue unless given, so several requests can share one) as ``(request id, item)``: a
        :class:`RequestOutput` after each step that advanced it, the exception that refused or failed it, or None
        once it is aborted."""
        rid = f"req-{next(self._ids)}"
        out = queue.Queue() if out is None else out
        kw = {k: v for k, v in (("lora", lora), ("pooling", pooling), ("priority", priority or None)) if v is not None}
        self._inbox.put(("add", rid, prompt, (params, kw), out))
        return rid, out

    def call(self, fn, *args):
        """Run ``fn(engine, *args)`` on the engine's thread, between steps; returns its result or raises its
        exception here (LoRA loading: the engine is not thread-safe)."""
        done: queue.Queue = queue.Queue()
        self._inbox.put(("call", None, (fn, args), None, done))
        ok, value = done.get()
        if not ok:
            raise value
        return value

    def abort(self, rid: str) -> None:
        self._inbox.put(("abort", rid, None, None, None))

    def close(self) -> None:
        self._stop.set()
        self._inbox.put(("wake", None, None, None, None))
        self.thread.join(timeout=30)

    def _admit(self, item) -> None:
        kind, rid, prompt, params, out = item
        if kind == "call":
            fn, args = prompt
            try:
                out.put((True, fn(self.engine, *args)))
            except Exception as e:  # noqa: BLE001  (handed to the caller)
                out.put((False, e))
        elif kind == "add":
            params, kw = params  # only the options given: engines without LoRA need not take the argument
            try:
                self.engine.add_request(prompt, params, request_id=rid, **kw)
            except (ValueError, TypeError, RuntimeError) as e:  # RuntimeError: the engine sleeps
                self.metrics.count("requests_refused_total")
                out.put((rid, e))
                return
            self._queues[rid] = out
        elif kind == "abort" and rid in self._queues:
            self.engine.abort(rid)
            self._queues.pop(rid).put((rid, None))

    def _run(self) -> None:
        eng = self.engine
        while not self._stop.is_set():
            try:  # wait for work when idle; otherwise only drain what has arrived
                item = self._inbox.get(timeout=0.5) if not eng.has_unfinished() else self._inbox.get_nowait()
                self._admit(item)
                while True:
                    self._admit(self._inbox.get_nowait())
            except queue.Empty:
                pass
            if not eng.has_unfinished():
                continue
            try:
                outputs = eng.step()
            except Exception as e:  # noqa: BLE001  (every waiting client hears of it; the loop goes on)
                for rid, q in list(self._queues.items()):
                    eng.abort(rid)
                    q.put((rid, RuntimeError(f"engine step failed: {e}")))
                self._queues.clear()
                continue
            self.metrics.observe_step(eng, outputs)
            for out in outputs:
                q = self._queues.get(out.request_id)
                if q is not None:
                    q.put((out.request_id, out))
                    if out.finished:
                        del self._queues[out.request_id]


class ServerMetrics:
    """What ``GET /metrics`` reports (Prometheus text format, names prefixed ``infercore:``): counters of requests
    (finished by reason, refused), prompt and generated tokens, prefix-cache hit tokens and preemptions; gauges of
    running / waiting requests and the KV pool's use after the last step; histograms of time to first token and
    request latency. Written by the engine loop's thread, read by the handlers' (under a lock)."""

    BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.counters: dict[str, float] = {"requests_refused_total": 0, "prompt_tokens_total": 0,
                                           "generation_tokens_total": 0, "prefix_cache_hit_tokens_total": 0,
                                           "preemptions_total": 0}
        self.finished: dict[str, int] = {}
        self.gauges: dict[str, float] = {"num_requests_running": 0, "num_requests_waiting": 0, "kv_cache_usage": 0.0}
        self.hist: dict[str, list] = {name: [[0] * len(self.BUCKETS), 0.0, 0]
                                      for name in ("time_to_first_token_seconds", "e2e_request_latency_seconds")}

    def count(self, name: str, n: float = 1) -> None:
        with self._lock:
            self.counters[name] += n

    def _observe(self, name: str, v: float) -> None:
        counts, _, _ = h = self.hist[name]
        for i, b in enumerate(self.BUCKETS):
            if v <= b:
                counts[i] += 1
        h[1] += v
        h[2] += 1

    def observe_step(self, engine, outputs: list[RequestOutput]) -> None:
        sched = getattr(engine, "scheduler", None)
        bm = getattr(engine, "block_manager", None)
        with self._lock:
            for out in outputs:
                self.counters["generation_tokens_total"] += len(out.new_token_ids)
                m = out.metrics
                if out.new_token_ids and len(out.token_ids) == len(out.new_token_ids) and m.first_token_time:
                    self._observe("time_to_first_token_seconds", m.first_token_time - m.arrival_time)
                if out.finished:
                    self.finished[out.finish_reason or "abort"] = self.finished.get(out.finish_reason or "abort", 0) + 1
                    self.counters["prompt_tokens_total"] += len(out.prompt_token_ids)
                    self.counters["prefix_cache_hit_tokens_total"] += m.num_cached_tokens
                    self.counters["preemptions_total"] += m.num_preemptions
                    end = m.finish_time or time.perf_counter()
                    self._observe("e2e_request_latency_seconds", end - m.arrival_time)
            if sched is not None:
                self.gauges["num_requests_running"] = len(sched.running)
                self.gauges["num_requests_waiting"] = len(sched.waiting)
            if bm is not None and getattr(bm, "num_pages", 0):
                self.gauges["kv_cache_usage"] = 1.0 - bm.num_free_pages / bm.num_pages

    def render(self, model_name: str) -> str:
        """The Prometheus text exposition of every metric."""
        lab = f'model_name="{model_name}"'
        lines = []
        with self._lock:
            for name, v in self.counters.items():
                lines += [f"# TYPE infercore:{name} counter", f"infercore:{name}{{{lab}}} {v}"]
            lines.append("# TYPE infercore:request_success_total counter")
            for reason, v in sorted(self.finished.items()):
                lines.append(f'infercore:request_success_total{{{lab},finished_reason="{reason}"}} {v}')
            for name, v in self.gauges.items():
                lines += [f"# TYPE infercore:{name} gauge", f"infercore:{name}{{{lab}}} {v}"]
            for name, (counts, total, n) in self.hist.items():
                lines.append(f"# TYPE infercore:{name} histogram")
                for b, c in zip(self.BUCKETS, counts):
                    lines.append(f'infercore:{name}_bucket{{{lab},le="{b}"}} {c}')
                lines += [f'infercore:{name}_bucket{{{lab},le="+Inf"}} {n}', f"infercore:{name}_sum{{{lab}}} {total}",
                          f"infercore:{name}_count{{{lab}}} {n}"]
        return "\n".join(lines) + "\n"


def _number(body: dict, name: str, kind: type) -> Any:
    """``body[name]`` if it is a ``kind`` (float takes ints too; bools are no numbers), None if absent."""
    v = body.get(name)
    if v is None:
        return None
    if kind is bool:
        ok = isinstance(v, bool)
    elif kind is int:
        ok = isinstance(v, int) and not isinstance(v, bool)
    else:
        ok = isinstance(v, (int, float)) and not isinstance(v, bool)
    if not ok:
        raise BadRequest(f"{name} must be a {kind.__name__}, got {type(v).__name__}", name)
    return v


def sampling_params(body: dict, *, chat: bool) -> SamplingParams:
    """The request body's sampling fields as :class:`SamplingParams` (``BadRequest`` / the params' own
    ValueError / TypeError name a bad field)."""
    kw: dict[str, Any] = {}
    kinds = {"temperature": float, "top_p": float, "min_p": float, "presence_penalty": float,
             "frequency_penalty": float, "repetition_penalty": float, "top_k": int, "seed": int, "min_tokens": int,
             "ignore_eos": bool, "truncate_prompt_tokens": int}
    for name in _SAMPLING_FIELDS:
        v = _number(body, name, kinds[name])
        if v is not None:
            kw[name] = v
    if chat and body.get("max_completion_tokens") is not None:
        kw["max_tokens"] = _number(body, "max_completion_tokens", int)
    elif body.get("max_tokens") is not None:
        kw["max_tokens"] = _number(body, "max_tokens", int)
    stop = body.get("stop")
    if stop is not None:
        if isinstance(stop, str):
            stop = [stop]
        if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
            raise BadRequest("stop must be a string or a list of strings", "stop")
        kw["stop"] = stop
    if chat:
        if body.get("logprobs"):
            kw["logprobs"] = _number(body, "top_logprobs", int) or 0
    elif body.get("logprobs") is not None:
        kw["logprobs"] = _number(body, "logprobs", int)
    if body.get("prompt_logprobs") is not None:
        kw["prompt_logprobs"] = _number(body, "prompt_logprobs", int)
    if body.get("bad_words") is not None:
        kw["bad_words"] = body["bad_words"]  # SamplingParams checks it (a TypeError naming the field)
    kw.update(_guided(body))
    return SamplingParams(**kw)


def _guided(body: dict) -> dict[str, Any]:
    """Guided-decoding fields: ``guided_regex`` / ``guided_choice`` / ``guided_json`` / ``guided_grammar`` (GBNF),
    vLLM's ``structured_outputs`` object (``regex`` / ``choice`` / ``json`` / ``grammar``, or ``json_object: true``),
    or OpenAI's ``response_format`` (``{"type": "json_object"}``, or ``{"type": "json_schema", "json_schema":
    {"schema": ...}}``; ``{"type": "text"}`` is no constraint)."""
    kw: dict[str, Any] = {}
    for name in ("guided_regex", "guided_choice", "guided_json", "guided_grammar", "allowed_token_ids"):
        if body.get(name) is not None:
            kw[name] = body[name]
    so = body.get("structured_outputs")
    if so is not None:
        if not isinstance(so, dict):
            raise BadRequest("structured_outputs must be an object", "structured_outputs")
        unknown = sorted(set(so) - {"regex", "choice", "json", "grammar", "json_object"})
        if unknown:
            raise BadRequest(f"structured_outputs: unsupported field(s) {unknown} (regex, choice, json, grammar, "
                             "json_object)", "structured_outputs")
        given = {f"guided_{k}": v for k, v in so.items() if k != "json_object" and v is not None}
        if so.get("json_object"):
            given["guided_json"] = True
        if len(given) > 1 or (given and any(k.startswith("guided_") for k in kw)):
            raise BadRequest("structured_outputs: give one constraint, and no guided_* field beside it",
                             "structured_outputs")
        kw.update(given)
    bias = body.get("logit_bias")
    if bias is not None:  # OpenAI's keys are token ids written as strings
        if not isinstance(bias, dict):
            raise BadRequest("logit_bias must be an object of token id: bias", "logit_bias")
        try:
            kw["logit_bias"] = {int(k): v for k, v in bias.items()}
        except (TypeError, ValueError):
            raise BadRequest("logit_bias: keys must be token ids", "logit_bias") from None
    fmt = body.get("response_format")
    if fmt is None:
        return kw
    if not isinstance(fmt, dict) or fmt.get("type") not in ("text", "json_object", "json_schema"):
        raise BadRequest("response_format must be an object whose type is text, json_object or json_schema",
                         "response_format")
    if fmt["type"] == "text":
        return kw
    if kw:
        raise BadRequest("response_format: not together with guided_regex / guided_choice / guided_json",
                         "response_format")
    if fmt["type"] == "json_object":
        return {"guided_json": True}
    schema = fmt.get("json_schema")
    if not isinstance(schema, dict) or not isinstance(schema.get("schema"), dict):
        raise BadRequest("response_format: json_schema must be an object with a schema object", "response_format")
    return {"guided_json": schema["schema"]}


MAX_N = 16


def _n(body: dict) -> int:
    n = _number(body, "n", int)
    if n is not None and not 1 <= n <= MAX_N:
        raise BadRequest(f"n must be in [1, {MAX_N}], got {n}", "n")
    return n or 1


@dataclass
class ToolPlan:
    """What a chat request's ``tools`` / ``tool_choice`` ask for: ``tools`` as the chat template takes them (None:
    none given), ``choice`` "none" / "auto" / "required" / "named" (``name``: the function), and ``schema``, the
    guided-decoding JSON schema of a named or required choice."""

    tools: list[dict] | None = None
    choice: str = "none"
    name: str | None = None
    schema: dict | None = None


_EMPTY_PARAMETERS = {"type": "object", "properties": {}}


def tool_plan(body: dict) -> ToolPlan:
    """Check a chat request's ``tools`` and ``tool_choice`` (BadRequest naming the field) into a :class:`ToolPlan`."""
    tools, choice = body.get("tools"), body.get("tool_choice")
    functions: dict[str, dict] = {}
    if tools is not None:
        if not isinstance(tools, list) or not tools:
            raise BadRequest("tools must be a non-empty list of {'type': 'function', 'function': {...}}", "tools")
        for i, t in enumerate(tools):
            fn = t.get("function") if isinstance(t, dict) else None
            if not isinstance(fn, dict) or t.get("type", "function") != "function":
                raise BadRequest(f"tools[{i}] must be {{'type': 'function', 'function': {{'name', 'description', "
                                 f"'parameters'}}}}", "tools")
            name = fn.get("name")
            if not isinstance(name, str) or not name:
                raise BadRequest(f"tools[{i}].function.name must be a non-empty string", "tools")
            if name in functions:
                raise BadRequest(f"tools[{i}]: a second function named {name!r}", "tools")
            if fn.get("description") is not None and not isinstance(fn["description"], str):
                raise BadRequest(f"tools[{i}].function.description must be a string", "tools")
            if fn.get("parameters") is not None and not isinstance(fn["parameters"], dict):
                raise BadRequest(f"tools[{i}].function.parameters must be a JSON schema object", "tools")
            functions[name] = fn
    if choice is None:
        choice = "auto" if tools else "none"
    if isinstance(choice, str):
        if choice not in ("none", "auto", "required"):
            raise BadRequest("tool_choice must be 'none', 'auto', 'required' or {'type': 'function', "
                             "'function': {'name': ...}}", "tool_choice")
        if choice == "required" and not tools:
            raise BadRequest("tool_choice 'required' needs tools", "tool_choice")
        plan = ToolPlan(tools, choice if tools else "none")
        if choice == "required":  # vLLM's form: one schema per tool, any number (>= 1) of calls
            plan.schema = {"type": "array", "minItems": 1, "items": {"anyOf": [
                {"type": "object", "properties": {"name": {"type": "string", "enum": [name]},
                                                  "parameters": fn.get("parameters") or _EMPTY_PARAMETERS},
                 "required": ["name", "parameters"]} for name, fn in functions.items()]}}
    elif isinstance(choice, dict):
        fn = choice.get("function")
        if choice.get("type") != "function" or not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise BadRequest("tool_choice must be 'none', 'auto', 'required' or {'type': 'function', "
                             "'function': {'name': ...}}", "tool_choice")
        if fn["name"] not in functions:
            raise BadRequest(f"tool_choice names the function {fn['name']!r}, which is not in tools "
                             f"({sorted(functions)})", "tool_choice")
        plan = ToolPlan(tools, "named", fn["name"], functions[fn["name"]].get("parameters") or _EMPTY_PARAMETERS)
    else:
        raise BadRequest("tool_choice must be a string or an object", "tool_choice")
    if plan.schema is not None:
        try:  # the schema's own faults, named here rather than at submission
            json_schema_guide(plan.schema)  # a regex, or a grammar for recursive / free-valued schemas
        except ValueError as e:
            raise BadRequest(f"tools: the parameters schema cannot guide decoding: {e}", "tools") from None
    return plan


def _chat_messages(messages) -> list[dict]:
    """Checked chat messages, as HF chat templates take them: text content parts joined, an assistant turn's
    ``tool_calls`` arguments as objects (JSON text parsed) and its null content as "", ``tool`` results with their
    ``tool_call_id``."""
    shape = "messages must be a non-empty list of {'role': str, 'content': str}"
    if not isinstance(messages, list) or not messages:
        raise BadRequest(shape, "messages")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise BadRequest(shape, "messages")
        m = dict(m)
        content = m.get("content")
        if isinstance(content, list):  # OpenAI's content parts: text ones only
            if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                       for p in content):
                raise BadRequest(f"messages[{i}].content: only text parts are served", "messages")
            m["content"] = "".join(p["text"] for p in content)
        calls = m.get("tool_calls")
        if calls is not None:
            if m["role"] != "assistant" or not isinstance(calls, list):
                raise BadRequest(f"messages[{i}].tool_calls: a list, in an assistant message", "messages")
            fixed = []
            for j, c in enumerate(calls):
                fn = c.get("function") if isinstance(c, dict) else None
                if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
                    raise BadRequest(f"messages[{i}].tool_calls[{j}] must be {{'id', 'type': 'function', "
                                     f"'function': {{'name', 'arguments'}}}}", "messages")
                args = fn.get("arguments", {})
                if isinstance(args, str):
                    try:
                        args = json.loads(args) if args.strip() else {}
                    except ValueError:
                        args = None
                if not isinstance(args, dict):
                    raise BadRequest(f"messages[{i}].tool_calls[{j}].function.arguments must be a JSON object "
                                     f"(or its text)", "messages")
                fixed.append({**c, "function": {**fn, "arguments": args}})
            m["tool_calls"] = fixed
            if m.get("content") is None:  # a template writing it would print "None"
                m["content"] = ""
        if m["role"] == "tool" and not isinstance(m.get("tool_call_id"), str):
            raise BadRequest(f"messages[{i}]: a tool message needs tool_call_id (a string)", "messages")
        if not isinstance(m.get("content"), str):
            raise BadRequest(f"{shape} (messages[{i}].content)", "messages")
        out.append(m)
    return out


def _prompt_ids(engine: Engine, body: dict, *, chat: bool, key: str = "prompt",
                tools: list[dict] | None = None) -> list[list[int]]:
    """The request's prompts as token ids: one chat conversation (its chat template given ``tools`` where there are
    any), or the completion prompt(s) (``body[key]``: a string, a list of token ids, or a list of either)."""
    tok = engine.tokenizer
    if chat:
        messages = _chat_messages(body.get("messages"))
        if tok is None:
            raise BadRequest("the model has no tokenizer for chat messages", "messages")
        extra = {"tools": tools} if tools else {}
        kwargs = body.get("chat_template_kwargs")
        if kwargs is not None:  # e.g. Qwen3's {"enable_thinking": false}
            if not isinstance(kwargs, dict) or not all(isinstance(k, str) for k in kwargs):
                raise BadRequest("chat_template_kwargs must be an object", "chat_template_kwargs")
            reserved = {"messages", "conversation", "tools", "add_generation_prompt", "tokenize"} & set(kwargs)
            if reserved:
                raise BadRequest(f"chat_template_kwargs: {sorted(reserved)} are set by the server",
                                 "chat_template_kwargs")
            extra.update(kwargs)
        text = tok.apply_chat_template(messages, add_generation_prompt=True, **extra)
        return [tok.encode(text, add_special_tokens=False)]
    prompt = body.get(key)

    def ids(p) -> list[int]:
        if isinstance(p, str):
            if tok is None:
                raise BadRequest("the model has no tokenizer; send token ids", key)
            return tok.encode(p)
        if isinstance(p, list) and p and all(isinstance(t, int) and not isinstance(t, bool) for t in p):
            return p
        raise BadRequest(f"{key} must be a string, a list of token ids, or a non-empty list of either", key)

    if isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
        return [ids(p) for p in prompt]  # OpenAI's batch form
    return [ids(prompt)]


def _logprobs(engine: Engine, out: RequestOutput, start: int, *, chat: bool) -> dict | None:
    if out.logprobs is None:
        return None
    tok = engine.tokenizer

    def text(t: int) -> str:
        return tok.decode([t], skip_special_tokens=False) if tok is not None else str(t)

    rows = list(zip(out.token_ids[start:], out.logprobs[start:]))
    if chat:
        return {"content": [{"token": text(t), "logprob": d[t],
                             "top_logprobs": [{"token": text(a), "logprob": v} for a, v in list(d.items())[1:]]}
                            for t, d in rows]}
    return {"tokens": [text(t) for t, _ in rows], "token_logprobs": [d[t] for t, d in rows],
            "top_logprobs": [{text(a): v for a, v in list(d.items())[1:]} for _, d in rows]}


def _prompt_logprobs(engine: Engine, out: RequestOutput) -> list:
    """``prompt_logprobs``: None for the first prompt token, then ``{token id: {"logprob", "decoded_token"}}`` per
    position (the prompt's token first)."""
    tok = engine.tokenizer

    def text(t: int) -> str:
        return tok.decode([t], skip_special_tokens=False) if tok is not None else str(t)

    return [None if d is None else {str(t): {"logprob": v, "decoded_token": text(t)} for t, v in d.items()}
            for d in out.prompt_logprobs]


def chat_message(plan: ToolPlan, parser: ToolParser | None, text: str, reason: str | None
                 ) -> tuple[dict, str | None]:
    """The assistant message of a chat choice whose output is ``text`` and its ``finish_reason``, after ``plan``:
    a named call (reason unchanged: "stop"), the calls of a required reply ("tool_calls" where the JSON array
    closed), those ``parser`` reads out of an auto reply ("tool_calls" when there is any), or the text alone."""
    calls: list[ToolCall] = []
    content: str | None = text
    if plan.choice == "named":
        calls, content = [ToolCall(plan.name, text)], None
    elif plan.choice == "required":
        try:
            items = json.loads(text)
        except ValueError:  # cut off by max_tokens: the text as it is
            items = None
        if isinstance(items, list) and items and all(isinstance(x, dict) and isinstance(x.get("name"), str)
                                                     for x in items):
            # each call's arguments as the model wrote them (what the stream sends, piece by piece)
            written = required_calls_so_far(text)
            if [n for n, _ in written] == [x["name"] for x in items]:
                calls = [ToolCall(n, args or "{}") for n, args in written]
            else:  # not expected for the guided output; its parsed form then
                calls = [ToolCall(x["name"], json.dumps(x.get("parameters", {}), ensure_ascii=False))
                         for x in items]
            content, reason = None, "tool_calls" if reason == "stop" else reason
    elif plan.choice == "auto" and parser is not None:
        content, calls = parser.extract(text)
        if calls:
            reason = "tool_calls"
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if calls:
        message["tool_calls"] = [c.to_openai() for c in calls]
    return message, reason


def required_calls_so_far(text: str) -> list[tuple[str | None, str]]:
    """The calls of a "required" reply's JSON array ``[{"name": ..., "parameters": {...}}, ...]`` as far as ``text``
    has written it: per item, its name once the string has closed (else None) and its ``parameters`` object's
    text so far (from its ``{``; "" before it starts). Later texts extend each item's parameters text, so a stream
    can send the difference."""
    items: list[list] = []  # [name, start of parameters, end of parameters]
    depth, in_str, esc, str_start, key, value = 0, False, False, 0, None, False
    for i, ch in enumerate(text):
        if in_str:
            if esc:
                esc = False
            elif ch == "\\":
                esc = True
            elif ch == '"':
                in_str = False
                if depth == 2 and items:
                    word = json.loads(text[str_start:i + 1])
                    if value:
                        if key == "name":
                            items[-1][0] = word
                        value = False
                    else:
                        key = word
            continue
        if ch == '"':
            in_str, str_start = True, i
        elif ch in "[{":
            depth += 1
            if depth == 2 and ch == "{":
                items.append([None, None, None])
                key, value = None, False
            elif depth == 3 and value and key == "parameters" and ch == "{" and items:
                items[-1][1], value = i, False
        elif ch in "]}":
            if depth == 3 and items and items[-1][1] is not None and items[-1][2] is None:
                items[-1][2] = i + 1
            depth -= 1
        elif depth == 2 and ch == ":":
            value = True
        elif depth == 2 and ch == ",":
            key, value = None, False
    return [(name, "" if lo is None else text[lo:hi if hi is not None else len(text)]) for name, lo, hi in items]


def _echo_texts(engine: Engine, body: dict, ids: list[list[int]]) -> list[str]:
    """``echo``: each completion prompt's text (as sent, or its token ids decoded)."""
    prompt, tok = body.get("prompt"), engine.tokenizer
    raw = prompt if isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt) \
        else [prompt]
    return [p if isinstance(p, str) else tok.decode(i, skip_special_tokens=False) if tok is not None else ""
            for p, i in zip(raw, ids)]


def _echo_logprobs(engine: Engine, out: RequestOutput, lp: dict) -> dict:
    """A completion choice's ``logprobs`` with its prompt's before them (``echo`` with ``logprobs``): the first
    prompt token's log-probability and top ones None, as vLLM writes them."""
    tok = engine.tokenizer

    def text(t: int) -> str:
        return tok.decode([t], skip_special_tokens=False) if tok is not None else str(t)

    rows = list(zip(out.prompt_token_ids, out.prompt_logprobs))
    return {"tokens": [text(t) for t, _ in rows] + lp["tokens"],
            "token_logprobs": [None if d is None else d[t] for t, d in rows] + lp["token_logprobs"],
            "top_logprobs": [None if d is None else {text(a): v for a, v in list(d.items())[1:]} for _, d in rows]
            + lp["top_logprobs"]}


class _LoopDriver:
    """An engine as :meth:`Engine.beam_search` sees it whose ``generate`` submits through the engine loop and waits
    (on the calling thread) for the outputs, so a beam search's steps batch with the other requests instead of
    stepping the engine behind the loop's back. Everything else reads the loop's engine."""

    def __init__(self, loop: EngineLoop, priority: int) -> None:
        self._loop, self._priority = loop, priority

    def __getattr__(self, name: str):
        return getattr(self._loop.engine, name)

    def generate(self, prompts: list[list[int]], params: SamplingParams, *, lora=None) -> list[RequestOutput]:
        q: queue.Queue = queue.Queue()
        loras = lora if isinstance(lora, list) else [lora] * len(prompts)
        index = {self._loop.submit(p, params, q, lora=la, priority=self._priority)[0]: i
                 for i, (p, la) in enumerate(zip(prompts, loras))}
        final: dict[str, RequestOutput] = {}
        while len(final) < len(index):
            rid, out = q.get()
            if not isinstance(out, RequestOutput):
                for other in index:
                    if other not in final and other != rid:
                        self._loop.abort(other)
                raise out if isinstance(out, Exception) else RuntimeError("request aborted")
            if out.finished:
                final[rid] = out
        return [final[rid] for rid in sorted(index, key=index.__getitem__)]


@dataclass
class _Reply:
    """How a completion request's outputs become its reply: chat or not, its tool plan, ``n`` (choice ``i`` is
    prompt ``i // n``'s), the echoed prompt texts (None: no echo), whether the reply shows ``prompt_logprobs``
    (echo may ask the engine for them alone) and whether a stream ends with its usage."""

    chat: bool
    plan: ToolPlan
    n: int = 1
    echo: list[str] | None = None
    show_prompt_logprobs: bool = True
    include_usage: bool = False
    reasoning: ReasoningParser | None = None  # splits a chat reply's reasoning out (None: the server has none)
    guided: bool = False  # the output is guided: it has a reasoning block only where it opens one itself


def reply_message(reply: _Reply, parser: ToolParser | None, text: str, reason: str | None) -> tuple[dict, str | None]:
    """:func:`chat_message` of a chat choice's whole ``text``, its reasoning first split out by the reply's reasoning
    parser (``reasoning_content``; the tool plan then reads the answer alone)."""
    if reply.reasoning is None:
        return chat_message(reply.plan, parser, text, reason)
    reasoning, answer = reply.reasoning.split(text, explicit=reply.guided)
    message, reason = chat_message(reply.plan, parser, answer or "", reason)
    message["content"] = message["content"] or None
    message["reasoning_content"] = reasoning
    return message, reason


def _usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def _include_usage(body: dict, stream: bool) -> bool:
    """``stream_options.include_usage`` (only with ``stream``)."""
    opts = body.get("stream_options")
    if opts is None:
        return False
    if not stream:
        raise BadRequest("stream_options is only for stream: true", "stream_options")
    if not isinstance(opts, dict) or not isinstance(opts.get("include_usage", False), bool):
        raise BadRequest("stream_options must be an object with include_usage (a boolean)", "stream_options")
    return opts.get("include_usage", False)


def _beam_options(body: dict, params: SamplingParams, n: int, stream: bool) -> dict:
    """``use_beam_search``'s options for :meth:`Engine.beam_search` (``beam_width`` >= ``n``, default ``n``;
    ``length_penalty``, ``early_stopping``), refusing what it cannot honour."""
    if stream:
        raise BadRequest("use_beam_search: not with stream", "stream")
    if params.guided:
        raise BadRequest("use_beam_search: not with guided decoding (response_format, guided_*, a named or "
                         "required tool_choice)", "use_beam_search")
    for name in ("logprobs", "prompt_logprobs"):
        if getattr(params, name) is not None:
            raise BadRequest(f"use_beam_search: {name} are not returned by beam search", name)
    if params.stop:
        raise BadRequest("use_beam_search: not with stop strings", "stop")
    width = _number(body, "beam_width", int)
    width = n if width is None else width
    if width < n:
        raise BadRequest(f"beam_width ({width}) must be >= n ({n})", "beam_width")
    penalty = _number(body, "length_penalty", float)
    return {"beam_width": width, "length_penalty": 1.0 if penalty is None else penalty,
            "early_stopping": bool(_number(body, "early_stopping", bool))}


class _Handler(BaseHTTPRequestHandler):
    server: _Server
    protocol_version = "HTTP/1.1"

    def log_message(self, fmt: str, *args) -> None:  # quiet unless asked
        if self.server.verbose:
            super().log_message(fmt, *args)

    def _json(self, status: int, obj: dict) -> None:
        data = json.dumps(obj).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _error(self, status: int, message: str, param: str | None = None) -> None:
        kind = "invalid_request_error" if status < 500 else "server_error"
        self._json(status, {"error": {"message": message, "type": kind, "param": param, "code": None}})

    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        if self.path.rstrip("/") == "/v1/models":
            srv = self.server
            data = [{"id": srv.model_name, "object": "model", "created": srv.created, "owned_by": "infercore"}]
            for name in _loras(srv.loop.engine):
                data.append({"id": name, "object": "model", "created": srv.created, "owned_by": "infercore",
                             "parent": srv.model_name})
            self._json(200, {"object": "list", "data": data})
        elif self.path.rstrip("/") in ("/health", ""):
            self._json(200, {"status": "ok"})
        elif self.path.rstrip("/") == "/is_sleeping":
            self._sleep_mode("/is_sleeping")
        elif self.path.rstrip("/") == "/metrics":
            data = self.server.loop.metrics.render(self.server.model_name).encode()
            self.send_response(200)
            self.send_header("Content-Type", "text/plain; version=0.0.4")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
        else:
            self._error(404, f"no route {self.path}")

    def do_POST(self) -> None:  # noqa: N802
        route = self.path.rstrip("/")
        if route.partition("?")[0] in ("/reset_prefix_cache", "/sleep", "/wake_up"):
            self._sleep_mode(route)
            return
        if route in ("/v1/load_lora_adapter", "/v1/unload_lora_adapter"):
            self._lora_admin(route)
            return
        if route == "/v1/embeddings":
            self._embeddings()
            return
        if route == "/classify":
            self._classify()
            return
        if route in ("/score", "/v1/score", "/rerank", "/v1/rerank"):
            self._score(route.endswith("rerank"))
            return
        if route in ("/tokenize", "/detokenize"):
            self._tokens(route)
            return
        if route not in ("/v1/completions", "/v1/chat/completions"):
            self._error(404, f"no route {self.path}")
            return
        chat = route == "/v1/chat/completions"
        eng = self.server.loop.engine
        try:
            body = self._read_json()
            params = sampling_params(body, chat=chat)
            n = _n(body)
            plan = tool_plan(body) if chat else ToolPlan()
            ids = _prompt_ids(eng, body, chat=chat, tools=plan.tools)
            stream = bool(body.get("stream", False))
            reply = _Reply(chat, plan, n, include_usage=_include_usage(body, stream))
            if not chat and _number(body, "echo", bool):
                reply.echo = _echo_texts(eng, body, ids)
                if params.logprobs is not None and params.prompt_logprobs is None:
                    params = replace(params, prompt_logprobs=params.logprobs)  # for the echoed prompt's logprobs
                    reply.show_prompt_logprobs = False
            if plan.schema is not None:
                if params.guided:
                    raise BadRequest("tool_choice: a named or required tool choice guides the output itself; not "
                                     "together with response_format or guided_*", "tool_choice")
                params = replace(params, guided_json=plan.schema)
            if chat:
                reply.reasoning, reply.guided = self.server.reasoning_parser, params.guided
            lora = self._adapter(body.get("model"))
            priority = _number(body, "priority", int) or 0
            beam = _beam_options(body, params, n, stream) if _number(body, "use_beam_search", bool) else None
        except BadRequest as e:  # NotFound too
            self._refuse(e)
            return
        except (ValueError, TypeError) as e:  # the JSON itself, or SamplingParams' checks (they name the field)
            self._error(400, str(e))
            return
        if beam is not None:
            self._beam_search(ids, params, beam, lora, priority, reply)
            return
        loop = self.server.loop
        q: queue.Queue = queue.Queue()
        # n samples per prompt are n requests; with a seed, sample j draws from seed + j (else each draws its own)
        index = {}
        for i, p in enumerate(ids):
            for j in range(n):
                sp = params if params.seed is None or j == 0 else replace(params, seed=params.seed + j)
                index[loop.submit(p, sp, q, lora=lora, priority=priority)[0]] = i * n + j
        first = self._first_outputs(q, index)
        if first is None:
            return
        if stream:
            self._stream(index, q, first, reply)
        else:
            self._whole(index, q, first, reply)

    def _beam_search(self, ids: list[list[int]], params: SamplingParams, beam: dict, lora: str | None,
                     priority: int, reply: _Reply) -> None:
        """``use_beam_search``: :meth:`Engine.beam_search` run from this handler's thread over a
        :class:`_LoopDriver`, so its steps go through the engine loop; each prompt's best ``n`` hypotheses."""
        driver = _LoopDriver(self.server.loop, priority)
        if not all(hasattr(driver, a) for a in ("_encode", "_eos", "_bind_lora")):
            self._error(400, f"use_beam_search: {type(self.server.loop.engine).__name__} does not serve beam search",
                        "use_beam_search")
            return
        try:
            # Engine's own checks and search, on the driver (it reads the loop's engine for all but generate)
            results = Engine.beam_search(driver, ids, max_tokens=params.max_tokens, ignore_eos=params.ignore_eos,
                                         lora=lora, **beam)
        except (ValueError, TypeError) as e:
            self._error(400, str(e))
            return
        except Exception as e:  # noqa: BLE001  (an engine step failed, or the request was aborted)
            self._error(500, str(e))
            return
        choices, prompt_tokens, completion_tokens = [], 0, 0
        for i, (p, hyps) in enumerate(zip(ids, results)):
            for j, h in enumerate(hyps[:reply.n]):
                idx = i * reply.n + j
                prompt_tokens += len(p)
                completion_tokens += len(h.token_ids)
                if reply.chat:
                    message, reason = reply_message(reply, self.server.tool_parser, h.text, h.finish_reason)
                    choices.append({"index": idx, "message": message, "logprobs": None, "finish_reason": reason})
                else:
                    text = h.text if reply.echo is None else reply.echo[i] + h.text
                    choices.append({"index": idx, "text": text, "logprobs": None, "finish_reason": h.finish_reason})
        self._json(200, {"id": f"beam-{time.monotonic_ns()}", "object": "chat.completion" if reply.chat
                         else "text_completion", "created": int(time.time()), "model": self.server.model_name,
                         "choices": choices, "usage": _usage(prompt_tokens, completion_tokens)})

    def _adapter(self, model) -> str | None:
        """The LoRA adapter a request's ``model`` names, or None for the base model. Without LoRA slots any name
        means the base model (clients send all sorts); with them, a name that is neither is refused."""
        eng = self.server.loop.engine
        if model is None or model == self.server.model_name or getattr(eng, "lora", None) is None:
            return None
        if not isinstance(model, str):
            raise BadRequest("model must be a string", "model")
        if model not in _loras(eng):
            raise NotFound(f"the model {model!r} does not exist (served: {[self.server.model_name, *_loras(eng)]})")
        return model

    def _read_json(self) -> dict:
        """The request's JSON object (BadRequest for anything else; json's ValueError for what does not parse)."""
        length = int(self.headers.get("Content-Length", "0"))
        body = json.loads(self.rfile.read(length) or b"{}")
        if not isinstance(body, dict):
            raise BadRequest("the body must be a JSON object")
        return body

    def _refuse(self, e: BadRequest) -> None:
        """Answer a refused request: 404 for a model the server does not have, else 400 naming the field."""
        if isinstance(e, NotFound):
            self._error(404, str(e), "model")
        else:
            self._error(400, str(e), e.param)

    def _tokens(self, route: str) -> None:
        """``POST /tokenize`` (``prompt``, or chat ``messages``, as the completion routes take them) -> ``{"tokens",
        "count", "max_model_len"}``; ``POST /detokenize`` (``tokens``: ids) -> ``{"prompt"}``. The tokenizer is
        read-only here, so these run on the handler's thread."""
        eng = self.server.loop.engine
        tok = getattr(eng, "tokenizer", None)
        try:
            body = self._read_json()
            if tok is None:
                raise BadRequest("the model has no tokenizer")
            if route == "/tokenize":
                chat = "messages" in body
                if not chat and not isinstance(body.get("prompt"), str):
                    raise BadRequest("prompt must be a string (or send chat messages)", "prompt")
                ids = _prompt_ids(eng, body, chat=chat, tools=tool_plan(body).tools if chat else None)[0]
                out = {"tokens": ids, "count": len(ids), "max_model_len": eng.max_model_len}
            else:
                ids = body.get("tokens")
                vocab = eng.vocab_size or 2**63
                if not isinstance(ids, list) or not all(
                        isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab for t in ids):
                    raise BadRequest(f"tokens must be a list of token ids in [0, {vocab})", "tokens")
                out = {"prompt": tok.decode(ids, skip_special_tokens=False)}
        except BadRequest as e:
            self._refuse(e)
            return
        except (ValueError, TypeError) as e:
            self._error(400, str(e))
            return
        self._json(200, out)

    def _pooling_route(self, parse) -> tuple[dict, list[RequestOutput], Any] | None:
        """The steps every pooling route shares: read the body, ``parse(body) -> (prompts, pooling, extra)`` (raising
        BadRequest / ValueError / TypeError for a bad field: answered 400, or 404 for an unknown model), then run the
        prompts (``truncate_prompt_tokens`` and the ``model``'s adapter from the body) as pooling requests. Returns
        ``(body, outputs in order, extra)``, or None once an answer has gone out."""
        try:
            body = self._read_json()  # read first: the connection stays usable whatever the answer
            prompts, pooling, extra = parse(body)
            sp = SamplingParams(truncate_prompt_tokens=_number(body, "truncate_prompt_tokens", int))
            lora = self._adapter(body.get("model"))
        except BadRequest as e:  # NotFound too
            self._refuse(e)
            return None
        except (ValueError, TypeError) as e:
            self._error(400, str(e))
            return None
        outs = self._pooled(prompts, sp, lora, pooling)
        return None if outs is None else (body, outs, extra)

    def _pooled_reply(self, body: dict, outs: list[RequestOutput], reply: dict) -> None:
        """Answer a pooling route: ``reply`` with the request's ``model`` and the prompts' ``usage``."""
        tokens = sum(len(o.prompt_token_ids) for o in outs)
        self._json(200, {**reply, "model": body.get("model") or self.server.model_name,
                         "usage": {"prompt_tokens": tokens, "total_tokens": tokens}})

    def _embeddings(self) -> None:
        """``POST /v1/embeddings``: ``input`` (a string, token ids, or a list of either), ``model`` (a LoRA adapter
        or the base), ``encoding_format`` "float", ``dimensions`` (the first that many components, then normalized),
        and the extensions ``pooling`` ("last", the default, or "mean"), ``normalize`` (default true) and
        ``truncate_prompt_tokens``."""
        eng = self.server.loop.engine

        def parse(body: dict):
            if body.get("encoding_format", "float") != "float":
                raise BadRequest("encoding_format: only 'float' is served", "encoding_format")
            pooling = body.get("pooling", "last")
            if pooling not in POOLING:
                raise BadRequest(f"pooling must be one of {POOLING}", "pooling")
            normalize = body.get("normalize", True)
            if not isinstance(normalize, bool):
                raise BadRequest("normalize must be a boolean", "normalize")
            dims = _number(body, "dimensions", int)
            hidden = getattr(getattr(eng.model, "config", None), "hidden_size", None)
            if dims is not None and not 1 <= dims <= (hidden or dims):
                raise BadRequest(f"dimensions must be in [1, {hidden}]", "dimensions")
            return _prompt_ids(eng, body, chat=False, key="input"), pooling, (normalize, dims)

        done = self._pooling_route(parse)
        if done is None:
            return
        body, outs, (normalize, dims) = done
        data = []
        for i, out in enumerate(outs):
            e = out.embedding if dims is None else out.embedding[:dims]
            if normalize:
                e = e / e.norm().clamp_min(1e-12)
            data.append({"object": "embedding", "index": i, "embedding": e.tolist()})
        self._pooled_reply(body, outs, {"object": "list", "data": data})

    def _pooled(self, ids: list[list[int]], sp: SamplingParams, lora: str | None,
                pooling: str) -> list[RequestOutput] | None:
        """Run ``ids`` as pooling requests through the engine loop; their final outputs in order, or None once an
        error has been answered (the others aborted)."""
        loop = self.server.loop
        q: queue.Queue = queue.Queue()
        index = {loop.submit(p, sp, q, lora=lora, pooling=pooling)[0]: i for i, p in enumerate(ids)}
        first = self._first_outputs(q, index)
        if first is None:
            return None
        final = {rid: out for rid, out in first if out.finished}
        while len(final) < len(index):
            rid, out = q.get()
            if not isinstance(out, RequestOutput):
                for other in index:
                    if other not in final:
                        loop.abort(other)
                self._error(500, str(out) if out is not None else "request aborted")
                return None
            if out.finished:
                final[rid] = out
        return [final[rid] for rid, _ in sorted(index.items(), key=lambda kv: kv[1])]

    def _classify(self) -> None:
        """``POST /classify`` (vLLM's): ``input`` (a string, token ids, or a list of either), ``model`` (a LoRA
        adapter or the base), the extension ``truncate_prompt_tokens``; each prompt's ``label``, ``probs`` (softmax
        over the labels) and ``num_classes`` from a sequence-classification checkpoint's score head
        (:meth:`Engine.classify`'s computation: the last token's final hidden state, run in the engine's batches)."""
        eng = self.server.loop.engine
        model = getattr(eng, "model", None)

        def parse(body: dict):
            if not callable(getattr(model, "compute_scores", None)):
                raise BadRequest("classify: the served model has no sequence-classification head (load a "
                                 "*ForSequenceClassification checkpoint)", "model")
            return _prompt_ids(eng, body, chat=False, key="input"), "last", None

        done = self._pooling_route(parse)
        if done is None:
            return
        body, outs, _ = done
        # the score head only reads its weight: computed here, off the engine's thread
        probs = torch.softmax(model.compute_scores(torch.stack([o.embedding for o in outs])).cpu(), dim=-1)
        labels = model.config.labels
        data = [{"index": i, "label": labels[int(p.argmax())], "probs": p.tolist(), "num_classes": len(labels)}
                for i, p in enumerate(probs)]
        self._pooled_reply(body, outs, {"id": f"classify-{time.monotonic_ns()}", "object": "list",
                                        "created": int(time.time()), "data": data})

    def _score(self, rerank: bool) -> None:
        """``POST /score`` (vLLM's: ``text_1`` one text or a list, ``text_2`` one or a list; pairwise or the one
        against each) -> ``data`` of ``{"index", "object": "score", "score"}``; ``POST /rerank`` (Jina / Cohere's:
        ``query``, ``documents``, optional ``top_n``) -> ``results`` of ``{"index", "document": {"text"},
        "relevance_score"}``, best first. Scores as :meth:`Engine.score`: a one-label classifier's sigmoid over the
        joined pair, or the cosine of an embedding model's last-token embeddings."""
        eng = self.server.loop.engine

        def parse(body: dict):
            top_n = None
            if rerank:
                first, second, top_n = body.get("query"), body.get("documents"), _number(body, "top_n", int)
                if not isinstance(first, (str, list)) or not first:
                    raise BadRequest("query must be a non-empty string or token ids", "query")
                if not isinstance(second, list) or not second:
                    raise BadRequest("documents must be a non-empty list of strings or token ids", "documents")
                if isinstance(first, list) and not all(isinstance(t, int) for t in first):
                    raise BadRequest("query must be one text (a string or token ids)", "query")
                if top_n is not None and top_n < 1:
                    raise BadRequest("top_n must be >= 1", "top_n")
            else:
                first, second = body.get("text_1"), body.get("text_2")
                for name, v in (("text_1", first), ("text_2", second)):
                    if not isinstance(v, (str, list)) or not v:
                        raise BadRequest(f"{name} must be a non-empty string, token ids, or a list of either", name)
            try:
                prompts, n = score_prompts(eng, first, second)
            except (ValueError, TypeError) as e:
                raise BadRequest(str(e), "documents" if rerank else "text_2") from None
            return prompts, "last", (second, n, top_n)

        done = self._pooling_route(parse)
        if done is None:
            return
        body, outs, (second, n, top_n) = done
        scores = pair_scores(eng.model, outs, n)  # reads the score head's weight only: off the engine's thread
        ident = f"{'rerank' if rerank else 'score'}-{time.monotonic_ns()}"
        if not rerank:
            self._pooled_reply(body, outs, {"id": ident, "object": "list", "created": int(time.time()), "data": [
                {"index": i, "object": "score", "score": v} for i, v in enumerate(scores)]})
            return
        order = sorted(range(n), key=lambda i: -scores[i])[:top_n]
        self._pooled_reply(body, outs, {"id": ident, "results": [
            {"index": i, "document": {"text": second[i] if isinstance(second[i], str) else None},
             "relevance_score": scores[i]} for i in order]})

    def _lora_admin(self, route: str) -> None:
        """``POST /v1/load_lora_adapter`` / ``/v1/unload_lora_adapter``, run on the engine's thread."""
        try:
            body = self._read_json()
            if not isinstance(body.get("lora_name"), str) or not body["lora_name"]:
                raise BadRequest("expected a JSON object with lora_name (a non-empty string)", "lora_name")
            name = body["lora_name"]
            if route.endswith("/load_lora_adapter"):
                path = body.get("lora_path")
                if not isinstance(path, str) or not path:
                    raise BadRequest("expected lora_path (a PEFT adapter directory)", "lora_path")
                self.server.loop.call(lambda eng: eng.add_lora(name, path))
                msg = f"loaded LoRA adapter {name!r}"
            else:
                self.server.loop.call(lambda eng: eng.remove_lora(name))
                msg = f"unloaded LoRA adapter {name!r}"
        except BadRequest as e:
            self._refuse(e)
            return
        except (ValueError, TypeError, OSError) as e:  # the engine's own checks, an unreadable directory
            self._error(400, str(e))
            return
        self._json(200, {"status": "ok", "message": msg})

    def _sleep_mode(self, route: str) -> None:
        """vLLM's development routes, run on the engine's thread: ``POST /reset_prefix_cache`` -> ``{"reset": bool}``
        (false while requests hold KV pages), ``POST /sleep`` (``level`` 1 or 2, in the query or a JSON body),
        ``POST /wake_up`` (``tags``: ``?tags=weights`` or a JSON list; default all), ``GET /is_sleeping``; 400 for
        what the engine refuses (running requests, a bad level or tag, an engine without them)."""
        from urllib.parse import parse_qs

        path, _, query = route.partition("?")
        loop = self.server.loop
        try:
            args = {k: v if k == "tags" else v[-1] for k, v in parse_qs(query).items()}
            if self.command == "POST":
                args.update(self._read_json())
            if path == "/is_sleeping":
                out = {"is_sleeping": bool(loop.engine.is_sleeping)}
            elif path == "/reset_prefix_cache":
                out = {"reset": loop.call(lambda eng: eng.reset_prefix_cache())}
            elif path == "/sleep":
                level = args.get("level", 1)
                level = int(level) if isinstance(level, str) and level.isdigit() else level  # from the query
                loop.call(lambda eng: eng.sleep(level))
                out = {"status": "ok"}
            else:
                loop.call(lambda eng: eng.wake_up(args.get("tags")))
                out = {"status": "ok"}
        except BadRequest as e:
            self._refuse(e)
            return
        except (ValueError, TypeError, RuntimeError, AttributeError) as e:
            self._error(400, str(e))
            return
        self._json(200, out)

    def _first_outputs(self, q: queue.Queue, index: dict[str, int]) -> list | None:
        """Each request's first output, in arrival order; on a refused one, the others are aborted and the
        error is answered (None)."""
        first, seen = [], set()
        while len(seen) < len(index):
            rid, item = q.get()
            if isinstance(item, RequestOutput):
                seen.add(rid)
                first.append((rid, item))
                continue
            for other in index:
                if other != rid:
                    self.server.loop.abort(other)
            if item is None or isinstance(item, (ValueError, TypeError)):
                prefix = f"prompt {index[rid]}: " if len(index) > 1 else ""
                self._error(400, prefix + (str(item) if item is not None else "request aborted"))
            else:
                self._error(500, str(item))
            return None
        return first

    def _whole(self, index: dict[str, int], q: queue.Queue, first: list, reply: _Reply) -> None:
        final: dict[str, RequestOutput] = {}
        pending = list(first)
        while len(final) < len(index):
            rid, out = pending.pop(0) if pending else q.get()
            if not isinstance(out, RequestOutput):
                for other in index:
                    if other not in final:
                        self.server.loop.abort(other)
                self._error(500, str(out) if out is not None else "request aborted")
                return
            if out.finished:
                final[rid] = out
        eng = self.server.loop.engine
        choices, prompt_tokens, completion_tokens = [], 0, 0
        for rid, i in sorted(index.items(), key=lambda kv: kv[1]):
            out = final[rid]
            reason = out.finish_reason  # "stop" / "length", as OpenAI names them
            prompt_tokens += len(out.prompt_token_ids)
            completion_tokens += len(out.token_ids)
            if reply.chat:
                message, reason = reply_message(reply, self.server.tool_parser, out.text, reason)
                choices.append({"index": i, "message": message, "logprobs": _logprobs(eng, out, 0, chat=True),
                                "finish_reason": reason})
            else:
                text, lp = out.text, _logprobs(eng, out, 0, chat=False)
                if reply.echo is not None:
                    text = reply.echo[i // reply.n] + text
                    if lp is not None and out.prompt_logprobs is not None:
                        lp = _echo_logprobs(eng, out, lp)
                choices.append({"index": i, "text": text, "logprobs": lp, "finish_reason": reason})
            if out.prompt_logprobs is not None and reply.show_prompt_logprobs:
                choices[-1]["prompt_logprobs"] = _prompt_logprobs(eng, out)
        self._json(200, {"id": next(iter(index)), "object": "chat.completion" if reply.chat else "text_completion",
                         "created": int(time.time()), "model": self.server.model_name, "choices": choices,
                         "usage": _usage(prompt_tokens, completion_tokens)})

    def _stream(self, index: dict[str, int], q: queue.Queue, first: list, reply: _Reply) -> None:
        """Server-sent chunks, one per step that advanced a choice. Named and required tool calls stream their
        arguments; an auto chat choice is read by its :class:`~infercore.tool_parsers.ToolStream`, which sends its
        content, each call once named and its arguments as they grow (after the reasoning, which streams first)."""
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Cache-Control", "no-cache")
        self.send_header("Connection", "close")
        self.end_headers()
        self.close_connection = True
        eng, chat, parser = self.server.loop.engine, reply.chat, self.server.tool_parser
        choice = reply.plan.choice if chat else "none"
        tools = choice in ("named", "required") or (choice == "auto" and parser is not None)
        readers = {rid: parser.stream() for rid in index} if tools and choice == "auto" else {}
        obj = "chat.completion.chunk" if chat else "text_completion"
        created, sid = int(time.time()), next(iter(index))
        head = {"id": sid, "object": obj, "created": created, "model": self.server.model_name}
        if reply.include_usage:
            head["usage"] = None
        pending, done = list(first), set()
        texts: dict[str, str] = dict.fromkeys(index, "")
        sent: dict[str, int] = dict.fromkeys(index, 0)
        calls_sent: dict[str, list[int]] = {}  # a "required" reply's calls sent: each one's argument characters
        thought: dict[str, int] = dict.fromkeys(index, 0)  # reasoning characters sent
        usage = [0, 0]
        try:
            if chat:
                for i in sorted(index.values()):
                    self._event({**head, "choices": [{"index": i, "delta": {"role": "assistant", "content": ""},
                                                      "finish_reason": None}]})
            elif reply.echo is not None:
                for i in sorted(index.values()):
                    self._event({**head, "choices": [{"index": i, "text": reply.echo[i // reply.n], "logprobs": None,
                                                      "finish_reason": None}]})
            while len(done) < len(index):
                rid, out = pending.pop(0) if pending else q.get()
                if not isinstance(out, RequestOutput):
                    self._event({"error": {"message": str(out) if out is not None else "request aborted",
                                           "type": "server_error"}})
                    for other in index:
                        if other not in done and other != rid:
                            self.server.loop.abort(other)
                    break
                begin = len(out.token_ids) - len(out.new_token_ids)
                reason = out.finish_reason if out.finished else None
                lp = _logprobs(eng, out, begin, chat=chat)
                if tools:
                    delta, reason = self._tool_delta(reply, rid, out, texts, sent, calls_sent, thought, readers)
                    choice = {"index": index[rid], "delta": delta, "logprobs": lp, "finish_reason": reason}
                    if not delta and lp is None and reason is None:  # held back: nothing to say yet
                        continue
                elif chat and reply.reasoning is not None:  # reasoning deltas until the block closes, then content
                    texts[rid] += out.new_text
                    r, c = reply.reasoning.split(texts[rid], finished=out.finished, explicit=reply.guided)
                    delta = {}
                    if r and len(r) > thought[rid]:
                        delta["reasoning_content"], thought[rid] = r[thought[rid]:], len(r)
                    if c and len(c) > sent[rid]:
                        delta["content"], sent[rid] = c[sent[rid]:], len(c)
                    if not delta and lp is None and reason is None:
                        continue
                    choice = {"index": index[rid], "delta": delta, "logprobs": lp, "finish_reason": reason}
                elif chat:
                    choice = {"index": index[rid], "delta": {"content": out.new_text} if out.new_text else {},
                              "logprobs": lp, "finish_reason": reason}
                else:
                    choice = {"index": index[rid], "text": out.new_text, "logprobs": lp, "finish_reason": reason}
                self._event({**head, "choices": [choice]})
                if out.finished:
                    done.add(rid)
                    usage[0] += len(out.prompt_token_ids)
                    usage[1] += len(out.token_ids)
            if reply.include_usage and len(done) == len(index):
                self._event({**head, "choices": [], "usage": _usage(*usage)})
            self.wfile.write(b"data: [DONE]\n\n")
            self.wfile.flush()
        except (BrokenPipeError, ConnectionResetError):
            for rid in index:
                if rid not in done:
                    self.server.loop.abort(rid)

    def _tool_delta(self, reply: _Reply, rid: str, out: RequestOutput, texts: dict, sent: dict, calls_sent: dict,
                    thought: dict, readers: dict[str, ToolStream]) -> tuple[dict, str | None]:
        """A tool-planned chat choice's delta after ``out`` (``texts[rid]``: its text so far) and its finish reason.
        Named: the arguments as generated; required: :func:`required_calls_so_far`'s growth; auto: what the
        choice's reader (``readers[rid]``) lets out of the answer (``sent[rid]`` characters of it read; the
        reasoning before it, ``thought[rid]`` characters of it out, streams as ``reasoning_content``)."""
        texts[rid] += out.new_text
        text = texts[rid]
        delta: dict[str, Any] = {}
        if reply.plan.choice == "named":  # the output is the arguments: streamed as they come, vLLM's way
            fn: dict[str, Any] = {"arguments": out.new_text}
            call: dict[str, Any] = {"index": 0, "function": fn}
            if sent[rid] == 0:  # the call's first chunk names it
                sent[rid] = 1
                call.update(id=new_call_id(), type="function")
                fn["name"] = reply.plan.name
            elif not out.new_text:
                return delta, out.finish_reason if out.finished else None
            delta["tool_calls"] = [call]
            return delta, out.finish_reason if out.finished else None
        if reply.plan.choice == "required":  # each call once its name is out, then its arguments as they come
            done = calls_sent.setdefault(rid, [])
            pieces = []
            for k, (name, args) in enumerate(required_calls_so_far(text)):
                if name is None:
                    break  # calls stream in order
                if k == len(done):
                    pieces.append({"index": k, "id": new_call_id(), "type": "function",
                                   "function": {"name": name, "arguments": args}})
                    done.append(len(args))
                elif len(args) > done[k]:
                    pieces.append({"index": k, "function": {"arguments": args[done[k]:]}})
                    done[k] = len(args)
            if pieces:
                delta["tool_calls"] = pieces
            if not out.finished:
                return delta, None
            return delta, chat_message(reply.plan, None, text, out.finish_reason)[1]
        answer = out.new_text
        if reply.reasoning is not None:  # the reasoning as it settles; the answer after it goes to the reader
            r, c = reply.reasoning.split(text, finished=out.finished, explicit=reply.guided)
            if r and len(r) > thought[rid]:
                delta["reasoning_content"], thought[rid] = r[thought[rid]:], len(r)
            answer = (c or "")[sent[rid]:]
            sent[rid] += len(answer)
        reader = readers[rid]
        got = reader.feed(answer, final=out.finished)
        if got.content:
            delta["content"] = got.content
        if got.tool_calls:
            delta["tool_calls"] = got.tool_calls
        if not out.finished:
            return delta, None
        return delta, "tool_calls" if reader.called else out.finish_reason

    def _event(self, obj: dict) -> None:
        self.wfile.write(b"data: " + json.dumps(obj).encode() + b"\n\n")
        self.wfile.flush()


class _Server(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, addr, loop: EngineLoop, model_name: str, verbose: bool, tool_parser: ToolParser | None
                 ) -> None:
        super().__init__(addr, _Handler)
        self.loop, self.model_name, self.verbose, self.tool_parser = loop, model_name, verbose, tool_parser
        self.reasoning_parser: ReasoningParser | None = None
        self.created = int(time.time())


def make_server(engine: Engine | MirroredEngine | AdaptiveEngine, *, host: str = "127.0.0.1", port: int = 8000,
                model_name: str = "infercore", verbose: bool = False, tool_call_parser: str | None = "hermes",
                reasoning_parser: str | None = None) -> _Server:
    """An HTTP server (not started: call ``serve_forever()``, or run it in a thread) whose engine loop is
    running. ``port=0`` picks a free port (``server.server_address``). ``server.shutdown()`` then
    ``server.loop.close()`` stop it. ``tool_call_parser``: the format (:data:`infercore.tool_parsers.TOOL_PARSERS`)
    that ``tool_choice: "auto"`` replies are read in; None leaves their text alone. ``reasoning_parser``: the format
    (:data:`infercore.reasoning_parsers.REASONING_PARSERS`, e.g. "deepseek_r1", "qwen3") whose reasoning block chat
    replies return as ``reasoning_content``; None (the default): none."""
    from .parallel import AdaptiveEngine, MirroredEngine

    if not isinstance(engine, (Engine, MirroredEngine, AdaptiveEngine)):
        raise TypeError(f"engine: expected an Engine (or rank 0's MirroredEngine / AdaptiveEngine), got "
                        f"{type(engine).__name__}")
    if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
        raise ValueError(f"port: expected an int in [0, 65535], got {port!r}")
    parser = None if tool_call_parser is None else get_tool_parser(tool_call_parser)
    reasoning = None if reasoning_parser is None else get_reasoning_parser(reasoning_parser)
    server = _Server((host, port), EngineLoop(engine), model_name, verbose, parser)
    server.reasoning_parser = reasoning
    return server
