#!/usr/bin/env bash
# One device call of steps, in order: bash bench/device_run.sh decode same_bits gpu_tests sanitize bench_quick
# Logs under $OUT; a short summary at the end. same_bits needs the tree to compare against in .old/ (carry it).
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python3 -m pip install -q --no-deps --no-build-isolation -e . > "$OUT/install.log" 2>&1 || { cat "$OUT/install.log"; exit 1; }
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,driver_version --format=csv,noheader
summary=()
for step in "$@"; do
  t0=$(date +%s)
  case $step in
    decode) python3 -m awq_cupy bench --decode --json "$OUT/decode.json" > "$OUT/decode.log" 2>&1; rc=$?
            tail -20 "$OUT/decode.log" ;;
    same_bits) (PYTHONPATH=.old python3 bench/same_bits.py "$OUT/same_bits_old.json" &&
                python3 bench/same_bits.py "$OUT/same_bits_new.json" --against "$OUT/same_bits_old.json") \
                 > "$OUT/same_bits.log" 2>&1; rc=$?; tail -3 "$OUT/same_bits.log" ;;
    gpu_tests) python3 -m pytest -q -n 8 -m gpu tests ${PYTEST_ARGS:-} > "$OUT/pytest_gpu.log" 2>&1; rc=$?
               tail -15 "$OUT/pytest_gpu.log" ;;
    host_tests) python3 -m pytest -q -m gpu tests/test_host_path.py > "$OUT/pytest_host.log" 2>&1; rc=$?
                tail -15 "$OUT/pytest_host.log" ;;
    sanitize) compute-sanitizer --tool memcheck --error-exitcode 1 python3 bench/sanitize_cases.py > "$OUT/memcheck.log" 2>&1; rc=$?
              tail -3 "$OUT/memcheck.log" ;;
    bench_quick) python3 -m awq_cupy bench --quick --no-decode --json "$OUT/bench.json" --plot "$OUT/bench.png" > "$OUT/bench.log" 2>&1; rc=$?
                 grep -A40 "^sum over" "$OUT/bench.log" | head -20 ;;
    bench_full) python3 -m awq_cupy bench --json "$OUT/bench_full.json" --plot "$OUT/bench_full.png" > "$OUT/bench_full.log" 2>&1; rc=$?
                grep -A60 "^sum over" "$OUT/bench_full.log" | head -60 ;;
    *) echo "unknown step $step"; rc=2 ;;
  esac
  summary+=("$step rc=$rc $(( $(date +%s) - t0 ))s")
done
printf '%s\n' "${summary[@]}"
