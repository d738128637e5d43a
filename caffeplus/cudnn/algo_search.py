"""Convolution descriptors and the algorithm search over them: cuDNN's
heuristics or FindEx timings (shared by every layer of one geometry, as
cudnn.benchmark does), the variants timed beside cuDNN's own calls (per
group, batch slices, im2col + cuBLAS) and the switches that enable them.
"""
import statistics

import numpy

from caffeplus.backend import mathmode
from caffeplus.cudnn import api

FLOAT_BYTES = 4


def _prod(shape):
    n = 1
    for d in shape:
        n *= int(d)
    return n


def median_ms(run, reps=3):
    """Device milliseconds of run() (the median of `reps` calls, after one more)."""
    import cupy
    run()
    times = []
    for _ in range(reps):
        e0, e1 = cupy.cuda.Event(), cupy.cuda.Event()
        e0.record()
        run()
        e1.record()
        e1.synchronize()
        times.append(cupy.cuda.get_elapsed_time(e0, e1))
    return statistics.median(times)


def _contiguous_strides(shape):
    strides, acc = [], 1
    for d in reversed(shape):
        strides.insert(0, acc)
        acc *= int(d)
    return strides


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
            # (An image input padded to 4 channels: _CudnnConvolutionMixin.padded_channels.)
            xsp, ysp, cy = layer.in_spatial, layer.out_spatial, layer.num_output
            cx = getattr(layer, 'padded_channels', 0) or layer.channels
        group = layer.group
        G = group if split else 1
        nc = n // chunks
        x_full = (n, cx) + tuple(xsp)
        y_full = (n, cy) + tuple(ysp)
        self.x_full, self.y_full = x_full, y_full
        # A 16-bit net's maps, and the 16-bit copies of the weights its layer
        # keeps, are described as such; cuDNN accumulates in float32.
        dtype = self.dtype = numpy.dtype(getattr(layer, 'activation_dtype', numpy.float32))
        size = dtype.itemsize
        # Channels-last maps (caffeplus.layout; groups by cuDNN's group count,
        # never split into calls): their strides, and filters in cuDNN's
        # channels-last order (K, kh, kw, C), which its channels-last
        # backward calls need.
        self.nhwc = nhwc = bool(getattr(layer, 'compute_nhwc', False))
        strides = api.nhwc_strides if nhwc else _contiguous_strides
        self.x = api.TensorDesc((nc, cx // G) + tuple(xsp), strides(x_full), dtype)
        self.y = api.TensorDesc((nc, cy // G) + tuple(ysp), strides(y_full), dtype)
        w_shape = tuple(layer.blobs[0].shape)
        if not layer.reverse and cx != w_shape[1] * group:
            w_shape = (w_shape[0], cx) + w_shape[2:]
        self.w_shape = w_shape
        self.w = api.FilterDesc((w_shape[0] // G,) + tuple(w_shape[1:]), dtype,
                                layout=api.NHWC if nhwc else api.NCHW)
        geom = layer.geom
        # 16-bit: tensor cores whatever the FP32 math mode (FMA math offers
        # cuDNN's CUDA-core kernels only).
        self.math = mathmode.cudnn_math_type() if size == FLOAT_BYTES else api.TENSOR_OP_MATH
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
            self.x_off = nc * cx * _prod(xsp) * size
            self.y_off = nc * cy * _prod(ysp) * size
            self.w_off = self.b_off = 0
        else:
            self.loops = G
            self.x_off = (cx // G) * _prod(xsp) * size
            self.y_off = (cy // G) * _prod(ysp) * size
            self.w_off = (_prod(w_shape) // G) * size
            self.b_off = (m // G) * size
        self.bias = api.TensorDesc((1, m // G) + (1,) * len(geom.kernel), dtype=dtype) \
            if layer.bias_term else None
        self.top = self.x if layer.reverse else self.y
        self.top_off = self.x_off if layer.reverse else self.y_off
        self.top_full = x_full if layer.reverse else y_full
        self.bias_part = None       # _bias_gradient's partial sums in Caffe's order
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

    def timer(self, kind, geometry_key=None, per_group=None, gemm=None, chunked=None, s2d=None):
        """A callable that times `kind` with FindEx on scratch arrays. With a
        geometry key, results are shared by every layer of that geometry
        (ResNet-50 repeats most of its convolutions), as cudnn.benchmark does.
        `per_group` (the split descriptors of a grouped convolution) adds its
        candidates, variant 1, timed as one call per group; `gemm` (a
        _GemmConv) adds cuBLAS, variant 2, for the calls it makes;
        `chunked` ({variant: batch-sliced descriptors}) adds each slicing's
        candidates, timed as one call per slice; `s2d` (a _SpaceToDepthConv)
        adds its candidates, variant S2D_VARIANT."""
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
                                tuple(sorted(chunked)), s2d is not None)
            if key is not None:
                found = _timed_within(key, len(geometry_key) + 1)
                if found is not None:
                    return found
            import cupy
            xa, ya, wa = (cupy.random.standard_normal(shape, dtype=numpy.float32).astype(
                self.dtype, copy=False) for shape in scratch)
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
                if s2d is not None and kind in s2d.kinds() and \
                        s2d.least_memory(kind) <= ws_bytes:
                    found = sorted(found + s2d.time(kind, xa, wa, ya, ws_ptr, ws_bytes),
                                   key=lambda c: c.time)
            finally:
                del xa, ya, wa
            if key is not None and found:
                _TIMED[key] = list(found)
            return found
        # What run() allocates besides the workspace (the workspace manager
        # keeps the search within the room a plan leaves: _time_sites).
        run.scratch_bytes = self.dtype.itemsize * sum(_prod(shape) for shape in scratch)
        if gemm is not None and kind == 'bwd_filter':
            run.scratch_bytes += FLOAT_BYTES * _prod(self.w_shape)     # its filter gradient
        # The workspace the cuBLAS variant is timed in (within the search's).
        run.variant_bytes = max(
            gemm.memory(kind) if gemm is not None and kind in gemm.kinds() else 0,
            s2d.memory(kind) if s2d is not None and kind in s2d.kinds() else 0)
        return run


GEMM_ALGO = 100                 # AlgoChoice.algo of the im2col + GEMM variant
# The space-to-depth variant (layers/conv_s2d.py): its AlgoChoice.algo is
# S2D_ALGO plus its batch slicing and cuDNN's algorithm of its inner
# stride-1 call (api.s2d_parts).
S2D_VARIANT = 6
S2D_ALGO = 200


# Timed search weighs cuBLAS for 1x1 stride-1 convolutions (_GemmConv.direct).
GEMM_1X1_SEARCH = True
# Timed search also times im2col + GEMM for convolutions over few input
# channels (FP32 layers: GEMM_SEARCH; 16-bit ones: GEMM_SEARCH_SIXTEEN_BIT).
# Both off: AlexNet's FP32 time did not move with it (H100); in 16 bits
# torchvision's AlexNet b128 took 5.4-5.7 ms with it against 5.8 without
# (H200, separate runs, within their spread) and peaked 90 MiB higher, as a
# chosen variant's column buffer (up to GEMM_CHUNK_BYTES) enlarges the arena.
GEMM_SEARCH = False
GEMM_SEARCH_SIXTEEN_BIT = False
# Timed search also times im2row + GEMM (layers/conv_gemm.py, `rows`) for an
# image layer that writes channels-last maps from an image in Caffe's order
# (a 16-bit net's first convolution). Off: on BVLC's AlexNet in BFLOAT16
# (H100) search took it for conv1's forward (0.59 ms timed, against 0.77-0.79
# over pixel blocks), yet the step took 6.6 and 6.5 ms against 6.2 and 6.5
# without it, peaking 30-40 MiB higher with its rows' workspace
# (benchmarks/gpu_16bit_alexnet_rows_ab_9372dc2_h100.json).
GEMM_ROWS_SEARCH = False
# Timed search also times a strided convolution over few input channels as a
# stride-1 convolution over space-to-depth blocks (FP32 layers: S2D_SEARCH;
# 16-bit ones: S2D_SEARCH_SIXTEEN_BIT).
S2D_SEARCH = True
S2D_SEARCH_SIXTEEN_BIT = True
# Timed search also times each call over halves, quarters and eighths of the
# batch (CHUNK_VARIANTS).
CHUNK_SEARCH = True
# Timed search also times grouped convolutions one call per group.
PER_GROUP_SEARCH = True


def _gemm_1x1_search():
    return GEMM_1X1_SEARCH


def _gemm_search(sixteen_bit=False):
    # The gemm_search setting (CAFFEPLUS_GEMM_SEARCH) 'on' or 'off' overrides
    # both switches (benchmarks weigh both).
    from caffeplus import config
    setting = config.get('gemm_search')
    if setting != 'plan':
        return setting == 'on'
    return GEMM_SEARCH_SIXTEEN_BIT if sixteen_bit else GEMM_SEARCH


def _rows_search():
    # The gemm_search setting 'on' or 'off' overrides it too.
    from caffeplus import config
    setting = config.get('gemm_search')
    return GEMM_ROWS_SEARCH if setting == 'plan' else setting == 'on'


def _s2d_search(sixteen_bit=False):
    return S2D_SEARCH_SIXTEEN_BIT if sixteen_bit else S2D_SEARCH


# FindEx results by geometry (see _ConvDescs.timer).
_TIMED = {}


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


def batch_slices_ok(n, k):
    """Whether a batch of n images splits into k equal slices of at least
    two images (the batch slicings timed search weighs)."""
    return n % k == 0 and n >= 2 * k


# Batch slicings timed as variants of a call site: variant -> slices.
# Eighths (5): VGG-16's conv1_2 filter gradient, the arena's largest call
# within 3% of its fastest, needs 883 MiB over quarters of b64.
CHUNK_VARIANTS = {3: 2, 4: 4, 5: 8}


def _chunk_search():
    return CHUNK_SEARCH


def _per_group_search():
    return PER_GROUP_SEARCH


def search_default():
    """The algorithm search a convolution uses when workspace.set_search was
    left at 'heuristic': heuristic (the default),
    timed, or auto (timed with FindEx for TRAIN nets under their own arena,
    as PyTorch's cudnn.benchmark; heuristic otherwise). Timed search may pick
    FFT or Winograd algorithms, which round differently from a direct sum
    (~1e-3 of the largest value), hence not the default for every net.
    The cudnn_search setting (caffeplus.config) chooses."""
    from caffeplus import config
    return config.get('cudnn_search')
