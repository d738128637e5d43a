"""ACROSS_CHANNELS LRN through cuDNN.
"""
import functools

from caffeplus import backend
from caffeplus.cudnn import api
from caffeplus.layer import register_engine
from caffeplus.layers.cudnn_common import (READS_BOTH, _as4d, _CudnnMixin, _dptr, _fits,
                                           _same_storage_dtype, cudnn_available, storage_dtype)
from caffeplus.layers.vision import LRNLayer
from caffeplus.proto import caffe_pb2


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
        self._dtypes_agree = _same_storage_dtype(bottom, top)
        if self._gpu_mode() and cudnn_available() and self._cudnn_ok(bottom[0].shape):
            self._build(bottom[0].shape, storage_dtype(bottom[0]))

    _dtypes_agree = True

    def _build(self, shape, dtype=None):
        from caffeplus.cudnn import api
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
