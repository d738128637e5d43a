"""Concat on the GPU as one row copy per bottom each way.
"""
from caffeplus import kernels as _kernels
from caffeplus.layer import register_engine
from caffeplus.layers.common import ConcatLayer
from caffeplus.layers.cudnn_common import KernelPath, _fused, _prod


_COPY_ROWS = KernelPath('Concat (cp_copy_rows)')


def _copy_rows(src, src_off, src_pitch, dst, dst_off, dst_pitch, width, rows):
    """`rows` rows of `width` bytes from the device array `src`, `src_off`
    bytes in, to `dst` (caffeplus.kernels.copy_rows, else cudaMemcpy2DAsync)."""
    if _COPY_ROWS.run(_kernels.copy_rows, src, src_off, src_pitch, dst, dst_off, dst_pitch,
                      width, rows):
        return
    import cupy
    runtime = cupy.cuda.runtime
    runtime.memcpy2DAsync(int(dst.data.ptr) + dst_off, dst_pitch, int(src.data.ptr) + src_off,
                          src_pitch, width, rows,
                          runtime.memcpyDeviceToDevice, cupy.cuda.get_current_stream().ptr)


@register_engine('CUDNN')
class GPUConcatLayer(ConcatLayer):
    """Concat on the GPU: one row copy per bottom each way (the bottom's rows
    into their column range of the top; caffeplus.kernels.copy_rows), instead
    of a strided CuPy copy through sliced views. The copies move bytes, so
    16-bit maps take the same path."""
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
            ends.append(a)
        off = 0
        for b, a in zip(bottom, ends):
            width = int(b.shape[axis]) * inner
            if a is not None and width and outer:
                if backward:
                    _copy_rows(y, off, pitch, a, 0, width, width, outer)
                else:
                    _copy_rows(a, 0, width, y, off, pitch, width, outer)
            off += width
        return True

    def _forward(self, bottom, top):
        if not (_kernels.active() and _fused('Concat forward', self._copies, bottom, top, False)):
            super()._forward(bottom, top)

    def _backward(self, top, propagate_down, bottom):
        self._propagate = list(propagate_down)
        if not (_kernels.active() and _fused('Concat backward', self._copies, bottom, top, True)):
            super()._backward(top, propagate_down, bottom)
