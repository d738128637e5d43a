"""caffeplus's GEMMs on a workspace of ours (for tools/cublas_workspace_probe.py).

    with own_workspace(ptr, nbytes):     # caffeplus.backend.blas's calls run there

cuBLAS takes each call's workspace from a pool it allocates with its
handle; cublasSetWorkspace gives it other bytes instead. CuPy's wrappers
set the stream before every call, and cublasSetStream puts the default
pool back, so the calls here go through ctypes: stream, workspace, GEMM.
The memory plans do not use this (caffeplus.memory.cublas_pool says why);
the probe measures what it would hold and whether the bits stay.
"""
import contextlib
import ctypes
import re

from caffeplus.backend import blas


def _loaded_cublas():
    """libcublas as CuPy loaded it (the same library, so CuPy's handle is valid)."""
    blas._lib()
    path = None
    with open('/proc/self/maps') as maps:
        for line in maps:
            name = line.rsplit(None, 1)[-1]
            if re.search(r'/libcublas\.so[.0-9]*$', name):
                path = name
                break
    lib = ctypes.CDLL(path or 'libcublas.so')
    v, i, s, ll = ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t, ctypes.c_longlong
    lib.cublasSetStream_v2.argtypes = [v, v]
    lib.cublasSetWorkspace_v2.argtypes = [v, v, s]
    lib.cublasGemmEx.argtypes = [v, i, i, i, i, i, v, v, i, i, v, i, i, v, v, i, i, i, i]
    lib.cublasGemmStridedBatchedEx.argtypes = [v, i, i, i, i, i, v, v, i, i, ll, v, i, i, ll,
                                               v, v, i, i, ll, i, i, i]
    return lib


def _compute(tf32):
    from caffeplus.backend import mathmode
    tf32 = mathmode.tf32() if tf32 is None else tf32
    return blas._COMPUTE_32F_FAST_TF32 if tf32 else blas._COMPUTE_32F


@contextlib.contextmanager
def own_workspace(ptr, nbytes):
    import cupy
    lib = _loaded_cublas()

    def call(function, *args):
        handle = blas._handle()
        for name, status in (
                ('cublasSetStream', lib.cublasSetStream_v2(
                    handle, cupy.cuda.get_current_stream().ptr)),
                ('cublasSetWorkspace', lib.cublasSetWorkspace_v2(handle, int(ptr), int(nbytes))),
                (function, getattr(lib, function)(handle, *args))):
            if status:
                raise RuntimeError('%s failed: cuBLAS status %d' % (name, status))

    def gemm(transa, transb, m, n, k, a, lda, b, ldb, c, ldc, beta=0.0, tf32=None):
        call('cublasGemmEx', transa, transb, int(m), int(n), int(k), blas._SCALARS[1.0], a,
             blas._R_32F, int(lda), b, blas._R_32F, int(ldb), blas._SCALARS[float(beta)], c,
             blas._R_32F, int(ldc), _compute(tf32), blas._GEMM_DEFAULT)

    def gemm_strided_batched(transa, transb, m, n, k, a, lda, stride_a, b, ldb, stride_b, c,
                             ldc, stride_c, batch, beta=0.0, tf32=None):
        call('cublasGemmStridedBatchedEx', transa, transb, int(m), int(n), int(k),
             blas._SCALARS[1.0], a, blas._R_32F, int(lda), int(stride_a), b, blas._R_32F,
             int(ldb), int(stride_b), blas._SCALARS[float(beta)], c, blas._R_32F, int(ldc),
             int(stride_c), int(batch), _compute(tf32), blas._GEMM_DEFAULT)

    saved = blas.gemm, blas.gemm_strided_batched
    blas.gemm, blas.gemm_strided_batched = gemm, gemm_strided_batched
    try:
        yield
    finally:
        blas.gemm, blas.gemm_strided_batched = saved
