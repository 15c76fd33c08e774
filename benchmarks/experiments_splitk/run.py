"""Experiment runner (eighteenth session): times the EXP variants of exp_kernel.py (a copy of gluon_frag with
switches that leave stages of MODE 7 out), alternating rounds as probe_tma_frag. Removed in the next commit."""
import json
import math
import statistics
import sys

import torch

sys.path.insert(0, "src")
sys.path.insert(0, "benchmarks")
sys.path.insert(0, "benchmarks/experiments_splitk")
import exp_kernel as GX  # noqa: E402
from _common import time_graph  # noqa: E402
from probe_tma_frag import SHAPES, frags  # noqa: E402
from sweep_quant_wo import WORKING_SET, make_weights  # noqa: E402

torch.manual_seed(0)
out = sys.argv[1]
cfgs = [json.loads(c) for c in sys.argv[2].split(";")]
cases = sys.argv[3].split(",")
res = []
for case in cases:
    shape, m = case.split(":")
    m = int(m)
    n, k = SHAPES[shape]
    w = torch.randn(n, k, device="cuda") * 0.02
    copies = max(1, math.ceil(WORKING_SET / (n * k // 2)))
    q, qs, fn, _ = make_weights("int4", w, copies)
    x = torch.randn(m, k, device="cuda").to(torch.bfloat16)
    ref = x.float() @ q.dequantize(torch.float32).T
    packs = [frags(qq, False) for qq in qs]
    descs = [GX.descriptor(p[0]) for p in packs]
    n_calls = math.ceil(max(copies, 24) / copies) * copies
    timed = {"dispatcher": lambda i: fn(x, qs[i % copies])}
    for c in cfgs:
        y = GX.launch(x, packs[0][0], packs[0][1], n, c, descs[0])
        err = ((y.float() - ref).norm() / ref.norm()).item()
        print(case, c, "rel err", round(err, 5), flush=True)
        timed[json.dumps(c)] = lambda i, c=c: GX.launch(x, packs[i % copies][0], packs[i % copies][1], n, c,
                                                         descs[i % copies])
    times = {lab: [] for lab in timed}
    for _ in range(3):
        for lab, call in timed.items():
            times[lab].append(time_graph(call, n_calls, reps=5, warmup=1) * 1e6)
    for c in cfgs:
        for rep in range(3):
            y = GX.launch(x, packs[rep % copies][0], packs[rep % copies][1], n, c, descs[rep % copies])
            err = ((y.float() - (x.float() @ qs[rep % copies].dequantize(torch.float32).T)).norm() / ref.norm()).item()
            if err > 1e-2:
                print("AFTER TIMING BAD", case, c, rep, err, flush=True)
    for lab, v in times.items():
        med = statistics.median(v)
        print(f"{case} {med:7.2f} {lab}", flush=True)
        res.append({"case": case, "config": lab, "us": med, "rounds_us": v})
    json.dump(res, open(out, "w"), indent=1)
