"""Typed wrappers over cuDNN: handles, descriptors and the calls layers use.

Descriptors are owned objects: created in __init__, destroyed when the owner
lets go of them (layers build them at reshape, never per call).

Replays: cuDNN 9's legacy calls cost 30-150 us of host time each inside
cuDNN (measured on an H100 with the arguments built once: an empty ctypes
call costs 0.2 us), often more than the kernels they launch, so a net of
small convolutions (GoogLeNet) waits on the host. A layer therefore hands
each group of its cuDNN calls to a Replays object with a key naming
everything the launch depends on (device pointers, algorithms, workspace,
scalars); the second time a key comes, its calls are captured into a CUDA
graph, which from then on is launched instead (a few microseconds), the
same kernels with the same arguments.
"""
import ctypes
import weakref

from caffeplus.cudnn.lib import BwdDataPerf, BwdFilterPerf, FwdPerf, call, library
from caffeplus.errors import CaffeplusError

FLOAT = 0                  # CUDNN_DATA_FLOAT
HALF = 2                   # CUDNN_DATA_HALF
BFLOAT16 = 9               # CUDNN_DATA_BFLOAT16
_DATA_TYPES = {'float32': FLOAT, 'float16': HALF, 'bfloat16': BFLOAT16}
NCHW, NHWC = 0, 1          # cudnnTensorFormat_t
CROSS_CORRELATION = 1      # Caffe's convolution is a cross-correlation
DEFAULT_MATH, TENSOR_OP_MATH, TENSOR_OP_MATH_ALLOW_CONVERSION, FMA_MATH = 0, 1, 2, 3
POOL_MAX, POOL_AVG_INCLUDE_PAD, POOL_AVG_EXCLUDE_PAD, POOL_MAX_DETERMINISTIC = 0, 1, 2, 3
ACT_SIGMOID, ACT_RELU, ACT_TANH, ACT_CLIPPED_RELU, ACT_ELU = 0, 1, 2, 3, 4
SOFTMAX_ACCURATE, SOFTMAX_MODE_CHANNEL = 1, 1
LRN_CROSS_CHANNEL = 0
NOT_PROPAGATE_NAN = 0
DETERMINISTIC = 1

FWD_ALGO_NAMES = ['IMPLICIT_GEMM', 'IMPLICIT_PRECOMP_GEMM', 'GEMM', 'DIRECT', 'FFT',
                  'FFT_TILING', 'WINOGRAD', 'WINOGRAD_NONFUSED']
BWD_DATA_ALGO_NAMES = ['ALGO_0', 'ALGO_1', 'FFT', 'FFT_TILING', 'WINOGRAD', 'WINOGRAD_NONFUSED']
BWD_FILTER_ALGO_NAMES = ['ALGO_0', 'ALGO_1', 'FFT', 'ALGO_3', 'WINOGRAD', 'WINOGRAD_NONFUSED',
                         'FFT_TILING']
ALGO_COUNTS = {'fwd': 8, 'bwd_data': 6, 'bwd_filter': 7}

_ONE = ctypes.c_float(1.0)
_ZERO = ctypes.c_float(0.0)
ONE, ZERO = ctypes.addressof(_ONE), ctypes.addressof(_ZERO)


def ptr(array):
    """Device pointer of a CuPy array, or an int address (None for NULL)."""
    if array is None:
        return None
    if isinstance(array, int):
        return ctypes.c_void_p(array)
    return ctypes.c_void_p(array.data.ptr)


def _ints(values):
    values = [int(v) for v in values]
    return (ctypes.c_int * len(values))(*values)


class _Owned:
    _create = _destroy = None

    def __init__(self):
        self.value = ctypes.c_void_p()
        call(self._create, ctypes.byref(self.value))
        self._lib = library()

    def __del__(self):
        v = getattr(self, 'value', None)
        if v is not None and v.value:
            try:
                getattr(self._lib, self._destroy)(v)
            except Exception:
                pass
            self.value = None

    @property
    def _as_parameter_(self):
        return self.value


class Handle(_Owned):
    _create, _destroy = 'cudnnCreate', 'cudnnDestroy'

    bound_stream = None

    def bind(self, stream_ptr):
        # cudnnSetStream costs a ctypes round trip; most calls stay on one stream.
        if stream_ptr != self.bound_stream:
            call('cudnnSetStream', self.value, ctypes.c_void_p(stream_ptr))
            self.bound_stream = stream_ptr
        return self


_handles = {}


def handle():
    """The cuDNN handle of the current device, bound to CuPy's current stream."""
    import cupy
    dev = cupy.cuda.runtime.getDevice()
    h = _handles.get(dev)
    if h is None:
        h = _handles[dev] = Handle()
    return h.bind(cupy.cuda.get_current_stream().ptr)


def data_type(dtype):
    """cuDNN's data type for a NumPy dtype or type (float32, float16 or
    ml_dtypes' bfloat16; None: float32)."""
    import numpy
    name = 'float32' if dtype is None else numpy.dtype(dtype).name
    try:
        return _DATA_TYPES[name]
    except KeyError:
        raise CaffeplusError('cuDNN descriptors here take float32, float16 or bfloat16, not %s'
                             % name) from None


class TensorDesc(_Owned):
    _create, _destroy = 'cudnnCreateTensorDescriptor', 'cudnnDestroyTensorDescriptor'

    def __init__(self, shape, strides=None, dtype=None):
        super().__init__()
        self.dtype = data_type(dtype)
        shape = [int(d) for d in shape]
        strides = None if strides is None else [int(s) for s in strides]
        while len(shape) < 4:           # cuDNN wants at least 4 dims
            shape.append(1)
            if strides is not None:
                strides.append(1)
        if strides is None:
            strides, acc = [], 1
            for d in reversed(shape):
                strides.insert(0, acc)
                acc *= d
        self.shape = tuple(shape)
        call('cudnnSetTensorNdDescriptor', self.value, self.dtype, len(shape), _ints(shape),
             _ints(strides))


class FilterDesc(_Owned):
    """Filters of `shape` (K, C, kh, kw...), stored in `layout`: NCHW (Caffe's
    K C kh kw order) or NHWC (K kh kw C, what cuDNN's channels-last kernels read)."""
    _create, _destroy = 'cudnnCreateFilterDescriptor', 'cudnnDestroyFilterDescriptor'

    def __init__(self, shape, dtype=None, layout=NCHW):
        super().__init__()
        shape = [int(d) for d in shape]
        while len(shape) < 4:
            shape.append(1)
        self.shape = tuple(shape)
        call('cudnnSetFilterNdDescriptor', self.value, data_type(dtype), int(layout), len(shape),
             _ints(shape))


def nhwc_strides(shape):
    """Strides (in values) of a (N, C, spatial...) tensor stored channels
    last: the logical shape stays NCHW, as cuDNN's Nd descriptors take it."""
    c, spatial = int(shape[1]), [int(d) for d in shape[2:]]
    inner = [1] * len(spatial)
    acc = c
    for i in range(len(spatial) - 1, -1, -1):
        inner[i] = acc
        acc *= spatial[i]
    return [acc, 1] + inner


class ConvDesc(_Owned):
    _create, _destroy = 'cudnnCreateConvolutionDescriptor', 'cudnnDestroyConvolutionDescriptor'

    def __init__(self, pad, stride, dilation, groups=1, math=FMA_MATH):
        super().__init__()
        pad, stride, dilation = list(pad), list(stride), list(dilation)
        if len(pad) == 1:   # cuDNN needs 2 spatial dims at least
            pad, stride, dilation = pad + [0], stride + [1], dilation + [1]
        call('cudnnSetConvolutionNdDescriptor', self.value, len(pad), _ints(pad), _ints(stride),
             _ints(dilation), CROSS_CORRELATION, FLOAT)
        if groups > 1:
            call('cudnnSetConvolutionGroupCount', self.value, int(groups))
        call('cudnnSetConvolutionMathType', self.value, int(math))


class PoolDesc(_Owned):
    _create, _destroy = 'cudnnCreatePoolingDescriptor', 'cudnnDestroyPoolingDescriptor'

    def __init__(self, mode, window, pad, stride):
        super().__init__()
        call('cudnnSetPoolingNdDescriptor', self.value, int(mode), NOT_PROPAGATE_NAN, len(window),
             _ints(window), _ints(pad), _ints(stride))


class ActivationDesc(_Owned):
    _create, _destroy = 'cudnnCreateActivationDescriptor', 'cudnnDestroyActivationDescriptor'

    def __init__(self, mode, coef=0.0):
        super().__init__()
        call('cudnnSetActivationDescriptor', self.value, int(mode), NOT_PROPAGATE_NAN, float(coef))


class LRNDesc(_Owned):
    _create, _destroy = 'cudnnCreateLRNDescriptor', 'cudnnDestroyLRNDescriptor'

    def __init__(self, n, alpha, beta, k):
        super().__init__()
        call('cudnnSetLRNDescriptor', self.value, int(n), float(alpha), float(beta), float(k))


# -- convolution algorithms ---------------------------------------------------
_KIND = {
    'fwd': ('cudnnGetConvolutionForwardAlgorithm_v7', 'cudnnFindConvolutionForwardAlgorithmEx',
            'cudnnGetConvolutionForwardWorkspaceSize', FwdPerf, FWD_ALGO_NAMES),
    'bwd_data': ('cudnnGetConvolutionBackwardDataAlgorithm_v7',
                 'cudnnFindConvolutionBackwardDataAlgorithmEx',
                 'cudnnGetConvolutionBackwardDataWorkspaceSize', BwdDataPerf, BWD_DATA_ALGO_NAMES),
    'bwd_filter': ('cudnnGetConvolutionBackwardFilterAlgorithm_v7',
                   'cudnnFindConvolutionBackwardFilterAlgorithmEx',
                   'cudnnGetConvolutionBackwardFilterWorkspaceSize', BwdFilterPerf,
                   BWD_FILTER_ALGO_NAMES),
}


class AlgoChoice:
    """One candidate algorithm of one call site: id, workspace bytes, time,
    the math type cuDNN ran it with (the convolution descriptor must carry
    that type when the algorithm runs) and the variant: 0 for one call over
    all groups, 1 for one call per group (a grouped convolution), 2 for
    caffeplus's cuBLAS GEMM (after im2col but for 1x1) instead of cuDNN, 3, 4 and 5 for one
    call per half, quarter and eighth of the batch, 6 for a stride-1 call over
    space-to-depth blocks (algo_search.py)."""
    __slots__ = ('kind', 'algo', 'memory', 'time', 'deterministic', 'math', 'variant')

    def __init__(self, kind, algo, memory, time, deterministic, math, variant=0):
        self.kind, self.algo, self.memory, self.time = kind, algo, memory, time
        self.deterministic, self.math, self.variant = deterministic, math, variant

    @property
    def name(self):
        if self.variant == 2:
            return 'CUBLAS_GEMM'        # im2col + GEMM, or GEMM alone for 1x1 (layers/conv_gemm.py)
        if self.variant == 6:           # layers/conv_s2d.py: its inner call's algorithm
            return _KIND[self.kind][4][s2d_parts(self.algo)[1]]
        return _KIND[self.kind][4][self.algo]

    def __repr__(self):
        variant = _VARIANT_NAMES.get(self.variant, '')
        if self.variant == 6:
            variant += _SLICE_NAMES.get(s2d_parts(self.algo)[0], '')
        return '<%s %s%s math=%d ws=%d t=%.3fms>' % (
            self.kind, self.name, variant, self.math, self.memory, self.time)


def s2d_parts(algo):
    """(batch slices, cuDNN's algorithm of the inner call) of a space-to-depth
    choice's algo, S2D_ALGO + 10 log2(slices) + the algorithm (layers/conv_s2d.py)."""
    j, inner = divmod(int(algo) % 100, 10)
    return 2 ** j, inner


_VARIANT_NAMES = {1: '/per-group', 3: '/halves', 4: '/quarters', 5: '/eighths',
                  6: '/space-to-depth'}
_SLICE_NAMES = {2: '/halves', 4: '/quarters', 8: '/eighths'}


def _descs(kind, x, w, conv, y):
    """The descriptor order each cuDNN query takes."""
    if kind == 'fwd':
        return (x, w, conv, y)
    if kind == 'bwd_data':
        return (w, y, conv, x)
    return (x, y, conv, w)


def heuristic_algorithms(kind, x, w, conv, y, conv_for_math=None):
    """Candidates from cuDNN's heuristics (no timing), best first. Each
    candidate's workspace is asked for under its own math type, through
    conv_for_math(math) -> ConvDesc where given."""
    get_name, _, ws_name, perf_t, _ = _KIND[kind]
    count = 2 * ALGO_COUNTS[kind]       # room for each algorithm under two math types
    perfs = (perf_t * count)()
    returned = ctypes.c_int()
    h = handle()
    call(get_name, h.value, *[d.value for d in _descs(kind, x, w, conv, y)], count,
         ctypes.byref(returned), perfs)
    out = []
    for p in perfs[:returned.value]:
        if p.status != 0:
            continue
        c = conv if conv_for_math is None else conv_for_math(p.mathType)
        out.append(AlgoChoice(kind, p.algo, workspace_size(kind, x, w, c, y, p.algo),
                              p.time, p.determinism == DETERMINISTIC, p.mathType))
    return out


def timed_algorithms(kind, x, w, conv, y, xa, wa, ya, workspace, workspace_bytes):
    """Candidates timed by cuDNN on real buffers (FindEx), fastest first.
    Writes into the output buffer (ya for fwd, xa for bwd_data, wa for bwd_filter)."""
    _, find_name, _, perf_t, _ = _KIND[kind]
    count = 2 * ALGO_COUNTS[kind]
    perfs = (perf_t * count)()
    returned = ctypes.c_int()
    h = handle()
    if kind == 'fwd':
        args = (x.value, ptr(xa), w.value, ptr(wa), conv.value, y.value, ptr(ya))
    elif kind == 'bwd_data':
        args = (w.value, ptr(wa), y.value, ptr(ya), conv.value, x.value, ptr(xa))
    else:
        args = (x.value, ptr(xa), y.value, ptr(ya), conv.value, w.value, ptr(wa))
    call(find_name, h.value, *args, count, ctypes.byref(returned), perfs,
         ptr(workspace) if workspace is not None else None, ctypes.c_size_t(workspace_bytes))
    return [AlgoChoice(kind, p.algo, p.memory, p.time, p.determinism == DETERMINISTIC, p.mathType)
            for p in perfs[:returned.value] if p.status == 0]


def workspace_size(kind, x, w, conv, y, algo):
    _, _, ws_name, _, _ = _KIND[kind]
    size = ctypes.c_size_t()
    call(ws_name, handle().value, *[d.value for d in _descs(kind, x, w, conv, y)], int(algo),
         ctypes.byref(size))
    return size.value


def conv_forward(x, xa, w, wa, conv, algo, ws, ws_bytes, y, ya, beta=0.0):
    b = ctypes.c_float(beta)
    call('cudnnConvolutionForward', handle().value, ONE, x.value, ptr(xa), w.value, ptr(wa),
         conv.value, int(algo), ptr(ws) if ws is not None else None, ctypes.c_size_t(ws_bytes),
         ctypes.byref(b), y.value, ptr(ya))


def conv_backward_data(w, wa, y, dya, conv, algo, ws, ws_bytes, x, dxa, beta=0.0):
    b = ctypes.c_float(beta)
    call('cudnnConvolutionBackwardData', handle().value, ONE, w.value, ptr(wa), y.value, ptr(dya),
         conv.value, int(algo), ptr(ws) if ws is not None else None, ctypes.c_size_t(ws_bytes),
         ctypes.byref(b), x.value, ptr(dxa))


def conv_backward_filter(x, xa, y, dya, conv, algo, ws, ws_bytes, w, dwa, beta=1.0):
    b = ctypes.c_float(beta)
    call('cudnnConvolutionBackwardFilter', handle().value, ONE, x.value, ptr(xa), y.value, ptr(dya),
         conv.value, int(algo), ptr(ws) if ws is not None else None, ctypes.c_size_t(ws_bytes),
         ctypes.byref(b), w.value, ptr(dwa))


def conv_backward_bias(y, dya, bias, dba, beta=1.0):
    b = ctypes.c_float(beta)
    call('cudnnConvolutionBackwardBias', handle().value, ONE, y.value, ptr(dya), ctypes.byref(b),
         bias.value, ptr(dba))


def add_tensor(bias, ba, y, ya):
    call('cudnnAddTensor', handle().value, ONE, bias.value, ptr(ba), ONE, y.value, ptr(ya))


def pooling_forward(pool, x, xa, y, ya):
    call('cudnnPoolingForward', handle().value, pool.value, ONE, x.value, ptr(xa), ZERO, y.value,
         ptr(ya))


def pooling_backward(pool, y, ya, dya, x, xa, dxa):
    call('cudnnPoolingBackward', handle().value, pool.value, ONE, y.value, ptr(ya), y.value,
         ptr(dya), x.value, ptr(xa), ZERO, x.value, ptr(dxa))


def activation_forward(act, x, xa, ya):
    call('cudnnActivationForward', handle().value, act.value, ONE, x.value, ptr(xa), ZERO, x.value,
         ptr(ya))


def activation_backward(act, x, ya, dya, xa, dxa):
    call('cudnnActivationBackward', handle().value, act.value, ONE, x.value, ptr(ya), x.value,
         ptr(dya), x.value, ptr(xa), ZERO, x.value, ptr(dxa))


def softmax_forward(x, xa, ya):
    call('cudnnSoftmaxForward', handle().value, SOFTMAX_ACCURATE, SOFTMAX_MODE_CHANNEL, ONE,
         x.value, ptr(xa), ZERO, x.value, ptr(ya))


def softmax_backward(x, ya, dya, dxa):
    call('cudnnSoftmaxBackward', handle().value, SOFTMAX_ACCURATE, SOFTMAX_MODE_CHANNEL, ONE,
         x.value, ptr(ya), x.value, ptr(dya), ZERO, x.value, ptr(dxa))


def lrn_forward(lrn, x, xa, ya):
    call('cudnnLRNCrossChannelForward', handle().value, lrn.value, LRN_CROSS_CHANNEL, ONE, x.value,
         ptr(xa), ZERO, x.value, ptr(ya))


def lrn_backward(lrn, x, ya, dya, xa, dxa):
    call('cudnnLRNCrossChannelBackward', handle().value, lrn.value, LRN_CROSS_CHANNEL, ONE,
         x.value, ptr(ya), x.value, ptr(dya), x.value, ptr(xa), ZERO, x.value, ptr(dxa))


# -- CUDA-graph replays of cuDNN calls --------------------------------------------
# Whether cuDNN calls replay as CUDA graphs unless set_graphs says otherwise.
GRAPHS = True
_graphs = {'on': None, 'streams': {}, 'captured': 0, 'failed': 0, 'launched': 0}


def graphs_enabled():
    """Replays on (GRAPHS, the default) unless set_graphs(False)."""
    on = _graphs['on']
    if on is None:
        on = _graphs['on'] = bool(GRAPHS)
    return on


def set_graphs(on):
    """Turn replays on or off (None: back to GRAPHS); returns the previous state."""
    previous = graphs_enabled()
    _graphs['on'] = None if on is None else bool(on)
    return previous


def graph_stats():
    """{'captured', 'failed', 'launched'} since the process started (tests, profiles)."""
    return {k: _graphs[k] for k in ('captured', 'failed', 'launched')}


_BUSY = object()
_owners = weakref.WeakSet()        # every Replays made (clear_replays)


def clear_replays():
    """Drop every captured graph (caffeplus.memory.thread_stack.settle): the
    next calls run directly and are captured again."""
    for owner in list(_owners):
        owner.clear()


def _capture(issue):
    """issue()'s calls captured into a CUDA graph on a side stream; None if
    they cannot be (the caller runs them directly), _BUSY if the current
    stream is itself capturing (the calls belong in that capture)."""
    import cupy
    try:
        if cupy.cuda.get_current_stream().is_capturing():
            return _BUSY
    except Exception:
        return _BUSY
    dev = cupy.cuda.runtime.getDevice()
    stream = _graphs['streams'].get(dev)
    if stream is None:
        stream = _graphs['streams'][dev] = cupy.cuda.Stream(non_blocking=True)
    graph = None
    try:
        with stream:        # handle() binds cuDNN to the capturing stream
            stream.begin_capture()      # relaxed mode: other threads' calls stay legal
            try:
                issue()
            finally:
                graph = stream.end_capture()
    except Exception:       # not capturable (or a real error: the direct call raises it)
        _graphs['failed'] += 1
        return None
    _graphs['captured'] += 1
    return graph


class Replays:
    """The CUDA graphs of one owner's cuDNN calls (see the module's docstring).

    run(key, issue): issue() makes the calls through handle(); `key` holds
    every value the calls read (pointers, algorithms, workspace, scalars)
    beside the owner's descriptors, which never change once built (a new
    geometry makes a new owner). A key seen once runs directly; the second
    time it is captured and launched; then launched. At most MAX graphs are
    kept (the oldest goes); an owner whose calls do not capture runs them
    directly from then on."""
    MAX = 8
    __slots__ = ('graphs', 'seen', 'off', '__weakref__')

    def __init__(self):
        self.graphs = {}
        self.seen = set()
        self.off = False
        _owners.add(self)

    def run(self, key, issue):
        if not (_graphs['on'] if _graphs['on'] is not None else graphs_enabled()) or self.off:
            return issue()
        graph = self.graphs.get(key)
        if graph is None:
            if key not in self.seen:
                if len(self.seen) >= 4 * self.MAX:
                    self.seen.clear()
                self.seen.add(key)
                return issue()
            graph = _capture(issue)
            if graph is None:
                self.off = True
                return issue()
            if graph is _BUSY:
                return issue()
            self.seen.discard(key)
            if len(self.graphs) >= self.MAX:
                del self.graphs[next(iter(self.graphs))]
            self.graphs[key] = graph
        graph.launch()
        _graphs['launched'] += 1

    def clear(self):
        self.graphs.clear()
        self.seen.clear()
