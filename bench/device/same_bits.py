"""Bitwise check of matmul against another awq_cupy tree: the same calls, hashed, in two processes.

    PYTHONPATH=<old tree> python3 bench/device/same_bits.py old.json
    python3 bench/device/same_bits.py new.json --against old.json

Each case is one matmul call (fixed seeds) on a layer shape that crosses the dispatch boundaries (a small layer the
17..32-row GEMV takes at every M, a large one it takes up to 24 rows, a long-K one) at M = 1, 8, 9, 16, 17, 24,
32, 33, 64, 256, 767, 768, 1024, fp16 and bf16, plain, with a bias and batch-invariant; the record is the sha256
of the output's bytes, after a second call of the same shape (the cached plan's) gave the same bytes as the first.
"""
import hashlib
import json
import sys

import cupy as cp
import numpy as np

import awq_cupy
from awq_cupy import formats

SHAPES = ((4096, 6144), (4096, 28672), (14336, 4096))
MS = (1, 8, 9, 16, 17, 24, 32, 33, 64, 256, 767, 768, 1024)


def main():
    out_path = sys.argv[1]
    against = sys.argv[3] if len(sys.argv) > 3 and sys.argv[2] == "--against" else None
    print(f"awq_cupy from {awq_cupy.__file__}", file=sys.stderr)
    import ml_dtypes

    rng = np.random.default_rng(7)
    res = {}
    for K, N in SHAPES:
        t = formats.pack(rng.integers(0, 16, (K, N), dtype=np.uint8), rng.integers(0, 16, (K // 128, N), np.uint8),
                         rng.uniform(0.001, 0.01, (K // 128, N)).astype(np.float16), "gemm", 128)
        for kind in ("float16", "bfloat16"):
            npdt = np.float16 if kind == "float16" else ml_dtypes.bfloat16
            w = awq_cupy.QuantizedWeight.from_gemm(t["qweight"], t["qzeros"], t["scales"], 128, dtype=kind)
            bias = cp.asarray(rng.standard_normal(N).astype(np.float32).astype(npdt))
            for M in MS:
                x = cp.asarray(rng.standard_normal((M, K)).astype(np.float32).astype(npdt))
                for variant in ("plain", "bias", "batch_invariant"):
                    kw = dict(bias=bias) if variant == "bias" else dict(batch_invariant=variant == "batch_invariant")
                    y = cp.full((M, N), np.nan, dtype=x.dtype)
                    awq_cupy.matmul(x, w, out=y, **kw)
                    first = y.view(cp.uint16).get().tobytes()
                    y.fill(np.nan)
                    awq_cupy.matmul(x, w, out=y, **kw)
                    again = y.view(cp.uint16).get().tobytes()
                    key = f"{K}x{N}/{kind}/M={M}/{variant}"
                    if first != again:
                        raise SystemExit(f"{key}: the second call differs from the first")
                    res[key] = hashlib.sha256(first).hexdigest()
    with open(out_path, "w") as f:
        json.dump(res, f, indent=1)
    print(f"{len(res)} cases hashed", file=sys.stderr)
    if against:
        old = json.load(open(against))
        diff = [k for k in res if old.get(k) != res[k]]
        missing = [k for k in old if k not in res]
        print(f"same bits: {len(res) - len(diff)} of {len(res)} cases equal to {against}; differ: {diff[:10]}; "
              f"missing: {missing[:5]}")
        return 1 if diff or missing else 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
