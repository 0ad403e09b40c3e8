#!/usr/bin/env bash
# Steps run on the lent GPU (H100 or H200) (see CONTRIBUTING.md, "GPU tests and benchmarks"). Usage: tools/device_session.sh STEP...
# When to use: every GPU run of this project goes through it, so that tests, benchmarks and profiles run the same way
# each time. Installs each carried wheel folder (.whl-gpu; .whl-torchao for the stack) into /tmp/site once, then
# runs each STEP from the repository root, logging to $OUT/<step>.log. Steps (time limits and arguments through the
# variables named):
#   env                          GPU, driver, clocks and library versions
#   cpu-tests                    CPU tests on the device's torch (CPU_TESTS: files)
#   lib-tests, triton-tests, gluon-tests, shapes-tests
#                                GPU tests (TRITON_K / GLUON_K / SHAPES_K: -k filters; GLUON_X= runs past failures)
#   gpu-tests                    the qattn_fx kernel and model GPU tests in parallel workers (GPU_N workers, default 6;
#                                GPU_TESTS: files, default the Sage kernels', shapes and masks, compiled models, the
#                                fused K/V quantize, persistent configs; GPU_K: -k filter): after a kernel refactor
#   tune-gluon, tune             python -m benchmarks.tune --kernel gluon_sage / triton_sage (TUNE_GLUON_ARGS, TUNE_ARGS)
#   ops                          python -m benchmarks.attention_ops (OPS_ARGS)
#   skip-tests                   Skip-Softmax GPU tests in parallel workers (GPU_N; SKIP_K: -k filter)
#   skip-bench                   python -m benchmarks.attention_ops --skip-softmax (SKIP_ARGS)
#   bs-tests                     block-sparse GPU tests in parallel workers, the files of BS_TEST_FILES that exist
#                                (default: the kernels', the predictor's and pair's; GPU_N; BS_K: -k filter)
#   bs-bench                     python -m benchmarks.attention_ops --block-sparse (BS_ARGS; BS_S, BS_MAX_S); writes
#                                $OUT/block_sparse.{json,png}, Skip-Softmax's curve beside it when skip-bench ran first
#   dit                          python -m benchmarks.dit_step (DIT_ARGS, split on spaces: --only takes substrings
#                                without spaces, e.g. DIT_ARGS="--model flux --compile whole --steps 4 --only auto")
#   stack                        the whole-stack table (BENCHMARKS.md, "The whole stack"): python -m benchmarks.dit_step
#                                --linears $STACK_LINEARS (default "fp8 fp8static") --stack-only --only auto for each of
#                                STACK_ROWS (default: wan14b wan1.3b flux1024 flux2048; wan14b adds --block-keep 0.5
#                                --block-dense-steps 1), each within STACK_S seconds (default 240), into
#                                $OUT/stack_<row>.{json,log}
#   ncu-gluon                    Nsight Compute on python -m tools.profile_gluon (PROFILE_ARGS, NCU_SECTIONS, NCU_S)
#   ab-tail-split                python -m tools.ab_tail_split (AB_ARGS)
#   quantize-profile             python -m tools.profile_quantize (QUANT_ARGS)
#   predictor-profile            python -m tools.profile_predictor (PRED_ARGS): the predictor's kernels apart
#   host-in-step                 python -m tools.host_overhead --in-step: a forced gluon_sage step's host path per call
#                                against the dense step's, synchronizing calls, cProfile (HOST_ARGS: the model and its
#                                flags, default "sd3 --steps 8 --profile 40")
#   quantize-ab                  the fused K/V quantize against the separate ops at flux-1024, d64 and wan1.3b-480p,
#                                gluon_sage's default recipe and config (QATTN_AUTOTUNE=0): python -m
#                                tools.profile_quantize --fused-kv on,off (QAB_PROFILE_S, default 150 s), then python -m
#                                benchmarks.attention_ops --timer graph with QATTN_FUSED_KV_QUANTIZE=1 and =0 (QAB_OPS_S
#                                each, default 165 s; QAB_ARGS), writing $OUT/quantize_ab_fused{1,0}.json
#   calibrate                    python examples/calibrate_wan.py --real-size: Wan2.1-1.3B config, 2 blocks, 480p,
#                                2 calls, candidates on the real kernels (CALIB_ARGS, CALIB_S); writes
#                                $OUT/calibrate/{spec.json,calibration.json,calibration.png}. Its GPU test:
#                                GPU_TESTS=tests/gpu/test_calibrate_on_kernels.py ... gpu-tests
#   cost-data                    python -m benchmarks.attention_ops at every shape of auto's cost data (the presets and the
#                                head_dim-64 shapes of LTX-Video, SD3 and CogVideoX) for the kernels it covers, timed as
#                                CUDA-graph replays, into $OUT/<date>_<gpu>_attention_ops_cost.json: the argument to add
#                                to qattn_fx/cost_data.py's COMMAND for this GPU (CONTRIBUTING.md) (COST_ARGS)
#   save-jit                     FlashInfer's JIT cache as $OUT/flashinfer.tgz (restored from .fi-cache/ next time)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/qattn_out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$PWD
for wheels in .whl-*/; do  # each carried wheel folder (.whl-gpu; .whl-torchao for the stack), installed once
  [ -d "$wheels" ] && [ ! -e "/tmp/site/.${wheels%/}" ] && { python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site \
    "$wheels"*.whl && touch "/tmp/site/.${wheels%/}"; }
done
if [ -d .fi-cache ] && [ ! -e ~/.cache/flashinfer/.restored ]; then  # FlashInfer JIT modules built on an earlier machine
  mkdir -p ~/.cache && tar -C ~/.cache -xzf .fi-cache/flashinfer.tgz && touch ~/.cache/flashinfer/.restored
fi
# the parallel GPU steps: tests (not files, as pyproject's addopts says for the CPU suite) spread over GPU_N workers
GPU_XDIST="-p no:cacheprovider -n ${GPU_N:-6} --dist load"
step() { local name=$1 limit=$2; shift 2; echo "=== $name ($(date +%T))"; timeout "$limit" "$@" 2>&1 | tee "$OUT/$name.log" | tail -${TAIL:-40}; echo "=== $name rc=${PIPESTATUS[0]}"; }
for s in "$@"; do
  case $s in
    env) step env 60 bash -c 'nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv; python3 -c "import torch, triton, cudnn, flashinfer; print(torch.__version__, torch.version.cuda, torch.backends.cudnn.version(), triton.__version__, cudnn.__version__, cudnn.backend_version(), flashinfer.__version__)"' ;;
    cpu-tests) TAIL=25 step cpu-tests 150 python3 -m pytest -q -rf -p no:cacheprovider -m "not gpu" -n 8 ${CPU_TESTS:-tests/fx/test_golden_graphs.py tests/backend/test_backend.py tests/models/test_diffusers_models.py tests/ops/test_attention_ops.py} ;;
    lib-tests) TAIL=30 step lib-tests ${LIB_TESTS_S:-330} python3 -m pytest -q -n 0 -rs --durations=8 tests/gpu/test_library_kernels.py tests/gpu/test_compiled_models.py ;;
    triton-tests) TAIL=45 step triton-tests ${TRITON_TESTS_S:-300} python3 -m pytest -q -n 0 -rfEs --durations=5 -k "${TRITON_K:-}" tests/gpu/test_triton_sage.py ;;
    gluon-tests) TAIL=45 step gluon-tests ${GLUON_TESTS_S:-240} python3 -m pytest -q -n 0 -rfEs ${GLUON_X--x} --durations=5 -k "${GLUON_K:-}" tests/gpu/test_gluon_sage.py ;;
    gpu-tests) TAIL=45 step gpu-tests ${GPU_TESTS_S:-480} python3 -m pytest -q -rfEs $GPU_XDIST --durations=8 -k "${GPU_K:-}" ${GPU_TESTS:-tests/gpu/test_gluon_sage.py tests/gpu/test_triton_sage.py tests/gpu/test_shapes_and_masks.py tests/gpu/test_compiled_models.py tests/gpu/test_quantize_kv.py tests/gpu/test_gluon_sage_persist.py} ;;
    shapes-tests) TAIL=45 step shapes-tests ${SHAPES_TESTS_S:-300} python3 -m pytest -q -n 0 -rfEs --durations=8 -k "${SHAPES_K:-}" tests/gpu/test_shapes_and_masks.py ;;
    tune-gluon) TAIL=40 step tune-gluon ${TUNE_GLUON_S:-240} python3 -m benchmarks.tune --kernel gluon_sage --out "$OUT/tune_gluon.json" ${TUNE_GLUON_ARGS:-} ;;
    tune) TAIL=30 step tune ${TUNE_S:-240} python3 -m benchmarks.tune --kernel triton_sage --out "$OUT/tune.json" ${TUNE_ARGS:-} ;;
    skip-tests) TAIL=45 step skip-tests ${SKIP_TESTS_S:-300} python3 -m pytest -q -rfEs $GPU_XDIST --durations=8 -k "${SKIP_K:-}" tests/gpu/test_skip_softmax.py ;;
    skip-bench) TAIL=60 step skip-bench ${SKIP_BENCH_S:-420} python3 -m benchmarks.attention_ops --skip-softmax --out "$OUT/skip_softmax.json" ${SKIP_ARGS:-} ;;
    bs-tests) files=""; for f in ${BS_TEST_FILES:-tests/gpu/test_block_sparse_kernels.py tests/gpu/test_gluon_sage_sparse.py tests/gpu/test_block_predictor.py tests/gpu/test_gluon_sage_pair.py}; do [ -e "$f" ] && files="$files $f"; done
        if [ -z "$files" ]; then echo "=== bs-tests: none of the block-sparse GPU test files exists"; else
        TAIL=45 step bs-tests ${BS_TESTS_S:-300} python3 -m pytest -q -rfEs $GPU_XDIST --durations=8 -k "${BS_K:-}" $files; fi ;;
    bs-bench) skipjson=""; [ -e "$OUT/skip_softmax.json" ] && skipjson="--skip-json $OUT/skip_softmax.json"
        TAIL=60 step bs-bench ${BS_S:-560} python3 -m benchmarks.attention_ops --block-sparse --timer graph --out "$OUT/block_sparse.json" \
        --plot "$OUT/block_sparse.png" --max-seconds ${BS_MAX_S:-480} $skipjson ${BS_ARGS:-} ;;
    cost-data) gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1 | awk '{print tolower($2)}')
        TAIL=70 step cost-data 580 python3 -m benchmarks.attention_ops --timer graph --rounds 2 --max-seconds 500 \
        --only sdpa_cudnn_bf16,cudnn_fp8,flashinfer_fa3_fp8,gluon_sage/int8-1-16-1 --shape ltx-512:1:32:3872:3872:64 \
        --shape sd3-1024:1:24:4429:4429:64 --shape ltx-704:1:32:9196:9196:64 --shape cogvideox:1:48:17776:17776:64 \
        --out "$OUT/$(date +%F)_${gpu}_attention_ops_cost.json" ${COST_ARGS:-} ;;
    ops) TAIL=70 step ops 560 python3 -m benchmarks.attention_ops --out "$OUT/ops.json" --max-seconds 480 ${OPS_ARGS:-} ;;
    dit) TAIL=20 step dit ${DIT_S:-560} python3 -m benchmarks.dit_step --out "$OUT/dit.json" ${DIT_ARGS:-} ;;
    stack) for row in ${STACK_ROWS:-wan14b wan1.3b flux1024 flux2048}; do
        case $row in
          wan14b) args="--config 14b --resolution 720 --blocks 4 --skip-no-attention --block-keep 0.5 --block-dense-steps 1" ;;
          wan1.3b) args="--config 1.3b --resolution 480 --blocks 10 --skip-no-attention" ;;
          flux1024) args="--model flux --resolution 1024 --blocks 4 --single-blocks 8 --skip-no-attention" ;;
          flux2048) args="--model flux --resolution 2048 --blocks 4 --single-blocks 8 --skip-no-attention" ;;
          *) echo "unknown stack row $row; valid: wan14b wan1.3b flux1024 flux2048"; continue ;;
        esac
        TAIL=12 step "stack_$row" ${STACK_S:-240} python3 -m benchmarks.dit_step --out "$OUT/stack_$row.json" $args \
          --compile whole --steps 4 --warmup 1 --only auto --linears ${STACK_LINEARS:-fp8 fp8static} --stack-only
      done ;;
    ncu-gluon) TAIL=${TAIL:-150} step ncu-gluon ${NCU_S:-240} ncu --clock-control none -k regex:_sage_fwd_ws --launch-skip 2 \
        --launch-count 1 ${NCU_SECTIONS:---section SpeedOfLight --section ComputeWorkloadAnalysis --section WarpStateStats --section SchedulerStats --section InstructionStats} \
        python3 -m tools.profile_gluon ${PROFILE_ARGS:-} ;;
    ab-tail-split) TAIL=20 step ab-tail-split ${AB_S:-240} python3 -m tools.ab_tail_split ${AB_ARGS:-} ;;
    host-in-step) TAIL=30 step host-in-step ${HOST_S:-300} python3 -m tools.host_overhead --out "$OUT/host_in_step.json" \
        --in-step ${HOST_ARGS:-sd3 --steps 8 --profile 40} ;;
    predictor-profile) TAIL=40 step predictor-profile ${PRED_S:-180} python3 -m tools.profile_predictor ${PRED_ARGS:-} ;;
    quantize-profile) TAIL=40 step quantize-profile ${QUANT_S:-240} python3 -m tools.profile_quantize ${QUANT_ARGS:-} ;;
    quantize-ab) shapes=flux-1024,d64,wan1.3b-480p
        TAIL=80 step quantize-ab-profile ${QAB_PROFILE_S:-150} env QATTN_AUTOTUNE=0 \
          python3 -m tools.profile_quantize --shapes $shapes --fused-kv on,off
        for on in 1 0; do TAIL=12 step quantize-ab-fused$on ${QAB_OPS_S:-165} \
          env QATTN_AUTOTUNE=0 QATTN_FUSED_KV_QUANTIZE=$on python3 -m benchmarks.attention_ops --timer graph \
          --shapes $shapes --only gluon_sage/int8-1-16-1 --max-seconds $(( ${QAB_OPS_S:-165} - 45 )) --out "$OUT/quantize_ab_fused$on.json" ${QAB_ARGS:-}; done ;;
    calibrate) TAIL=60 step calibrate ${CALIB_S:-150} env QATTN_AUTOTUNE=0 \
        python3 examples/calibrate_wan.py --real-size --out "$OUT/calibrate" ${CALIB_ARGS:-} ;;
    save-jit) tar -C ~/.cache -czf "$OUT/flashinfer.tgz" flashinfer 2>/dev/null; ls -la "$OUT/flashinfer.tgz" ;;
    *) echo "unknown step $s" ;;
  esac
done
