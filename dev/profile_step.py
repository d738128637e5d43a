#!/usr/bin/env python3
"""Time solver.step under a memory plan and show where the host spends it.

    python dev/profile_step.py --net tests/data/bench/googlenet_b64.prototxt --plan shared \\
        [--gpu 0] [--iters 10] [--top 25] [--precision fp16] [--dump step.pstats]

Builds an SGD solver (momentum 0.9, weight decay, the NaN check as
`caffeplus train` has it) over the net with its data layers as DummyData,
runs 3 steps, times --iters steps (ms/iter, device synchronised), then runs
--iters more under cProfile and prints the functions of most own time.
CAFFEPLUS_UPDATE_IN_BACKWARD=0 compares with the update after backward.

    python dev/profile_step.py --net ... --plan shared --against offload --offload free \
        --warmup 20 --gpu 0

profiles a second plan the same way (--offload: its offload policy; `free`
measures its first iterations as `shared`, hence --warmup) and prints the
functions whose own host time per iteration differs most between the two:
where the second plan's extra host time goes.
"""
import argparse
import cProfile
import os
import pstats
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    ap.add_argument('--net', required=True)
    ap.add_argument('--plan', default='shared')
    ap.add_argument('--gpu', type=int)
    ap.add_argument('--iters', type=int, default=10)
    ap.add_argument('--top', type=int, default=25)
    ap.add_argument('--warmup', type=int, default=3)
    ap.add_argument('--against', default=None, help='a second plan to compare with')
    ap.add_argument('--offload', default=None, help='offload policy of plan offload')
    ap.add_argument('--precision', default=None, help='fp32, tf32, fp16 or bf16 (the solver\'s '
                    'caffeplus_param.precision, as `caffeplus train --precision`)')
    ap.add_argument('--dump', default=None,
                    help='write the first plan\'s profile here (pstats format) to read elsewhere')
    ap.add_argument('--callers', default='',
                    help="comma-separated function names (e.g. '_view,_handle_fromlist'): "
                         "who calls them, in the first plan's profile")
    args = ap.parse_args(argv)
    runs = [profile_plan(args, args.plan)]
    if args.against:
        runs.append(profile_plan(args, args.against))
    if args.dump:
        runs[0][2].dump_stats(args.dump)
    for plan, ms, stats in runs:
        print('%s plan %s: %.2f ms/iter' % (os.path.basename(args.net), plan, ms))
        stats.sort_stats('tottime').print_stats(args.top)
    if args.against:
        print_difference(runs[0], runs[1], args.iters, args.top)
    for name in filter(None, args.callers.split(',')):
        print('callers of %s (plan %s):' % (name, runs[0][0]))
        runs[0][2].sort_stats('ncalls').print_callers(r'\(%s\)' % name)


def own_times(stats):
    """{function label: (own seconds, calls)} of a pstats.Stats."""
    out = {}
    for (path, line, name), (_, calls, tottime, _, _) in stats.stats.items():
        out['%s:%d(%s)' % (os.path.basename(path), line, name)] = (tottime, calls)
    return out


def print_difference(first, second, iters, top):
    """The functions whose own time per iteration grew or shrank most from
    the first plan's profile to the second's."""
    a, b = own_times(first[2]), own_times(second[2])
    rows = []
    for label in set(a) | set(b):
        ta, ca = a.get(label, (0.0, 0))
        tb, cb = b.get(label, (0.0, 0))
        rows.append(((tb - ta) * 1e3 / iters, ca / iters, cb / iters, label))
    rows.sort(key=lambda r: -abs(r[0]))
    print('own host time per iteration, %s -> %s (ms; calls per iteration):' % (first[0], second[0]))
    for delta, ca, cb, label in rows[:top]:
        print('  %+8.3f ms  calls %7.1f -> %7.1f  %s' % (delta, ca, cb, label))
    total = sum(r[0] for r in rows)
    print('  total %+.3f ms an iteration (under cProfile)' % total)
    # Calls do not vary with the host's speed the way times do: where the
    # second plan makes more Python calls is where its host time goes.
    rows.sort(key=lambda r: -abs(r[2] - r[1]))
    print('calls per iteration, %s -> %s (most changed):' % (first[0], second[0]))
    for delta, ca, cb, label in rows[:top]:
        if cb != ca:
            print('  %+8.1f calls (%7.1f -> %7.1f)  %+8.3f ms  %s' % (cb - ca, ca, cb, delta, label))
    print('  total %.0f -> %.0f calls an iteration'
          % (sum(r[1] for r in rows), sum(r[2] for r in rows)))


def profile_plan(args, plan_name):
    """(plan, ms/iter without the profiler, pstats.Stats of --iters steps)."""
    from caffeplus.memory import shapes
    from caffeplus.solver import get_solver
    from dev.check_plans_equal import solver_param
    from benchmarks.time_plans import training_device
    sync = training_device(args.gpu)
    with shapes.quiet():
        param = shapes.load_net_param(args.net)
        offload = args.offload if plan_name == 'offload' else None
        sp = solver_param(param, plan_name, 10 ** 6, offload=offload)
        if args.precision:
            sp.caffeplus_param.precision = args.precision
        solver = get_solver(sp)
        solver.step(args.warmup)
        sync()
        t0 = time.perf_counter()
        solver.step(args.iters)
        sync()
        ms = (time.perf_counter() - t0) * 1e3 / args.iters
        profile = cProfile.Profile()
        profile.enable()
        solver.step(args.iters)
        sync()
        profile.disable()
    plan = solver.net.applied_plan
    label = '%s (update in backward: %s)' % (
        plan_name, bool(getattr(getattr(plan, 'plan', None), 'param_diffs', False)))
    return label, ms, pstats.Stats(profile, stream=sys.stdout)


if __name__ == '__main__':
    main()
