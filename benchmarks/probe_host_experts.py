"""Where a host-experts decode step goes: the host GEMV kernels' read rate by thread count, one layer's host call,
and the device side's eager cost per layer.

Part A (host only): Qwen3-30B-A3B experts (128 x [1536 x 2048, 2048 x 768], bf16); the native host kernels
(``ops.moe.cpu_native``) beside oneDNN's and ATen's where they build. Every timed call picks other
experts than the previous ones (cycling through all 128 x ``--layers`` layers, ~1.2 GB each) so no weight is in
the last-level cache. Per kernel (oneDNN-packed ``_linear_pointwise``, plain ``F.linear``, the INT4 / INT8 packed
kernels) and thread count: GB/s of weight read at one row, and the whole-layer host call at T tokens.

Part B (device): a ``--model-layers``-layer model of that shape; Engine decode step at B=1 resident with and
without CUDA graphs, then with host experts (eager): (host step - resident eager step) / layers is what one
layer's host round trip costs.

    python benchmarks/probe_host_experts.py --out /tmp/probe_host_experts.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))
sys.path.insert(0, os.path.dirname(__file__))

from _common import host_read_bandwidth  # noqa: E402

from infercore.models.layout import CPUPackedExperts  # noqa: E402
from infercore.offload.host_experts import NativeQuantExperts, _quant_experts, _QuantLinear  # noqa: E402
from infercore.ops.moe import cpu_native  # noqa: E402


def timed(fns, reps: int) -> float:
    """Median seconds of ``fns[i % len]()`` over ``reps`` calls after one pass over all (each a different weight)."""
    for f in fns:
        f()
    ts = []
    for i in range(reps):
        t = time.perf_counter()
        fns[i % len(fns)]()
        ts.append(time.perf_counter() - t)
    ts.sort()
    return ts[len(ts) // 2]


def part_a(args, out: dict) -> None:
    E, H, I, k = 128, 2048, 768, 8
    dt = torch.bfloat16
    layers = []
    for _ in range(args.layers):
        gu = torch.randn(E, 2 * I, H, dtype=dt) * 0.02
        dn = torch.randn(E, H, I, dtype=dt) * 0.02
        native = CPUPackedExperts(gu, dn) if cpu_native.available() else None  # the plain weights themselves
        layers.append((gu, dn, CPUPackedExperts(gu, dn, native=False), native))
    quant = {}
    with cpu_native.disabled():  # ATen's kernels per expert
        for scheme in ("w4a16-g128", "w8a16"):
            gu, dn = layers[0][:2]
            quant[scheme] = ([_QuantLinear(gu[e], scheme, dt) for e in range(E)],
                             [_QuantLinear(dn[e], scheme, dt) for e in range(E)])
    gu, dn = layers[0][:2]
    native_q4 = NativeQuantExperts.build([_QuantLinear(gu[e], "w4a16-g128", dt) for e in range(E)],
                                      [_QuantLinear(dn[e], "w4a16-g128", dt) for e in range(E)])
    out["native"] = cpu_native.status()
    x1 = torch.randn(1, H, dtype=dt)
    xi = torch.randn(1, I, dtype=dt)
    linear = torch.ops.mkldnn._linear_pointwise
    gu_bytes, dn_bytes = 2 * I * H * 2, H * I * 2
    g = torch.Generator().manual_seed(0)
    rows = []
    for threads in [int(t) for t in args.threads.split(",")]:
        torch.set_num_threads(threads)
        bw = host_read_bandwidth(1 << 30)
        r = {"threads": threads, "host_read_GBps": bw / 1e9}
        all_w = [(lay[2].gate_up[e], lay[2].down[e], lay[0][e], lay[1][e]) for lay in layers for e in range(E)]
        if cpu_native.available():
            r["native_gate_up_GBps"] = gu_bytes / timed([lambda w=w: cpu_native.linear_dense(x1, w[2]) for w in all_w],
                                                        args.reps) / 1e9
        r["packed_gate_up_GBps"] = gu_bytes / timed([lambda w=w: linear(x1, w[0], None, "none", [], "")
                                                      for w in all_w], args.reps) / 1e9
        r["packed_down_GBps"] = dn_bytes / timed([lambda w=w: linear(xi, w[1], None, "none", [], "")
                                                   for w in all_w], args.reps) / 1e9
        r["plain_linear_gate_up_GBps"] = gu_bytes / timed([lambda w=w: F.linear(x1, w[2]) for w in all_w],
                                                          args.reps) / 1e9
        r["plain_linear_down_GBps"] = dn_bytes / timed([lambda w=w: F.linear(xi, w[3]) for w in all_w],
                                                       args.reps) / 1e9
        for scheme, (qg, _) in quant.items():
            qb = qg[0].nbytes
            r[f"{scheme}_gate_up_GBps"] = qb / timed([lambda q=q: q(x1) for q in qg], args.reps) / 1e9
            r[f"{scheme}_gate_up_bf16_equiv_GBps"] = gu_bytes / qb * r[f"{scheme}_gate_up_GBps"]
        for T in (1, 2, 4):
            calls = []
            for lay in layers:
                for _ in range(4):
                    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])
                    w = torch.softmax(torch.randn(T, k, generator=g), -1)
                    x = torch.randn(T, H, dtype=dt, generator=g)
                    calls.append((lay[2], x, w, ids, lay[3]))
            t = timed([lambda c=c: c[0](c[1], c[2], c[3]) for c in calls], args.reps)
            distinct = sum(int(torch.unique(c[3]).numel()) for c in calls) / len(calls)
            r[f"layer_T{T}_ms"] = t * 1e3  # oneDNN-packed
            r[f"layer_T{T}_GBps"] = distinct * (gu_bytes + dn_bytes) / t / 1e9
            if calls[0][4] is not None:
                tn = timed([lambda c=c: c[4](c[1], c[2], c[3]) for c in calls], args.reps)
                r[f"layer_T{T}_native_ms"] = tn * 1e3
                r[f"layer_T{T}_native_GBps"] = distinct * (gu_bytes + dn_bytes) / tn / 1e9
            if native_q4 is not None:
                tq = timed([lambda c=c: native_q4(c[1], c[2], c[3], None) for c in calls[:4]], args.reps)
                r[f"layer_T{T}_w4a16-g128_native_ms"] = tq * 1e3
            qcalls = [(c[1], c[2], c[3]) for c in calls]
            for scheme, (qg, qd) in quant.items():
                tq = timed([lambda c=c, qg=qg, qd=qd: _quant_experts(c[0], qg, qd, c[1], c[2], None)
                            for c in qcalls], args.reps)
                r[f"layer_T{T}_{scheme}_ms"] = tq * 1e3
        print(json.dumps(r), flush=True)
        rows.append(r)
    out["host_kernels"] = rows


def part_b(args, out: dict) -> None:
    from bench_moe_e2e import QWEN3_30B_A3B

    from infercore import Engine, SamplingParams
    from infercore.models import build_model, config_from_hf
    from infercore.offload import offload_experts_

    torch.set_num_threads(int(args.threads.split(",")[0]))
    dev = torch.device("cuda")
    cfg = config_from_hf(dict(QWEN3_30B_A3B, num_hidden_layers=args.model_layers))
    torch.manual_seed(0)
    model = build_model(cfg, dtype=torch.bfloat16, device=dev, init="normal")
    prompt = torch.randint(0, 150000, (1, 256)).tolist()

    def step_ms(graphs: bool, label: str) -> float:
        eng = Engine(model, num_pages=64, page_size=16, max_num_seqs=1, max_model_len=512,
                     enable_prefix_caching=False, cuda_graph_max_batch=1 if graphs else 0)
        eng.generate(prompt, SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
        eng.add_request(prompt[0], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
        for _ in range(5):
            eng.step()
        ts = []
        for _ in range(30):
            torch.cuda.synchronize()
            t = time.perf_counter()
            eng.step()
            torch.cuda.synchronize()
            ts.append(time.perf_counter() - t)
        while eng.has_unfinished():
            eng.step()
        ts.sort()
        ms = ts[len(ts) // 2] * 1e3
        print(f"{label}: {ms:.2f} ms/step", flush=True)
        return ms

    res = {"model_layers": args.model_layers}
    res["resident_graphs_ms"] = step_ms(True, "resident, graphs")
    res["resident_eager_ms"] = step_ms(False, "resident, eager")
    offload_experts_(model, device=dev)
    res["host_experts_ms"] = step_ms(False, "host experts (packed)")
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        eng = Engine(model, num_pages=64, page_size=16, max_num_seqs=1, max_model_len=512,
                     enable_prefix_caching=False, cuda_graph_max_batch=0)
        eng.generate(prompt, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25)
    print(table, flush=True)
    res["profile_top"] = table
    out["device_step"] = res


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="/tmp/probe_host_experts.json")
    ap.add_argument("--threads", default="16,8,4")
    ap.add_argument("--layers", type=int, default=4, help="host layers of experts cycled through (part A)")
    ap.add_argument("--model-layers", type=int, default=8)
    ap.add_argument("--reps", type=int, default=60)
    ap.add_argument("--no-device", action="store_true")
    args = ap.parse_args()
    out = {"torch": torch.__version__, "cpu_capability": torch.backends.cpu.get_cpu_capability()}
    print(out, flush=True)
    with torch.no_grad():
        part_a(args, out)
    if not args.no_device:
        part_b(args, out)
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)
    print(f"wrote {args.out}", flush=True)


if __name__ == "__main__":
    main()
