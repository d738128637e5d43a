"""ACROSS_CHANNELS LRN through cuDNN; for BFLOAT16 maps, which cuDNN's LRN
does not take, caffeplus.kernels' cp_lrn_fwd/cp_lrn_bwd; over channels-last
16-bit maps, their channels-last forms.
"""
import functools

import numpy

from caffeplus import backend
from caffeplus import kernels as _kernels
from caffeplus.cudnn import api
from caffeplus.layer import register_engine
from caffeplus.layers.cudnn_common import (READS_BOTH, _as4d, _CudnnMixin, _dptr, _fits,
                                           _same_storage_dtype, cudnn_available, storage_dtype)
from caffeplus.errors import CaffeplusError
from caffeplus.layers.vision import LRNLayer
from caffeplus.proto import caffe_pb2


# The map types cuDNN's LRN takes (cuDNN 9 has no BFLOAT16 LRN: a BFLOAT16
# net's LRN runs the fused kernels' cp_lrn_*, or where they cannot, cuDNN's
# float32 one on float32 copies of its maps).
_CUDNN_LRN_TYPES = ('float32', 'float16')
# The widest window cp_lrn_* keep in registers (kernel_sources_extra's CP_LRN_MAX).
KERNEL_MAX_SIZE = 15
# Channels a cp_lrn_* thread walks: enough threads to fill the device, few
# window re-reads at a chunk's start (2 * pre channels in backward).
KERNEL_CHANNEL_CHUNK = 16
# A 16-bit LRN across channels may read and write channels-last maps, its
# bottom and top alike (cp_lrn_fwd_nhwc/cp_lrn_bwd_nhwc), so that the
# convolutions around it need not keep Caffe's order (BVLC AlexNet's,
# GoogLeNet's stem). Off by default: with it and GROUPED_CHANNELS_LAST on,
# BVLC AlexNet's FP16 step took 10.2 ms against 7.6 (docs/precision.md,
# Channels-last maps).
CHANNELS_LAST = False


def _math_dtype(dtype):
    return dtype if dtype is None or numpy.dtype(dtype).name in _CUDNN_LRN_TYPES \
        else numpy.dtype(numpy.float32)


FLOAT32_SLICE_BYTES = 16 << 20


def _empty_like(a):
    import cupy
    return cupy.empty_like(a)


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

    # caffeplus.layout: where channels_last_ok, either order, bottom and top alike.
    layout_role = 'tied'

    def channels_last_ok(self):
        return self._gpu_mode() and _kernels.active() and self.gpu_channels_last_ok()

    def gpu_channels_last_ok(self):
        """channels_last_ok() on a GPU with caffeplus's kernels (the estimate's
        model, caffeplus.layout.modelled_blobs)."""
        return CHANNELS_LAST and self.region == caffe_pb2.LRNParameter.ACROSS_CHANNELS and \
            self.size <= KERNEL_MAX_SIZE and self._dtypes_agree and \
            getattr(self, '_sixteen_bit_maps', False) and \
            0 < getattr(self, '_count', 0) <= _kernels.MAX_COUNT

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
        self._dtypes_agree = _same_storage_dtype(bottom, top)
        self._sixteen_bit_maps = storage_dtype(bottom[0]).itemsize == 2
        self._count = bottom[0].count
        if self._gpu_mode() and cudnn_available() and self._cudnn_ok(bottom[0].shape):
            self._build(bottom[0].shape, storage_dtype(bottom[0]))

    _dtypes_agree = True

    def _build(self, shape, dtype=None):
        from caffeplus.cudnn import api
        dtype = _math_dtype(dtype)
        key = (tuple(shape), backend.device(), dtype)
        if key == self._desc_key:
            return
        self._desc = (api.LRNDesc(self.size, self.alpha, self.beta, self.k),
                      api.TensorDesc(_as4d(shape), dtype=dtype))
        self._replays = api.Replays()
        self._desc_key = key

    def _ready(self, x):
        if not self._cudnn_ok(x.shape) or not self._dtypes_agree or not self._cudnn_usable(x):
            return False
        self._build(x.shape, x.dtype)
        return True

    def _converts(self, x):
        return _math_dtype(x.dtype) != x.dtype

    def _float32_slices(self, shape):
        """(first image, end, float32 descriptor) of the batch in slices of at
        most FLOAT32_SLICE_BYTES a float32 copy: the copies' memory stays small
        beside the maps (GoogLeNet's norm2 would take 154 MB a copy)."""
        n = int(shape[0])
        per_image = 4 * max(1, int(numpy.prod(shape[1:])))
        step = max(1, min(n, FLOAT32_SLICE_BYTES // per_image))
        descs = self.__dict__.setdefault('_float32_descs', {})
        for lo in range(0, n, step):
            hi = min(n, lo + step)
            key = (hi - lo,) + tuple(shape[1:])
            if key not in descs:
                descs[key] = api.TensorDesc(_as4d(key), dtype=numpy.float32)
            yield lo, hi, descs[key]

    def _window_args(self):
        """(size, alpha/size, k, beta) as every cp_lrn_* kernel takes them."""
        return (numpy.int32(self.size),
                numpy.float32(numpy.float32(self.alpha) / numpy.float32(self.size)),
                numpy.float32(self.k), numpy.float32(self.beta))

    def _kernel_args(self, shape):
        """(threads, C, HW, size, alpha/size, k, beta, chunk) as cp_lrn_* take them."""
        n, c = int(shape[0]), int(shape[1])
        hw = int(numpy.prod(shape[2:]))
        chunks = -(-c // KERNEL_CHANNEL_CHUNK)
        return (numpy.uint32(n * chunks * hw), numpy.int32(c), numpy.uint32(hw)) + \
            self._window_args() + (numpy.int32(KERNEL_CHANNEL_CHUNK),)

    def _kernel_ok(self, shape):
        return _kernels.active() and self.size <= KERNEL_MAX_SIZE and \
            int(numpy.prod(shape)) <= _kernels.MAX_COUNT

    def _run_kernel(self, name, shape, *blob_diffs):
        """cp_lrn_fwd or cp_lrn_bwd (`name`) on the maps of (blob, diff) pairs
        in the kernel's order, where cuDNN's LRN does not take their type;
        False where the kernel cannot run."""
        arrays, dtype = _kernels.maps(*blob_diffs) if self._kernel_ok(shape) else (None, None)
        if arrays is None:
            return False
        args = self._kernel_args(shape)
        _kernels.kernel(name, dtype)(_kernels.elementwise_grid(int(args[0])),
                                     (_kernels.ELEMENTWISE_THREADS,), tuple(arrays) + args)
        return True

    def _run_channels_last(self, name, blob, *blob_diffs):
        """cp_lrn_fwd_nhwc or cp_lrn_bwd_nhwc (`name`) over channels-last maps
        (the layout put them there only where channels_last_ok)."""
        arrays, dtype = _kernels.maps(*blob_diffs)
        if arrays is None:
            raise CaffeplusError('layer %s: its channels-last maps need caffeplus\'s LRN kernels'
                                 % self.layer_param.name)
        count = blob.count
        args = (numpy.uint32(count), numpy.int32(blob.shape[1])) + self._window_args()
        _kernels.kernel(name, dtype)(_kernels.elementwise_grid(count),
                                     (_kernels.ELEMENTWISE_THREADS,), tuple(arrays) + args)

    def _forward(self, bottom, top):
        if bottom[0].layout == 'NHWC':
            return self._run_channels_last('cp_lrn_fwd_nhwc', bottom[0], (bottom[0], False),
                                           (top[0], False))
        if not self._ready(bottom[0].data):
            return super()._forward(bottom, top)
        lrn, xd = self._desc
        if self._converts(bottom[0].data):
            if self._run_kernel('cp_lrn_fwd', bottom[0].shape, (bottom[0], False),
                                (top[0], False)):
                return
            x, y = bottom[0].data, top[0].data
            for lo, hi, desc in self._float32_slices(x.shape):
                x32 = x[lo:hi].astype(numpy.float32)
                y32 = _empty_like(x32)
                api.lrn_forward(lrn, desc, x32, y32)
                y[lo:hi] = y32              # rounded once to the map's type
            return
        x, y = _dptr(bottom[0]), _dptr(top[0])
        self._replays.run(('f', x, y), functools.partial(api.lrn_forward, lrn, xd, x, y))

    def _backward(self, top, propagate_down, bottom):
        if not propagate_down[0]:
            return
        if bottom[0].layout == 'NHWC':
            return self._run_channels_last('cp_lrn_bwd_nhwc', bottom[0], (bottom[0], False),
                                           (top[0], False), (top[0], True), (bottom[0], True))
        if not self._ready(bottom[0].data):
            return super()._backward(top, propagate_down, bottom)
        lrn, xd = self._desc
        if self._converts(bottom[0].data):
            if self._run_kernel('cp_lrn_bwd', bottom[0].shape, (bottom[0], False),
                                (top[0], False), (top[0], True), (bottom[0], True)):
                return
            y, dy, x, dx = top[0].data, top[0].diff, bottom[0].data, bottom[0].diff
            for lo, hi, desc in self._float32_slices(x.shape):
                y32, dy32, x32 = (a[lo:hi].astype(numpy.float32) for a in (y, dy, x))
                dx32 = _empty_like(x32)
                api.lrn_backward(lrn, desc, y32, dy32, x32, dx32)
                dx[lo:hi] = dx32
            return
        y, dy = _dptr(top[0]), _dptr(top[0], True)
        x, dx = _dptr(bottom[0]), _dptr(bottom[0], True)
        self._replays.run(('b', y, dy, x, dx), functools.partial(
            api.lrn_backward, lrn, xd, y, dy, x, dx))
