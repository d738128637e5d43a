"""ReLU, Sigmoid, TanH and ELU through cuDNN's activation calls; a masked
ReLU keeps one sign bit per value (caffeplus.memory.masks).
"""
import functools

import numpy

from caffeplus import backend
from caffeplus import kernels as _kernels
from caffeplus.cudnn import api
from caffeplus.errors import CaffeplusError
from caffeplus.layer import register_engine
from caffeplus.layers.cudnn_common import (READS_BOTH, _as4d, _CudnnMixin, _MaskableMixin, _dptr,
                                           _fits, _same_storage_dtype, cudnn_available,
                                           storage_dtype)
from caffeplus.layers.neuron import ELULayer, ReLULayer, SigmoidLayer, TanHLayer
from caffeplus.memory import scratch


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
                _fits(bottom[0].shape) and _same_storage_dtype(bottom, top):
            self._build(bottom[0].shape, storage_dtype(bottom[0]))

    def _build(self, shape, dtype=None):
        from caffeplus.cudnn import api
        key = (tuple(shape), backend.device(), dtype)
        if key == getattr(self, '_act_key', None):
            return
        self._act = (api.ActivationDesc(self.act_mode, self._act_coef()),
                     api.TensorDesc(_as4d(shape), dtype=dtype))
        self._act_replays = api.Replays()
        self._act_key = key

    def _ready(self, bottom, top, x):
        if not self._act_ok(bottom, top) or not _fits(x.shape) or not self._cudnn_usable(x) or \
                not _same_storage_dtype(bottom, top):
            return False
        self._build(x.shape, x.dtype)
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
            x, y = K.flat(bottom[0], any_dtype=True), K.flat(top[0], any_dtype=True)
            K.kernel('cp_relu_bits_fwd', x.dtype)(K.elementwise_grid(n), (K.ELEMENTWISE_THREADS,),
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
            dy = K.flat(top[0], diff=True, any_dtype=True)
            dx = K.flat(bottom[0], diff=True, any_dtype=True)
            K.kernel('cp_relu_bits_bwd', dy.dtype)(K.elementwise_grid(n), (K.ELEMENTWISE_THREADS,),
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
