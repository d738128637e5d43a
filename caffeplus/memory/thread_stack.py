"""The CUDA per-thread stack: sized down for caffeplus's own plans.

The driver reserves cudaLimitStackSize bytes of local memory for every
thread the GPU can hold at once. At CUDA's default of 1 KiB that is 264 MiB
on an H100 (132 SMs x 2048 threads), measured by dev/context_probe.py:
the context alone falls from 529 to 331 MiB at 256 bytes (318 at 208). The driver raises
the limit by itself when a kernel needs more, and keeps it raised, so a
smaller limit is safe; it only reserves up front what the kernels caffeplus
runs were seen to need (THREAD_STACK_BYTES).

`stock` keeps CUDA's default: it is Caffe 1.0's footprint, and Caffe does
not touch the limit.
"""

from caffeplus.errors import CaffeplusError
from caffeplus.memory.plan import PLACING

CUDA_DEFAULT_BYTES = 1024
# Started at 0 and read back after training, the driver raises the limit to
# 208 bytes for AlexNet b128, 160 for VGG-16 b64, 144 for ResNet-50 b64 and
# 128 for GoogLeNet b64: 208 covers them, so no launch of theirs waits for a
# raise, and each 48 bytes more would cost about 12 MiB on every net. The
# kernels the plans choose need less (dev/stack_probe.py, from 0 after the
# search: AlexNet and ResNet-50 144 bytes, GoogLeNet 128, VGG-16 160); the
# timed search's candidates raise it to 208 on AlexNet.
THREAD_STACK_BYTES = 208
# So the placing plans lower it again once their timed search is done
# (settle): to 0, and the chosen kernels raise it to what they need. CUDA
# graphs captured before then were made under the larger limit and can fail
# when launched after it went down (VGG-16 b64's `free`:
# cudnnActivationForward, CUDNN_STATUS_EXECUTION_FAILED_CUDART), so settling
# drops every captured graph (caffeplus.cudnn.api.clear_replays): each call
# runs directly once, raising the limit as its kernels need, and is captured
# again. For the estimate: the most the four benchmark nets' chosen kernels
# needed.
SETTLED_MODEL_BYTES = 160
# The same for a net whose convolutions run in 16 bits: their kernels need
# less (`thread_stack_bytes` of `caffeplus memory -gpu 0 --precision fp16
# --plans shared`: AlexNet 112 bytes, torchvision's AlexNet and ResNet-50 48,
# GoogLeNet 32, VGG-16 16), the most of them.
SETTLED_MODEL_BYTES_16BIT = 112
# False: the limit stays where the timed search left it.
SETTLE = True
# Threads an H100 holds at once: what the estimate (made without a GPU) scales by.
H100_THREADS = 132 * 2048
# Another limit for the placing plans, in bytes, or 'default' (CUDA's);
# None: THREAD_STACK_BYTES. A limit given here is never settled.
LIMIT_FOR_PLACING_PLANS = None
_STACK_LIMIT = 0                        # cudaLimitStackSize


def wanted_bytes(plan_name):
    """The per-thread stack limit a plan runs with."""
    if plan_name == 'stock':
        return CUDA_DEFAULT_BYTES
    value = LIMIT_FOR_PLACING_PLANS
    if value is None:
        return THREAD_STACK_BYTES
    if value == 'default':
        return CUDA_DEFAULT_BYTES
    if not isinstance(value, int) or value < 0:
        raise CaffeplusError("LIMIT_FOR_PLACING_PLANS must be a number of bytes or 'default', "
                             "not %r" % (value,))
    return value


def settles(plan_name):
    """Whether `plan_name` lowers the limit after its timed search (not
    where a limit is given, nor without SETTLE)."""
    if plan_name not in PLACING or LIMIT_FOR_PLACING_PLANS is not None:
        return False
    return SETTLE


def modelled_bytes(plan_name, sixteen_bit=False):
    """The limit the estimate assumes a plan runs at (`sixteen_bit`: for a
    net whose convolutions run in 16 bits)."""
    if settles(plan_name):
        settled = SETTLED_MODEL_BYTES_16BIT if sixteen_bit else SETTLED_MODEL_BYTES
        return min(settled, wanted_bytes(plan_name))
    return wanted_bytes(plan_name)


def saved_bytes(plan_name, threads=H100_THREADS, sixteen_bit=False):
    """Device memory a plan's limit saves against CUDA's default (for the estimate)."""
    return max(CUDA_DEFAULT_BYTES - modelled_bytes(plan_name, sixteen_bit), 0) * threads


def apply(plan_name):
    """Set the current GPU's limit for `plan_name` (nothing without CuPy)."""
    try:
        import cupy
    except ImportError:
        return
    cupy.cuda.runtime.deviceSetLimit(_STACK_LIMIT, wanted_bytes(plan_name))


def settle(plan_name):
    """After a timed search (whose candidates raised the limit): down to 0
    for the plans that settle, every captured CUDA graph dropped (see
    SETTLED_MODEL_BYTES); the next launches raise it to what they need.
    Returns whether it did."""
    if not settles(plan_name):
        return False
    try:
        import cupy
    except ImportError:
        return False
    from caffeplus.cudnn import api
    cupy.cuda.Device().synchronize()        # no graph of the old layout still running
    api.clear_replays()
    cupy.cuda.runtime.deviceSetLimit(_STACK_LIMIT, 0)
    return True


def current_bytes():
    """The current GPU's limit now (raised by any kernel that needed more)."""
    import cupy
    return int(cupy.cuda.runtime.deviceGetLimit(_STACK_LIMIT))
