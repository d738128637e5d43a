"""cuBLAS's workspace pool: one buffer instead of two under caffeplus's plans.

cuBLAS takes each call's workspace from a pool it allocates with its
handle, outside CuPy's pool; CUBLAS_WORKSPACE_CONFIG=:KiB:COUNT sizes the
pool and is read when the handle is made. On Hopper the default is two
32 MiB buffers (the handle adds 66 MiB, dev/cublas_workspace_probe.py on
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

The placing plans (shared, offload, auto) go further: an InnerProduct's
GEMMs run on caffeplus's own handle, made with no pool
(caffeplus.backend.blas.own_handle), on ARENA_BYTES of the plan's arena
placed at that layer's forward step and at its backward step
(liveness.gemm_workspace_buffers), where the feature maps leave room far
below the peak; CuPy's handle, with its one buffer, is then made only if
something else calls cuBLAS (a 1x1 convolution timed as a GEMM, the
generic layers). Each call still sees 32 MiB, so the bits stay
(dev/cublas_workspace_probe.py --own). IN_ARENA = False keeps every GEMM
on CuPy's handle.
"""
import os

from caffeplus.memory.plan import PLACING

ENV = 'CUBLAS_WORKSPACE_CONFIG'
POOL = ':32768:1'
HOPPER_MAJOR = 9
# What one buffer instead of two saves on the H100 (the estimate's GPU).
SAVED_BYTES = 32 * 1024 * 1024
# The workspace each GEMM sees on Hopper, and what a placing plan places
# for an InnerProduct's calls (the estimate's, for the H100).
ARENA_BYTES = 32 * 1024 * 1024
# The placing plans run the InnerProduct GEMMs on their own handle in the arena.
IN_ARENA = True


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


def _in_arena_wanted():
    return IN_ARENA


def arena_bytes(plan_name, compute_capability):
    """The workspace bytes plan `plan_name` places for each InnerProduct
    call on a GPU of `compute_capability` (0: its GEMMs stay on CuPy's
    handle): a placing plan's on Hopper, unless the user set
    CUBLAS_WORKSPACE_CONFIG (their cuBLAS, their bits) or
    IN_ARENA is False."""
    if plan_name not in PLACING or not _in_arena_wanted():
        return 0
    if os.environ.get(ENV) not in (None, POOL):        # (POOL: apply() set it)
        return 0
    if not compute_capability or int(str(compute_capability)[:-1] or 0) != HOPPER_MAJOR:
        return 0
    return ARENA_BYTES


# Layers that may run GEMMs through CuPy on the GPU (its matmul, on CuPy's
# handle): with caffeplus's handle made first, CuPy's has no pool and those
# GEMMs' bits would change (caffeplus.backend.blas), so a net with one keeps
# every GEMM on CuPy's handle.
CUPY_GEMM_TYPES = ('RNN', 'LSTM', 'Python')


def cupy_gemm_layers(net):
    """Names of the net's layers that may run GEMMs on CuPy's handle: the
    recurrent and Python layers, a convolution not run by cuDNN (im2col
    and matmul), an InnerProduct not run by caffeplus's GPU layer."""
    out = []
    for name, layer in zip(net._layer_names, net.layers):
        kind = layer.layer_param.type
        if kind in CUPY_GEMM_TYPES or \
                (kind in ('Convolution', 'Deconvolution') and
                 not layer.workspace_calls) or \
                (kind == 'InnerProduct' and not hasattr(type(layer), 'gemm_views')):
            out.append(name)
    return out


def claim_first_handle(net, plan_name):
    """Make caffeplus's handle now, before anything calls cuBLAS, where the
    plan places the net's GEMM workspace: cuBLAS reads its setting for the
    process's first handle only, and a timed search that weighs a 1x1
    convolution as a GEMM before the first InnerProduct runs would
    otherwise make CuPy's handle first, with its 32 MiB pool, and ours
    after it with 32 MiB more (GoogLeNet b64 and ResNet-50 b64 `shared`
    held 80 MiB more outside CuPy's pool than AlexNet).
    Returns whether it did."""
    try:
        import cupy
    except ImportError:
        return False
    if cupy_gemm_layers(net) or not arena_bytes(plan_name, cupy.cuda.Device().compute_capability):
        return False
    from caffeplus.backend import blas
    blas.own_handle()
    return True


def modelled_arena_bytes(plan_name):
    """arena_bytes as the estimate models it (the H100)."""
    return ARENA_BYTES if plan_name in PLACING else 0


def saved_bytes(plan_name):
    """Device memory outside CuPy's pool the plan saves against cuBLAS's
    default on the H100 (the estimate's): one buffer instead of two, and
    for a placing plan the other too (its GEMMs' workspace is in the arena)."""
    if plan_name == 'stock':
        return 0
    return SAVED_BYTES + modelled_arena_bytes(plan_name)
