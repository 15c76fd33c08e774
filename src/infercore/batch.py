"""Offline batch jobs in the OpenAI Batch API's file format (``infercore run-batch``, as vLLM's ``run-batch``).

Each input line is one request, ``{"custom_id": ..., "method": "POST", "url": "/v1/chat/completions", "body":
{...}}``; each output line answers one, in input order: ``{"id", "custom_id", "response": {"status_code",
"request_id", "body"}, "error"}`` (``error`` set and ``response`` null for a line that is not a request at all).
Every request runs through the OpenAI-compatible server's own routes (:mod:`infercore.serve`: an in-process server
on a loopback port), so a batch answers exactly as the server would, and up to ``concurrency`` requests are in the
engine at once, batched together.

Routes: ``/v1/chat/completions``, ``/v1/completions``, ``/v1/embeddings``, ``/v1/score``, ``/v1/rerank``,
``/classify``. ``"stream": true`` is refused per line (a batch answers whole).
"""

from __future__ import annotations

import http.client
import json
import secrets
import threading
from collections.abc import Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor

__all__ = ["BATCH_URLS", "run_batch"]

BATCH_URLS = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/score", "/v1/rerank", "/classify")


def _line_error(custom_id, code: str, message: str) -> dict:
    return {"id": f"batch_req_{secrets.token_hex(12)}", "custom_id": custom_id, "response": None,
            "error": {"code": code, "message": message}}


def _parse(line: str, n: int) -> tuple[dict | None, dict | None]:
    """``(request, None)`` or ``(None, error line)`` for input line ``n`` (1-based)."""
    try:
        req = json.loads(line)
    except json.JSONDecodeError as e:
        return None, _line_error(None, "invalid_json", f"line {n}: not JSON ({e.msg})")
    if not isinstance(req, dict):
        return None, _line_error(None, "invalid_request", f"line {n}: expected an object")
    cid = req.get("custom_id")
    if cid is not None and not isinstance(cid, str):
        return None, _line_error(None, "invalid_request", f"line {n}: custom_id must be a string")
    if str(req.get("method", "POST")).upper() != "POST":
        return None, _line_error(cid, "invalid_request", f"line {n}: method must be POST, got {req.get('method')!r}")
    url = req.get("url")
    if url not in BATCH_URLS:
        return None, _line_error(cid, "invalid_url", f"line {n}: url must be one of {', '.join(BATCH_URLS)}, "
                                                     f"got {url!r}")
    body = req.get("body")
    if not isinstance(body, dict):
        return None, _line_error(cid, "invalid_request", f"line {n}: body must be an object")
    if body.get("stream"):
        return None, _line_error(cid, "invalid_request", f"line {n}: stream is not supported in a batch")
    return req, None


def _post(address: tuple[str, int], url: str, body: dict, timeout: float) -> tuple[int, dict]:
    conn = http.client.HTTPConnection(*address, timeout=timeout)
    try:
        conn.request("POST", url, json.dumps(body), {"Content-Type": "application/json"})
        r = conn.getresponse()
        data = r.read()
        try:
            payload = json.loads(data) if data else {}
        except json.JSONDecodeError:
            payload = {"error": {"message": data.decode("utf-8", "replace")}}
        return r.status, payload
    finally:
        conn.close()


def run_batch(engine, lines: Iterable[str], *, model_name: str = "infercore", concurrency: int = 64,
              tool_call_parser: str | None = "hermes", reasoning_parser: str | None = None,
              timeout: float = 3600.0) -> Iterator[dict]:
    """Answer each request line of ``lines`` (the OpenAI Batch API's input format; blank lines skipped) with its
    output line (a dict), in input order, running up to ``concurrency`` requests at once through ``engine`` (an
    :class:`~infercore.engine.Engine`, or rank 0's ``MirroredEngine`` / ``AdaptiveEngine``). ``model_name``,
    ``tool_call_parser``, ``reasoning_parser``: as :func:`infercore.serve.make_server` takes them; a request whose
    body's ``model`` names a loaded LoRA adapter runs through it. A line that is not a valid request gets an output
    line with ``error`` set; a request the server refuses gets its status code and error body."""
    from .serve import make_server

    if isinstance(concurrency, bool) or not isinstance(concurrency, int) or concurrency < 1:
        raise ValueError(f"concurrency: expected an int >= 1, got {concurrency!r}")
    server = make_server(engine, host="127.0.0.1", port=0, model_name=model_name, tool_call_parser=tool_call_parser,
                         reasoning_parser=reasoning_parser)
    address = server.server_address[:2]
    thread = threading.Thread(target=server.serve_forever, name="infercore-batch-server", daemon=True)
    thread.start()

    def answer(req: dict) -> dict:
        status, payload = _post(address, req["url"], req["body"], timeout)
        rid = payload.get("id") if isinstance(payload, dict) else None
        return {"id": f"batch_req_{secrets.token_hex(12)}", "custom_id": req.get("custom_id"),
                "response": {"status_code": status, "request_id": rid or f"req_{secrets.token_hex(8)}",
                             "body": payload},
                "error": None}

    try:
        with ThreadPoolExecutor(max_workers=concurrency, thread_name_prefix="infercore-batch") as pool:
            pending = []
            for n, line in enumerate(lines, 1):
                if not line.strip():
                    continue
                req, err = _parse(line, n)
                pending.append(pool.submit(lambda e=err: e) if req is None else pool.submit(answer, req))
                while len(pending) > 4 * concurrency:  # bounded look-ahead: answers leave in order as they finish
                    yield pending.pop(0).result()
            for f in pending:
                yield f.result()
    finally:
        server.shutdown()
        server.server_close()
        server.loop.close()
        thread.join(timeout=10)
