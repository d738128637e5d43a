"""Convolution over a space-to-depth image: the variant timed search weighs
beside cuDNN's algorithms for a strided convolution over few input channels
(variant S2D_VARIANT of a call site).
"""
import numpy

from caffeplus import kernels as _kernels
from caffeplus.cudnn import api
from caffeplus.cudnn.algo_search import (S2D_ALGO, S2D_VARIANT, _prod, _s2d_search,
                                         batch_slices_ok, median_ms)

S2D_MAX_CHANNELS = 4            # input channels up to which it is timed (image layers)
SLICINGS = (1, 2, 4, 8)         # the batch slicings timed (algo: S2D_ALGO + 10 * index)
_ALIGN = 256


def _aligned(nbytes):
    return -(-int(nbytes) // _ALIGN) * _ALIGN


def _pointer(a):
    """A kernel's pointer argument: a device address, or an array (the emulator's)."""
    return a if isinstance(a, numpy.ndarray) else numpy.uint64(a)


class _DeviceOps:
    """What _SpaceToDepthConv launches besides cuDNN (device pointers as ints)."""

    @staticmethod
    def kernel(name, dtype):
        return _kernels.kernel(name, dtype)

    @classmethod
    def _launch(cls, name, g, total, src, dst, *rest):
        """`name`'s g-typed build over `total` values, src and dst first."""
        cls.kernel(name, g.kernel_dtype)(
            _kernels.elementwise_grid(total), (_kernels.ELEMENTWISE_THREADS,),
            (_pointer(src), _pointer(dst)) + rest)

    @classmethod
    def space_to_depth(cls, x, x2, g, own_order=False, images=None):
        total = (images or g.n) * g.h2 * g.w2 * g.c2
        cls._launch('cp_space_to_depth', g, total, x, x2, numpy.uint64(total),
                    *(_kernels.i32(v) for v in (g.c, g.h, g.w, g.s, g.ph, g.pw, g.h2, g.w2)),
                    *(numpy.uint64(v) for v in (g.own_strides if own_order else g.x_strides)),
                    _kernels.i32(g.nhwc))

    @classmethod
    def filters(cls, w, w2, g):
        total = g.m * g.kh2 * g.kw2 * g.c2
        cls._launch('cp_s2d_filter', g, total, w, w2, _kernels.u32(total), *_taps(g),
                    *(_kernels.u32(v) for v in g.w_strides), _kernels.i32(g.nhwc))

    @classmethod
    def filter_gradient(cls, dw2, dw, g):
        total = g.m * g.c * g.kh * g.kw
        cls._launch('cp_s2d_filter_grad', g, total, dw2, dw, _kernels.u32(total), *_taps(g),
                    _kernels.i32(g.nhwc))


def _taps(g):
    """(C, KH, KW, s, KH2, KW2) as the filter kernels take them."""
    return tuple(_kernels.i32(v) for v in (g.c, g.kh, g.kw, g.s, g.kh2, g.kw2))


class _SpaceToDepthConv:
    """A 2-D convolution of stride s (both axes) over few channels, as a
    stride-1 convolution over blocks of s x s pixels: x2 holds each block's
    C s^2 values as channels (in the layer's calling order), the filters
    are regrouped the same way into ceil(kh/s) x ceil(kw/s) taps (those
    past the kernel zero), and cuDNN runs that convolution. cuDNN's kernels
    are slow on the 3 channels of an image net's first layer and fast on 48
    (AlexNet's conv1: 11x11, stride 4 becomes 3x3 over 48 channels, the
    same top).

    Forward: x2 into the workspace, the filters into a buffer of the
    variant's own (a few KiB), cuDNN's forward into the layer's top (the
    bias after it, by the layer). Filter gradient: x2 into the workspace
    again, cuDNN's filter gradient of x2 after it (in the maps' type, beta
    0), added in float32 to the FP32 master's (cp_s2d_filter_grad). No
    data gradient (an image layer's bottom needs none; the data-gradient
    site keeps cuDNN's algorithms).

    Over the batch in 1, 2, 4 or 8 slices (SLICINGS), one slice's x2 in the
    workspace at a time: a small net's search room may not hold the whole
    batch's (torchvision's AlexNet b128: 40 MiB against 35). A choice's
    `algo` is S2D_ALGO + 10 log2(slices) + cuDNN's algorithm of the inner
    call (api.s2d_parts), its `memory` one slice's x2 (and the inner filter
    gradient) plus that algorithm's workspace."""

    def __init__(self, layer, cd):
        self.dtype = cd.dtype
        # The blocks and their filters in the layer's calling order (cuDNN's
        # calls take channels-last or Caffe's order on all three tensors).
        self.nhwc = bool(cd.nhwc)
        self.kernel_dtype = None if self.dtype.itemsize == 4 else self.dtype
        g = layer.geom
        self.n, self.c = layer.num, layer.channels
        self.h, self.w = (int(d) for d in layer.in_spatial)
        self.m = layer.num_output
        self.kh, self.kw = (int(d) for d in g.kernel)
        self.s = int(g.stride[0])
        self.ph, self.pw = (int(d) for d in g.pad)
        self.oh, self.ow = (int(d) for d in layer.out_spatial)
        self.kh2, self.kw2 = -(-self.kh // self.s), -(-self.kw // self.s)
        self.h2, self.w2 = self.oh + self.kh2 - 1, self.ow + self.kw2 - 1
        self.c2 = self.c * self.s * self.s
        # The bottom as the layer hands it over: Caffe's order, or
        # channels-last with cx >= c channels (an image padded to 4).
        cx = cd.x_full[1]
        hw = self.h * self.w
        self.x_strides = (hw * cx, 1, self.w * cx, cx) if cd.nhwc else (cx * hw, hw, self.w, 1)
        # The bottom in its own order, where the layer would relay it for
        # cuDNN (the other order, c channels): read as it is, no relay.
        c = self.c
        self.own_strides = (c * hw, hw, self.w, 1) if cd.nhwc else (hw * c, 1, self.w * c, c)
        # The filters as the layer keeps them for cuDNN: (K, kh, kw, cx)
        # channels-last, or Caffe's (K, C, kh, kw).
        khw = self.kh * self.kw
        self.w_strides = (khw * cx, 1, self.kw * cx, cx) if cd.nhwc else (self.c * khw, khw,
                                                                           self.kw, 1)
        self.w2_shape = (self.m, self.kh2, self.kw2, self.c2) if self.nhwc else \
            (self.m, self.c2, self.kh2, self.kw2)
        self.dw2_bytes = _aligned(_prod(self.w2_shape) * self.dtype.itemsize)
        self.slicings = tuple(k for k in SLICINGS if k == 1 or batch_slices_ok(self.n, k))
        self.math = cd.math
        self._convs = {}
        self._w2 = None
        self._descs = {}
        self._wdesc = None

    def x2_bytes(self, slices=1):
        """One slice's blocks."""
        return _aligned(self.n // slices * self.h2 * self.w2 * self.c2 * self.dtype.itemsize)

    def need(self, kind, slices=1):
        """The workspace besides the inner call's own, over `slices` slices."""
        return self.x2_bytes(slices) + (self.dw2_bytes if kind == 'bwd_filter' else 0)

    def memory(self, kind):
        """The most workspace besides the inner call's: the whole batch at once."""
        return self.need(kind, 1)

    def least_memory(self, kind):
        return self.need(kind, self.slicings[-1])

    def descriptors(self, slices=1):
        """(x2's, the top's, the regrouped filters') cuDNN descriptors for
        one slice of the batch, made at first use."""
        if self._wdesc is None:
            self._wdesc = api.FilterDesc((self.m, self.c2, self.kh2, self.kw2), self.dtype,
                                         layout=api.NHWC if self.nhwc else api.NCHW)
        descs = self._descs.get(slices)
        if descs is None:
            nb = self.n // slices
            x2 = (nb, self.c2, self.h2, self.w2)
            y = (nb, self.m, self.oh, self.ow)
            strides = api.nhwc_strides if self.nhwc else (lambda shape: None)
            descs = self._descs[slices] = (api.TensorDesc(x2, strides(x2), self.dtype),
                                           api.TensorDesc(y, strides(y), self.dtype))
        return descs + (self._wdesc,)

    @staticmethod
    def eligible(layer, cd):
        g = layer.geom
        if layer.reverse or layer.group != 1 or layer.num_spatial != 2 or layer.num <= 0 or \
                cd.loops != 1 or _prod(layer.out_spatial) <= 0:
            return False
        s = int(g.stride[0])
        return _s2d_search(cd.dtype.itemsize != 4) and s >= 2 and \
            tuple(int(v) for v in g.stride) == (s, s) and \
            tuple(int(v) for v in g.dilation) == (1, 1) and \
            min(int(k) for k in g.kernel) >= s and layer.channels <= S2D_MAX_CHANNELS

    def kinds(self):
        return ('fwd', 'bwd_filter')

    def conv(self, math):
        """The stride-1 convolution's descriptor under `math` (FMA in strict
        mode whatever cuDNN reports, as _ConvDescs.conv_for)."""
        if self.math == api.FMA_MATH:
            math = api.FMA_MATH
        c = self._convs.get(math)
        if c is None:
            c = self._convs[math] = api.ConvDesc((0, 0), (1, 1), (1, 1), 1, math=math)
        return c

    def filters(self, w, ops=_DeviceOps):
        """The regrouped filters of w (the layer's, as cuDNN reads them), in
        the variant's own buffer: its address (it stays from call to call)."""
        if self._w2 is None:
            import cupy
            self._w2 = cupy.zeros(self.w2_shape, self.dtype)
        w2 = int(self._w2.data.ptr)
        ops.filters(w, w2, self)
        return w2

    def slices(self, slices, own_order=False):
        """(images a slice, bytes from one slice's bottom to the next's, and
        its top's)."""
        nb, E = self.n // slices, self.dtype.itemsize
        strides = self.own_strides if own_order else self.x_strides
        return nb, nb * strides[0] * E, nb * self.m * self.oh * self.ow * E

    def forward(self, x, w, y, ws, nbytes, choice, own_order=False, ops=_DeviceOps):
        """y = conv(x, w) (no bias) on device pointers, in the workspace ws;
        x in the calls' order, or (`own_order`) in the bottom's own."""
        k, algo = api.s2d_parts(choice.algo)
        x2, yd, wdesc = self.descriptors(k)
        w2 = self.filters(w, ops)
        nb, x_step, y_step = self.slices(k, own_order)
        base = self.need('fwd', k)
        for i in range(k):
            ops.space_to_depth(x + i * x_step, ws, self, own_order, nb)
            api.conv_forward(x2, ws, wdesc, w2, self.conv(choice.math), algo, ws + base,
                             nbytes - base, yd, y + i * y_step)

    def backward_filter(self, x, dy, dw, ws, nbytes, choice, own_order=False, ops=_DeviceOps):
        """dw (float32) += the filter gradient, in the workspace ws (x as
        forward's); each slice's added to dw as it comes."""
        k, algo = api.s2d_parts(choice.algo)
        x2, yd, wdesc = self.descriptors(k)
        nb, x_step, y_step = self.slices(k, own_order)
        dw2 = ws + self.x2_bytes(k)
        base = self.need('bwd_filter', k)
        for i in range(k):
            ops.space_to_depth(x + i * x_step, ws, self, own_order, nb)
            api.conv_backward_filter(x2, ws, yd, dy + i * y_step, self.conv(choice.math), algo,
                                     ws + base, nbytes - base, wdesc, dw2, beta=0.0)
            ops.filter_gradient(dw2, dw, self)

    def time(self, kind, xa, wa, ya, wsp, ws_bytes):
        """The variant's candidates for `kind` over each slicing whose blocks
        fit `ws_bytes` (cuDNN's inner algorithms timed by FindEx on one slice
        in what the workspace leaves, plus the regrouping's own time, times
        the slices), as AlgoChoices of variant S2D_VARIANT."""
        import cupy
        wsp = int(wsp)
        x, w, y = int(xa.data.ptr), int(wa.data.ptr), int(ya.data.ptr)
        w2 = self.filters(w)
        dw_array = cupy.zeros(self.m * self.c * self.kh * self.kw, numpy.float32) \
            if kind == 'bwd_filter' else None
        dw = None if dw_array is None else int(dw_array.data.ptr)
        out = []
        for k in self.slicings:
            base = self.need(kind, k)
            if base > ws_bytes:
                continue
            nb = self.n // k
            dw2 = wsp + self.x2_bytes(k)

            def regroup():
                _DeviceOps.space_to_depth(x, wsp, self, False, nb)
                if kind == 'fwd':
                    _DeviceOps.filters(w, w2, self)
                else:
                    _DeviceOps.filter_gradient(dw2, dw, self)
            extra = median_ms(regroup)
            x2, yd, wdesc = self.descriptors(k)
            found = api.timed_algorithms(kind, x2, wdesc, self.conv(self.math), yd, wsp,
                                         w2 if kind == 'fwd' else dw2, y, wsp + base,
                                         ws_bytes - base)
            j = SLICINGS.index(k)
            out += [api.AlgoChoice(kind, S2D_ALGO + 10 * j + c.algo, base + c.memory,
                                   (c.time + extra) * k, c.deterministic, c.math,
                                   variant=S2D_VARIANT) for c in found]
        return out
