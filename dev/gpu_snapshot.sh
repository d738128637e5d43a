#!/bin/bash
# Run GPU checks on the committed tree only, so that uncommitted edits in the
# working tree (a helper's, say) never reach the device machine.
#
#   here:       bash dev/gpu_snapshot.sh prepare          # git archive HEAD -> .gpu_carry/src
#   on device:  bash dev/gpu_snapshot.sh run 'STEPS=tests,memory bash dev/gpu_release_check.sh'
#               (the device tool's run, with carry [".gpu_carry"])
#
# .gpu_carry (git-ignored) also holds whl/ (the lmdb wheel) and copies of
# ../shared's bench/, reference/ and zoo/.
set -u
case "${1:-}" in
  prepare)
    rm -rf .gpu_carry/src && mkdir -p .gpu_carry/src
    git archive HEAD | tar -x -C .gpu_carry/src
    git rev-parse --short HEAD > .gpu_carry/src/COMMIT
    echo "snapshot of $(cat .gpu_carry/src/COMMIT) in .gpu_carry/src"
    ;;
  run)
    shift
    ROOT=$PWD
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target /tmp/site "$ROOT"/.gpu_carry/whl/*.whl >/dev/null 2>&1
    cd "$ROOT/.gpu_carry/src" || exit 1
    mkdir -p .gpu_carry
    for d in bench reference zoo whl mpi nvcaffe; do ln -sfn "$ROOT/.gpu_carry/$d" ".gpu_carry/$d"; done
    [ -e caffeplus/layers ] || ln -s ../layers caffeplus/layers
    export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1 CAFFEPLUS_SHARED=$PWD/.gpu_carry
    export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
    echo "commit $(cat COMMIT 2>/dev/null)"
    eval "$@"
    ;;
  *)
    echo "usage: $0 prepare | run COMMAND" >&2; exit 2;;
esac
