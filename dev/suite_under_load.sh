#!/usr/bin/env bash
# The whole test suite while busy loops oversubscribe the cores, split into
# SHARDS pytest processes (test files dealt out largest first, each with its
# own --basetemp) so that the run ends in reasonable time: with 6 loops and 4
# shards the load average stays above 10 on 2 cores.
#   bash dev/suite_under_load.sh [LOOPS=6] [SHARDS=4] [OUTDIR=/tmp/suite_under_load]
# Prints each shard's summary line; exits non-zero if any shard failed.
# PYTHON: the interpreter (default python3).
set -u
loops=${1:-6}; shards=${2:-4}; out=${3:-/tmp/suite_under_load}
cd "$(dirname "$0")/.."
rm -rf "$out" && mkdir -p "$out"
mapfile -t files < <(ls -S tests/test_*.py)
for ((k = 0; k < shards; k++)); do : > "$out/files_$k"; done
for ((i = 0; i < ${#files[@]}; i++)); do
  # Boustrophedon deal: 0..k-1, k-1..0, ... keeps the shards' sizes close.
  r=$(( i % (2 * shards) )); k=$(( r < shards ? r : 2 * shards - 1 - r ))
  echo "${files[$i]}" >> "$out/files_$k"
done
pids=()
for _ in $(seq "$loops"); do (while :; do :; done) & pids+=($!); done
( while sleep 60; do echo "$(date +%T) load $(cut -d' ' -f1-3 /proc/loadavg)"; done ) \
  > "$out/load.log" & pids+=($!)
trap 'kill "${pids[@]}" 2>/dev/null' EXIT
runs=()
for ((k = 0; k < shards; k++)); do
  "${PYTHON:-python3}" -m pytest -q -p no:cacheprovider --basetemp="$out/tmp_$k" $(cat "$out/files_$k") \
    > "$out/shard_$k.log" 2>&1 &
  runs+=($!)
done
rc=0
for ((k = 0; k < shards; k++)); do
  wait "${runs[$k]}" || rc=1
  echo "shard $k: $(tail -n 1 "$out/shard_$k.log")"
done
sort -k3 -n "$out/load.log" | sed -n '1p;$p' | sed 's/^/load (min, max of the minutely samples): /'
exit $rc
