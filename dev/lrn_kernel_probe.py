#!/usr/bin/env python3
"""How long the 16-bit LRN's kernels take against cuDNN's, per call, and
how near the memory's speed they run.

    python3 dev/lrn_kernel_probe.py [--shapes alexnet] [--chunks 16,32] [--kernels-only]

BFLOAT16 has no cuDNN LRN: a BFLOAT16 net's LRN runs caffeplus's
cp_lrn_fwd/cp_lrn_bwd (Caffe's order) or cp_lrn_*_nhwc (channels-last),
where FLOAT16 takes cuDNN's. For the bench nets' LRN shapes the LRN layer
runs forward and backward (as a net runs it, through layers/cudnn_lrn.py)
in FLOAT16 on cuDNN, in FLOAT16 and BFLOAT16 on the kernels, in Caffe's
order and channels-last. Milliseconds (median of 20 timed calls, CUDA
events) and the bytes each call must move (forward: x read, y written;
backward: x, y, dy read, dx written) over its time.
"""
import argparse
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import numpy  # noqa: E402

REPS = 20       # timed calls a median is taken of
SHAPES = {      # set: [(name, (N, C, H, W))]; local_size 5, alpha 1e-4, beta 0.75
    'alexnet': [('alexnet norm1', (128, 96, 55, 55)), ('alexnet norm2', (128, 256, 27, 27))],
    'googlenet': [('googlenet pool1/norm1', (64, 64, 56, 56)),
                  ('googlenet conv2/norm2', (64, 192, 56, 56))],
}


def _layer(shape, dtype, layout, on_kernels):
    """The LRN layer and its bottom and top over `dtype` maps in `layout`."""
    from caffeplus.blob import Blob
    from caffeplus.layer import create_layer
    from caffeplus.layers import cudnn_lrn
    from caffeplus.proto import caffe_pb2
    from google.protobuf import text_format
    lp = text_format.Parse('name: "norm" type: "LRN" bottom: "x" top: "y" lrn_param { '
                           'local_size: 5 alpha: 0.0001 beta: 0.75 }', caffe_pb2.LayerParameter())
    layer = create_layer(lp)
    if on_kernels:      # FLOAT16 onto caffeplus's kernels, as BFLOAT16 runs
        layer._converts = lambda x: True
    bottom, top = [Blob(shape, name='x')], [Blob(name='y')]
    for b in bottom + top:
        b.set_storage_dtype(dtype)
        b.layout = layout
    rng = numpy.random.default_rng(5)
    bottom[0].data = rng.standard_normal(shape).astype(numpy.float32)
    layer.setup(bottom, top)
    layer.forward(bottom, top)
    top[0].diff = rng.standard_normal(shape).astype(numpy.float32)
    assert cudnn_lrn is not None
    return layer, bottom, top


def main():
    ap = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    ap.add_argument('--shapes', default='alexnet,googlenet')
    ap.add_argument('--chunks', default=None,
                    help='channels a thread walks in Caffe\'s order (layers/cudnn_lrn.py '
                         'KERNEL_CHANNEL_CHUNK), each timed; default: the layer\'s')
    ap.add_argument('--kernels-only', action='store_true',
                    help='leave out cuDNN\'s FLOAT16 LRN and the channels-last kernels')
    args = ap.parse_args()
    import caffeplus
    from caffeplus.cudnn.algo_search import median_ms
    from caffeplus.precision import bfloat16_dtype
    caffeplus.set_mode_gpu()
    fp16, bf16 = numpy.dtype(numpy.float16), bfloat16_dtype()
    from caffeplus.layers import cudnn_lrn
    runs = [('FLOAT16 cuDNN', fp16, 'NCHW', False), ('FLOAT16 kernels', fp16, 'NCHW', True),
            ('BFLOAT16 kernels', bf16, 'NCHW', True),
            ('FLOAT16 kernels channels-last', fp16, 'NHWC', True),
            ('BFLOAT16 kernels channels-last', bf16, 'NHWC', True)]
    if args.kernels_only:
        runs = [r for r in runs if r[3] and r[2] == 'NCHW']
    chunks = [int(c) for c in args.chunks.split(',')] if args.chunks \
        else [cudnn_lrn.KERNEL_CHANNEL_CHUNK]
    runs = [(what + (' chunk %d' % chunk if args.chunks and on and layout == 'NCHW' else ''),
             dtype, layout, on, chunk) for chunk in chunks
            for what, dtype, layout, on in runs
            if chunk == chunks[0] or (on and layout == 'NCHW')]
    for group in args.shapes.split(','):
        for name, shape in SHAPES[group]:
            count = int(numpy.prod(shape))
            for what, dtype, layout, on_kernels, chunk in runs:
                cudnn_lrn.KERNEL_CHANNEL_CHUNK = chunk
                layer, bottom, top = _layer(shape, dtype, layout, on_kernels)
                fwd = median_ms(lambda: layer.forward(bottom, top), REPS)
                bwd = median_ms(lambda: layer.backward(top, [True], bottom), REPS)
                moved_f, moved_b = 2 * count * dtype.itemsize, 4 * count * dtype.itemsize
                print('%-22s %-40s forward %.3f ms (%4.0f GB/s), backward %.3f ms (%4.0f GB/s)'
                      % (name, what, fwd, moved_f / fwd / 1e6, bwd, moved_b / bwd / 1e6))


if __name__ == '__main__':
    main()
