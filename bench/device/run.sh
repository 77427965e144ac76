#!/usr/bin/env bash
# One device call of steps, in order: bash bench/device/run.sh decode same_bits gpu_tests sanitize probes examples bench_quick
# (also: checks, host_tests, bench_peer, bench_full, dispatch_sweep, m128_ab, m512_ab, ks_ab, k2tail_ab, k2tail_check,
#  producers_ab, signal_ab, tma_ab, tma_check, wide_tail_ab, m128_tail_ab, pair_tail_check)
# Logs under $OUT; a short summary at the end. same_bits needs the tree to compare against in .old/ (carry it).
# gpu_tests runs PYTEST_PATHS (default: tests) with PYTEST_ARGS on PYTEST_WORKERS processes (default 14: the whole
# suite took 255 s on the H200 host, 16 cores).
# Wheels in .whl/ (carry it) are installed for the run: the peers of bench_peer (humming-kernels).
cd "$(dirname "$0")/../.." || exit 1   # the repo root: the paths below and .old/ are relative to it
# CARD=H200: run nothing (exit 3) unless the GPU's name contains it. A request for nvidia-h200 may get an H100; a
# call that finds another card this way cost about 30 s of device time, against minutes for the steps.
if [ -n "${CARD:-}" ]; then
  gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
  case $gpu in *"$CARD"*) ;; *) echo "CARD=$CARD, but this GPU is $gpu: nothing run"; exit 3 ;; esac
fi
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python3 -m pip install -q --no-deps --no-build-isolation -e . > "$OUT/install.log" 2>&1 || { cat "$OUT/install.log"; exit 1; }
if ls .whl/*.whl > /dev/null 2>&1; then   # peers' wheels (bench --contenders humming), carried as .whl
  python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl > "$OUT/wheels.log" 2>&1 || cat "$OUT/wheels.log"
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,driver_version --format=csv,noheader
# the GPU tests and memcheck, shared by gpu_tests, sanitize and checks
# --durations: the suite's wall time decides what else fits one call (255 s on the H200, 407-465 s on an H100)
run_gpu_tests() { python3 -m pytest -q -n ${PYTEST_WORKERS:-14} --durations=15 -m gpu ${PYTEST_PATHS:-tests} \
                    ${PYTEST_ARGS:-} > "$OUT/pytest_gpu.log" 2>&1; }
run_memcheck() { compute-sanitizer --tool memcheck --error-exitcode 1 python3 bench/device/sanitize_cases.py \
                   > "$OUT/memcheck.log" 2>&1; }
summary=()
for step in "$@"; do
  t0=$(date +%s)
  case $step in
    decode) python3 -m awq_cupy bench --decode --json "$OUT/decode.json" > "$OUT/decode.log" 2>&1; rc=$?
            tail -20 "$OUT/decode.log" ;;
    same_bits) (PYTHONPATH=.old python3 bench/device/same_bits.py "$OUT/same_bits_old.json" &&
                python3 bench/device/same_bits.py "$OUT/same_bits_new.json" --against "$OUT/same_bits_old.json") \
                 > "$OUT/same_bits.log" 2>&1; rc=$?; tail -3 "$OUT/same_bits.log" ;;
    gpu_tests) run_gpu_tests; rc=$?; tail -15 "$OUT/pytest_gpu.log" ;;
    checks) # gpu_tests and sanitize side by side (neither is timed; ~260 s on the H200 for both, not ~400 in turn)
            run_memcheck & san=$!
            run_gpu_tests; rc=$?
            wait $san || rc=1
            tail -4 "$OUT/pytest_gpu.log"; tail -1 "$OUT/memcheck.log" ;;
    host_tests) python3 -m pytest -q -m gpu tests/test_launch.py > "$OUT/pytest_host.log" 2>&1; rc=$?
                tail -15 "$OUT/pytest_host.log" ;;
    sanitize) run_memcheck; rc=$?
              tail -3 "$OUT/memcheck.log" ;;
    probes) rc=0   # each probe briefly (PROBE_TIMEOUT s; a probe cut off after printing rows counts as running)
            for cmd in "mma_probe.py" "wgmma_probe.py" "wgmma_sts_probe.py second" "stream_probe.py 16" \
                       "launch_floor.py mistral-7b 1" "cluster_occupancy.py" "gemv_trace.py 1 mistral-7b" \
                       "gemv_two_per_sm.py" "gemv_wide_probe.py 24 float16 mistral-7b" "gemv_stages.py base:1,3" \
                       "wb_case.py 4,4 4096 4096 64 4 2" "wb_probe.py 64 4,4"; do
              log="$OUT/probe_${cmd%%.py*}.log"
              timeout "${PROBE_TIMEOUT:-40}" python3 bench/probes/$cmd > "$log" 2>&1; prc=$?
              lines=$(grep -cv '^\s*$' "$log")
              if [ $prc -ne 0 ] && { [ $prc -ne 124 ] || [ "$lines" -lt 2 ]; }; then rc=1; fi
              echo "probe $cmd: rc=$prc, $lines lines; $(tail -1 "$log" | cut -c1-100)"
            done ;;
    examples) { python3 examples/run_checkpoint.py --layers 4 --hidden 4096 --kv 1024 --inter 14336 &&
                python3 examples/run_checkpoint.py --layers 4 --hidden 4096 --kv 1024 --inter 14336 --tokens 16 &&
                python3 examples/capture_decode_step.py --layers 32 &&
                python3 examples/capture_decode_step.py --layers 32 --tokens 16 &&
                python3 examples/quantize_awq.py --hidden 4096 --xp cupy &&
                python3 examples/fused_gate_up_silu.py && python3 examples/fused_gate_up_silu.py --dtype bfloat16 &&
                python3 examples/fused_gate_up_silu.py --hidden 5120 --inter 13824 &&
                python3 examples/fused_gate_up_silu.py --hidden 8192 --inter 28672; } > "$OUT/examples.log" 2>&1; rc=$?
              grep -E "eager|replay|RTN|AWQ|fused|Error|error" "$OUT/examples.log" ;;
    bench_quick) python3 -m awq_cupy bench --quick --no-decode --json "$OUT/bench.json" --plot "$OUT/bench.png" > "$OUT/bench.log" 2>&1; rc=$?
                 grep -A40 "^sum over" "$OUT/bench.log" | head -20 ;;
    bench_peer) rc=0   # every M against the peers, both models; PEER_DTYPES (default: float16 bfloat16), PEER_M
                for dt in ${PEER_DTYPES:-float16 bfloat16}; do
                  python3 -m awq_cupy bench --no-decode --dtype $dt ${PEER_M:+--m $PEER_M} \
                    --contenders awq_cupy cublas_fp16 ${PEERS:-humming} --trials ${PEER_TRIALS:-3} \
                    --json "$OUT/bench_peer_$dt.json" --plot "$OUT/bench_peer_$dt.png" > "$OUT/bench_peer_$dt.log" 2>&1 || rc=1
                  grep -B1 -A60 "^sum over" "$OUT/bench_peer_$dt.log" | grep -v "^--" | head -60
                done ;;
    producers_ab) rc=0   # the wgmma GEMM's x producers (docs/history.md v51): after the x tile pass / the default
                 # ring / the AWQ_PROBE_PRODUCER_ROUNDS probe, A/B on Mistral-7B (AB_CASES), and the probe build's
                 # bitwise GPU test from a scratch tree whose gemm_wg.cu defines it
                 export AB_CASES=${AB_CASES:-qkv:256:1024:4096,o:256:512:1024:4096,gate_up:256:1024:4096,down:256:512:1024:4096}
                 python3 bench/sweeps/ab_gemm.py ring tp:producers=0 xp:producers=1 > "$OUT/ab_ring.txt" 2>&1 || rc=1
                 AB_DEFINES=AWQ_PROBE_PRODUCER_ROUNDS=1 python3 bench/sweeps/ab_gemm.py rounds tp:producers=0 \
                   xp:producers=1 > "$OUT/ab_rounds.txt" 2>&1 || rc=1
                 rm -rf /tmp/rounds && mkdir -p /tmp/rounds && cp -r awq_cupy /tmp/rounds/ &&
                   cp -r kernels_cu /tmp/rounds/awq_cupy/kernels_cu &&
                   sed -i '1i #define AWQ_PROBE_PRODUCER_ROUNDS 1' /tmp/rounds/awq_cupy/kernels_cu/gemm_wg.cu || rc=1
                 PYTHONPATH=/tmp/rounds python3 -m pytest -q -m gpu tests/test_ops_gpu.py -k producers_give \
                   > "$OUT/pytest_rounds.log" 2>&1 || rc=1
                 cat "$OUT/ab_ring.txt" "$OUT/ab_rounds.txt"; tail -1 "$OUT/pytest_rounds.log" ;;
    signal_ab) rc=0   # the signalling x tile pass (bench/probes/tile_x_signal_unrolled.patch, docs/history.md v52) on a
                 # scratch tree: the pass alone (main's, the patch's plain and signalling), its bitwise GPU tests, and
                 # A/B of main's planned calls against the patch's (signalling where planned, and signal=0)
                 rm -rf /tmp/sigab && mkdir -p /tmp/sigab && cp -r awq_cupy kernels_cu tests bench /tmp/sigab/ &&
                   (cd /tmp/sigab && patch -s -p1 < bench/probes/tile_x_signal_unrolled.patch) || rc=1
                 timeout 90 python3 bench/probes/tile_x_pass_bw.py > "$OUT/pass_bw_main.txt" 2>&1 || rc=1
                 (cd /tmp/sigab && PYTHONPATH=/tmp/sigab timeout 90 python3 bench/probes/tile_x_pass_bw.py) \
                   > "$OUT/pass_bw_signal.txt" 2>&1 || rc=1
                 (cd /tmp/sigab && PYTHONPATH=/tmp/sigab timeout 240 python3 -m pytest -q -m gpu -p no:cacheprovider \
                   tests/test_ops_gpu.py \
                   -k "signalled or strides or chained or graph or tail_launch or two_k_streams") \
                   > "$OUT/pytest_signal.log" 2>&1 || rc=1
                 export AB_CASES=${AB_CASES:-qkv:512:1024:4096,o:1024:4096,gate_up:1024:4096,down:512:1024:4096}
                 timeout 90 python3 bench/sweeps/ab_gemm.py main plan > "$OUT/ab_main.txt" 2>&1 || rc=1
                 (cd /tmp/sigab && mv kernels_cu awq_cupy/kernels_cu && timeout 120 python3 bench/sweeps/ab_gemm.py \
                   signal /tmp/sigab plan wait:signal=0) > "$OUT/ab_signal.txt" 2>&1 || rc=1
                 cat "$OUT/pass_bw_main.txt" "$OUT/pass_bw_signal.txt" "$OUT/ab_main.txt" "$OUT/ab_signal.txt"
                 tail -2 "$OUT/pytest_signal.log" ;;
    tma_ab) rc=0   # the tensor-map variants (no x tile pass): their GPU tests, then A/B against the tile pass on both
              # models (AB_MISTRAL, AB_LLAMA: ab_gemm.py cases)
            python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_ops_gpu.py -k "tensor_map or tail_launch" \
              > "$OUT/pytest_tma.log" 2>&1 || rc=1
            tail -3 "$OUT/pytest_tma.log"
            AB_CASES=${AB_MISTRAL:-o:128:256:1024:4096,qkv:256:512:1024:4096,gate_up:256:1024:4096,down:256:512:1024:4096} \
              timeout 200 python3 bench/sweeps/ab_gemm.py mistral plan:tma=0 tma:tma=1 > "$OUT/ab_tma_mistral.txt" 2>&1 || rc=1
            AB_MODEL=llama-2-70b AB_CASES=${AB_LLAMA:-qkv:256:1024:4096,o:256:1024:4096,gate_up:256:4096,down:256:1024:4096} \
              timeout 200 python3 bench/sweeps/ab_gemm.py llama plan:tma=0 tma:tma=1 > "$OUT/ab_tma_llama.txt" 2>&1 || rc=1
            cat "$OUT/ab_tma_mistral.txt" "$OUT/ab_tma_llama.txt" ;;
    tma_check) rc=0   # the tensor-map variants below 256 rows (A/B, AB_SMALL: ab_gemm.py cases) and their host cost
               AB_CASES=${AB_SMALL:-qkv:128:192,o:192,down:128:192,gate_up:128} timeout 150 python3 \
                 bench/sweeps/ab_gemm.py small plan:tma=0 tma:tma=1 > "$OUT/ab_tma_small.txt" 2>&1 || rc=1
               timeout 60 python3 bench/probes/host_tma.py > "$OUT/host_tma.txt" 2>&1 || rc=1
               cat "$OUT/ab_tma_small.txt" "$OUT/host_tma.txt" ;;
    dispatch_sweep) # fused GEMM against dequantize + cuBLAS where the dispatch model chooses (docs/design.md §Crossovers)
                python3 -m awq_cupy bench --no-decode --dtype float16 --m ${SWEEP_M:-768,1024,1536,2048,2560,3072,4096} \
                  --contenders gemm_wg dequant_cublas --trials 2 --json "$OUT/sweep_fused_dense.json" \
                  > "$OUT/sweep.log" 2>&1; rc=$?; tail -5 "$OUT/sweep.log" ;;
    m128_ab) rc=0   # the 128-token tile's PEND 2 grids that fill two CTAs per SM (plans.wgmma_pend) against the
             # default-PEND grids planned for those layers before (forced: Mistral-7B 4 splits, Llama-2-70B 2), at
             # M = 96 and 128, fp16 and bf16 (AB_DTYPES); the row splits whose rest may run them (M = 384, 1100:
             # plan against the one 256-token call, fp16); results/h100_m128_pend_two_v59.txt has the first run
             for dt in ${AB_DTYPES:-float16 bfloat16}; do
               for mc in mistral-7b:4 llama-2-70b:2; do
                 AB_DTYPE=$dt AB_MODEL=${mc%%:*} AB_CASES=${AB_M128:-o:96:128,down:96:128} timeout 100 \
                   python3 bench/sweeps/ab_gemm.py m128 plan was:splits=${mc##*:} >> "$OUT/ab_m128_$dt.txt" 2>&1 || rc=1
               done
               cat "$OUT/ab_m128_$dt.txt"
             done
             timeout 150 python3 bench/sweeps/token_tiles.py 384,1100 --tiles 256 --trials 2 \
               > "$OUT/token_tiles_m128.txt" 2>&1 || rc=1
             cat "$OUT/token_tiles_m128.txt" ;;
    m128_tail_ab) rc=0   # Llama-2-70B gate_up at M = 128 (448 CTAs on 264 two-per-SM slots; the peer leads that bf16
                  # cell): the plan (with plans.PAIR_TAILS on, one wave and the other 184 column tiles in a tail launch
                  # split K two ways) against that tail split exactly 2, 3, 4, 5, 7 ways (ab_gemm.py tailsplits=)
                  for dt in ${AB_DTYPES:-float16 bfloat16}; do
                    AB_DTYPE=$dt AB_MODEL=llama-2-70b AB_CASES=${AB_M128_TAIL:-gate_up:128} timeout 200 \
                      python3 bench/sweeps/ab_gemm.py m128t_$dt plan t2:tail=1,tailsplits=2 t3:tail=1,tailsplits=3 \
                      t4:tail=1,tailsplits=4 t5:tail=1,tailsplits=5 t7:tail=1,tailsplits=7 \
                      > "$OUT/ab_m128_tail_$dt.txt" 2>&1 || rc=1
                    cat "$OUT/ab_m128_tail_$dt.txt"
                  done ;;
    pair_tail_check) # two CTAs per SM ending in a planned tail (plans.pair_sm_terms, plans.PAIR_TAILS): its GPU
                     # tests and the tail launch's, memcheck of its case beside them,
                     # then Llama-2-70B at M = 128 (gate_up plans it) against cuBLAS fp16 and the peer, fp16 and bf16
      compute-sanitizer --tool memcheck --error-exitcode 1 python3 bench/device/sanitize_cases.py pair_tail \
        > "$OUT/memcheck_pair_tail.log" 2>&1 & san=$!
      python3 -m pytest -q -n 8 -m gpu tests/test_ops_gpu.py -k "pair_grid_tail or tail_launch" \
        > "$OUT/pytest_pair_tail.log" 2>&1; rc=$?
      wait $san || rc=1
      tail -2 "$OUT/pytest_pair_tail.log"; tail -2 "$OUT/memcheck_pair_tail.log"
      for dt in float16 bfloat16; do
        python3 -m awq_cupy bench --no-decode --models llama-2-70b --m 128 --dtype $dt \
          --contenders awq_cupy cublas_fp16 ${PEERS:-humming} --trials ${PEER_TRIALS:-2} \
          --json "$OUT/bench_m128_$dt.json" > "$OUT/bench_m128_$dt.log" 2>&1 || rc=1
        grep "M=  128" "$OUT/bench_m128_$dt.log"
      done ;;
    m512_ab) rc=0   # Mistral-7B at M = 512 and 1024 (the misses of docs/design.md §Measured bounds): the plan against two
             # K streams per CTA and the 128-token tile (two CTAs per SM), with the x tile pass and the tensor map
             AB_CASES=${AB_M512:-qkv:512:1024,o:512:1024,gate_up:512,down:512:1024} timeout 240 python3 \
               bench/sweeps/ab_gemm.py m512 plan k2:ksplit=2 t128:tile=128 t128x:tile=128,tma=1 \
               > "$OUT/ab_m512.txt" 2>&1 || rc=1
             cat "$OUT/ab_m512.txt" ;;
    ks_ab) rc=0   # two K streams per CTA (ksplit=2) against one (ksplit=1, with its planned splits or tail) and the
           # plan, where the 256-token tile reads x through the tensor map (plans._KSPLIT_TMA)
           AB_CASES=${AB_KS_MISTRAL:-qkv:512:768:1024,o:1024:1536,down:512:768:1024:1536} \
             timeout 200 python3 bench/sweeps/ab_gemm.py ks plan k1:ksplit=1 k2:ksplit=2 > "$OUT/ab_ks_mistral.txt" 2>&1 || rc=1
           AB_MODEL=llama-2-70b AB_CASES=${AB_KS_LLAMA:-qkv:512:1024,o:256:768,down:256:768} \
             timeout 200 python3 bench/sweeps/ab_gemm.py ks plan k1:ksplit=1 k2:ksplit=2 > "$OUT/ab_ks_llama.txt" 2>&1 || rc=1
           cat "$OUT/ab_ks_mistral.txt" "$OUT/ab_ks_llama.txt" ;;
    k2tail_ab) rc=0   # two K streams ending in a split tail launch (plans._KSPLIT_TMA_TAILS, off until this says so):
               # their GPU tests, then A/B against the plan where the model gives them 3-18%
               python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_ops_gpu.py -k "tail_launch" \
                 > "$OUT/pytest_k2tail.log" 2>&1 || rc=1
               tail -2 "$OUT/pytest_k2tail.log"
               AB_CASES=${AB_K2T_MISTRAL:-qkv:512:768:1536,o:768,down:768} timeout 150 python3 \
                 bench/sweeps/ab_gemm.py k2tail plan k2t:ksplit=2,tail=1 > "$OUT/ab_k2tail_mistral.txt" 2>&1 || rc=1
               AB_MODEL=llama-2-70b AB_CASES=${AB_K2T_LLAMA:-qkv:256:512:768:1536} timeout 150 python3 \
                 bench/sweeps/ab_gemm.py k2tail plan k2t:ksplit=2,tail=1 > "$OUT/ab_k2tail_llama.txt" 2>&1 || rc=1
               cat "$OUT/ab_k2tail_mistral.txt" "$OUT/ab_k2tail_llama.txt" ;;
    k2tail_check) rc=0   # the planned two-stream tails (plans._KSPLIT_TMA_TAILS): their GPU tests and the row split it
                  # gave Llama-2-70B qkv at M = 384 (plan against the two calls and the one 256-token call)
                  python3 -m pytest -q -n ${PYTEST_WORKERS:-14} -m gpu -p no:cacheprovider tests/test_ops_gpu.py \
                    -k "tail_launch or two_k_streams or row_split" > "$OUT/pytest_k2tail_check.log" 2>&1 || rc=1
                  tail -3 "$OUT/pytest_k2tail_check.log"
                  timeout 120 python3 bench/sweeps/token_tiles.py 384 --models llama-2-70b --tiles 256 --trials 2 \
                    > "$OUT/token_tiles_l384.txt" 2>&1 || rc=1
                  tail -14 "$OUT/token_tiles_l384.txt" ;;
    wide_tail_ab) rc=0   # the split tail launch on grids the model gives it 2-3% (plans._TAIL_GAIN; docs/design.md
                  # §Split-K reduce): the plan against the one launch (tail=0) and a forced tail (tail=1); by default
                  # the planned tails not yet timed (results/h100_wide_tail_ab_v64.txt has the first ten grids) and
                  # Llama-2-70B gate_up at 2048; fp16 and bf16, then the tail launch's GPU tests
                  for dt in float16 bfloat16; do
                    AB_DTYPE=$dt AB_MODEL=llama-2-70b AB_CASES=${AB_WT_LLAMA:-gate_up:2048,qkv:3584} \
                      timeout 240 python3 bench/sweeps/ab_gemm.py wt_$dt plan one:tail=0 tail:tail=1 \
                      > "$OUT/ab_wide_tail_llama_$dt.txt" 2>&1 || rc=1
                    AB_DTYPE=$dt AB_CASES=${AB_WT_MISTRAL:-gate_up:1280:2304:3328,down:3840} timeout 120 \
                      python3 bench/sweeps/ab_gemm.py wt_$dt plan one:tail=0 tail:tail=1 \
                      > "$OUT/ab_wide_tail_mistral_$dt.txt" 2>&1 || rc=1
                    cat "$OUT/ab_wide_tail_llama_$dt.txt" "$OUT/ab_wide_tail_mistral_$dt.txt"
                  done
                  python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_ops_gpu.py -k "tail_launch" \
                    > "$OUT/pytest_wide_tail.log" 2>&1 || rc=1
                  tail -2 "$OUT/pytest_wide_tail.log" ;;
    bench_full) python3 -m awq_cupy bench --json "$OUT/bench_full.json" --plot "$OUT/bench_full.png" > "$OUT/bench_full.log" 2>&1; rc=$?
                grep -A60 "^sum over" "$OUT/bench_full.log" | head -60 ;;
    *) echo "unknown step $step"; rc=2 ;;
  esac
  summary+=("$step rc=$rc $(( $(date +%s) - t0 ))s")
done
printf '%s\n' "${summary[@]}"
