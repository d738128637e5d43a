#!/usr/bin/env python3
"""The planner's estimate of a plan, step by step, without a GPU: the bytes
its arena holds at each of the 2L steps (forward, then backward) and, at
the steps asked for, the buffers live there, largest first.

    python3 dev/estimate_timeline.py tests/data/bench/alexnet_b128.prototxt \\
        --plan offload --offload free [--steps 9,13,34,44] [--min-mib 1]

What it answers: which steps set a plan's peak and what holds them there
(for example, what AlexNet's `free` would need to reach 0.5x of stock
Caffe).
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

MIB = 2.0 ** 20


def timeline(path, plan_name, offload='conv', budget=None):
    """(net, plan) of the estimate for the net at `path` (TRAIN phase)."""
    from caffeplus.memory import budget as budget_mod, shapes
    with shapes.quiet():
        net = shapes.build_net(shapes.load_net_param(path))
        plan = budget_mod.estimate_plan(
            net, plan_name, offload_policy=offload,
            budget=budget_mod.parse_bytes(budget) if budget else None)
    return net, plan


def step_label(net, step):
    """'F conv1' / 'B conv1' for step `step` of the 2L steps."""
    L = len(net.layers)
    if step < L:
        return 'F %s' % net._layer_names[step]
    if step < 2 * L:
        return 'B %s' % net._layer_names[2 * L - 1 - step]
    return 'end'


def live_at(plan, step, min_bytes=0):
    """The plan's buffers live at `step` or in the half step before it (a
    filter call's workspace), largest first."""
    out = [b for b in plan.buffers
           if b.start <= step and b.end >= step - 0.5 and b.nbytes >= min_bytes]
    return sorted(out, key=lambda b: (-b.nbytes, b.key))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    ap.add_argument('net')
    ap.add_argument('--plan', default='shared')
    ap.add_argument('--offload', default='conv', help='offload policy (conv, all, free)')
    ap.add_argument('--budget', default=None, help='for plan auto, e.g. 1.6G')
    ap.add_argument('--steps', default='', help='steps whose live buffers to list')
    ap.add_argument('--min-mib', type=float, default=1.0)
    args = ap.parse_args(argv)
    net, plan = timeline(args.net, args.plan, args.offload, args.budget)
    print('%s, plan %s: peak %.1f MiB, arena %.1f MiB; offloaded %s; made again %s' % (
        net.name, args.plan, plan.peak_bytes / MIB, plan.arena_bytes / MIB,
        sorted({n for key in plan.offloaded for n in key[1]}) or 'none',
        plan.recomputed_names() or 'none'))
    live = plan.live_curve()
    top = max(live) if live else 0
    for step, nbytes in enumerate(live):
        print('%3d %-28s %8.1f MiB%s' % (step, step_label(net, step), nbytes / MIB,
                                          '  <- peak' if nbytes == top else ''))
    for step in [int(s) for s in args.steps.split(',') if s.strip()]:
        print('step %d (%s):' % (step, step_label(net, step)))
        for b in live_at(plan, step, args.min_mib * MIB):
            print('   %-10s %-44s %8.1f MiB  [%g, %g]' % (
                b.kind, ','.join(b.blobs)[:44] or '/'.join(map(str, b.key[1:]))[:44],
                b.nbytes / MIB, b.start, b.end))
    return plan


if __name__ == '__main__':
    main()
