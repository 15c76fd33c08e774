"""Probe: cross-kernel L2 prefetch of the next linears' weights during batch-1 decode (W4A16 / FP8 / bf16).

A side stream, forked inside the captured decode step, asks L2 for weights that the main stream reads
next, while the main stream runs latency-bound kernels (attention, the split merge, norms):

* ``TENSOR@HOOK=F``: a share F (default 1) of a linear's weights, spread evenly, asked for at HOOK.
  TENSOR: ``o`` (o_proj), ``gu`` (the merged gate_up), ``dn`` (down), ``nq`` (the next layer's qkv).
  HOOK: ``a`` (forked after the qkv GEMV: loads during RoPE + attention + merge), ``a2`` (after o_proj),
  ``b`` (after the gate_up GEMV: loads during down). Older names: ``o`` = ``o@a``, ``gu=F`` = ``gu@a=F``,
  ``qkv`` = ``nq@b``; a tiny F (``of=0.001``) measures the side branch's own cost;
* ``bulk``: ``cp.async.bulk.prefetch.L2`` chunks instead of per-line ``prefetch.global.L2``;
* ``normal``: prefetches without the ``evict_last`` priority;
* ``prio``: the side stream has the high stream priority;
* ``chain``: no side stream: the prefetch is a PDL kernel on the main stream, right after the hook's kernel;
* ``chunk=N``: bytes per prefetch program (bulk: one prefetch of N bytes per one-warp program).

Each variant gets its own Engine (one CUDA graph for batch 1, captured with the variant set); the
variants' steady decode rates are then timed in alternating rounds, and their greedy tokens compared.

    python benchmarks/probe_l2_prefetch.py --scheme w4a16-g128 --variants "none;o;o,qkv;o,gu=0.5" \
        --out $OUT/r/probe_l2_prefetch.json
"""

from __future__ import annotations

import argparse
import os
import sys
import time

os.environ.setdefault("INFERCORE_QUANT_AUTOTUNE", "0")

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))
sys.path.insert(0, os.path.dirname(__file__))

from _common import case, write_results  # noqa: E402
from _l2_prefetch import l2_prefetch  # noqa: E402
from bench_e2e import LLAMA_8B  # noqa: E402

from infercore import Engine, SamplingParams  # noqa: E402
from infercore.models import ModelConfig, build_model  # noqa: E402
from infercore.quant import quantize  # noqa: E402

STATE: dict = {"v": {}, "side": None}


HOOKS = ("a", "a2", "b")  # after the qkv GEMV, after o_proj, after the gate_up GEMV (forward order)
TENSORS = ("o", "gu", "dn", "nq")  # o_proj, gate_up, down, the next layer's qkv


def parse(v: str) -> dict:
    """``"gu@a=0.5,dn@a2,bulk,chunk=1048576"`` -> {"plan": {hook: [(tensor, fraction)]}, "bulk": True, ...}.
    The legacy keys ``o`` / ``of=F`` / ``gu=F`` mean hook a and ``qkv`` means ``nq@b``."""
    out: dict = {"plan": {h: [] for h in HOOKS}}
    for part in filter(None, (p.strip() for p in v.split(","))):
        if part == "none":
            continue
        k, _, val = part.partition("=")
        if k in ("bulk", "normal", "prio", "chain"):
            out[k] = True
        elif k == "chunk":
            out[k] = int(val)
        else:
            legacy = {"o": "o@a", "of": "o@a", "gu": "gu@a", "qkv": "nq@b"}
            name, _, hook = legacy.get(k, k).partition("@")
            if name not in TENSORS or hook not in HOOKS:
                raise ValueError(f"variant part {part!r}: expected TENSOR@HOOK[=F] with TENSOR in {TENSORS}, "
                                 f"HOOK in {HOOKS}")
            out["plan"][hook].append((name, float(val) if val else 1.0))
    return out


def read_set(lin: torch.nn.Module) -> list[torch.Tensor]:
    """The tensors ``lin``'s decode kernel reads: its repacks (MODE 6/7 fragments, MODE 4 words) plus its
    scales, or its plain weight."""
    from infercore.quant import repacks, wo_gemv

    q = getattr(lin, "qweight", None)
    if q is None:
        return [lin.weight]
    out: list[torch.Tensor] = []
    ent = repacks._PACKS.get(id(q))
    if ent is not None and ent[0]() is q:
        for val in ent[1].values():
            for t in val if isinstance(val, tuple) else (val,):
                if isinstance(t, torch.Tensor) and t.is_cuda:
                    out.append(t)
    hit = wo_gemv._ILV_CACHE.get(id(q))
    if hit is not None and hit[0]() is q:
        out.append(hit[1])
        out += [getattr(lin, n) for n in ("scales", "zeros") if getattr(lin, n, None) is not None]
    return out or [q]


def fork(hook: str, mods: dict, x: torch.Tensor) -> None:
    v = STATE["v"]
    items = v["plan"][hook] if v else []
    if not items or x.shape[0] > 4 or not x.is_cuda:
        return
    kw = {"bulk": bool(v.get("bulk")), "evict_last": not v.get("normal"), "pdl": bool(v.get("chain"))}
    if "chunk" in v:
        kw["chunk"] = v["chunk"]
    if v.get("chain"):  # on the main stream, a PDL kernel between the hook's kernel and the next
        for name, f in items:
            if mods.get(name) is not None:  # one kernel per linear: its largest tensor
                t = max(read_set(mods[name]), key=lambda t: t.numel() * t.element_size())
                l2_prefetch(t, fraction=f, **kw)
        return
    main = torch.cuda.current_stream()
    side = STATE["side_hi" if v.get("prio") else "side"]
    side.wait_stream(main)
    STATE["joined_to"] = side
    STATE["forked"] = True
    with torch.cuda.stream(side):
        for name, f in items:
            if mods.get(name) is None:
                continue
            for t in read_set(mods[name]):
                l2_prefetch(t, fraction=f, **kw)


def install(model) -> None:
    layers = model.model.layers
    for i, layer in enumerate(layers):
        attn, mlp = layer.self_attn, layer.mlp
        mods = {"o": attn.o_proj, "gu": mlp.gate_up_proj, "dn": mlp.down_proj,
                "nq": layers[i + 1].self_attn.qkv_proj if i + 1 < len(layers) else None}

        def wrap(mod, hook, attr="forward", _mods=mods):
            orig = getattr(mod, attr)

            def f(x, *a, _orig=orig, _hook=hook):
                y = _orig(x, *a)
                fork(_hook, _mods, x)
                return y

            setattr(mod, attr, f)

        wrap(attn.qkv_proj, "a")
        wrap(attn.o_proj, "a2")
        if hasattr(mlp.gate_up_proj, "forward_act"):
            wrap(mlp.gate_up_proj, "b", "forward_act")
    orig = model.forward

    def fwd(*a, **k):
        out = orig(*a, **k)
        if STATE.pop("forked", False):  # join the side stream (a captured graph must end on its origin stream)
            torch.cuda.current_stream().wait_stream(STATE.pop("joined_to"))
        return out

    model.forward = fwd


def steady(eng: Engine, prompt: list[int], steps: int) -> tuple[float, list[int]]:
    sp = SamplingParams(temperature=0, max_tokens=steps + 8, ignore_eos=True)
    eng.add_request(prompt, sp)
    req = list(eng.requests.values())[0]
    while not req.output_token_ids:
        eng.step()
    for _ in range(3):
        eng.step()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(steps):
        eng.step()
    torch.cuda.synchronize()
    dt = (time.perf_counter() - t) / steps
    while eng.has_unfinished():
        eng.step()
    return dt * 1e3, list(req.output_token_ids[:16])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--scheme", default="w4a16-g128", help="quantize() scheme, or 'bf16'")
    ap.add_argument("--variants", default="none;o;o,qkv;o,gu=0.5;o,qkv,gu=0.5")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--lm-head", action="store_true", help="quantize lm_head too")
    ap.add_argument("--trace", default="", help="write a chrome trace of 2 steps per variant into this folder")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    cfg = dict(LLAMA_8B, num_hidden_layers=args.layers)
    torch.manual_seed(0)
    model = build_model(ModelConfig.from_hf(cfg), dtype=torch.bfloat16, device="cuda", init="normal")
    if args.scheme != "bf16":
        quantize(model, args.scheme, skip=() if args.lm_head else ("lm_head",))
    STATE["side"] = torch.cuda.Stream()
    STATE["side_hi"] = torch.cuda.Stream(priority=-1)
    install(model)
    prompt = torch.randint(0, 128000, (512,), generator=torch.Generator().manual_seed(1)).tolist()
    names = [v.strip() for v in args.variants.split(";")]
    engines = {}
    for name in names:
        STATE["v"] = parse(name)
        engines[name] = Engine(model, num_pages=64, page_size=16, max_num_seqs=1, max_num_batched_tokens=2048,
                               max_model_len=800, enable_prefix_caching=False, cuda_graph_max_batch=1)
        steady(engines[name], prompt, 5)  # capture + compile under this variant
    times: dict[str, list[float]] = {n: [] for n in names}
    tokens: dict[str, list[int]] = {}
    for r in range(args.rounds):
        order = names if r % 2 == 0 else names[::-1]
        for name in order:
            STATE["v"] = parse(name)
            ms, tok = steady(engines[name], prompt, args.steps)
            times[name].append(ms)
            tokens.setdefault(name, tok)
            print(f"round {r} {name:24s} {ms:.4f} ms/step", flush=True)
    if args.trace:
        os.makedirs(args.trace, exist_ok=True)
        for i, name in enumerate(names):
            STATE["v"] = parse(name)
            eng = engines[name]
            eng.add_request(prompt, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))
            for _ in range(6):
                eng.step()
            torch.cuda.synchronize()
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                for _ in range(2):
                    eng.step()
                torch.cuda.synchronize()
            prof.export_chrome_trace(os.path.join(args.trace, f"trace_{i}.json"))
            while eng.has_unfinished():
                eng.step()
    base = sorted(times[names[0]])[len(times[names[0]]) // 2]
    cases = []
    for name in names:
        med = sorted(times[name])[len(times[name]) // 2]
        cases.append(case(f"{args.scheme}{' lm_head too' if args.lm_head else ''} bs1 step, prefetch [{name}]",
                          metric="step time (median of rounds)", unit="ms", ours=med, peers={}, floor=None,
                          baseline_ms=base, rounds_ms=times[name], tok_s=1e3 / med,
                          same_tokens_as_first=tokens[name] == tokens[names[0]]))
        print(f"{name:24s} median {med:.4f} ms = {1e3 / med:.1f} tok/s ({base / med:.4f}x) "
              f"same tokens: {tokens[name] == tokens[names[0]]}", flush=True)
    write_results(args.out, "probe_l2_prefetch", torch.cuda.get_device_name(), cases,
                  extra={"note": "Probe: side-stream L2 prefetch of the next linears' weights inside the captured "
                                 "decode step; medians of alternating rounds, each round's steps timed back to back."})


if __name__ == "__main__":
    main()
