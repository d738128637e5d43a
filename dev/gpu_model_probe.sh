#!/bin/bash
# Probes for the memory model, in one device call (run through
# dev/gpu_snapshot.sh; outputs under $OUT):
#   STEPS="net net"     dev/free_offload_probe.py --json: the step times offload
#                       'free' measures, to fit workspace_model's layer times
#   CENSUS="net:plan"   dev/pool_census.py: what holds the device at the steady peak
#   CUBLAS=1            dev/cublas_workspace_probe.py: GEMM bits and memory by
#                       CUBLAS_WORKSPACE_CONFIG
#   OWN=1               the same with the GEMMs on a 32 MiB workspace of CuPy's pool
#                       (blas.workspace), against cuBLAS's default pool
#   LRN=1               dev/lrn_slices_probe.py: cuDNN's LRN bits over batch slices
#   CONTEXT=1           dev/context_probe.py at the 256-byte stack, with cuBLAS's
#                       default workspace and with CUBLAS_WORKSPACE_CONFIG=:4096:1
set -u
OUT=${OUT:-/tmp/gpu_out}
mkdir -p "$OUT"
B=.gpu_carry/bench
for net in ${STEPS:-}; do
  echo "== steps $net"
  GLOG_minloglevel=2 timeout 240 python3 dev/free_offload_probe.py $B/$net.prototxt \
    --iterations ${STEPS_ITERS:-6} --json "$OUT/steps_$net.json" > "$OUT/steps_$net.log" 2>&1
  echo "rc=$?"; grep -E "^iteration|chose at|candidates" "$OUT/steps_$net.log" | tail -4
done
for spec in ${CENSUS:-}; do
  net=${spec%%:*}; plan=${spec#*:}
  echo "== census $net $plan"
  GLOG_minloglevel=2 timeout 240 python3 dev/pool_census.py $B/$net.prototxt --plan $plan 2>&1 | tail -40
done
if [ -n "${CONTEXT:-}" ]; then
  echo "== context, cuBLAS default"
  timeout 120 python3 dev/context_probe.py --stack 256 2>&1 | tail -12
  echo "== context, CUBLAS_WORKSPACE_CONFIG=:4096:1"
  CUBLAS_WORKSPACE_CONFIG=:4096:1 timeout 120 python3 dev/context_probe.py --stack 256 2>&1 | tail -12
fi
# gemm_against_default ENV=VALUE [probe args]: the probe in a process of its
# own under that setting, its outputs compared bit for bit with the default's
gemm_against_default() {
  local setting=$1; shift
  env "$setting" timeout 120 python3 dev/cublas_workspace_probe.py "$OUT/gemm_c.npz" "$@" \
    2>&1 | grep -v "^I2"
  python3 dev/cublas_workspace_probe.py --compare "$OUT/gemm_default.npz" "$OUT/gemm_c.npz"
}
if [ -n "${CUBLAS:-}${OWN:-}" ]; then
  echo "== cuBLAS's default pool"
  timeout 120 python3 dev/cublas_workspace_probe.py "$OUT/gemm_default.npz" 2>&1 | grep -v "^I2"
fi
if [ -n "${CUBLAS:-}" ]; then
  echo "== cuBLAS workspace: GEMM outputs and memory per CUBLAS_WORKSPACE_CONFIG"
  for cfg in :4096:1 :4096:8 :16384:2; do gemm_against_default CUBLAS_WORKSPACE_CONFIG=$cfg; done
fi
if [ -n "${OWN:-}" ]; then
  echo "== cuBLAS: one 32 MiB buffer, and a workspace of ours, against its default pool"
  for cfg in :32768:1 :0:0 :4096:1; do
    gemm_against_default CUBLAS_WORKSPACE_CONFIG=$cfg
    gemm_against_default CUBLAS_WORKSPACE_CONFIG=$cfg --own 33554432
  done
  echo "-- the setting made inside the process, before the handle"
  gemm_against_default PROBE_SET_CONFIG=:0:0 --own 33554432
fi
rm -f "$OUT"/gemm_*.npz
if [ -n "${LRN:-}" ]; then
  echo "== LRN over batch slices"
  timeout 120 python3 dev/lrn_slices_probe.py 2>&1 | grep -v "^I2"
fi
