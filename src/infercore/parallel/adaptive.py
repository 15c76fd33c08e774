"""Adaptive parallelism: one group of ranks that switches between a tensor-parallel and a data-parallel layout
with the load.

Tensor parallelism (TP) splits every layer over the ranks: each step reads ``1 / world`` of the weights per rank
and pays two all-reduces a layer, so a lone request decodes faster than on one rank. Data parallelism (DP) gives
each rank a whole replica and its own requests: no collectives in the forward, so under a high load the group
serves more tokens per second. Load is tidal; :class:`AdaptiveEngine` keeps both layouts resident on every rank
(the replica, plus the rank's TP shard: ``1 + 1 / world`` of the weights) and moves the unfinished requests from one
layout's engines to the other's when :class:`LoadPolicy` says so.

A switch settles the in-flight step and moves every unfinished request with
:meth:`Engine.take_requests <infercore.Engine.take_requests>` / :meth:`~infercore.Engine.adopt_request`, and its
KV with :meth:`~infercore.Engine.read_prefix_kv` / :meth:`~infercore.Engine.write_prefix_kv`: TP to DP, the ranks'
head slices of each request's computed full pages are gathered on the request's new rank; DP to TP, each rank
takes its heads' slice of the owner's pages. The adopting engine finds that KV in its prefix cache and computes
only the rest (the last partial page, or everything where the pools cannot exchange KV: hybrid or quantized KV,
prefix caching off). Sampling depends on a request's seed and position alone, so its tokens do not depend on where
it ran, up to the rounding differences of the two layouts' sums (exact in the fp32 tests on the CPU).

Rank 0 drives, as :class:`~infercore.parallel.MirroredEngine` does: requests arrive there, and each
:meth:`AdaptiveEngine.step` first broadcasts what changed (the layout, new requests, aborts); the other ranks run
:meth:`AdaptiveEngine.follow` until rank 0 calls :meth:`AdaptiveEngine.close`. In DP a new request goes to the
rank with the fewest unfinished requests, and the ranks' outputs are gathered to rank 0 after every step.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..engine import Engine, EngineConfig, RequestOutput, SamplingParams
from ..engine.engine import _one_prompt, run_to_completion, stream_outputs
from .spmd import _broadcast
from .tensor import tensor_parallel_

TP, DP = "tp", "dp"
_STOP = "stop"
_LORA = "lora"  # a message that loads or unloads a LoRA adapter in both engines of every rank


@dataclass
class LoadPolicy:
    """When to switch. ``low`` is the layout under a light load, ``high`` under a heavy one (TP and DP, the usual
    way round: TP's latency for a few requests, DP's throughput for many; the other way round, or one layout for
    both, where that measures better). ``high_at``: switch to ``high`` once at least this many requests are
    unfinished (queued included); ``low_at``: back to ``low`` once at most this many are. ``min_steps``: steps spent
    in a layout before it may switch again, so that a load near a threshold does not pay a switch (a settle, and
    every unfinished request's KV gathered or recomputed) every step. With ``low == high`` the group stays in that
    layout (it moves there at once from the other). :meth:`from_rates` derives a policy from measured tokens/s of
    both layouts (``benchmarks/bench_adaptive_parallel.py`` measures them)."""

    high_at: int = 8
    low_at: int = 2
    min_steps: int = 16
    low: str = TP
    high: str = DP

    def validate(self) -> None:
        for name in ("high_at", "low_at", "min_steps"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                raise ValueError(f"LoadPolicy.{name}: expected an int >= 0, got {v!r}")
        if self.low_at >= self.high_at:
            raise ValueError(f"LoadPolicy: low_at ({self.low_at}) must be below high_at ({self.high_at})")
        for name in ("low", "high"):
            if getattr(self, name) not in (TP, DP):
                raise ValueError(f"LoadPolicy.{name}: expected 'tp' or 'dp', got {getattr(self, name)!r}")

    def choose(self, mode: str, load: int, steps_in_mode: int) -> str:
        """The layout for the next step, given the current one, the unfinished requests and the steps spent in
        the current layout."""
        if self.low == self.high:
            return self.low
        if steps_in_mode < self.min_steps:
            return mode
        if mode == self.low and load >= self.high_at:
            return self.high
        if mode == self.high and load <= self.low_at:
            return self.low
        return mode

    @classmethod
    def from_rates(cls, rates: dict[int, dict[str, float]], *, min_steps: int = 16) -> LoadPolicy:
        """A policy from measured throughput: ``rates[batch] = {"tp": tokens/s, "dp": tokens/s}`` at two or more
        batch sizes. ``low`` is the faster layout at the smallest batch, ``high`` the faster at the largest; the
        switch comes at the smallest measured batch from which ``high`` stays ahead (``high_at``), and back at the
        measured batch below it (``low_at``)."""
        if len(rates) < 2 or any(set(r) != {TP, DP} for r in rates.values()):
            raise ValueError("rates: expected {batch: {'tp': tokens/s, 'dp': tokens/s}} for two or more batches")
        batches = sorted(rates)
        best = [max(rates[b], key=rates[b].get) for b in batches]
        low, high = best[0], best[-1]
        if low == high:
            return cls(high_at=1 << 30, low_at=0, min_steps=min_steps, low=low, high=high)
        i = len(best) - 1
        while i > 0 and best[i - 1] == high:
            i -= 1
        return cls(high_at=batches[i], low_at=batches[i - 1], min_steps=min_steps, low=low, high=high)


def build_adaptive(model, tokenizer=None, *, group=None, experts: str = "tp", quantization: str | None = None,
                   tp_engine_kwargs: dict | None = None, dp_engine_kwargs: dict | None = None,
                   policy: LoadPolicy | None = None, mode: str = TP) -> AdaptiveEngine:
    """On every rank of ``group`` (default: the world), with the same loaded unsharded Llama-family ``model``:
    keep ``model`` as this rank's DP replica, shard a copy of it for TP (:func:`tensor_parallel_`, ``experts`` as
    there), quantize both to ``quantization`` (a scheme of :data:`infercore.quant.SCHEMES`) if given, and build both
    engines (``*_engine_kwargs`` go to :class:`~infercore.Engine`). On a GPU, engines given no KV budget
    (``kv_cache_bytes`` / ``num_pages`` / ``gpu_memory_fraction``) share the default fraction of free memory
    between them, half each."""
    tp_kw, dp_kw = dict(tp_engine_kwargs or {}), dict(dp_engine_kwargs or {})
    tp_model = tensor_parallel_(copy.deepcopy(model), group, experts=experts)
    if quantization is not None:
        from ..quant import quantize

        quantize(tp_model, quantization)
        quantize(model, quantization)
    sized = ("kv_cache_bytes", "num_pages", "gpu_memory_fraction")
    if next(model.parameters()).device.type == "cuda":
        share = EngineConfig.gpu_memory_fraction / 2
        if not any(k in tp_kw for k in sized):
            tp_kw["gpu_memory_fraction"] = share
        if not any(k in dp_kw for k in sized):  # of what the TP engine left: about the other half of the total
            dp_kw["gpu_memory_fraction"] = min(0.95, share / (1 - share))
    tp_engine = Engine(tp_model, tokenizer, **tp_kw)
    dp_engine = Engine(model, tokenizer, **dp_kw)
    return AdaptiveEngine(dp_engine, tp_engine, policy=policy, mode=mode)


class AdaptiveEngine:
    """A TP engine and a DP engine on every rank of the TP engine's group, one of them serving at a time.

    ``dp_engine``: this rank's engine over a whole (unsharded) replica. ``tp_engine``: the engine over this rank's
    shard of the same model (:func:`tensor_parallel_`). Build both on every rank (:func:`build_adaptive` does), then
    drive from rank 0 (``add_request``, ``abort``, ``step``, ``generate``, ``close``) while the other ranks call
    :meth:`follow`. ``mode``: the starting layout, ``"tp"`` or ``"dp"``.

    ``switches`` lists the layout changes (rank 0: step index, layout, requests moved, tokens of KV rank 0 wrote
    instead of recomputing, seconds the move took, outputs included). ``move_kv=False`` recomputes every moved
    request's KV instead of sending it.
    """

    def __init__(self, dp_engine: Engine, tp_engine: Engine, *, policy: LoadPolicy | None = None,
                 mode: str = TP, move_kv: bool = True) -> None:
        for name, eng in (("dp_engine", dp_engine), ("tp_engine", tp_engine)):
            if not isinstance(eng, Engine):
                raise TypeError(f"{name}: expected an Engine, got {type(eng).__name__}")
        if getattr(tp_engine.model, "tp_size", 1) < 2:
            raise ValueError("tp_engine: its model is not sharded (parallel.tensor_parallel_)")
        if getattr(dp_engine.model, "tp_size", 1) != 1:
            raise ValueError("dp_engine: its model is sharded; it must be a whole replica")
        if mode not in (TP, DP):
            raise ValueError(f"mode: expected 'tp' or 'dp', got {mode!r}")
        if getattr(dp_engine.model, "config", None) != getattr(tp_engine.model, "config", None):
            raise ValueError("dp_engine, tp_engine: not engines of one model (their model configs differ)")
        self.policy = policy or LoadPolicy()
        if not isinstance(self.policy, LoadPolicy):
            raise TypeError(f"policy: expected a LoadPolicy, got {type(self.policy).__name__}")
        self.policy.validate()
        self.dp, self.tp = dp_engine, tp_engine
        self.group = tp_engine.model.tp_group
        self.shm = getattr(tp_engine.model, "tp_shm", None)  # the control messages go through it too
        self.world, self.rank = tp_engine.model.tp_size, tp_engine.model.tp_rank
        self.mode = mode
        # A switch sends the moved requests' KV along (Engine.read_prefix_kv / write_prefix_kv) where both engines'
        # pools are dense ones of plain tensors with prefix caching on and pages of one size; else it is recomputed.
        self.move_kv = bool(move_kv) and dp_engine._plain_kv() is not None and tp_engine._plain_kv() is not None \
            and dp_engine.config.page_size == tp_engine.config.page_size
        self.steps_in_mode = 0
        self.num_steps = 0
        self.switches: list[dict] = []
        # rank 0's books: each unfinished request's place (-1: the TP engines, r: rank r's DP engine), in arrival
        # order; what the next step's message carries
        self._owner: dict[str, int] = {}
        self._lora_of: dict[str, str] = {}  # rank 0: the adapter of each unfinished request that has one
        self._adds: list = []
        self._aborts: list[str] = []
        self._next_id = 0
        self._closed = False

    # ------------------------------------------------------------------ rank 0

    def _driver(self, what: str) -> None:
        if self.rank != 0:
            raise RuntimeError(f"AdaptiveEngine.{what}: rank {self.rank} follows (call follow()); rank 0 drives")
        if self._closed:
            raise RuntimeError("AdaptiveEngine: closed")

    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None, *,
                    request_id: str | None = None, chat: bool = False, lora: str | None = None) -> str:
        """Queue a request (rank 0); checked like :meth:`Engine.add_request`, against both layouts' engines, since
        it may run in either. It reaches its engine at the next :meth:`step`. ``lora``: a loaded adapter's name
        (:meth:`add_lora`); the request keeps it when it moves between the layouts."""
        self._driver("add_request")
        return self._new(prompt, params, request_id, chat, final_only=False, lora=lora)

    def add_lora(self, name: str, adapter) -> None:
        """Load a LoRA adapter (a PEFT directory every rank can read, or a :class:`~infercore.lora.LoRAAdapter`,
        sent to every rank) into both engines of every rank (rank 0; both need ``max_loras > 0``: pass it in both
        engines' kwargs). Checked on rank 0's engines first, so a refused adapter reaches no rank."""
        self._driver("add_lora")
        for eng in (self.dp, self.tp):
            if eng.lora is None:
                raise ValueError("add_lora: LoRA is not enabled; build both engines with max_loras > 0")
            if name in eng.lora.adapters:
                raise ValueError(f"add_lora: a LoRA adapter named {name!r} is already loaded")
        self._lora_call(("add", name, adapter))

    def remove_lora(self, name: str) -> None:
        """Unload adapter ``name`` from every engine (rank 0); ValueError if it is not loaded or an unfinished
        request uses it."""
        self._driver("remove_lora")
        if name not in self.list_loras():
            raise ValueError(f"remove_lora: no LoRA adapter named {name!r} is loaded")
        busy = [rid for rid, la in self._lora_of.items() if la == name and rid in self._owner]
        if busy:
            raise ValueError(f"remove_lora: adapter {name!r} is in use by request(s) {busy[:4]}")
        self._lora_call(("remove", name))

    def list_loras(self) -> list[str]:
        """The loaded adapters' names."""
        return self.dp.list_loras()

    def _lora_call(self, op: tuple) -> None:
        msg = (_LORA, op, (), None)
        _broadcast(msg, self.group, self.shm)
        self._run(msg)

    def _lora_op(self, op: tuple) -> list:
        for eng in (self.dp, self.tp):
            if op[0] == "add":
                eng.add_lora(op[1], op[2])
            else:
                eng.remove_lora(op[1])
        return []

    def _new(self, prompt, params, request_id, chat: bool, *, final_only: bool, lora: str | None = None) -> str:
        if request_id is None:
            while str(self._next_id) in self._owner:
                self._next_id += 1
            request_id = str(self._next_id)
            self._next_id += 1
        request_id = str(request_id)
        if request_id in self._owner:
            raise ValueError(f"request_id {request_id!r} is already in use")
        req = self.dp._new_request(prompt, params, request_id=request_id, chat=chat,
                                   lora=lora)  # checked against dp's pool (and its adapters)
        if req.num_tokens >= self.tp.max_model_len:  # and against tp's: a request may run in either
            raise ValueError(f"prompt has {req.num_tokens} tokens; the model's context is {self.tp.max_model_len}")
        self.tp._check_fits(min(req.num_tokens + req.params.max_tokens, self.tp.max_model_len), req.num_tokens)
        req._final_only = final_only
        self._owner[request_id] = -1  # placed when the step's layout is known
        if lora is not None:
            self._lora_of[request_id] = lora
        self._adds.append(req)
        return request_id

    def abort(self, request_id: str) -> None:
        """Abort a request (rank 0); it leaves at the next step, and reports no output."""
        self._driver("abort")
        rid = str(request_id)
        self._lora_of.pop(rid, None)
        if self._owner.pop(rid, None) is None:
            return
        kept = [r for r in self._adds if r.request_id != rid]
        if len(kept) == len(self._adds):
            self._aborts.append(rid)
        self._adds = kept

    def has_unfinished(self) -> bool:
        return bool(self._owner)

    def step(self) -> list[RequestOutput]:
        """One step of the group (rank 0): pick the layout, send the changes, step every rank's engine of that
        layout; returns the outputs of every request that advanced, wherever it ran."""
        self._driver("step")
        mode = self.policy.choose(self.mode, len(self._owner), self.steps_in_mode)
        adds, self._adds = self._adds, []
        if mode == DP:
            counts = [0] * self.world
            for r in self._owner.values():
                if r >= 0:
                    counts[r] += 1
            dest = [_least_loaded(counts) for _ in adds]
        else:
            dest = [-1] * len(adds)
        msg = (mode, list(zip(adds, dest)), self._aborts, list(self._owner) if mode != self.mode else None)
        self._aborts = []
        _broadcast(msg, self.group, self.shm)
        outs = self._run(msg)
        for out in outs:
            if out.finished:
                self._owner.pop(out.request_id, None)
                self._lora_of.pop(out.request_id, None)
        return outs

    def generate(self, prompts: str | list[int] | Iterable[str | list[int]],
                 params: SamplingParams | list[SamplingParams] | None = None, *, chat: bool = False,
                 lora: str | list[str | None] | None = None) -> list[RequestOutput]:
        """Run a batch of prompts to completion (rank 0); outputs in the prompts' order (``lora``: one adapter name
        for all, or one name or None per prompt)."""
        self._driver("generate")
        prompts = [prompts] if _one_prompt(prompts) else list(prompts)
        plist = params if isinstance(params, list) else [params] * len(prompts)
        if len(plist) != len(prompts):
            raise ValueError(f"params has {len(plist)} entries for {len(prompts)} prompts")
        loras = lora if isinstance(lora, list) else [lora] * len(prompts)
        if len(loras) != len(prompts):
            raise ValueError(f"lora has {len(loras)} entries for {len(prompts)} prompts")
        ids = []
        try:
            for p, sp, la in zip(prompts, plist, loras):
                ids.append(self._new(p, sp, None, chat, final_only=True, lora=la))
        except (ValueError, TypeError):
            for rid in ids:  # a bad prompt queues none of them
                self.abort(rid)
            raise
        return run_to_completion(self, ids)

    def stream(self, prompt: str | list[int], params: SamplingParams | None = None, *, chat: bool = False,
               lora: str | None = None) -> Iterator[RequestOutput]:
        """Yield this request's output after every step that advanced it (rank 0)."""
        return stream_outputs(self, self.add_request(prompt, params, chat=chat, lora=lora))

    @property
    def tokenizer(self):
        return self.dp.tokenizer

    @property
    def device(self):
        return self.dp.device

    @property
    def dtype(self):
        return self.dp.dtype

    @property
    def max_model_len(self) -> int:
        return min(self.dp.max_model_len, self.tp.max_model_len)

    def close(self) -> None:
        """Release the other ranks (their :meth:`follow` returns)."""
        if self.rank == 0 and not self._closed:
            _broadcast((_STOP, (), (), None), self.group, self.shm)
            self._closed = True

    # ------------------------------------------------------------------ every rank

    def follow(self) -> int:
        """On a rank other than 0: run rank 0's steps until it closes; returns how many ran. A step that raises
        here raised on rank 0 too (the same calls on the same state), and is passed over alike."""
        if self.rank == 0:
            raise RuntimeError("AdaptiveEngine.follow: rank 0 drives")
        n = 0
        while True:
            msg = _broadcast(None, self.group, self.shm)
            if msg[0] == _STOP:
                return n
            try:
                self._run(msg)
            except Exception:  # noqa: BLE001  (rank 0's caller sees it; this rank waits for the next step)
                pass
            n += 1

    def _run(self, msg) -> list[RequestOutput]:
        mode, adds, aborts, order = msg
        if mode == _LORA:
            return self._lora_op(adds)
        for rid in aborts:
            self.tp.abort(rid)
            self.dp.abort(rid)
        outs: list[RequestOutput] = []
        if mode != self.mode:
            t0 = time.perf_counter()
            outs, moved, kv_tokens = self._switch(mode, order)
            self.switches.append({"step": self.num_steps, "to": mode, "requests": moved, "kv_tokens": kv_tokens,
                                  "seconds": time.perf_counter() - t0})
            self.mode, self.steps_in_mode = mode, 0
        for req, r in adds:
            if r < 0:
                self.tp.adopt_request(req)
            elif r == self.rank:
                self.dp.adopt_request(req)
            if self.rank == 0:
                self._owner[req.request_id] = r
        if mode == TP:
            step_outs = self.tp.step()
            if self.rank == 0:
                outs += step_outs
        else:
            outs += self._gather(self.dp.step() if self.dp.has_unfinished() else [])
        self.steps_in_mode += 1
        self.num_steps += 1
        return outs

    def _gather(self, outs: list) -> list:
        """Every rank's ``outs`` on rank 0 (in rank order); ``[]`` elsewhere."""
        if self.shm is not None:
            box = self.shm.all_gather_object(outs)
        else:
            box = [None] * self.world if self.rank == 0 else None
            dist.gather_object(outs, box, dst=dist.get_global_rank(self.group, 0) if self.group is not None else 0,
                               group=self.group)
        return [o for part in box for o in part] if self.rank == 0 else []

    def _all_gather_object(self, obj) -> list:
        if self.shm is not None:
            return self.shm.all_gather_object(obj)
        parts = [None] * self.world
        dist.all_gather_object(parts, obj, group=self.group)
        return parts

    def _all_gather_flat(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's 1-D ``flat`` (lengths may differ), in rank order, through ``torch.distributed``."""
        sizes = self._all_gather_object(flat.numel())
        padded = torch.zeros(max(sizes), dtype=flat.dtype, device=flat.device)
        padded[: flat.numel()] = flat
        parts = [torch.empty_like(padded) for _ in range(self.world)]
        dist.all_gather(parts, padded, group=self.group)
        return [p[:n] for p, n in zip(parts, sizes)]

    def _kv_of(self, engine: Engine, reqs: list) -> tuple[list[int], torch.Tensor]:
        """Tokens of cached KV of each of ``reqs`` in ``engine`` (whole pages), and that KV flattened: per request,
        per layer, K then V."""
        if not self.move_kv:
            return [0] * len(reqs), torch.empty(0)
        ns, parts = [], []
        for req in reqs:
            n, kv = engine.read_prefix_kv(req.all_token_ids, extra_key=req.cache_salt)
            ns.append(n)
            parts += [t.reshape(-1) for pair in kv for t in pair]
        k0 = engine.runner.kv_caches[0][0]
        return ns, (torch.cat(parts) if parts else torch.empty(0, dtype=k0.dtype, device=k0.device))

    def _unflatten(self, engine: Engine, flat: torch.Tensor, ns: list[int], heads: int):
        """Per request of :meth:`_kv_of`'s ``ns``: its ``[(k, v) per layer]`` of ``heads`` KV heads (None where
        ``n == 0``), read off ``flat``."""
        shapes = [(heads, kc.shape[3]) for kc, _ in engine.runner.kv_caches]
        at, out = 0, []
        for n in ns:
            kv = []
            for h, d in shapes if n else ():
                size = n * h * d
                k = flat[at : at + size].view(n, h, d)
                v = flat[at + size : at + 2 * size].view(n, h, d)
                at += 2 * size
                kv.append((k, v))
            out.append(kv or None)
        return out

    def _switch(self, mode: str, order: list[str]) -> tuple[list[RequestOutput], int, int]:
        """Move the unfinished requests to ``mode``'s engines; returns the outputs of the steps settled on the way
        (rank 0), how many requests moved, and how many tokens of KV this rank wrote instead of recomputing.

        The KV of each request's computed full pages moves with it where both layouts' pools can take it
        (:attr:`move_kv`): TP to DP, each rank's head slices are gathered and the request's new rank writes them
        into its DP engine's prefix cache; DP to TP, the owner's whole heads are gathered and each rank writes its
        slice. The request is then adopted, and its admission takes that KV as a prefix-cache hit (if the pool
        has evicted it meanwhile, the prefix is recomputed)."""
        written = 0
        if mode == DP:
            # Every rank's TP engine holds the same requests in the same order (and the same KV pages): each rank
            # keeps its share.
            outs = self.tp.settle()
            reqs = self.tp.take_requests()
            counts = [0] * self.world
            dest = [_least_loaded(counts) for _ in reqs]
            ns, flat = self._kv_of(self.tp, reqs)
            if any(ns):  # the same on every rank
                hk = self.tp.runner.kv_caches[0][0].shape[2]
                ranks = [self._unflatten(self.tp, f, ns, hk) for f in self._all_gather_flat(flat)]
                for i, req in enumerate(reqs):
                    if dest[i] == self.rank and ns[i]:
                        kv = [tuple(torch.cat([pairs[layer][j] for pairs in (r[i] for r in ranks)], dim=1)
                                    for j in (0, 1)) for layer in range(len(ranks[0][i]))]
                        written += self.dp.write_prefix_kv(req.all_token_ids, kv, extra_key=req.cache_salt)
            for req, r in zip(reqs, dest):
                if r == self.rank:
                    self.dp.adopt_request(req)
                if self.rank == 0:
                    self._owner[req.request_id] = r
            return (outs if self.rank == 0 else []), len(reqs), written
        outs = self._gather(self.dp.settle())
        mine = self.dp.take_requests()
        ns, flat = self._kv_of(self.dp, mine)
        parts = self._all_gather_object((mine, ns))
        if any(n for _, part_ns in parts for n in part_ns):
            hk = self.tp.runner.kv_caches[0][0].shape[2]  # this rank's heads: [rank * hk, (rank + 1) * hk)
            heads = slice(self.rank * hk, (self.rank + 1) * hk)
            whole = self.dp.runner.kv_caches[0][0].shape[2]
            for (part, part_ns), f in zip(parts, self._all_gather_flat(flat)):
                for req, kv in zip(part, self._unflatten(self.dp, f, part_ns, whole)):
                    if kv is not None:
                        written += self.tp.write_prefix_kv(req.all_token_ids, [(k[:, heads], v[:, heads])
                                                                               for k, v in kv],
                                                           extra_key=req.cache_salt)
        by_id = {req.request_id: req for part, _ in parts for req in part}
        rank_of = {order[i]: i for i in range(len(order))}
        reqs = sorted(by_id.values(), key=lambda q: rank_of.get(q.request_id, len(order)))
        for req in reqs:  # the same order on every rank: the TP engines must schedule alike
            self.tp.adopt_request(req)
            if self.rank == 0:
                self._owner[req.request_id] = -1
        return outs, len(reqs), written


def _least_loaded(counts: list[int]) -> int:
    """The rank with the fewest requests (the lowest such rank), counted in ``counts``, which it now has one more."""
    r = min(range(len(counts)), key=counts.__getitem__)
    counts[r] += 1
    return r
