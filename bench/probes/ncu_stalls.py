"""Summarise ncu's per-instruction warp-stall sampling. Usage:

    ncu ... --section WarpStateStats --section SourceCounters --import-source yes -o rep python3 ...
    ncu -i rep.ncu-rep --page source --csv --print-source sass | gzip > sass.csv.gz
    python3 bench/probes/ncu_stalls.py sass.csv.gz [top]

Prints the stall reasons summed over the kernel (share of all samples) and the `top` instructions by samples,
each with its execution count and its three largest stall reasons.
"""
import collections
import csv
import gzip
import sys

path = sys.argv[1]
top = int(sys.argv[2]) if len(sys.argv) > 2 else 25
rows = list(csv.reader(gzip.open(path, "rt") if path.endswith(".gz") else open(path)))
hdr, data = rows[1], rows[2:]
ix = {h: i for i, h in enumerate(hdr)}
stall_cols = [h for h in hdr if h.startswith("stall_") and "(Not Issued)" not in h]
total = collections.Counter()
samples = executed = 0
per = []
for r in data:
    try:
        s = int(r[ix["Warp Stall Sampling (All Samples)"]] or 0)
    except ValueError:
        continue
    samples += s
    n = int(r[ix["Instructions Executed"]] or 0)
    executed += n
    st = {c: int(r[ix[c]] or 0) for c in stall_cols}
    total.update(st)
    worst = sorted(st.items(), key=lambda kv: -kv[1])[:3]
    per.append((s, r[ix["Address"]][-5:], r[ix["Source"]].strip()[:70], n, worst))
print(path, "samples", samples, "instructions executed", executed)
for c, v in total.most_common(12):
    print(f"  {c:28s} {v:7d} {100 * v / max(1, samples):5.1f}%")
for s, a, src, n, worst in sorted(per, key=lambda t: -t[0])[:top]:
    print(f"{100 * s / max(1, samples):5.1f}% {a} {n:9d} {src:70s} " + " ".join(f"{k[6:]}={v}" for k, v in worst if v))
