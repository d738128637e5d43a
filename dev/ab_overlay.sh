#!/bin/bash
# A/B on the device: the tree as sent ("new") against the same tree with some
# files replaced ("old"), runs alternated ROUNDS times, each line of output
# prefixed with its side and round:
#   OVERLAY=.gpu_carry/old ROUNDS=2 bash dev/ab_overlay.sh CMD ARGS...
# OVERLAY mirrors the repository's paths; make it here from a revision, e.g.
#   git show REV:caffeplus/kernels.py > .gpu_carry/old/caffeplus/kernels.py
# (the device's copy of .git may be older than the tree it was sent). Run
# after dev/gpu_release_check.sh has installed the wheels (/tmp/site).
set -u
OVERLAY=${OVERLAY:?OVERLAY: the folder of replaced files}
ROUNDS=${ROUNDS:-2}
OLD=/tmp/ab_old
rm -rf "$OLD" && mkdir -p "$OLD"
tar --exclude=./.git --exclude=./.gpu_carry -cf - . | tar -xf - -C "$OLD"
(cd "$OVERLAY" && tar -cf - .) | tar -xf - -C "$OLD"
ln -sfn "$PWD/.gpu_carry" "$OLD/.gpu_carry"
for r in $(seq "$ROUNDS"); do
  for side in new old; do
    dir=$PWD; [ "$side" = old ] && dir=$OLD
    (cd "$dir" && PYTHONPATH=$dir:/tmp/site "$@" 2>&1) | sed "s/^/$side $r | /"
  done
done
