"""InnerProduct on the GPU as cuBLAS GEMMs on the blobs' storage.
"""
import numpy

from caffeplus import kernels as _kernels
from caffeplus.backend import blas
from caffeplus.layer import register_engine
from caffeplus.layers.common import InnerProductLayer
from caffeplus.layers.cudnn_common import _fused


@register_engine('CUDNN')
class GPUInnerProductLayer(InnerProductLayer):
    """InnerProduct on the GPU as cublasGemmEx calls on the blobs' storage
    (caffeplus.backend.blas): no views, no temporaries. The weight gradient
    accumulates inside its GEMM (beta = 1; the generic code makes a
    weight-sized temporary and adds it, a pass over 150-400 MB for AlexNet's
    and VGG's fc6), the bias gradient is one GEMM with a ones vector
    (beta = 1), the bias is added by a rank-1 GEMM (k = 1: exactly y + b,
    as the generic code). The matrix products follow the math mode (TF32
    or strict FP32, CUBLAS_COMPUTE_32F); the bias sums are FP32 always.
    Under a placing plan on Hopper the GEMMs run on caffeplus's own cuBLAS
    handle with workspace the plan placed for this layer's forward and
    backward steps (`gemm_views`; caffeplus.memory.cublas_pool)."""
    engine = 'FUSED'
    _ones = None
    gemm_views = {}         # 'forward' | 'backward' -> (pointer, bytes), set by the plan

    def _ones_ptr(self, n):
        K = _kernels
        if self._ones is None or self._ones.size < n or not K.is_device(self._ones):
            import cupy
            self._ones = cupy.ones(max(int(n), 1), dtype=numpy.float32)
        return int(self._ones.data.ptr)

    def _usable(self):
        K = _kernels
        if K.emulating():
            return False
        limit = 2 ** 31 - 1       # cuBLAS's int dimensions
        return 0 < self.M <= limit and 0 < self.K <= limit and 0 < self.num_output <= limit

    def _fast_forward(self, bottom, top):
        K = _kernels
        if not self._usable():
            return False
        x, w, y = K.flat(bottom[0]), K.flat(self.blobs[0]), K.flat(top[0])
        bias = K.flat(self.blobs[1]) if self.bias_term else None
        if x is None or w is None or y is None or (self.bias_term and bias is None):
            return False
        M, N, Kd = self.M, self.num_output, self.K
        xp, wp, yp = int(x.data.ptr), int(w.data.ptr), int(y.data.ptr)
        ws = self.gemm_views.get('forward')
        if self.transpose:          # W is K x N: y = x W
            blas.gemm(blas.N, blas.N, N, M, Kd, wp, N, xp, Kd, yp, N, workspace=ws)
        else:                       # W is N x K: y = x W^T
            blas.gemm(blas.T, blas.N, N, M, Kd, wp, Kd, xp, Kd, yp, N, workspace=ws)
        if bias is not None:        # y += 1 b^T
            blas.gemm(blas.N, blas.N, N, M, 1, int(bias.data.ptr), N, self._ones_ptr(M), 1, yp, N,
                      beta=1.0, tf32=False, workspace=ws)
        return True

    def _forward(self, bottom, top):
        if not (_kernels.active() and
                _fused('InnerProduct forward', self._fast_forward, bottom, top)):
            super()._forward(bottom, top)

    def _fast_backward(self, top, propagate_down, bottom):
        K = _kernels
        if not self._usable():
            return False
        M, N, Kd = self.M, self.num_output, self.K
        want_w = self.param_needs_backward(0)
        want_b = self.bias_term and self.param_needs_backward(1)
        dy, x = K.flat(top[0], diff=True), K.flat(bottom[0])
        dw = K.flat(self.blobs[0], diff=True) if want_w else None
        db = K.flat(self.blobs[1], diff=True) if want_b else None
        dx = K.flat(bottom[0], diff=True) if propagate_down[0] else None
        w = K.flat(self.blobs[0]) if propagate_down[0] else None
        if dy is None or x is None or (want_w and dw is None) or (want_b and db is None) or \
                (propagate_down[0] and (dx is None or w is None)):
            return False
        dyp, xp = int(dy.data.ptr), int(x.data.ptr)
        ws = self.gemm_views.get('backward')
        if want_w:
            if self.transpose:      # W is K x N: dW += x^T dy
                blas.gemm(blas.N, blas.T, N, Kd, M, dyp, N, xp, Kd, int(dw.data.ptr), N, beta=1.0,
                          workspace=ws)
            else:                   # W is N x K: dW += dy^T x
                blas.gemm(blas.N, blas.T, Kd, N, M, xp, Kd, dyp, N, int(dw.data.ptr), Kd, beta=1.0,
                          workspace=ws)
        if want_b:                  # db += dy^T 1
            blas.gemm(blas.N, blas.N, N, 1, M, dyp, N, self._ones_ptr(M), M, int(db.data.ptr), N,
                      beta=1.0, tf32=False, workspace=ws)
        if propagate_down[0]:
            if self.transpose:      # dx = dy W^T
                blas.gemm(blas.T, blas.N, Kd, M, N, int(w.data.ptr), N, dyp, N, int(dx.data.ptr),
                          Kd, workspace=ws)
            else:                   # dx = dy W
                blas.gemm(blas.N, blas.N, Kd, M, N, int(w.data.ptr), Kd, dyp, N, int(dx.data.ptr),
                          Kd, workspace=ws)
        return True

    def _backward(self, top, propagate_down, bottom):
        if not (_kernels.active() and _fused('InnerProduct backward', self._fast_backward, top,
                                            propagate_down, bottom)):
            super()._backward(top, propagate_down, bottom)
