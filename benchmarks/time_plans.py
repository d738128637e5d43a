#!/usr/bin/env python3
"""Iteration time of memory plans side by side, interleaved in one process.

    python benchmarks/time_plans.py --net tests/data/bench/alexnet_b128.prototxt \\
        --plans arena,shared [--gpu 0] [--rounds 8] [--iters 10] [--offload free]

`caffeplus memory` times each plan once, one after the other; on the H100
consecutive runs of one plan differ by 5-15% (clocks, the host), more than
`shared` and `arena` differ. Here every plan has its own solver (SGD with
momentum, as profile_step.py), all built first, and the rounds take turns:
each round times --iters steps of every plan, in a rotating order. Prints
each plan's median ms/iter over the rounds and its median per-round ratio
to the first plan (the peer measured in the same run), e.g.

    shared   12.41 ms/iter (rounds 12.2-12.9)  x1.004 of arena (rounds 0.97-1.03)

A plan may carry settings (caffeplus.config, docs/configuration.md) its
solver is built under, after '@': `shared@update_in_backward=0@nan_check=off`
(the update in backward and the NaN check are chosen when a solver is built,
so solvers with and without them can take turns in one process).
"""
import argparse
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def parse_plan(spec):
    """'shared@SETTING=VALUE@...' -> ('shared', {SETTING: VALUE, ...})."""
    name, *rest = spec.split('@')
    settings = {}
    for item in rest:
        key, sep, value = item.partition('=')
        if not sep or not key:
            raise SystemExit("time_plans: '%s' in plan '%s' is not SETTING=VALUE" % (item, spec))
        settings[key] = value
    return name, settings


def plan_settings(settings):
    """caffeplus.config's `settings` in force inside, restored after."""
    from caffeplus import config
    return config.using(**settings)


def training_device(gpu):
    """Run as `caffeplus train` runs (cuDNN's algorithms timed: heuristic
    choices run AlexNet twice as long) on GPU `gpu` (None: the CPU); returns
    the function that waits for the device."""
    from caffeplus import backend, config
    config.set_command_default('cudnn_search', 'auto')
    if gpu is not None:
        backend.set_mode_gpu(gpu)

    def sync():
        if gpu is not None:
            import cupy
            cupy.cuda.Device().synchronize()
    return sync


def build_solvers(net_path, plans, warmup, sync, offload=None):
    """{plan spec: an SGD solver over the net under it}, each built under its
    spec's settings and stepped `warmup` times (`offload`: the policy of
    plan offload)."""
    from caffeplus.memory import shapes
    from caffeplus.solver import get_solver
    from dev.check_plans_equal import solver_param
    param = shapes.load_net_param(net_path)
    solvers = {}
    for plan in plans:
        name, settings = parse_plan(plan)
        with plan_settings(settings):
            solvers[plan] = get_solver(solver_param(
                param, name, 10 ** 6, offload=offload if name == 'offload' else None))
        solvers[plan].step(warmup)
        sync()
    return solvers


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    ap.add_argument('--net', required=True)
    ap.add_argument('--plans', default='arena,shared')
    ap.add_argument('--gpu', type=int)
    ap.add_argument('--rounds', type=int, default=8)
    ap.add_argument('--iters', type=int, default=10)
    ap.add_argument('--warmup', type=int, default=5)
    ap.add_argument('--offload', default=None, help="offload policy for plan offload (e.g. free)")
    args = ap.parse_args(argv)
    from caffeplus.memory import shapes
    plans = [p.strip() for p in args.plans.split(',') if p.strip()]
    sync = training_device(args.gpu)
    with shapes.quiet():
        solvers = build_solvers(args.net, plans, args.warmup, sync, args.offload)
        times = {plan: [] for plan in plans}
        for r in range(args.rounds):
            order = plans[r % len(plans):] + plans[:r % len(plans)]
            for plan in order:
                sync()
                t0 = time.perf_counter()
                solvers[plan].step(args.iters)
                sync()
                times[plan].append((time.perf_counter() - t0) * 1e3 / args.iters)
    peer = plans[0]
    print('%s: %d rounds of %d iterations, interleaved' % (
        os.path.basename(args.net), args.rounds, args.iters))
    for plan in plans:
        ms = times[plan]
        line = '%-8s %8.2f ms/iter (rounds %.2f-%.2f)' % (plan, statistics.median(ms), min(ms),
                                                           max(ms))
        if plan != peer:
            ratios = [a / b for a, b in zip(ms, times[peer])]
            line += '  x%.3f of %s (rounds %.2f-%.2f)' % (statistics.median(ratios), peer,
                                                         min(ratios), max(ratios))
        print(line)
    return times


if __name__ == '__main__':
    main()
