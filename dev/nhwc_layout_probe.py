#!/usr/bin/env python3
"""What channels-last (NHWC) storage would take in caffeplus's own cuDNN calls:
for convolutions and poolings of the bench nets, in FLOAT16 and BFLOAT16,
which layouts cuDNN accepts and how fast its timed search makes each.

    python3 dev/nhwc_layout_probe.py [--types fp16,bf16] [--iters 20]   (on the GPU)

Layouts of a convolution (input x, output y, filters w):
  nchw       x, y NCHW, w K C kh kw: what caffeplus runs now;
  nhwc       x, y NHWC (strides), w NHWC (K kh kw C): a channels-last net;
  nchw>nhwc  x NCHW, y NHWC, w NHWC: the first convolution of such a net, whose
             input comes from a data layer in NCHW;
  nhwc,wnchw x, y NHWC, w NCHW: filters left in Caffe's order.
Each call kind (fwd, bwd_data, bwd_filter): FindEx's fastest time in ms, or
'-' where cuDNN offers no algorithm or refuses. Poolings (max 2x2/2 and 3x3/2,
forward + backward, CUDA-event timed): NCHW, NHWC, and NHWC in with NCHW out
(the last pooling before an InnerProduct, which flattens in Caffe's order).
The answers decide the layout work of issue 37: where a net can switch
layout, and what NHWC saves per call.
"""
import argparse
import os
import sys

import numpy

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

# (name, x shape, output channels, kernel, stride, pad): VGG-16 b64's and
# ResNet-50 b256's heaviest shapes.
CONVS = [
    ('vgg conv1_1', (64, 3, 224, 224), 64, 3, 1, 1),
    ('vgg conv1_2', (64, 64, 224, 224), 64, 3, 1, 1),
    ('vgg conv2_2', (64, 128, 112, 112), 128, 3, 1, 1),
    ('vgg conv3_2', (64, 256, 56, 56), 256, 3, 1, 1),
    ('vgg conv4_2', (64, 512, 28, 28), 512, 3, 1, 1),
    ('vgg conv5_2', (64, 512, 14, 14), 512, 3, 1, 1),
    ('r50 res2a_branch2b', (256, 64, 56, 56), 64, 3, 1, 1),
    ('r50 res2a_branch2c', (256, 64, 56, 56), 256, 1, 1, 0),
    ('r50 res4a_branch2b', (256, 256, 14, 14), 256, 3, 1, 1),
    # an image net's first convolution: 3 input channels, and padded to 4
    ('r50 conv1', (256, 3, 224, 224), 64, 7, 2, 3),
    ('r50 conv1 c4', (256, 4, 224, 224), 64, 7, 2, 3),
    ('r50 conv1 b64', (64, 3, 224, 224), 64, 7, 2, 3),
    ('r50 conv1 b64 c4', (64, 4, 224, 224), 64, 7, 2, 3),
    ('vgg conv1_1 c4', (64, 4, 224, 224), 64, 3, 1, 1),
    ('alexnettv conv1', (128, 3, 224, 224), 64, 11, 4, 2),
    ('alexnettv conv1 c4', (128, 4, 224, 224), 64, 11, 4, 2),
]
POOLS = [('vgg pool1', (64, 64, 224, 224), 2, 2), ('vgg pool5', (64, 512, 14, 14), 2, 2),
         ('r50 pool1', (256, 64, 112, 112), 3, 2)]
LAYOUTS = ('nchw', 'nhwc', 'nchw>nhwc', 'nhwc,wnchw')


def _desc(api, shape, dtype, nhwc):
    return api.TensorDesc(shape, api.nhwc_strides(shape) if nhwc else None, dtype=dtype)


def conv_times(api, cupy, dtype, xs, k, kernel, stride, pad, layout):
    n, c, h, w = xs
    oh = (h + 2 * pad - kernel) // stride + 1
    ow = (w + 2 * pad - kernel) // stride + 1
    ys, ws = (n, k, oh, ow), (k, c, kernel, kernel)
    x_nhwc = layout in ('nhwc', 'nhwc,wnchw')
    y_nhwc = layout != 'nchw'
    w_nhwc = layout in ('nhwc', 'nchw>nhwc')
    xd, yd = _desc(api, xs, dtype, x_nhwc), _desc(api, ys, dtype, y_nhwc)
    wd = api.FilterDesc(ws, dtype=dtype, layout=api.NHWC if w_nhwc else api.NCHW)
    cd = api.ConvDesc((pad, pad), (stride, stride), (1, 1), 1, api.TENSOR_OP_MATH)
    r = numpy.random.default_rng(0)
    xa = cupy.asarray(r.standard_normal(int(numpy.prod(xs))).astype(dtype))
    ya = cupy.asarray(r.standard_normal(int(numpy.prod(ys))).astype(dtype))
    wa = cupy.asarray(r.standard_normal(int(numpy.prod(ws))).astype(dtype))
    space = cupy.empty(1 << 30, numpy.uint8)
    out = {}
    for kind in ('fwd', 'bwd_data', 'bwd_filter'):
        try:
            found = api.timed_algorithms(kind, xd, wd, cd, yd, xa, wa, ya, space, space.nbytes)
        except Exception as exc:            # a refused layout is an answer here
            out[kind] = 'refused: %s' % str(exc).split(':')[-1].strip()[:40]
            continue
        out[kind] = min(f.time for f in found) if found else None
    return out


def pool_ms(api, cupy, dtype, xs, window, stride, x_nhwc, y_nhwc, iters):
    n, c, h, w = xs
    oh, ow = (h - window) // stride + 1, (w - window) // stride + 1
    ys = (n, c, oh, ow)
    xd, yd = _desc(api, xs, dtype, x_nhwc), _desc(api, ys, dtype, y_nhwc)
    pd = api.PoolDesc(api.POOL_MAX, (window, window), (0, 0), (stride, stride))
    r = numpy.random.default_rng(1)
    xa = cupy.asarray(r.standard_normal(int(numpy.prod(xs))).astype(dtype))
    ya = cupy.empty(int(numpy.prod(ys)), dtype)
    dya = cupy.asarray(r.standard_normal(ya.size).astype(dtype))
    dxa = cupy.empty_like(xa)

    def step():
        api.pooling_forward(pd, xd, xa, yd, ya)
        api.pooling_backward(pd, yd, ya, dya, xd, xa, dxa)
    try:
        step()
    except Exception as exc:
        return 'refused: %s' % str(exc).split(':')[-1].strip()[:40]
    a, b = cupy.cuda.Event(), cupy.cuda.Event()
    a.record()
    for _ in range(iters):
        step()
    b.record()
    b.synchronize()
    return cupy.cuda.get_elapsed_time(a, b) / iters


def _cell(v):
    if v is None:
        return '-'
    return v if isinstance(v, str) else '%.3f' % v


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    ap.add_argument('--types', default='fp16,bf16')
    ap.add_argument('--iters', type=int, default=20)
    ap.add_argument('--convs', default='', help='only the convolutions whose name has this')
    ap.add_argument('--layouts', default=','.join(LAYOUTS))
    ap.add_argument('--no-pools', action='store_true')
    args = ap.parse_args(argv)
    layouts = args.layouts.split(',')
    import cupy
    from caffeplus.cudnn import api
    types = {'fp16': numpy.dtype(numpy.float16)}
    try:
        import ml_dtypes
        types['bf16'] = numpy.dtype(ml_dtypes.bfloat16)
    except ImportError:
        pass
    for tname in args.types.split(','):
        dtype = types.get(tname)
        if dtype is None:
            print('%s: no such type here' % tname)
            continue
        print('\n## convolutions, %s (FindEx fastest, ms: fwd / bwd_data / bwd_filter)' % tname)
        print('| call | ' + ' | '.join(layouts) + ' |')
        print('|---' * (len(layouts) + 1) + '|')
        for name, xs, k, kernel, stride, pad in CONVS:
            if args.convs not in name:
                continue
            cells = []
            for layout in layouts:
                t = conv_times(api, cupy, dtype, xs, k, kernel, stride, pad, layout)
                cells.append(' / '.join(_cell(t[kind]) for kind in
                                        ('fwd', 'bwd_data', 'bwd_filter')))
            print('| %s %s | %s |' % (name, 'x'.join(map(str, xs)), ' | '.join(cells)), flush=True)
        if args.no_pools:
            continue
        print('\n## max poolings, %s (forward + backward, ms)' % tname)
        print('| pooling | NCHW | NHWC | NHWC in, NCHW out |')
        print('|---|---|---|---|')
        for name, xs, window, stride in POOLS:
            cells = [pool_ms(api, cupy, dtype, xs, window, stride, xi, yo, args.iters)
                     for xi, yo in ((False, False), (True, True), (True, False))]
            print('| %s | %s |' % (name, ' | '.join(_cell(v) for v in cells)), flush=True)


if __name__ == '__main__':
    main()
