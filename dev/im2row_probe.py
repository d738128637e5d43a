#!/usr/bin/env python3
"""Whether an image layer's 16-bit convolution runs faster as im2row + one
cuBLAS GEMM a batch chunk, writing a channels-last top, than cuDNN does.

    python3 dev/im2row_probe.py [--chunks 16,32,64,128]

For the AlexNets' conv1 (BVLC's 227 px, 96 filters; torchvision's 224 px,
pad 2, 64 filters) at b128, FLOAT16 and BFLOAT16: the image (Caffe's
order) is written as rows of (c, kh, kw) patches, one row an output pixel
(im2row), then y (N*P x M, channels-last) = rows W^T, and the filter
gradient dW (float32, Caffe's order) += dy^T rows, chunk by chunk; beside
PyTorch's cuDNN (channels_last, cudnn.benchmark) on the same shapes.
Milliseconds, medians of 20 timed calls (CUDA events).
"""
import argparse
import os
import statistics
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import numpy  # noqa: E402

SOURCE = r'''
#include <cuda_fp16.h>
#include <cuda_bf16.h>
template <typename T>
__device__ void im2row(const T* x, T* rows, const int nrows, const int n0, const int C,
    const int H, const int W, const int OW, const int P, const int SH, const int SW,
    const int PH, const int PW, const int KP, const int* taps)
{
    /* One row (an output pixel) per threadIdx.y, its KP values across
       threadIdx.x; taps[k] = c << 16 | i << 8 | j (-1: padding). */
    for (int r = blockIdx.x * blockDim.y + threadIdx.y; r < nrows; r += gridDim.x * blockDim.y) {
        const int p = r % P, b = r / P;
        const int y0 = (p / OW) * SH - PH, x0 = (p % OW) * SW - PW;
        const T* img = x + (size_t)(n0 + b) * C * H * W;
        T* out = rows + (size_t)r * KP;
        for (int k = threadIdx.x; k < KP; k += blockDim.x) {
            const int e = taps[k];
            T v = (T)0.0f;
            if (e >= 0) {
                const int yy = y0 + ((e >> 8) & 255), xx = x0 + (e & 255);
                if (yy >= 0 && yy < H && xx >= 0 && xx < W)
                    v = img[((e >> 16) * H + yy) * W + xx];
            }
            out[k] = v;
        }
    }
}
template <typename T>
__device__ void im2row8(const T* x, T* rows, const int nrows, const int n0, const int C,
    const int H, const int W, const int OW, const int P, const int SH, const int SW,
    const int PH, const int PW, const int KP, const int* taps)
{
    /* A thread writes 8 consecutive values of a row as one 16-byte store. */
    const int G = KP / 8;
    const long long total = (long long)nrows * G;
    for (long long t = (long long)blockIdx.x * blockDim.x + threadIdx.x; t < total;
         t += (long long)gridDim.x * blockDim.x) {
        const int r = (int)(t / G), g = (int)(t - (long long)r * G);
        const int p = r % P, b = r / P;
        const int y0 = (p / OW) * SH - PH, x0 = (p % OW) * SW - PW;
        const T* img = x + (size_t)(n0 + b) * C * H * W;
        union { T v[8]; uint4 u; } pack;
        #pragma unroll
        for (int q = 0; q < 8; ++q) {
            const int e = __ldg(taps + g * 8 + q);
            T v = (T)0.0f;
            if (e >= 0) {
                const int yy = y0 + ((e >> 8) & 255), xx = x0 + (e & 255);
                if (yy >= 0 && yy < H && xx >= 0 && xx < W)
                    v = img[((e >> 16) * H + yy) * W + xx];
            }
            pack.v[q] = v;
        }
        reinterpret_cast<uint4*>(rows + (size_t)r * KP)[g] = pack.u;
    }
}
#define IM2ROW_ARGS const int nrows, const int n0, const int C, const int H, const int W, \
    const int OW, const int P, const int SH, const int SW, const int PH, const int PW, \
    const int KP, const int* taps
extern "C" __global__ void im2row_h(const __half* x, __half* rows, IM2ROW_ARGS)
{ im2row<__half>(x, rows, nrows, n0, C, H, W, OW, P, SH, SW, PH, PW, KP, taps); }
extern "C" __global__ void im2row_b(const __nv_bfloat16* x, __nv_bfloat16* rows, IM2ROW_ARGS)
{ im2row<__nv_bfloat16>(x, rows, nrows, n0, C, H, W, OW, P, SH, SW, PH, PW, KP, taps); }
extern "C" __global__ void im2row8_h(const __half* x, __half* rows, IM2ROW_ARGS)
{ im2row8<__half>(x, rows, nrows, n0, C, H, W, OW, P, SH, SW, PH, PW, KP, taps); }
extern "C" __global__ void im2row8_b(const __nv_bfloat16* x, __nv_bfloat16* rows, IM2ROW_ARGS)
{ im2row8<__nv_bfloat16>(x, rows, nrows, n0, C, H, W, OW, P, SH, SW, PH, PW, KP, taps); }
'''

SHAPES = {      # name: (N, C, H, M, k, s, pad)
    'bvlc_conv1': (128, 3, 227, 96, 11, 4, 0),
    'tv_conv1': (128, 3, 224, 64, 11, 4, 2),
}


def launch(kern, x, rows, nrows, n0, C, H, OW, P, s, pad, KP, taps):
    i = numpy.int32
    if VECTOR[0]:
        blocks = min((nrows * (KP // 8) + 255) // 256, 132 * 32)
        kern((blocks,), (256,),
             (x, rows, i(nrows), i(n0), i(C), i(H), i(H), i(OW), i(P), i(s), i(s), i(pad),
              i(pad), i(KP), taps))
        return
    per_block = 4
    blocks = min((nrows + per_block - 1) // per_block, 65535 * 8)
    kern((blocks,), (128, per_block),
         (x, rows, i(nrows), i(n0), i(C), i(H), i(H), i(OW), i(P), i(s), i(s), i(pad), i(pad),
          i(KP), taps))


VECTOR = [False]    # whether the 8-values-a-thread kernels run


def timed(fn, reps=20):
    import cupy
    fn()
    out = []
    for _ in range(reps):
        a, b = cupy.cuda.Event(), cupy.cuda.Event()
        a.record()
        fn()
        b.record()
        b.synchronize()
        out.append(cupy.cuda.get_elapsed_time(a, b))
    return statistics.median(out)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    ap.add_argument('--chunks', default='16,32,64,128')
    ap.add_argument('--vector', action='store_true', help='8 values a thread, one 16-byte store')
    args = ap.parse_args()
    import cupy
    from caffeplus import backend
    from caffeplus.backend import blas
    from caffeplus.precision import bfloat16_dtype
    backend.set_mode_gpu(0)
    module = cupy.RawModule(code=SOURCE, options=('--std=c++14',))
    VECTOR[0] = args.vector
    types = {'fp16': (numpy.float16, 'float16', 'im2row_h'),
             'bf16': (bfloat16_dtype(), 'bfloat16', 'im2row_b')}
    for name, (N, C, H, M, k, s, pad) in SHAPES.items():
        OH = (H + 2 * pad - k) // s + 1
        P, K = OH * OH, C * k * k
        K = -(-K // 8) * 8      # rows padded to 16 bytes: cuBLAS's aligned kernels
        KR = C * k * k
        taps = numpy.full(K, -1, numpy.int32)
        c_, i_, j_ = numpy.unravel_index(numpy.arange(KR), (C, k, k))
        taps[:KR] = c_ << 16 | i_ << 8 | j_
        taps = cupy.asarray(taps)
        for tname, (dtype, cublas_type, fname) in types.items():
            kern = module.get_function(fname.replace('im2row', 'im2row8') if args.vector
                                       else fname)
            x = cupy.random.standard_normal((N, C, H, H), dtype=numpy.float32).astype(dtype)
            w = cupy.random.standard_normal((M, K), dtype=numpy.float32)
            w[:, KR:] = 0
            w = w.astype(dtype)
            y = cupy.empty((N * P, M), dtype)
            dy = cupy.random.standard_normal((N * P, M), dtype=numpy.float32).astype(dtype)
            dw = cupy.zeros((M, K), numpy.float32)
            for B in (int(b) for b in args.chunks.split(',')):
                rows = cupy.empty((B * P, K), dtype)

                def make(n0, B=B, rows=rows):
                    launch(kern, x, rows, B * P, n0, C, H, OH, P, s, pad, K, taps)

                def fwd(B=B, rows=rows):
                    for n0 in range(0, N, B):
                        make(n0)
                        blas.gemm(blas.T, blas.N, M, B * P, K, int(w.data.ptr), K,
                                  int(rows.data.ptr), K,
                                  int(y.data.ptr) + n0 * P * M * y.itemsize, M,
                                  ab_type=cublas_type, c_type=cublas_type)

                def filt(B=B, rows=rows):
                    for n0 in range(0, N, B):
                        make(n0)
                        blas.gemm(blas.N, blas.T, K, M, B * P, int(rows.data.ptr), K,
                                  int(dy.data.ptr) + n0 * P * M * dy.itemsize, M,
                                  int(dw.data.ptr), K, beta=1.0, ab_type=cublas_type,
                                  c_type='float32')

                def only_rows(B=B):
                    for n0 in range(0, N, B):
                        make(n0)
                print('%s %s chunk %3d (%5.1f MiB rows): im2row %.3f ms, fwd %.3f ms, '
                      'filter %.3f ms' % (name, tname, B, rows.nbytes / 2 ** 20,
                                          timed(only_rows), timed(fwd), timed(filt)))
                del rows
            # Correctness of the forward against float32 math on the same values.
            B = 16
            rows = cupy.empty((B * P, K), dtype)
            fwd_ref = _reference(x[:2].astype(numpy.float32), w[:, :KR].astype(numpy.float32), k, s,
                                 pad)
            launch(kern, x, rows, 2 * P, 0, C, H, OH, P, s, pad, K, taps)
            got = rows[:2 * P].astype(numpy.float32) @ w.astype(numpy.float32).T
            print('  rows reproduce the convolution: max |diff| %.2e' %
                  float(abs(got - fwd_ref).max()))
            _torch(name, tname, N, C, H, M, k, s, pad)


def _reference(x, w, k, s, pad):
    """float32 convolution of x (n, C, H, H) by w (M, C*k*k), channels-last rows."""
    import cupy
    n, C, H, _ = x.shape
    xp = cupy.pad(x, ((0, 0), (0, 0), (pad, pad), (pad, pad)))
    OH = (H + 2 * pad - k) // s + 1
    cols = cupy.empty((n, OH, OH, C, k, k), numpy.float32)
    for i in range(k):
        for j in range(k):
            cols[..., i, j] = xp[:, :, i:i + s * OH:s, j:j + s * OH:s].transpose(0, 2, 3, 1)
    return cols.reshape(n * OH * OH, -1) @ w.T


def _torch(name, tname, N, C, H, M, k, s, pad):
    try:
        import torch
    except ImportError:
        return
    torch.backends.cudnn.benchmark = True
    dt = {'fp16': torch.float16, 'bf16': torch.bfloat16}[tname]
    x = torch.randn(N, C, H, H, device='cuda', dtype=dt).to(memory_format=torch.channels_last)
    w = torch.randn(M, C, k, k, device='cuda', dtype=dt).to(memory_format=torch.channels_last)
    y = torch.nn.functional.conv2d(x, w, stride=s, padding=pad)
    dy = torch.randn_like(y)

    def run(fn, reps=20):
        for _ in range(3):
            fn()
        torch.cuda.synchronize()
        out = []
        for _ in range(reps):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            out.append(a.elapsed_time(b))
        return statistics.median(out)
    f = run(lambda: torch.nn.functional.conv2d(x, w, stride=s, padding=pad))
    g = run(lambda: torch.ops.aten.convolution_backward(
        dy, x, w, None, (s, s), (pad, pad), (1, 1), False, (0, 0), 1, (False, True, False)))
    print('  PyTorch cuDNN channels_last %s %s: fwd %.3f ms, filter %.3f ms' % (name, tname, f, g))


if __name__ == '__main__':
    main()
