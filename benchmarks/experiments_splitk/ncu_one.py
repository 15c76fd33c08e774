import json
import sys

import torch

sys.path.insert(0, "src")
sys.path.insert(0, "benchmarks")
sys.path.insert(0, "benchmarks/experiments_splitk")
import exp_kernel as GX  # noqa: E402
from probe_tma_frag import SHAPES, frags  # noqa: E402
from sweep_quant_wo import make_weights  # noqa: E402

torch.manual_seed(0)
m = int(sys.argv[1])
cfg = json.loads(sys.argv[2])
n, k = SHAPES["gate_up/2"]
w = torch.randn(n, k, device="cuda") * 0.02
q, qs, fn, _ = make_weights("int4", w, 1)
x = torch.randn(m, k, device="cuda").to(torch.bfloat16)
words, sz = frags(q, False)
d = GX.descriptor(words)
for _ in range(4):
    GX.launch(x, words, sz, n, cfg, d)
torch.cuda.synchronize()
print("ok")
