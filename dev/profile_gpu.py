#!/usr/bin/env python3
"""Where one caffeplus training iteration spends its time on the GPU, by
layer type: host (Python) time of each layer's reshape, forward and backward,
and device time between CUDA events recorded around each call (when the host
is the bottleneck the device time includes the gaps it leaves).

    python dev/profile_gpu.py --net tests/data/bench/resnet50_b64.prototxt \\
        --plan arena --search timed --iters 10 [--tf32] [--generic]

(--plan shared/offload/auto applies the whole memory plan, not only its
workspace.)

Layers are timed by wrapping their methods, not through the net's per-layer
hooks, so fused chains of layers (caffeplus.kernels) stay fused. The step is
the benchmark's (benchmarks/bench_gpu.py): clear diffs, forward, backward, the
solver's fused SGD update; data layers run once before.
"""
import argparse
import collections
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
DATA_TYPES = ('DummyData', 'Input', 'Data', 'ImageData', 'HDF5Data', 'MemoryData')


def _build(caffeplus, workspace, args):
    if args.plan in ('stock', 'arena'):
        net = caffeplus.Net(args.net, caffeplus.TRAIN)
        workspace.apply_workspace_plan(net, args.plan, 0)
    elif args.budget:
        from caffeplus.memory.apply import apply_named_plan
        from caffeplus.memory.budget import parse_bytes
        net = caffeplus.Net(args.net, caffeplus.TRAIN)
        apply_named_plan(net, args.plan, training=True, budget=parse_bytes(args.budget))
    else:
        # The reusing plans place the workspace with the activations (and
        # make maps again in backward): the whole memory plan.
        net = caffeplus.Net(args.net, caffeplus.TRAIN, memory=args.plan)
    return net


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    ap.add_argument('--net', required=True)
    ap.add_argument('--plan', default='arena')
    ap.add_argument('--search', default='timed', choices=('heuristic', 'timed'))
    ap.add_argument('--iters', type=int, default=10)
    ap.add_argument('--warmup', type=int, default=3)
    ap.add_argument('--tf32', action='store_true')
    ap.add_argument('--generic', action='store_true', help='fused kernels off')
    ap.add_argument('--no-graphs', action='store_true',
                    help='cuDNN calls made directly, not replayed as CUDA graphs')
    ap.add_argument('--top', type=int, default=12)
    ap.add_argument('--precision', default=None, help='fp32, tf32, fp16 or bf16 (the switch)')
    ap.add_argument('--budget', default=None, help="plan auto's memory budget (e.g. 12G)")
    ap.add_argument('--layout', default='nchw', choices=('nchw', 'nhwc', 'nhwcbn'),
                    help="a 16-bit net's convolution maps (caffeplus.layout); nhwcbn: "
                         "channels-last with BatchNorm and Scale too")
    args = ap.parse_args(argv)

    import cupy
    import caffeplus
    from caffeplus import kernels
    from caffeplus.backend import mathmode
    from caffeplus.blob import Blob
    from caffeplus.memory import workspace
    from caffeplus.solver import gpu_kernels
    caffeplus.set_mode_gpu(0)
    mathmode.set_math_mode('tf32' if args.tf32 else 'strict')
    kernels.set_enabled(not args.generic)
    from caffeplus.cudnn import api
    api.set_graphs(not args.no_graphs)
    workspace.set_search(args.search)
    from caffeplus import config, precision
    if args.layout == 'nhwcbn':
        from caffeplus import layout
        layout.CHANNELS_LAST_BATCHNORM = True
    with precision.setting(args.precision), \
            config.using(layout='nhwc' if args.layout == 'nhwcbn' else args.layout):
        net = _build(caffeplus, workspace, args)
    params = net.learnable_params
    hist = [Blob(p.shape) for p in params]
    for h in hist:
        h.data[...] = 0
    multi = gpu_kernels.MultiTensorUpdate()
    ones, zeros = [1.0] * len(params), [0.0] * len(params)
    start = 0
    while start < len(net.layers) and net.layers[start].layer_param.type in DATA_TYPES:
        start += 1
    last = len(net.layers) - 1
    net.forward_prefilled()

    host = collections.defaultdict(float)       # (layer index, 'r'/'f'/'b') -> seconds
    pairs = {}                                  # (layer index, 'f'/'b') -> (start, end) events
    state = {'on': False}
    recorded = set()                            # the pairs recorded this iteration

    def wrap(i, layer, which):
        fn = getattr(layer, {'r': 'reshape', 'f': 'forward', 'b': 'backward'}[which])
        if which != 'r':
            pairs[(i, which)] = (cupy.cuda.Event(), cupy.cuda.Event())

        def timed(*a):
            if not state['on']:
                return fn(*a)
            t0 = time.perf_counter()
            ev = pairs.get((i, which))
            if ev is not None:
                ev[0].record()
            r = fn(*a)
            if ev is not None:
                ev[1].record()
                recorded.add((i, which))
            host[(i, which)] += time.perf_counter() - t0
            return r
        setattr(layer, {'r': 'reshape', 'f': 'forward', 'b': 'backward'}[which], timed)
    for i, layer in enumerate(net.layers):
        for which in 'rfb':
            wrap(i, layer, which)

    def step():
        net.clear_param_diffs()
        net.forward_from_to(start, last)
        net.backward_from_to(last, start)
        multi.prepare(params, hist, None, ones, zeros)
        multi.run('SGD', 0.01, 1.0, 0.0, False, 0.9)

    for _ in range(args.warmup):
        step()
    cupy.cuda.get_current_stream().synchronize()
    device = collections.defaultdict(float)
    total_dev = total_host = 0.0
    for _ in range(args.iters):
        a, b = cupy.cuda.Event(), cupy.cuda.Event()
        recorded.clear()
        state['on'] = True
        t0 = time.perf_counter()
        a.record()
        step()
        b.record()
        total_host += time.perf_counter() - t0
        b.synchronize()
        state['on'] = False
        total_dev += cupy.cuda.get_elapsed_time(a, b)
        for key in recorded:
            e0, e1 = pairs[key]
            device[key] += cupy.cuda.get_elapsed_time(e0, e1)
        recorded.clear()
    n = args.iters
    print('net %s plan %s search %s tf32 %s fused %s graphs %s: %.2f ms/iter on the device, '
          'host %.2f ms' % (os.path.basename(args.net), args.plan, args.search, args.tf32,
                            not args.generic, not args.no_graphs, total_dev / n,
                            total_host * 1000 / n))
    print('cuDNN graph replays: %s' % api.graph_stats())
    by_type = collections.defaultdict(lambda: collections.defaultdict(float))
    counts = collections.Counter()
    for i, layer in enumerate(net.layers):
        t = layer.layer_param.type
        counts[t] += 1
        for w in 'rfb':
            by_type[t]['host_' + w] += host.get((i, w), 0.0) * 1000 / n
        for w in 'fb':
            by_type[t]['dev_' + w] += device.get((i, w), 0.0) / n
    print('%-16s %5s %9s %9s %9s %9s %9s' % ('type', 'count', 'host rsh', 'host fwd', 'host bwd',
                                             'dev fwd', 'dev bwd'))
    rows = sorted(by_type.items(), key=lambda kv: -(kv[1]['dev_f'] + kv[1]['dev_b']))
    for t, d in rows:
        print('%-16s %5d %9.2f %9.2f %9.2f %9.2f %9.2f' % (
            t, counts[t], d['host_r'], d['host_f'], d['host_b'], d['dev_f'], d['dev_b']))
    sums = {k: sum(d[k] for d in by_type.values()) for k in
            ('host_r', 'host_f', 'host_b', 'dev_f', 'dev_b')}
    print('%-16s %5d %9.2f %9.2f %9.2f %9.2f %9.2f' % (
        'all layers', len(net.layers), sums['host_r'], sums['host_f'], sums['host_b'],
        sums['dev_f'], sums['dev_b']))
    per_layer = sorted(((device.get((i, 'f'), 0) + device.get((i, 'b'), 0)) / n, i)
                       for i in range(len(net.layers)))
    print('slowest layers (device ms fwd+bwd):')
    for ms, i in reversed(per_layer[-args.top:]):
        l = net.layers[i]
        print('  %-28s %-12s %7.3f  %s' % (l.name, l.layer_param.type, ms,
                                          net.top_vecs[i][0].shape if net.top_vecs[i] else ''))
    chains = net.__dict__.get('_fused_chains') or []
    print('fused chains: %d found, %d ran fused both ways; kernel failures: %s'
          % (len(chains), sum(1 for c in chains if c.fwd_done and c.bwd_done),
             kernels.failures()[:3]))
    return 0


if __name__ == '__main__':
    sys.exit(main())
