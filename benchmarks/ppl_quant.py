"""Perplexity of SmolLM2-135M-Instruct under each quantization scheme (CPU, reference ops).

The text ships with Python (``pydoc_data.topics``): the help topics in sorted order, tokenized,
cut into windows of ``--window`` tokens (each window its own sequence, no context carried over);
the first ``--tokens`` tokens are evaluated. Calibration (GPTQ Hessians, SmoothQuant factors, the
initial MixQ outlier set, FP8 scale-search weights) uses ``--calib-seqs`` sequences of
``--calib-len`` tokens spread evenly over the rest of the corpus, starting 2x ``--tokens`` in, so
it never overlaps the evaluated text. The "unquantized" baseline is the checkpoint's own weights dequantized to fp32
(the file is Q4_1); every scheme re-quantizes those. Also runs the native-Q4_1 demo: the model
whose linears read the file's Q4_1 blocks as stored must answer exactly as the dequantized one.

    PYTHONPATH=src python benchmarks/ppl_quant.py --tokens 2048 --out docs/quant_ppl.json
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))

from infercore.loading import default_model_path  # noqa: E402
from infercore.models import load_model  # noqa: E402
from infercore.ops import AttentionMetadata  # noqa: E402
from infercore.quant import SCHEMES, collect_calibration, outlier_hit_rate, quantize  # noqa: E402
from infercore.quant.gguf_native import use_gguf_blocks  # noqa: E402

PAGE = 16


def corpus() -> str:
    from pydoc_data.topics import topics

    return "\n\n".join(topics[k] for k in sorted(topics))


def forward_logits(model, ids: list[int]) -> torch.Tensor:
    """One sequence, prefill only: fp32 logits ``[T, V]``."""
    t = len(ids)
    pages = math.ceil(t / PAGE)
    caches = [(torch.zeros(pages, PAGE, s.num_kv_heads, s.head_dim, dtype=s.dtype),
               torch.zeros(pages, PAGE, s.num_kv_heads, s.head_dim, dtype=s.dtype)) for s in model.kv_specs()]
    meta = AttentionMetadata.from_lists(query_lens=[t], seq_lens=[t], block_tables=[list(range(pages))],
                                        slot_mapping=list(range(t)))
    with torch.inference_mode():
        h = model(torch.tensor(ids), torch.arange(t), caches, meta)
        return model.compute_logits(h)


def perplexity(model, windows: list[list[int]]) -> float:
    nll, n = 0.0, 0
    for w in windows:
        logits = forward_logits(model, w)
        nll += torch.nn.functional.cross_entropy(logits[:-1], torch.tensor(w[1:]), reduction="sum").item()
        n += len(w) - 1
    return math.exp(nll / n)


def greedy(model, ids: list[int], n: int) -> list[int]:
    out = list(ids)
    for _ in range(n):  # re-prefill each step: simple and exact for a short demo
        out.append(int(forward_logits(model, out)[-1].argmax()))
    return out[len(ids):]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--window", type=int, default=512)
    ap.add_argument("--calib-seqs", type=int, default=32)
    ap.add_argument("--calib-len", type=int, default=256)
    ap.add_argument("--schemes", default="w8a16,w4a16-g128,w4a16-g128-sym,w4a16-g128-gptq,fp8-wo,fp8-wo-search,"
                    "fp8-wo-block,fp8-w8a8,w8a8,w8a8-smooth,w8a8-mixed,w8a8-mixed-smooth,gguf-q4_0,gguf-q8_0")
    ap.add_argument("--out", default="docs/quant_ppl.json")
    args = ap.parse_args()
    torch.manual_seed(0)
    path = default_model_path()
    base, tok, _ = load_model(path, dtype=torch.float32, device="cpu")
    ids = tok.encode(corpus(), add_special_tokens=False)
    n = args.tokens // args.window * args.window
    windows = [ids[i:i + args.window] for i in range(0, n, args.window)]
    first = 2 * n  # calibration starts well past the evaluated text
    starts = torch.linspace(first, len(ids) - args.calib_len, args.calib_seqs).long().tolist()
    calib_seqs = [ids[st:st + args.calib_len] for st in starts]

    def run_calibration(m):
        for seq in calib_seqs:
            forward_logits(m, seq)

    t0 = time.time()
    rows = [{"scheme": "unquantized (fp32, dequantized file weights)", "ppl": perplexity(base, windows)}]
    print(rows[-1], f"{time.time() - t0:.0f}s", flush=True)
    t0 = time.time()
    calib = collect_calibration(base, run_calibration, hessian=True)  # one pass serves every scheme
    print(f"calibration {time.time() - t0:.0f}s", flush=True)
    for name in args.schemes.split(","):
        t0 = time.time()
        m = quantize(copy.deepcopy(base), name, calibration=calib)
        row = {"scheme": name, "ppl": perplexity(m, windows)}
        if SCHEMES[name].outlier_threshold is not None:
            row["outliers"] = outlier_hit_rate(m)
            row["outlier_channels"] = sum(int(q.outlier_idx.numel()) for q in m.modules()
                                          if hasattr(q, "outlier_idx"))
        rows.append(row)
        print(row, f"{time.time() - t0:.0f}s", flush=True)
    base_ppl = rows[0]["ppl"]
    for r in rows:
        r["delta_pct"] = 100.0 * (r["ppl"] / base_ppl - 1.0)
    # Native Q4_1 demo: the file's blocks as stored vs the dequantized model.
    prompt = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}])
    p_ids = tok.encode(prompt, add_special_tokens=False)
    dense = greedy(base, p_ids, 12)
    native = copy.deepcopy(base)
    swapped = use_gguf_blocks(native, path)
    nat = greedy(native, p_ids, 12)
    demo = {"prompt": "What is the capital of France?", "dense": tok.decode(dense),
            "native_q4_1": tok.decode(nat),
            "identical": dense == nat, "native_linears": len(swapped)}
    print(demo, flush=True)
    with open(args.out, "w") as f:
        json.dump({"command": "python " + " ".join(sys.argv), "device": "cpu", "tokens": n, "window": args.window,
                   "text": "pydoc_data.topics (sorted topics)",
                   "calibration": {"seqs": args.calib_seqs, "len": args.calib_len, "first_token": first,
                                   "corpus_tokens": len(ids)},
                   "rows": rows, "demo": demo}, f, indent=1)


if __name__ == "__main__":
    main()
