#!/bin/bash
# The largest-batch runs on the device (through tools/gpu_snapshot.sh run):
# tools/large_batch_probe.py at each of BATCHES (VGG-16, plan auto within
# BUDGET), then `caffeplus memory --plans auto` at the largest that trained,
# for its measured peak. Logs and JSON under $OUT.
set -u
OUT=${OUT:-/tmp/gpu_out}
mkdir -p "$OUT"
NET=${NET:-.gpu_carry/bench/vgg16_b64.prototxt}
BUDGET=${BUDGET:-76G}
export GLOG_minloglevel=2
best=${MEASURE_BATCH:-0}      # set: measure at that batch without probing
for b in ${BATCHES-1536 2048}; do
  echo "== batch $b, auto within $BUDGET"
  timeout "${PROBE_S:-200}" python3 tools/large_batch_probe.py "$NET" --batch "$b" --plan auto \
    --budget "$BUDGET" > "$OUT/probe_$b.log" 2>&1
  rc=$?
  grep -E "^(largest|iteration|ok|FAILED)" "$OUT/probe_$b.log" | cut -c1-400
  [ $rc -eq 0 ] && [ "$b" -gt "$best" ] && best=$b
done
if [ "$best" -gt 0 ] && [ -n "${MEASURE:-1}" ]; then
  echo "== caffeplus memory --plans auto --batch $best"
  timeout "${MEASURE_S:-240}" python3 -m caffeplus memory -model "$NET" -gpu 0 --plans auto \
    --budget "$BUDGET" --batch "$best" --iterations 1 --json > "$OUT/memory_auto_$best.json" \
    2> "$OUT/memory_auto_$best.err"
  echo "rc=$?"
  python3 -c "
import json, sys
d = json.load(open(sys.argv[1]))['plans']['auto']
print('peak %.1f GiB, steady %.1f GiB, %.0f ms an iteration, %d maps offloaded' % (
    d['peak_bytes'] / 2**30, d.get('steady_peak_bytes', 0) / 2**30, d['iter_ms'] or 0,
    len(d.get('offloaded') or [])))" "$OUT/memory_auto_$best.json" 2>&1 | tail -n 2
fi
