#!/usr/bin/env python3
"""Device time of a max pooling's forward and backward on the GPU, masked
(caffeplus.memory.masks: the one-byte-argmax kernels) against cuDNN's, at
the bench nets' shapes. Prints milliseconds per pass and the ratio
kernels / cuDNN. (An LRN backward from x alone, timed this way, runs
3.0-3.5x cuDNN's.)

    python3 benchmarks/bench_layer_kernels.py [--reps 50]
"""
import argparse
import os
import sys

import numpy

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

CASES = [
    # (what, layer text, bottom shape)
    ('AlexNet pool1 3x3 s2', 'type: "Pooling" pooling_param { pool: MAX kernel_size: 3 stride: 2 }',
     (128, 96, 55, 55)),
    ('AlexNet pool2 3x3 s2', 'type: "Pooling" pooling_param { pool: MAX kernel_size: 3 stride: 2 }',
     (128, 256, 27, 27)),
    ('VGG-16 pool1 2x2 s2 (b64)', 'type: "Pooling" pooling_param { pool: MAX kernel_size: 2 '
     'stride: 2 }', (64, 64, 224, 224)),
]


def time_layer(text, shape, fused, reps):
    import cupy
    from google.protobuf import text_format
    from caffeplus import kernels
    from caffeplus.blob import Blob
    from caffeplus.layer import create_layer
    from caffeplus.proto import caffe_pb2
    was = kernels.set_enabled(fused)
    try:
        lp = caffe_pb2.LayerParameter()
        text_format.Parse('name: "l" ' + text, lp)
        layer = create_layer(lp)
        bottom, top = [Blob(shape, name='x')], [Blob(name='y')]
        rng = numpy.random.default_rng(0)
        bottom[0].data = numpy.maximum(rng.standard_normal(shape).astype(numpy.float32), 0)
        layer.setup(bottom, top)
        if fused:
            assert layer.set_masked(True)
        layer.reshape(bottom, top)
        top[0].diff = rng.standard_normal(top[0].shape).astype(numpy.float32)
        out = {}
        for name, fn in (('forward', lambda: layer.forward(bottom, top)),
                         ('backward', lambda: layer.backward(top, [True], bottom))):
            for _ in range(3):
                fn()
            start, end = cupy.cuda.Event(), cupy.cuda.Event()
            start.record()
            for _ in range(reps):
                fn()
            end.record()
            end.synchronize()
            out[name] = cupy.cuda.get_elapsed_time(start, end) / reps
        return out
    finally:
        kernels.set_enabled(was)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    ap.add_argument('--reps', type=int, default=50)
    args = ap.parse_args(argv)
    import caffeplus
    caffeplus.set_mode_gpu(0)
    print('%-28s %-9s %10s %10s %8s' % ('layer', 'pass', 'cuDNN ms', 'kernels ms', 'ratio'))
    for what, text, shape in CASES:
        cudnn = time_layer(text, shape, False, args.reps)
        ours = time_layer(text, shape, True, args.reps)
        for p in ('forward', 'backward'):
            print('%-28s %-9s %10.3f %10.3f %8.2f' % (what, p, cudnn[p], ours[p],
                                                      ours[p] / cudnn[p]))
    return 0


if __name__ == '__main__':
    sys.exit(main())
