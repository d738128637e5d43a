#!/usr/bin/env bash
# Run a command while busy loops keep every core oversubscribed, to show that
# tests which send signals or wait for processes wait for states, not times.
#   bash dev/under_load.sh 8 python3 -m pytest -q -p no:cacheprovider tests
# The load average is printed every minute to stderr; the command's exit
# status is the script's.
set -u
loops=$1; shift
pids=()
for _ in $(seq "$loops"); do (while :; do :; done) & pids+=($!); done
( while sleep 60; do echo "under_load: $(cat /proc/loadavg)" >&2; done ) & pids+=($!)
trap 'kill "${pids[@]}" 2>/dev/null' EXIT
"$@"
