"""float32 matrix products through cuBLAS that follow the math mode.

CuPy's matmul honours the float32 compute type that
caffeplus.backend.mathmode sets (TF32 or not), but cupy.cublas.gemm is
cublasSgemm, which never uses TF32 whatever the mode, and neither takes
beta = 1 with a strided layout. gemm() here is cublasGemmEx on raw device
pointers: compute type CUBLAS_COMPUTE_32F in strict mode (true FP32),
CUBLAS_COMPUTE_32F_FAST_TF32 in TF32 mode, or as the caller asks (bias
sums stay FP32 in every mode). Column-major, as cuBLAS: a C-ordered r x c
array is a column-major c x r matrix.

`workspace=(pointer, bytes)`: the call runs on a cuBLAS handle of
caffeplus's own (one per device), made without a workspace pool of its
own (CUBLAS_WORKSPACE_CONFIG=:0:0 while it is created), on those bytes,
which a memory plan places in its arena (caffeplus.memory.cublas_pool).
CuPy's wrappers set the handle's stream before every call and
cublasSetStream puts the handle's default workspace back, so these calls
go through ctypes: stream, workspace, GEMM. Without `workspace` the call
runs on CuPy's handle and its pool, unless caffeplus's handle exists:
cuBLAS reads CUBLAS_WORKSPACE_CONFIG once, for the first handle of the
process, so a CuPy handle made after ours has no pool either; such calls
then run on caffeplus's handle over a FALLBACK_BYTES buffer of CuPy's
pool, and every GEMM here still sees the workspace size, hence the bits,
it would have on CuPy's handle with its one buffer (dev/cublas_handles_probe.py).
"""
import contextlib
import ctypes
import os
import re

from caffeplus.backend import mathmode

N, T = 0, 1                         # cublasOperation_t
_R_32F = 0                          # cudaDataType CUDA_R_32F
_R_16F = 2                          # CUDA_R_16F
_R_16BF = 14                        # CUDA_R_16BF
_DATA_TYPES = {'float32': _R_32F, 'float16': _R_16F, 'bfloat16': _R_16BF}
_COMPUTE_32F = 68                   # cublasComputeType_t
_COMPUTE_32F_FAST_TF32 = 77
_GEMM_DEFAULT = -1
_ONE = ctypes.c_float(1.0)
_ZERO = ctypes.c_float(0.0)
_SCALARS = {1.0: ctypes.addressof(_ONE), 0.0: ctypes.addressof(_ZERO)}
# 'bound': {caffeplus's handle: [the stream, the (pointer, bytes) workspace] set on it}
_state = {'cublas': None, 'handle': None, 'ctypes': None, 'own': {}, 'fallback': {},
          'bound': {}, 'capture': None}
# cuBLAS's one buffer on Hopper (caffeplus.memory.cublas_pool.POOL): what a
# call without workspace of its own gets on caffeplus's handle.
FALLBACK_BYTES = 32 * 1024 * 1024
WORKSPACE_ENV = 'CUBLAS_WORKSPACE_CONFIG'
NO_POOL = ':0:0'


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


def loaded_cublas():
    """libcublas through ctypes: the library CuPy loaded (so a handle of
    either kind is valid in both), with the signatures used here."""
    lib = _state['ctypes']
    if lib is not None:
        return lib
    _lib()
    path = None
    with open('/proc/self/maps') as maps:
        for line in maps:
            name = line.rsplit(None, 1)[-1]
            if re.search(r'/libcublas\.so[.0-9]*$', name):
                path = name
                break
    lib = ctypes.CDLL(path or 'libcublas.so')
    v, i, s, ll = ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t, ctypes.c_longlong
    lib.cublasCreate_v2.argtypes = [ctypes.POINTER(v)]
    lib.cublasSetStream_v2.argtypes = [v, v]
    lib.cublasSetWorkspace_v2.argtypes = [v, v, s]
    lib.cublasGemmEx.argtypes = [v, i, i, i, i, i, v, v, i, i, v, i, i, v, v, i, i, i, i]
    lib.cublasGemmStridedBatchedEx.argtypes = [v, i, i, i, i, i, v, v, i, i, ll, v, i, i, ll,
                                               v, v, i, i, ll, i, i, i]
    _state['ctypes'] = lib
    return lib


def own_handle():
    """caffeplus's own cuBLAS handle on the current device, made with no
    workspace pool (cuBLAS reads CUBLAS_WORKSPACE_CONFIG when a handle is
    made); every call on it brings its workspace."""
    import cupy
    device = cupy.cuda.runtime.getDevice()
    handle = _state['own'].get(device)
    if handle is None:
        lib = loaded_cublas()
        saved = os.environ.get(WORKSPACE_ENV)
        os.environ[WORKSPACE_ENV] = NO_POOL
        try:
            made = ctypes.c_void_p()
            _check('cublasCreate', lib.cublasCreate_v2(ctypes.byref(made)))
        finally:
            if saved is None:
                del os.environ[WORKSPACE_ENV]
            else:
                os.environ[WORKSPACE_ENV] = saved
        handle = _state['own'][device] = made.value
    return handle


def own_handle_made():
    """Whether caffeplus's handle exists (on any device: the setting cuBLAS
    read for the process's first handle holds for every later one)."""
    return bool(_state['own'])


def _fallback_workspace():
    import cupy
    device = cupy.cuda.runtime.getDevice()
    buf = _state['fallback'].get(device)
    if buf is None:
        buf = _state['fallback'][device] = cupy.empty(FALLBACK_BYTES, dtype='uint8')
    return int(buf.data.ptr), FALLBACK_BYTES


def release_fallback():
    """Give the fallback buffers back (after a timed search, whose GEMM
    candidates used them); the next call without a workspace takes one
    again. Returns the bytes released."""
    n = FALLBACK_BYTES * len(_state['fallback'])
    _state['fallback'].clear()
    return n


def _workspace(workspace):
    if workspace is None:
        if _state['capture'] is not None:
            return _state['capture']
        if _state['own']:
            return _fallback_workspace()
    return workspace


@contextlib.contextmanager
def capture_workspace(workspace):
    """Calls without a workspace of their own run on caffeplus's handle over
    `workspace` (pointer, bytes of FALLBACK_BYTES: the bits of an eager
    call) while a CUDA graph is captured (caffeplus.pass_graph): CuPy
    refuses its cuBLAS calls then, and the fallback buffer may be released
    while the graph still uses it."""
    saved, _state['capture'] = _state['capture'], (int(workspace[0]), int(workspace[1]))
    try:
        yield
    finally:
        _state['capture'] = saved


def _check(function, status):
    if status:
        raise RuntimeError('%s failed: cuBLAS status %d' % (function, status))


def _current_stream():
    import cupy
    return cupy.cuda.get_current_stream().ptr


def _on_workspace(workspace, function, *args):
    """`function` on caffeplus's handle, on CuPy's current stream, with the
    workspace (pointer, bytes). Only this function sets the handle's stream
    and workspace, so each is set only when it changes (a GoogLeNet
    iteration makes about 180 GEMM calls, most on one stream and one
    workspace, and a host-bound net waits on every ctypes call); setting
    the stream puts cuBLAS's default workspace back, so the workspace
    follows a new stream."""
    lib = loaded_cublas()
    handle = own_handle()
    stream = _current_stream()
    ws = (int(workspace[0]), int(workspace[1]))
    bound = _state['bound'].get(handle)
    if bound is None or bound[0] != stream:
        _check('cublasSetStream', lib.cublasSetStream_v2(handle, stream))
        bound = _state['bound'][handle] = [stream, None]
    if bound[1] != ws:
        bound[1] = None             # unknown until the call succeeds
        _check('cublasSetWorkspace', lib.cublasSetWorkspace_v2(handle, ws[0], ws[1]))
        bound[1] = ws
    _check(function, getattr(lib, function)(handle, *args))


def _types_and_compute(ab_type, c_type, tf32):
    """cuBLAS's data types of A and B and of C, and its compute type: float32
    sums, TF32's fast ones (tf32 None follows the math mode) only where A and
    B are float32."""
    if tf32 is None:
        tf32 = mathmode.tf32()
    ta, tc = _DATA_TYPES[str(ab_type)], _DATA_TYPES[str(c_type)]
    compute = _COMPUTE_32F_FAST_TF32 if tf32 and ta == _R_32F else _COMPUTE_32F
    return ta, tc, compute


def gemm(transa, transb, m, n, k, a, lda, b, ldb, c, ldc, beta=0.0, tf32=None, workspace=None,
         ab_type='float32', c_type='float32'):
    """C (m x n) = op(A) op(B) + beta C on device pointers (ints), column-major,
    on CuPy's current stream. beta is 0 or 1; tf32 None follows the math
    mode; `workspace` (pointer, bytes): on caffeplus's handle, there.
    `ab_type`, `c_type`: 'float32', 'float16' or 'bfloat16' (A and B 16-bit run on the
    tensor cores; the sums are float32 always)."""
    ta, tc, compute = _types_and_compute(ab_type, c_type, tf32)
    workspace = _workspace(workspace)
    if workspace is not None:
        _on_workspace(workspace, 'cublasGemmEx', transa, transb, int(m), int(n), int(k),
                      _SCALARS[1.0], a, ta, int(lda), b, ta, int(ldb),
                      _SCALARS[float(beta)], c, tc, int(ldc), compute, _GEMM_DEFAULT)
        return
    lib = _lib()
    lib.gemmEx(_handle(), transa, transb, int(m), int(n), int(k), _SCALARS[1.0], a, ta,
               int(lda), b, ta, int(ldb), _SCALARS[float(beta)], c, tc, int(ldc),
               compute, _GEMM_DEFAULT)


def gemm_strided_batched(transa, transb, m, n, k, a, lda, stride_a, b, ldb, stride_b, c, ldc,
                         stride_c, batch, beta=0.0, tf32=None, workspace=None,
                         ab_type='float32', c_type='float32'):
    """C_i = op(A_i) op(B_i) + beta C_i for i < batch, X_i = X + i * stride_x
    (elements; a stride of 0 shares the matrix); as gemm() otherwise."""
    ta, tc, compute = _types_and_compute(ab_type, c_type, tf32)
    workspace = _workspace(workspace)
    if workspace is not None:
        _on_workspace(workspace, 'cublasGemmStridedBatchedEx', transa, transb, int(m), int(n),
                      int(k), _SCALARS[1.0], a, ta, int(lda), int(stride_a), b, ta,
                      int(ldb), int(stride_b), _SCALARS[float(beta)], c, tc, int(ldc),
                      int(stride_c), int(batch), compute, _GEMM_DEFAULT)
        return
    lib = _lib()
    lib.gemmStridedBatchedEx(
        _handle(), transa, transb, int(m), int(n), int(k), _SCALARS[1.0], a, ta, int(lda),
        int(stride_a), b, ta, int(ldb), int(stride_b), _SCALARS[float(beta)], c, tc,
        int(ldc), int(stride_c), int(batch), compute, _GEMM_DEFAULT)
