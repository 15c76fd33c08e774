"""End-to-end batch-1 decode of the Llama-3.1-8B shape: bf16 vs W4A16 g128 vs FP8 weight-only (emulated).

The same random bf16 model (``bench_e2e``'s config and helpers) is built three times: as is, then
quantized in place with ``quantize(model, "w4a16-g128")`` and ``quantize(model, "fp8-wo")`` (RTN;
``lm_head`` stays bf16, the schemes' default). Each runs in infercore's Engine with CUDA-graph decode.
Decode rate = (N - 1) / (t(N tokens) - t(1 token)) (prefill excluded), plus the steady rate once past
the prefill. Peer: the bf16 Engine, same run. Floor: (weight bytes read per step + KV bytes at the
mean context) / copy bandwidth measured in the run.

    python benchmarks/bench_e2e_quant.py --out $OUT/e2e_quant.json     # H200, ~3 min
    python benchmarks/bench_e2e_quant.py --smoke --out /tmp/eq.json    # CPU, tiny model (plumbing only)

Targets (issue 5): W4A16 >= 2.5x and FP8-emulated >= 1.6x the bf16 decode tok/s.
"""

from __future__ import annotations

import argparse
import gc
import os
import sys

if "--smoke" in sys.argv:
    os.environ.setdefault("TRITON_INTERPRET", "1")
# Prefill-sized GEMMs would autotune every shape; decode (what is measured) does not autotune.
os.environ.setdefault("INFERCORE_QUANT_AUTOTUNE", "0")

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))
sys.path.insert(0, os.path.dirname(__file__))

from _common import case, copy_bandwidth, write_results  # noqa: E402
from bench_e2e import LLAMA_8B, steady_decode, timed  # noqa: E402

from infercore import Engine, SamplingParams  # noqa: E402
from infercore.models import ModelConfig, build_model  # noqa: E402
from infercore.quant import quantize  # noqa: E402

# (name, scheme, modules left unquantized). The schemes' default keeps lm_head in bf16; the two
# "lm_head too" variants quantize it (an extra row for users; the target reads the default).
VARIANTS = (("bf16", None, ("lm_head",)), ("W4A16 g128", "w4a16-g128", ("lm_head",)),
            ("FP8 weight-only emulated", "fp8-wo", ("lm_head",)),
            ("FP8 weight-only emulated, lm_head too", "fp8-wo", ()), ("W4A16 g128, lm_head too", "w4a16-g128", ()),
            ("NF4 weight-only", "w4a16-nf4", ("lm_head",)), ("NVFP4 weight-only emulated", "w4a16-nvfp4", ("lm_head",)),
            ("MXFP4 weight-only emulated", "w4a16-mxfp4", ("lm_head",)))
TARGET = {"W4A16 g128": 2.5, "FP8 weight-only emulated": 1.6}
TINY = dict(LLAMA_8B, vocab_size=512, hidden_size=128, intermediate_size=256, num_attention_heads=4,
            num_key_value_heads=2)


def load_tuned(path: str) -> int:
    """Fill ``triton_wo.SMALL_M_TUNED`` from a ``sweep_quant_wo.py`` result (its ``best`` dict)."""
    import json

    from infercore.quant import triton_wo

    with open(path) as f:
        best = json.load(f).get("best", {})
    for key, b in best.items():
        kind, n, k, m = key.split(",")
        cfg = {kk: v for kk, v in b["config"].items() if kk != "BLOCK_M"}
        triton_wo.SMALL_M_TUNED[(kind, int(n), int(k), triton_wo.triton.next_power_of_2(int(m)))] = cfg
    return len(best)


def read_bytes(model: torch.nn.Module) -> int:
    """Bytes of weights read per decode step: every parameter and buffer but the embedding table."""
    emb = model.model.embed_tokens.weight
    total = sum(t.numel() * t.element_size() for t in list(model.parameters()) + list(model.buffers()))
    return total - emb.numel() * emb.element_size()


def run_variant(cfg: dict, scheme: str | None, skip: tuple, dev: torch.device, args, prompt: list[int]) -> dict:
    torch.manual_seed(0)
    model = build_model(ModelConfig.from_hf(cfg), dtype=torch.bfloat16, device=dev, init="normal")
    if scheme is not None:
        quantize(model, scheme, skip=skip)
    rb = read_bytes(model)
    page = 16
    max_len = args.prompt + args.new + page
    eng = Engine(model, num_pages=-(-max_len // page) + 8, page_size=page, max_num_seqs=1,
                 max_num_batched_tokens=max(2048, args.prompt), max_model_len=max_len,
                 enable_prefix_caching=False, cuda_graph_max_batch=0 if args.smoke else 1)

    def ours(n: int):
        return eng.generate([prompt], SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))

    ours(2)  # compiles, CUDA-graph capture
    t1 = min(timed(lambda: ours(1)) for _ in range(2))
    tn = timed(lambda: ours(args.new))
    rate = (args.new - 1) / max(tn - t1, 1e-9)
    steady = steady_decode(eng, torch.tensor([prompt]), args.new)
    tokens = ours(16)[0].token_ids
    return {"rate": rate, "steady": steady, "read_bytes": rb, "first16": tokens, "first_token_s": t1}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--new", type=int, default=256)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--tuned", default="", help="a sweep_quant_wo.py JSON: use its best small-M configs")
    ap.add_argument("--smoke", action="store_true", help="tiny model on the CPU (checks the script)")
    ap.add_argument("--variants", default="", help="';'-separated subset of the variant names (bf16 always runs)")
    args = ap.parse_args()
    variants = VARIANTS
    if args.variants:
        names = {v.strip() for v in args.variants.split(";")} | {"bf16"}
        unknown = names - {v[0] for v in VARIANTS}
        if unknown:
            ap.error(f"--variants: unknown {sorted(unknown)}; choose from {[v[0] for v in VARIANTS]}")
        variants = tuple(v for v in VARIANTS if v[0] in names)
    if args.smoke:
        # bench_e2e's timers synchronize CUDA; there is nothing to synchronize on the CPU.
        torch.cuda.synchronize = lambda *a, **k: None
        cfg = dict(TINY, num_hidden_layers=2)
        args.prompt, args.new = min(args.prompt, 16), min(args.new, 8)
        dev, bw = torch.device("cpu"), 1e11
    else:
        cfg = dict(LLAMA_8B, num_hidden_layers=args.layers)
        dev, bw = torch.device("cuda"), copy_bandwidth()
    if args.tuned:
        n_tuned = load_tuned(args.tuned)
        print(f"small-M configs from {args.tuned}: {n_tuned} entries", flush=True)
    kv_per_token = cfg["num_hidden_layers"] * 2 * cfg["num_key_value_heads"] * (
        cfg["hidden_size"] // cfg["num_attention_heads"]) * 2
    mean_ctx = args.prompt + args.new / 2
    prompt = torch.randint(0, cfg["vocab_size"] - 1, (args.prompt,), generator=torch.Generator().manual_seed(1))
    prompt = prompt.tolist()
    res = {}
    for name, scheme, skip in variants:
        try:
            res[name] = run_variant(cfg, scheme, skip, dev, args, prompt)
            gc.collect()  # the previous model and its Engine (KV pool, graphs) go before the next
            if dev.type == "cuda":
                torch.cuda.empty_cache()
        except Exception as e:  # noqa: BLE001  (one failing variant must not lose the others)
            import traceback

            traceback.print_exc()
            res[name] = {"error": repr(e)[:300]}
            continue
        r = res[name]
        r["floor"] = bw / (r["read_bytes"] + mean_ctx * kv_per_token)
        print(f"{name:26s} decode {r['rate']:8.1f} tok/s (steady {r['steady']:8.1f}) floor {r['floor']:8.1f} "
              f"weights read {r['read_bytes'] / 1e9:6.2f} GB, first token {r['first_token_s'] * 1e3:6.1f} ms",
              flush=True)
    base = res.get("bf16", {})
    cases = []
    for name, _, _ in variants:
        r = res[name]
        if "error" in r:
            cases.append({"case": f"llama3.1-8b-shape decode bs1 {name}", "error": r["error"]})
            continue
        peers = {"infercore Engine bf16": base["rate"]} if name != "bf16" and "rate" in base else {}
        agree = None
        if peers:
            agree = sum(int(a == b) for a, b in zip(r["first16"], base["first16"]))
        speedup = r["rate"] / base["rate"] if peers else None
        cases.append(case(f"llama3.1-8b-shape decode bs1 prompt{args.prompt} new{args.new} {name}",
                          metric="decode throughput", unit="tok/s", ours=r["rate"], peers=peers, floor=r["floor"],
                          steady_decode_tok_s=r["steady"], weight_bytes_read=r["read_bytes"],
                          copy_bw_TBps=bw / 1e12, speedup_vs_bf16=speedup, target_speedup=TARGET.get(name),
                          greedy_first16_agree_with_bf16=agree,
                          first_token_ms=r["first_token_s"] * 1e3))  # the prompt's prefill + one sampled token
        if speedup is not None:
            target = f" (target {TARGET[name]}x)" if name in TARGET else " (no target)"
            print(f"{name}: {speedup:.2f}x bf16{target}", flush=True)
    write_results(args.out, "e2e_quant", "cpu" if args.smoke else torch.cuda.get_device_name(), cases)


if __name__ == "__main__":
    main()
