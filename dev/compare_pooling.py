#!/usr/bin/env python3
"""Does cuDNN's max pooling give the bits of caffeplus's masked pooling
(caffeplus.memory.masks: the first maximum of each window, gradients summed
in window order)? Runs both on the GPU over the bench nets' pooling
geometries, on maps with ties (zeros, as after a ReLU, and repeated
values), and prints how many tops and bottom gradients differ.

    python3 dev/compare_pooling.py [--trials 3] [--math deterministic]
"""
import argparse
import os
import sys

import numpy

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

GEOMETRIES = [
    # (what, bottom shape, pooling_param)
    ('VGG-16 pool1, 2x2 s2', (16, 64, 224, 224), 'pool: MAX kernel_size: 2 stride: 2'),
    ('AlexNet pool1, 3x3 s2', (128, 96, 55, 55), 'pool: MAX kernel_size: 3 stride: 2'),
    ('AlexNet pool5, 3x3 s2', (128, 256, 13, 13), 'pool: MAX kernel_size: 3 stride: 2'),
    ('GoogLeNet inception pool, 3x3 s1 p1', (64, 192, 28, 28),
     'pool: MAX kernel_size: 3 stride: 1 pad: 1'),
    ('GoogLeNet pool1, 3x3 s2', (64, 64, 112, 112), 'pool: MAX kernel_size: 3 stride: 2'),
    ('ResNet-50 pool1, 3x3 s2', (64, 64, 112, 112), 'pool: MAX kernel_size: 3 stride: 2'),
]


def run(shape, text, x, seed, masked):
    """Forward and backward of the pooling on x (dy drawn from `seed`, of
    the top's shape): top, bottom diff, whether cuDNN would run it."""
    from caffeplus import backend
    from caffeplus.blob import Blob
    from caffeplus.layer import create_layer
    from caffeplus.proto import caffe_pb2
    from google.protobuf import text_format
    lp = caffe_pb2.LayerParameter()
    text_format.Parse('name: "p" type: "Pooling" pooling_param { %s }' % text, lp)
    layer = create_layer(lp)
    bottom, top = [Blob(shape, name='x')], [Blob(name='y')]
    bottom[0].data = x
    layer.setup(bottom, top)
    agrees = layer.cudnn_agrees()
    assert layer.set_masked(masked) == masked
    layer.reshape(bottom, top)
    layer.forward(bottom, top)
    top[0].diff = numpy.random.default_rng(seed).standard_normal(top[0].shape).astype(
        numpy.float32)
    layer.backward(top, [True], bottom)
    return (backend.to_numpy(top[0].data).copy(), backend.to_numpy(bottom[0].diff).copy(),
            agrees)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    ap.add_argument('--trials', type=int, default=3)
    ap.add_argument('--math', default='deterministic')
    args = ap.parse_args(argv)
    import caffeplus
    from caffeplus.backend import mathmode
    caffeplus.set_mode_gpu(0)
    mathmode.set_math_mode(args.math)
    rng = numpy.random.default_rng(1)
    worst = 0
    for what, shape, text in GEOMETRIES:
        for trial in range(args.trials):
            x = rng.standard_normal(shape).astype(numpy.float32)
            x[x < 0] = 0.0                                   # a ReLU's zeros
            if trial > 0:                                    # and positive ties
                x = numpy.round(x * (4 if trial == 1 else 1)) / 4
            seed = int(rng.integers(2 ** 31))
            y_c, dx_c, agrees = run(shape, text, x, seed, False)
            y_m, dx_m, _ = run(shape, text, x, seed, True)
            top_diff = int(numpy.count_nonzero(y_c.view(numpy.uint32) != y_m.view(numpy.uint32)))
            dx_diff = int(numpy.count_nonzero(dx_c.view(numpy.uint32) != dx_m.view(numpy.uint32)))
            worst = max(worst, top_diff, dx_diff)
            print('%-40s trial %d  cuDNN %s  tops differing %d / %d  bottom diffs differing %d / %d'
                  ' (max abs %.3g)' % (what, trial, 'used' if agrees else 'NOT used (ceil rule)',
                                       top_diff, y_c.size, dx_diff, dx_c.size,
                                       float(numpy.abs(dx_c - dx_m).max())))
    print('identical' if worst == 0 else 'DIFFERENT')
    return 0


if __name__ == '__main__':
    sys.exit(main())
