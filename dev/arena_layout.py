#!/usr/bin/env python3
"""The arena a plan placed at run time, step by step (the run's counterpart
of dev/estimate_timeline.py).

    python dev/arena_layout.py .gpu_carry/bench/alexnet_b128.prototxt --plan offload \\
        --offload free [--steps 9,13,43] [--json layout.json]

Builds the net as `caffeplus memory -gpu` does (TRAIN, SGD solver, the
estimated plan applied), runs iterations until the plan settles (for
`free`: it has chosen and laid out again), then prints the arena's size
beside the bytes live at the busiest step (the bound no placement beats),
the live bytes at each step, and at the steps asked for (and the busiest)
the buffers live there, largest first. --json writes every placed buffer
(name, kind, bytes, first and last step, offset) to compare with the
estimate's on a machine without a GPU.
"""
import argparse
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
MiB = 2.0 ** 20


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    ap.add_argument('model')
    ap.add_argument('--plan', default='offload')
    ap.add_argument('--offload', default='free')
    ap.add_argument('--steps', default='')
    ap.add_argument('--min-mib', type=float, default=1.0)
    ap.add_argument('--json')
    ap.add_argument('--sites', action='store_true',
                    help="each convolution call's chosen algorithm and its timed candidates")
    ap.add_argument('--cpu', action='store_true', help='on the CPU backend (to try the tool)')
    args = ap.parse_args(argv)
    os.environ.setdefault('CAFFEPLUS_CUDNN_SEARCH', 'auto')
    from caffeplus import backend
    from caffeplus.memory import measure, placement
    if not args.cpu:
        backend.set_mode_gpu(0)
    net, _ = measure.settled_net(args.model, args.plan, args.offload)
    applied = net.applied_plan
    bufs = applied.layout[0]
    rows = applied.placed_rows()
    steps = applied.steps
    curve = [sum(placement._align(b.nbytes) for b in bufs if b.start <= t <= b.end)
             for t in range(steps + 1)]
    top = max(curve)
    print('%s, plan %s (%s): arena %.1f MiB, bound %.1f MiB, busiest step %d; offloaded %s'
          % (os.path.basename(args.model), args.plan, args.offload,
             applied.arena_bytes / MiB, placement.live_bound(bufs) / MiB,
             curve.index(top), [e.name for e in applied.entries if e.offloaded]))
    names = net._layer_names
    L = len(names)
    for t, n in enumerate(curve):
        label = ('F ' + names[t]) if t < L else ('B ' + names[2 * L - 1 - t]) if t < 2 * L \
            else 'end'
        print('%3d %-24s %8.1f MiB%s' % (t, label, n / MiB, '  <- busiest' if n == top else ''))
    wanted = [int(s) for s in args.steps.split(',') if s.strip()] + [curve.index(top)]
    for t in wanted:
        print('step %d:' % t)
        for name, kind, nbytes, start, end, off in sorted(
                rows, key=lambda r: -r[2]):
            if start <= t and end >= t - 0.5 and nbytes >= args.min_mib * MiB:
                print('   %-10s %-40s %8.1f MiB  [%g, %g]' % (kind, name[:40], nbytes / MiB,
                                                            start, end))
    if args.sites:
        for layer, name in zip(net.layers, names):
            for kind, site in sorted((getattr(layer, '_sites', None) or {}).items()):
                best = min((c.time for c in site.candidates if c.time and c.time > 0), default=0)
                print('%s %s: chosen %r' % (name, kind, site.choice))
                for c in sorted(site.candidates, key=lambda c: c.memory):
                    if c.time and c.time > 0:
                        print('     %8.1f MiB  %7.3f ms  x%.3f  %r' % (
                            c.memory / MiB, c.time, c.time / best if best else 0, c))
    if args.json:
        with open(args.json, 'w') as f:
            json.dump(layout_record(net), f, indent=1)
    return 0


def layout_record(net):
    """What --json writes: the arena of the net's applied plan and every
    buffer placed in it (name, kind, bytes, first and last step, offset)."""
    from caffeplus.memory import measure
    applied = net.applied_plan
    return {'arena_bytes': applied.arena_bytes, 'steps': applied.steps,
            'layer_names': net._layer_names,
            'buffers': [dict(zip(measure.LAYOUT_FIELDS, r)) for r in applied.placed_rows()]}


if __name__ == '__main__':
    sys.exit(main())
