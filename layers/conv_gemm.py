"""Convolution as im2col (or im2row) + cuBLAS: the variant timed search
weighs beside cuDNN's algorithms (variant 2 of a call site).
"""
import numpy

from caffeplus import kernels as _kernels
from caffeplus.backend import blas
from caffeplus.cudnn.algo_search import (FLOAT_BYTES, _gemm_1x1_search, _gemm_search, _prod,
                                         _rows_search, median_ms)


GEMM_MAX_CHANNELS = 4           # input channels up to which it is timed (image layers)
GEMM_CHUNK_BYTES = 256 << 20    # column buffer of one batch chunk, at most
# im2row's buffer of one batch chunk, at most: within the room a site is
# timed in (caffeplus.memory.workspace), near the whole batch's speed
# (AlexNet's conv1 at b128 in BFLOAT16 on the H100, dev/im2row_probe.py:
# forward 0.54 ms over chunks of 16 images, 0.46 over the whole batch).
ROWS_CHUNK_BYTES = 32 << 20
ROWS_ALIGN = 8                  # values a row is padded to (16 bytes of 16-bit values)
ROWS_TILE = 12288               # cp_im2row's shared tile, values (CP_IM2ROW_TILE)


class _DeviceOps:
    """What _GemmConv launches: cp_im2col and cuBLAS (device pointers as ints)."""

    @staticmethod
    def im2col(x, col, n0, nb, g):
        total = g.K * nb * g.P
        _kernels.kernel('cp_im2col', g.dtype)(
            _kernels.elementwise_grid(total), (_kernels.ELEMENTWISE_THREADS,),
            (numpy.uint64(x), numpy.uint64(col), numpy.uint64(total), _kernels.i32(n0),
             _kernels.i32(nb), _kernels.i32(g.c), _kernels.i32(g.h), _kernels.i32(g.w),
             _kernels.i32(g.kh), _kernels.i32(g.kw), _kernels.i32(g.oh), _kernels.i32(g.ow),
             _kernels.i32(g.sh), _kernels.i32(g.sw), _kernels.i32(g.ph), _kernels.i32(g.pw),
             _kernels.i32(g.dh), _kernels.i32(g.dw)))

    @staticmethod
    def im2row(x, rows, n0, nb, g):
        i32 = _kernels.i32
        _kernels.kernel('cp_im2row', g.dtype)(
            (nb * g.oh,), (256,),
            (numpy.uint64(x), numpy.uint64(rows), i32(n0), i32(g.c), i32(g.h), i32(g.w),
             i32(g.kh), i32(g.oh), i32(g.ow), i32(g.sh), i32(g.sw), i32(g.ph), i32(g.pw),
             i32(g.dh), i32(g.w + 2 * g.pw), i32(g.KP), numpy.uint64(g.taps_ptr())))

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
    ResNet-50's shapes on the H100 (dev/gemm_1x1_probe.py: forward
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
    (In cuBLAS's column-major terms each C-ordered r x c matrix is c x r.)

    A 16-bit layer's maps, columns and weights are 16-bit (the GEMMs' sums
    float32, on the tensor cores); the per-image partial filter gradients
    are float32, summed into the FP32 master's gradient as in FP32.

    Over channels-last maps (`nhwc`) a 1x1 convolution's whole batch is one
    matrix of N*H*W rows of C values, and each call one GEMM: y = x W^T,
    dx = dy W, dW += dy^T x (the sums float32 into the master's gradient;
    a 1x1 filter's channels-last copy is its Caffe-order one). cuDNN's
    channels-last algorithms took 3-5x cuBLAS's time on ResNet-50's 1x1
    convolutions (timed search's records, b64: 0.32 ms against 0.076).

    An image layer writing channels-last maps from an image in Caffe's order
    (`rows`: nhwc, not 1x1) runs im2row: row b*P + p of a chunk holds output
    pixel p's window, KP values (Caffe's (c, i, j) order, zero past K), and
    y (B*P x M, channels-last) = rows W^T, one GEMM a chunk, W the (M x KP)
    copy of the weights in the maps' type (row_weights); the filter
    gradient dW (float32, Caffe's order) += dy^T rows, a GEMM a chunk. In
    BFLOAT16 PyTorch's cuDNN took 0.98 ms over AlexNet's conv1 forward at
    b128, im2row and cuBLAS 0.46-0.54 (H100, dev/im2row_probe.py)."""

    def __init__(self, layer, dtype=numpy.float32, nhwc=False):
        self.dtype = numpy.dtype(dtype)
        self.nhwc = bool(nhwc)
        self.type_name = self.dtype.name            # cuBLAS's operand type
        E = self.itemsize = self.dtype.itemsize
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
        self.rows = self.nhwc and not self.direct
        self.KP = -(-self.K // ROWS_ALIGN) * ROWS_ALIGN
        self._taps = self._wrows = None
        if self.rows:
            if not self.rows_ok(layer):
                raise ValueError('channels-last maps: 1x1 stride-1 convolutions, or image '
                                 'layers im2row can index')
            per_image = self.KP * self.P * E
            chunks = -(-self.n // max(1, min(self.n, ROWS_CHUNK_BYTES // per_image)))
            self.B = -(-self.n // chunks)           # chunks as even as they go
            self.col_bytes = -(-self.B * per_image // 256) * 256
        elif self.nhwc:     # one GEMM a call: no columns, no partials
            self.B, self.col_bytes = self.n, 0
        elif self.direct:   # no columns; partial filter gradients of B images
            self.B = max(1, min(self.n, GEMM_CHUNK_BYTES // max(1, self.m * self.K *
                                                                FLOAT_BYTES)))
            self.col_bytes = 0
        else:
            self.B = max(1, min(self.n, GEMM_CHUNK_BYTES // max(1, self.K * self.P * E)))
            self.col_bytes = -(-self.K * self.B * self.P * E // 256) * 256
        self.part_bytes = 0 if self.nhwc else self.B * self.m * self.K * FLOAT_BYTES
        self._ones = None

    @staticmethod
    def is_direct(layer):
        g = layer.geom
        return tuple(g.kernel) == (1, 1) and tuple(g.stride) == (1, 1) and \
            tuple(g.pad) == (0, 0) and tuple(g.dilation) == (1, 1)

    @staticmethod
    def rows_ok(layer):
        """Whether im2row can make `layer`'s rows: its taps (c << 16 | i << 8
        | j*DW) index the window, and the input rows one output row covers
        (C x KH rows of W + 2*PW values) fit its shared tile."""
        g = layer.geom
        kh, kw = (int(k) for k in g.kernel)
        dw = int(g.dilation[1])
        width = int(layer.in_spatial[1]) + 2 * int(g.pad[1])
        return layer.channels < (1 << 15) and kh < 256 and (kw - 1) * dw < 256 and \
            layer.channels * kh * width <= ROWS_TILE

    def taps_ptr(self):
        """Device address of im2row's taps (made once)."""
        if self._taps is None:
            import cupy
            taps = numpy.full(self.KP, -1, numpy.int32)
            c, i, j = numpy.unravel_index(numpy.arange(self.K), (self.c, self.kh, self.kw))
            taps[:self.K] = c << 16 | i << 8 | j * self.dw
            self._taps = cupy.asarray(taps)
        return int(self._taps.data.ptr)

    def row_weights(self, master=None):
        """Device address of the (M x KP) weights im2row's forward reads, in
        the maps' type, refreshed from the FP32 master `master` (a device
        array of the layer's weights; None: as they are, zeros at first)."""
        import cupy
        if self._wrows is None:
            self._wrows = cupy.zeros((self.m, self.KP), self.dtype)
        if master is not None:
            cupy.copyto(self._wrows[:, :self.K], master.reshape(self.m, self.K),
                        casting='same_kind')
        return int(self._wrows.data.ptr)

    @staticmethod
    def eligible(layer, rows=False):
        """Whether timed search weighs this variant for `layer` (`rows`: as
        im2row over an image in Caffe's order, writing channels-last maps)."""
        if layer.reverse or layer.group != 1 or layer.num_spatial != 2 or layer.num <= 0 or \
                _prod(layer.out_spatial) <= 0:
            return False
        if _GemmConv.is_direct(layer):
            return _gemm_1x1_search()
        if layer.channels > GEMM_MAX_CHANNELS:
            return False
        if rows:
            return _rows_search() and _GemmConv.rows_ok(layer)
        sixteen_bit = getattr(layer, 'activation_dtype', numpy.dtype(numpy.float32)).itemsize != 4
        return _gemm_search(sixteen_bit)

    def kinds(self):
        """The calls this variant can make."""
        return ('fwd', 'bwd_data', 'bwd_filter') if self.direct else ('fwd', 'bwd_filter')

    def memory(self, kind):
        return self.col_bytes + (self.part_bytes if kind == 'bwd_filter' else 0)

    def _images(self, x, n0):
        """(A, lda, stride) of images n0.. as column-major P x K matrices."""
        return x + n0 * self.K * self.P * self.itemsize, self.P, self.K * self.P

    def chunks(self):
        for n0 in range(0, self.n, self.B):
            yield n0, min(self.B, self.n - n0)

    def forward(self, x, w, y, ws, tf32=None, ops=_DeviceOps):
        """y = conv(x, w) (no bias) on device pointers; ws: the column buffer
        (`rows`: w is row_weights())."""
        M, K, P, t = self.m, self.K, self.P, self.type_name
        if self.rows:       # (column-major: y is M x BP, the rows KP x BP, w KP x M)
            for n0, nb in self.chunks():
                ops.im2row(x, ws, n0, nb, self)
                ops.gemm(blas.T, blas.N, M, nb * P, self.KP, w, self.KP, ws, self.KP,
                         y + n0 * M * P * self.itemsize, M, tf32=tf32, ab_type=t, c_type=t)
            return
        if self.nhwc:       # (column-major: y is M x NP, x K x NP, w K x M)
            ops.gemm(blas.T, blas.N, M, self.n * P, K, w, K, x, K, y, M, tf32=tf32, ab_type=t,
                     c_type=t)
            return
        if self.direct:
            ops.gemm_strided_batched(blas.N, blas.N, P, M, K, x, P, K * P, w, K, 0, y, P, M * P,
                                     self.n, tf32=tf32, ab_type=t, c_type=t)
            return
        for n0, nb in self.chunks():
            ops.im2col(x, ws, n0, nb, self)
            ops.gemm_strided_batched(blas.N, blas.N, P, M, K, ws, nb * P, P, w, K, 0,
                                     y + n0 * M * P * self.itemsize, P, M * P, nb, tf32=tf32,
                                     ab_type=t, c_type=t)

    def backward_data(self, dy, w, dx, tf32=None, ops=_DeviceOps):
        """dx = the data gradient (direct only; written, as cuDNN's beta 0)."""
        M, K, P, t = self.m, self.K, self.P, self.type_name
        if self.nhwc:
            ops.gemm(blas.N, blas.N, K, self.n * P, M, w, K, dy, M, dx, K, tf32=tf32, ab_type=t,
                     c_type=t)
            return
        ops.gemm_strided_batched(blas.N, blas.T, P, K, M, dy, P, M * P, w, K, 0, dx, P, K * P,
                                 self.n, tf32=tf32, ab_type=t, c_type=t)

    def ones(self, nb):
        if self._ones is None or self._ones.size < nb:
            import cupy
            self._ones = cupy.ones(max(int(nb), 1), dtype=numpy.float32)
        return int(self._ones.data.ptr)

    def backward_filter(self, x, dy, dw, ws, tf32=None, ops=_DeviceOps, ones=None):
        """dw (float32) += the filter gradient on device pointers; ws: columns,
        then the float32 partials."""
        M, K, P, t = self.m, self.K, self.P, self.type_name
        if self.rows:       # dW^T (K x M, column-major) += the rows' first K of each x dy
            for n0, nb in self.chunks():
                ops.im2row(x, ws, n0, nb, self)
                ops.gemm(blas.N, blas.T, K, M, nb * P, ws, self.KP,
                         dy + n0 * M * P * self.itemsize, M, dw, K, beta=1.0, tf32=tf32,
                         ab_type=t, c_type='float32')
            return
        if self.nhwc:
            ops.gemm(blas.N, blas.T, K, M, self.n * P, x, K, dy, M, dw, K, beta=1.0, tf32=tf32,
                     ab_type=t, c_type='float32')
            return
        part = ws + self.col_bytes
        for n0, nb in self.chunks():
            if self.direct:
                a, lda, stride = self._images(x, n0)
            else:
                ops.im2col(x, ws, n0, nb, self)
                a, lda, stride = ws, nb * P, P
            ops.gemm_strided_batched(blas.T, blas.N, K, M, P, a, lda, stride,
                                     dy + n0 * M * P * self.itemsize, P, M * P, part, K, M * K,
                                     nb, tf32=tf32, ab_type=t, c_type='float32')
            ops.gemm(blas.N, blas.N, M * K, 1, nb, part, M * K,
                     ones if ones is not None else self.ones(nb), nb, dw, M * K, beta=1.0,
                     tf32=False)

    def time(self, kind, xa, wa, ya, wsp):
        """Milliseconds of one call of `kind` on scratch arrays (median of 3),
        in the workspace at device address `wsp` (at least memory(kind) bytes)."""
        import cupy
        wsp = int(wsp or 0)
        x, w, y = int(xa.data.ptr), int(wa.data.ptr), int(ya.data.ptr)
        if self.rows:
            w = self.row_weights()
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
        return median_ms(run)
