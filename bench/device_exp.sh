#!/usr/bin/env bash
# One device call (v20): install, GPU tests, memcheck + racecheck, an A/B of two GEMM shape options, the full
# benchmark of both models. Files under $OUT (at most 8 come back).
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python3 -m pip install -q --no-deps --no-build-isolation -e . > /tmp/install.log 2>&1 || { cat /tmp/install.log; exit 1; }
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,driver_version --format=csv,noheader
timeout 300 python3 -m pytest -q -x -m gpu tests > "$OUT/pytest_gpu.log" 2>&1; echo "pytest rc=$?"; tail -3 "$OUT/pytest_gpu.log"
for tool in memcheck racecheck; do
  timeout 200 compute-sanitizer --tool $tool --error-exitcode 1 python3 bench/sanitize_cases.py > /tmp/$tool.log 2>&1
  echo "$tool rc=$?" | tee -a "$OUT/sanitize.log"; tail -3 /tmp/$tool.log | tee -a "$OUT/sanitize.log"
done
AB_CASES=qkv:64,o:64:128,gate_up:32:64:128,down:32:64:128 timeout 200 python3 bench/ab_gemm.py v20c base \
  t2:tiles=2 d8:depth=8 2>&1 | tee "$OUT/ab3.txt"
timeout 200 python3 -m awq_cupy bench --models mistral-7b --json "$OUT/h200_mistral7b_fp16.json" \
  --plot "$OUT/h200_mistral7b_fp16.png" > /tmp/bm.log 2>&1; echo "bench rc=$?"
timeout 200 python3 -m awq_cupy bench --models llama-2-70b --trials 3 --json "$OUT/h200_llama70b_fp16.json" \
  --plot "$OUT/h200_llama70b_fp16.png" > /tmp/bl.log 2>&1; echo "bench rc=$?"
python3 - "$OUT" <<'PY'
import json, sys, collections
for f in ("h200_mistral7b_fp16", "h200_llama70b_fp16"):
    try:
        d = json.load(open(f"{sys.argv[1]}/{f}.json"))
    except Exception as e:
        print(f, e); continue
    s = collections.defaultdict(lambda: collections.defaultdict(float))
    for r in d["rows"]:
        s[r["M"]][r["contender"]] += r["us"]
    print(f, " ".join(f"{M}:{v['awq_cupy']:.1f}/{v['cublas_fp16'] / v['awq_cupy']:.2f}x" for M, v in sorted(s.items())))
PY
