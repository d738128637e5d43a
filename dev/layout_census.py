#!/usr/bin/env python3
"""Which maps a GPU build stores channels-last, net by net, against the
estimate's model of it (caffeplus.layout.modelled_blobs), and how the
first convolution runs (calls channels-last, bottom and top relaid).

    python3 dev/layout_census.py --bench-dir .gpu_carry/bench alexnet_b128 googlenet_b64
    python3 dev/layout_switches.py on dev/layout_census.py ...     (the switches on)

Needs a GPU; the nets are built at batch 2 in FLOAT16.
"""
import argparse
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    ap.add_argument('nets', nargs='+')
    ap.add_argument('--bench-dir', default=os.path.join(ROOT, 'benchmarks', 'nets'))
    ap.add_argument('--precision', default='fp16')
    args = ap.parse_args(argv)
    import caffeplus
    from caffeplus import layout, precision
    from caffeplus.memory import shapes
    from caffeplus.proto import caffe_pb2
    caffeplus.set_mode_gpu(0)
    for name in args.nets:
        param = shapes.load_net_param(os.path.join(args.bench_dir, name + '.prototxt'),
                                      batch=2, phase=caffe_pb2.TRAIN)
        precision.override(param, args.precision)
        net = caffeplus.Net(param, caffe_pb2.TRAIN)
        moved = {n for n, b in net._blob_dict.items() if b.layout == layout.NHWC}
        model = {net._blob_names[i] for i in layout.modelled_blobs(net)}
        conv = next(l for l in net.layers if l.layer_param.type == 'Convolution')
        print('%-16s channels-last %3d of %3d  model agrees: %-5s %s  %s: calls %s, bottom '
              'relaid %s, top relaid %s, padded to %d' % (
                  name, len(moved), len(net._blobs), moved == model,
                  sorted(moved ^ model)[:4] if moved != model else '', conv.layer_param.name,
                  conv.compute_nhwc, conv._bottom_relaid, conv._top_relaid,
                  conv.padded_channels), flush=True)
    return 0


if __name__ == '__main__':
    sys.exit(main())
