"""Driving the engines of a tensor-parallel group from one rank (serving).

Every rank of a sharded model must make the same engine calls in the same order. Offline (``generate``) every
rank simply runs the same script. A server receives its requests on rank 0 only, so rank 0 drives a
:class:`MirroredEngine`: each call that changes the engine (``add_request``, ``abort``, ``step``) is broadcast to
the other ranks before it runs, and they replay it in :func:`follow` until rank 0 calls :meth:`MirroredEngine.close`.
"""

from __future__ import annotations

import torch.distributed as dist

from ..engine import Engine
from ..engine.engine import _one_prompt, _per_prompt, run_to_completion, stream_outputs

_STOP = "stop"


def _broadcast(obj, group, shm=None) -> object:
    """Rank 0's ``obj`` on every rank of ``group`` (through ``shm``, a :class:`~.shm.ShmGroup`, where given)."""
    if shm is not None:
        return shm.all_gather_object(obj)[0]
    box = [obj]
    dist.broadcast_object_list(box, src=dist.get_global_rank(group, 0) if group is not None else 0, group=group)
    return box[0]


class MirroredEngine:
    """Rank 0's view of the group's engines: the calls that change an engine (``add_request``, ``abort``,
    ``step``, ``settle``, ``take_requests``, ``adopt_request``, ``add_lora`` / ``remove_lora`` (every rank loads the
    adapter and keeps the same slot table), and ``generate`` / ``stream`` through them) are sent
    to the followers first. Everything else (``has_unfinished``, ``tokenizer``, ``requests``, ...) reads rank 0's
    engine."""

    def __init__(self, engine: Engine) -> None:
        if not isinstance(engine, Engine):
            raise TypeError(f"engine: expected an Engine, got {type(engine).__name__}")
        if getattr(engine.model, "tp_size", 1) < 2:
            raise ValueError("engine: its model is not sharded (parallel.tensor_parallel_); nothing to mirror")
        if engine.model.tp_rank != 0:
            raise ValueError(f"engine: rank {engine.model.tp_rank} follows (parallel.follow); rank 0 drives")
        self.engine = engine
        self.group = engine.model.tp_group
        self.shm = getattr(engine.model, "tp_shm", None)
        self._closed = False

    def __getattr__(self, name):
        return getattr(self.engine, name)

    def _call(self, name: str, *args, **kwargs):
        if self._closed:
            raise RuntimeError("MirroredEngine: closed")
        _broadcast((name, args, kwargs), self.group, self.shm)
        return getattr(self.engine, name)(*args, **kwargs)

    def add_request(self, *args, **kwargs) -> str:
        return self._call("add_request", *args, **kwargs)

    def abort(self, request_id: str) -> None:
        return self._call("abort", request_id)

    def step(self):
        return self._call("step")

    def settle(self) -> None:
        return self._call("settle")

    def add_lora(self, name: str, adapter) -> None:
        """Load a LoRA adapter on every rank (a path each rank reads, or a ``LoRAAdapter`` sent to each); each rank's
        slots take its slice of it."""
        return self._call("add_lora", name, adapter)

    def remove_lora(self, name: str) -> None:
        return self._call("remove_lora", name)

    def take_requests(self):
        """Rank 0's unfinished requests, taken out of every rank's engine alike (see :meth:`Engine.take_requests`)."""
        return self._call("take_requests")

    def adopt_request(self, request) -> str:
        return self._call("adopt_request", request)

    def generate(self, prompts, params=None, *, chat: bool = False, lora=None) -> list:
        """Run a batch of prompts to completion on every rank; rank 0's outputs, in the prompts' order (``lora``: one
        adapter name, or one per prompt, as :meth:`Engine.generate`). A bad prompt queues none of them (the ones
        queued before it are aborted on every rank)."""
        prompts = [prompts] if _one_prompt(prompts) else list(prompts)
        plist, loras = _per_prompt("params", params, len(prompts)), _per_prompt("lora", lora, len(prompts))
        ids: list[str] = []
        try:
            for p, sp, la in zip(prompts, plist, loras):
                ids.append(self.add_request(p, sp, chat=chat, lora=la))
        except (ValueError, TypeError):
            for rid in ids:
                self.abort(rid)
            raise
        return run_to_completion(self, ids)

    def stream(self, prompt, params=None, *, chat: bool = False, lora: str | None = None):
        """Yield this request's output after every step that advanced it, every rank stepping alike."""
        return stream_outputs(self, self.add_request(prompt, params, chat=chat, lora=lora))

    def close(self) -> None:
        """Release the followers (their :func:`follow` returns)."""
        if not self._closed:
            _broadcast((_STOP, (), {}), self.group, self.shm)
            self._closed = True


def follow(engine: Engine) -> int:
    """On a rank other than 0: replay rank 0's engine calls on ``engine`` until it closes; returns how many ran.
    A call that raises on rank 0 (a refused request, a failed step) raises here too, and is passed over alike."""
    group, shm = engine.model.tp_group, getattr(engine.model, "tp_shm", None)
    n = 0
    while True:
        name, args, kwargs = _broadcast(None, group, shm)
        if name == _STOP:
            return n
        try:
            getattr(engine, name)(*args, **kwargs)
        except Exception:  # noqa: BLE001  (rank 0 met the same error in the same call, and goes on)
            pass
        n += 1
