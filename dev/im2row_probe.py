#!/usr/bin/env python3
"""How fast an image layer's 16-bit convolution runs as im2row + cuBLAS
(layers/conv_gemm.py, `rows`), beside PyTorch's cuDNN on the same shapes.

    python3 dev/im2row_probe.py [--chunks 16,32,128] [--nets bvlc_conv1,tv_conv1]

For each layer (AlexNet's conv1 in BVLC's and torchvision's forms at b128,
ResNet-50's stem at b64 and b256, VGG-16's conv1_1 at b64), FLOAT16 and
BFLOAT16, and each chunk of images: cp_im2row alone, the forward (im2row
and one GEMM a chunk, channels-last top) and the filter gradient (float32,
Caffe's order), then PyTorch's channels_last conv2d and its weight
gradient under cudnn.benchmark. Milliseconds, medians of 20 timed calls
(CUDA events); the forward checked against float32 math on the same values.
"""
import argparse
import os
import statistics
import sys
import types

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import numpy  # noqa: E402

REPS = 20       # timed calls a median is taken of
LAYERS = {      # name: (N, C, H, M, k, s, pad)
    'bvlc_conv1': (128, 3, 227, 96, 11, 4, 0),
    'tv_conv1': (128, 3, 224, 64, 11, 4, 2),
    'resnet50_conv1_b64': (64, 3, 224, 64, 7, 2, 3),
    'resnet50_conv1_b256': (256, 3, 224, 64, 7, 2, 3),
    'vgg16_conv1_1': (64, 3, 224, 64, 3, 1, 1),
}


def _layer(N, C, H, M, k, s, pad):
    from caffeplus.im2col import ConvGeometry
    geom = ConvGeometry((k, k), (s, s), (pad, pad), (1, 1))
    return types.SimpleNamespace(geom=geom, num=N, channels=C, in_spatial=(H, H),
                                 num_output=M, out_spatial=geom.conv_out_shape((H, H)),
                                 reverse=False, group=1, num_spatial=2)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    ap.add_argument('--chunks', default='16,32,128', help='images a chunk')
    ap.add_argument('--nets', default=','.join(LAYERS))
    args = ap.parse_args()
    import cupy
    from caffeplus import backend
    from caffeplus.cudnn.algo_search import median_ms
    from caffeplus.layers import conv_gemm
    from caffeplus.precision import bfloat16_dtype
    backend.set_mode_gpu(0)
    for name in args.nets.split(','):
        shape = LAYERS[name]
        layer = _layer(*shape)
        N, C, H, M = shape[:4]
        for tname, dtype in (('fp16', numpy.dtype(numpy.float16)), ('bf16', bfloat16_dtype())):
            x = cupy.random.standard_normal((N, C, H, H), dtype=numpy.float32).astype(dtype)
            master = cupy.random.standard_normal((M, C * shape[4] ** 2), dtype=numpy.float32)
            for chunk in (int(c) for c in args.chunks.split(',')):
                g0 = conv_gemm._GemmConv(layer, dtype, nhwc=True)
                conv_gemm.ROWS_CHUNK_BYTES = chunk * g0.KP * g0.P * dtype.itemsize
                g = conv_gemm._GemmConv(layer, dtype, nhwc=True)
                ws = cupy.empty(g.memory('fwd'), numpy.uint8)
                y = cupy.empty((N * g.P, M), dtype)
                dy = cupy.random.standard_normal((N * g.P, M), dtype=numpy.float32).astype(dtype)
                dw = cupy.zeros((M, g.K), numpy.float32)
                w = g.row_weights(master)
                xp, yp, wsp = int(x.data.ptr), int(y.data.ptr), int(ws.data.ptr)

                def rows_only():
                    for n0, nb in g.chunks():
                        conv_gemm._DeviceOps.im2row(xp, wsp, n0, nb, g)
                fwd = median_ms(lambda: g.forward(xp, w, yp, wsp), REPS)
                filt = median_ms(lambda: g.backward_filter(xp, int(dy.data.ptr), int(dw.data.ptr),
                                                           wsp), REPS)
                print('%s %s chunk %3d (%5.1f MiB): im2row %.3f ms, fwd %.3f ms, filter %.3f ms'
                      % (name, tname, g.B, ws.nbytes / 2 ** 20, median_ms(rows_only, REPS), fwd,
                         filt))
            _check(layer, g, x, master, y, dtype)
            _torch(name, tname, shape)


def _check(layer, g, x, master, y, dtype):
    """The forward's top against float32 math on the same 16-bit values."""
    import cupy
    k, s, p = layer.geom.kernel[0], layer.geom.stride[0], layer.geom.pad[0]
    x2 = x[:2].astype(numpy.float32)
    n, C, H, _ = x2.shape
    xp = cupy.pad(x2, ((0, 0), (0, 0), (p, p), (p, p)))
    OH = layer.out_spatial[0]
    cols = cupy.empty((n, OH, OH, C, k, k), numpy.float32)
    for i in range(k):
        for j in range(k):
            cols[..., i, j] = xp[:, :, i:i + s * OH:s, j:j + s * OH:s].transpose(0, 2, 3, 1)
    w = master.astype(dtype).astype(numpy.float32)
    want = cols.reshape(n * OH * OH, -1) @ w.T
    got = y[:n * OH * OH].astype(numpy.float32)
    print('  forward against float32 math: max |diff| %.2e of max |y| %.2e' %
          (float(abs(got - want).max()), float(abs(want).max())))


def _torch(name, tname, shape):
    try:
        import torch
    except ImportError:
        return
    N, C, H, M, k, s, pad = shape
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
