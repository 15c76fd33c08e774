"""Tile sweep of the routed-expert op's decode-size GEMV path against its grouped path, at decode token counts.

Each call routes fresh random tokens (8 routings rotated inside one CUDA graph, so the routed experts are mostly
not in L2); the floor is the distinct routed experts' bytes of each call / measured copy bandwidth.

    python benchmarks/sweep_moe_gemv.py --out $OUT/sweep_moe_gemv.json
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))
sys.path.insert(0, os.path.dirname(__file__))

from _common import case, copy_bandwidth, time_graph, write_results  # noqa: E402

from infercore.ops.moe import triton as moe_triton  # noqa: E402

SHAPES = {  # name: (experts, hidden, expert width, top_k)
    "qwen3-30b-a3b": (128, 2048, 768, 8),
    "qwen3-next-80b": (512, 2048, 512, 10),
    "mixtral-8x7b": (8, 4096, 14336, 2),
}
CONFIGS = [(2, 512, 4), (4, 256, 4), (4, 512, 4), (4, 1024, 8), (8, 256, 4), (8, 512, 8), (16, 256, 8)]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--tokens", default="1,2,4,8")
    args = ap.parse_args()
    dev = torch.device("cuda")
    bw = copy_bandwidth()
    cases = []
    for name, (E, H, I, k) in SHAPES.items():
        torch.manual_seed(0)
        gate_up = torch.randn(E, 2 * I, H, device=dev, dtype=torch.bfloat16) * 0.02
        down = torch.randn(E, H, I, device=dev, dtype=torch.bfloat16) * 0.02
        expert_bytes = 3 * H * I * 2
        for T in [int(t) for t in args.tokens.split(",")]:
            sets = []
            for _ in range(8):
                x = torch.randn(T, H, device=dev, dtype=torch.bfloat16)
                w, ids = torch.topk(torch.softmax(torch.randn(T, E, device=dev), -1), k, dim=-1)
                sets.append((x, w.to(torch.bfloat16), ids))
            distinct = sum(len(torch.unique(s[2])) for s in sets) / len(sets)
            floor_us = distinct * expert_bytes / bw * 1e6
            moe_triton.GEMV_MAX_PAIRS = 0  # the grouped path
            want = [moe_triton.moe_experts_triton(x, gate_up, down, w, ids) for x, w, ids in sets]
            def call(fn, sets=sets, gate_up=gate_up, down=down):
                return lambda i: fn(sets[i][0], gate_up, down, sets[i][1], sets[i][2])

            grouped = time_graph(call(moe_triton.moe_experts_triton), 8) * 1e6
            results = {}
            for gu, dn in itertools.product(CONFIGS, CONFIGS):
                if gu != dn and (gu not in CONFIGS[:4] or dn not in CONFIGS[:4]):
                    continue  # the full cross product only among the first four
                moe_triton._GEMV_CFG = {n: {"gate_up": gu, "down": dn} for n in (1, 2)}
                got = moe_triton.moe_experts_gemv(*sets[0][:1], gate_up, down, *sets[0][1:])
                err = (got.float() - want[0].float()).abs().max().item()
                scale = want[0].float().abs().max().item()
                if err > 2e-2 * scale + 1e-3:
                    print(f"{name} T={T} {gu} {dn}: MISMATCH {err} vs {scale}", flush=True)
                    continue
                results[(gu, dn)] = time_graph(call(moe_triton.moe_experts_gemv), 8) * 1e6
            best = min(results, key=results.get)
            us = results[best]
            print(f"{name} T={T}: grouped {grouped:.1f} us, gemv best {us:.1f} us {best} "
                  f"(floor {floor_us:.1f} us, {distinct:.1f} experts)", flush=True)
            cases.append(case(f"{name} routed experts, {T} tokens, bf16", metric="routed-expert bandwidth",
                              unit="TB/s", ours=distinct * expert_bytes / us / 1e6,
                              peers={"grouped path (sorted pairs)": distinct * expert_bytes / grouped / 1e6},
                              floor=bw / 1e12, ours_us=us, grouped_us=grouped, floor_us=floor_us,
                              best_config={"gate_up": list(best[0]), "down": list(best[1])},
                              all_us={f"{a}/{b}": round(v, 2) for (a, b), v in results.items()}))
    write_results(args.out, "sweep_moe_gemv", torch.cuda.get_device_name(), cases)


if __name__ == "__main__":
    main()
