#!/usr/bin/env bash
# One device call: install, GPU tests, compute-sanitizer, the quick benchmark. Logs go to $OUT.
# TIMING=0 skips the benchmark, SANITIZE=0 the sanitizer runs; PYTEST_ARGS adds pytest arguments.
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python3 -m pip install -q --no-deps --no-build-isolation -e . > "$OUT/install.log" 2>&1 || { cat "$OUT/install.log"; exit 1; }
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,driver_version --format=csv,noheader
python3 -m pytest -q -x -m gpu tests ${PYTEST_ARGS:-} 2>&1 | tee "$OUT/pytest_gpu.log" | tail -25
if [ "${SANITIZE:-1}" = 1 ]; then
  compute-sanitizer --tool memcheck --error-exitcode 1 python3 bench/sanitize_cases.py > "$OUT/memcheck.log" 2>&1; echo "memcheck rc=$?"; tail -3 "$OUT/memcheck.log"
  compute-sanitizer --tool racecheck --error-exitcode 1 python3 bench/sanitize_cases.py > "$OUT/racecheck.log" 2>&1; echo "racecheck rc=$?"; tail -3 "$OUT/racecheck.log"
fi
if [ "${TIMING:-1}" = 1 ]; then python3 -m awq_cupy bench --quick --json "$OUT/bench.json" --plot "$OUT/bench.png" 2>&1 | tee "$OUT/bench.log"; fi
