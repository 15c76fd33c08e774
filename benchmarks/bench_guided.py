"""Guided decoding's cost on the real SmolLM2-135M-Instruct weights: a batch of 8 requests constrained to a JSON
schema or a regex (the character DFA), or to a GBNF grammar, any JSON object, or a recursive JSON schema (the
pushdown recognizer), against the same requests unguided, each generating as many tokens as its guided twin (the peer),
in alternating rounds; and the one-time cost of a new pattern (the vocabulary's texts and trie, the first walks of
its DFA states).

    python benchmarks/bench_guided.py --out benchmarks/results/cpu/guided.json              # the 2-core CPU
    python benchmarks/bench_guided.py --device cuda --out $OUT/guided.json

The timed rounds build nothing: the guides are warm (a cold pattern's first request is timed apart). Throughput
counts the generated tokens of the batch over the wall time of ``generate``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))
sys.path.insert(0, os.path.dirname(__file__))

from _common import case, write_results  # noqa: E402

from infercore import Engine, SamplingParams  # noqa: E402

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "pattern": "[A-Z][a-z]{1,12}"},
    "age": {"type": "integer", "minimum": 0, "maximum": 150},
    "city": {"type": "string", "enum": ["Paris", "London", "Tokyo", "Lima"]},
    "hobbies": {"type": "array", "items": {"type": "string", "pattern": "[a-z ]{1,20}"}, "maxItems": 3}}}
ARITH = 'root ::= expr\nexpr ::= term (" " [-+*] " " term)*\nterm ::= [0-9]{1,3} | "(" expr ")"'
TREE = {"$defs": {"node": {"type": "object", "properties": {
    "name": {"type": "string", "pattern": "[a-z]{1,8}"},
    "children": {"type": "array", "items": {"$ref": "#/$defs/node"}, "maxItems": 2}}, "required": ["name"]}},
    "$ref": "#/$defs/node"}
PROMPTS = ["Describe a person as JSON.", "Invent a character and give it as JSON.", "A JSON record of a traveller.",
           "Give a JSON profile of a chef.", "A student as JSON, please.", "JSON for a fictional pilot.",
           "Describe your neighbour in JSON.", "A musician, as a JSON object."]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=64)
    args = ap.parse_args()
    dev = torch.device(args.device)
    eng = Engine.from_pretrained(device=dev, dtype=torch.bfloat16 if dev.type == "cuda" else None)
    n = args.max_tokens
    kinds = {
        "json schema": [SamplingParams(temperature=0.7, seed=i, max_tokens=n, guided_json=SCHEMA) for i in range(8)],
        "regex": [SamplingParams(temperature=0.7, seed=i, max_tokens=n, guided_regex=r"(\d{3}-\d{4}, ){0,6}\d{3}-\d{4}")
                  for i in range(8)],
        "GBNF grammar": [SamplingParams(temperature=0.7, seed=i, max_tokens=n, guided_grammar=ARITH) for i in range(8)],
        "any JSON object (grammar)": [SamplingParams(temperature=0.7, seed=i, max_tokens=n, guided_json=True)
                                      for i in range(8)],
        "recursive JSON schema (grammar)": [SamplingParams(temperature=0.7, seed=i, max_tokens=n, guided_json=TREE)
                                            for i in range(8)],
    }
    guided = list(kinds)
    # one-time cost of a pattern: the first request of each kind on a fresh engine's guides
    cold = {}
    for name in guided:
        t = time.perf_counter()
        out = eng.generate(PROMPTS[:1], kinds[name][:1], chat=True)[0]
        cold[name] = (time.perf_counter() - t, len(out.token_ids))
    # the peers: the same prompts and seeds unguided, each request generating as many tokens as its guided twin
    # (seeded, so the same every round), so that both runs shrink their batch alike
    for name in list(kinds):
        lengths = [len(o.token_ids) for o in eng.generate(PROMPTS, kinds[name], chat=True)]
        kinds[f"{name}, unguided"] = [SamplingParams(temperature=0.7, seed=i, max_tokens=k, ignore_eos=True)
                                      for i, k in enumerate(lengths)]
    times: dict[str, list[float]] = {k: [] for k in kinds}
    tokens: dict[str, list[int]] = {k: [] for k in kinds}
    finished: dict[str, int] = {}
    for _ in range(args.rounds):
        for name, params in kinds.items():
            if dev.type == "cuda":
                torch.cuda.synchronize()
            t = time.perf_counter()
            outs = eng.generate(PROMPTS, params, chat=True)
            if dev.type == "cuda":
                torch.cuda.synchronize()
            times[name].append(time.perf_counter() - t)
            tokens[name].append(sum(len(o.token_ids) for o in outs))
            finished[name] = sum(o.finish_reason == "stop" for o in outs)
    rate = {k: statistics.median(t / s for t, s in zip(tokens[k], times[k])) for k in kinds}
    cases = []
    for name in guided:
        peer = f"{name}, unguided"
        cases.append(case(f"SmolLM2-135M guided decoding ({name}), 8 requests, <= {n} tokens, {dev.type}",
                          metric="generated tokens/s", unit="tok/s", ours=rate[name],
                          peers={"the same requests unguided, as many tokens each": rate[peer]}, floor=None,
                          cold_first_request_s=cold[name][0], cold_first_request_tokens=cold[name][1],
                          finished_by_the_pattern=finished[name], rounds_s=times[name], tokens=tokens[name],
                          peer_rounds_s=times[peer], peer_tokens=tokens[peer]))
        print(f"{name}: {rate[name]:.1f} tok/s vs unguided {rate[peer]:.1f} "
              f"({rate[name] / rate[peer]:.2f}x); cold first request {cold[name][0]:.2f} s", flush=True)
    write_results(args.out, "guided", torch.cuda.get_device_name() if dev.type == "cuda" else "cpu", cases)


if __name__ == "__main__":
    main()
