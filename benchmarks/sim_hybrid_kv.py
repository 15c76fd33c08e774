"""Trace simulator (CPU): hybrid-model KV memory, multi-granularity (Jenga) vs the uniform baseline.

No tensors are allocated: the simulator drives :class:`infercore.kv.hybrid.HybridBlockManager`
exactly as an engine would (allocate, grow, mark_computed, free) and reads its byte accounting.

Models (KV shapes of public architectures, layer counts rounded to the stated ratio):

* ``sliding5to1`` -- Gemma-3-like: 48 layers, 40 sliding (window 1024) + 8 full, 8 KV heads x 128, bf16.
* ``linear3to1`` -- Qwen3-Next-like: 48 layers, 36 gated-DeltaNet (conv state 8192 x 3 bf16,
  recurrent state 32 x 128 x 128 fp32) + 12 full attention (2 KV heads x 256, bf16).

Budget sweep (capacity only) at the shapes of the public configs, 1 / 4 / 16 / 40 GiB pools:

* ``qwen3_next_80b`` -- Qwen3-Next-80B-A3B: 48 layers, 36 gated DeltaNet + 12 gated attention
  (the ``linear3to1`` specs in the config's layer order), at 512 + 256 and 32k tokens;
* ``qwen3_next_80b_8l`` -- its first 8 layers, the model of ``benchmarks/bench_hybrid_e2e.py``;
* ``gemma3_27b`` -- Gemma-3-27B: 62 layers, 52 sliding (window 1024) + 10 global, 16 KV heads x
  128, at 512 + 256, 4k + 256 and 32k tokens.

Per context length ``L`` (4k..128k) and mode, on a 40 GiB KV pool:

* **capacity** -- requests of ``L`` tokens (prefilled in 2048-token chunks) admitted until the pool
  is full: the largest concurrent batch at that context;
* **utilization** -- bytes those requests really need (every token of full layers, the last ``w``
  of sliding layers, one state per linear layer; :meth:`HybridKVLayout.needed_bytes`) over the
  bytes the pool has carved for them; ``wasted = 1 - utilization`` (page rounding, padding,
  window overhang, large-page fragmentation);
* **trace** -- continuous batching of 4x-capacity requests (prompt ``L - 256`` + 256 decoded
  tokens, chunked prefill, preemption of the newest request when the pool runs short): the peak
  number of running requests.

Layouts are built for their pool (``HybridKVLayout.build(..., budget_bytes=)``), as the engine does.

Run: ``PYTHONPATH=src python benchmarks/sim_hybrid_kv.py`` (a few minutes on 2 cores;
``--quick`` for a smoke run). Writes ``benchmarks/results/cpu/sim_hybrid_kv.json``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import sys
from collections import deque
from pathlib import Path

import torch

from infercore.kv import FullAttentionSpec
from infercore.kv.hybrid import HybridBlockManager, HybridKVLayout, LinearStateSpec, SlidingWindowSpec

GiB = 1 << 30
BUDGET = 40 * GiB
CHUNK = 2048
PAGE_TOKENS = 16
CONTEXTS = [4096, 8192, 16384, 32768, 65536, 131072]
SWEEP_BUDGETS = [1, 4, 16, 40]  # GiB
SWEEP = {  # model -> contexts (prompt + 256 decoded tokens)
    "qwen3_next_80b": [768, 32768],
    "qwen3_next_80b_8l": [768, 32768],
    "gemma3_27b": [768, 4352, 32768],
}
GDN = LinearStateSpec((8192, 3), (32, 128, 128), conv_dtype=torch.bfloat16, recurrent_dtype=torch.float32)


def model_specs(name: str) -> list:
    if name == "sliding5to1":
        return ([SlidingWindowSpec(8, 128, 1024)] * 5 + [FullAttentionSpec(8, 128)]) * 8
    if name == "linear3to1":
        return ([GDN] * 3 + [FullAttentionSpec(2, 256)]) * 12
    if name.startswith("qwen3_next_80b"):
        layers = 8 if name.endswith("_8l") else 48
        return [FullAttentionSpec(2, 256) if (i + 1) % 4 == 0 else GDN for i in range(layers)]
    if name == "gemma3_27b":
        return [FullAttentionSpec(16, 128) if (i + 1) % 6 == 0 else SlidingWindowSpec(16, 128, 1024) for i in range(62)]
    raise ValueError(f"unknown model {name!r}")


def capacity(layout: HybridKVLayout, length: int, budget: int = BUDGET) -> tuple[int, float]:
    """Requests of ``length`` tokens resident at once, and the memory utilization then."""
    mgr = HybridBlockManager(layout, layout.num_large_pages(budget), enable_prefix_caching=False)
    tokens = range(length)  # ids are irrelevant without prefix caching
    n = 0
    while True:
        if mgr.allocate(n, tokens, min(CHUNK, length), max_cached_tokens=0) is None:
            break
        done, ok = min(CHUNK, length), True
        mgr.mark_computed(n, tokens, done)
        while done < length:
            nxt = min(length, done + CHUNK)
            if not mgr.grow(n, nxt):
                ok = False
                break
            mgr.mark_computed(n, tokens, nxt)
            done = nxt
        if not ok:
            mgr.free(n)
            break
        n += 1
    mem = mgr.memory()
    carved = mem["total"] - mem["free"]
    util = n * layout.needed_bytes(length) / carved if carved else 0.0
    return n, util


def trace(
    layout: HybridKVLayout, length: int, num_requests: int, *, token_budget: int = 16384, budget: int = BUDGET
) -> int:
    """Peak running requests under continuous batching with chunked prefill and preemption."""
    mgr = HybridBlockManager(layout, layout.num_large_pages(budget), enable_prefix_caching=False)
    tokens = range(length)
    waiting: deque[int] = deque(range(num_requests))
    computed: dict[int, int] = {}
    running: list[int] = []
    peak = 0
    while waiting or running:
        budget = token_budget
        scheduled: list[tuple[int, int]] = []
        for rid in list(running):
            if rid not in running:  # preempted earlier in this step
                continue
            done = computed[rid]
            step = 1 if done >= length - 256 else min(CHUNK, length - 256 - done)
            if step > budget:
                continue
            while not mgr.grow(rid, done + step):
                victim = running.pop()  # preempt the newest; it restarts from scratch
                mgr.free(victim)
                scheduled = [s for s in scheduled if s[0] != victim]
                waiting.appendleft(victim)
                computed.pop(victim)
                if victim == rid:
                    break
            else:
                scheduled.append((rid, done + step))
                budget -= step
        while waiting and budget >= 1:
            rid = waiting[0]
            step = min(CHUNK, length - 256, budget)
            if mgr.allocate(rid, tokens, step, max_cached_tokens=0) is None:
                break
            waiting.popleft()
            running.append(rid)
            computed[rid] = 0
            scheduled.append((rid, step))
            budget -= step
        if not scheduled:
            raise RuntimeError("no progress: a single request does not fit the pool")
        peak = max(peak, len(running))
        for rid, end in scheduled:
            mgr.mark_computed(rid, tokens, end)
            computed[rid] = end
            if end >= length:
                mgr.free(rid)
                running.remove(rid)
                computed.pop(rid)
    return peak


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="contexts 4k and 32k only, no trace")
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "cpu" / "sim_hybrid_kv.json"))
    args = parser.parse_args()
    contexts = [4096, 32768] if args.quick else CONTEXTS
    cases = []
    for model in ("sliding5to1", "linear3to1"):
        specs = model_specs(model)
        layouts = {
            m: HybridKVLayout.build(specs, page_tokens=PAGE_TOKENS, mode=m, budget_bytes=BUDGET)
            for m in ("multi", "uniform")
        }
        for length in contexts:
            ideal = BUDGET // layouts["multi"].needed_bytes(length)
            cap = {m: capacity(lay, length) for m, lay in layouts.items()}
            row = {m: {"capacity": c, "utilization": u} for m, (c, u) in cap.items()}
            if not args.quick:
                for m, lay in layouts.items():
                    row[m]["trace_peak"] = trace(lay, length, max(8, 4 * cap[m][0]))
            print(f"{model:12s} {length:>6d}: ideal {ideal:4d} | " + " | ".join(
                f"{m}: cap {r['capacity']:4d} util {100 * r['utilization']:5.1f}% "
                f"peak {r.get('trace_peak', '-')}"
                for m, r in row.items()
            ), flush=True)  # fmt: skip
            ours, base = row["multi"], row["uniform"]
            tag = f"{model} ctx={length // 1024}k"
            cases.append(_case(f"{tag} capacity", "max concurrent requests", "requests",
                               ours["capacity"], base["capacity"], ideal))  # fmt: skip
            cases.append(_case(f"{tag} utilization", "memory utilization %", "%",
                               100 * ours["utilization"], 100 * base["utilization"], 100.0))  # fmt: skip
            if "trace_peak" in ours:
                # No floor: running requests include ones still early in their prefill.
                cases.append(_case(f"{tag} trace", "peak running requests (trace)", "requests",
                                   ours["trace_peak"], base["trace_peak"], None))  # fmt: skip
    cases += budget_sweep(trace_small=not args.quick)
    result = {
        "name": "sim_hybrid_kv",
        "device": "cpu",
        "date": datetime.date.today().isoformat(),
        "command": "PYTHONPATH=src python benchmarks/sim_hybrid_kv.py" + (" --quick" if args.quick else ""),
        "env": {
            "torch": torch.__version__,
            "triton": _triton_version(),
            "gpu": None,
            "python": sys.version.split()[0],
            "machine": platform.machine(),
        },  # fmt: skip
        "notes": "KV budget 40 GiB unless the case names one; page 16 tokens; prefill chunk 2048; "
        "peers.uniform = one page size for every layer (sliding layers keep full history, states padded "
        "to an inflated token page); floor = the ideal (no waste) value; layouts built for their budget.",
        "cases": cases,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}")


def budget_sweep(*, trace_small: bool) -> list[dict]:
    """Capacity of multi vs uniform at the public configs' shapes across pool sizes (and the
    continuous-batching peak where the pool is small enough for the trace to be quick)."""
    cases = []
    for model, contexts in SWEEP.items():
        specs = model_specs(model)
        for gib in SWEEP_BUDGETS:
            budget = gib * GiB
            layouts = {
                m: HybridKVLayout.build(specs, page_tokens=PAGE_TOKENS, mode=m, budget_bytes=budget)
                for m in ("multi", "uniform")
            }
            for length in contexts:
                ideal = budget // layouts["multi"].needed_bytes(length)
                cap = {m: capacity(lay, length, budget)[0] for m, lay in layouts.items()}
                tag = f"{model} {gib}GiB ctx={length}"
                line = (f"{tag:34s}: ideal {ideal:5d} | multi {cap['multi']:5d} | uniform {cap['uniform']:5d} "
                        f"| large page multi {layouts['multi'].large_bytes / 2**20:.1f} MiB x "
                        f"{layouts['multi'].num_large_pages(budget)}")  # fmt: skip
                cases.append(_case(f"{tag} capacity", "max concurrent requests", "requests",
                                   cap["multi"], cap["uniform"], ideal))  # fmt: skip
                if trace_small and gib <= 4 and length <= 4352 and cap["uniform"] > 0:
                    peak = {m: trace(lay, length, max(8, 4 * cap[m]), budget=budget) for m, lay in layouts.items()}
                    line += f" | trace peak {peak['multi']} vs {peak['uniform']}"
                    cases.append(_case(f"{tag} trace", "peak running requests (trace)", "requests",
                                       peak["multi"], peak["uniform"], None))  # fmt: skip
                print(line, flush=True)
    return cases


def _case(case: str, metric: str, unit: str, ours: float, uniform: float, floor: float | None) -> dict:
    return {
        "case": case,
        "metric": metric,
        "unit": unit,
        "ours": round(ours, 3),
        "peers": {"uniform": round(uniform, 3)},
        "floor": round(floor, 3) if floor is not None else None,
        "ours_over_floor": round(ours / floor, 4) if floor else None,
        "ours_vs_best_peer": round(ours / uniform, 4) if uniform else None,
    }


def _triton_version() -> str | None:
    try:
        import triton

        return triton.__version__
    except ImportError:
        return None


if __name__ == "__main__":
    main()
