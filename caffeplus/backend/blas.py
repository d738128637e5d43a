"""float32 matrix products through cuBLAS that follow the math mode.

CuPy's matmul honours the float32 compute type that
caffeplus.backend.mathmode sets (TF32 or not), but cupy.cublas.gemm is
cublasSgemm, which never uses TF32 whatever the mode, and neither takes
beta = 1 with a strided layout. gemm() here is cublasGemmEx on raw device
pointers: compute type CUBLAS_COMPUTE_32F in strict mode (true FP32),
CUBLAS_COMPUTE_32F_FAST_TF32 in TF32 mode, or as the caller asks (bias
sums stay FP32 in every mode). Column-major, as cuBLAS: a C-ordered r x c
array is a column-major c x r matrix.
"""
import ctypes

from caffeplus.backend import mathmode

N, T = 0, 1                         # cublasOperation_t
_R_32F = 0                          # cudaDataType CUDA_R_32F
_COMPUTE_32F = 68                   # cublasComputeType_t
_COMPUTE_32F_FAST_TF32 = 77
_GEMM_DEFAULT = -1
_ONE = ctypes.c_float(1.0)
_ZERO = ctypes.c_float(0.0)
_SCALARS = {1.0: ctypes.addressof(_ONE), 0.0: ctypes.addressof(_ZERO)}
_state = {'cublas': None, 'handle': None}


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


def gemm(transa, transb, m, n, k, a, lda, b, ldb, c, ldc, beta=0.0, tf32=None):
    """C (m x n) = op(A) op(B) + beta C on device pointers (ints), column-major,
    on CuPy's current stream. beta is 0 or 1; tf32 None follows the math mode."""
    if tf32 is None:
        tf32 = mathmode.tf32()
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
    lib = _lib()
    lib.gemmStridedBatchedEx(
        _handle(), transa, transb, int(m), int(n), int(k), _SCALARS[1.0], a, _R_32F, int(lda),
        int(stride_a), b, _R_32F, int(ldb), int(stride_b), _SCALARS[float(beta)], c, _R_32F,
        int(ldc), int(stride_c), int(batch), _COMPUTE_32F_FAST_TF32 if tf32 else _COMPUTE_32F,
        _GEMM_DEFAULT)
