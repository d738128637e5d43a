#!/bin/bash
# One device call: environment, the GPU tests, optionally the GPU benchmark.
#
#   dev/gpu_check.sh [tests,profile,bench,others|all] [seconds for the bench]
#
# (a comma-separated list; env: TEST_FILES, PROFILE_NETS, PROFILE_ARGS,
#  BENCH_NETS, BENCH_PLANS, BENCH_TF32, BENCH_ITERS)
#
# Run from the repository root on the device machine (the `run` tool), with
# carry=[".gpu_carry"]: .gpu_carry/whl holds wheels the machine lacks
# (pytest, lmdb), .gpu_carry/reference/layers the stock-Caffe layer cases and
# .gpu_carry/bench the benchmark prototxts (copies of ../shared, which does
# not travel). Logs go to $OUT (at most 8 files come back).
set -u
WHAT=${1:-all}
BENCH_S=${2:-240}
OUT=${OUT:-/tmp/gpu_out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 GLOG_minloglevel=${GLOG_minloglevel:-2}
export CAFFEPLUS_SHARED=$PWD/.gpu_carry
unset CUPY_TF32 NVIDIA_TF32_OVERRIDE
T0=$(date +%s)
stamp() { echo "[$(( $(date +%s) - T0 ))s] $*"; }

# -- environment ---------------------------------------------------------------
if ls .gpu_carry/whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .gpu_carry/whl/*.whl >/dev/null 2>&1 || echo "wheel install failed"
fi
export PYTHONPATH=$PWD:${PYTHONPATH:-}:/tmp/site
# caffeplus.layers is the top-level layers/ folder (setup.py's package_dir);
# an editable install needs build tools the machine may lack: link instead.
[ -e caffeplus/layers ] || ln -s ../layers caffeplus/layers

{
  stamp environment
  nvidia-smi --query-gpu=name,driver_version,memory.total,memory.used --format=csv
  python3 - <<'EOF'
import sys, cupy, numpy
print('python', sys.version.split()[0], 'cupy', cupy.__version__, 'numpy', numpy.__version__)
print('CUDA runtime', cupy.cuda.runtime.runtimeGetVersion(), 'driver', cupy.cuda.runtime.driverGetVersion())
from caffeplus.cudnn import lib, api
print('cudnn version', lib.version())
h = api.handle()
print('cudnn handle ok', h.value.value is not None)
import caffeplus, caffeplus.layer as L
caffeplus.set_mode_gpu()
L.layer_types(); print('engines', sorted(L.GPU_ENGINES))
import time; from caffeplus import kernels
t = time.time(); kernels.kernel('cp_bn_fwd')
print('fused kernels compiled in %.1f s' % (time.time() - t))
EOF
} > "$OUT/env.log" 2>&1
cat "$OUT/env.log"

has() { case ",$WHAT," in *",$1,"*|*",all,"*) return 0;; *) return 1;; esac; }

if has tests; then
  stamp "my GPU tests"
  timeout "${TEST_S:-240}" python3 -m pytest -q -p no:cacheprovider -rfE --tb=short --maxfail=60 \
    ${TEST_FILES:-tests/test_fused_kernels.py tests/test_workspace_arena.py tests/test_gpu_layers.py} \
    > "$OUT/pytest_gpu.log" 2>&1
  echo "rc=$?" >> "$OUT/pytest_gpu.log"
  tail -n 45 "$OUT/pytest_gpu.log"
fi
if has others; then
  stamp "colleagues' gpu-marked tests"
  timeout 150 python3 -m pytest -q -p no:cacheprovider -rfE --tb=line -m gpu tests \
    --ignore=tests/test_workspace_arena.py --ignore=tests/test_gpu_layers.py \
    > "$OUT/pytest_others_gpu.log" 2>&1
  echo "rc=$?" >> "$OUT/pytest_others_gpu.log"
  tail -n 25 "$OUT/pytest_others_gpu.log"
fi

if has profile; then
  # per-layer-type host and device time (dev/profile_gpu.py), fused and generic
  for n in ${PROFILE_NETS:-resnet50_b64}; do
    stamp "profile $n"
    timeout "${PROFILE_S:-120}" python3 dev/profile_gpu.py --net .gpu_carry/bench/$n.prototxt \
      --plan arena --search timed --iters 10 ${PROFILE_ARGS:-} >> "$OUT/profile.log" 2>&1
    echo "rc=$?" >> "$OUT/profile.log"
  done
  cat "$OUT/profile.log"
fi

if has bench; then
  stamp "benchmark (${BENCH_S}s)"
  timeout "$BENCH_S" python3 benchmarks/bench_gpu.py --bench-dir .gpu_carry/bench \
    --nets "${BENCH_NETS:-alexnet_b128,resnet50_b32}" \
    --plans "${BENCH_PLANS:-stock,arena,arena:timed}" --torch \
    --tf32 "${BENCH_TF32:-both}" --iters "${BENCH_ITERS:-20}" --warmup 3 --timeout 120 \
    --json "$OUT/bench.json" --md "$OUT/gpu_results.md" > "$OUT/bench.log" 2>&1
  echo "rc=$?" >> "$OUT/bench.log"
  cat "$OUT/bench.log"
fi
stamp done
