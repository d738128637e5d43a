"""The CUDA per-thread stack: sized down for caffeplus's own plans.

The driver reserves cudaLimitStackSize bytes of local memory for every
thread the GPU can hold at once. At CUDA's default of 1 KiB that is 264 MiB
on an H100 or H200 (132 SMs x 2048 threads), measured by tools/context_probe.py:
the context alone falls from 529 to 331 MiB at 256 bytes (318 at 208). The driver raises
the limit by itself when a kernel needs more, and keeps it raised, so the
plans set it to THREAD_STACK_BYTES (none) and let the kernels they run
raise it to what they need.

The timed algorithm search runs every candidate, and some need more than
the chosen ones (AlexNet b128: the search raised it to 208 bytes, the
chosen kernels need 144; tools/stack_probe.py on the H200), so the limit is
set again once a search is done (after_search): 16.5 MiB less on AlexNet.

`stock` keeps CUDA's default: it is Caffe 1.0's footprint, and Caffe does
not touch the limit. CAFFEPLUS_THREAD_STACK=BYTES sets another limit for
the other plans ('default' leaves CUDA's).
"""
import os

from caffeplus.errors import CaffeplusError

CUDA_DEFAULT_BYTES = 1024
# What the plans set: nothing up front; each kernel's launch raises it to
# what that kernel needs (the first launch after a raise waits for the
# device once). 256 until session 17, 208 until session 18.
THREAD_STACK_BYTES = 0
# What the kernels the plans choose raised it to on the bench nets (H200,
# tools/stack_probe.py, from 0 after the search): AlexNet b128 and
# ResNet-50 b64 144 bytes, GoogLeNet b64 128, VGG-16 b64 160 (its fc6's
# GEMM; benchmarks/memory_results.md, session 18). The estimate, made
# without a GPU, counts 144 (VGG-16's 16 bytes more are 4 MiB).
ESTIMATED_STACK_BYTES = 144
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


def expected_bytes(plan_name):
    """The limit a plan is expected to run at once its kernels have raised
    it (for the estimate): at least ESTIMATED_STACK_BYTES."""
    wanted = wanted_bytes(plan_name)
    return wanted if wanted >= CUDA_DEFAULT_BYTES else max(wanted, ESTIMATED_STACK_BYTES)


def saved_bytes(plan_name, threads=H100_THREADS):
    """Device memory a plan's limit saves against CUDA's default (for the estimate)."""
    return max(CUDA_DEFAULT_BYTES - expected_bytes(plan_name), 0) * threads


def apply(plan_name):
    """Set the current GPU's limit for `plan_name` (nothing without CuPy)."""
    try:
        import cupy
    except ImportError:
        return
    cupy.cuda.runtime.deviceSetLimit(_STACK_LIMIT, wanted_bytes(plan_name))


def after_search(plan_name):
    """Once a timed algorithm search is done: set the limit again, so that
    what the candidates raised it to is not kept for the chosen kernels.
    Nothing for `stock`, whose limit is CUDA's default, or below the limit."""
    if plan_name == 'stock':
        return
    try:
        import cupy
    except ImportError:
        return
    wanted = wanted_bytes(plan_name)
    if current_bytes() > wanted:
        cupy.cuda.runtime.deviceSetLimit(_STACK_LIMIT, wanted)


def current_bytes():
    """The current GPU's limit now (raised by any kernel that needed more)."""
    import cupy
    return int(cupy.cuda.runtime.deviceGetLimit(_STACK_LIMIT))
