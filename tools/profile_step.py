#!/usr/bin/env python3
"""Time solver.step under a memory plan and show where the host spends it.

    python tools/profile_step.py --net ../shared/bench/googlenet_b64.prototxt --plan shared \\
        [--gpu 0] [--iters 10] [--top 25]

Builds an SGD solver (momentum 0.9, weight decay, the NaN check as
`caffeplus train` has it) over the net with its data layers as DummyData,
runs 3 steps, times --iters steps (ms/iter, device synchronised), then runs
--iters more under cProfile and prints the functions of most own time.
CAFFEPLUS_UPDATE_IN_BACKWARD=0 compares with the update after backward.
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
    args = ap.parse_args(argv)
    from caffeplus.memory import shapes
    from caffeplus.solver import get_solver
    from tools.check_plans_equal import solver_param
    from tools.time_plans import training_device
    sync = training_device(args.gpu)
    with shapes.quiet():
        param = shapes.load_net_param(args.net)
        solver = get_solver(solver_param(param, args.plan, 10 ** 6))
        solver.step(3)
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
    print('%s plan %s: %.2f ms/iter; update in backward: %s' % (
        os.path.basename(args.net), args.plan, ms,
        bool(getattr(getattr(plan, 'plan', None), 'param_diffs', False))))
    pstats.Stats(profile, stream=sys.stdout).sort_stats('tottime').print_stats(args.top)


if __name__ == '__main__':
    main()
