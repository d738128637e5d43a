"""Convolution over a space-to-depth image: the variant timed search weighs
beside cuDNN's algorithms for a strided convolution over few input channels
(variant S2D_VARIANT of a call site).
"""
import numpy

from caffeplus import kernels as _kernels
from caffeplus.cudnn import api
from caffeplus.cudnn.algo_search import S2D_ALGO, S2D_VARIANT, _prod, _s2d_search, median_ms

S2D_MAX_CHANNELS = 4            # input channels up to which it is timed (image layers)
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
    def space_to_depth(cls, x, x2, g, own_order=False):
        total = g.n * g.h2 * g.w2 * g.c2
        cls.kernel('cp_space_to_depth', g.kernel_dtype)(
            _kernels.elementwise_grid(total), (_kernels.ELEMENTWISE_THREADS,),
            (_pointer(x), _pointer(x2), numpy.uint64(total)) +
            tuple(_kernels.i32(v) for v in (g.c, g.h, g.w, g.s, g.ph, g.pw, g.h2, g.w2)) +
            tuple(numpy.uint64(v) for v in (g.own_strides if own_order else g.x_strides)) +
            (_kernels.i32(g.nhwc),))

    @classmethod
    def filters(cls, w, w2, g):
        total = g.m * g.kh2 * g.kw2 * g.c2
        cls.kernel('cp_s2d_filter', g.kernel_dtype)(
            _kernels.elementwise_grid(total), (_kernels.ELEMENTWISE_THREADS,),
            (_pointer(w), _pointer(w2), _kernels.u32(total)) +
            tuple(_kernels.i32(v) for v in (g.c, g.kh, g.kw, g.s, g.kh2, g.kw2)) +
            tuple(_kernels.u32(v) for v in g.w_strides) + (_kernels.i32(g.nhwc),))

    @classmethod
    def filter_gradient(cls, dw2, dw, g):
        total = g.m * g.c * g.kh * g.kw
        cls.kernel('cp_s2d_filter_grad', g.kernel_dtype)(
            _kernels.elementwise_grid(total), (_kernels.ELEMENTWISE_THREADS,),
            (_pointer(dw2), _pointer(dw), _kernels.u32(total)) +
            tuple(_kernels.i32(v) for v in (g.c, g.kh, g.kw, g.s, g.kh2, g.kw2, g.nhwc)))


class _SpaceToDepthConv:
    """A 2-D convolution of stride s (both axes) over few channels, as a
    stride-1 convolution over blocks of s x s pixels: x2 holds each block's
    C s^2 values as channels (in the layer's calling order), the filters
    are regrouped the same way into ceil(kh/s) x ceil(kw/s) taps (those
    past the kernel zero), and cuDNN runs that convolution. cuDNN's kernels are slow on
    the 3 channels of an image net's first layer and fast on 48 (AlexNet's
    conv1: 11x11, stride 4 becomes 3x3 over 48 channels, the same top).

    Forward: x2 into the workspace, the filters into a buffer of the
    variant's own (a few KiB), cuDNN's forward into the layer's top (the
    bias after it, by the layer). Filter gradient: x2 into the workspace
    again, cuDNN's filter gradient of x2 after it (in the maps' type, beta
    0), added in float32 to the FP32 master's (cp_s2d_filter_grad). No
    data gradient (an image layer's bottom needs none; the data-gradient
    site keeps cuDNN's algorithms).

    A choice's `algo` is S2D_ALGO plus cuDNN's algorithm of the inner call,
    its `memory` x2's bytes (and the inner filter gradient's) plus that
    algorithm's workspace."""

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
        E = self.dtype.itemsize
        self.x2_bytes = _aligned(self.n * self.h2 * self.w2 * self.c2 * E)
        self.w2_shape = (self.m, self.kh2, self.kw2, self.c2) if self.nhwc else \
            (self.m, self.c2, self.kh2, self.kw2)
        self.dw2_bytes = _aligned(_prod(self.w2_shape) * E)
        self.y = cd.y
        self.math = cd.math
        self._convs = {}
        self._w2 = None
        self._x2 = self._wdesc = None

    def descriptors(self):
        """(x2's, the regrouped filters') cuDNN descriptors, made at first use."""
        if self._x2 is None:
            shape = (self.n, self.c2, self.h2, self.w2)
            self._x2 = api.TensorDesc(shape, api.nhwc_strides(shape) if self.nhwc else None,
                                      self.dtype)
            self._wdesc = api.FilterDesc((self.m, self.c2, self.kh2, self.kw2), self.dtype,
                                         layout=api.NHWC if self.nhwc else api.NCHW)
        return self._x2, self._wdesc

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

    def memory(self, kind):
        """The workspace besides the inner call's own."""
        return self.x2_bytes + (self.dw2_bytes if kind == 'bwd_filter' else 0)

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

    def forward(self, x, w, y, ws, nbytes, choice, own_order=False, ops=_DeviceOps):
        """y = conv(x, w) (no bias) on device pointers, in the workspace ws;
        x in the calls' order, or (`own_order`) in the bottom's own."""
        x2, wdesc = self.descriptors()
        w2 = self.filters(w, ops)
        ops.space_to_depth(x, ws, self, own_order)
        inner = ws + self.x2_bytes
        api.conv_forward(x2, ws, wdesc, w2, self.conv(choice.math),
                         choice.algo - S2D_ALGO, inner, nbytes - self.x2_bytes, self.y, y)

    def backward_filter(self, x, dy, dw, ws, nbytes, choice, own_order=False, ops=_DeviceOps):
        """dw (float32) += the filter gradient, in the workspace ws (x as forward's)."""
        x2, wdesc = self.descriptors()
        ops.space_to_depth(x, ws, self, own_order)
        dw2 = ws + self.x2_bytes
        inner = dw2 + self.dw2_bytes
        api.conv_backward_filter(x2, ws, self.y, dy, self.conv(choice.math),
                                 choice.algo - S2D_ALGO, inner, nbytes - self.memory('bwd_filter'),
                                 wdesc, dw2, beta=0.0)
        ops.filter_gradient(dw2, dw, self)

    def time(self, kind, xa, wa, ya, wsp, ws_bytes):
        """The variant's candidates for `kind` (cuDNN's inner algorithms timed
        by FindEx in what the workspace leaves, plus the regrouping's own
        time), as AlgoChoices of variant S2D_VARIANT."""
        import cupy
        wsp, base = int(wsp), self.memory(kind)
        x, w, y = int(xa.data.ptr), int(wa.data.ptr), int(ya.data.ptr)
        w2 = self.filters(w)
        dw2 = wsp + self.x2_bytes

        def regroup():
            _DeviceOps.space_to_depth(x, wsp, self)
            if kind == 'fwd':
                _DeviceOps.filters(w, w2, self)
            else:
                _DeviceOps.filter_gradient(dw2, dw, self)
        dw_array = cupy.zeros(self.m * self.c * self.kh * self.kw, numpy.float32) \
            if kind == 'bwd_filter' else None
        dw = None if dw_array is None else int(dw_array.data.ptr)
        extra = median_ms(regroup)
        x2, wdesc = self.descriptors()
        found = api.timed_algorithms(kind, x2, wdesc, self.conv(self.math), self.y, wsp,
                                     w2 if kind == 'fwd' else dw2, y, wsp + base, ws_bytes - base)
        return [api.AlgoChoice(kind, S2D_ALGO + c.algo, base + c.memory, c.time + extra,
                               c.deterministic, c.math, variant=S2D_VARIANT) for c in found]
