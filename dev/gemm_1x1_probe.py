#!/usr/bin/env python3
"""cuBLAS against cuDNN on ResNet-50's 1x1 convolutions (FP32, no TF32):
would a GEMM variant for 1x1 stride-1 convolutions beat cuDNN's fastest
algorithm (what timed search finds)? Prints, per shape and call kind,
cuDNN's best FindEx time and a strided-batched cuBLAS GEMM's.

    python dev/gemm_1x1_probe.py [--batch 64]
"""
import argparse
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

SHAPES = [  # (C in, M out, H=W)
    (64, 64, 56), (64, 256, 56), (256, 64, 56),
    (256, 128, 28), (128, 512, 28), (512, 128, 28),
    (512, 256, 14), (256, 1024, 14), (1024, 256, 14),
    (1024, 512, 7), (512, 2048, 7), (2048, 512, 7),
]


def _ms(fn, reps=10):
    import cupy
    fn()
    e0, e1 = cupy.cuda.Event(), cupy.cuda.Event()
    e0.record()
    for _ in range(reps):
        fn()
    e1.record()
    e1.synchronize()
    return cupy.cuda.get_elapsed_time(e0, e1) / reps


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument('--batch', type=int, default=64)
    args = ap.parse_args(argv)
    import cupy
    import numpy
    import caffeplus
    from caffeplus.backend import mathmode
    from caffeplus.cudnn import api
    caffeplus.set_mode_gpu(0)
    mathmode.set_math_mode('strict')
    n = args.batch
    ws = cupy.empty(1 << 30, dtype=numpy.uint8)
    tot = {'cudnn': 0.0, 'gemm': 0.0}
    for c, m, hw in SHAPES:
        p = hw * hw
        x = cupy.random.standard_normal((n, c, hw, hw), dtype=numpy.float32)
        y = cupy.random.standard_normal((n, m, hw, hw), dtype=numpy.float32)
        w = cupy.random.standard_normal((m, c, 1, 1), dtype=numpy.float32)
        xd, yd = api.TensorDesc((n, c, hw, hw)), api.TensorDesc((n, m, hw, hw))
        wd = api.FilterDesc((m, c, 1, 1))
        cd = api.ConvDesc((0, 0), (1, 1), (1, 1), 1, mathmode.cudnn_math_type())
        row = []
        xm, ym, wm = x.reshape(n, c, p), y.reshape(n, m, p), w.reshape(m, c)
        part = cupy.empty((n, m, c), dtype=numpy.float32)
        gemm = {'fwd': lambda: cupy.matmul(wm, xm, out=ym),
                'bwd_data': lambda: cupy.matmul(wm.T, ym, out=xm),
                'bwd_filter': lambda: cupy.matmul(ym, xm.transpose(0, 2, 1), out=part).sum(0)}
        for kind in ('fwd', 'bwd_data', 'bwd_filter'):
            found = api.timed_algorithms(kind, xd, wd, cd, yd, x, w, y, ws, ws.nbytes)
            best = min(f.time for f in found if f.time > 0)
            g = _ms(gemm[kind])
            tot['cudnn'] += best
            tot['gemm'] += min(best, g)
            row.append('%s cudnn %.3f gemm %.3f (%.2fx)' % (kind, best, g, best / g))
        print('C%-5d M%-5d %3dx%-3d ' % (c, m, hw, hw) + ' | '.join(row), flush=True)
    print('sum of cuDNN best: %.2f ms; with GEMM where faster: %.2f ms'
          % (tot['cudnn'], tot['gemm']))


if __name__ == '__main__':
    main()
