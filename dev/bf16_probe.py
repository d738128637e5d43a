"""What CuPy does with BFLOAT16 arrays (ml_dtypes.bfloat16) on the device:
the operations a BFLOAT16 net's storage goes through, each checked against
the host's ml_dtypes values. Prints one line a check, 'ok' or what failed.

    python3 dev/bf16_probe.py        (on the GPU machine)
"""
import traceback

import numpy


def main():
    import cupy
    import ml_dtypes
    bf16 = numpy.dtype(ml_dtypes.bfloat16)
    rng = numpy.random.default_rng(0)
    host32 = rng.standard_normal(1000).astype(numpy.float32) * 3
    host = host32.astype(bf16)

    def check(name, fn):
        try:
            fn()
            print('ok    ', name)
        except Exception as exc:                        # the probe reports every failure
            print('FAILED', name, '-', type(exc).__name__, str(exc).splitlines()[0][:200])
            traceback.print_exc(limit=2)

    def asarray():
        d = cupy.asarray(host)
        assert d.dtype == bf16, d.dtype
        assert cupy.asnumpy(d).view(numpy.uint16).tolist() == host.view(numpy.uint16).tolist()

    def astype_rounds():
        d = cupy.asarray(host32).astype(bf16)
        assert cupy.asnumpy(d).view(numpy.uint16).tolist() == host.view(numpy.uint16).tolist()
        back = cupy.asnumpy(d.astype(numpy.float32))
        assert back.tolist() == host.astype(numpy.float32).tolist()

    def elementwise():
        d = cupy.asarray(host)
        got = cupy.asnumpy((d * 2 + d).astype(numpy.float32))
        want = (host * bf16.type(2) + host).astype(numpy.float32)
        assert numpy.allclose(got, want, rtol=1e-2), (got[:4], want[:4])
        m = cupy.asnumpy(cupy.maximum(d, 0).astype(numpy.float32))
        assert (m == numpy.maximum(host.astype(numpy.float32), 0)).all()

    def reductions():
        d = cupy.asarray(host)
        s = float(d.sum(dtype=numpy.float32))
        assert abs(s - float(host.astype(numpy.float32).sum())) < 1e-2, s
        assert bool(cupy.isfinite(d).all())

    def views_and_fill():
        d = cupy.zeros(16, bf16)
        d.fill(1.5)
        assert cupy.asnumpy(d.view(numpy.uint16)).tolist() == [0x3FC0] * 16
        e = cupy.empty_like(d)
        e[...] = d
        assert cupy.asnumpy(e).astype(numpy.float32).tolist() == [1.5] * 16

    def raw_kernel():
        src = r'''#include <cuda_bf16.h>
        extern "C" __global__ void twice(const __nv_bfloat16* x, __nv_bfloat16* y, unsigned n) {
            unsigned i = blockIdx.x * blockDim.x + threadIdx.x;
            if (i < n) y[i] = __nv_bfloat16(__fmul_rn((float)x[i], 2.0f));
        }'''
        k = cupy.RawModule(code=src, options=('--fmad=false',)).get_function('twice')
        d = cupy.asarray(host)
        y = cupy.empty_like(d)
        k((4,), (256,), (d, y, numpy.uint32(d.size)))
        want = (host.astype(numpy.float32) * 2).astype(bf16)
        assert cupy.asnumpy(y).view(numpy.uint16).tolist() == want.view(numpy.uint16).tolist()

    def matmul():
        a = cupy.asarray(rng.standard_normal((64, 32)).astype(bf16))
        b = cupy.asarray(rng.standard_normal((32, 16)).astype(bf16))
        c = cupy.asnumpy((a @ b).astype(numpy.float32))
        want = cupy.asnumpy(a.astype(numpy.float32)) @ cupy.asnumpy(b.astype(numpy.float32))
        assert numpy.allclose(c, want, rtol=2e-2, atol=2e-1), abs(c - want).max()

    def cudnn_conv():
        from caffeplus.cudnn import api
        n, c, k, hw = 8, 16, 32, 14
        x = cupy.asarray(rng.standard_normal((n, c, hw, hw)).astype(bf16))
        w = cupy.asarray(rng.standard_normal((k, c, 3, 3)).astype(bf16))
        y = cupy.empty((n, k, hw - 2, hw - 2), bf16)
        xd, yd = api.TensorDesc(x.shape, dtype=bf16), api.TensorDesc(y.shape, dtype=bf16)
        wd = api.FilterDesc(w.shape, dtype=bf16)
        cd = api.ConvDesc((0, 0), (1, 1), (1, 1), math=api.TENSOR_OP_MATH)
        algos = api.heuristic_algorithms('fwd', xd, wd, cd, yd)
        print('       bf16 fwd algorithms:', algos[:3])
        a = algos[0]
        ws = cupy.empty(max(a.memory, 1), numpy.uint8)
        api.conv_forward(xd, x, wd, w, cd, a.algo, ws, a.memory, yd, y)
        xf = cupy.asnumpy(x.astype(numpy.float32)).astype(numpy.float64)
        wf = cupy.asnumpy(w.astype(numpy.float32)).astype(numpy.float64)
        want = numpy.zeros(y.shape)
        for i in range(3):
            for j in range(3):
                want += numpy.einsum('nchw,kc->nkhw', xf[:, :, i:i + hw - 2, j:j + hw - 2],
                                     wf[:, :, i, j])
        got = cupy.asnumpy(y.astype(numpy.float32))
        assert numpy.allclose(got, want, rtol=2e-2, atol=0.3), abs(got - want).max()

    def cublas_gemm():
        from caffeplus.backend import blas
        a = cupy.asarray(rng.standard_normal((64, 32)).astype(bf16))
        b = cupy.asarray(rng.standard_normal((32, 16)).astype(bf16))
        for c_type in ('float32', 'bfloat16'):
            c = cupy.zeros((64, 16), numpy.float32 if c_type == 'float32' else bf16)
            # row-major C = A B is column-major C^T = B^T A^T
            blas.gemm(blas.N, blas.N, 16, 64, 32, b.data.ptr, 16, a.data.ptr, 32, c.data.ptr, 16,
                      ab_type='bfloat16', c_type=c_type)
            cupy.cuda.runtime.deviceSynchronize()
            want = cupy.asnumpy(a.astype(numpy.float32)) @ cupy.asnumpy(b.astype(numpy.float32))
            got = cupy.asnumpy(c.astype(numpy.float32))
            assert numpy.allclose(got, want, rtol=2e-2, atol=0.2), (c_type, abs(got - want).max())

    for name, fn in [('cuBLAS GemmEx, BFLOAT16 A and B', cublas_gemm),
                     ('cuDNN convolution forward in BFLOAT16', cudnn_conv),
                     ('asarray and asnumpy keep the bits', asarray),
                     ('astype float32 -> bfloat16 rounds as ml_dtypes', astype_rounds),
                     ('elementwise arithmetic', elementwise),
                     ('sum(dtype=float32), isfinite', reductions),
                     ('views, fill, assignment', views_and_fill),
                     ('RawModule with cuda_bf16.h', raw_kernel),
                     ('matmul', matmul)]:
        check(name, fn)


if __name__ == '__main__':
    main()
