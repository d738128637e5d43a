#!/bin/bash
# The release check on the GPU machine, in one device call:
#   1. every gpu-marked test of the suite,
#   2. `caffeplus memory -gpu 0` (measured plans beside the planner's estimate) on the bench nets,
#   3. benchmarks/bench_gpu.py on the nets not yet benchmarked (caffeplus vs PyTorch in the same run),
#   4. (STEPS=stock) benchmarks/bench_stock_memory.py: the `stock` plan against stock Caffe's peaks,
#   5. (STEPS=time) benchmarks/time_plans.py: `shared` against `offload --offload free`, interleaved.
#   6. (STEPS=speed) benchmarks/bench_data_gpu.py --inputs constant, strict and TF32 math,
#      (STEPS=data16) the same from raw and JPEG LMDBs in 16 bits (DATA16_NETS, DATA16_PRECISION),
#   7. (STEPS=bits) dev/check_plans_equal.py: every plan bit-identical to `stock`, all nets,
#   8. (STEPS=stockbits) dev/check_plans_equal.py: `stock` against `shared` and `arena` under
#      deterministic math with Caffe's 8 MiB per call (as tests/test_memory_apply.py's GoogLeNet
#      and ResNet-50 cases), naming the calls whose algorithms differ.
#   9. (STEPS=amp) benchmarks/bench_gpu.py with TF32 on, PyTorch's AMP FP16/BF16 runs beside
#      caffeplus strict FP32, TF32, FP16 and BF16 under `shared`, `caffeplus train`'s plan
#      (AMP_PLANS), and PyTorch TF32 (the 16-bit work's peers).
#      The caffeplus rows search cuDNN's algorithms by timing them (':timed'), as `caffeplus
#      train` does on a GPU (cudnn_search auto) and PyTorch's cudnn.benchmark does.
#      Each net's AMP peer is PyTorch's model of the same architecture: BVLC's AlexNet
#      (alexnet_b128) PyTorch's BVLC form, torchvision's (alexnettv_b128) torchvision's.
#      PyTorch's TF32 rows only with AMP_TORCH_PLAIN=on. All five default nets take about
#      10 minutes: split AMP_NETS over two device calls.
#      ResNet-50 b256: AMP_NETS=resnet50_b256 (a batch without a prototxt of its own is
#      built from the architecture's file, bench_gpu.net_source).
#  10. (STEPS=accuracy) benchmarks/precision_accuracy.py: digits LeNet and CIFAR10-full (on the
#      digits; ACCURACY_SOLVERS) in FP32 and 16 bits (ACCURACY_PRECISIONS).
#  11. (STEPS=nvcaffe) dev/nvcaffe_time.sh: NVCaffe's FP16 model files, `caffeplus time`.
#  13. (STEPS=layouts) the layout switches (dev/layout_switches.py): LAYOUT_NEW
#      (lrn=on,grouped=on) against LAYOUT_BASE (default): census, GPU tests, FP16
#      `shared` (LAYOUT_NETS), memory with LAYOUT_NEW.
#  12. (STEPS=profile) dev/profile_gpu.py on PROFILE_NETS in PROFILE_PRECISION (fp16) with timed search
#      (PROFILE_LAYOUT, one or more of nchw nhwc nhwcbn: the convolution maps channels-last,
#      nhwcbn BatchNorm's too).
# Prefer running it through dev/gpu_snapshot.sh (the committed tree only).
# Run from the repository root on the device (the `run` tool) with carry=[".gpu_carry"]
# (.gpu_carry: wheels in whl/ (lmdb, simplejpeg), copies of ../shared's reference/, zoo/ and bench/).
# env: LAYOUT_NEW, LAYOUT_BASE, LAYOUT_NETS, LAYOUT_S, ACCURACY_SOLVERS, ACCURACY_PRECISIONS, ACCURACY_SEEDS, PROFILE_PRECISION, PROFILE_LAYOUT, MEMORY_PRECISION, STEPS (tests,memory,probe,bench,stock,time,speed,data16,bits,stockbits,amp,accuracy,nvcaffe,profile), PROFILE_NETS, AMP_TORCH, TEST_PATHS, AMP_NETS, AMP_PLANS, TIME_NETS, MEMORY_NETS, MEMORY_PLANS, MEMORY_OFFLOAD (policy),
#      MEMORY_ITERS, BENCH_NETS, TEST_S, KERNEL_COMPILE, MEMORY_S, BENCH_S, DATA16_NETS, DATA16_PRECISION,
#      DATA16_INPUTS, DATA16_S
set -u
OUT=${OUT:-/tmp/gpu_out}
mkdir -p "$OUT"
STEPS=${STEPS:-tests,memory,bench}
export PYTHONUNBUFFERED=1
export CAFFEPLUS_SHARED=$PWD/.gpu_carry
unset CUPY_TF32 NVIDIA_TF32_OVERRIDE
T0=$(date +%s)
stamp() { echo "[$(( $(date +%s) - T0 ))s] $*"; }
has() { case ",$STEPS," in *",$1,"*) return 0;; *) return 1;; esac; }

if ls .gpu_carry/whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .gpu_carry/whl/*.whl >/dev/null 2>&1 || echo "wheel install failed"
fi
export PYTHONPATH=$PWD:${PYTHONPATH:-}:/tmp/site
# caffeplus.layers is the top-level layers/ folder (setup.py's package_dir);
# the machine cannot build an editable install, so link it.
[ -e caffeplus/layers ] || ln -s ../layers caffeplus/layers
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUT/env.log"
# A snapshot (dev/gpu_snapshot.sh) names its commit in COMMIT, a caller in
# CAFFEPLUS_COMMIT (the device's copy of .git can be older than the tree it
# was sent; benchmarks/bench_gpu.py reads the same variable); else git's.
if [ -n "${CAFFEPLUS_COMMIT:-}" ]; then echo "commit $CAFFEPLUS_COMMIT"
elif [ -f COMMIT ]; then echo "commit $(cat COMMIT)"; else git log -1 --format='commit %h %s' 2>/dev/null; fi \
  | tee -a "$OUT/env.log"

# The device's NVRTC: its version, and whether CuPy builds the kernel modules
# without the -default-device that caffeplus.kernels passes (NVRTC 13.0 does
# not); then every CUDA source compiled by it as the CI compiles them.
python3 - <<'PY' 2>&1 | tee -a "$OUT/env.log"
import cupy
from caffeplus import kernels
print('nvrtc', cupy.cuda.nvrtc.getVersion())
try:
    cupy.RawModule(code=kernels.SOURCES['core'], options=('--std=c++14',)).get_function('cp_relu_fwd')
    print('core builds without -default-device')
except Exception as exc:
    print('core needs -default-device:', str(exc).strip().splitlines()[0][:200])
PY

if has tests; then
  # KERNEL_COMPILE=off skips it (about a minute) where only a few files' tests are wanted.
  if [ "${KERNEL_COMPILE:-on}" != off ]; then
    stamp "CUDA sources compiled by this machine's NVRTC"
    timeout 120 python3 -m pytest -q -p no:cacheprovider tests/test_kernel_compile.py 2>&1 | tail -n 3
  fi
  stamp "gpu-marked tests"
  timeout "${TEST_S:-420}" python3 -m pytest -q -p no:cacheprovider -rfExX --tb=short -m gpu ${TEST_PATHS:-tests} \
    > "$OUT/pytest_gpu.log" 2>&1
  echo "rc=$?" >> "$OUT/pytest_gpu.log"
  tail -n 30 "$OUT/pytest_gpu.log"
fi

if has memory; then
  # MEMORY_NETS: bench nets, each optionally NAME@BATCH (resnet50_b64@256:
  # the net at batch 256, as `caffeplus memory --batch 256`).
  for spec in ${MEMORY_NETS:-alexnet_b128 googlenet_b64 vgg16_b64 resnet50_b64}; do
    n=${spec%@*}; batch=; [ "$spec" != "$n" ] && batch=${spec#*@}
    out="$OUT/memory_${n}${batch:+_batch$batch}"
    stamp "memory $spec"
    # (torchvision's AlexNet, alexnettv_b128, is this repository's benchmarks/nets/ net.)
    model=.gpu_carry/bench/$n.prototxt; [ -e "$model" ] || model=benchmarks/nets/$n.prototxt
    GLOG_minloglevel=2 timeout "${MEMORY_S:-280}" python3 -m caffeplus memory -model $model \
      -gpu 0 --plans ${MEMORY_PLANS:-stock,arena,shared,offload} --offload ${MEMORY_OFFLOAD:-conv} \
      ${MEMORY_PRECISION:+--precision $MEMORY_PRECISION} ${batch:+--batch $batch} \
      --iterations ${MEMORY_ITERS:-3} --json > "$out.json" 2> "$out.err"
    echo "rc=$?" >> "$out.err"
    python3 dev/memory_summary.py "$out.json"
    tail -n 3 "$out.err"
  done
fi

if has probe; then
  stamp "determinism probe"
  GLOG_minloglevel=2 timeout "${PROBE_S:-150}" python3 dev/gpu_determinism_probe.py > "$OUT/probe.log" 2>&1
  echo "rc=$?" >> "$OUT/probe.log"
  cat "$OUT/probe.log"
fi

if has bench; then
  stamp "benchmark"
  GLOG_minloglevel=2 timeout "${BENCH_S:-200}" python3 benchmarks/bench_gpu.py --bench-dir .gpu_carry/bench \
    --nets "${BENCH_NETS:-vgg16_b64,googlenet_b64}" --plans stock,arena:timed --torch \
    --tf32 off --iters 20 --warmup 3 --timeout 120 \
    --json "$OUT/bench.json" --md "$OUT/gpu_results.md" > "$OUT/bench.log" 2>&1
  echo "rc=$?" >> "$OUT/bench.log"
  tail -n 20 "$OUT/bench.log"
fi
if has stock; then
  stamp "stock plan against stock Caffe"
  timeout "${STOCK_S:-300}" python3 benchmarks/bench_stock_memory.py ${STOCK_NETS:-alexnet_b128 googlenet_b64 vgg16_b64 resnet50_b64} \
    --bench-dir .gpu_carry/bench --timeout 100 --json "$OUT/stock.json" --md "$OUT/stock.md" 2>&1 | tail -n 8
fi
if has time; then
  for n in ${TIME_NETS:-alexnet_b128 googlenet_b64 resnet50_b64}; do
    stamp "time_plans $n"
    GLOG_minloglevel=2 timeout "${TIME_S:-120}" python3 benchmarks/time_plans.py --net .gpu_carry/bench/$n.prototxt \
      --gpu 0 --plans shared,offload --offload free --rounds ${TIME_ROUNDS:-12} --iters 10 --warmup 10 \
      > "$OUT/time_plans_$n.txt" 2>&1
    tail -n 3 "$OUT/time_plans_$n.txt"
  done
fi
if has stockbits; then
  stamp "stock against shared, deterministic"
  GLOG_minloglevel=2 timeout "${STOCKBITS_S:-240}" python3 dev/check_plans_equal.py --gpu 0 \
    --math deterministic --workspace_limit 8388608 --nets googlenet,resnet50 --batch 4 \
    --iters 10 --plans stock,shared,arena --algorithms > "$OUT/stockbits.log" 2>&1
  echo "rc=$?" >> "$OUT/stockbits.log"
  tail -n 40 "$OUT/stockbits.log"
fi
if has speed; then
  for m in ${SPEED_MATH:-strict tf32}; do
    stamp "caffeplus train, constant DummyData, math $m"
    timeout "${SPEED_S:-300}" python3 benchmarks/bench_data_gpu.py --inputs constant \
      --nets ${SPEED_NETS:-alexnet_b128,googlenet_b64,vgg16_b64,resnet50_b64} --math $m \
      --json "$OUT/speed_$m.json" > "$OUT/speed_$m.log" 2>&1
    echo "rc=$?" >> "$OUT/speed_$m.log"
    cat "$OUT/speed_$m.log"
  done
fi
if has data16; then
  # 16-bit nets from LMDBs: whether the input pipeline keeps up with a batch
  # in half FP32's time (bench_data_gpu --precision; needs the lmdb wheel,
  # and simplejpeg's, or the JPEG rows time Pillow's decoder instead).
  python3 -c "import simplejpeg" 2>/dev/null || \
    echo "WARNING: simplejpeg is not installed: the JPEG rows decode with Pillow (carry its wheel in .gpu_carry/whl)"
  for n in ${DATA16_NETS:-alexnet_b128 resnet50_b64}; do
    stamp "caffeplus train $n from LMDBs, precision ${DATA16_PRECISION:-fp16}"
    timeout "${DATA16_S:-300}" python3 benchmarks/bench_data_gpu.py --nets $n \
      --inputs ${DATA16_INPUTS:-constant,raw,jpeg} --precision ${DATA16_PRECISION:-fp16} \
      --json "$OUT/data16_$n.json" > "$OUT/data16_$n.log" 2>&1
    echo "rc=$?" >> "$OUT/data16_$n.log"
    cat "$OUT/data16_$n.log"
  done
fi
if has bits; then
  stamp "plans bit-identical, deterministic math, ${BITS_ITERS:-50} iterations"
  GLOG_minloglevel=2 timeout "${BITS_S:-300}" python3 dev/check_plans_equal.py --gpu 0 \
    --math deterministic --workspace_limit 8388608 --iters ${BITS_ITERS:-50} \
    --plans stock,shared,offload,arena > "$OUT/bits.log" 2>&1
  echo "rc=$?" >> "$OUT/bits.log"
  cat "$OUT/bits.log"
fi
if has amp; then
  stamp "PyTorch AMP peers, TF32 on"
  GLOG_minloglevel=2 timeout "${AMP_S:-400}" python3 benchmarks/bench_gpu.py --bench-dir .gpu_carry/bench \
    --nets "${AMP_NETS:-alexnet_b128,alexnettv_b128,googlenet_b64,vgg16_b64,resnet50_b64}" --plans "${AMP_PLANS:-shared:timed/strict,shared:timed,shared:timed/fp16,shared:timed/bf16}" \
    --torch --torch-models torchvision,bvlc --torch-amp "${AMP_TORCH:-fp16,bf16}" \
    --torch-plain "${AMP_TORCH_PLAIN:-off}" \
    --tf32 on --iters 20 --warmup 5 --timeout 150 \
    --json "$OUT/amp.json" --md "$OUT/amp.md" > "$OUT/amp.log" 2>&1
  echo "rc=$?" >> "$OUT/amp.log"
  tail -n 20 "$OUT/amp.log"
fi
if has layouts; then
  # The layout switches (dev/layout_switches.py): LAYOUT_NEW (the ones off by
  # default, on) against LAYOUT_BASE (as the code has them): the GPU's
  # channels-last maps beside the model, the switches' GPU tests, bench_gpu's
  # FP16 `shared` for each in one run, and `caffeplus memory -gpu` with LAYOUT_NEW.
  new=${LAYOUT_NEW:-lrn=on,grouped=on}; base=${LAYOUT_BASE:-default}
  stamp "layout switches $new against $base: census, tests, speed, memory"
  for sw in "$new" "$base"; do
    GLOG_minloglevel=2 timeout 60 python3 dev/layout_switches.py "$sw" dev/layout_census.py \
      --bench-dir .gpu_carry/bench $(echo "${LAYOUT_NETS:-alexnet_b128,googlenet_b64}" | tr , ' ') 2>&1 | tail -n 4
  done
  timeout 150 python3 -m pytest -q -p no:cacheprovider -rfE --tb=short -m gpu \
    tests/test_channels_last_gpu.py -k 'image_convolution or ceil_rule or lrns_and_grouped' \
    > "$OUT/pytest_layouts.log" 2>&1
  tail -n 4 "$OUT/pytest_layouts.log"
  for sw in "$new" "$base"; do
    tag=$(echo "$sw" | tr ',=' '_-')
    GLOG_minloglevel=2 timeout "${LAYOUT_S:-200}" python3 dev/layout_switches.py "$sw" benchmarks/bench_gpu.py \
      --bench-dir .gpu_carry/bench --nets "${LAYOUT_NETS:-alexnet_b128,googlenet_b64}" \
      --plans shared:timed/fp16 --tf32 on --iters 20 --warmup 5 --timeout 150 \
      --json "$OUT/layouts_$tag.json" > "$OUT/layouts_$tag.log" 2>&1
    tail -n 3 "$OUT/layouts_$tag.log"
  done
  for net in $(echo "${LAYOUT_NETS:-alexnet_b128,googlenet_b64}" | tr , ' '); do
    GLOG_minloglevel=2 timeout 90 python3 dev/layout_switches.py "$new" -m caffeplus memory \
      -model .gpu_carry/bench/$net.prototxt -gpu 0 --precision fp16 --plans shared --json \
      > "$OUT/memory_fp16_layouts_$net.json" 2> "$OUT/memory_layouts.err"
    python3 dev/memory_summary.py "$OUT/memory_fp16_layouts_$net.json" 2>&1 | tail -n 2
  done
fi
if has profile; then
  # Where a 16-bit iteration's time goes, layer by layer (timed algorithms, as
  # caffeplus train runs them), for the nets still slower than AMP.
  stamp "per-layer profile, ${PROFILE_PRECISION:-fp16}, timed search"
  for net in ${PROFILE_NETS:-vgg16_b64 alexnet_b128}; do
   for lay in ${PROFILE_LAYOUT:-nchw}; do
    log="$OUT/profile_${PROFILE_PRECISION:-fp16}_${lay}_$net.log"
    GLOG_minloglevel=2 timeout "${PROFILE_S:-120}" python3 dev/profile_gpu.py \
      --net .gpu_carry/bench/$net.prototxt --plan arena --search timed --tf32 \
      --precision "${PROFILE_PRECISION:-fp16}" --layout "$lay" --iters 10 --top 25 \
      > "$log" 2>&1
    echo "rc=$?" >> "$log"
    tail -n 45 "$log"
   done
  done
fi
if has accuracy; then
  stamp "digits LeNet and CIFAR10-full trained in each precision, test accuracy against FP32's"
  # The digits LMDBs: carried in .gpu_carry/digits, else made here (scikit-learn).
  for db in digits_train_lmdb digits_test_lmdb; do
    [ -d examples/digits/$db ] || [ ! -d .gpu_carry/digits/$db ] || cp -r .gpu_carry/digits/$db examples/digits/
  done
  [ -d examples/digits/digits_test_lmdb ] || python3 examples/digits/make_digits_lmdb.py
  for solver in ${ACCURACY_SOLVERS:-lenet_solver cifar10_full_solver}; do
    timeout "${ACCURACY_S:-300}" python3 benchmarks/precision_accuracy.py --gpu 0 \
      --solver examples/digits/$solver.prototxt --precisions "${ACCURACY_PRECISIONS:-fp32,fp16,bf16}" \
      ${ACCURACY_SEEDS:+--seeds $ACCURACY_SEEDS} --keep "$OUT/accuracy_$solver" \
      > "$OUT/accuracy_$solver.log" 2>&1
    echo "rc=$?" >> "$OUT/accuracy_$solver.log"
    cat "$OUT/accuracy_$solver.log"
  done
fi
if has nvcaffe; then
  stamp "NVCaffe's FP16 model files, caffeplus time"
  bash dev/nvcaffe_time.sh .gpu_carry/nvcaffe ${NVCAFFE_MODELS:-resnet50/train_val_fp16.prototxt \
    bvlc_alexnet/train_val_fp16.prototxt} > "$OUT/nvcaffe.log" 2>&1
  cat "$OUT/nvcaffe.log"
fi
stamp done
