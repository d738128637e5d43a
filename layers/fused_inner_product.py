"""InnerProduct on the GPU as cuBLAS GEMMs on the blobs' storage.
"""
import numpy

from caffeplus import kernels as _kernels
from caffeplus.backend import blas
from caffeplus.layer import register_engine
from caffeplus.layers.common import InnerProductLayer
from caffeplus.layers.cudnn_common import _fused, sixteen_bit_copy


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
    _ones = None            # {dtype: a device vector of ones}
    _weight_copies = None   # 16-bit copies of the weights and bias, sixteen_bit_copy
    gemm_views = {}         # 'forward' | 'backward' -> (pointer, bytes), set by the plan

    def _ones_ptr(self, n, dtype=numpy.float32):
        K = _kernels
        ones = self._ones.get(numpy.dtype(dtype)) if self._ones is not None else None
        if ones is None or ones.size < n or not K.is_device(ones):
            import cupy
            ones = cupy.ones(max(int(n), 1), dtype=dtype)
            self._ones = dict(self._ones or {})
            self._ones[numpy.dtype(dtype)] = ones
        return int(ones.data.ptr)

    def _usable(self):
        K = _kernels
        if K.emulating():
            return False
        limit = 2 ** 31 - 1       # cuBLAS's int dimensions
        return 0 < self.M <= limit and 0 < self.K <= limit and 0 < self.num_output <= limit

    def _params_in(self, dtype, reuse=False):
        """Pointers to the weights and bias (0 without) in `dtype`: the FP32
        masters, or 16-bit copies of them (a 16-bit layer multiplies in 16
        bits, as its maps are), which the backward takes from its forward
        (`reuse`, sixteen_bit_copy)."""
        K = _kernels
        w = K.flat(self.blobs[0])
        b = K.flat(self.blobs[1]) if self.bias_term else None
        if w is None or (self.bias_term and b is None):
            return None
        if dtype != numpy.float32:
            if self._weight_copies is None:
                self._weight_copies = {}
            w = sixteen_bit_copy(self._weight_copies, 'w', self.blobs[0], dtype, reuse)
            b = sixteen_bit_copy(self._weight_copies, 'b', self.blobs[1], dtype, reuse) \
                if b is not None else None
        return int(w.data.ptr), int(b.data.ptr) if b is not None else 0

    def _fast_forward(self, bottom, top):
        if not self._usable():
            return False
        arrays, dtype = _kernels.maps((bottom[0], False), (top[0], False))
        if arrays is None:
            return False
        x, y = arrays
        params = self._params_in(dtype)
        if params is None:
            return False
        wp, bp = params
        t = dtype.name
        M, N, Kd = self.M, self.num_output, self.K
        xp, yp = int(x.data.ptr), int(y.data.ptr)
        ws = self.gemm_views.get('forward')
        if self.transpose:          # W is K x N: y = x W
            blas.gemm(blas.N, blas.N, N, M, Kd, wp, N, xp, Kd, yp, N, workspace=ws,
                      ab_type=t, c_type=t)
        else:                       # W is N x K: y = x W^T
            blas.gemm(blas.T, blas.N, N, M, Kd, wp, Kd, xp, Kd, yp, N, workspace=ws,
                      ab_type=t, c_type=t)
        if bp:                      # y += 1 b^T
            blas.gemm(blas.N, blas.N, N, M, 1, bp, N, self._ones_ptr(M, dtype), 1, yp, N,
                      beta=1.0, tf32=False, workspace=ws, ab_type=t, c_type=t)
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
        pairs = [(top[0], True), (bottom[0], False)] + \
            ([(bottom[0], True)] if propagate_down[0] else [])
        arrays, dtype = K.maps(*pairs)
        if arrays is None:
            return False
        dy, x = arrays[0], arrays[1]
        dx = arrays[2] if propagate_down[0] else None
        # The parameters' gradients stay FP32: the 16-bit products are summed
        # into them in float32 (beta 1).
        dw = K.flat(self.blobs[0], diff=True) if want_w else None
        db = K.flat(self.blobs[1], diff=True) if want_b else None
        if (want_w and dw is None) or (want_b and db is None):
            return False
        w = None
        if propagate_down[0]:
            params = self._params_in(dtype, reuse=True)
            if params is None:
                return False
            w = params[0]
        t = dtype.name
        dyp, xp = int(dy.data.ptr), int(x.data.ptr)
        ws = self.gemm_views.get('backward')
        if want_w:
            if self.transpose:      # W is K x N: dW += x^T dy
                blas.gemm(blas.N, blas.T, N, Kd, M, dyp, N, xp, Kd, int(dw.data.ptr), N, beta=1.0,
                          workspace=ws, ab_type=t)
            else:                   # W is N x K: dW += dy^T x
                blas.gemm(blas.N, blas.T, Kd, N, M, xp, Kd, dyp, N, int(dw.data.ptr), Kd, beta=1.0,
                          workspace=ws, ab_type=t)
        if want_b:                  # db += dy^T 1
            blas.gemm(blas.N, blas.N, N, 1, M, dyp, N, self._ones_ptr(M, dtype), M,
                      int(db.data.ptr), N, beta=1.0, tf32=False, workspace=ws, ab_type=t)
        if propagate_down[0]:
            if self.transpose:      # dx = dy W^T
                blas.gemm(blas.T, blas.N, Kd, M, N, w, N, dyp, N, int(dx.data.ptr),
                          Kd, workspace=ws, ab_type=t, c_type=t)
            else:                   # dx = dy W
                blas.gemm(blas.N, blas.N, Kd, M, N, w, Kd, dyp, N, int(dx.data.ptr),
                          Kd, workspace=ws, ab_type=t, c_type=t)
        return True

    def _backward(self, top, propagate_down, bottom):
        if not (_kernels.active() and _fused('InnerProduct backward', self._fast_backward, top,
                                            propagate_down, bottom)):
            super()._backward(top, propagate_down, bottom)
