#!/usr/bin/env bash
# Session experiment (v20): wgmma GEMM A/B of batched weight loads (BAT), PEND, depth.
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python3 -m pip install -q --no-deps --no-build-isolation -e . > /tmp/install.log 2>&1 || { cat /tmp/install.log; exit 1; }
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,driver_version --format=csv,noheader
AB_CASES=qkv:64:256,o:64:128,gate_up:32:64:256:1024,down:32:64:128 timeout 400 python3 bench/ab_gemm.py v20b base \
  p3:pend=3 bat:bat=1 b3:bat=1,pend=3 b8:bat=1,depth=8 b8p3:bat=1,depth=8,pend=3 2>&1 | tee "$OUT/ab2.txt"
