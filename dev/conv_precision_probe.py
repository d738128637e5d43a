#!/usr/bin/env python3
"""What 16-bit storage would buy each convolution of a net, on this GPU:
cuDNN's fastest forward + backward-data + backward-filter time for every
Convolution layer of a bench net, in FP32, TF32, FP16 and BF16, the 16-bit
types both in NCHW and in NHWC (channels_last).

    python3 dev/conv_precision_probe.py .gpu_carry/bench/resnet50_b64.prototxt [--iters 20]

The shapes come from caffeplus (a shape-only build of the net); the timing
from PyTorch's cuDNN bindings with cudnn.benchmark on (cuDNN's own timed
search, as caffeplus's is), so the figures say what cuDNN can do for these
calls, not what any framework adds. Printed: each layer's times and the
sums, with each column's ratio to FP32. The design question it answers:
which layout the 16-bit path should take per net.
"""
import argparse
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

VARIANTS = ('fp32', 'tf32', 'fp16', 'fp16_nhwc', 'bf16', 'bf16_nhwc')


def conv_calls(model):
    """[(name, bottom shape, weight shape, stride, pad, dilation, group)]."""
    from caffeplus.memory import shapes
    from caffeplus.proto import caffe_pb2
    net = shapes.build_net(shapes.load_net_param(model), caffe_pb2.TRAIN)
    out = []
    for i, layer in enumerate(net.layers):
        if layer.layer_param.type != 'Convolution' or len(layer.geom.kernel) != 2:
            continue
        g = layer.geom
        out.append((layer.layer_param.name, tuple(net.bottom_vecs[i][0].shape),
                    tuple(layer.blobs[0].shape), tuple(g.stride), tuple(g.pad),
                    tuple(g.dilation), layer.group))
    return out


def time_call(torch, call, variant, iters):
    name, xs, ws, stride, pad, dil, group = call
    dtype = {'fp32': torch.float32, 'tf32': torch.float32}.get(
        variant, torch.float16 if variant.startswith('fp16') else torch.bfloat16)
    torch.backends.cudnn.allow_tf32 = variant == 'tf32'
    fmt = torch.channels_last if variant.endswith('nhwc') else torch.contiguous_format
    x = torch.randn(xs, device='cuda', dtype=dtype).to(memory_format=fmt).requires_grad_()
    w = torch.randn(ws, device='cuda', dtype=dtype).to(memory_format=fmt).requires_grad_()
    conv = torch.nn.functional.conv2d
    y = conv(x, w, None, stride, pad, dil, group)
    dy = torch.randn_like(y)

    def step():
        out = conv(x, w, None, stride, pad, dil, group)
        torch.autograd.grad(out, (x, w), dy)
    for _ in range(3):
        step()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(iters):
        step()
    b.record()
    b.synchronize()
    return a.elapsed_time(b) / iters


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    ap.add_argument('model')
    ap.add_argument('--iters', type=int, default=20)
    args = ap.parse_args(argv)
    import torch
    torch.backends.cudnn.benchmark = True
    calls = conv_calls(args.model)
    totals = dict.fromkeys(VARIANTS, 0.0)
    print('%-22s %-18s ' % ('layer', 'bottom') + ' '.join('%10s' % v for v in VARIANTS))
    for call in calls:
        ms = {v: time_call(torch, call, v, args.iters) for v in VARIANTS}
        for v in VARIANTS:
            totals[v] += ms[v]
        print('%-22s %-18s ' % (call[0][:22], 'x'.join(map(str, call[1]))) +
              ' '.join('%10.3f' % ms[v] for v in VARIANTS), flush=True)
    print('%-41s ' % ('sum of %d convolutions, ms' % len(calls)) +
          ' '.join('%10.2f' % totals[v] for v in VARIANTS))
    print('%-41s ' % 'ratio to fp32' +
          ' '.join('%10.2f' % (totals[v] / totals['fp32']) for v in VARIANTS))
    return 0


if __name__ == '__main__':
    sys.exit(main())
