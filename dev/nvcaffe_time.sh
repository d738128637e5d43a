#!/usr/bin/env bash
# `caffeplus time` on NVCaffe's own model files (their data layers made
# DummyData), on the GPU: they load and run as written.
#   bash dev/nvcaffe_time.sh DIR MODEL... (DIR holds NVCaffe's models/ folder)
set -u
dir=$1; shift
for m in "$@"; do
  src="$dir/models/$m"
  tmp=$(mktemp --suffix=.prototxt)
  python3 -c "
import sys
from google.protobuf import text_format
from caffeplus.io import dummy
sys.stdout.write(text_format.MessageToString(dummy.swap_data_layers(sys.argv[1])))
" "$src" > "$tmp" || { echo "$m: could not swap its data layers"; continue; }
  echo "== $m"
  timeout 200 python3 -m caffeplus time -model "$tmp" -gpu 0 -iterations 10 2>&1 \
    | grep -E "Average Forward-Backward|asks for|Error|error" | tail -n 4
  rm -f "$tmp"
done
