"""DeepSeek MLA decode through the generic paged decode kernel (diagnostic): the latent cache ``[c_kv | k_pe]`` (576
wide, one KV head) as both K and V, all query heads on it, as models/deepseek.py runs it. Checks the kernel compiles
and is right at V2-Lite (16 heads) and V2 / V3 (128 heads) widths, and how fast it reads the latent KV.

    python benchmarks/probe_mla_decode.py
"""

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))

import torch

from infercore.devices import implementation
from infercore.ops.attention import triton_decode as td

for hq, B, L in ((16, 8, 1024), (128, 8, 1024), (128, 64, 2048)):
    D, page = 576, 16
    n = B * L // page + 8
    kc = torch.randn(n, page, 1, D, device="cuda", dtype=torch.bfloat16)
    table = torch.randperm(n, device="cuda")[: B * L // page].view(B, L // page).to(torch.int32)
    q = torch.randn(B, hq, D, device="cuda", dtype=torch.bfloat16)
    sl = torch.full((B,), L, device="cuda", dtype=torch.int32)
    try:
        out = td.paged_attention_decode(q, kc, kc, seq_lens=sl, block_table=table, scale=0.07)
        ref = implementation("paged_attention_decode", "reference")(q, kc, kc, seq_lens=sl, block_table=table, scale=0.07)
        err = ((out.float() - ref.float()).abs().max() / ref.float().abs().max()).item()
        from triton.testing import do_bench
        t = do_bench(lambda: td.paged_attention_decode(q, kc, kc, seq_lens=sl, block_table=table, scale=0.07))
        gb = B * L * D * 2 / 1e9
        print(f"MLA decode Hq={hq} B={B} L={L}: rel err {err:.2e}, {t*1e3:.1f} us, {gb / (t*1e-3) / 1e3:.2f} TB/s of latent KV")
    except Exception as e:
        print(f"MLA decode Hq={hq} B={B} L={L}: {type(e).__name__}: {str(e)[:300]}")
