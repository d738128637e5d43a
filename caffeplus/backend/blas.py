"""float32 matrix products through cuBLAS that follow the math mode.

CuPy's matmul honours the float32 compute type that
caffeplus.backend.mathmode sets (TF32 or not), but cupy.cublas.gemm is
cublasSgemm, which never uses TF32 whatever the mode, and neither takes
beta = 1 with a strided layout. gemm() here is cublasGemmEx on raw device
pointers: compute type CUBLAS_COMPUTE_32F in strict mode (true FP32),
CUBLAS_COMPUTE_32F_FAST_TF32 in TF32 mode, or as the caller asks (bias
sums stay FP32 in every mode). Column-major, as cuBLAS: a C-ordered r x c
array is a column-major c x r matrix.

Workspace. cuBLAS takes each call's workspace from a pool of its own
outside CuPy's (on the H100 two 32 MiB buffers, 62 MiB more than with the
smallest pool). Inside `with workspace(ptr, nbytes):` the calls run on
the bytes given instead (cublasSetWorkspace), so a memory plan can place
them in its arena at the GEMM's step. CuPy's wrappers set the stream
before every call, and cublasSetStream puts the default pool back, so
these calls go through ctypes: stream, workspace, then the GEMM.
RECOMMENDED_WORKSPACE is cuBLAS's documented size for Hopper, which gives
the default pool's algorithms, hence its bits
(tools/cublas_workspace_probe.py --own).
"""
import contextlib
import ctypes
import re

from caffeplus.backend import mathmode

N, T = 0, 1                         # cublasOperation_t
_R_32F = 0                          # cudaDataType CUDA_R_32F
_COMPUTE_32F = 68                   # cublasComputeType_t
_COMPUTE_32F_FAST_TF32 = 77
_GEMM_DEFAULT = -1
_ONE = ctypes.c_float(1.0)
_ZERO = ctypes.c_float(0.0)
_SCALARS = {1.0: ctypes.addressof(_ONE), 0.0: ctypes.addressof(_ZERO)}
_state = {'cublas': None, 'handle': None, 'ctypes': None, 'workspace': None}
RECOMMENDED_WORKSPACE = 32 * 1024 * 1024


def _lib():
    lib = _state['cublas']
    if lib is None:
        from cupy_backends.cuda.libs import cublas as lib
        _state['cublas'] = lib
    return lib


def _handle():
    import cupy
    get = _state['handle']
    if get is None:
        get = getattr(cupy.cuda.device, 'get_cublas_handle', None) or \
            (lambda: cupy.cuda.Device().cublas_handle)
        _state['handle'] = get
    return get()


def _loaded_cublas():
    """libcublas as CuPy loaded it (ctypes on the same library, so the
    handle CuPy made is valid here)."""
    lib = _state['ctypes']
    if lib is None:
        _lib()                              # makes the process load libcublas
        path = None
        with open('/proc/self/maps') as maps:
            for line in maps:
                name = line.rsplit(None, 1)[-1]
                if re.search(r'/libcublas\.so[.0-9]*$', name):
                    path = name
                    break
        lib = ctypes.CDLL(path or 'libcublas.so')
        v, i, s = ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t
        lib.cublasSetStream_v2.argtypes = [v, v]
        lib.cublasSetWorkspace_v2.argtypes = [v, v, s]
        lib.cublasGemmEx.argtypes = [v, i, i, i, i, i, v, v, i, i, v, i, i, v, v, i, i, i, i]
        lib.cublasGemmStridedBatchedEx.argtypes = [
            v, i, i, i, i, i, v, v, i, i, ctypes.c_longlong, v, i, i, ctypes.c_longlong, v, v,
            i, i, ctypes.c_longlong, i, i, i]
        _state['ctypes'] = lib
    return lib


@contextlib.contextmanager
def workspace(ptr, nbytes):
    """GEMMs inside run on `nbytes` at device address `ptr` (see above)."""
    previous = _state['workspace']
    _state['workspace'] = (int(ptr), int(nbytes))
    try:
        yield
    finally:
        _state['workspace'] = previous


def _own_workspace_call(function, *args):
    """cuBLAS `function` on CuPy's handle and current stream, with the
    workspace given to workspace()."""
    import cupy
    lib = _loaded_cublas()
    handle = _handle()
    ptr, nbytes = _state['workspace']
    for name, status in (
            ('cublasSetStream', lib.cublasSetStream_v2(handle,
                                                      cupy.cuda.get_current_stream().ptr)),
            ('cublasSetWorkspace', lib.cublasSetWorkspace_v2(handle, ptr, nbytes)),
            (function, getattr(lib, function)(handle, *args))):
        if status:
            from caffeplus.errors import CaffeplusError
            raise CaffeplusError('%s failed: cuBLAS status %d' % (name, status))


def gemm(transa, transb, m, n, k, a, lda, b, ldb, c, ldc, beta=0.0, tf32=None):
    """C (m x n) = op(A) op(B) + beta C on device pointers (ints), column-major,
    on CuPy's current stream. beta is 0 or 1; tf32 None follows the math mode."""
    if tf32 is None:
        tf32 = mathmode.tf32()
    if _state['workspace'] is not None:
        _own_workspace_call(
            'cublasGemmEx', transa, transb, int(m), int(n), int(k), _SCALARS[1.0], a, _R_32F,
            int(lda), b, _R_32F, int(ldb), _SCALARS[float(beta)], c, _R_32F, int(ldc),
            _COMPUTE_32F_FAST_TF32 if tf32 else _COMPUTE_32F, _GEMM_DEFAULT)
        return
    lib = _lib()
    lib.gemmEx(_handle(), transa, transb, int(m), int(n), int(k), _SCALARS[1.0], a, _R_32F,
               int(lda), b, _R_32F, int(ldb), _SCALARS[float(beta)], c, _R_32F, int(ldc),
               _COMPUTE_32F_FAST_TF32 if tf32 else _COMPUTE_32F, _GEMM_DEFAULT)


def gemm_strided_batched(transa, transb, m, n, k, a, lda, stride_a, b, ldb, stride_b, c, ldc,
                         stride_c, batch, beta=0.0, tf32=None):
    """C_i = op(A_i) op(B_i) + beta C_i for i < batch, X_i = X + i * stride_x
    (elements; a stride of 0 shares the matrix); as gemm() otherwise."""
    if tf32 is None:
        tf32 = mathmode.tf32()
    if _state['workspace'] is not None:
        _own_workspace_call(
            'cublasGemmStridedBatchedEx', transa, transb, int(m), int(n), int(k), _SCALARS[1.0],
            a, _R_32F, int(lda), int(stride_a), b, _R_32F, int(ldb), int(stride_b),
            _SCALARS[float(beta)], c, _R_32F, int(ldc), int(stride_c), int(batch),
            _COMPUTE_32F_FAST_TF32 if tf32 else _COMPUTE_32F, _GEMM_DEFAULT)
        return
    lib = _lib()
    lib.gemmStridedBatchedEx(
        _handle(), transa, transb, int(m), int(n), int(k), _SCALARS[1.0], a, _R_32F, int(lda),
        int(stride_a), b, _R_32F, int(ldb), int(stride_b), _SCALARS[float(beta)], c, _R_32F,
        int(ldc), int(stride_c), int(batch), _COMPUTE_32F_FAST_TF32 if tf32 else _COMPUTE_32F,
        _GEMM_DEFAULT)
