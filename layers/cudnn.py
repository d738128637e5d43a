"""cuDNN engines for the layers cuDNN has: Convolution, Deconvolution,
Pooling, LRN, Softmax, ReLU, Sigmoid, TanH, ELU.

Each class here subclasses the generic layer and is registered with
caffeplus.layer.register_engine('CUDNN'): create_layer picks it when the
layer's engine is DEFAULT or CUDNN (engine: CAFFE keeps the generic class).
With NumPy arrays (CPU mode), or a configuration cuDNN does not cover, every
method falls back to the parent's generic code, so CPU results are the
generic layer's, bit for bit. With CuPy arrays the math goes to cuDNN.

Descriptors are built at reshape (cached by shape, so the net's reshape
before every forward costs a dict lookup), never per call. Convolution
workspace comes from the layer's workspace manager (caffeplus.memory.
workspace): the net's arena, or under plan 'stock' the layer's own buffer,
with the groups run one cuDNN call each, as in Caffe 1.0.

Where cuDNN disagrees with Caffe, the generic CuPy path runs instead:
  * Pooling whose Caffe output shape (ceil rule) differs from cuDNN's floor
    rule, STOCHASTIC pooling, and MAX pooling with the mask top;
  * LRN WITHIN_CHANNEL, or parameters outside cuDNN's ranges;
  * ReLU with a negative slope; ELU computed in place (cuDNN's ELU backward
    reads the bottom, which in place is gone);
  * convolutions with more than 3 spatial axes or the channel axis not 1.
"""
import functools
import os

import numpy

from caffeplus import backend, log
from caffeplus import kernels as _kernels
from caffeplus.backend import blas, mathmode
from caffeplus.cudnn import api
from caffeplus.errors import CaffeplusError
from caffeplus.layer import register_engine
from caffeplus.memory import scratch
from caffeplus.layers.common import (ConcatLayer, EltwiseLayer, InnerProductLayer, SoftmaxLayer,
                                     SplitLayer)
from caffeplus.layers.neuron import ELULayer, ReLULayer, SigmoidLayer, TanHLayer
from caffeplus.layers.loss import SoftmaxWithLossLayer
from caffeplus.layers.normalization import BatchNormLayer, ScaleLayer, _same_data
from caffeplus.layers.vision import (AVE, MAX, ConvolutionLayer, DeconvolutionLayer,
                                     LRNLayer, PoolingLayer)
from caffeplus.proto import caffe_pb2

READS_BOTH = frozenset(('bottom_data', 'top_data'))
F32 = numpy.float32
_ELTWISE_SUM = caffe_pb2.EltwiseParameter.SUM
FLOAT_BYTES = 4
CUDNN_ENGINE = 2
_status = {'available': None, 'warned': False}


def _is_cupy(*arrays):
    return all(type(a).__module__.startswith('cupy') for a in arrays)


def cudnn_available():
    if _status['available'] is None:
        from caffeplus.cudnn import lib
        _status['available'] = lib.available()
    return _status['available']


def _prod(shape):
    n = 1
    for d in shape:
        n *= int(d)
    return n


def _contiguous_strides(shape):
    strides, acc = [], 1
    for d in reversed(shape):
        strides.insert(0, acc)
        acc *= int(d)
    return strides


def _as4d(shape):
    """A blob shape as cuDNN's (N, C, H, W): trailing axes folded, 1s added."""
    shape = [int(d) for d in shape] or [1]
    if len(shape) > 4:
        shape = shape[:3] + [_prod(shape[3:])]
    while len(shape) < 4:
        shape.append(1)
    return tuple(shape)


# cuDNN's tensor descriptors index with 32-bit ints. Convolution and pooling
# run larger blobs in equal slices of the batch that fit (batch_slices), one
# cuDNN call per slice; the other layers run them generically.
MAX_CUDNN_COUNT = 2 ** 31 - 1


def _fits(*shapes):
    return all(_prod(s) <= MAX_CUDNN_COUNT for s in shapes)


def batch_slices(num, *item_shapes):
    """How many equal slices of a batch of `num` items, each item of the
    given shapes (one image's tensors), each cuDNN call must run over so
    that every tensor of a call fits MAX_CUDNN_COUNT: 1 when the whole
    batch does, the fewest dividing `num` otherwise, None when one item
    alone does not fit."""
    per = max([_prod(s) for s in item_shapes] + [1])
    if per > MAX_CUDNN_COUNT or num < 1:
        return None
    if num * per <= MAX_CUDNN_COUNT:
        return 1
    for k in range(2, num + 1):
        if num % k == 0 and (num // k) * per <= MAX_CUDNN_COUNT:
            return k
    return None


def _addr(array, offset_bytes=0):
    return int(array.data.ptr) + int(offset_bytes)


class _CudnnMixin:
    """Shared by every cuDNN layer: the decision to use cuDNN."""
    engine = 'CUDNN'

    def _explicit_cudnn(self):
        field = {'Convolution': 'convolution_param', 'Deconvolution': 'convolution_param',
                 'Pooling': 'pooling_param', 'LRN': 'lrn_param', 'ReLU': 'relu_param',
                 'Sigmoid': 'sigmoid_param', 'TanH': 'tanh_param',
                 'Softmax': 'softmax_param'}.get(self.layer_param.type)
        return field is not None and self.layer_param.HasField(field) and \
            getattr(self.layer_param, field).engine == CUDNN_ENGINE

    def _cudnn_usable(self, *arrays):
        """CuPy arrays and a loadable cuDNN (engine: CUDNN without one is an error)."""
        if not _is_cupy(*arrays):
            return False
        if cudnn_available():
            return True
        if self._explicit_cudnn():
            from caffeplus.cudnn import lib
            lib.library()           # raises the error that names what is missing
        if not _status['warned']:
            _status['warned'] = True
            log.warning('cuDNN was not found: GPU layers run their generic CuPy code. %s',
                        _missing_cudnn_hint())
        return False

    @staticmethod
    def _gpu_mode():
        return backend.mode() == backend.GPU


def _missing_cudnn_hint():
    try:
        from caffeplus.cudnn import lib
        lib.library()
    except CaffeplusError as exc:
        return str(exc)
    return ''


# =============================================================================
# Convolution and Deconvolution
# =============================================================================
class _ConvDescs:
    """Descriptors of one convolution geometry in cuDNN's terms: conv-x is
    the convolution's input (the layer's bottom, or a Deconvolution's top),
    conv-y its output. With `split` each group is its own call on
    channel-sliced, full-stride descriptors, as Caffe 1.0 does (plan stock;
    under timed search also an alternative the arena may choose per call
    site when it is faster than cuDNN's grouped convolution).

    The convolution descriptor carries the math type: FMA in strict mode;
    in TF32 mode the type cuDNN timed the chosen algorithm with (conv_for),
    as cuDNN asks (an algorithm found under TENSOR_OP_MATH may have run
    with DEFAULT_MATH). `replays` holds the CUDA graphs of this geometry's
    calls (caffeplus.cudnn.api.Replays).

    With `chunks` > 1 each call runs over the batch in that many slices of
    num / chunks images (the filter and bias gradients accumulate, beta 1):
    the same algorithm on a smaller batch needs less workspace (Winograd's
    and FFT's transforms grow with the batch), so a fast algorithm can fit
    where the whole batch's workspace would raise the peak."""

    def __init__(self, layer, split, chunks=1):
        n = layer.num
        if layer.reverse:
            xsp, ysp, cx, cy = layer.out_spatial, layer.in_spatial, layer.num_output, layer.channels
        else:
            xsp, ysp, cx, cy = layer.in_spatial, layer.out_spatial, layer.channels, layer.num_output
        group = layer.group
        G = group if split else 1
        nc = n // chunks
        x_full = (n, cx) + tuple(xsp)
        y_full = (n, cy) + tuple(ysp)
        self.x_full, self.y_full = x_full, y_full
        self.x = api.TensorDesc((nc, cx // G) + tuple(xsp), _contiguous_strides(x_full))
        self.y = api.TensorDesc((nc, cy // G) + tuple(ysp), _contiguous_strides(y_full))
        w_shape = tuple(layer.blobs[0].shape)
        self.w_shape = w_shape
        self.w = api.FilterDesc((w_shape[0] // G,) + tuple(w_shape[1:]))
        geom = layer.geom
        self.math = mathmode.cudnn_math_type()
        self._conv_args = (tuple(geom.pad), tuple(geom.stride), tuple(geom.dilation), group // G)
        self.conv = api.ConvDesc(*self._conv_args, math=self.math)
        self._convs = {self.math: self.conv}
        m = layer.num_output
        # Each of the `loops` calls reads and writes at these byte offsets
        # from the last: the next group's channels, or the next batch slice
        # (the same filter and bias).
        self.batch_chunks = chunks
        if chunks > 1:
            self.loops = chunks
            self.x_off = nc * cx * _prod(xsp) * FLOAT_BYTES
            self.y_off = nc * cy * _prod(ysp) * FLOAT_BYTES
            self.w_off = self.b_off = 0
        else:
            self.loops = G
            self.x_off = (cx // G) * _prod(xsp) * FLOAT_BYTES
            self.y_off = (cy // G) * _prod(ysp) * FLOAT_BYTES
            self.w_off = (_prod(w_shape) // G) * FLOAT_BYTES
            self.b_off = (m // G) * FLOAT_BYTES
        self.bias = api.TensorDesc((1, m // G) + (1,) * len(geom.kernel)) \
            if layer.bias_term else None
        self.top = self.x if layer.reverse else self.y
        self.top_off = self.x_off if layer.reverse else self.y_off
        self.top_full = x_full if layer.reverse else y_full
        self.bias_part = None       # _bias_gradient's partial sums
        self.replays = api.Replays()

    def conv_for(self, math):
        """The convolution descriptor to run an algorithm of math type `math`
        with: strict mode keeps FMA whatever cuDNN reports; TF32 mode takes
        DEFAULT or TENSOR_OP as the algorithm ran when it was found."""
        if self.math == api.FMA_MATH or math not in (api.DEFAULT_MATH, api.TENSOR_OP_MATH,
                                                     api.FMA_MATH):
            return self.conv
        c = self._convs.get(math)
        if c is None:
            c = self._convs[math] = api.ConvDesc(*self._conv_args, math=math)
        return c

    def candidates(self, kind):
        return api.heuristic_algorithms(kind, self.x, self.w, self.conv, self.y, self.conv_for)

    def timer(self, kind, geometry_key=None, per_group=None, gemm=None, chunked=None):
        """A callable that times `kind` with FindEx on scratch arrays. With a
        geometry key, results are shared by every layer of that geometry
        (ResNet-50 repeats most of its convolutions), as cudnn.benchmark does.
        `per_group` (the split descriptors of a grouped convolution) adds its
        candidates, variant 1, timed as one call per group; `gemm` (a
        _GemmConv) adds cuBLAS, variant 2, for the calls it makes;
        `chunked` ({variant: batch-sliced descriptors}) adds each slicing's
        candidates, timed as one call per slice."""
        chunked = chunked or {}
        # A sliced call touches its first slice only: scratch of one slice
        # (a batch too large for one call would double its bytes). (The
        # sliced variants come only with an unsliced primary: k 1.)
        k = self.batch_chunks
        scratch = ((self.x_full[0] // k,) + self.x_full[1:],
                   (self.y_full[0] // k,) + self.y_full[1:], self.w_shape)

        def run(ws_ptr, ws_bytes):
            # FindEx results hold for one math mode (TF32 or strict) only.
            key = None if geometry_key is None else \
                geometry_key + (kind, int(ws_bytes), mathmode.cudnn_math_type(),
                                self.batch_chunks, per_group is not None, gemm is not None,
                                tuple(sorted(chunked)))
            if key is not None:
                found = _timed_within(key, len(geometry_key) + 1)
                if found is not None:
                    return found
            import cupy
            xa, ya, wa = (cupy.random.standard_normal(shape, dtype=numpy.float32)
                          for shape in scratch)
            try:
                found = api.timed_algorithms(kind, self.x, self.w, self.conv, self.y, xa, wa, ya,
                                             ws_ptr or None, ws_bytes)
                for c in found:
                    c.time *= self.batch_chunks       # one call per slice
                if per_group is not None:
                    more = api.timed_algorithms(kind, per_group.x, per_group.w, per_group.conv,
                                                per_group.y, xa, wa, ya, ws_ptr or None, ws_bytes)
                    for c in more:
                        c.time *= per_group.loops
                        c.variant = 1
                    found = sorted(found + more, key=lambda c: c.time)
                for variant, sliced in sorted(chunked.items()):
                    more = api.timed_algorithms(kind, sliced.x, sliced.w, sliced.conv, sliced.y,
                                                xa, wa, ya, ws_ptr or None, ws_bytes)
                    for c in more:
                        c.time *= sliced.loops
                        c.variant = variant
                    found = sorted(found + more, key=lambda c: c.time)
                if gemm is not None and kind in gemm.kinds() and \
                        gemm.memory(kind) <= ws_bytes:
                    # In the search's own workspace: one that would not fit is not timed.
                    t = gemm.time(kind, xa, wa, ya, ws_ptr)
                    found = sorted(found + [api.AlgoChoice(kind, GEMM_ALGO, gemm.memory(kind), t,
                                                           True, self.math, variant=2)],
                                   key=lambda c: c.time)
            finally:
                del xa, ya, wa
            if key is not None and found:
                _TIMED[key] = list(found)
            return found
        # What run() allocates besides the workspace (the workspace manager
        # keeps the search within the room a plan leaves: _time_sites).
        run.scratch_bytes = FLOAT_BYTES * sum(_prod(shape) for shape in scratch)
        if gemm is not None and kind == 'bwd_filter':
            run.scratch_bytes += FLOAT_BYTES * _prod(self.w_shape)     # its filter gradient
        # The workspace the cuBLAS variant is timed in (within the search's).
        run.variant_bytes = gemm.memory(kind) if gemm is not None and kind in gemm.kinds() else 0
        return run


# -- convolution as im2col + cuBLAS (variant 2 of a call site) -------------------
GEMM_ALGO = 100                 # AlgoChoice.algo of the im2col + GEMM variant
GEMM_MAX_CHANNELS = 4           # input channels up to which it is timed (image layers)
GEMM_CHUNK_BYTES = 256 << 20    # column buffer of one batch chunk, at most


def _gemm_1x1_search():
    """Whether timed search weighs cuBLAS for 1x1 stride-1 convolutions
    (_GemmConv.direct): on unless CAFFEPLUS_CUDNN_GEMM_1X1=0."""
    return os.environ.get('CAFFEPLUS_CUDNN_GEMM_1X1', '1').strip().lower() \
        not in ('0', 'off', 'false', 'no')


def _gemm_search():
    """Whether timed search also times im2col + GEMM for convolutions over
    few input channels: opt-in (CAFFEPLUS_CUDNN_GEMM=1). Checked correct on
    an H100 (tests/test_gpu_layers.py), but AlexNet's time did not move with
    it in the one benchmark run so far, and a chosen variant's column buffer
    (up to GEMM_CHUNK_BYTES) enlarges the arena."""
    return os.environ.get('CAFFEPLUS_CUDNN_GEMM', '0').strip().lower() \
        in ('1', 'on', 'true', 'yes')


class _DeviceOps:
    """What _GemmConv launches: cp_im2col and cuBLAS (device pointers as ints)."""

    @staticmethod
    def im2col(x, col, n0, nb, g):
        total = g.K * nb * g.P
        _kernels.kernel('cp_im2col')(
            _kernels.elementwise_grid(total), (_kernels.ELEMENTWISE_THREADS,),
            (numpy.uint64(x), numpy.uint64(col), numpy.uint64(total), _kernels.i32(n0),
             _kernels.i32(nb), _kernels.i32(g.c), _kernels.i32(g.h), _kernels.i32(g.w),
             _kernels.i32(g.kh), _kernels.i32(g.kw), _kernels.i32(g.oh), _kernels.i32(g.ow),
             _kernels.i32(g.sh), _kernels.i32(g.sw), _kernels.i32(g.ph), _kernels.i32(g.pw),
             _kernels.i32(g.dh), _kernels.i32(g.dw)))

    @staticmethod
    def gemm_strided_batched(*args, **kw):
        blas.gemm_strided_batched(*args, **kw)

    @staticmethod
    def gemm(*args, **kw):
        blas.gemm(*args, **kw)


class _GemmConv:
    """A 2-D convolution (group 1) as Caffe 1.0 computes it without cuDNN:
    im2col into the workspace, then cuBLAS, one batch chunk at a time.
    cuDNN's kernels are slow on the few input channels of an image net's
    first layer (AlexNet's conv1: 3 channels, 11x11, stride 4, most of its
    convolution time in cuDNN); timed search weighs this variant against
    cuDNN's algorithms for such layers.

    A 1x1 convolution of stride 1 without padding (`direct`: ResNet's
    bottlenecks) needs no im2col: each image's input is its own K x P
    column matrix. Its forward and data gradient are one strided-batched
    GEMM each, faster than cuDNN's best FP32 algorithm on most of
    ResNet-50's shapes on the H100 (tools/gemm_1x1_probe.py: forward
    1.3-2.1x, data gradient 1.0-1.9x); timed search weighs it for all three
    calls of every such layer.

    Column buffer: (K, B, P) for a chunk of B images, K = C*KH*KW, P =
    OH*OW, so image b's columns are a K x P matrix of leading dimension B*P.
      forward:  y_b (M x P) = W (M x K) col_b, one strided-batched GEMM;
      filter:   dW += sum_b dy_b col_b^T: a strided-batched GEMM into
                per-image partial products (after the columns in the
                workspace), summed into dW by one GEMM with a ones vector
                (beta = 1, FP32).
      data:     dx_b (K x P) = W^T dy_b (direct only), one strided-batched GEMM.
    (In cuBLAS's column-major terms each C-ordered r x c matrix is c x r.)"""

    def __init__(self, layer):
        g = layer.geom
        self.n, self.c = layer.num, layer.channels
        self.h, self.w = (int(d) for d in layer.in_spatial)
        self.m = layer.num_output
        self.kh, self.kw = (int(d) for d in g.kernel)
        self.sh, self.sw = (int(d) for d in g.stride)
        self.ph, self.pw = (int(d) for d in g.pad)
        self.dh, self.dw = (int(d) for d in g.dilation)
        self.oh, self.ow = (int(d) for d in layer.out_spatial)
        self.K = self.c * self.kh * self.kw
        self.P = self.oh * self.ow
        self.direct = self.is_direct(layer)
        if self.direct:     # no columns; partial filter gradients of B images
            self.B = max(1, min(self.n, GEMM_CHUNK_BYTES // max(1, self.m * self.K *
                                                                FLOAT_BYTES)))
            self.col_bytes = 0
        else:
            self.B = max(1, min(self.n, GEMM_CHUNK_BYTES //
                                max(1, self.K * self.P * FLOAT_BYTES)))
            self.col_bytes = -(-self.K * self.B * self.P * FLOAT_BYTES // 256) * 256
        self.part_bytes = self.B * self.m * self.K * FLOAT_BYTES
        self._ones = None

    @staticmethod
    def is_direct(layer):
        g = layer.geom
        return tuple(g.kernel) == (1, 1) and tuple(g.stride) == (1, 1) and \
            tuple(g.pad) == (0, 0) and tuple(g.dilation) == (1, 1)

    @staticmethod
    def eligible(layer):
        if layer.reverse or layer.group != 1 or layer.num_spatial != 2 or layer.num <= 0 or \
                _prod(layer.out_spatial) <= 0:
            return False
        if _GemmConv.is_direct(layer):
            return _gemm_1x1_search()
        return _gemm_search() and layer.channels <= GEMM_MAX_CHANNELS

    def kinds(self):
        """The calls this variant can make."""
        return ('fwd', 'bwd_data', 'bwd_filter') if self.direct else ('fwd', 'bwd_filter')

    def memory(self, kind):
        return self.col_bytes + (self.part_bytes if kind == 'bwd_filter' else 0)

    def _images(self, x, n0):
        """(A, lda, stride) of images n0.. as column-major P x K matrices."""
        return x + n0 * self.K * self.P * FLOAT_BYTES, self.P, self.K * self.P

    def chunks(self):
        for n0 in range(0, self.n, self.B):
            yield n0, min(self.B, self.n - n0)

    def forward(self, x, w, y, ws, tf32=None, ops=_DeviceOps):
        """y = conv(x, w) (no bias) on device pointers; ws: the column buffer."""
        M, K, P = self.m, self.K, self.P
        if self.direct:
            ops.gemm_strided_batched(blas.N, blas.N, P, M, K, x, P, K * P, w, K, 0, y, P, M * P,
                                     self.n, tf32=tf32)
            return
        for n0, nb in self.chunks():
            ops.im2col(x, ws, n0, nb, self)
            ops.gemm_strided_batched(blas.N, blas.N, P, M, K, ws, nb * P, P, w, K, 0,
                                     y + n0 * M * P * FLOAT_BYTES, P, M * P, nb, tf32=tf32)

    def backward_data(self, dy, w, dx, tf32=None, ops=_DeviceOps):
        """dx = the data gradient (direct only; written, as cuDNN's beta 0)."""
        M, K, P = self.m, self.K, self.P
        ops.gemm_strided_batched(blas.N, blas.T, P, K, M, dy, P, M * P, w, K, 0, dx, P, K * P,
                                 self.n, tf32=tf32)

    def ones(self, nb):
        if self._ones is None or self._ones.size < nb:
            import cupy
            self._ones = cupy.ones(max(int(nb), 1), dtype=numpy.float32)
        return int(self._ones.data.ptr)

    def backward_filter(self, x, dy, dw, ws, tf32=None, ops=_DeviceOps, ones=None):
        """dw += the filter gradient on device pointers; ws: columns, then partials."""
        M, K, P = self.m, self.K, self.P
        part = ws + self.col_bytes
        for n0, nb in self.chunks():
            if self.direct:
                a, lda, stride = self._images(x, n0)
            else:
                ops.im2col(x, ws, n0, nb, self)
                a, lda, stride = ws, nb * P, P
            ops.gemm_strided_batched(blas.T, blas.N, K, M, P, a, lda, stride,
                                     dy + n0 * M * P * FLOAT_BYTES, P, M * P, part, K, M * K, nb,
                                     tf32=tf32)
            ops.gemm(blas.N, blas.N, M * K, 1, nb, part, M * K,
                     ones if ones is not None else self.ones(nb), nb, dw, M * K, beta=1.0,
                     tf32=False)

    def time(self, kind, xa, wa, ya, wsp):
        """Milliseconds of one call of `kind` on scratch arrays (median of 3),
        in the workspace at device address `wsp` (at least memory(kind) bytes)."""
        import cupy
        wsp = int(wsp or 0)
        x, w, y = int(xa.data.ptr), int(wa.data.ptr), int(ya.data.ptr)
        if kind == 'fwd':
            def run():
                self.forward(x, w, y, wsp)
        elif kind == 'bwd_data':
            def run():
                self.backward_data(y, w, x)
        else:
            dw = cupy.zeros(wa.shape, dtype=numpy.float32)
            dwp = int(dw.data.ptr)

            def run():
                self.backward_filter(x, y, dwp, wsp)
        run()
        times = []
        for _ in range(3):
            e0, e1 = cupy.cuda.Event(), cupy.cuda.Event()
            e0.record()
            run()
            e1.record()
            e1.synchronize()
            times.append(cupy.cuda.get_elapsed_time(e0, e1))
        return sorted(times)[1]


def _dptr(blob, diff=False):
    """Device address of a blob's data (diff): its storage array, no views."""
    return int(_kernels.flat(blob, diff).data.ptr)


def _conv_forward_calls(cd, conv, algo, reverse, x, w, y, b, ws, nbytes):
    """One convolution forward (each group with `split` descriptors) and its bias."""
    ws = ws or None
    for g in range(cd.loops):
        if not reverse:
            api.conv_forward(cd.x, x + g * cd.x_off, cd.w, w + g * cd.w_off, conv, algo, ws,
                             nbytes, cd.y, y + g * cd.y_off)
        else:   # a Deconvolution's forward is the convolution's backward data
            api.conv_backward_data(cd.w, w + g * cd.w_off, cd.y, x + g * cd.y_off, conv, algo,
                                   ws, nbytes, cd.x, y + g * cd.x_off)
    if b:
        for g in range(cd.loops):
            api.add_tensor(cd.bias, b + g * cd.b_off, cd.top, y + g * cd.top_off)


def _bias_add_calls(cd, b, y):
    for g in range(cd.loops):
        api.add_tensor(cd.bias, b + g * cd.b_off, cd.top, y + g * cd.top_off)


_channel_sums_ok = [True]


def _bias_gradient(cd, dtop, db):
    """db += the top diff summed over batch and space, per output channel
    (beta 1), with caffeplus.kernels.channel_sums over the whole top: every
    group and batch slice at once. cudnnConvolutionBackwardBias's kernel
    (calc_bias_diff) took 2.1 of AlexNet's 9.2 ms a TF32 iteration on the
    H100 (tools/kernel_profile.py); it stays as the fallback."""
    if _channel_sums_ok[0]:
        # A top too large for one call is summed slice by slice (the kernel
        # indexes with 32-bit ints); each slice adds to db.
        pieces = cd.batch_chunks if _prod(cd.top_full) > MAX_CUDNN_COUNT else 1
        n, c = cd.top_full[0] // pieces, cd.top_full[1]
        s = _prod(cd.top_full[2:])
        p = _kernels.sum_blocks_per_channel(c, n * s)
        if cd.bias_part is None or cd.bias_part.size < c * p:
            cd.bias_part = _kernels.empty(c * p, numpy.float64)
        try:
            for g in range(pieces):
                _kernels.channel_sums(dtop + g * cd.top_off, cd.bias_part, db, n, c, s, p)
            return
        except Exception as exc:        # the extra module did not build here
            _channel_sums_ok[0] = False
            _kernels.note_failure('convolution bias gradient (cp_channel_sum)', exc)
    for g in range(cd.loops):
        api.conv_backward_bias(cd.top, dtop + g * cd.top_off, cd.bias, db + g * cd.b_off,
                               beta=1.0)


def _conv_params_calls(cd, conv, algo, reverse, x, dtop, dw, db, ws, nbytes):
    """The bias gradient (if db) and the filter gradient (if dw), accumulated (beta 1)."""
    if db:
        _bias_gradient(cd, dtop, db)
    if dw:
        ws = ws or None
        for g in range(cd.loops):
            if not reverse:
                api.conv_backward_filter(cd.x, x + g * cd.x_off, cd.y, dtop + g * cd.y_off, conv,
                                         algo, ws, nbytes, cd.w, dw + g * cd.w_off, beta=1.0)
            else:       # x is conv-y, the top conv-x
                api.conv_backward_filter(cd.x, dtop + g * cd.x_off, cd.y, x + g * cd.y_off, conv,
                                         algo, ws, nbytes, cd.w, dw + g * cd.w_off, beta=1.0)


def _conv_data_calls(cd, conv, algo, reverse, dtop, w, dx, ws, nbytes):
    """The bottom gradient."""
    ws = ws or None
    for g in range(cd.loops):
        if not reverse:
            api.conv_backward_data(cd.w, w + g * cd.w_off, cd.y, dtop + g * cd.y_off, conv, algo,
                                   ws, nbytes, cd.x, dx + g * cd.x_off)
        else:
            api.conv_forward(cd.x, dtop + g * cd.x_off, cd.w, w + g * cd.w_off, conv, algo, ws,
                             nbytes, cd.y, dx + g * cd.y_off)


# FindEx results by geometry (see _ConvDescs.timer).
_TIMED = {}
_BIAS_RELU = []


def _bias_relu():
    """y = max(y + b[channel], 0) in place (forward_then_relu)."""
    if not _BIAS_RELU:
        import cupy
        _BIAS_RELU.append(cupy.ElementwiseKernel(
            'raw float32 b, int64 spatial, int64 channels', 'float32 y',
            'float v = y + b[(i / spatial) % channels]; y = v > 0.0f ? v : 0.0f;',
            'cp_bias_relu'))
    return _BIAS_RELU[0]


def _timed_within(key, at):
    """FindEx's results for `key` (its workspace bytes at index `at`): its
    own, or those of the same search in a larger workspace less what needs
    more than this one, or else of the largest smaller one (plan auto times
    before it plans, in what the device spares then:
    caffeplus.memory.calibration.measure_net; timing again inside the placed
    arena would need the call's arrays twice). None: not timed yet."""
    if key in _TIMED:
        return list(_TIMED[key])
    ws = key[at]
    same = sorted((other[at], found) for other, found in _TIMED.items()
                  if len(other) == len(key) and other[:at] == key[:at] and
                  other[at + 1:] == key[at + 1:])
    for size, found in same:
        if size >= ws:
            return [c for c in found if c.memory <= ws] or None
    # Only smaller searches: their candidates, not more (timing again may
    # not fit beside the arena: a 12 GiB card under VGG-16 b256).
    return list(same[-1][1]) if same else None


def _workspace():
    from caffeplus.memory import workspace
    return workspace


# Batch slicings timed as variants of a call site: variant -> slices.
# Eighths (5): VGG-16's conv1_2 filter gradient, the arena's largest call
# within 3% of its fastest, needs 883 MiB over quarters of b64.
CHUNK_VARIANTS = {3: 2, 4: 4, 5: 8}


def _switched_on(variable):
    """An on-by-default switch: off when the variable says 0/off/false/no."""
    return os.environ.get(variable, '1').strip().lower() not in ('0', 'off', 'false', 'no')


def _chunk_search():
    """Whether timed search also times each call over halves, quarters and eighths
    of the batch (CAFFEPLUS_CUDNN_CHUNKS=0 turns it off)."""
    return _switched_on('CAFFEPLUS_CUDNN_CHUNKS')


def _per_group_search():
    """Whether timed search also times grouped convolutions one call per
    group (CAFFEPLUS_CUDNN_PER_GROUP=0 turns it off)."""
    return _switched_on('CAFFEPLUS_CUDNN_PER_GROUP')


def search_default():
    """The algorithm search a convolution uses when workspace.set_search was
    left at 'heuristic': CAFFEPLUS_CUDNN_SEARCH = heuristic (the default),
    timed, or auto (timed with FindEx for TRAIN nets under their own arena,
    as PyTorch's cudnn.benchmark; heuristic otherwise). Timed search may pick
    FFT or Winograd algorithms, which round differently from a direct sum
    (~1e-3 of the largest value), hence not the default for every net."""
    return os.environ.get('CAFFEPLUS_CUDNN_SEARCH', 'heuristic').lower()


class _CudnnConvolutionMixin(_CudnnMixin):

    def layer_setup(self, bottom, top):
        super().layer_setup(bottom, top)
        self._cd = None
        self._cd_groups = None
        self._cd_chunks = {}
        self._gemm = None
        self._cd_key = None
        self._sites = {}
        self._ws = None
        if not hasattr(self, 'memory_plan'):
            self.memory_plan = None

    # -- which configurations go to cuDNN ------------------------------------
    def _cudnn_geometry_ok(self):
        if not (self.channel_axis == 1 and 1 <= self.num_spatial <= 3 and self.num > 0):
            return False
        k = self._batch_slices()
        # Caffe's per-group calls (plan stock) over batch slices too: not built.
        return k is not None and (k == 1 or not self._split_groups())

    def _batch_slices(self):
        """Slices of the batch each cuDNN call runs over (batch_slices): 1
        unless an input or output blob exceeds cuDNN's 32-bit count."""
        return batch_slices(self.num, (self.channels,) + tuple(self.in_spatial),
                            (self.num_output,) + tuple(self.out_spatial))

    def _split_groups(self):
        return self.memory_plan == 'stock' and self.group > 1

    # -- workspace ----------------------------------------------------------
    def set_workspace_manager(self, manager, plan_name):
        """Called by caffeplus.memory.workspace.apply_workspace_plan."""
        if self._ws is not None and self._ws is not manager:
            self._ws.unregister(self)
        self._ws = manager
        self.memory_plan = plan_name
        if plan_name == 'stock' and backend.mode() == backend.GPU and cudnn_available():
            manager.create_handles()
        if self._cd is not None:
            # The plan decides per-group calls (stock) and timed search: the
            # descriptors serve again only if they describe the same calls.
            if self._cd_key == self._key() and \
                    getattr(self, '_built_timed', False) == self._timed_search():
                manager.register(self, list(self._sites.values()))     # same descriptors
                if plan_name == 'stock':
                    manager.plan()
            else:
                self._cd_key = None
                if self._cudnn_geometry_ok():
                    self._build_cudnn()
                else:               # runs generically now (e.g. stock's groups over slices)
                    self._cd, self._sites = None, {}

    def _manager(self):
        if self._ws is None:
            from caffeplus.memory import workspace
            self._ws = workspace.default_arena()
        return self._ws

    def _key(self):
        return (self.num, tuple(self.in_spatial), tuple(self.out_spatial), self._split_groups(),
                self._batch_slices(), mathmode.generation(), _workspace().search_mode(),
                backend.device())

    def _build_cudnn(self):
        """Descriptors and call sites for the current shapes (cached)."""
        key = self._key()
        if key == self._cd_key:
            return
        workspace = _workspace()
        slices = self._batch_slices()
        cd = _ConvDescs(self, self._split_groups(), slices)
        timed = self._timed_search()
        self._built_timed = timed
        self._auto_timed = timed and workspace.search_mode() != 'timed'
        gkey = self._geometry_key() if timed else None
        # Grouped convolutions under timed search: one call per group is a
        # candidate too (cuDNN's grouped kernels are often slower, in TF32
        # mode especially); the fastest of both wins per call site.
        per_group = _ConvDescs(self, True) if timed and cd.loops == 1 and self.group > 1 and \
            _per_group_search() else None
        gemm, chunked = self._timed_variants(cd, slices) if timed else (None, {})
        sites = {}
        for kind in workspace.KINDS:
            sites[kind] = workspace.Site(kind, cd.candidates(kind), timer=cd.timer(
                kind, gkey, per_group, gemm, chunked) if timed else None)
        self._cd, self._cd_groups, self._sites, self._cd_key = cd, per_group, sites, key
        self._cd_chunks = chunked
        self._gemm = gemm
        mgr = self._manager()
        mgr.register(self, list(sites.values()))
        if self.memory_plan == 'stock':
            mgr.plan()          # Caffe allocates its workspace in Reshape

    def _timed_variants(self, cd, slices):
        """(cuBLAS variant or None, {variant: batch-sliced descriptors}): the
        calls timed search weighs beside cuDNN's own for descriptors `cd`."""
        if cd.loops != 1:
            return None, {}
        # Few input channels (an image net's first layer): im2col + GEMM too.
        gemm = _GemmConv(self) if _GemmConv.eligible(self) else None
        # The batch in halves, quarters and eighths: less workspace at about the speed.
        chunked = {v: _ConvDescs(self, False, k) for v, k in CHUNK_VARIANTS.items()
                   if slices == 1 and self.num % k == 0 and self.num >= 2 * k and
                   _chunk_search()}
        return gemm, chunked

    def _check_gemm_workspace(self, kind, ws, nbytes):
        need = self._gemm.memory(kind)
        if need and (not ws or nbytes < need):
            raise CaffeplusError('layer %s: the workspace (%d bytes) is smaller than the cuBLAS '
                                 'variant of its %s call needs (%d)'
                                 % (self.layer_param.name, nbytes, kind, need))

    def _descs_for(self, choice):
        """The descriptors an algorithm choice runs with (per group or not)."""
        if choice.variant == 1 and self._cd_groups is not None:
            return self._cd_groups
        if choice.variant in self._cd_chunks:
            return self._cd_chunks[choice.variant]
        return self._cd

    def _timed_search(self):
        """FindEx (timed) rather than cuDNN's heuristics for this layer's algorithms."""
        from caffeplus.memory import workspace
        if self.memory_plan == 'stock':
            return False            # Caffe 1.0's choice
        if workspace.search_mode() == 'timed':
            return True
        mode = search_default()
        if mode == 'timed':
            return True
        # auto: training nets, whose shapes stay put, under a net's own arena
        return mode == 'auto' and self.phase == caffe_pb2.TRAIN and \
            self._ws is not None and self._ws is not workspace._default.get(backend.device())

    def _geometry_key(self):
        from caffeplus.backend import mathmode
        g = self.geom
        return (self.reverse, self.num, self.channels, self.num_output, tuple(self.in_spatial),
                tuple(self.out_spatial), tuple(self.blobs[0].shape), tuple(g.kernel),
                tuple(g.pad), tuple(g.stride), tuple(g.dilation), self.group,
                mathmode.generation(), mathmode.deterministic(), backend.device())

    def forward_then_relu(self, bottom, top):
        """Forward, then a ReLU (negative slope 0) in place on the top, with
        the bias add and the ReLU as one pass over the top instead of two
        (the same float operations: y + b, then y if y > 0 else 0). For a
        convolution run again in backward (caffeplus.memory.apply): at
        VGG-16 b256 conv1_1's map is 3.3 GB, 2.4 ms a pass. False (nothing
        run) where this path does not apply: then run the two layers."""
        if self.reverse or len(bottom) != 1 or not self.bias_term or \
                not self._ready(_kernels.flat(bottom[0]), _kernels.flat(self.blobs[0])):
            return False
        self._ensure_planned(self._manager())
        if self._sites['fwd'].choice.variant == 2:
            return False                # the cuBLAS variant: its own bias path
        self._forward_calls(bottom, top, bias=False)
        t = top[0].data
        _bias_relu()(self.blobs[1].data, numpy.int64(t[0, 0].size),
                     numpy.int64(t.shape[1]), t)
        return True

    def time_calls(self, ws_ptr, ws_bytes):
        """{kind: cuDNN's candidates timed with FindEx} for this layer's
        calls, as the timed search weighs them (batch slicings and the
        cuBLAS variant included), in a workspace of `ws_bytes`; without a
        plan (caffeplus.memory.calibration.measure_net: plan auto's search
        weighs measured algorithms)."""
        slices = self._batch_slices()
        cd = _ConvDescs(self, False, slices)
        gemm, chunked = self._timed_variants(cd, slices)
        return {kind: cd.timer(kind, self._geometry_key(), None, gemm, chunked)(ws_ptr, ws_bytes)
                for kind in _workspace().KINDS}

    def _ensure_planned(self, mgr):
        """The manager's plan; with the auto search, FindEx times the sites
        (the arena times only under set_search('timed'))."""
        if getattr(self, '_auto_timed', False) and getattr(mgr, '_dirty', False):
            from caffeplus.memory import workspace
            previous = workspace.set_search('timed')
            try:
                mgr.ensure_planned()
            finally:
                workspace.set_search(previous)
        else:
            mgr.ensure_planned()

    def reshape(self, bottom, top):
        super().reshape(bottom, top)
        if self._gpu_mode() and self._cudnn_geometry_ok() and cudnn_available():
            self._build_cudnn()

    def _ready(self, *arrays):
        # (`arrays`: the blobs' storage, kernels.flat: a view of each, made
        # only to ask its type, cost the host ~2 us a blob every call.)
        if not self._cudnn_geometry_ok() or not self._cudnn_usable(*arrays):
            return False
        self._build_cudnn()
        return True

    def workspace_bytes(self):
        """Arena need: the largest workspace of this layer's chosen algorithms."""
        if self._cd is None or not self._sites:
            return super().workspace_bytes()
        self._ensure_planned(self._manager())
        return self.chosen_workspace_bytes()

    def chosen_workspace_bytes(self):
        """workspace_bytes() of the algorithms chosen so far, without
        choosing (a plan made to be applied: the memory plan's own manager
        chooses later; planning now would time the candidates with the
        net's default arena, what the whole GPU spares)."""
        if self._cd is None or not self._sites:
            return super().workspace_bytes()
        return max([s.choice.memory for s in self._sites.values() if s.choice is not None] + [0])

    def stock_workspace_bytes(self):
        """What Caffe 1.0 allocates for this layer: per-group descriptors,
        first _v7 algorithm within 8 MiB per kind, max * group * 3."""
        if self._cd is None:
            return 0
        from caffeplus.memory import workspace
        # (Sliced, too large for one call, Caffe 1.0 could not run it: as sliced.)
        cd = self._cd if self._cd.batch_chunks > 1 or self._cd.loops == self.group \
            else _ConvDescs(self, True)
        choices = [workspace.choose_stock(cd.candidates(k),
                                          what=workspace.call_site_name(self, k))
                   for k in workspace.KINDS]
        return workspace.stock_bytes(choices, self.group)

    def algorithms(self):
        """{kind: chosen AlgoChoice} (for logs and tests)."""
        if self._cd is not None:
            self._ensure_planned(self._manager())
        return {k: s.choice for k, s in self._sites.items()}

    # -- the math -----------------------------------------------------------
    # Each group of cuDNN calls goes through its descriptors' Replays, keyed
    # by every value the calls read: replayed as a CUDA graph from the
    # second iteration on (caffeplus.cudnn.api).
    def _forward(self, bottom, top):
        if not self._ready(_kernels.flat(bottom[0]), _kernels.flat(self.blobs[0])):
            return super()._forward(bottom, top)
        self._forward_calls(bottom, top)

    def _forward_calls(self, bottom, top, bias=True):
        """The forward's cuDNN (or cuBLAS) calls; `bias` False leaves the
        bias out (forward_then_relu adds it)."""
        mgr = self._manager()
        self._ensure_planned(mgr)
        kind = 'bwd_data' if self.reverse else 'fwd'
        c = self._sites[kind].choice
        cd = self._descs_for(c)
        conv = cd.conv_for(c.math)
        w = _dptr(self.blobs[0])
        b = _dptr(self.blobs[1]) if self.bias_term and bias else 0
        gemm = self._gemm if c.variant == 2 else None
        for bb, tt in zip(bottom, top):
            x, y = _dptr(bb), _dptr(tt)
            if gemm is not None:
                with mgr.checkout(self, kind) as (ws, nbytes):
                    self._check_gemm_workspace(kind, ws, nbytes)
                    gemm.forward(x, w, y, ws)
                if b:
                    cd.replays.run(('bias', x, y, b), functools.partial(
                        _bias_add_calls, cd, b, y))
                continue
            with mgr.checkout(self, kind) as (ws, nbytes):
                cd.replays.run((kind, x, w, y, b, ws, nbytes, c.algo, c.math, c.variant),
                               functools.partial(_conv_forward_calls, cd, conv, c.algo,
                                                 self.reverse, x, w, y, b, ws, nbytes))

    def _backward(self, top, propagate_down, bottom):
        if not self._ready(_kernels.flat(top[0], True), _kernels.flat(self.blobs[0])):
            return super()._backward(top, propagate_down, bottom)
        mgr = self._manager()
        self._ensure_planned(mgr)
        wblob = self.blobs[0]
        w = _dptr(wblob)
        dw = _dptr(wblob, True) if self.param_needs_backward(0) else 0
        db = _dptr(self.blobs[1], True) if self.bias_term and self.param_needs_backward(1) else 0
        fc = self._sites['bwd_filter'].choice
        fcd = self._descs_for(fc)
        dkind = 'fwd' if self.reverse else 'bwd_data'
        dc = self._sites[dkind].choice
        dcd = self._descs_for(dc)
        for i, (bb, tt) in enumerate(zip(bottom, top)):
            dtop = _dptr(tt, True)
            if dw and fc.variant == 2 and self._gemm is not None:
                x = _dptr(bb)
                if db:
                    self._cd.replays.run(('bias', dtop, db), functools.partial(
                        _conv_params_calls, self._cd, None, 0, self.reverse, 0, dtop, 0, db, 0, 0))
                with mgr.checkout(self, 'bwd_filter') as (ws, nbytes):
                    self._check_gemm_workspace('bwd_filter', ws, nbytes)
                    self._gemm.backward_filter(x, dtop, dw, ws)
            elif dw:
                x = _dptr(bb)
                with mgr.checkout(self, 'bwd_filter') as (ws, nbytes):
                    fcd.replays.run(('bwd_filter', x, dtop, dw, db, ws, nbytes, fc.algo, fc.math,
                                     fc.variant),
                                    functools.partial(_conv_params_calls, fcd,
                                                      fcd.conv_for(fc.math), fc.algo,
                                                      self.reverse, x, dtop, dw, db, ws, nbytes))
            elif db:
                self._cd.replays.run(('bias', dtop, db), functools.partial(
                    _conv_params_calls, self._cd, None, 0, self.reverse, 0, dtop, 0, db, 0, 0))
            if propagate_down[i] and dc.variant == 2 and self._gemm is not None:
                self._gemm.backward_data(dtop, w, _dptr(bb, True))
            elif propagate_down[i]:
                dx = _dptr(bb, True)
                with mgr.checkout(self, dkind) as (ws, nbytes):
                    dcd.replays.run((dkind, dtop, w, dx, ws, nbytes, dc.algo, dc.math,
                                     dc.variant),
                                    functools.partial(_conv_data_calls, dcd,
                                                      dcd.conv_for(dc.math), dc.algo,
                                                      self.reverse, dtop, w, dx, ws, nbytes))


@register_engine('CUDNN')
class CuDNNConvolutionLayer(_CudnnConvolutionMixin, ConvolutionLayer):
    """Convolution through cuDNN (groups by cudnnSetConvolutionGroupCount,
    dilation, 1-3 spatial axes through Nd descriptors)."""


@register_engine('CUDNN')
class CuDNNDeconvolutionLayer(_CudnnConvolutionMixin, DeconvolutionLayer):
    """Deconvolution through cuDNN: forward is backward-data, backward is
    forward and backward-filter."""


# =============================================================================
# Pooling
# =============================================================================
def cudnn_pool_size(size, kernel, stride, pad):
    """cuDNN's output size (floor rule)."""
    return 1 + (size + 2 * pad - kernel) // stride


def _pool_forward_calls(pd, xd, x, yd, y, loops):
    k, x_step, y_step = loops
    for g in range(k):
        api.pooling_forward(pd, xd, x + g * x_step, yd, y + g * y_step)


def _pool_backward_calls(pd, yd, y, dy, xd, x, dx, loops):
    k, x_step, y_step = loops
    for g in range(k):
        api.pooling_backward(pd, yd, y + g * y_step, dy + g * y_step, xd, x + g * x_step,
                             dx + g * x_step)


class _MaskableMixin:
    """What caffeplus.memory.masks switches: a masked layer's backward reads
    what its forward kept (can_mask says whether it can), none of its blobs."""
    masked = False

    def set_masked(self, on):
        """Mask (or stop masking) this layer; returns whether it is masked."""
        on = bool(on) and self.can_mask()
        if on != self.masked:
            if on:
                self._reads_unmasked = self.backward_reads
            self.backward_reads = frozenset() if on else self._reads_unmasked
            self.masked = on
            self.forget_kept_buffers()      # kept by the other kind of pass
        return on


@register_engine('CUDNN')
class CuDNNPoolingLayer(_MaskableMixin, _CudnnMixin, PoolingLayer):
    """MAX and AVE pooling through cuDNN where cuDNN's output shape equals
    Caffe's; there Caffe's AVE divisor (the window clipped to H + pad) is
    the full kernel, which is cuDNN's AVERAGE_COUNT_INCLUDE_PADDING."""

    def __init__(self, layer_param):
        super().__init__(layer_param)
        if backend.mode() == backend.GPU:
            self.backward_reads = self.gpu_backward_reads()

    def gpu_backward_reads(self):
        """cuDNN's pooling backward reads x and y (the estimate, built on the
        CPU, plans with these: caffeplus.memory.shapes.build_net)."""
        if self.layer_param.pooling_param.pool in (MAX, AVE):
            return READS_BOTH
        return self.backward_reads

    def layer_setup(self, bottom, top):
        super().layer_setup(bottom, top)
        self._pd = None
        self._pd_key = None

    def cudnn_agrees(self):
        """Whether cuDNN computes exactly Caffe's pooling for this geometry."""
        pool = self.pool
        if pool is None or pool.method not in (MAX, AVE) or self._ntop != 1 or \
                self._batch_slices() is None:
            return False
        (kh, kw), (sh, sw), (ph, pw) = pool.geom
        h, w = pool.x_shape[2:]
        oh, ow = pool.out_shape[2:]
        return cudnn_pool_size(h, kh, sh, ph) == oh and cudnn_pool_size(w, kw, sw, pw) == ow

    def reshape(self, bottom, top):
        super().reshape(bottom, top)
        self._ntop = len(top)
        if self._gpu_mode() and cudnn_available() and self.cudnn_agrees():
            self._build()

    def _build(self):
        from caffeplus.backend import mathmode
        from caffeplus.cudnn import api
        pool = self.pool
        k = self._batch_slices()
        key = (pool.x_shape, pool.out_shape, tuple(pool.geom), pool.method, k,
               mathmode.generation(), backend.device())
        if key == self._pd_key:
            return
        if pool.method == MAX:
            mode = api.POOL_MAX_DETERMINISTIC if mathmode.deterministic() else api.POOL_MAX
        else:
            mode = api.POOL_AVG_INCLUDE_PAD
        n = pool.x_shape[0] // k
        x_slice, y_slice = (n,) + tuple(pool.x_shape[1:]), (n,) + tuple(pool.out_shape[1:])
        self._pd = (api.PoolDesc(mode, pool.geom.kernel, pool.geom.pad, pool.geom.stride),
                    api.TensorDesc(x_slice), api.TensorDesc(y_slice))
        # One call per batch slice (a blob over cuDNN's 32-bit count): byte steps.
        self._pool_loops = (k, _prod(x_slice) * FLOAT_BYTES, _prod(y_slice) * FLOAT_BYTES)
        self._replays = api.Replays()
        self._pd_key = key

    def _batch_slices(self):
        pool = self.pool
        return batch_slices(pool.x_shape[0], pool.x_shape[1:], pool.out_shape[1:])

    def _ready(self, *arrays):
        if not self.cudnn_agrees() or not self._cudnn_usable(*arrays):
            return False
        self._build()
        return True

    def _forward(self, bottom, top):
        self._fused_arg = False
        if self.masked and _kernels.active():
            return self._masked_forward(bottom, top)
        if not self._ready(_kernels.flat(bottom[0])):
            if _kernels.active() and _fused('Pooling forward', self._fast_forward, bottom, top):
                return
            return super()._forward(bottom, top)
        pd, xd, yd = self._pd
        x, y = _dptr(bottom[0]), _dptr(top[0])
        self._replays.run(('f', x, y), functools.partial(_pool_forward_calls, pd, xd, x, yd, y,
                                                         self._pool_loops))

    def _backward(self, top, propagate_down, bottom):
        if not propagate_down[0]:
            return
        if self.masked and _kernels.active():
            return self._masked_backward(top, bottom)
        if not self._ready(_kernels.flat(top[0], True)):
            if _kernels.active() and _fused('Pooling backward', self._fast_backward, top,
                                           propagate_down, bottom):
                return
            return super()._backward(top, propagate_down, bottom)
        pd, xd, yd = self._pd
        y, dy = _dptr(top[0]), _dptr(top[0], True)
        x, dx = _dptr(bottom[0]), _dptr(bottom[0], True)
        self._replays.run(('b', y, dy, x, dx), functools.partial(
            _pool_backward_calls, pd, yd, y, dy, xd, x, dx, self._pool_loops))

    # -- Caffe's windows where cuDNN's differ (the ceil rule): caffeplus.kernels
    _arg_buf = None
    _fused_arg = False

    # -- masks instead of maps (caffeplus.memory.masks) ---------------------
    # A masked layer keeps a one-byte argmax and its backward reads that, not
    # x and y, so a memory plan may drop both maps after forward. cuDNN's
    # pooling keeps no argmax, so it does not run for a masked layer.
    _arg8 = None

    def masked_bits_unchanged(self):
        """Whether masking leaves the layer's results bit for bit: cuDNN's
        max pooling gives the masked kernels' bits where the windows do not
        overlap (tools/compare_pooling.py), and where cuDNN does not run the
        kernels' int32 argmax computes what the masked one does."""
        pool = self.pool
        (kh, kw), (sh, sw), _ = pool.geom
        oh, ow = pool.out_shape[2:]
        overlapping = (kh > sh and oh > 1) or (kw > sw and ow > 1)
        return not overlapping or not self.cudnn_agrees()

    def can_mask(self):
        """MAX pooling with one top and windows of at most 255 values."""
        pool = self.pool
        return pool is not None and pool.method == MAX and getattr(self, '_ntop', 1) == 1 and \
            pool.geom.kernel[0] * pool.geom.kernel[1] < 255

    def _window_args(self):
        """H, W, OH, OW, KH, KW, SH, SW, PH, PW as the pooling kernels take them."""
        K = _kernels
        pool = self.pool
        (kh, kw), (sh, sw), (ph, pw) = pool.geom
        h, w = pool.x_shape[2:]
        oh, ow = pool.out_shape[2:]
        return tuple(K.i32(v) for v in (h, w, oh, ow, kh, kw, sh, sw, ph, pw))

    def _masked_forward(self, bottom, top):
        K = _kernels
        count = _prod(self.pool.out_shape)
        x, y = K.flat(bottom[0]), K.flat(top[0])
        self._arg8 = arg = scratch.get(self, 'argmax8', count, numpy.uint8, K.array_module())
        K.kernel('cp_mpool_fwd')(K.elementwise_grid(count), (K.ELEMENTWISE_THREADS,),
                                 (x, y, arg, numpy.uint64(count)) + self._window_args())

    def _masked_backward(self, top, bottom):
        K = _kernels
        if self._arg8 is None:
            raise CaffeplusError("layer '%s': backward before forward (its argmax mask is not "
                                 "there)" % self.name)
        pool = self.pool
        dy, dx = K.flat(top[0], diff=True), K.flat(bottom[0], diff=True)
        (kh, kw), (sh, sw), (ph, pw) = pool.geom
        (h, w), (oh, ow) = pool.x_shape[2:], pool.out_shape[2:]
        if (kh, kw) == (sh, sw) and ph == pw == 0 and (h, w) == (oh * kh, ow * kw):
            # Windows that tile the input (VGG-16's): each output writes its own.
            count = _prod(pool.out_shape)
            K.kernel('cp_mpool_bwd_tiled')(
                K.elementwise_grid(count), (K.ELEMENTWISE_THREADS,),
                (dy, self._arg8, dx, numpy.uint64(count)) +
                tuple(K.i32(v) for v in (oh, ow, kh, kw)))
            return
        count = _prod(pool.x_shape)
        K.kernel('cp_mpool_bwd')(K.elementwise_grid(count), (K.ELEMENTWISE_THREADS,),
                                 (dy, self._arg8, dx, numpy.uint64(count)) + self._window_args())

    def internal_buffers(self):
        """On the GPU, MAX pooling's kernel keeps an int32 argmax for
        backward; cuDNN keeps nothing (its backward reads x and y); a masked
        layer keeps a one-byte argmax."""
        pool = self.pool
        if self.masked and _kernels.active():
            return {'argmax8': (_prod(pool.out_shape), numpy.uint8)}
        if pool is not None and pool.method == MAX and self._gpu_mode():
            if cudnn_available() and self.cudnn_agrees():
                return {}
            return {'argmax': (_prod(pool.out_shape), numpy.int32)}
        return super().internal_buffers()

    def gpu_internal_bytes(self):
        """What internal_buffers keeps on a GPU with cuDNN (for the estimate,
        made on a CPU net: workspace_model.internal_bytes)."""
        pool = self.pool
        if self.masked:
            return _prod(pool.out_shape)
        if pool is None or pool.method != MAX or self.cudnn_agrees():
            return 0
        return 4 * _prod(pool.out_shape)

    def forget_kept_buffers(self):
        super().forget_kept_buffers()
        self._arg_buf = None
        self._arg8 = None
        self._fused_arg = False

    def _pool_args(self):
        K = _kernels
        n, c = self.pool.x_shape[:2]
        return (K.u32(n * c),) + self._window_args() + (K.i32(self.pool.method == AVE),)

    def _fast_forward(self, bottom, top):
        K = _kernels
        pool = self.pool
        if pool is None or pool.method not in (MAX, AVE) or \
                not 0 < _prod(pool.x_shape) <= K.MAX_COUNT:
            return False
        x, y = K.flat(bottom[0]), K.flat(top[0])
        if x is None or y is None:
            return False
        count = _prod(pool.out_shape)
        arg = y
        if pool.method == MAX:
            # The kept argmax: the memory plan's view, else the layer's own.
            self._arg_buf = arg = scratch.get(self, 'argmax', count, numpy.int32,
                                              K.array_module())
        K.kernel('cp_pool_fwd')(K.elementwise_grid(count * K.UNROLL), (K.ELEMENTWISE_THREADS,),
                                (x, y, arg) + self._pool_args())
        if pool.method == MAX:
            # the generic code's state: backward and the mask top read it
            pool.arg = arg[:count].reshape(pool.out_shape)
            self._fused_arg = True
            if len(top) > 1:
                top[1].data[...] = pool.mask()
        return True

    def _fast_backward(self, top, propagate_down, bottom):
        K = _kernels
        pool = self.pool
        if pool is None or pool.method not in (MAX, AVE) or \
                not 0 < _prod(pool.x_shape) <= K.MAX_COUNT:
            return False
        if pool.method == MAX and not (self._fused_arg and pool.arg is not None and
                                       K.is_device(pool.arg)):
            return False
        dy, dx = K.flat(top[0], diff=True), K.flat(bottom[0], diff=True)
        if dy is None or dx is None:
            return False
        arg = pool.arg if pool.method == MAX else dy
        count = _prod(pool.x_shape)
        K.kernel('cp_pool_bwd')(K.elementwise_grid(count * K.UNROLL), (K.ELEMENTWISE_THREADS,),
                                (dy, arg, dx) + self._pool_args())
        return True


# =============================================================================
# LRN
# =============================================================================
@register_engine('CUDNN')
class CuDNNLRNLayer(_CudnnMixin, LRNLayer):
    """ACROSS_CHANNELS LRN through cuDNN (same formula: k + alpha/n * sum x^2);
    WITHIN_CHANNEL and parameters outside cuDNN's ranges run generically."""

    def __init__(self, layer_param):
        super().__init__(layer_param)
        if backend.mode() == backend.GPU:
            self.backward_reads = self.gpu_backward_reads()

    def gpu_backward_reads(self):
        return READS_BOTH           # cuDNN's LRN backward reads x and y

    def layer_setup(self, bottom, top):
        super().layer_setup(bottom, top)
        self._desc = None
        self._desc_key = None

    def _cudnn_ok(self, shape=()):
        return (self.region == caffe_pb2.LRNParameter.ACROSS_CHANNELS and _fits(shape) and
                1 <= self.size <= 16 and self.k >= 1e-5 and self.beta >= 0.01 and
                self.alpha >= 1e-5)

    def reshape(self, bottom, top):
        super().reshape(bottom, top)
        if self._gpu_mode() and cudnn_available() and self._cudnn_ok(bottom[0].shape):
            self._build(bottom[0].shape)

    def _build(self, shape):
        from caffeplus.cudnn import api
        key = (tuple(shape), backend.device())
        if key == self._desc_key:
            return
        self._desc = (api.LRNDesc(self.size, self.alpha, self.beta, self.k),
                      api.TensorDesc(_as4d(shape)))
        self._replays = api.Replays()
        self._desc_key = key

    def _ready(self, x):
        if not self._cudnn_ok(x.shape) or not self._cudnn_usable(x):
            return False
        self._build(x.shape)
        return True

    def _forward(self, bottom, top):
        if not self._ready(bottom[0].data):
            return super()._forward(bottom, top)
        lrn, xd = self._desc
        x, y = _dptr(bottom[0]), _dptr(top[0])
        self._replays.run(('f', x, y), functools.partial(api.lrn_forward, lrn, xd, x, y))

    def _backward(self, top, propagate_down, bottom):
        if not propagate_down[0]:
            return
        if not self._ready(bottom[0].data):
            return super()._backward(top, propagate_down, bottom)
        lrn, xd = self._desc
        y, dy = _dptr(top[0]), _dptr(top[0], True)
        x, dx = _dptr(bottom[0]), _dptr(bottom[0], True)
        self._replays.run(('b', y, dy, x, dx), functools.partial(
            api.lrn_backward, lrn, xd, y, dy, x, dx))


# =============================================================================
# Softmax
# =============================================================================
@register_engine('CUDNN')
class CuDNNSoftmaxLayer(_CudnnMixin, SoftmaxLayer):
    """Softmax along `axis` as cuDNN's CHANNEL mode on (outer, C, inner, 1)."""

    def layer_setup(self, bottom, top):
        super().layer_setup(bottom, top)
        self._desc = None
        self._desc_key = None

    def reshape(self, bottom, top):
        super().reshape(bottom, top)
        if self._gpu_mode() and cudnn_available() and _fits(bottom[0].shape):
            self._build(bottom[0].shape)

    def _build(self, shape):
        from caffeplus.cudnn import api
        key = (tuple(shape), self.axis, backend.device())
        if key == self._desc_key:
            return
        outer = _prod(shape[:self.axis])
        inner = _prod(shape[self.axis + 1:])
        self._desc = api.TensorDesc((outer, int(shape[self.axis]), inner, 1))
        self._replays = api.Replays()
        self._desc_key = key

    def _ready(self, x):
        if not _fits(x.shape) or not self._cudnn_usable(x):
            return False
        self._build(x.shape)
        return True

    def _forward(self, bottom, top):
        if not self._ready(bottom[0].data):
            return super()._forward(bottom, top)
        x, y = _dptr(bottom[0]), _dptr(top[0])
        self._replays.run(('f', x, y), functools.partial(api.softmax_forward, self._desc, x, y))

    def _backward(self, top, propagate_down, bottom):
        if not propagate_down[0]:
            return
        if not self._ready(top[0].data):
            return super()._backward(top, propagate_down, bottom)
        y, dy, dx = _dptr(top[0]), _dptr(top[0], True), _dptr(bottom[0], True)
        self._replays.run(('b', y, dy, dx), functools.partial(
            api.softmax_backward, self._desc, y, dy, dx))


# =============================================================================
# Activations
# =============================================================================
class _CudnnActivationMixin(_CudnnMixin):
    """cuDNN activation forward/backward on the blob as one (N, C, H, W)."""
    act_mode = None
    # Whether backward may pass the top as cuDNN's x: true for ReLU, Sigmoid
    # and TanH, whose gradients cuDNN computes from y (Caffe's cuDNN layers
    # run them in place, where x is y).
    x_from_top = True

    def _act_coef(self):
        return 0.0

    def _act_ok(self, bottom, top):
        return True

    def reshape(self, bottom, top):
        super().reshape(bottom, top)
        if self._gpu_mode() and cudnn_available() and self._act_ok(bottom, top) and \
                _fits(bottom[0].shape):
            self._build(bottom[0].shape)

    def _build(self, shape):
        from caffeplus.cudnn import api
        key = (tuple(shape), backend.device())
        if key == getattr(self, '_act_key', None):
            return
        self._act = (api.ActivationDesc(self.act_mode, self._act_coef()),
                     api.TensorDesc(_as4d(shape)))
        self._act_replays = api.Replays()
        self._act_key = key

    def _ready(self, bottom, top, x):
        if not self._act_ok(bottom, top) or not _fits(x.shape) or not self._cudnn_usable(x):
            return False
        self._build(x.shape)
        return True

    def _forward(self, bottom, top):
        if not self._ready(bottom, top, bottom[0].data):
            return super()._forward(bottom, top)
        act, xd = self._act
        x, y = _dptr(bottom[0]), _dptr(top[0])
        self._act_replays.run(('f', x, y), functools.partial(
            api.activation_forward, act, xd, x, y))

    def _backward(self, top, propagate_down, bottom):
        if not propagate_down[0]:
            return
        if not self._ready(bottom, top, top[0].data):
            return super()._backward(top, propagate_down, bottom)
        act, xd = self._act
        y, dy, dx = _dptr(top[0]), _dptr(top[0], True), _dptr(bottom[0], True)
        x = y if self.x_from_top else _dptr(bottom[0])
        self._act_replays.run(('b', y, dy, x, dx), functools.partial(
            api.activation_backward, act, xd, y, dy, x, dx))


@register_engine('CUDNN')
class CuDNNReLULayer(_MaskableMixin, _CudnnActivationMixin, ReLULayer):
    """ReLU through cuDNN (negative_slope 0 only; a leaky ReLU runs generically)."""

    @property
    def act_mode(self):
        from caffeplus.cudnn import api
        return api.ACT_RELU

    def _act_ok(self, bottom, top):
        return self.slope == 0

    # -- masks instead of maps (caffeplus.memory.masks) ---------------------
    # A masked ReLU keeps one bit per value, (y > 0), and its backward reads
    # those instead of y, so a plan may drop the map once the layers after
    # it are done with it (a masked max pooling).
    _bits = None
    _values = 0

    def can_mask(self):
        return self.slope == 0

    def reshape(self, bottom, top):
        super().reshape(bottom, top)
        self._values = bottom[0].count

    def internal_buffers(self):
        if not self.masked:
            return {}
        return {'sign': ((self._values + 31) // 32, numpy.uint32)}

    def gpu_internal_bytes(self):
        return 4 * ((self._values + 31) // 32) if self.masked else 0

    def forget_kept_buffers(self):
        self._bits = None

    def _masked_forward(self, bottom, top):
        n = bottom[0].count
        words = (n + 31) // 32
        if _kernels.active():
            K = _kernels
            self._bits = bits = scratch.get(self, 'sign', words, numpy.uint32, K.array_module())
            x, y = K.flat(bottom[0]), K.flat(top[0])
            K.kernel('cp_relu_bits_fwd')(K.elementwise_grid(n), (K.ELEMENTWISE_THREADS,),
                                         (x, y, bits, numpy.uint64(n)))
            return
        self._bits = bits = scratch.get(self, 'sign', words, numpy.uint32, numpy)
        y = top[0].data
        numpy.maximum(bottom[0].data, 0, out=y)
        raw = bits.view(numpy.uint8)
        packed = numpy.packbits(y.reshape(-1) > 0, bitorder='little')
        raw[:packed.size] = packed
        raw[packed.size:] = 0

    def _masked_backward(self, top, bottom):
        if self._bits is None:
            raise CaffeplusError("layer '%s': backward before forward (its sign bits are not "
                                 "there)" % self.name)
        n = top[0].count
        if _kernels.active():
            K = _kernels
            dy, dx = K.flat(top[0], diff=True), K.flat(bottom[0], diff=True)
            K.kernel('cp_relu_bits_bwd')(K.elementwise_grid(n), (K.ELEMENTWISE_THREADS,),
                                         (dy, self._bits, dx, numpy.uint64(n)))
            return
        dy = top[0].diff
        positive = numpy.unpackbits(self._bits.view(numpy.uint8), count=n, bitorder='little')
        # Caffe's dy * (y > 0), as the unmasked layer writes it.
        numpy.multiply(dy, positive.view(numpy.bool_).reshape(dy.shape), out=bottom[0].diff)


@register_engine('CUDNN')
class CuDNNSigmoidLayer(_CudnnActivationMixin, SigmoidLayer):

    @property
    def act_mode(self):
        from caffeplus.cudnn import api
        return api.ACT_SIGMOID


@register_engine('CUDNN')
class CuDNNTanHLayer(_CudnnActivationMixin, TanHLayer):

    @property
    def act_mode(self):
        from caffeplus.cudnn import api
        return api.ACT_TANH


@register_engine('CUDNN')
class CuDNNELULayer(_CudnnActivationMixin, ELULayer):
    """ELU through cuDNN when not in place (its backward reads the bottom)."""
    x_from_top = False

    def __init__(self, layer_param):
        super().__init__(layer_param)
        if backend.mode() == backend.GPU:
            self.backward_reads = self.gpu_backward_reads()

    def gpu_backward_reads(self):
        return READS_BOTH           # cuDNN's activation backward reads x and y

    @property
    def act_mode(self):
        from caffeplus.cudnn import api
        return api.ACT_ELU

    def _act_coef(self):
        return float(self.alpha)

    def _act_ok(self, bottom, top):
        # cuDNN's ELU assumes alpha >= 0 (Caffe allows any alpha): the
        # generic code handles the rest.
        return bottom[0].data_storage is not top[0].data_storage and self.alpha >= 0


# =============================================================================
# Fused kernels (caffeplus.kernels): BatchNorm, Scale, ReLU, Eltwise SUM, Split
# =============================================================================
# In GPU mode these layers run one CUDA kernel per forward and per backward
# instead of the generic code's ten to twenty CuPy operations; on NumPy
# arrays (CPU mode), for blobs of 2**31 values or more, or with
# CAFFEPLUS_FUSED=0, they run the generic code. Their reshape returns at
# once when the bottom shapes are those of the last call (the net reshapes
# every layer before every forward).
#
# Chains. In a residual net each convolution is followed by BatchNorm,
# Scale and (mostly) ReLU, all in place on one blob. When a pass of the net
# runs the whole chain and nothing watches the layers in between (no
# per-layer hooks but on_layer_backward_done, no debug_info), BatchNorm's
# forward writes the chain's final top, relu(scale * norm(x) + bias), and
# the chain's last layer's backward computes every gradient of the three
# (Scale's parameter gradients included) in one kernel; the other layers
# of the chain then do nothing. The blob's values after the chain, and
# every gradient, are those of the layers run one by one. The net tells
# the chains about each pass through kernels.begin_pass.

def _fused(what, fn, *args):
    """Run a fused path; False (the caller runs the generic code) when it
    does not apply or its kernel failed to build or launch."""
    try:
        return fn(*args)
    except CaffeplusError:
        raise                   # the layer's own errors (labels, released memory)
    except Exception as exc:
        from caffeplus.memory import workspace
        if workspace.is_out_of_memory(exc):
            raise
        _kernels.note_failure(what, exc)
        return False


def _base_address(array):
    """Where an array's data starts (CuPy or NumPy): a view's identity."""
    data = array.data
    return int(data.ptr) if hasattr(data, 'ptr') else array.__array_interface__['data'][0]


def _view(buf, shape):
    """A cached view of buffer `buf` with `shape` (rebuilt when either changes)."""
    return buf[:_prod(shape)].reshape(shape)


class _FusedMixin:
    """A reshape that skips when the bottom shapes are those of the last call."""
    _rkey = None

    def _reshape_key(self, bottom):
        return tuple(b._shape for b in bottom)

    def reshape(self, bottom, top):
        key = self._reshape_key(bottom)
        if key == self._rkey and all(t._shape == bottom[0]._shape for t in top):
            return
        self._rkey = None
        super().reshape(bottom, top)
        self._rkey = key
        self._reshaped(bottom, top)

    def _reshaped(self, bottom, top):
        pass


class _Chain:
    """BatchNorm -> Scale (-> ReLU), in place on one blob, consecutive layers."""
    __slots__ = ('bn', 'scale', 'relu', 'first', 'last', 'head', 'needs_backward',
                 'fwd_active', 'bwd_active', 'fwd_done', 'bwd_done')

    def __init__(self, net, i, bn, scale, relu):
        self.bn, self.scale, self.relu = bn, scale, relu
        self.first, self.last = i, i + (2 if relu is not None else 1)
        self.head = relu if relu is not None else scale      # first in backward order
        self.needs_backward = all(net.layer_need_backward[j] and all(net.bottom_need_backward[j])
                                  for j in range(self.first, self.last + 1))
        self.fwd_active = self.bwd_active = self.fwd_done = self.bwd_done = False

    def geometry_ok(self):
        """Scale covers exactly BatchNorm's channel axis (and its bias the same)."""
        sc = self.scale
        return sc.dims == self.bn._cfg and (sc.bias_param_id is None or
                                            sc.bias_dims == sc.dims)

    def forward(self, x, y):
        """BatchNorm's fused forward for the whole chain (called by BatchNorm)."""
        K = _kernels
        sc = self.scale
        s = K.flat(sc.blobs[0])
        b = K.flat(sc.blobs[sc.bias_param_id]) if sc.bias_param_id is not None else None
        if s is None or (sc.bias_param_id is not None and b is None):
            return False
        flags = K.BN_SCALE | (K.BN_BIAS if b is not None else 0) | \
            (K.BN_RELU if self.relu is not None else 0)
        if not self.bn._launch_forward(x, y, flags, s, b):
            return False
        sc._bottom_copy = self.bn._x_norm           # Scale's bottom: the normalized x
        self.fwd_done = True
        return True

    def backward(self):
        """The chain's fused backward (called by its head, first in backward order)."""
        K = _kernels
        bn, sc = self.bn, self.scale
        if not self.geometry_ok() or bn._x_norm is None or bn._std is None:
            return False
        n, c, s_ = bn._cfg
        count = n * c * s_
        if not 0 < count <= K.MAX_COUNT or bn._x_norm.size != count:
            return False
        blob = bn._chain_blob
        dy = K.flat(blob, diff=True)
        s = K.flat(sc.blobs[0])
        bid = sc.bias_param_id
        b = K.flat(sc.blobs[bid]) if bid is not None else None
        if dy is None or s is None or (bid is not None and b is None):
            return False
        want_ds = sc.param_needs_backward(0)
        want_db = bid is not None and sc.param_needs_backward(bid)
        ds = K.flat(sc.blobs[0], diff=True) if want_ds else None
        db = K.flat(sc.blobs[bid], diff=True) if want_db else None
        if (want_ds and ds is None) or (want_db and db is None):
            return False
        flags = K.BN_SCALE | K.BN_DX | (K.BN_BIAS if b is not None else 0) | \
            (K.BN_RELU if self.relu is not None else 0) | \
            (K.BN_DSCALE if want_ds else 0) | (K.BN_DBIAS if want_db else 0) | \
            (0 if bn.use_global_stats else K.BN_BATCH)
        bn._launch_backward(dy, bn._x_norm, bn._std, dy, s, b if b is not None else s,
                            ds if ds is not None else dy, db if db is not None else dy, flags)
        self.bwd_done = True
        return True


def _scale_diffs(g, ref, outs, n, mask):
    """cp_scale2 over (diff array, coefficient) pairs, two per launch; with
    `mask`, g is first multiplied by (ref > 0) and written back (an in-place
    ReLU's backward)."""
    K = _kernels
    grid, block = K.elementwise_grid(n), (K.ELEMENTWISE_THREADS,)
    k = K.kernel('cp_scale2')
    if not outs:
        if mask:
            k(grid, block, (g, g, g, ref, K.u32(n), F32(1), F32(1), K.i32(4)))
        return
    for j in range(0, len(outs), 2):
        d0, c0 = outs[j]
        if j + 1 < len(outs):
            d1, c1, flags = outs[j + 1][0], outs[j + 1][1], 3
        else:
            d1, c1, flags = d0, c0, 1
        if mask and j == 0:
            flags |= 4
        k(grid, block, (g, d0, d1, ref, K.u32(n), F32(c0), F32(c1), K.i32(flags)))


class _SumChain:
    """Eltwise SUM of two bottoms into a new top, then ReLU in place on it."""
    __slots__ = ('eltwise', 'relu', 'first', 'last', 'head', 'needs_backward', 'bottoms',
                 'top', 'propagate', 'fwd_active', 'bwd_active', 'fwd_done', 'bwd_done')

    def __init__(self, net, i, eltwise, relu):
        self.eltwise, self.relu = eltwise, relu
        self.first, self.last, self.head = i, i + 1, relu
        self.bottoms, self.top = list(net.bottom_vecs[i]), net.top_vecs[i][0]
        self.propagate = list(net.bottom_need_backward[i])
        self.needs_backward = net.layer_need_backward[i] and net.layer_need_backward[i + 1] \
            and all(net.bottom_need_backward[i + 1])
        self.fwd_active = self.bwd_active = self.fwd_done = self.bwd_done = False

    def backward(self):
        """ReLU's and Eltwise's backward in one kernel (called by the ReLU)."""
        K = _kernels
        n = self.top._count
        if not 0 < n <= K.MAX_COUNT:
            return False
        g, ref = K.flat(self.top, diff=True), K.flat(self.top)
        outs = [(K.flat(b, diff=True), self.eltwise.coeffs[j])
                for j, b in enumerate(self.bottoms) if self.propagate[j]]
        if g is None or ref is None or any(a is None for a, _ in outs):
            return False
        _scale_diffs(g, ref, outs, n, 1)
        self.bwd_done = True
        return True


def _find_chains(net):
    chains = []
    layers = net.layers
    L = len(layers)

    def in_place_on(j, blob):
        return len(net.bottom_vecs[j]) == 1 and len(net.top_vecs[j]) == 1 and \
            net.bottom_vecs[j][0] is blob and net.top_vecs[j][0] is blob
    for i, layer in enumerate(layers):
        if not isinstance(layer, GPUBatchNormLayer) or i + 1 >= L or not net.bottom_vecs[i]:
            continue
        blob = net.bottom_vecs[i][0]
        if not in_place_on(i, blob):
            continue
        sc = layers[i + 1]
        if not isinstance(sc, GPUScaleLayer) or not in_place_on(i + 1, blob):
            continue
        relu = layers[i + 2] if i + 2 < L else None
        if not (isinstance(relu, CuDNNReLULayer) and relu.slope == 0 and in_place_on(i + 2, blob)):
            relu = None
        ch = _Chain(net, i, layer, sc, relu)
        layer._chain_blob = blob
        for member in (layer, sc, relu):
            if member is not None:
                member._chain = ch
        chains.append(ch)
    for i, layer in enumerate(layers):
        if not isinstance(layer, GPUEltwiseLayer) or layer.op != _ELTWISE_SUM or i + 1 >= L or \
                len(net.bottom_vecs[i]) != 2 or len(net.top_vecs[i]) != 1:
            continue
        top = net.top_vecs[i][0]
        relu = layers[i + 1]
        if any(b is top for b in net.bottom_vecs[i]) or not (
                isinstance(relu, CuDNNReLULayer) and relu.slope == 0 and relu._chain is None
                and in_place_on(i + 1, top)):
            continue
        ch = _SumChain(net, i, layer, relu)
        layer._chain = relu._chain = ch
        chains.append(ch)
    return chains


def _chain_backward(layer, what):
    """Whether the layer's chain took its backward: done already by the
    chain's last layer, or run now because `layer` is that layer."""
    ch = layer._chain
    if ch is None:
        return False
    if ch.bwd_done:
        return True
    return ch.head is layer and ch.bwd_active and _kernels.active() and _fused(what, ch.backward)


def _begin_pass(net, start, end, backward):
    """kernels.begin_pass: which chains run fused in this pass of `net`."""
    chains = _chains(net)
    if not chains:
        return
    # Hooks that look at blobs between a chain's layers need it unfused;
    # hooks marked chain_safe (the offload runtime's copies and waits, which
    # act at step boundaries on whole buffers) do not.
    watchers = [h for h in (net.before_layer_forward + net.after_layer_forward +
                            net.before_layer_backward) if not getattr(h, 'chain_safe', False)]
    on = _kernels.active() and not (net.debug_info or watchers)
    for ch in chains:
        if backward:
            ch.bwd_done = False
            ch.bwd_active = on and ch.needs_backward and end <= ch.first and ch.last <= start
        else:
            ch.fwd_done = False
            ch.fwd_active = on and start <= ch.first and ch.last <= end


def _chains(net):
    """The net's fused chains, found once."""
    chains = net.__dict__.get('_fused_chains')
    if chains is None:
        chains = net._fused_chains = _find_chains(net)
    return chains


def _chain_heads(net):
    """kernels.chain_heads: every chain member -> its last layer, whose
    backward (first in backward order) runs the chain's."""
    return {j: ch.last for ch in _chains(net) if ch.needs_backward
            for j in range(ch.first, ch.last + 1)}


def _register_planner():
    _kernels.set_chain_planner(_begin_pass)
    _kernels.set_chain_heads(_chain_heads)


@register_engine('CUDNN')
class GPUBatchNormLayer(_FusedMixin, BatchNormLayer):
    """BatchNorm through caffeplus.kernels' cp_bn_fwd / cp_bn_bwd on the GPU."""
    engine = 'FUSED'
    _chain = None
    _chain_blob = None
    _cfg = None
    _xn_buf = _std_buf = _buf_key = None

    def _reshaped(self, bottom, top):
        self._cfg = self._dims(bottom[0])

    def forget_kept_buffers(self):
        super().forget_kept_buffers()
        self._xn_buf = self._buf_key = self._my_xn = None

    def _buffers(self, keep):
        """The layer's std and normalized copy: views of device buffers reused
        across calls (the generic code's self._std and self._x_norm)."""
        K = _kernels
        n, c, s = self._cfg
        count = n * c * s
        if self._std_buf is None or self._std_buf.size < c or not K.is_device(self._std_buf):
            self._std_buf = K.empty(c)
        if keep:
            # The kept normalized copy: the memory plan's view, else the layer's own.
            self._xn_buf = scratch.get(self, 'x_norm', count, numpy.float32, K.array_module())
        key = (self._cfg, keep, id(self._std_buf), _base_address(self._xn_buf) if keep else None)
        if key != self._buf_key:
            self._my_std = self._std_buf[:c]
            self._my_xn = _view(self._xn_buf, (n, c, s)) if keep else None
            self._buf_key = key
        self._std = self._my_std
        self._x_norm = self._my_xn
        return self._xn_buf if keep else None

    def _launch_forward(self, x, y, chain_flags=0, sc=None, bi=None):
        K = _kernels
        n, c, s = self._cfg
        b0, b1, b2 = (K.flat(b) for b in self.blobs)
        if b0 is None or b1 is None or b2 is None:
            return False
        batch = not self.use_global_stats
        keep = batch or bool(chain_flags)
        xn = self._buffers(keep)
        m = n * s
        corr = F32(m) / F32(m - 1) if m > 1 else F32(1)
        flags = (K.BN_BATCH if batch else 0) | (K.BN_KEEP if keep else 0) | chain_flags
        xn = xn if xn is not None else y
        sc = sc if sc is not None else b0
        bi = bi if bi is not None else b0
        split = self._split_kernels(('cp_bn_stats_part', 'cp_bn_fwd_apply'))
        if split is not None:
            kp, ka, P, part, kv, block = split
            if batch:
                kp((c * P,), block, (x, part, kv, K.u32(n), K.u32(c), K.u32(s), K.u32(P)))
            ka((c * P,), block, (
                x, y, xn, b0, b1, b2, self._std_buf, sc, bi, part, kv,
                K.u32(n), K.u32(c), K.u32(s), K.u32(P), K.i32(flags), self.maf, self.eps,
                F32(corr)))
            return True
        K.kernel('cp_bn_fwd')((c,), (K.channel_block(m),), (
            x, y, xn, b0, b1, b2, self._std_buf, sc, bi,
            K.u32(n), K.u32(c), K.u32(s), K.i32(flags), self.maf, self.eps, F32(corr)))
        return True

    _split_ok = True
    _split_bufs = None

    def _split_kernels(self, names):
        """(kernel, kernel, P, partial sums, K values, block) to run this layer
        over P blocks per channel; None for one block per channel."""
        K = _kernels
        n, c, s = self._cfg
        P = K.blocks_per_channel(c, n * s)
        if P <= 1 or not GPUBatchNormLayer._split_ok:
            return None
        try:
            ks = [K.kernel(name) for name in names]
        except Exception as exc:        # the extra module: keep the one-block kernels
            GPUBatchNormLayer._split_ok = False
            K.note_failure('BatchNorm split kernels', exc)
            return None
        b = self._split_bufs
        if b is None or b[0].size < 2 * c * P or not K.is_device(b[0]):
            b = self._split_bufs = (K.empty(2 * c * P, numpy.float64), K.empty(c))
        return (ks[0], ks[1], P, b[0], b[1], (K.channel_block(n * s // P),))

    def _launch_backward(self, dy, xn, std, dx, sc, bi, dsc, dbi, flags):
        K = _kernels
        n, c, s = self._cfg
        split = self._split_kernels(('cp_bn_bwd_part', 'cp_bn_bwd_apply'))
        if split is not None:
            kp, ka, P, part, _, block = split
            args = (K.u32(n), K.u32(c), K.u32(s), K.u32(P), K.i32(flags))
            if flags & (K.BN_BATCH | K.BN_DSCALE | K.BN_DBIAS):
                kp((c * P,), block, (dy, xn, sc, bi, part) + args)
            ka((c * P,), block, (dy, xn, std, dx, sc, bi, dsc, dbi, part) + args)
            return
        K.kernel('cp_bn_bwd')((c,), (K.channel_block(n * s),), (
            dy, xn, std, dx, sc, bi, dsc, dbi, K.u32(n), K.u32(c), K.u32(s), K.i32(flags)))

    def _fast_forward(self, bottom, top):
        K = _kernels
        n, c, s = self._cfg
        if not 0 < n * c * s <= K.MAX_COUNT:
            return False
        x, y = K.flat(bottom[0]), K.flat(top[0])
        if x is None or y is None:
            return False
        ch = self._chain
        if ch is not None and ch.fwd_active and ch.geometry_ok() and ch.forward(x, y):
            return True
        return self._launch_forward(x, y)

    def _forward(self, bottom, top):
        if not (_kernels.active() and _fused('BatchNorm forward', self._fast_forward, bottom, top)):
            super()._forward(bottom, top)

    def _fast_backward(self, top, propagate_down, bottom):
        K = _kernels
        n, c, s = self._cfg
        count = n * c * s
        if not 0 < count <= K.MAX_COUNT or self._std is None or self._std.size != c:
            return False
        batch = not self.use_global_stats
        xn = self._x_norm
        if batch and (xn is None or xn.size != count):
            return False
        dy, dx = K.flat(top[0], diff=True), K.flat(bottom[0], diff=True)
        if dy is None or dx is None or not K.is_device(self._std) or \
                (xn is not None and not K.is_device(xn)):
            return False
        flags = K.BN_DX | (K.BN_BATCH if batch else 0)
        self._launch_backward(dy, xn if xn is not None else dy, self._std, dx, dy, dy, dx, dx,
                              flags)
        return True

    def _backward(self, top, propagate_down, bottom):
        ch = self._chain
        if ch is not None and ch.bwd_done:
            return
        if not propagate_down[0]:
            return
        if not (_kernels.active() and _fused('BatchNorm backward', self._fast_backward, top,
                                            propagate_down, bottom)):
            super()._backward(top, propagate_down, bottom)


@register_engine('CUDNN')
class GPUScaleLayer(_FusedMixin, ScaleLayer):
    """Scale through caffeplus.kernels' cp_scale_fwd / cp_scale_bwd on the GPU."""
    engine = 'FUSED'
    _chain = None
    _keep_buf = _keep_key = None

    def _scale_grad_needed(self, bottom):
        return len(bottom) > 1 or self.param_needs_backward(0)

    def internal_buffers(self):
        """In a BatchNorm -> Scale chain the scale gradient reads BatchNorm's
        kept normalized copy: nothing of its own to keep."""
        if self._chain is not None:
            return {}
        return super().internal_buffers()

    def forget_kept_buffers(self):
        super().forget_kept_buffers()
        self._keep_buf = self._keep_key = self._my_copy = None

    def _fast_forward(self, bottom, top):
        K = _kernels
        outer, dim, inner = self.dims
        count = outer * dim * inner
        if not 0 < count <= K.MAX_COUNT:
            return False
        bid = self.bias_param_id
        if bid is not None and self.bias_dims != self.dims:
            return False
        x, y = K.flat(bottom[0]), K.flat(top[0])
        s = K.flat(self._scale_blob(bottom))
        b = K.flat(self.blobs[bid]) if bid is not None else None
        if x is None or y is None or s is None or (bid is not None and b is None):
            return False
        keep = _same_data(bottom[0], top[0]) and self._scale_grad_needed(bottom)
        flags = (K.SC_BIAS if b is not None else 0)
        kp = y
        if keep:
            self._keep_buf = kp = scratch.get(self, 'bottom_copy', count, numpy.float32,
                                              K.array_module())
            key = (self.dims, _base_address(kp))
            if key != self._keep_key:
                self._my_copy = _view(kp, self.dims)
                self._keep_key = key
            self._bottom_copy = self._my_copy
            flags |= K.SC_KEEP
        else:
            self._bottom_copy = None
        K.kernel('cp_scale_fwd')(K.elementwise_grid(count), (K.ELEMENTWISE_THREADS,), (
            x, y, kp, s, b if b is not None else s, K.u32(outer), K.u32(dim), K.u32(inner),
            K.i32(flags)))
        return True

    def _forward(self, bottom, top):
        ch = self._chain
        if ch is not None and ch.fwd_done:
            return
        if not (_kernels.active() and _fused('Scale forward', self._fast_forward, bottom, top)):
            super()._forward(bottom, top)

    def _fast_backward(self, top, propagate_down, bottom):
        K = _kernels
        outer, dim, inner = self.dims
        count = outer * dim * inner
        if not 0 < count <= K.MAX_COUNT:
            return False
        bid = self.bias_param_id
        want_db = bid is not None and self.param_needs_backward(bid)
        if want_db and self.bias_dims != self.dims:
            return False
        learned = len(bottom) == 1
        want_ds = (learned and self.param_needs_backward(0)) or \
            (not learned and propagate_down[1])
        want_dx = bool(propagate_down[0])
        if not (want_ds or want_db or want_dx):
            return True
        dy = K.flat(top[0], diff=True)
        s = K.flat(self._scale_blob(bottom))
        if dy is None or s is None:
            return False
        x = ds = db = dx = None
        flags = 0
        if want_ds:
            if _same_data(bottom[0], top[0]):
                x = self._bottom_copy
                if x is None or x.size != count or not K.is_device(x):
                    return False            # the generic code names the problem
            else:
                x = K.flat(bottom[0])
            ds = K.flat(self.blobs[0], diff=True) if learned else K.flat(bottom[1], diff=True)
            if x is None or ds is None:
                return False
            flags |= K.SC_DSCALE | (K.SC_DSCALE_ACC if learned else 0)
        if want_db:
            db = K.flat(self.blobs[bid], diff=True)
            if db is None:
                return False
            flags |= K.SC_DBIAS
        if want_dx:
            dx = K.flat(bottom[0], diff=True)
            if dx is None:
                return False
            flags |= K.SC_DX
        K.kernel('cp_scale_bwd')((dim,), (K.channel_block(outer * inner),), (
            dy, x if x is not None else dy, s, dx if dx is not None else dy,
            ds if ds is not None else dy, db if db is not None else dy,
            K.u32(outer), K.u32(dim), K.u32(inner), K.i32(flags)))
        return True

    def _backward(self, top, propagate_down, bottom):
        if _chain_backward(self, 'BatchNorm-Scale backward'):
            return
        if not (_kernels.active() and _fused('Scale backward', self._fast_backward, top,
                                            propagate_down, bottom)):
            super()._backward(top, propagate_down, bottom)


class _FusedReLUMixin:
    """ReLU (any slope) through cp_relu_fwd / cp_relu_bwd; a link of a chain."""
    _chain = None

    # Elementwise: a blob over the kernels' 32-bit count runs in pieces
    # (the generic code's temporaries would take 1-4 bytes per value more).
    def _fast_forward(self, bottom, top):
        K = _kernels
        n = bottom[0]._count
        if n <= 0:
            return False
        x, y = K.flat(bottom[0]), K.flat(top[0])
        if x is None or y is None:
            return False
        for m, (xs, ys) in _pieces(n, K.MAX_COUNT, x, y):
            K.kernel('cp_relu_fwd')(K.elementwise_grid(m), (K.ELEMENTWISE_THREADS,),
                                    (xs, ys, K.u32(m), F32(self.slope)))
        return True

    def _fast_backward(self, top, propagate_down, bottom):
        K = _kernels
        n = top[0]._count
        if n <= 0:
            return False
        ref = K.flat(top[0]) if self.slope >= 0 else K.flat(bottom[0])
        dy, dx = K.flat(top[0], diff=True), K.flat(bottom[0], diff=True)
        if ref is None or dy is None or dx is None:
            return False
        for m, (dys, refs, dxs) in _pieces(n, K.MAX_COUNT, dy, ref, dx):
            K.kernel('cp_relu_bwd')(K.elementwise_grid(m), (K.ELEMENTWISE_THREADS,),
                                    (dys, refs, dxs, K.u32(m), F32(self.slope)))
        return True


def _pieces(n, most, *arrays):
    """(count, the arrays' views) of consecutive pieces of n values, each at
    most `most`; one piece (every blob below 2**31 values) passes the
    arrays themselves, without making views on this per-layer path."""
    if n <= most:
        return [(n, arrays)]
    return [(min(most, n - o), tuple(a[o:o + most] for a in arrays)) for o in range(0, n, most)]


# The fused kernels replace cuDNN's activation for ReLU (same values; one
# launch with less Python around it): CuDNNReLULayer takes them first.
def _relu_forward(self, bottom, top):
    if self.masked:
        return self._masked_forward(bottom, top)
    ch = self._chain
    if ch is not None and ch.fwd_done:
        return
    if not (_kernels.active() and _fused('ReLU forward', self._fast_forward, bottom, top)):
        _CudnnActivationMixin._forward(self, bottom, top)


def _relu_backward(self, top, propagate_down, bottom):
    if self.masked:
        if propagate_down[0]:
            self._masked_backward(top, bottom)
        return
    if _chain_backward(self, 'BatchNorm-Scale-ReLU backward'):
        return
    if not propagate_down[0]:
        return
    if not (_kernels.active() and _fused('ReLU backward', self._fast_backward, top,
                                        propagate_down, bottom)):
        _CudnnActivationMixin._backward(self, top, propagate_down, bottom)


for _name, _value in (('_fast_forward', _FusedReLUMixin._fast_forward),
                      ('_fast_backward', _FusedReLUMixin._fast_backward),
                      ('_forward', _relu_forward), ('_backward', _relu_backward),
                      ('_chain', None)):
    setattr(CuDNNReLULayer, _name, _value)


@register_engine('CUDNN')
class GPUEltwiseLayer(_FusedMixin, EltwiseLayer):
    """Eltwise SUM through cp_axpby / cp_scale2 on the GPU (PROD and MAX: generic)."""
    engine = 'FUSED'
    _chain = None

    def _fast_forward(self, bottom, top):
        K = _kernels
        n = top[0]._count
        if not 0 < n <= K.MAX_COUNT:
            return False
        xs = [K.flat(b) for b in bottom]
        y = K.flat(top[0])
        if y is None or any(a is None for a in xs):
            return False
        grid, block, c = K.elementwise_grid(n), (K.ELEMENTWISE_THREADS,), self.coeffs
        ch = self._chain
        relu = ch is not None and ch.fwd_active and len(xs) == 2
        k = K.kernel('cp_axpby')
        k(grid, block, (xs[0], xs[1], y, K.u32(n), F32(c[0]), F32(c[1]), K.i32(relu)))
        for a, ci in zip(xs[2:], c[2:]):
            k(grid, block, (y, a, y, K.u32(n), F32(1), F32(ci), K.i32(0)))
        if relu:
            ch.fwd_done = True          # the ReLU after us has nothing left to do
        return True

    def _fast_backward(self, top, propagate_down, bottom):
        K = _kernels
        n = top[0]._count
        if not 0 < n <= K.MAX_COUNT:
            return False
        dy = K.flat(top[0], diff=True)
        outs = [(K.flat(b, diff=True), self.coeffs[i])
                for i, b in enumerate(bottom) if propagate_down[i]]
        if dy is None or any(a is None for a, _ in outs):
            return False
        _scale_diffs(dy, dy, outs, n, 0)
        return True

    def _forward(self, bottom, top):
        if not (self.op == _ELTWISE_SUM and _kernels.active() and
                _fused('Eltwise forward', self._fast_forward, bottom, top)):
            super()._forward(bottom, top)

    def _backward(self, top, propagate_down, bottom):
        ch = self._chain
        if ch is not None and ch.bwd_done:
            return
        if not (self.op == _ELTWISE_SUM and _kernels.active() and
                _fused('Eltwise backward', self._fast_backward, top, propagate_down, bottom)):
            super()._backward(top, propagate_down, bottom)


@register_engine('CUDNN')
class GPUSplitLayer(SplitLayer):
    """Split whose backward sums the top diffs with cp_axpby on the GPU."""
    engine = 'FUSED'

    def _fast_backward(self, top, propagate_down, bottom):
        K = _kernels
        n = bottom[0]._count
        if len(top) < 2 or not 0 < n <= K.MAX_COUNT:
            return False
        ds = [K.flat(t, diff=True) for t in top]
        dx = K.flat(bottom[0], diff=True)
        if dx is None or any(a is None for a in ds):
            return False
        grid, block = K.elementwise_grid(n), (K.ELEMENTWISE_THREADS,)
        k = K.kernel('cp_axpby')
        one, no = F32(1), K.i32(0)
        k(grid, block, (ds[0], ds[1], dx, K.u32(n), one, one, no))
        for a in ds[2:]:
            k(grid, block, (dx, a, dx, K.u32(n), one, one, no))
        return True

    def _backward(self, top, propagate_down, bottom):
        if not propagate_down[0]:
            return
        if not (_kernels.active() and
                _fused('Split backward', self._fast_backward, top, propagate_down, bottom)):
            super()._backward(top, propagate_down, bottom)



_NOT_QUEUED = object()      # GPUSoftmaxWithLossLayer: its forward's report is checked at once


@register_engine('CUDNN')
class GPUSoftmaxWithLossLayer(SoftmaxWithLossLayer):
    """SoftmaxWithLoss (one top) through caffeplus.kernels on the GPU: three
    kernels forward (the last writes the loss's normalizer, the label check,
    and the loss and its weight for Layer.forward's weighted loss into pinned
    host memory) and one synchronisation, when the loss is read (the
    solver's, after the update is queued: forward_deferred), one kernel
    backward; the generic code makes two host synchronisations and about
    twenty CuPy operations each way."""
    engine = 'FUSED'
    _bufs = None
    _fwd_key = None

    def forward(self, bottom, top):
        """Layer.forward, with the weighted loss from the fused forward's read-back."""
        loss = self.forward_deferred(bottom, top)
        return loss() if callable(loss) else loss

    def forward_deferred(self, bottom, top):
        """Layer.forward_deferred: the fused forward's report is read (and its
        label check raised) when the loss is."""
        if not _kernels.active():
            return self._run_forward(bottom, top, deferred=True)
        self._queued_report = None
        try:
            self._forward(bottom, top)
            report = self._queued_report
        except Exception as exc:        # out of GPU memory: name the layer
            from caffeplus.layer import _reraise_out_of_memory
            _reraise_out_of_memory(self, 'forward', exc)
            raise
        finally:
            del self._queued_report     # back to the class's: reports are checked at once
        if report is not None and len(self.loss_weights) == 1:
            return report.loss if self.loss_weights[0] else report.check
        if report is not None:
            report.check()
        return self.weighted_loss(top, deferred=True)

    def _fast_forward(self, bottom, top):
        K = _kernels
        if len(top) != 1:
            return False
        outer, classes, inner = self.outer_num, self.num_classes, self.inner_num
        rows = outer * inner
        if not (0 < bottom[0]._count <= K.MAX_COUNT and rows > 0 and classes > 0):
            return False
        x, lab, y = K.flat(bottom[0]), K.flat(bottom[1]), K.flat(top[0])
        if x is None or lab is None or y is None:
            return False
        b = self._bufs
        if b is None or b[0].size < rows or not K.is_device(b[0]):
            b = self._bufs = (K.empty(rows), K.empty(rows), K.empty(2), K.empty(5))
            b[2][:] = 0
        rowloss, rowvalid, err, info = b
        ign = self.ignore_label
        args = (K.u32(outer), K.u32(classes), K.u32(inner), K.i32(ign is not None),
                K.i32(ign if ign is not None else 0))
        K.kernel('cp_softmax_loss_rows')((rows,), (_row_block(classes),),
                                         (x, lab, rowloss, rowvalid, err) + args)
        K.kernel('cp_softmax_loss_total')((1,), (256,), (
            rowloss, rowvalid, err, y, info, K.u32(rows), K.i32(self.normalization),
            K.u32(outer), K.u32(inner)))
        self._args = args
        self._fwd_key = (bottom[0]._shape, bottom[1]._shape)
        dtop = K.flat(top[0], diff=True)
        report = self._launch_report(info, y, dtop)
        if self._queued_report is _NOT_QUEUED:
            report.check()          # a synchronous forward: the label check now
        else:
            self._queued_report = report
        return True

    _pinned = None
    _queued_report = _NOT_QUEUED    # forward_deferred sets None: queue the report
    _outstanding = None             # the report in the pinned buffer, not read yet

    def _launch_report(self, info, y, dtop):
        """[normalizer, label error flag, its value, loss, loss weight],
        written by cp_loss_report straight into pinned memory (no copy on the
        copy engines: behind offload's copies there it waited for
        milliseconds); the _LossReport reads it with one synchronisation."""
        K = _kernels
        if self._outstanding is not None:
            self._outstanding.read()        # the buffer is about to be written again
        if K.emulating():
            out = numpy.zeros(5, numpy.float32)
            K.kernel('cp_loss_report')((1,), (32,), (info, y, dtop if dtop is not None else y,
                                                     out, K.i32(dtop is not None)))
            return _LossReport(self, out, None, dtop is not None)
        import cupy
        if self._pinned is None:
            mem = cupy.cuda.alloc_pinned_memory(5 * 4)
            self._pinned = (mem, numpy.frombuffer(mem, numpy.float32, 5))
        out = self._pinned[1]
        K.kernel('cp_loss_report')((1,), (32,), (
            info, y, dtop if dtop is not None else y, numpy.uint64(out.ctypes.data),
            K.i32(dtop is not None)))
        done = cupy.cuda.Event(disable_timing=True)
        done.record()
        self._outstanding = _LossReport(self, out, done, dtop is not None)
        return self._outstanding

    def _label_error(self, value):
        self._fwd_key = None
        ign = self.ignore_label
        self._fail('label value %g is out of range: labels must be integers in '
                   '[0, %d)%s' % (value, self.num_classes, '' if ign is None else
                                  ' or loss_param.ignore_label (%d)' % ign))

    def _forward(self, bottom, top):
        self._fwd_key = None
        if not (_kernels.active() and
                _fused('SoftmaxWithLoss forward', self._fast_forward, bottom, top)):
            super()._forward(bottom, top)

    def _fast_backward(self, top, propagate_down, bottom):
        K = _kernels
        if self._fwd_key != (bottom[0]._shape, bottom[1]._shape) or self._bufs is None:
            return False            # the normalizer comes from a fused forward
        x, lab = K.flat(bottom[0]), K.flat(bottom[1])
        dtop, dx = K.flat(top[0], diff=True), K.flat(bottom[0], diff=True)
        if x is None or lab is None or dtop is None or dx is None:
            return False
        K.kernel('cp_softmax_loss_bwd')((self.outer_num * self.inner_num,),
                                        (_row_block(self.num_classes),),
                                        (x, lab, dtop, self._bufs[3], dx) + self._args)
        return True

    def _backward(self, top, propagate_down, bottom):
        self._check_propagate(propagate_down)
        if not propagate_down[0]:
            return
        if not (_kernels.active() and _fused('SoftmaxWithLoss backward', self._fast_backward, top,
                                            propagate_down, bottom)):
            super()._backward(top, propagate_down, bottom)


def _row_block(classes):
    return 32 if classes <= 64 else 128 if classes <= 512 else 256


class _LossReport:
    """A fused SoftmaxWithLoss forward's report in pinned memory, read once
    (after its event): the label check, then the weighted loss."""

    def __init__(self, layer, out, event, has_dtop):
        self.layer, self._out, self._event, self._has_dtop = layer, out, event, has_dtop
        self._host = None

    def read(self):
        if self._host is None:
            if self._event is not None:
                self._event.synchronize()
            self._host = self._out.copy()
            if self.layer._outstanding is self:
                self.layer._outstanding = None
        return self._host

    def check(self):
        """Raise the label check's error, if any; the weighted loss is 0.0
        (a loss weight of 0)."""
        host = self.read()
        if float(host[1]):
            self.layer._label_error(float(host[2]))
        return 0.0

    def loss(self):
        self.check()
        host = self.read()
        if not self._has_dtop:
            return 0.0
        # Layer.forward's float(dot(top, top diff)) of one float32 value each
        return float(numpy.float32(host[3]) * numpy.float32(host[4]))


@register_engine('CUDNN')
class GPUInnerProductLayer(InnerProductLayer):
    """InnerProduct on the GPU as cublasGemmEx calls on the blobs' storage
    (caffeplus.backend.blas): no views, no temporaries. The weight gradient
    accumulates inside its GEMM (beta = 1; the generic code makes a
    weight-sized temporary and adds it, a pass over 150-400 MB for AlexNet's
    and VGG's fc6), the bias gradient is one GEMM with a ones vector
    (beta = 1), the bias is added by a rank-1 GEMM (k = 1: exactly y + b,
    as the generic code). The matrix products follow the math mode (TF32
    or strict FP32, CUBLAS_COMPUTE_32F); the bias sums are FP32 always.
    Under a placing plan on Hopper the GEMMs run on caffeplus's own cuBLAS
    handle with workspace the plan placed for this layer's forward and
    backward steps (`gemm_views`; caffeplus.memory.cublas_pool)."""
    engine = 'FUSED'
    _ones = None
    gemm_views = {}         # 'forward' | 'backward' -> (pointer, bytes), set by the plan

    def _ones_ptr(self, n):
        K = _kernels
        if self._ones is None or self._ones.size < n or not K.is_device(self._ones):
            import cupy
            self._ones = cupy.ones(max(int(n), 1), dtype=numpy.float32)
        return int(self._ones.data.ptr)

    def _usable(self):
        K = _kernels
        if K.emulating():
            return False
        limit = 2 ** 31 - 1       # cuBLAS's int dimensions
        return 0 < self.M <= limit and 0 < self.K <= limit and 0 < self.num_output <= limit

    def _fast_forward(self, bottom, top):
        K = _kernels
        if not self._usable():
            return False
        x, w, y = K.flat(bottom[0]), K.flat(self.blobs[0]), K.flat(top[0])
        bias = K.flat(self.blobs[1]) if self.bias_term else None
        if x is None or w is None or y is None or (self.bias_term and bias is None):
            return False
        M, N, Kd = self.M, self.num_output, self.K
        xp, wp, yp = int(x.data.ptr), int(w.data.ptr), int(y.data.ptr)
        ws = self.gemm_views.get('forward')
        if self.transpose:          # W is K x N: y = x W
            blas.gemm(blas.N, blas.N, N, M, Kd, wp, N, xp, Kd, yp, N, workspace=ws)
        else:                       # W is N x K: y = x W^T
            blas.gemm(blas.T, blas.N, N, M, Kd, wp, Kd, xp, Kd, yp, N, workspace=ws)
        if bias is not None:        # y += 1 b^T
            blas.gemm(blas.N, blas.N, N, M, 1, int(bias.data.ptr), N, self._ones_ptr(M), 1, yp, N,
                      beta=1.0, tf32=False, workspace=ws)
        return True

    def _forward(self, bottom, top):
        if not (_kernels.active() and
                _fused('InnerProduct forward', self._fast_forward, bottom, top)):
            super()._forward(bottom, top)

    def _fast_backward(self, top, propagate_down, bottom):
        K = _kernels
        if not self._usable():
            return False
        M, N, Kd = self.M, self.num_output, self.K
        want_w = self.param_needs_backward(0)
        want_b = self.bias_term and self.param_needs_backward(1)
        dy, x = K.flat(top[0], diff=True), K.flat(bottom[0])
        dw = K.flat(self.blobs[0], diff=True) if want_w else None
        db = K.flat(self.blobs[1], diff=True) if want_b else None
        dx = K.flat(bottom[0], diff=True) if propagate_down[0] else None
        w = K.flat(self.blobs[0]) if propagate_down[0] else None
        if dy is None or x is None or (want_w and dw is None) or (want_b and db is None) or \
                (propagate_down[0] and (dx is None or w is None)):
            return False
        dyp, xp = int(dy.data.ptr), int(x.data.ptr)
        ws = self.gemm_views.get('backward')
        if want_w:
            if self.transpose:      # W is K x N: dW += x^T dy
                blas.gemm(blas.N, blas.T, N, Kd, M, dyp, N, xp, Kd, int(dw.data.ptr), N, beta=1.0,
                          workspace=ws)
            else:                   # W is N x K: dW += dy^T x
                blas.gemm(blas.N, blas.T, Kd, N, M, xp, Kd, dyp, N, int(dw.data.ptr), Kd, beta=1.0,
                          workspace=ws)
        if want_b:                  # db += dy^T 1
            blas.gemm(blas.N, blas.N, N, 1, M, dyp, N, self._ones_ptr(M), M, int(db.data.ptr), N,
                      beta=1.0, tf32=False, workspace=ws)
        if propagate_down[0]:
            if self.transpose:      # dx = dy W^T
                blas.gemm(blas.T, blas.N, Kd, M, N, int(w.data.ptr), N, dyp, N, int(dx.data.ptr),
                          Kd, workspace=ws)
            else:                   # dx = dy W
                blas.gemm(blas.N, blas.N, Kd, M, N, int(w.data.ptr), Kd, dyp, N, int(dx.data.ptr),
                          Kd, workspace=ws)
        return True

    def _backward(self, top, propagate_down, bottom):
        if not (_kernels.active() and _fused('InnerProduct backward', self._fast_backward, top,
                                            propagate_down, bottom)):
            super()._backward(top, propagate_down, bottom)


@register_engine('CUDNN')
class GPUConcatLayer(ConcatLayer):
    """Concat on the GPU: one cudaMemcpy2DAsync per bottom each way (the
    bottom's rows into their column range of the top), instead of a strided
    CuPy copy through sliced views."""
    engine = 'FUSED'

    def _copies(self, bottom, top, backward):
        K = _kernels
        if len(bottom) < 2 or K.emulating():
            return False
        axis = self.axis
        shape = top[0].shape
        outer = _prod(shape[:axis])
        inner = _prod(shape[axis + 1:]) * FLOAT_BYTES
        pitch = int(shape[axis]) * inner
        y = K.flat(top[0], diff=backward)
        if y is None:
            return False
        ends = []
        for i, b in enumerate(bottom):
            if backward and not self._propagate[i]:
                ends.append(None)
                continue
            a = K.flat(b, diff=backward)
            if a is None:
                return False
            ends.append(int(a.data.ptr))
        import cupy
        runtime = cupy.cuda.runtime
        stream = cupy.cuda.get_current_stream().ptr
        base, off = int(y.data.ptr), 0
        for b, p in zip(bottom, ends):
            width = int(b.shape[axis]) * inner
            if p is not None and width and outer:
                if backward:
                    runtime.memcpy2DAsync(p, width, base + off, pitch, width, outer,
                                          runtime.memcpyDeviceToDevice, stream)
                else:
                    runtime.memcpy2DAsync(base + off, pitch, p, width, width, outer,
                                          runtime.memcpyDeviceToDevice, stream)
            off += width
        return True

    def _forward(self, bottom, top):
        if not (_kernels.active() and _fused('Concat forward', self._copies, bottom, top, False)):
            super()._forward(bottom, top)

    def _backward(self, top, propagate_down, bottom):
        self._propagate = list(propagate_down)
        if not (_kernels.active() and _fused('Concat backward', self._copies, bottom, top, True)):
            super()._backward(top, propagate_down, bottom)


_register_planner()
