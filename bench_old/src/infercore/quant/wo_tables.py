"""Launch tables of the small-M weight-only kernels, measured on the H200 (the sweeps and result files
are named beside each entry), and the lookup they share (``_tuned``). ``triton_wo`` reads them; a shape
or M bucket missing here takes ``triton_wo._small_cfg``'s heuristic."""

from __future__ import annotations

import triton

# MODE 5's default tile (M = 2..16, or shapes not in the table) and MODE 2's, where MODE 5 cannot run.
_MODE5_DEFAULT = {"MODE": 5, "BLOCK_N": 128, "BLOCK_K": 128, "SPLIT": 0, "num_warps": 4, "num_stages": 3}

_MODE2_DEFAULT = {"MODE": 2, "BLOCK_N": 64, "BLOCK_K": 128, "SPLIT": 0, "num_warps": 4, "num_stages": 3}


def _packed4(bn: int, bk: int, warps: int, stages: int, split: int) -> dict:
    """A MODE 4 table entry with the packed fp16 dot (``_packed_rows``)."""
    return {"MODE": 4, "BLOCK_N": bn, "BLOCK_K": bk, "num_warps": warps, "num_stages": stages, "SPLIT": split,
            "PACKED": True}


# Small-M launch table: (kind, N, K, M bucket) -> config, from benchmarks/sweep_quant_wo.py on an
# H200 (its "table" output). Missing entries use the heuristic in ``_small_cfg``.
SMALL_M_TUNED: dict[tuple[str, int, int, int], dict] = {
    # benchmarks/sweep_quant_wo.py on the H200: results/h200/quant_wo_small_m.json; the MODE 4 "PACKED" entries
    # (FP8 at M = 1, 2; INT4 at M = 2 and o_proj's M = 4) from its --grid packed runs,
    # results/h200/sweeps/sweep_packed_fp8.json and sweep_packed_rows_int4.json (fifteenth session)
    ("int4", 14336, 4096, 1): {'MODE': 5, 'BLOCK_N': 128, 'BLOCK_K': 128, 'num_warps': 4, 'num_stages': 3, 'SPLIT': 4},
    ("int4", 14336, 4096, 4): {'MODE': 5, 'BLOCK_N': 128, 'BLOCK_K': 128, 'num_warps': 4, 'num_stages': 3, 'SPLIT': 4},
    ("int4", 14336, 4096, 16): {'MODE': 5, 'BLOCK_N': 128, 'BLOCK_K': 128, 'num_warps': 4, 'num_stages': 3, 'SPLIT': 4},
    ("fp8", 14336, 4096, 1): _packed4(8, 2048, 4, 2, 1),
    ("fp8", 14336, 4096, 2): _packed4(8, 2048, 4, 2, 1),
    ("fp8", 14336, 4096, 4): {'MODE': 5, 'BLOCK_N': 128, 'BLOCK_K': 256, 'num_warps': 4, 'num_stages': 3, 'SPLIT': 2},
    ("fp8", 14336, 4096, 16): {'MODE': 5, 'BLOCK_N': 128, 'BLOCK_K': 256, 'num_warps': 4, 'num_stages': 3, 'SPLIT': 2},
    ("int4", 6144, 4096, 1): {'MODE': 4, 'BLOCK_N': 8, 'BLOCK_K': 2048, 'num_warps': 2, 'num_stages': 2, 'SPLIT': 0},
    ("int4", 6144, 4096, 2): _packed4(4, 1024, 1, 2, 1),
    ("int4", 6144, 4096, 4): {'MODE': 5, 'BLOCK_N': 128, 'BLOCK_K': 128, 'num_warps': 4, 'num_stages': 3, 'SPLIT': 8},
    ("int4", 6144, 4096, 16): {'MODE': 5, 'BLOCK_N': 64, 'BLOCK_K': 128, 'num_warps': 4, 'num_stages': 3, 'SPLIT': 4},
    ("fp8", 6144, 4096, 1): _packed4(8, 2048, 4, 2, 1),
    ("fp8", 6144, 4096, 2): _packed4(8, 2048, 4, 2, 0),
    ("fp8", 6144, 4096, 4): {'MODE': 5, 'BLOCK_N': 128, 'BLOCK_K': 128, 'num_warps': 4, 'num_stages': 3, 'SPLIT': 8},
    ("fp8", 6144, 4096, 16): {'MODE': 5, 'BLOCK_N': 128, 'BLOCK_K': 128, 'num_warps': 4, 'num_stages': 3, 'SPLIT': 4},
    ("int4", 4096, 4096, 1): {'MODE': 4, 'BLOCK_N': 4, 'BLOCK_K': 2048, 'num_warps': 2, 'num_stages': 1, 'SPLIT': 1},
    ("int4", 4096, 4096, 2): _packed4(8, 2048, 2, 2, 0),
    ("int4", 4096, 4096, 4): _packed4(8, 2048, 2, 2, 0),
    ("int4", 4096, 4096, 16): {'MODE': 5, 'BLOCK_N': 64, 'BLOCK_K': 128, 'num_warps': 4, 'num_stages': 3, 'SPLIT': 8},
    ("fp8", 4096, 4096, 1): _packed4(8, 2048, 4, 2, 1),
    ("fp8", 4096, 4096, 2): _packed4(8, 2048, 4, 2, 1),
    ("fp8", 4096, 4096, 4): {'MODE': 5, 'BLOCK_N': 128, 'BLOCK_K': 128, 'num_warps': 4, 'num_stages': 3, 'SPLIT': 8},
    ("fp8", 4096, 4096, 16): {'MODE': 5, 'BLOCK_N': 128, 'BLOCK_K': 256, 'num_warps': 4, 'num_stages': 3, 'SPLIT': 4},
    ("int4", 28672, 4096, 1): {'MODE': 5, 'BLOCK_N': 128, 'BLOCK_K': 128, 'num_warps': 4, 'num_stages': 3, 'SPLIT': 4},
    ("int4", 28672, 4096, 4): {'MODE': 5, 'BLOCK_N': 128, 'BLOCK_K': 128, 'num_warps': 4, 'num_stages': 3, 'SPLIT': 4},
    ("int4", 28672, 4096, 16): {'MODE': 5, 'BLOCK_N': 128, 'BLOCK_K': 128, 'num_warps': 4, 'num_stages': 3, 'SPLIT': 2},
    ("fp8", 28672, 4096, 1): _packed4(8, 2048, 4, 2, 0),
    ("fp8", 28672, 4096, 4): {'MODE': 5, 'BLOCK_N': 128, 'BLOCK_K': 256, 'num_warps': 4, 'num_stages': 3, 'SPLIT': 1},
    ("fp8", 28672, 4096, 16): {'MODE': 5, 'BLOCK_N': 128, 'BLOCK_K': 256, 'num_warps': 4, 'num_stages': 3, 'SPLIT': 1},
    ("int4", 4096, 14336, 1): {'MODE': 4, 'BLOCK_N': 4, 'BLOCK_K': 2048, 'num_warps': 2, 'num_stages': 1, 'SPLIT': 1},
    ("int4", 4096, 14336, 2): _packed4(8, 2048, 2, 2, 0),
    ("int4", 4096, 14336, 4): {'MODE': 5, 'BLOCK_N': 128, 'BLOCK_K': 128, 'num_warps': 4, 'num_stages': 3, 'SPLIT': 16},
    ("int4", 4096, 14336, 16): {'MODE': 5, 'BLOCK_N': 64, 'BLOCK_K': 128, 'num_warps': 4, 'num_stages': 3, 'SPLIT': 8},
    ("fp8", 4096, 14336, 1): _packed4(4, 2048, 4, 2, 0),
    ("fp8", 4096, 14336, 2): _packed4(8, 2048, 4, 2, 0),
    ("fp8", 4096, 14336, 4): {'MODE': 5, 'BLOCK_N': 128, 'BLOCK_K': 256, 'num_warps': 4, 'num_stages': 3, 'SPLIT': 8},
    ("fp8", 4096, 14336, 16): {'MODE': 5, 'BLOCK_N': 128, 'BLOCK_K': 256, 'num_warps': 4, 'num_stages': 3, 'SPLIT': 8},
}


# MODE 6 (``triton_frag``: weights stored as MMA fragments) where the H200 sweep measured it faster than
# the table above (``python benchmarks/sweep_frag.py --kinds int4 --wn also``; the tiles below are from
# results/h200/quant_wo_mode6_one_mma.json, the kernel with one MMA per word and, with WN, the MMAs of a
# group chained before its scale): INT4 at M <= 4 on the MLP and qkv shapes, and the merged gate_up at
# M <= 16 (34.2 vs 38.4 us for MODE 5 at M=16). It loses on o_proj, at M = 16 elsewhere and for FP8,
# which keep MODEs 4 / 5. "WN": the warps split N (``triton_frag._frag_kernel``'s WN). A None entry: MODE 4's
# packed INT4 dot wins at that M (fourteenth session, results/h200/sweeps/sweep_mode4_packed.json).
# 14336x4096: M=1 14.1 us (bf16 32.7, tinygemm 18.0), M=4 17.3; 28672x4096 M=1 23.1, M=4 25.8
# (4096x14336 M=1 16.0, M=4 20.3 and 6144x4096 M=1 9.8, M=4 11.7 before the None entries below).
MODE6_TUNED: dict[tuple[str, int, int, int], dict | None] = {
    # M=1 on the MLP shapes (sixteenth session, results/h200/sweeps/probe_frag_depth.json, alternating rounds):
    # DEPTH 3 (no register rotation) under a 128-register cap, 13.70 vs 13.99 us and 21.89 vs 23.14 us for
    # the DEPTH 2 tiles before; M=4 on 14336x4096 eight warps, 16.85 vs 17.26 us; M=2 there the warps splitting
    # K at DEPTH 3 (sweeps/probe_frag_depth_caps.json).
    ("int4", 14336, 4096, 1): {'WN': 1, 'WARPS': 2, 'REPS': 4, 'SPLIT': 8, 'DEPTH': 3, 'MAXNREG': 128},
    ("int4", 14336, 4096, 2): {'WARPS': 4, 'REPS': 4, 'SPLIT': 1, 'DEPTH': 3},  # 15.59 vs 16.85 us (_caps.json)
    ("int4", 14336, 4096, 4): {'WN': 1, 'WARPS': 8, 'REPS': 4, 'SPLIT': 8, 'DEPTH': 2},
    ("int4", 28672, 4096, 1): {'WN': 1, 'WARPS': 4, 'REPS': 4, 'SPLIT': 8, 'DEPTH': 3, 'MAXNREG': 128},
    ("int4", 28672, 4096, 4): {'WARPS': 4, 'REPS': 4, 'SPLIT': 1, 'DEPTH': 1},
    ("int4", 28672, 4096, 16): {'WN': 1, 'WARPS': 2, 'REPS': 4, 'SPLIT': 4, 'DEPTH': 1},
    ("int4", 4096, 14336, 1): None,  # MODE 4 PACKED: 14.4 vs 16.4 us
    # (M 2 there: MODE 4's packed dot at 2 rows, 19.0 / 9.4 us; M 3-4: MODE 5 on the stored words, 21.9 / 13.8 us
    # against MODE 6's 20.3 / 11.7, so that a weight keeps one repacked copy: results/h200/quant_wo_dispatch.json,
    # quant_wo_small_m.json, quant_wo_mode6_one_mma.json)
    ("int4", 4096, 14336, 4): None,
    ("int4", 6144, 4096, 1): None,  # MODE 4 PACKED: 7.3 vs 9.8 us
    ("int4", 6144, 4096, 4): None,
}


def _tuned(table: dict, kind: str, n: int, k: int, m: int, borrow: int) -> tuple[bool, dict | None]:
    """``table``'s entry for this shape and M bucket: the first of the bucket and ``borrow`` larger ones
    present (an unswept bucket borrows the next larger one's tile). ``(found, entry)``; an entry may be
    None (MODE6_TUNED: not MODE 6 there)."""
    mb = triton.next_power_of_2(m)
    key = next(((kind, n, k, mb << i) for i in range(borrow + 1) if (kind, n, k, mb << i) in table), None)
    return (False, None) if key is None else (True, table[key])


# Untuned INT4 shapes run MODE 6 at M=1 from this many channels and bytes of codes (``TF.m1_config``: the
# warps splitting N, DEPTH 3 under a 128-register cap). On the H200 it beat MODE 4 on 14336x4096 and
# 28672x4096 (MODE6_TUNED), on the 128256-row lm_head (73.9 vs 107.2 us for MODE 4's best tile,
# sweeps/probe_lm_head.json), 8192x8192 (14.8 vs 16.7) and 10240x8192 (18.4 vs 20.7); MODE 4 won on 4096
# or 6144 channels and on 8192x4096 (9.8 vs 11.3 us; sweeps/probe_untuned_int4.json).
MODE6_MIN_N = 8192

MODE6_MIN_BYTES = 24 << 20


# MODE 7 (``gluon_frag``: MODE 6's fragments streamed by TMA, one warp per 64-channel block; sm90+) where the
# H200 probe measured it faster than the MODE 6 entry above (seventeenth session,
# results/h200/sweeps/probe_tma_frag_w.json, alternating rounds): 14336x4096 M=1 13.09 vs 13.73 us, M=2 14.31
# vs 15.62, M=4 15.23 vs 16.93; the merged gate_up with SiLU M=1 20.15 vs 22.11, M=4 22.16 vs 32.76. It lost
# on down, qkv, o_proj and the lm_head (fewer channel blocks: a warp's groups run one after another) and tied
# at M=16. Same repacked words as MODE 6, so a weight still keeps one copy; on GPUs before sm90 the MODE 6
# entries run. With the eighteenth session's split-K finishes (unrolled; tagged at M <= 2) the dispatcher reads
# 11.05 / 11.88 / 14.65 / 20.32 us at M = 1 / 2 / 4 / 16 on 14336x4096 and 18.89 / 20.64 on the merged gate_up
# at M = 1 / 4 (results/h200/quant_wo_dispatch.json). Nineteenth session: with more splits (4 groups or fewer
# per warp, so ~1800 one-warp programs keep the loads in flight) MODE 7 also wins on down and qkv, and at M 5-8
# on 14336x4096 (results/h200/sweeps/probe_mode7_small_shapes.json, probe_mode7_down_m.json,
# probe_mode7_kmajor.json; alternating rounds against the dispatcher's MODE 4 / 5): down M = 1 / 2 / 4 / 8 / 16
# 12.41 / 13.44 / 15.38 / 16.01 / 20.47 us vs 14.35 / 18.99 / 23.97 / 22.54 / 22.50; qkv M = 1 / 2 / 4 7.18 /
# 8.16 / 8.81 vs 7.31 / 9.51 / 10.50, M=8 9.94 vs 12.25 (probe_mode7_more.json; M=16: 13.40 vs MODE 5's 12.51);
# 14336x4096 M=8 14.38 vs 21.35. o_proj stays on MODE 4: MODE 7 wins at M = 2 / 4 (6.87 / 8.84 vs 7.13 / 10.12)
# but loses at M=1 (6.42 vs 5.29), and a weight keeps one repacked copy.
MODE7_TUNED: dict[tuple[str, int, int, int], dict | None] = {
    ("int4", 14336, 4096, 1): {"MODE": 7, "W": 1, "STAGES": 2, "SPLIT": 8},
    ("int4", 14336, 4096, 2): {"MODE": 7, "W": 1, "STAGES": 2, "SPLIT": 8},
    ("int4", 14336, 4096, 4): {"MODE": 7, "W": 1, "STAGES": 2, "SPLIT": 8},
    ("int4", 14336, 4096, 8): {"MODE": 7, "W": 1, "STAGES": 2, "SPLIT": 4},
    # M 9-16 (two B fragments) after the unrolled finish, eighteenth session: 20.19 vs 22.03 us for MODE 5
    # (results/h200/sweeps/probe_tma_frag_after_finish.json, alternating rounds)
    ("int4", 14336, 4096, 16): {"MODE": 7, "W": 1, "STAGES": 2, "SPLIT": 4},
    ("int4", 28672, 4096, 1): {"MODE": 7, "W": 1, "STAGES": 2, "SPLIT": 4},
    ("int4", 28672, 4096, 4): {"MODE": 7, "W": 1, "STAGES": 2, "SPLIT": 4},
    ("int4", 4096, 14336, 1): {"MODE": 7, "W": 1, "STAGES": 2, "SPLIT": 28},
    ("int4", 4096, 14336, 2): {"MODE": 7, "W": 1, "STAGES": 2, "SPLIT": 16},
    ("int4", 4096, 14336, 4): {"MODE": 7, "W": 1, "STAGES": 2, "SPLIT": 16},
    ("int4", 4096, 14336, 8): {"MODE": 7, "W": 1, "STAGES": 2, "SPLIT": 8},
    ("int4", 4096, 14336, 16): {"MODE": 7, "W": 1, "STAGES": 2, "SPLIT": 8},
    ("int4", 6144, 4096, 1): {"MODE": 7, "W": 1, "STAGES": 2, "SPLIT": 32},
    ("int4", 6144, 4096, 2): {"MODE": 7, "W": 1, "STAGES": 2, "SPLIT": 16},
    ("int4", 6144, 4096, 4): {"MODE": 7, "W": 1, "STAGES": 2, "SPLIT": 8},
    ("int4", 6144, 4096, 8): {"MODE": 7, "W": 1, "STAGES": 2, "SPLIT": 4},
    ("int4", 6144, 4096, 16): None,  # MODE 5
}
