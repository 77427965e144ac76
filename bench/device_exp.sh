#!/usr/bin/env bash
# v20 follow-up: the 128-token tile's PEND / depth, and a tune of the per-layer cuBLAS model on the v20 kernel.
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python3 -m pip install -q --no-deps --no-build-isolation -e . > /tmp/install.log 2>&1 || { cat /tmp/install.log; exit 1; }
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,driver_version --format=csv,noheader
AB_CASES=qkv:128,o:96:128,gate_up:96:128,down:128 timeout 200 python3 bench/ab_gemm.py v20d base \
  p1:pend=1 p2:pend=2 d8:depth=8 d8p1:depth=8,pend=1 d6p1:depth=6,pend=1 2>&1 | tee "$OUT/ab4.txt"
timeout 300 python3 -m awq_cupy tune --m 16,24,256,384,512,768,1024,1536,2048 --out "$OUT/dispatch_h200_v20.json" \
  2>&1 | tee "$OUT/h200_tune_v20.txt" | tail -14
