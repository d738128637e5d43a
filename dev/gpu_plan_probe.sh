#!/bin/bash
# Side-by-side probes of memory plans on the GPU, in one device call (run
# through dev/gpu_snapshot.sh; outputs under $OUT):
#   PROFILE="net:plan,plan net:plan"  dev/profile_gpu.py per plan (device ms by layer)
#   ALGOS="net:plan,plan"             tools/dump_algorithms.py JSON per plan
#   MEMORY="net:plans:budget:iters"   caffeplus memory -gpu 0 (budget '-' for none)
# e.g. PROFILE="alexnet_b128:arena,shared" MEMORY="vgg16_b256:shared,auto:12G:5"
# MEMORY_PLOT=1 writes each memory run's charts beside its JSON (--plot).
# PROFILE_FULL=1 prints the profiles (the device tool brings back 8 files at most);
# PROFILE_BUDGET=12G profiles plan auto under that budget.
set -u
OUT=${OUT:-/tmp/gpu_out}
mkdir -p "$OUT"
B=.gpu_carry/bench
for spec in ${PROFILE:-}; do
  net=${spec%%:*}; plans=${spec#*:}
  for plan in ${plans//,/ }; do
    echo "== profile $net $plan"
    GLOG_minloglevel=2 timeout 240 python3 dev/profile_gpu.py --net $B/$net.prototxt \
      --plan $plan --iters ${PROFILE_ITERS:-20} --top ${PROFILE_TOP:-30} \
      ${PROFILE_BUDGET:+--budget $PROFILE_BUDGET} \
      > "$OUT/profile_${net}_$plan.log" 2>&1
    echo "rc=$?" >> "$OUT/profile_${net}_$plan.log"
    if [ -n "${PROFILE_FULL:-}" ]; then cat "$OUT/profile_${net}_$plan.log"
    else grep -E "ms/iter|rc=" "$OUT/profile_${net}_$plan.log"; fi
  done
done
for spec in ${ALGOS:-}; do
  net=${spec%%:*}; plans=${spec#*:}
  for plan in ${plans//,/ }; do
    echo "== algorithms $net $plan"
    GLOG_minloglevel=2 timeout 240 python3 tools/dump_algorithms.py --plan $plan \
      --json "$OUT/algos_${net}_$plan.json" $B/$net.prototxt > "$OUT/algos_${net}_$plan.log" 2>&1
    echo "rc=$?"
  done
done
for spec in ${MEMORY:-}; do
  IFS=: read -r net plans budget iters <<< "$spec"
  echo "== memory $net $plans budget $budget"
  extra=""; [ "$budget" != "-" ] && extra="--budget $budget"
  [ -n "${MEMORY_PLOT:-}" ] && extra="$extra --plot $OUT/memory_${net}_${plans//,/_}.png"
  GLOG_minloglevel=2 timeout ${MEMORY_S:-300} python3 -m caffeplus memory -model $B/$net.prototxt \
    -gpu 0 --plans $plans $extra --offload ${MEMORY_OFFLOAD:-free} --iterations ${iters:-5} --json \
    > "$OUT/memory_${net}_${plans//,/_}.json" 2> "$OUT/memory_${net}_${plans//,/_}.err"
  echo "rc=$?"
  python3 dev/memory_summary.py "$OUT/memory_${net}_${plans//,/_}.json"
  tail -n 2 "$OUT/memory_${net}_${plans//,/_}.err"
done
