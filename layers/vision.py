"""Vision layers: Convolution, Deconvolution, Pooling, SPP, LRN, Im2col, Crop.

Semantics follow stock Caffe (output-size rules, defaults, which gradients
are computed, param diffs accumulating); the arithmetic is vectorised with
`xp` (numpy or cupy) and never loops over pixels or batch items. The pure
functions (pooling, LRN) live at module level so other backends can reuse
them; convolution arithmetic is in caffeplus.im2col.
"""
import collections
import math

import numpy

from caffeplus import backend, rng
from caffeplus.errors import NetError
from caffeplus.fillers import fill
from caffeplus.im2col import (ConvGeometry, FLOAT, batch_chunks, conv_backward, conv_forward,
                              conv_workspace_bytes, deconv_backward, deconv_forward,
                              im2col_backward, im2col_forward, scratch)
from caffeplus.blob import Blob
from caffeplus.layer import Layer, register
from caffeplus.memory import scratch as kept_buffers
from caffeplus.proto import caffe_pb2

FLT_MAX = float(numpy.finfo(numpy.float32).max)


def _no_cell(dtype):
    """Caffe's -FLT_MAX as an output of `dtype`: in 16 bits it rounds to
    -inf (written as such, without NumPy's overflow warning)."""
    return -numpy.inf if numpy.dtype(dtype).itemsize < 4 else -FLT_MAX
FLT_MIN = float(numpy.finfo(numpy.float32).tiny)

PoolMethod = caffe_pb2.PoolingParameter
MAX, AVE, STOCHASTIC = PoolMethod.MAX, PoolMethod.AVE, PoolMethod.STOCHASTIC


def _fail(layer, what):
    raise NetError('layer %s (%s): %s' % (layer.layer_param.name, layer.layer_param.type, what))



def _check_windows(layer, in_spatial, out_spatial, channels, num):
    """Refuse geometries the im2col path cannot hold: a padded image beyond
    the blob bound (a huge pad), or a last window that ends past the padded
    input (a kernel wider than it, hidden by C's truncating division)."""
    from caffeplus.blob import MAX_BLOB_COUNT
    g = layer.geom
    padded = [in_spatial[i] + 2 * g.pad[i] for i in range(g.nd)]
    if channels < 1:
        _fail(layer, 'the input has no channels (shape %s)' % (in_spatial,))
    if num * channels * _prod(padded) > MAX_BLOB_COUNT:
        _fail(layer, 'pad %s makes a padded input of %s per channel, beyond the %d-value bound '
              '(convolution_param.pad)' % (tuple(g.pad), tuple(padded), MAX_BLOB_COUNT))
    for i in range(g.nd):
        last = (g.kernel[i] - 1) * g.dilation[i] + (out_spatial[i] - 1) * g.stride[i]
        if last >= padded[i]:
            _fail(layer, 'kernel extent %d does not fit the padded input %d on spatial axis %d '
                  '(convolution_param.kernel_size / pad)' % (g.extent(i), padded[i], i))

def _prod(shape):
    n = 1
    for d in shape:
        n *= int(d)
    return n


# =============================================================================
# Convolution geometry from a ConvolutionParameter
# =============================================================================
def conv_geometry(layer, cp, num_spatial):
    """kernel/stride/pad/dilation per spatial axis, checked as Caffe does."""
    def per_axis(field, h_field, w_field, default, positive):
        has_hw = cp.HasField(h_field) or cp.HasField(w_field)
        values = list(getattr(cp, field))
        if has_hw:
            if num_spatial != 2:
                _fail(layer, '%s & %s can only be used for 2D convolution '
                      '(convolution_param.%s)' % (h_field, w_field, h_field))
            if values:
                _fail(layer, 'either %s or %s/%s should be specified; not both '
                      '(convolution_param.%s)' % (field, h_field, w_field, field))
            out = (getattr(cp, h_field), getattr(cp, w_field))
        else:
            if field == 'kernel_size' and not values and num_spatial > 0:
                _fail(layer, 'kernel_size must be given (convolution_param.kernel_size)')
            if len(values) not in (0, 1, num_spatial):
                _fail(layer, '%s must be specified once, or once per spatial dimension '
                      '(convolution_param.%s specified %d times; %d spatial dims)'
                      % (field, field, len(values), num_spatial))
            if not values:
                out = (default,) * num_spatial
            else:
                out = tuple(values[0 if len(values) == 1 else i] for i in range(num_spatial))
        if positive and any(v <= 0 for v in out):
            _fail(layer, '%s dimensions must be nonzero (convolution_param.%s)'
                  % ('filter' if field == 'kernel_size' else field, field))
        return tuple(int(v) for v in out)

    kernel = per_axis('kernel_size', 'kernel_h', 'kernel_w', None, True)
    stride = per_axis('stride', 'stride_h', 'stride_w', 1, True)
    pad = per_axis('pad', 'pad_h', 'pad_w', 0, False)
    dil = list(cp.dilation)
    if len(dil) not in (0, 1, num_spatial):
        _fail(layer, 'dilation must be specified once, or once per spatial dimension '
              '(convolution_param.dilation specified %d times; %d spatial dims)'
              % (len(dil), num_spatial))
    dilation = tuple(int(dil[0 if len(dil) == 1 else i]) if dil else 1
                     for i in range(num_spatial))
    return ConvGeometry(kernel, stride, pad, dilation)


# =============================================================================
# Convolution / Deconvolution
# =============================================================================
class _BaseConvolution(Layer):
    min_num_bottom = 1
    min_num_top = 1
    equal_num_bottom_top = True
    backward_reads = frozenset(('bottom_data',))
    inplace_ok = False
    reverse = False

    def layer_setup(self, bottom, top):
        self._reshaped = None
        cp = self.layer_param.convolution_param
        b0 = bottom[0]
        self.channel_axis = b0.canonical_axis_index(cp.axis)
        self.first_spatial = self.channel_axis + 1
        self.num_spatial = b0.num_axes - self.first_spatial
        self.geom = conv_geometry(self, cp, self.num_spatial)
        self.channels = b0.shape[self.channel_axis]
        self.num_output = int(cp.num_output)
        if self.num_output <= 0:
            _fail(self, 'num_output must be positive (convolution_param.num_output)')
        self.group = int(cp.group)
        if self.group <= 0:
            _fail(self, 'group must be positive (convolution_param.group)')
        if self.channels % self.group:
            _fail(self, 'the number of input channels (%d) must be a multiple of group (%d) '
                  '(convolution_param.group)' % (self.channels, self.group))
        if self.num_output % self.group:
            _fail(self, 'num_output (%d) should be a multiple of group (%d) '
                  '(convolution_param.num_output)' % (self.num_output, self.group))
        if self.reverse:
            w_shape = (self.channels, self.num_output // self.group) + self.geom.kernel
        else:
            w_shape = (self.num_output, self.channels // self.group) + self.geom.kernel
        self.bias_term = bool(cp.bias_term)
        shapes = [w_shape] + ([(self.num_output,)] if self.bias_term else [])
        if self.blobs:
            if len(self.blobs) != len(shapes):
                _fail(self, 'incorrect number of weight blobs (%d given, %d expected)'
                      % (len(self.blobs), len(shapes)))
            for what, b, s in zip(('weight', 'bias'), self.blobs, shapes):
                if tuple(b.shape) != tuple(s):
                    _fail(self, 'incorrect %s shape: expected shape %s; instead, shape was %s'
                          % (what, Blob(s).shape_string(), b.shape_string()))
        else:
            fillers = [cp.weight_filler, cp.bias_filler]
            for i, s in enumerate(shapes):
                b = Blob(s, name='%s.%d' % (self.name, i))
                fill(b, fillers[i])
                self.blobs.append(b)

    # The bottoms' shapes the geometry below was worked out for, and the top
    # shape it gave: Caffe reshapes before every forward, and with the same
    # shapes the checks would only repeat (a host-bound net waits for them).
    _reshaped = None

    def reshape(self, bottom, top):
        shapes = tuple(b.shape for b in bottom)
        if shapes == self._reshaped:
            for t in top:
                t.reshape(self._top_shape)
            return
        self._reshaped = None
        b0 = bottom[0]
        if b0.num_axes != self.first_spatial + self.num_spatial:
            _fail(self, 'bottom num_axes may not change (was %d, now %d)'
                  % (self.first_spatial + self.num_spatial, b0.num_axes))
        if b0.shape[self.channel_axis] != self.channels:
            _fail(self, 'input size incompatible with convolution kernel: %d channels, '
                  'weights expect %d' % (b0.shape[self.channel_axis], self.channels))
        for i, b in enumerate(bottom[1:], 1):
            if b.shape != b0.shape:
                _fail(self, 'shape mismatch - bottom[0]: %s vs. bottom[%d]: %s'
                      % (b0.shape_string(), i, b.shape_string()))
        self.num = b0.count_axes(0, self.channel_axis)
        self.in_spatial = tuple(b0.shape[self.first_spatial:])
        if self.reverse:
            self.out_spatial = self.geom.deconv_out_shape(self.in_spatial)
        else:
            self.out_spatial = self.geom.conv_out_shape(self.in_spatial)
        if any(o <= 0 for o in self.out_spatial):
            _fail(self, 'output spatial shape %s is empty for input %s (kernel %s, stride %s, '
                  'pad %s, dilation %s)' % (self.out_spatial, self.in_spatial, self.geom.kernel,
                                            self.geom.stride, self.geom.pad, self.geom.dilation))
        if not self.reverse:
            _check_windows(self, self.in_spatial, self.out_spatial, self.channels, self.num)
        out_shape = tuple(b0.shape[:self.channel_axis]) + (self.num_output,) + self.out_spatial
        for t in top:
            t.reshape(out_shape)
        self._reshaped, self._top_shape = shapes, out_shape

    def _views(self, blob_array, channels, spatial):
        return blob_array.reshape((self.num, channels) + tuple(spatial))

    def _forward(self, bottom, top):
        w = self.blobs[0].data
        b = self.blobs[1].data if self.bias_term else None
        fwd = deconv_forward if self.reverse else conv_forward
        for bb, tt in zip(bottom, top):
            x = self._views(bb.data, self.channels, self.in_spatial)
            y = self._views(tt.data, self.num_output, self.out_spatial)
            fwd(x, w, b, self.geom, self.group, y)

    def _backward(self, top, propagate_down, bottom):
        w = self.blobs[0]
        dw = w.diff if self.param_needs_backward(0) else None
        db = self.blobs[1].diff if self.bias_term and self.param_needs_backward(1) else None
        bwd = deconv_backward if self.reverse else conv_backward
        for i, (bb, tt) in enumerate(zip(bottom, top)):
            dx = self._views(bb.diff, self.channels, self.in_spatial) \
                if propagate_down[i] else None
            if dx is None and dw is None and db is None:
                continue
            x = self._views(bb.data, self.channels, self.in_spatial)
            dy = self._views(tt.diff, self.num_output, self.out_spatial)
            bwd(x, w.data, dy, self.geom, self.group, dx=dx, dw=dw, db=db)

    def workspace_bytes(self):
        im_spatial = self.out_spatial if self.reverse else self.in_spatial
        col_spatial = self.in_spatial if self.reverse else self.out_spatial
        im_channels = self.num_output if self.reverse else self.channels
        col = conv_workspace_bytes((self.num,) + im_spatial, col_spatial, self.geom, im_channels)
        return col


@register
class ConvolutionLayer(_BaseConvolution):
    """Caffe's Convolution: weights (num_output, C/group, *kernel)."""
    type = 'Convolution'
    reverse = False


@register
class DeconvolutionLayer(_BaseConvolution):
    """Caffe's Deconvolution (the transpose of Convolution): weights
    (C, num_output/group, *kernel), output s*(in-1) + extent - 2p."""
    type = 'Deconvolution'
    reverse = True


# =============================================================================
# Im2col
# =============================================================================
@register
class Im2colLayer(Layer):
    """Top = Caffe's column buffer: (N, C*prod(kernel), *out)."""
    type = 'Im2col'
    exact_num_bottom = 1
    exact_num_top = 1
    backward_reads = frozenset()
    inplace_ok = False

    def layer_setup(self, bottom, top):
        cp = self.layer_param.convolution_param
        b0 = bottom[0]
        self.channel_axis = b0.canonical_axis_index(cp.axis)
        self.first_spatial = self.channel_axis + 1
        self.num_spatial = b0.num_axes - self.first_spatial
        if self.num_spatial < 1:
            _fail(self, 'needs at least one spatial axis after the channel axis '
                  '(convolution_param.axis)')
        self.geom = conv_geometry(self, cp, self.num_spatial)

    def reshape(self, bottom, top):
        b0 = bottom[0]
        if b0.num_axes != self.first_spatial + self.num_spatial:
            _fail(self, 'bottom num_axes may not change')
        self.channels = b0.shape[self.channel_axis]
        self.num = b0.count_axes(0, self.channel_axis)
        self.in_spatial = tuple(b0.shape[self.first_spatial:])
        self.out_spatial = self.geom.conv_out_shape(self.in_spatial)
        if any(o <= 0 for o in self.out_spatial):
            _fail(self, 'output spatial shape %s is empty for input %s'
                  % (self.out_spatial, self.in_spatial))
        _check_windows(self, self.in_spatial, self.out_spatial, self.channels, self.num)
        top[0].reshape(tuple(b0.shape[:self.channel_axis]) +
                       (self.channels * self.geom.kernel_count,) + self.out_spatial)

    def _shapes(self):
        return ((self.num, self.channels) + self.in_spatial,
                (self.num, self.channels * self.geom.kernel_count) + self.out_spatial)

    def _forward(self, bottom, top):
        xs, ys = self._shapes()
        im2col_forward(bottom[0].data.reshape(xs), self.geom, top[0].data.reshape(ys))

    def _backward(self, top, propagate_down, bottom):
        if not propagate_down[0]:
            return
        xs, ys = self._shapes()
        im2col_backward(top[0].diff.reshape(ys), self.geom, bottom[0].diff.reshape(xs))


# =============================================================================
# Pooling: pure functions
# =============================================================================
class PoolGeometry(collections.namedtuple('PoolGeometry', 'kernel stride pad')):
    """(h, w) pairs of kernel, stride and pad."""
    __slots__ = ()


def pool_output_size(size, kernel, stride, pad, ceil_mode=True):
    """Caffe's pooled size for one axis (before the padding correction)."""
    q = float(numpy.float32(size + 2 * pad - kernel) / numpy.float32(stride))
    return int(math.ceil(q) if ceil_mode else math.floor(q)) + 1


def pool_output_shape(height, width, geom, ceil_mode=True):
    """(pooled_h, pooled_w) as Caffe: ceil (or floor) rule, then one less on
    an axis whose last window would start in the padding (only with pad)."""
    (kh, kw), (sh, sw), (ph, pw) = geom
    oh = pool_output_size(height, kh, sh, ph, ceil_mode)
    ow = pool_output_size(width, kw, sw, pw, ceil_mode)
    if ph or pw:
        if (oh - 1) * sh >= height + ph:
            oh -= 1
        if (ow - 1) * sw >= width + pw:
            ow -= 1
    return oh, ow


class _Windows:
    """Every kernel offset of a pooling as a strided slice of one source.

    The source is x padded (with `fill`) to rows -pad .. (out-1)*stride -
    pad + kernel - 1 (and likewise columns). When the windows overlap a lot
    and the stride is > 1, the padded source is split into stride x stride
    phase planes, so that every offset's slice reads contiguous rows
    (offset (i, j) lives in plane (i % sh, j % sw) at (i // sh, j // sw))."""

    def __init__(self, x_shape, geom, out_hw):
        n, c, h, w = x_shape
        (kh, kw), (sh, sw), (ph, pw) = geom
        oh, ow = out_hw
        self.x_shape = tuple(x_shape)
        self.geom, self.out_hw = geom, (oh, ow)
        self.hp = ph + max(h, (oh - 1) * sh - ph + kh)
        self.wp = pw + max(w, (ow - 1) * sw - pw + kw)
        self.split = (sh > 1 or sw > 1) and kh * kw >= 2 * sh * sw
        self.identity = not self.split and self.hp == h and self.wp == w
        if self.split:
            self.rows = -(-self.hp // sh)
            self.cols = -(-self.wp // sw)
            self.shape = (sh, sw, n, c, self.rows, self.cols)
            self.phases = []
            for a in range(sh):
                for b in range(sw):
                    h0, w0 = (a - ph) % sh, (b - pw) % sw
                    if h0 >= h or w0 >= w:
                        continue
                    nr, nc = len(range(h0, h, sh)), len(range(w0, w, sw))
                    r0, c0 = (h0 + ph) // sh, (w0 + pw) // sw
                    self.phases.append(((a, b, slice(None), slice(None),
                                         slice(r0, r0 + nr), slice(c0, c0 + nc)),
                                        (slice(None), slice(None),
                                         slice(h0, None, sh), slice(w0, None, sw))))
        else:
            self.shape = (n, c, self.hp, self.wp)
        self.offsets = []
        for i in range(kh):
            for j in range(kw):
                if self.split:
                    sl = (i % sh, j % sw, slice(None), slice(None),
                          slice(i // sh, i // sh + oh), slice(j // sw, j // sw + ow))
                else:
                    sl = (slice(None), slice(None), slice(i, i + (oh - 1) * sh + 1, sh),
                          slice(j, j + (ow - 1) * sw + 1, sw))
                self.offsets.append((i * kw + j, sl))

    def _interior(self):
        (ph, pw) = self.geom.pad
        h, w = self.x_shape[2:]
        return (slice(None), slice(None), slice(ph, ph + h), slice(pw, pw + w))

    def source(self, x, fill, slot='pool'):
        """The array the offsets slice: x itself, or a padded/split copy."""
        if self.identity:
            return x
        xp = backend.get_array_module(x)
        src = scratch(xp, self.shape, slot)
        src.fill(fill)
        if self.split:
            for dst, sl in self.phases:
                src[dst] = x[sl]
        else:
            src[self._interior()] = x
        return src

    def grad_buffer(self, dx, slot='poolgrad'):
        if self.identity:
            dx.fill(0)
            return dx
        return scratch(backend.get_array_module(dx), self.shape, slot, zero=True)

    def grad_finish(self, acc, dx):
        if acc is dx:
            return dx
        if self.split:
            for src, sl in self.phases:
                dx[sl] = acc[src]
        else:
            dx[...] = acc[self._interior()]
        return dx


def _arg_dtype(count):
    if count < 127:
        return numpy.int8
    if count < 32767:
        return numpy.int16
    return numpy.int32


def pool_sizes(x_hw, geom, out_hw):
    """AVE pooling's divisor per output cell: the window clipped to H+pad."""
    (kh, kw), (sh, sw), (ph, pw) = geom
    h, w = x_hw
    oh, ow = out_hw
    hs = numpy.arange(oh) * sh - ph
    ws = numpy.arange(ow) * sw - pw
    hsz = numpy.minimum(hs + kh, h + ph) - hs
    wsz = numpy.minimum(ws + kw, w + pw) - ws
    # (a float64 product: exact for any real window, no int64 overflow for absurd ones)
    return (hsz[:, None].astype(numpy.float64) * wsz[None, :]).astype(FLOAT)


def _is_global(x_shape, geom, out_hw):
    return tuple(out_hw) == (1, 1) and tuple(geom.kernel) == tuple(x_shape[2:]) and \
        tuple(geom.pad) == (0, 0)


def new_arg(xp, out_shape, geom):
    """An array for max_pool_forward's `arg` (offsets within the window)."""
    return xp.empty(out_shape, dtype=_arg_dtype(geom.kernel[0] * geom.kernel[1] + 1))


def _max_pool_forward(x, geom, y, arg):
    """y = window max; arg = the kernel offset (row-major in the window, -1
    if no cell beats -FLT_MAX) of the first maximum in scan order: Caffe's
    strict > scan, which also skips NaNs."""
    xp = backend.get_array_module(x)
    out_hw = y.shape[2:]
    if _is_global(x.shape, geom, out_hw):
        flat = x.reshape(x.shape[0], x.shape[1], _prod(x.shape[2:]))   # (-1 fails on N = 0)
        if not bool(xp.isnan(flat).any()):
            a = flat.argmax(axis=2)
            v = xp.take_along_axis(flat, a[..., None], axis=2)[..., 0]
            ok = v > -FLT_MAX
            y[..., 0, 0] = xp.where(ok, v, y.dtype.type(_no_cell(y.dtype)))
            arg[..., 0, 0] = xp.where(ok, a, -1)
            return y, arg
    win = _Windows(x.shape, geom, out_hw)
    src = win.source(x, -numpy.inf)
    y.fill(_no_cell(y.dtype))
    arg.fill(0)
    better = xp.empty(y.shape, dtype=bool)
    mark = xp.empty(y.shape, dtype=arg.dtype)
    one = numpy.dtype(arg.dtype).type
    for o, sl in win.offsets:
        v = src[sl]
        xp.greater(v, y, out=better)
        xp.fmax(y, v, out=y)
        # offsets come in increasing order, so the last offset that beat the
        # running max is the largest one marked: arg = max(o + 1 where better)
        xp.multiply(better.view(numpy.int8), one(o + 1), out=mark)
        xp.maximum(arg, mark, out=arg)
    arg -= one(1)
    return y, arg


def _by_planes(fn, arrays):
    """Run fn(*arrays) on (planes, 1, H, W) chunks of the (N, C, H, W)
    `arrays` (the first one's planes set the chunk size), so that on the
    CPU each chunk's working set stays in cache (planes are independent);
    one call on the whole arrays on the GPU, for non-contiguous arrays or
    when one chunk holds everything."""
    xp = backend.get_array_module(arrays[0])
    n, c = arrays[0].shape[:2]
    x_hw = arrays[0].shape[2:]
    chunks = None
    if xp is numpy and all(a.flags.c_contiguous for a in arrays):
        chunks = batch_chunks(xp, n * c, 4 * x_hw[0] * x_hw[1], 'plane')
    if chunks is None or len(chunks) == 1:
        fn(*arrays)
        return
    flats = [a.reshape((n * c, 1) + a.shape[2:]) for a in arrays]
    for sl in chunks:
        fn(*[f[sl] for f in flats])


def max_pool_forward(x, geom, y, arg):
    """y = window max; arg = the kernel offset (row-major in the window, -1
    if no cell beats -FLT_MAX) of the first maximum in scan order: Caffe's
    strict > scan, which also skips NaNs."""
    _by_planes(lambda xs, ys, args: _max_pool_forward(xs, geom, ys, args), (x, y, arg))
    return y, arg


def _scatter_back(dy, arg, geom, dx):
    _by_planes(lambda dxs, dys, args: _scatter_back_impl(dys, args, geom, dxs), (dx, dy, arg))
    return dx


def ave_pool_forward(x, geom, y, sizes=None):
    """y = window sums / `sizes` (default pool_sizes: Caffe's divisor)."""
    _by_planes(lambda xs, ys: _ave_pool_forward(xs, geom, ys, sizes), (x, y))
    return y


def ave_pool_backward(dy, geom, dx, sizes=None):
    _by_planes(lambda dxs, dys: _ave_pool_backward(dys, geom, dxs, sizes), (dx, dy))
    return dx


def max_pool_mask(arg, geom, x_hw):
    """Caffe's mask: the flat index h*W + w of the max within its plane."""
    xp = backend.get_array_module(arg)
    (kh, kw), (sh, sw), (ph, pw) = geom
    oh, ow = arg.shape[2:]
    width = x_hw[1]
    hs = xp.arange(oh, dtype=numpy.int64)[:, None] * sh - ph
    ws = xp.arange(ow, dtype=numpy.int64)[None, :] * sw - pw
    a = arg.astype(numpy.int64)
    idx = (hs + a // kw) * width + (ws + a % kw)
    return xp.where(arg < 0, -1, idx)


def _scatter_back_impl(dy, arg, geom, dx):
    """dx[...] = each window's dy routed to the offset in arg."""
    xp = backend.get_array_module(dy)
    out_hw = dy.shape[2:]
    if _is_global(dx.shape, geom, out_hw):
        flat = dx.reshape(dx.shape[0], dx.shape[1], _prod(dx.shape[2:]))
        flat.fill(0)
        a = arg[..., 0, 0].astype(numpy.int64)
        ok = a >= 0
        xp.put_along_axis(flat, xp.where(ok, a, 0)[..., None],
                          xp.where(ok, dy[..., 0, 0], FLOAT(0))[..., None], axis=2)
        return dx
    win = _Windows(dx.shape, geom, out_hw)
    acc = win.grad_buffer(dx)
    tmp = xp.empty(dy.shape, dtype=FLOAT)
    sel = xp.empty(dy.shape, dtype=bool)
    # reverse offset order adds each cell's contributions in the order of
    # the windows (row-major), the order Caffe's loops add them in
    for o, sl in reversed(win.offsets):
        xp.equal(arg, o, out=sel)
        xp.multiply(dy, sel, out=tmp)
        acc[sl] += tmp
    return win.grad_finish(acc, dx)


def max_pool_backward(dy, arg, geom, dx):
    return _scatter_back(dy, arg, geom, dx)


def _ave_pool_forward(x, geom, y, sizes=None):
    xp = backend.get_array_module(x)
    out_hw = y.shape[2:]
    if sizes is None:
        sizes = pool_sizes(x.shape[2:], geom, out_hw)
    sizes = xp.asarray(sizes)
    if _is_global(x.shape, geom, out_hw):
        x.reshape(x.shape[0], x.shape[1], _prod(x.shape[2:])).sum(axis=2,
                                                                  out=y.reshape(y.shape[:2]))
        y /= sizes
        return y
    win = _Windows(x.shape, geom, out_hw)
    src = win.source(x, 0.0)
    y.fill(0)
    for _, sl in win.offsets:
        y += src[sl]
    y /= sizes
    return y


def _ave_pool_backward(dy, geom, dx, sizes=None):
    xp = backend.get_array_module(dy)
    out_hw = dy.shape[2:]
    if sizes is None:
        sizes = pool_sizes(dx.shape[2:], geom, out_hw)
    g = dy / xp.asarray(sizes)
    if _is_global(dx.shape, geom, out_hw):
        dx[...] = g
        return dx
    win = _Windows(dx.shape, geom, out_hw)
    acc = win.grad_buffer(dx)
    for _, sl in reversed(win.offsets):
        acc[sl] += g
    return win.grad_finish(acc, dx)


def stochastic_pool_forward(x, geom, y, arg, train, uniform=None):
    """TRAIN: sample one cell per window with probability proportional to its
    value (inputs are expected non-negative); arg = its offset. TEST: the
    probability-weighted average sum(x^2)/sum(x). Caffe's GPU semantics
    (its CPU version is not implemented)."""
    xp = backend.get_array_module(x)
    out_hw = y.shape[2:]
    win = _Windows(x.shape, geom, out_hw)
    src = win.source(x, 0.0)
    if not train:
        total = xp.full(y.shape, FLT_MIN, dtype=FLOAT)
        y.fill(0)
        for _, sl in win.offsets:
            v = src[sl]
            total += v
            y += v * v
        y /= total
        if arg is not None:
            arg.fill(-1)
        return y
    total = xp.zeros(y.shape, dtype=FLOAT)
    for _, sl in win.offsets:
        total += src[sl]
    if uniform is None:
        uniform = rng.get().random(size=y.shape, dtype=numpy.float32)
    thres = xp.asarray(uniform, dtype=FLOAT) * total
    cum = xp.zeros(y.shape, dtype=FLOAT)
    y.fill(0)
    arg.fill(-1)
    hit = xp.empty(y.shape, dtype=bool)
    for o, sl in win.offsets:
        v = src[sl]
        cum += v
        xp.greater_equal(cum, thres, out=hit)
        hit &= arg < 0
        xp.copyto(arg, o, where=hit)
        xp.copyto(y, v, where=hit)
    return y


def stochastic_pool_backward(dy, arg, geom, dx):
    return _scatter_back(dy, arg, geom, dx)


def pool_forward(method, x, geom, y, arg=None, train=True):
    if method == MAX:
        return max_pool_forward(x, geom, y, arg)
    if method == AVE:
        return ave_pool_forward(x, geom, y)
    return stochastic_pool_forward(x, geom, y, arg, train)


def pool_backward(method, dy, geom, dx, arg=None):
    if method == AVE:
        return ave_pool_backward(dy, geom, dx)
    return _scatter_back(dy, arg, geom, dx)


def pooling_geometry(layer, pp, height, width):
    """Kernel/stride/pad from a PoolingParameter, checked as Caffe does."""
    if pp.global_pooling:
        if pp.HasField('kernel_size') or pp.HasField('kernel_h') or pp.HasField('kernel_w'):
            _fail(layer, 'with global_pooling: true filter size cannot be specified '
                  '(pooling_param.kernel_size)')
    else:
        has_hw = pp.HasField('kernel_h') and pp.HasField('kernel_w')
        if pp.HasField('kernel_size') and (pp.HasField('kernel_h') or pp.HasField('kernel_w')):
            _fail(layer, 'filter size is kernel_size OR kernel_h and kernel_w; not both '
                  '(pooling_param.kernel_size)')
        if not pp.HasField('kernel_size') and not has_hw:
            if pp.HasField('kernel_h') or pp.HasField('kernel_w'):
                _fail(layer, 'for non-square filters both kernel_h and kernel_w are required '
                      '(pooling_param.kernel_h/kernel_w)')
            _fail(layer, 'kernel_size must be given (pooling_param.kernel_size)')
    if pp.HasField('pad_h') or pp.HasField('pad_w'):
        if pp.HasField('pad') or not (pp.HasField('pad_h') and pp.HasField('pad_w')):
            _fail(layer, 'pad is pad OR pad_h and pad_w are required (pooling_param.pad)')
    if pp.HasField('stride_h') or pp.HasField('stride_w'):
        if pp.HasField('stride') or not (pp.HasField('stride_h') and pp.HasField('stride_w')):
            _fail(layer, 'stride is stride OR stride_h and stride_w are required '
                  '(pooling_param.stride)')
    if pp.global_pooling:
        kernel = (height, width)
    elif pp.HasField('kernel_size'):
        kernel = (pp.kernel_size, pp.kernel_size)
    else:
        kernel = (pp.kernel_h, pp.kernel_w)
    if kernel[0] <= 0 or kernel[1] <= 0:
        _fail(layer, 'filter dimensions cannot be zero (pooling_param.kernel_size)')
    pad = (pp.pad_h, pp.pad_w) if pp.HasField('pad_h') else (pp.pad, pp.pad)
    stride = (pp.stride_h, pp.stride_w) if pp.HasField('stride_h') else (pp.stride, pp.stride)
    if stride[0] <= 0 or stride[1] <= 0:
        _fail(layer, 'stride must be positive (pooling_param.stride)')
    if pp.global_pooling and (pad != (0, 0) or stride != (1, 1)):
        _fail(layer, 'with global_pooling: true only pad = 0 and stride = 1 are allowed '
              '(pooling_param.pad/stride)')
    if pad != (0, 0):
        if pp.pool not in (MAX, AVE):
            _fail(layer, 'padding implemented only for average and max pooling '
                  '(pooling_param.pad)')
        if pad[0] >= kernel[0] or pad[1] >= kernel[1]:
            _fail(layer, 'pad (%d, %d) must be smaller than the kernel (%d, %d) '
                  '(pooling_param.pad)' % (pad + kernel))
    return PoolGeometry(tuple(int(k) for k in kernel), tuple(int(s) for s in stride),
                        tuple(int(p) for p in pad))


# Pooling windows (kernel_h * kernel_w cells, one slice each) beyond this
# many are refused unless the pooling is global: a padded kernel that large
# means hours of work over padding (Caffe's own loops would take as long).
MAX_POOL_WINDOW = 2 ** 18


def clip_pool_geometry(x_hw, geom, out_hw):
    """A geometry that computes exactly what `geom` does over an input of
    x_hw with out_hw outputs, with stride and kernel no larger than the
    padded input needs (so that no scratch is sized by an absurd stride):

      * a stride s > H + pad + 1: every window after the first starts past
        the input, as it still does with s = H + pad + 1 (they read only
        padding: MAX -FLT_MAX / arg -1, AVE 0; offsets within a window do
        not depend on the stride);
      * a kernel k > H + 2 pad + 1 (the ceil rule allows up to stride - 1
        more; then there is one window): its end past the padding covers
        nothing more, and Caffe's AVE divisor clips the window to H + pad
        anyway, so k = H + 2 pad + 1 gives the same cells, divisor and
        order of additions (one more than the padded input, so that it does
        not turn into a global pooling, which sums in another order)."""
    (kh, kw), (sh, sw), (ph, pw) = geom
    h, w = x_hw
    kh, kw = min(kh, h + 2 * ph + 1), min(kw, w + 2 * pw + 1)
    sh, sw = min(sh, h + ph + 1), min(sw, w + pw + 1)
    return PoolGeometry((kh, kw), (sh, sw), (ph, pw))


class _Pool:
    """One pooling operation with its size rule and internal argmax state."""

    def __init__(self, layer, pp, x_shape, kept_name='argmax'):
        if len(x_shape) != 4:
            _fail(layer, 'input must have 4 axes, corresponding to (num, channels, height, '
                  'width), got shape %s' % (x_shape,))
        self.method = pp.pool
        self.geom = pooling_geometry(layer, pp, x_shape[2], x_shape[3])
        ceil_mode = pp.round_mode != caffe_pb2.PoolingParameter.FLOOR
        oh, ow = pool_output_shape(x_shape[2], x_shape[3], self.geom, ceil_mode)
        (sh, sw), (ph, pw) = self.geom.stride, self.geom.pad
        if (ph or pw) and ((oh - 1) * sh >= x_shape[2] + ph or (ow - 1) * sw >= x_shape[3] + pw):
            _fail(layer, 'the last pooling window starts in the padding (pooling_param.pad)')
        if oh <= 0 or ow <= 0:
            _fail(layer, 'pooled output %dx%d is empty for input %dx%d'
                  % (oh, ow, x_shape[2], x_shape[3]))
        # The same windows with stride and kernel clipped to the padded input
        # (a stride of 2^31 sized the scratch copy of the input by it).
        self.geom = clip_pool_geometry(x_shape[2:], self.geom, (oh, ow))
        (kh, kw), (ph, pw) = self.geom.kernel, self.geom.pad
        if kh * kw > MAX_POOL_WINDOW and not _is_global(x_shape, self.geom, (oh, ow)):
            _fail(layer, 'a pooling window of %d x %d cells (with pad %d x %d over an input of '
                  '%d x %d) is more than the %d this implementation visits '
                  '(pooling_param.kernel_size / pad)'
                  % (kh, kw, ph, pw, x_shape[2], x_shape[3], MAX_POOL_WINDOW))
        self.x_shape = tuple(x_shape)
        self.out_shape = tuple(x_shape[:2]) + (oh, ow)
        self.arg = None
        self.layer = layer
        self.kept_name = kept_name      # the layer's kept buffer for the argmax

    def kept(self):
        """{name: (count, dtype)}: the argmax MAX/STOCHASTIC keep for backward."""
        if self.method not in (MAX, STOCHASTIC):
            return {}
        count = 1
        for d in self.out_shape:
            count *= int(d)
        return {self.kept_name: (count,
                                 _arg_dtype(self.geom.kernel[0] * self.geom.kernel[1] + 1))}

    def forward(self, x, y, train):
        xp = backend.get_array_module(x)
        if self.method in (MAX, STOCHASTIC):
            # The layer's kept buffer: its own, or the memory plan's view.
            count, dtype = self.kept()[self.kept_name]
            self.arg = kept_buffers.get(self.layer, self.kept_name, count, dtype,
                                        xp).reshape(y.shape)
        return pool_forward(self.method, x, self.geom, y, self.arg, train)

    def backward(self, dy, dx):
        if self.method != AVE and self.arg is None:
            dx[...] = 0
            return dx
        return pool_backward(self.method, dy, self.geom, dx, self.arg)

    def mask(self):
        return max_pool_mask(self.arg, self.geom, self.x_shape[2:])


# =============================================================================
# Pooling layer
# =============================================================================
@register
class PoolingLayer(Layer):
    """MAX (optional second top: the argmax mask), AVE, STOCHASTIC pooling."""
    type = 'Pooling'
    exact_num_bottom = 1
    min_num_top = 1
    max_num_top = 2
    backward_reads = frozenset()
    inplace_ok = False

    def __init__(self, layer_param):
        super().__init__(layer_param)
        if self.layer_param.pooling_param.pool != MAX:
            self.max_num_top = 1

    def layer_setup(self, bottom, top):
        self.pool = None

    def reshape(self, bottom, top):
        pool = self.pool
        if pool is not None and pool.x_shape == bottom[0].shape:
            # The same input shape (Caffe reshapes before every forward): the
            # same geometry, its checks passed; the argmax as a new one's.
            pool.arg = None
        else:
            self.pool = _Pool(self, self.layer_param.pooling_param, bottom[0].shape)
        for t in top:
            t.reshape(self.pool.out_shape)

    def internal_buffers(self):
        """MAX pooling's argmax, kept for backward (caffeplus.memory.scratch)."""
        return self.pool.kept() if self.pool is not None else {}

    def forget_kept_buffers(self):
        """caffeplus.memory.scratch.forget: the argmax view is dead."""
        if self.pool is not None:
            self.pool.arg = None

    def _forward(self, bottom, top):
        self.pool.forward(bottom[0].data, top[0].data, self.phase == caffe_pb2.TRAIN)
        if len(top) > 1:
            top[1].data[...] = self.pool.mask()

    def _backward(self, top, propagate_down, bottom):
        if not propagate_down[0]:
            return
        self.pool.backward(top[0].diff, bottom[0].diff)


# =============================================================================
# SPP
# =============================================================================
def spp_pooling_param(level, height, width, pool):
    """Caffe's pooling parameter for pyramid level `level` (2**level bins)."""
    bins = 2 ** level
    kh = int(math.ceil(height / float(bins)))
    kw = int(math.ceil(width / float(bins)))
    pp = caffe_pb2.PoolingParameter()
    pp.pool = pool
    pp.kernel_h, pp.kernel_w = kh, kw
    pp.stride_h, pp.stride_w = kh, kw
    pp.pad_h = (kh * bins - height + 1) // 2
    pp.pad_w = (kw * bins - width + 1) // 2
    return pp


@register
class SPPLayer(Layer):
    """Spatial pyramid pooling: levels 0..h-1 pooled to 2**l bins each,
    flattened and concatenated (N, sum C*bins_h*bins_w); with
    pyramid_height 1 the single pooling's (N, C, 1, 1) output as Caffe."""
    type = 'SPP'
    exact_num_bottom = 1
    exact_num_top = 1
    backward_reads = frozenset()
    inplace_ok = False

    def layer_setup(self, bottom, top):
        sp = self.layer_param.spp_param
        self.height_levels = int(sp.pyramid_height)
        if self.height_levels < 1:
            _fail(self, 'pyramid_height must be at least 1 (spp_param.pyramid_height)')
        self.pools = []
        self.shape = None

    def reshape(self, bottom, top):
        b = bottom[0]
        if b.num_axes != 4:
            _fail(self, 'input must have 4 axes, corresponding to (num, channels, height, '
                  'width), got %s' % b.shape_string())
        n, c, h, w = b.shape
        if h <= 0 or w <= 0:
            _fail(self, 'input dimensions cannot be zero')
        pool = self.layer_param.spp_param.pool
        self.pools = [_Pool(self, spp_pooling_param(l, h, w, pool), b.shape,
                            kept_name='argmax%d' % l)
                      for l in range(self.height_levels)]
        if self.height_levels == 1:
            top[0].reshape(self.pools[0].out_shape)
        else:
            top[0].reshape((n, sum(_prod(p.out_shape[1:]) for p in self.pools)))

    def internal_buffers(self):
        """Each level's argmax, kept for backward (caffeplus.memory.scratch)."""
        out = {}
        for p in getattr(self, 'pools', None) or ():
            out.update(p.kept())
        return out

    def forget_kept_buffers(self):
        """caffeplus.memory.scratch.forget: the argmax views are dead."""
        for p in getattr(self, 'pools', None) or ():
            p.arg = None

    def _forward(self, bottom, top):
        x = bottom[0].data
        train = self.phase == caffe_pb2.TRAIN
        n = x.shape[0]
        if self.height_levels == 1:
            self.pools[0].forward(x, top[0].data, train)
            return
        y = top[0].data
        xp = backend.get_array_module(x)
        start = 0
        for p in self.pools:
            size = _prod(p.out_shape[1:])
            out = xp.empty(p.out_shape, dtype=FLOAT)
            p.forward(x, out, train)
            y[:, start:start + size] = out.reshape(n, size)
            start += size

    def _backward(self, top, propagate_down, bottom):
        if not propagate_down[0]:
            return
        dx = bottom[0].diff
        if self.height_levels == 1:
            self.pools[0].backward(top[0].diff, dx)
            return
        xp = backend.get_array_module(dx)
        dy = top[0].diff
        start = 0
        part = xp.empty(dx.shape, dtype=FLOAT)
        for i, p in enumerate(self.pools):
            size = _prod(p.out_shape[1:])
            g = xp.ascontiguousarray(dy[:, start:start + size]).reshape(p.out_shape)
            start += size
            if i == 0:
                p.backward(g, dx)
            else:
                p.backward(g, part)
                dx += part


# =============================================================================
# LRN: pure functions
# =============================================================================
def _across_offsets(size, c):
    """The channel offsets d = o - (size-1)/2, o = 0 .. size-1, of an LRN
    window that reach another channel (|d| < c), in order: the others add
    nothing, and a local_size of 2^31 must not mean 2^31 iterations."""
    pre = (size - 1) // 2
    return range(max(-pre, -(c - 1)), min(size - 1 - pre, c - 1) + 1)


def lrn_across_scale(x, size, alpha, k, scale):
    """scale = k + alpha/size * sum of x^2 over `size` channels centred on
    each channel (zero beyond the ends)."""
    c = x.shape[1]
    sq = x * x
    sq *= numpy.float32(alpha) / numpy.float32(size)
    scale.fill(k)
    for d in _across_offsets(size, c):
        if d < 0:
            if c + d > 0:
                scale[:, -d:] += sq[:, :c + d]
        elif d > 0:
            if c - d > 0:
                scale[:, :c - d] += sq[:, d:]
        else:
            scale += sq
    return scale


def lrn_across_forward(x, size, alpha, beta, k, y, scale):
    xp = backend.get_array_module(x)
    lrn_across_scale(x, size, alpha, k, scale)
    xp.power(scale, numpy.float32(-beta), out=y)
    y *= x
    return y


def lrn_across_backward(x, dy, scale, size, alpha, beta, dx):
    """Caffe's exact backward: dx = dy*scale^-beta
    - 2*alpha*beta/size * x * sum_window(dy * y / scale)."""
    xp = backend.get_array_module(x)
    c = x.shape[1]
    p = xp.power(scale, numpy.float32(-beta))
    ratio = x * p           # the forward top
    ratio *= dy
    ratio /= scale
    accum = xp.zeros(x.shape, dtype=FLOAT)
    for d in _across_offsets(size, c):
        if d < 0:
            if c + d > 0:
                accum[:, -d:] += ratio[:, :c + d]
        elif d > 0:
            if c - d > 0:
                accum[:, :c - d] += ratio[:, d:]
        else:
            accum += ratio
    accum *= x
    accum *= numpy.float32(2.0 * float(numpy.float32(alpha)) * float(numpy.float32(beta)) / size)
    xp.multiply(p, dy, out=dx)
    dx -= accum
    return dx


def _within_geom(size):
    pre = (size - 1) // 2
    return PoolGeometry((size, size), (1, 1), (pre, pre))


def _within_pool(x_hw, size):
    """(geometry, divisor) for WITHIN_CHANNEL's average pooling of an input
    of x_hw: Caffe's size x size window with pad (size-1)/2 and its divisor,
    but the window cut to what can reach the input (pad at most H-1, kernel
    2 pad + 1: every window still covers the same cells), so that a
    local_size of 2^31 visits at most (2H-1) x (2W-1) offsets."""
    geom = _within_geom(size)
    sizes = pool_sizes(x_hw, geom, x_hw)
    pre = geom.pad[0]
    ph, pw = min(pre, max(x_hw[0] - 1, 0)), min(pre, max(x_hw[1] - 1, 0))
    return PoolGeometry((2 * ph + 1, 2 * pw + 1), (1, 1), (ph, pw)), sizes


def lrn_within_forward(x, size, alpha, beta, y, scale):
    """Caffe's WITHIN_CHANNEL: scale = 1 + alpha * avepool(x^2) (size x size,
    pad (size-1)/2), y = x * scale^-beta (k is not used)."""
    xp = backend.get_array_module(x)
    sq = x * x
    geom, sizes = _within_pool(x.shape[2:], size)
    ave_pool_forward(sq, geom, scale, sizes)
    scale *= numpy.float32(alpha)
    scale += numpy.float32(1)
    xp.power(scale, numpy.float32(-beta), out=y)
    y *= x
    return y


def lrn_within_backward(x, dy, scale, size, alpha, beta, dx):
    xp = backend.get_array_module(x)
    p = xp.power(scale, numpy.float32(-beta))
    # through the power layer: d/davg = (-beta*alpha) * p / scale * (x * dy)
    g = p / scale
    g *= numpy.float32(numpy.float32(-beta) * numpy.float32(alpha))
    g *= x * dy
    dsq = xp.empty(x.shape, dtype=FLOAT)
    geom, sizes = _within_pool(x.shape[2:], size)
    ave_pool_backward(g, geom, dsq, sizes)
    # through the square: 2x * dsq; plus the product's direct path p * dy
    dsq *= x * numpy.float32(2)
    xp.multiply(p, dy, out=dx)
    dx += dsq
    return dx


@register
class LRNLayer(Layer):
    """Local response normalisation, ACROSS_CHANNELS or WITHIN_CHANNEL."""
    type = 'LRN'
    exact_num_bottom = 1
    exact_num_top = 1
    backward_reads = frozenset(('bottom_data',))
    inplace_ok = False
    # Both backwards read dy elementwise before writing dx at the same
    # index; cuDNN's gives the same bits with dx == dy (dev/lrn_slices_probe.py).
    diff_over_top_diff = True

    def layer_setup(self, bottom, top):
        p = self.layer_param.lrn_param
        self.size = int(p.local_size)
        if self.size % 2 != 1:
            _fail(self, 'LRN only supports odd values for local_size (lrn_param.local_size)')
        self.alpha = float(numpy.float32(p.alpha))
        self.beta = float(numpy.float32(p.beta))
        self.k = float(numpy.float32(p.k))
        self.region = p.norm_region
        self.scale = None

    def reshape(self, bottom, top):
        if bottom[0].num_axes != 4:
            _fail(self, 'input must have 4 axes, corresponding to (num, channels, height, '
                  'width), got %s' % bottom[0].shape_string())
        top[0].reshape(bottom[0].shape)

    def _forward(self, bottom, top):
        x = bottom[0].data
        xp = backend.get_array_module(x)
        if self.scale is None or self.scale.shape != x.shape or \
                backend.get_array_module(self.scale) is not xp:
            self.scale = xp.empty(x.shape, dtype=FLOAT)
        if self.region == caffe_pb2.LRNParameter.ACROSS_CHANNELS:
            lrn_across_forward(x, self.size, self.alpha, self.beta, self.k, top[0].data,
                               self.scale)
        else:
            lrn_within_forward(x, self.size, self.alpha, self.beta, top[0].data, self.scale)

    def _backward(self, top, propagate_down, bottom):
        if not propagate_down[0]:
            return
        x = bottom[0].data
        if self.region == caffe_pb2.LRNParameter.ACROSS_CHANNELS:
            lrn_across_backward(x, top[0].diff, self.scale, self.size, self.alpha, self.beta,
                                bottom[0].diff)
        else:
            lrn_within_backward(x, top[0].diff, self.scale, self.size, self.alpha, self.beta,
                                bottom[0].diff)


# =============================================================================
# Crop
# =============================================================================
@register
class CropLayer(Layer):
    """Crop bottom 0 to the shape of bottom 1 from axis `axis` on, at the
    given offsets (one for all axes, or one per cropped axis)."""
    type = 'Crop'
    exact_num_bottom = 2
    exact_num_top = 1
    backward_reads = frozenset()
    inplace_ok = False

    def allow_force_backward(self, bottom_index):
        return bottom_index != 1

    def layer_setup(self, bottom, top):
        p = self.layer_param.crop_param
        nd = bottom[0].num_axes
        self.start_axis = bottom[0].canonical_axis_index(p.axis)
        if self.start_axis >= nd:
            _fail(self, 'crop axis bigger than input dim (crop_param.axis)')
        if len(p.offset) > 1 and self.start_axis + len(p.offset) != nd:
            _fail(self, 'number of offset values specified must be equal to the number of '
                  'dimensions following axis (crop_param.offset: %d given for %d axes)'
                  % (len(p.offset), nd - self.start_axis))

    def reshape(self, bottom, top):
        p = self.layer_param.crop_param
        a, b = bottom[0], bottom[1]
        if b.num_axes != a.num_axes:
            _fail(self, 'bottoms must have the same number of axes (%s vs %s)'
                  % (a.shape_string(), b.shape_string()))
        shape, slices = [], []
        for i in range(a.num_axes):
            off, size = 0, a.shape[i]
            if i >= self.start_axis:
                size = b.shape[i]
                if len(p.offset) == 1:
                    off = p.offset[0]
                elif len(p.offset) > 1:
                    off = p.offset[i - self.start_axis]
                if a.shape[i] - off < b.shape[i]:
                    _fail(self, 'invalid crop parameters in dimension: %d (crop_param.offset)'
                          % i)
            shape.append(size)
            slices.append(slice(off, off + size))
        self.slices = tuple(slices)
        top[0].reshape(tuple(shape))

    def _forward(self, bottom, top):
        top[0].data[...] = bottom[0].data[self.slices]

    def _backward(self, top, propagate_down, bottom):
        if not propagate_down[0]:
            return
        d = bottom[0].diff
        d[...] = 0
        d[self.slices] = top[0].diff
