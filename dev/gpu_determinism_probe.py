#!/usr/bin/env python3
"""Is a GPU training run repeatable under one plan? (Run on the GPU machine.)

Trains the same net twice under each plan with deterministic math and the
same workspace limit, and prints whether each pair is bit-identical. If the
same plan does not repeat itself, differences between plans come from
non-deterministic kernels, not from the plan's placement.

    python dev/gpu_determinism_probe.py [--nets lenet,cifar10_bn] [--iters 10]
"""
import argparse
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import check_plans_equal as cpe  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument('--nets', default='lenet,cifar10_bn')
    ap.add_argument('--plans', default='arena,shared')
    ap.add_argument('--iters', type=int, default=10)
    args = ap.parse_args()
    for name in args.nets.split(','):
        with tempfile.TemporaryDirectory() as tmp:
            param, test_nets = cpe.net_param(name, tmp, 2)
            runs = {}
            for plan in args.plans.split(','):
                pair = [cpe.train(param, plan, args.iters, test_nets, gpu=0, math='deterministic',
                                  workspace_limit=64 << 20) for _ in range(2)]
                diff = cpe.differences(pair[0], pair[1])
                print('%-10s %-7s run vs rerun: %s' % (name, plan,
                                                       'bit-identical' if not diff else diff[:2]))
                runs[plan] = pair[0]
            plans = list(runs)
            for a, b in zip(plans, plans[1:]):
                diff = cpe.differences(runs[a], runs[b])
                print('%-10s %s vs %s: %s' % (name, a, b, 'bit-identical' if not diff else diff[:2]))


if __name__ == '__main__':
    main()
