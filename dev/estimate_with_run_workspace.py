#!/usr/bin/env python3
"""Split the estimate's error into the workspace model's and the rest's.

    python3 dev/estimate_with_run_workspace.py MEASURED.json NET.prototxt [--plans shared,offload]

MEASURED.json is `caffeplus memory -gpu 0 --json` output, whose placing
plans record the workspace each cuDNN call was given (workspace_calls; those
of InnerProduct's cuBLAS calls the estimate places alike).
For each plan this prints the measured peak, the estimate, and the
estimate again with the run's workspace sizes in place of the model's
algorithms: what is left of the error then is liveness, placement and the
fixed costs; the rest came from the model's candidates.
"""
import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

MiB = 2.0 ** 20


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument('measured')
    ap.add_argument('model')
    ap.add_argument('--plans', default='shared,offload')
    ap.add_argument('--offload', default='free')
    args = ap.parse_args(argv)
    from caffeplus import Net, TRAIN
    from caffeplus.memory import budget, liveness, shapes
    runs = json.load(open(args.measured))['plans']
    param = shapes.load_net_param(args.model)
    for name in args.plans.split(','):
        run = runs[name]
        calls = run.get('workspace_calls') or {}
        net = Net(param, TRAIN, memory='stock')
        index = {n: i for i, n in enumerate(net._layer_names)}
        sizes = {}
        for key, nbytes in calls.items():
            layer, part = key.rsplit('/', 1)
            if liveness.takes_gemm_workspace(net.layers[index[layer]]):
                continue        # cuBLAS's, which the estimate places as the run did
            row = sizes.setdefault(index[layer], [0, 0, 0])
            row[('forward', 'backward', 'backward_filter').index(part)] = nbytes
        model = budget.estimate_plan(net, name, offload_policy=args.offload)
        original = budget.placed_workspace_sizes
        budget.placed_workspace_sizes = lambda *a, **k: {i: tuple(r) for i, r in sizes.items()}
        try:
            with_run = budget.estimate_plan(net, name, offload_policy=args.offload)
        finally:
            budget.placed_workspace_sizes = original
        real = run.get('steady_peak_bytes') or run['peak_bytes']
        print('%-8s measured %6.0f MiB  estimate %6.0f (%+.1f%%)  with the run\'s workspace %6.0f (%+.1f%%)'
              '  arena: run %6.0f, estimate %6.0f, with the run\'s workspace %6.0f'
              % (name, real / MiB, model.peak_bytes / MiB, 100 * (model.peak_bytes - real) / real,
                 with_run.peak_bytes / MiB, 100 * (with_run.peak_bytes - real) / real,
                 run.get('arena_bytes', 0) / MiB, model.arena_bytes / MiB,
                 with_run.arena_bytes / MiB))
    return 0


if __name__ == '__main__':
    sys.exit(main())
