#!/usr/bin/env python3
"""What a reusing plan's timed search gives each convolution (GPU): the
maps' room, each site's scratch and search limit, the candidates timed, the
step's headroom and the choice; then the iteration's time.

    python dev/search_room_probe.py --net alexnettv_b128 --precision fp16 [--floor 0.5]
"""
import argparse
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    ap.add_argument('--net', default='alexnettv_b128')
    ap.add_argument('--bench-dir', default=os.path.join(ROOT, '.gpu_carry', 'bench'))
    ap.add_argument('--precision', default='fp16')
    ap.add_argument('--plan', default='shared')
    ap.add_argument('--floor', type=float, default=None, help='SEARCH_ROOM_FLOOR')
    args = ap.parse_args(argv)
    import cupy
    import caffeplus
    from caffeplus import precision
    from caffeplus.backend import mathmode
    from caffeplus.memory import workspace
    from caffeplus.memory.apply import apply_named_plan
    from benchmarks.bench_gpu import net_source
    caffeplus.set_mode_gpu(0)
    mathmode.set_math_mode('tf32')
    workspace.set_search('timed')
    if args.floor is not None:
        workspace.SEARCH_ROOM_FLOOR = args.floor
    real = workspace.PlacedWorkspace._time_sites

    def traced(self, pairs, budget):
        print('search room %.1f MiB, floor %s, budget %s' % (
            (self.search_room or 0) / 2 ** 20, self.search_floor, budget))
        for layer, s in pairs:
            if s.timer is not None:
                print('  %-8s %-10s scratch %7.1f MiB limit %7.1f MiB' % (
                    layer.layer_param.name, s.kind, getattr(s.timer, 'scratch_bytes', 0) / 2 ** 20,
                    min(self.search_limit(s), 2 ** 50) / 2 ** 20))
        real(self, pairs, budget)
        for layer, s in pairs:
            print('  %-8s %-10s timed %s' % (layer.layer_param.name, s.kind, ', '.join(
                '%s/%d:%.1fMiB:%.3fms' % (c.algo, c.math, c.memory / 2 ** 20, c.time)
                for c in sorted(s.candidates, key=lambda c: c.time)[:4])))
    workspace.PlacedWorkspace._time_sites = traced
    with precision.setting(args.precision):
        net = caffeplus.Net(net_source(args.bench_dir, args.net), caffeplus.TRAIN)
    apply_named_plan(net, args.plan, keep=['data', 'label'], training=True)
    net.forward_prefilled()
    headroom = getattr(net.workspace, 'headroom', {})      # (id(layer), view) -> bytes
    for layer in workspace.workspace_layers(net):
        room = {view: round(n / 2 ** 20, 1) for (owner, view), n in headroom.items()
                if owner == id(layer)}
        print('  %-8s headroom (MiB) %s' % (layer.layer_param.name, room))
        print('  %-8s chosen %s' % (layer.layer_param.name,
                                    {k: repr(c) for k, c in layer.algorithms().items()}))
    start = 1
    last = len(net.layers) - 1
    for _ in range(3):
        net.forward_from_to(start, last)
        net.backward_from_to(last, start)
    cupy.cuda.Device().synchronize()
    t = time.perf_counter()
    for _ in range(10):
        net.forward_from_to(start, last)
        net.backward_from_to(last, start)
    cupy.cuda.Device().synchronize()
    print('%s %s %s floor %s: %.2f ms an iteration (forward + backward), arena %.1f MiB' % (
        args.net, args.plan, args.precision, workspace.SEARCH_ROOM_FLOOR,
        (time.perf_counter() - t) * 100, net.applied_plan.arena_bytes / 2 ** 20))
    return 0


if __name__ == '__main__':
    sys.exit(main())
