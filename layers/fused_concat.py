"""Concat on the GPU as one 2-D copy per bottom each way.
"""
from caffeplus import kernels as _kernels
from caffeplus.layer import register_engine
from caffeplus.layers.common import ConcatLayer
from caffeplus.layers.cudnn_common import _fused, _prod


@register_engine('CUDNN')
class GPUConcatLayer(ConcatLayer):
    """Concat on the GPU: one cudaMemcpy2DAsync per bottom each way (the
    bottom's rows into their column range of the top), instead of a strided
    CuPy copy through sliced views. The copies move bytes, so 16-bit maps
    take the same path."""
    engine = 'FUSED'

    def _copies(self, bottom, top, backward):
        K = _kernels
        if len(bottom) < 2 or K.emulating():
            return False
        axis = self.axis
        shape = top[0].shape
        y = K.flat(top[0], diff=backward, any_dtype=True)
        if y is None:
            return False
        if top[0].layout == 'NHWC':     # (rows of channels: the concat axis is the last)
            outer, inner = _prod(shape) // int(shape[axis]), y.dtype.itemsize
        else:
            outer = _prod(shape[:axis])
            inner = _prod(shape[axis + 1:]) * y.dtype.itemsize
        pitch = int(shape[axis]) * inner
        ends = []
        for i, b in enumerate(bottom):
            if backward and not self._propagate[i]:
                ends.append(None)
                continue
            a = K.flat(b, diff=backward, any_dtype=True)
            # A byte copy cannot convert: every bottom must share the top's type.
            if a is None or a.dtype != y.dtype:
                return False
            ends.append(int(a.data.ptr))
        import cupy
        runtime = cupy.cuda.runtime
        stream = cupy.cuda.get_current_stream().ptr
        base, off = int(y.data.ptr), 0
        for b, p in zip(bottom, ends):
            width = int(b.shape[axis]) * inner
            if p is not None and width and outer:
                if backward:
                    runtime.memcpy2DAsync(p, width, base + off, pitch, width, outer,
                                          runtime.memcpyDeviceToDevice, stream)
                else:
                    runtime.memcpy2DAsync(base + off, pitch, p, width, width, outer,
                                          runtime.memcpyDeviceToDevice, stream)
            off += width
        return True

    def _forward(self, bottom, top):
        if not (_kernels.active() and _fused('Concat forward', self._copies, bottom, top, False)):
            super()._forward(bottom, top)

    def _backward(self, top, propagate_down, bottom):
        self._propagate = list(propagate_down)
        if not (_kernels.active() and _fused('Concat backward', self._copies, bottom, top, True)):
            super()._backward(top, propagate_down, bottom)
