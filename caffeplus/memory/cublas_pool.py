"""cuBLAS's workspace pool: one buffer instead of two under caffeplus's plans.

cuBLAS takes each call's workspace from a pool it allocates with its
handle, outside CuPy's pool; CUBLAS_WORKSPACE_CONFIG=:KiB:COUNT sizes the
pool and is read when the handle is made. On Hopper the default is two
32 MiB buffers (the handle adds 66 MiB, tools/cublas_workspace_probe.py on
the H100); the second lets GEMMs on two streams run at once, and caffeplus
issues all of them on one. One 32 MiB buffer (the handle then adds 34 MiB)
gives every GEMM the probe runs (the bench nets' InnerProducts forward and
backward, a 1x1 convolution's strided-batched GEMM) the default's bits:
each call sees the same workspace size, so cuBLAS picks the same kernels.
Smaller buffers change 15 of its 25 outputs.

So every plan but `stock` (Caffe 1.0's footprint keeps cuBLAS's default)
asks for POOL when it is applied on a GPU of compute capability 9. It only
counts if cuBLAS's handle for the device does not exist yet (the plans are
applied before the first GEMM in `caffeplus train` and `caffeplus memory`);
a CUBLAS_WORKSPACE_CONFIG the user set is left alone.
"""
import os

ENV = 'CUBLAS_WORKSPACE_CONFIG'
POOL = ':32768:1'
HOPPER_MAJOR = 9
# What one buffer instead of two saves on the H100 (the estimate's GPU).
SAVED_BYTES = 32 * 1024 * 1024


def wanted(plan_name, compute_capability):
    """The CUBLAS_WORKSPACE_CONFIG plan `plan_name` asks for on a GPU of
    `compute_capability` ('90'), or None to leave cuBLAS's default."""
    if plan_name == 'stock' or os.environ.get(ENV) is not None:
        return None
    if not compute_capability or int(str(compute_capability)[:-1] or 0) != HOPPER_MAJOR:
        return None
    return POOL


def apply(plan_name):
    """Set CUBLAS_WORKSPACE_CONFIG for `plan_name` on the current GPU;
    returns the setting made, or None."""
    try:
        import cupy
    except ImportError:
        return None
    setting = wanted(plan_name, cupy.cuda.Device().compute_capability)
    if setting is not None:
        os.environ[ENV] = setting
    return setting


def saved_bytes(plan_name):
    """Device memory the setting saves for `plan_name` on the H100 (the estimate's)."""
    return 0 if plan_name == 'stock' else SAVED_BYTES
