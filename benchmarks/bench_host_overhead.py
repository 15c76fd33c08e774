"""Host milliseconds per decode step of the Engine, with the model replaced by a free stub (CPU only).

The stub's forward returns a fixed hidden state, its logits are a fixed tensor and ``sample`` returns
fixed tokens, so what is timed is the engine's own host work per step: scheduling, block tables /
slot mappings / positions / sampling parameters, and output processing (stop checks, outputs).
Shapes follow benchmarks/bench_e2e.py's steady decode: prompts of 512 tokens, 256 new tokens,
page size 16, prefix caching off, every request decoding in every timed step.

Phases (median over the timed steps, ms):
  schedule    Scheduler.schedule
  prepare     the runner's host inputs and tensors (eager path: ModelRunner.prepare)
  stage       the CUDA-graph path's staging of the same step into its host buffers (measured on
              the CPU by calling the graph runner's host half; absent if the engine has none)
  stub        the stub model + sampler (the GPU's share; near zero)
  post        the rest of Engine.step: token appends, stop checks, RequestOutputs
  total       Engine.step wall time minus stub

    python benchmarks/bench_host_overhead.py [--batches 64,256] [--steps 40] [--out results.json]
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

import infercore.engine.graph_runner as graph_runner_mod  # noqa: E402
import infercore.engine.runner as runner_mod  # noqa: E402
from infercore import Engine, SamplingParams  # noqa: E402
from infercore.engine import ScheduledBatch  # noqa: E402
from infercore.kv import FullAttentionSpec  # noqa: E402


class _Cfg:
    vocab_size = 128256
    max_position_embeddings = 131072
    eos_token_id = 128001


class StubModel(torch.nn.Module):
    """Follows the models contract but costs (almost) nothing: fixed hidden states and logits."""

    def __init__(self, hidden: int = 8, vocab: int = 64) -> None:
        super().__init__()
        self.config = _Cfg()
        self.w = torch.nn.Parameter(torch.zeros(1))
        self.hidden = torch.zeros(1 << 17, hidden)
        self.logits = torch.zeros(1024, vocab)
        self.clock = 0.0

    def kv_specs(self):
        return [FullAttentionSpec(num_kv_heads=1, head_dim=8)]

    def forward(self, input_ids, positions, kv_caches, meta):
        t = time.perf_counter()
        out = self.hidden[: input_ids.shape[0]]
        self.clock += time.perf_counter() - t
        return out

    def compute_logits(self, hidden):
        t = time.perf_counter()
        out = self.logits[: hidden.shape[0]]
        self.clock += time.perf_counter() - t
        return out


def _stub_sampler(model: StubModel):
    tokens = torch.full((1024,), 7, dtype=torch.long)

    def sample(logits, params, *, prev_tokens=None, check_values=True):
        t = time.perf_counter()
        out = tokens[: logits.shape[0]]
        model.clock += time.perf_counter() - t
        return out

    return sample


class _Timer:
    """Wraps ``obj.name`` and accumulates its wall time into ``self.total``."""

    def __init__(self, obj, name: str) -> None:
        self.total = 0.0
        fn = getattr(obj, name)

        def wrapped(*a, **k):
            t = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                self.total += time.perf_counter() - t

        setattr(obj, name, wrapped)


def run(batch: int, steps: int, prompt: int, new: int, async_scheduling: bool | None) -> dict:
    model = StubModel()
    sampler = _stub_sampler(model)
    runner_mod.sample = sampler
    graph_runner_mod.sample = sampler
    page = 16
    kwargs = dict(num_pages=batch * -(-(prompt + new + page) // page) + 64, page_size=page, max_num_seqs=batch,
                  max_num_batched_tokens=16384, max_model_len=prompt + new + page, enable_prefix_caching=False)
    if async_scheduling is not None:
        kwargs["async_scheduling"] = async_scheduling
    eng = Engine(model, **kwargs)
    gen = torch.Generator().manual_seed(1)
    sp = SamplingParams(temperature=0, max_tokens=new, ignore_eos=True)
    for p in torch.randint(0, 128000, (batch, prompt), generator=gen):
        eng.add_request(p.tolist(), sp)
    reqs = list(eng.requests.values())
    while any(not r.output_token_ids for r in reqs) or len(eng.scheduler.running) < batch:
        eng.step()
    eng.step()
    sched = _Timer(eng.scheduler, "schedule")
    prep = _Timer(eng.runner, "prepare")
    # The CUDA-graph path's host half (if this engine version has one that runs on the CPU).
    staging = None
    if hasattr(graph_runner_mod.CUDAGraphRunner, "stage"):
        gr = graph_runner_mod.CUDAGraphRunner(eng.runner, max_batch=batch, max_model_len=prompt + new + page,
                                              page_size=page)

        def staging() -> float:
            running = list(eng.scheduler.running)
            b = ScheduledBatch(requests=running, num_new_tokens=[1] * len(running))
            t = time.perf_counter()
            gr.stage(b)
            return time.perf_counter() - t
    rows = {k: [] for k in ("schedule", "prepare", "stage", "stub", "post", "total")}
    for _ in range(steps):
        s0, p0, m0 = sched.total, prep.total, model.clock
        t = time.perf_counter()
        eng.step()
        wall = time.perf_counter() - t
        ds, dp, dm = sched.total - s0, prep.total - p0, model.clock - m0
        rows["schedule"].append(ds)
        rows["prepare"].append(dp)
        rows["stub"].append(dm)
        rows["post"].append(wall - ds - dp - dm)
        rows["total"].append(wall - dm)
        if staging is not None:
            rows["stage"].append(staging())
    assert all(len(r.output_token_ids) < new for r in reqs), "increase --new: requests finished while timed"
    out = {k: 1e3 * statistics.median(v) for k, v in rows.items() if v}
    out["batch"] = batch
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", default="64,256")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--new", type=int, default=256)
    ap.add_argument("--async-scheduling", choices=["default", "on", "off"], default="default")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    torch.set_num_threads(1)
    mode = {"default": None, "on": True, "off": False}[args.async_scheduling]
    results = [run(int(b), args.steps, args.prompt, args.new, mode) for b in args.batches.split(",")]
    keys = [k for k in ("schedule", "prepare", "stage", "stub", "post", "total") if k in results[0]]
    print("host ms per decode step (median; CPU, stub model)")
    print(f"{'batch':>6} " + " ".join(f"{k:>9}" for k in keys))
    for r in results:
        print(f"{r['batch']:>6} " + " ".join(f"{r[k]:9.3f}" for k in keys))
    if args.out:
        # Shared format (higher is better): host-limited steps per second; the phases ride along in ms.
        cases = [case(f"engine host work per decode step, batch {r['batch']} (stub model)",
                      metric="host-limited step rate", unit="steps/s", ours=1e3 / r["total"], peers={}, floor=None,
                      ms_per_step={k: r[k] for k in keys}, async_scheduling=args.async_scheduling)
                 for r in results]
        write_results(args.out, "host_overhead", f"cpu ({os.cpu_count()} cores)", cases)


if __name__ == "__main__":
    main()
