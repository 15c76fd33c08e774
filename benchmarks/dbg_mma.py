import sys

import torch

sys.path.insert(0, "src")
from infercore.quant import IntWeight  # noqa: E402
from infercore.quant import cuda_mma as CM  # noqa: E402

torch.manual_seed(1)
n, k = 600, 384
q = IntWeight.quantize(torch.randn(n, k, device="cuda") * 0.02, bits=4, group_size=128, clip_search=False)
words, sc = CM.repack_int4(q)
wref = q.dequantize(torch.float32)
for m, st, ct in [(3, 4, 1), (3, 3, 2), (3, 3, 1), (3, 4, 2), (9, 4, 1), (16, 4, 1)]:
    x = torch.randn(m, k, device="cuda").to(torch.bfloat16)
    ref = x.float() @ wref.T
    for rep in range(3):
        y = CM.matmul(x, "int4", words, sc, n, k, stages=st, ctas=ct)
        torch.cuda.synchronize()
        ws = CM._BUFFERS[0].view(torch.int32)
        dirty = (ws != -1).nonzero().flatten()
        bad = ((y.float() - ref).abs() > 1e-2 * ref.abs().max()) | y.isnan()
        bi = bad.nonzero()
        print(f"m={m} st={st} ct={ct} rep={rep} dirty={dirty.numel()} first={dirty[:3].tolist()} "
              f"bad={bi.shape[0]} rows={sorted(set(bi[:, 0].tolist()))[:16]} cols={bi[:8, 1].tolist()}", flush=True)
