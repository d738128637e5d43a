"""Softmax through cuDNN.
"""
import functools

from caffeplus import backend
from caffeplus.cudnn import api
from caffeplus.layer import register_engine
from caffeplus.layers.common import SoftmaxLayer
from caffeplus.layers.cudnn_common import (_CudnnMixin, _dptr, _fits, _prod, _same_storage_dtype,
                                           cudnn_available, storage_dtype)


@register_engine('CUDNN')
class CuDNNSoftmaxLayer(_CudnnMixin, SoftmaxLayer):
    """Softmax along `axis` as cuDNN's CHANNEL mode on (outer, C, inner, 1)."""

    def layer_setup(self, bottom, top):
        super().layer_setup(bottom, top)
        self._desc = None
        self._desc_key = None

    def reshape(self, bottom, top):
        super().reshape(bottom, top)
        # (A 16-bit bottom under a float32 output runs the generic code.)
        self._dtypes_agree = _same_storage_dtype(bottom, top)
        if self._gpu_mode() and cudnn_available() and _fits(bottom[0].shape) and \
                self._dtypes_agree:
            self._build(bottom[0].shape, storage_dtype(bottom[0]))

    _dtypes_agree = True

    def _build(self, shape, dtype=None):
        from caffeplus.cudnn import api
        key = (tuple(shape), self.axis, backend.device(), dtype)
        if key == self._desc_key:
            return
        outer = _prod(shape[:self.axis])
        inner = _prod(shape[self.axis + 1:])
        self._desc = api.TensorDesc((outer, int(shape[self.axis]), inner, 1), dtype=dtype)
        self._replays = api.Replays()
        self._desc_key = key

    def _ready(self, x):
        if not _fits(x.shape) or not self._dtypes_agree or not self._cudnn_usable(x):
            return False
        self._build(x.shape, x.dtype)
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
