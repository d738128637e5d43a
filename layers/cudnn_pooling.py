"""MAX and AVE pooling through cuDNN where its output shape is Caffe's; the
fused kernels (Caffe's ceil rule) and the masked one-byte argmax elsewhere.
"""
import functools

import numpy

from caffeplus import backend
from caffeplus import kernels as _kernels
from caffeplus.cudnn import api
from caffeplus.errors import CaffeplusError
from caffeplus.layer import register_engine
from caffeplus.layers.cudnn_common import (READS_BOTH, _CudnnMixin, _MaskableMixin, _dptr,
                                           _fused, _prod, _same_storage_dtype, batch_slices,
                                           cudnn_available, relaid_top, storage_dtype,
                                           top_from_relaid)
from caffeplus.layers.vision import AVE, MAX, PoolingLayer
from caffeplus.memory import scratch


# Max pooling on the argmax kernels may store its top in the other order than
# its bottom (CuDNNPoolingLayer.layout_role; off: one order both sides), so a
# ceil-rule pooling does not tie the maps after it to Caffe's order
# (GoogLeNet's inceptions; docs/precision.md, Channels-last maps).
ARGMAX_BETWEEN_ORDERS = True


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


@register_engine('CUDNN')
class CuDNNPoolingLayer(_MaskableMixin, _CudnnMixin, PoolingLayer):
    """MAX and AVE pooling through cuDNN where cuDNN's output shape equals
    Caffe's; there Caffe's AVE divisor (the window clipped to H + pad) is
    the full kernel, which is cuDNN's AVERAGE_COUNT_INCLUDE_PADDING."""
    _layouts = ('NCHW', 'NCHW')

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

    _storage_dtype = numpy.dtype(numpy.float32)
    _dtypes_agree = True

    def layout_role(self):
        """caffeplus.layout: where cuDNN's windows are Caffe's, cuDNN reads
        and writes either order, each side its own ('channels_last'); else
        MAX pooling on caffeplus's argmax kernels, which read and write one
        order: where the top is stored in the other, they write a scratch in
        the bottom's order that is transposed into the top (GoogLeNet's
        pool2, from its stem's LRN in Caffe's order into channels-last
        inceptions; 19 MiB at b64 in FP16)."""
        if not self._gpu_mode():
            return None
        return self._role(cudnn_available(), _kernels.active())

    def gpu_layout_role(self):
        """layout_role() on a GPU with cuDNN and caffeplus's kernels
        (caffeplus.layout.modelled_blobs)."""
        return self._role(True, True)

    def _role(self, cudnn, kernels):
        if not (self._dtypes_agree and self.pool is not None and len(self.pool.x_shape) == 4):
            return None
        if cudnn and self.cudnn_agrees():
            return 'channels_last'
        if kernels and self._argmax_geometry():
            return 'channels_last' if ARGMAX_BETWEEN_ORDERS else 'tied'
        return None

    def _argmax_kernels(self, layouts=None):
        """Whether the one-byte argmax kernels run (masked or not): a masked
        layer, and channels-last MAX pooling, whose cuDNN kernels are slow
        (VGG-16's pool1: 3.56 ms forward and backward, against 1.54 in
        Caffe's order; dev/nhwc_layout_probe.py). `layouts`: the (bottom,
        top) orders a GPU would store, for a layer built elsewhere; the
        answer is then the GPU's, kernels on."""
        if layouts is None:
            if not _kernels.active():
                return False
            layouts = self._layouts
        if self.masked:
            return True
        if not self._argmax_geometry():
            return False
        return layouts == ('NHWC', 'NHWC') or self._top_relaid(layouts)

    def _top_relaid(self, layouts=None):
        """Top and bottom stored in different orders, cuDNN's windows not
        Caffe's: the argmax kernels run in the bottom's order into a scratch."""
        bottom, top = layouts or self._layouts
        return bottom != top and not self.cudnn_agrees()

    def reshape(self, bottom, top):
        super().reshape(bottom, top)
        self._ntop = len(top)
        self._layouts = (bottom[0].layout, top[0].layout)
        self._storage_dtype = storage_dtype(bottom[0])
        self._dtypes_agree = _same_storage_dtype(bottom, top)
        if self._gpu_mode() and cudnn_available() and self.cudnn_agrees():
            self._build()

    def _build(self):
        from caffeplus.backend import mathmode
        from caffeplus.cudnn import api
        pool = self.pool
        k = self._batch_slices()
        dtype = self._storage_dtype
        key = (pool.x_shape, pool.out_shape, tuple(pool.geom), pool.method, k,
               mathmode.generation(), backend.device(), dtype, self._layouts)
        if key == self._pd_key:
            return
        if pool.method == MAX:
            mode = api.POOL_MAX_DETERMINISTIC if mathmode.deterministic() else api.POOL_MAX
        else:
            mode = api.POOL_AVG_INCLUDE_PAD
        n = pool.x_shape[0] // k
        x_slice, y_slice = (n,) + tuple(pool.x_shape[1:]), (n,) + tuple(pool.out_shape[1:])
        x_strides, y_strides = (api.nhwc_strides(shape) if layout == 'NHWC' else None
                                for shape, layout in zip((x_slice, y_slice), self._layouts))
        self._pd = (api.PoolDesc(mode, pool.geom.kernel, pool.geom.pad, pool.geom.stride),
                    api.TensorDesc(x_slice, x_strides, dtype=dtype),
                    api.TensorDesc(y_slice, y_strides, dtype=dtype))
        # One call per batch slice (a blob over cuDNN's 32-bit count): byte steps.
        self._pool_loops = (k, _prod(x_slice) * dtype.itemsize, _prod(y_slice) * dtype.itemsize)
        self._replays = api.Replays()
        self._pd_key = key

    def _batch_slices(self):
        pool = self.pool
        return batch_slices(pool.x_shape[0], pool.x_shape[1:], pool.out_shape[1:])

    def _ready(self, *arrays):
        if not self.cudnn_agrees() or not self._dtypes_agree or not self._cudnn_usable(*arrays):
            return False
        self._build()
        return True

    def _forward(self, bottom, top):
        self._fused_arg = False
        if self._argmax_kernels():
            return self._masked_forward(bottom, top)
        if not self._ready(_kernels.flat(bottom[0], any_dtype=True)):
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
        if self._argmax_kernels():
            return self._masked_backward(top, bottom)
        if not self._ready(_kernels.flat(top[0], True, any_dtype=True)):
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

    def masked_bits_unchanged(self, layouts=None):
        """Whether masking leaves the layer's results bit for bit: cuDNN's
        max pooling gives the masked kernels' bits where the windows do not
        overlap (dev/compare_pooling.py), and where cuDNN does not run the
        kernels' int32 argmax computes what the masked one does. `layouts`:
        as _argmax_kernels."""
        pool = self.pool
        (kh, kw), (sh, sw), _ = pool.geom
        oh, ow = pool.out_shape[2:]
        overlapping = (kh > sh and oh > 1) or (kw > sw and ow > 1)
        return not overlapping or not self.cudnn_agrees() or self._argmax_kernels(layouts)

    def can_mask(self):
        """MAX pooling with one top and windows of at most 255 values."""
        return self._argmax_geometry() and \
            self._layouts[0] == self._layouts[1]        # (the kernels: one order both sides)

    def _argmax_geometry(self):
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
        relaid = not self.masked and self._top_relaid()
        x = K.flat(bottom[0], any_dtype=True)
        y = relaid_top(top[0], not self._nhwc()) if relaid else K.flat(top[0], any_dtype=True)
        self._arg8 = arg = scratch.get(self, 'argmax8', count, numpy.uint8, K.array_module())
        name, args = ('cp_mpool_fwd_nhwc', self._channel_arg()) if self._nhwc() \
            else ('cp_mpool_fwd', ())
        K.kernel(name, x.dtype)(self._grid(count, x.dtype), (K.ELEMENTWISE_THREADS,),
                                (x, y, arg, numpy.uint64(count)) + args + self._window_args())
        if relaid:
            top_from_relaid(top[0], y, not self._nhwc())

    def _nhwc(self):
        return self._layouts[0] == 'NHWC'

    def _grid(self, count, dtype):
        """The pooling kernels' grid over `count` values."""
        if self._nhwc():
            return _kernels.channels_grid(count, self.pool.x_shape[1], dtype)
        return _kernels.elementwise_grid(count)

    def _channel_arg(self):
        return (_kernels.i32(self.pool.x_shape[1]),)

    def _masked_backward(self, top, bottom):
        K = _kernels
        if self._arg8 is None:
            raise CaffeplusError("layer '%s': backward before forward (its argmax mask is not "
                                 "there)" % self.name)
        pool = self.pool
        dy = relaid_top(top[0], not self._nhwc(), diff=True) \
            if not self.masked and self._top_relaid() else K.flat(top[0], diff=True, any_dtype=True)
        dx = K.flat(bottom[0], diff=True, any_dtype=True)
        (kh, kw), (sh, sw), (ph, pw) = pool.geom
        (h, w), (oh, ow) = pool.x_shape[2:], pool.out_shape[2:]
        nhwc = self._nhwc()
        channels = self._channel_arg() if nhwc else ()
        if (kh, kw) == (sh, sw) and ph == pw == 0 and (h, w) == (oh * kh, ow * kw):
            # Windows that tile the input (VGG-16's): each output writes its own.
            count = _prod(pool.out_shape)
            K.kernel('cp_mpool_bwd_tiled_nhwc' if nhwc else 'cp_mpool_bwd_tiled', dy.dtype)(
                self._grid(count, dy.dtype), (K.ELEMENTWISE_THREADS,),
                (dy, self._arg8, dx, numpy.uint64(count)) + channels +
                tuple(K.i32(v) for v in (oh, ow, kh, kw)))
            return
        count = _prod(pool.x_shape)
        K.kernel('cp_mpool_bwd_nhwc' if nhwc else 'cp_mpool_bwd', dy.dtype)(
            self._grid(count, dy.dtype), (K.ELEMENTWISE_THREADS,),
            (dy, self._arg8, dx, numpy.uint64(count)) + channels + self._window_args())

    def internal_buffers(self):
        """On the GPU, MAX pooling's kernel keeps an int32 argmax for
        backward; cuDNN keeps nothing (its backward reads x and y); a masked
        layer, and channels-last MAX pooling, keep a one-byte argmax."""
        pool = self.pool
        if self._argmax_kernels():
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
        if self.masked or self._argmax_kernels():
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
        arrays, dtype = K.maps((bottom[0], False), (top[0], False))
        if arrays is None:
            return False
        x, y = arrays
        count = _prod(pool.out_shape)
        arg = y
        if pool.method == MAX:
            # The kept argmax: the memory plan's view, else the layer's own.
            self._arg_buf = arg = scratch.get(self, 'argmax', count, numpy.int32,
                                              K.array_module())
        K.kernel('cp_pool_fwd', dtype)(K.elementwise_grid(count * K.UNROLL),
                                       (K.ELEMENTWISE_THREADS,), (x, y, arg) + self._pool_args())
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
        arrays, dtype = K.maps((top[0], True), (bottom[0], True))
        if arrays is None:
            return False
        dy, dx = arrays
        arg = pool.arg if pool.method == MAX else dy
        count = _prod(pool.x_shape)
        K.kernel('cp_pool_bwd', dtype)(K.elementwise_grid(count * K.UNROLL),
                                       (K.ELEMENTWISE_THREADS,), (dy, arg, dx) + self._pool_args())
        return True
