"""DeepSeek MLA decode through the generic paged decode kernel (diagnostic): the latent cache ``[c_kv | k_pe]`` (576
wide, one KV head) as both K and V, all query heads on it, as models/deepseek.py runs it. Checks the kernel compiles
and is right at V2-Lite (16 heads) and V2 / V3 (128 heads) widths, and how fast it reads the latent KV.

    python benchmarks/probe_mla_decode.py
"""

from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))

from infercore.devices import implementation  # noqa: E402
from infercore.ops.attention import triton_decode as td  # noqa: E402


def probe(hq: int, B: int, L: int, D: int = 576, page: int = 16) -> str:
    from triton.testing import do_bench

    n = B * L // page + 8
    kc = torch.randn(n, page, 1, D, device="cuda", dtype=torch.bfloat16)
    table = torch.randperm(n, device="cuda")[: B * L // page].view(B, L // page).to(torch.int32)
    q = torch.randn(B, hq, D, device="cuda", dtype=torch.bfloat16)
    kw = dict(seq_lens=torch.full((B,), L, device="cuda", dtype=torch.int32), block_table=table, scale=0.07)
    try:
        out = td.paged_attention_decode(q, kc, kc, **kw).float()
        ref = implementation("paged_attention_decode", "reference")(q, kc, kc, **kw).float()
        err = ((out - ref).abs().max() / ref.abs().max()).item()
        ms = do_bench(lambda: td.paged_attention_decode(q, kc, kc, **kw))
    except Exception as e:  # noqa: BLE001 (a shape the kernel cannot compile is the finding)
        return f"MLA decode Hq={hq} B={B} L={L}: {type(e).__name__}: {str(e)[:300]}"
    tbps = B * L * D * 2 / (ms * 1e-3) / 1e12
    return f"MLA decode Hq={hq} B={B} L={L}: rel err {err:.2e}, {ms * 1e3:.1f} us, {tbps:.2f} TB/s of latent KV"


if __name__ == "__main__":
    for hq, B, L in ((16, 8, 1024), (128, 8, 1024), (128, 64, 2048)):
        print(probe(hq, B, L), flush=True)
