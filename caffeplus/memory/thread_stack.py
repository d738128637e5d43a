"""The CUDA per-thread stack: sized down for caffeplus's own plans.

The driver reserves cudaLimitStackSize bytes of local memory for every
thread the GPU can hold at once. At CUDA's default of 1 KiB that is 264 MiB
on an H100 (132 SMs x 2048 threads), measured by tools/context_probe.py:
the context alone falls from 529 to 331 MiB at 256 bytes (318 at 208). The driver raises
the limit by itself when a kernel needs more, and keeps it raised, so a
smaller limit is safe; it only reserves up front what the kernels caffeplus
runs were seen to need (THREAD_STACK_BYTES).

`stock` keeps CUDA's default: it is Caffe 1.0's footprint, and Caffe does
not touch the limit. CAFFEPLUS_THREAD_STACK=BYTES sets another limit for
the other plans ('default' leaves CUDA's).
"""
import os

from caffeplus.errors import CaffeplusError

CUDA_DEFAULT_BYTES = 1024
# Started at 0 and read back after training on the H100, the driver had
# raised the limit to 208 bytes for AlexNet b128, 160 for VGG-16 b64, 144 for
# ResNet-50 b64 and 128 for GoogLeNet b64 (benchmarks/memory_results.md,
# session 10): 208 covers them, so no launch of theirs waits for a raise.
# (256 until session 17: 12.4 MiB more on every net.) The kernels the
# plans choose need less (tools/stack_probe.py on the H200, from 0 after the
# search: AlexNet and ResNet-50 144 bytes, GoogLeNet 128, VGG-16 160); the
# timed search's candidates raise it to 208 on AlexNet. Setting it to 0 and
# again after the search saved 16.5 MiB on AlexNet, but VGG-16 b64's `free`
# then failed in 2 of 9 runs (cudnnActivationForward: CUDNN_STATUS_EXECUTION_
# FAILED_CUDART, a launch failure; 0 of 8 at 208 bytes), so it stays fixed
# until that is understood (session 18).
THREAD_STACK_BYTES = 208
# Threads an H100 holds at once: what the estimate (made without a GPU) scales by.
H100_THREADS = 132 * 2048
ENV = 'CAFFEPLUS_THREAD_STACK'
_STACK_LIMIT = 0                        # cudaLimitStackSize


def wanted_bytes(plan_name):
    """The per-thread stack limit a plan runs with."""
    if plan_name == 'stock':
        return CUDA_DEFAULT_BYTES
    value = os.environ.get(ENV, '').strip().lower()
    if not value:
        return THREAD_STACK_BYTES
    if value == 'default':
        return CUDA_DEFAULT_BYTES
    try:
        n = int(value)
    except ValueError:
        n = -1
    if n < 0:
        raise CaffeplusError("%s must be a number of bytes or 'default', not '%s'" % (ENV, value))
    return n


def saved_bytes(plan_name, threads=H100_THREADS):
    """Device memory a plan's limit saves against CUDA's default (for the estimate)."""
    return max(CUDA_DEFAULT_BYTES - wanted_bytes(plan_name), 0) * threads


def apply(plan_name):
    """Set the current GPU's limit for `plan_name` (nothing without CuPy)."""
    try:
        import cupy
    except ImportError:
        return
    cupy.cuda.runtime.deviceSetLimit(_STACK_LIMIT, wanted_bytes(plan_name))


def current_bytes():
    """The current GPU's limit now (raised by any kernel that needed more)."""
    import cupy
    return int(cupy.cuda.runtime.deviceGetLimit(_STACK_LIMIT))
