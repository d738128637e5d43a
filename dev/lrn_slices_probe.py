#!/usr/bin/env python3
"""Does cuDNN's cross-channel LRN give the same bits over slices of the batch,
or with its backward writing the bottom gradient over the top gradient?

    python dev/lrn_slices_probe.py

For the bench nets' LRN shapes, runs cudnnLRNCrossChannelForward and
...Backward on the whole batch from fixed inputs, then over slices of 1..N/2
images (descriptors of the slice's shape at the slice's offsets), and the
backward with dx == dy, and compares every output bit for bit with the
whole-batch call; prints the times of each. A memory plan could then run an
LRN's backward slice by slice with one slice of its output made again and
write the bottom gradient where the top gradient was (two maps at its step
instead of four).
"""
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
# (name, shape, local_size, alpha, beta)
SHAPES = [('alexnet norm1', (128, 96, 55, 55), 5, 1e-4, 0.75),
          ('alexnet norm2', (128, 256, 27, 27), 5, 1e-4, 0.75),
          ('googlenet pool1/norm1', (64, 64, 56, 56), 5, 1e-4, 0.75),
          ('googlenet conv2/norm2', (64, 192, 56, 56), 5, 1e-4, 0.75)]


def main():
    import numpy
    import cupy
    from caffeplus.cudnn import api
    rng = numpy.random.RandomState(3)
    event = cupy.cuda.Event

    def timed(fn):
        fn()
        a, b = event(), event()
        a.record()
        for _ in range(5):
            fn()
        b.record()
        b.synchronize()
        return cupy.cuda.get_elapsed_time(a, b) / 5

    all_same = True
    for name, shape, n, alpha, beta in SHAPES:
        N = shape[0]
        per = int(numpy.prod(shape[1:]))
        x = cupy.asarray(numpy.maximum(rng.standard_normal(shape), 0).astype(numpy.float32))
        dy = cupy.asarray(rng.standard_normal(shape).astype(numpy.float32))
        lrn = api.LRNDesc(n, alpha, beta, 1.0)
        whole = api.TensorDesc(shape)
        y = cupy.empty_like(x)
        dx = cupy.empty_like(x)
        t_f = timed(lambda: api.lrn_forward(lrn, whole, x, y))
        t_b = timed(lambda: api.lrn_backward(lrn, whole, y, dy, x, dx))
        print('%s %s: whole batch forward %.3f ms, backward %.3f ms' % (name, shape, t_f, t_b))
        for s in [1, 2, 4, 8, 16, 32, N // 2]:
            if N % s:
                continue
            part = api.TensorDesc((s,) + shape[1:])
            ys, dxs = cupy.empty_like(x), cupy.empty_like(x)
            offs = [i * per * 4 for i in range(0, N, s)]

            def fwd():
                for o in offs:
                    api.lrn_forward(lrn, part, int(x.data.ptr) + o, int(ys.data.ptr) + o)

            def bwd():
                for o in offs:
                    api.lrn_backward(lrn, part, int(y.data.ptr) + o, int(dy.data.ptr) + o,
                                     int(x.data.ptr) + o, int(dxs.data.ptr) + o)
            tf, tb = timed(fwd), timed(bwd)
            same_f = bool(cupy.array_equal(ys, y))
            same_b = bool(cupy.array_equal(dxs, dx))
            all_same &= same_f and same_b
            print('  slices of %3d: forward %s (%.3f ms), backward %s (%.3f ms)' % (
                s, 'same bits' if same_f else 'DIFFERENT', tf,
                'same bits' if same_b else 'DIFFERENT', tb))
        over = dy.copy()
        api.lrn_backward(lrn, whole, y, over, x, over)
        same = bool(cupy.array_equal(over, dx))
        print('  backward with dx == dy, whole batch: %s' % ('same bits' if same else 'DIFFERENT'))
        for s in (8, 16):
            part = api.TensorDesc((s,) + shape[1:])
            over = dy.copy()
            for o in range(0, N * per * 4, s * per * 4):
                api.lrn_backward(lrn, part, int(y.data.ptr) + o, int(over.data.ptr) + o,
                                 int(x.data.ptr) + o, int(over.data.ptr) + o)
            same = bool(cupy.array_equal(over, dx))
            print('  backward with dx == dy, slices of %d: %s' % (s, 'same bits' if same else 'DIFFERENT'))
    print('every slice gives the whole batch\'s bits' if all_same else 'some slices differ')


if __name__ == '__main__':
    main()
