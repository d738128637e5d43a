#!/usr/bin/env python3
"""Memory plans change where blobs live, never the numbers: train the same
nets under several plans and check that losses and weights are bit-identical.

    python dev/check_plans_equal.py                       # CPU, 50 iterations, 4 nets
    python dev/check_plans_equal.py --gpu 0 --math deterministic
    python dev/check_plans_equal.py --nets lenet,cifar10_bn --plans stock,shared,offload \\
                                      --iters 50 --batch 2

Nets: lenet (the reference set's LeNet over its LMDB, copied to a temporary
folder, with its TEST net), cifar10_bn (the zoo's
cifar10_full_sigmoid_train_test_bn, data layers swapped for DummyData),
googlenet and resnet50 (shared/bench/googlenet_b64 and resnet50_b32, batch
overridden). Each plan trains from the same seed with SGD (momentum 0.9,
weight decay) for --iters iterations; every iteration's loss, the final
weights (and BatchNorm statistics) and the test net's outputs are compared
with the first plan's. Exit status 1 if anything differs.

tests/test_memory_apply.py uses the helpers here with few iterations.
"""
import argparse
import os
import shutil
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

NETS = ('lenet', 'cifar10_bn', 'googlenet', 'resnet50')
DEFAULT_BATCH = {'lenet': None, 'cifar10_bn': 2, 'googlenet': 1, 'resnet50': 1}


def shared_dir():
    return os.environ.get('CAFFEPLUS_SHARED', os.path.join(ROOT, 'tests', 'data'))


def model_path(name):
    shared = shared_dir()
    return {
        'lenet': os.path.join(shared, 'reference', 'training', 'lenet_train_test.prototxt'),
        'cifar10_bn': os.path.join(shared, 'zoo', 'bvlc_caffe', 'examples', 'cifar10',
                                   'cifar10_full_sigmoid_train_test_bn.prototxt'),
        'googlenet': os.path.join(shared, 'bench', 'googlenet_b64.prototxt'),
        'resnet50': os.path.join(shared, 'bench', 'resnet50_b32.prototxt'),
    }[name]


def random_labels(param, classes=10):
    """DummyData label tops (1-D) drawn uniformly from [0, classes) every
    iteration instead of a constant 0 (which a net learns at once)."""
    from caffeplus.proto import caffe_pb2
    for lp in param.layer:
        if lp.type != 'DummyData':
            continue
        p = lp.dummy_data_param
        n = max(len(p.shape), len(lp.top))
        if len(p.shape) != n or len(p.data_filler) not in (n,):
            continue
        for shape, filler in zip(p.shape, p.data_filler):
            if len(shape.dim) == 1:
                filler.CopyFrom(caffe_pb2.FillerParameter(type='uniform', min=0,
                                                          max=classes - 1e-3))
    return param


def net_param(name, workdir, batch=None):
    """(NetParameter, number of test nets) of net `name`; LeNet's LMDBs are
    copied under `workdir` (a Data layer must not lock the shared copy)."""
    from caffeplus.io.dummy import swap_data_layers
    from caffeplus.memory import shapes
    from caffeplus.net import load_net_param
    path = model_path(name)
    if not os.path.exists(path):
        raise FileNotFoundError(path)
    if name == 'lenet':
        src = os.path.join(os.path.dirname(path), 'data')
        dst = os.path.join(workdir, 'lenet_data')
        if not os.path.isdir(dst):
            shutil.copytree(src, dst)
        param = load_net_param(path)
        for lp in param.layer:
            if lp.type == 'Data':
                lp.data_param.source = os.path.join(dst, os.path.basename(lp.data_param.source))
                if batch:
                    lp.data_param.batch_size = batch
        return param, 1
    if name == 'cifar10_bn':
        param = swap_data_layers(load_net_param(path), batch_size=batch or 2)
        return random_labels(param), 1
    with shapes.quiet():
        param = load_net_param(path)
    if batch:
        shapes.set_batch(param, batch)
    return random_labels(param), 0


def solver_param(param, plan, iters, test_nets=0, math=None, keep=(), offload=None,
                 workspace_limit=None):
    from caffeplus.proto import caffe_pb2
    sp = caffe_pb2.SolverParameter()
    sp.net_param.CopyFrom(param)
    sp.type = 'SGD'
    sp.base_lr = 0.01
    sp.momentum = 0.9
    sp.weight_decay = 5e-4
    sp.lr_policy = 'fixed'
    sp.max_iter = iters
    sp.display = 0
    sp.snapshot = 0
    sp.snapshot_after_train = False
    sp.random_seed = 1701
    for _ in range(test_nets):
        sp.test_iter.append(1)
    if test_nets:
        sp.test_interval = max(iters // 2, 1)
        sp.test_initialization = False
    cp = sp.caffeplus_param
    cp.memory_plan = plan
    cp.keep.extend(keep)
    if offload:
        cp.offload.extend([offload] if isinstance(offload, str) else offload)
    if math:
        cp.math = math
    if workspace_limit:
        cp.workspace_limit = int(workspace_limit)
    return sp


class Result:
    def __init__(self, plan):
        self.plan = plan
        self.losses = []
        self.weights = []
        self.test_outputs = {}
        self.info = {}
        self.seconds = 0.0
        self.algorithms = {}        # {layer: {call kind: the chosen algorithm}} (GPU)


def _host(a):
    from caffeplus import backend
    return backend.to_numpy(a).copy()


def train(param, plan, iters, test_nets=0, gpu=None, math=None, keep=(), offload=None,
          workspace_limit=None, runtime_options=None, lookahead=None, solver_hook=None):
    """Train `param` under memory plan `plan` for `iters` iterations; a Result."""
    import caffeplus
    from caffeplus import backend
    from caffeplus.memory import shapes
    from caffeplus.memory.apply import apply_named_plan, _offload_policy
    from caffeplus.solver.memory_plans import apply_solver_plans
    from caffeplus.solver import get_solver
    if gpu is not None:
        backend.set_mode_gpu(gpu)
    else:
        backend.set_mode_cpu()
    caffeplus.set_random_seed(1701)
    sp = solver_param(param, plan, iters, test_nets, math, keep, offload, workspace_limit)
    result = Result(plan)
    with shapes.quiet():
        solver = get_solver(sp)
        apply_solver_plans(solver)          # (again, if the solver already did)
        if runtime_options is not None or lookahead is not None:
            # Offload options the solver parameter has no field for.
            apply_named_plan(solver.net, plan, keep=keep,
                             offload_policy=_offload_policy(sp.caffeplus_param.offload),
                             workspace_limit=workspace_limit, training=True,
                             lookahead=lookahead, runtime_options=runtime_options)
        if solver_hook is not None:
            solver_hook(solver)
        applied = solver.net.applied_plan
        t0 = time.perf_counter()
        for _ in range(iters):
            solver.step(1)
            result.losses.append(float(solver.smoothed_loss))
        if gpu is not None:
            import cupy
            cupy.cuda.Device().synchronize()
        result.seconds = time.perf_counter() - t0
        result.weights = [_host(b.data) for layer in solver.net.layers for b in layer.blobs]
        for i, test_net in enumerate(solver.test_nets):
            solver.test(i)
            for name in test_net.outputs:
                result.test_outputs['%d/%s' % (i, name)] = _host(test_net._blob_dict[name].data)
        result.algorithms = chosen_algorithms(solver.net)
        applied = solver.net.applied_plan
        if applied is not None:
            result.info = applied.info()
            result.info.pop('arena', None)
            if applied.runtime is not None:
                result.info['offload_stats'] = dict(applied.runtime.stats)
                result.info['lookahead'] = applied.runtime.lookaheads()
    result.solver = solver
    return result


def chosen_algorithms(net):
    """{layer name: {call kind: repr of its chosen algorithm}} of the layers
    that choose one (cuDNN's convolutions on the GPU)."""
    out = {}
    for name, layer in zip(net._layer_names, net.layers):
        choose = getattr(layer, 'algorithms', None)
        if callable(choose):
            picks = choose() or {}
            if picks:
                out[name] = {kind: repr(c) for kind, c in sorted(picks.items())}
    return out


def algorithm_differences(a, b):
    """Lines naming each call whose algorithm differs between two Results."""
    out = []
    for layer in sorted(set(a.algorithms) | set(b.algorithms)):
        x, y = a.algorithms.get(layer, {}), b.algorithms.get(layer, {})
        for kind in sorted(set(x) | set(y)):
            if x.get(kind) != y.get(kind):
                out.append('  %s %s: %s %s, %s %s' % (layer, kind, a.plan, x.get(kind),
                                                      b.plan, y.get(kind)))
    return out


def differences(a, b):
    """What differs between two Results (empty: bit-identical)."""
    import numpy
    out = []
    for i, (x, y) in enumerate(zip(a.losses, b.losses)):
        if x != y:
            out.append('iteration %d loss: %s %r, %s %r' % (i + 1, a.plan, x, b.plan, y))
            break
    if len(a.losses) != len(b.losses):
        out.append('iteration counts differ')
    for i, (x, y) in enumerate(zip(a.weights, b.weights)):
        if x.shape != y.shape or not numpy.array_equal(x, y):
            out.append('parameter blob %d differs (max abs diff %g)'
                       % (i, float(numpy.max(numpy.abs(x - y))) if x.shape == y.shape else -1))
            break
    for k in a.test_outputs:
        if not numpy.array_equal(a.test_outputs[k], b.test_outputs.get(k)):
            out.append('test output %s differs' % k)
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    ap.add_argument('--nets', default=','.join(NETS))
    ap.add_argument('--plans', default='stock,shared,offload',
                    help='plans to compare with the first (default stock,shared,offload)')
    ap.add_argument('--iters', type=int, default=50)
    ap.add_argument('--batch', type=int, default=None,
                    help='batch of every net (default: lenet 64, cifar10_bn 2, googlenet and '
                         'resnet50 1 on the CPU, 8 on the GPU)')
    ap.add_argument('--gpu', type=int, default=None)
    ap.add_argument('--math', default=None, help='GPU math mode (deterministic for bit-identity)')
    ap.add_argument('--offload', default='conv', help='offload policy: conv, all, blob names')
    ap.add_argument('--workspace_limit', type=int, default=None)
    ap.add_argument('--algorithms', action='store_true',
                    help="list each convolution call whose algorithm differs from the first "
                         "plan's (GPU)")
    args = ap.parse_args(argv)
    from caffeplus import log
    log.logger.setLevel(30)
    plans = [p for p in args.plans.split(',') if p]
    failed = False
    with tempfile.TemporaryDirectory(prefix='caffeplus_plans_') as tmp:
        for name in [n for n in args.nets.split(',') if n]:
            batch = args.batch or (DEFAULT_BATCH[name] if args.gpu is None or name in
                                   ('lenet', 'cifar10_bn') else 8)
            try:
                param, test_nets = net_param(name, tmp, batch)
            except FileNotFoundError as exc:
                print('%-11s skipped: %s not found' % (name, exc))
                continue
            results = []
            for plan in plans:
                try:
                    r = train(param, plan, args.iters, test_nets, gpu=args.gpu,
                              math=args.math,
                              offload=args.offload if plan == 'offload' else None,
                              workspace_limit=args.workspace_limit)
                except Exception as exc:        # a plan that cannot run says why; the rest run
                    print('%-11s %-8s FAILED: %s: %s' % (name, plan, type(exc).__name__, exc))
                    failed = True
                    continue
                results.append(r)
                diff = differences(results[0], r) if len(results) > 1 else []
                extra = ''
                if r.info:
                    extra = ' arena %.1f MiB' % (r.info.get('arena_bytes', 0) / 2 ** 20)
                    if 'offload_stats' in r.info:
                        extra += ', %d offloaded' % len(r.info.get('offloaded', []))
                print('%-11s %-8s %3d iterations %7.2f s  final loss %.6g%s  %s'
                      % (name, plan, args.iters, r.seconds, r.losses[-1] if r.losses else 0,
                         extra, ('DIFFERS: ' + '; '.join(diff)) if diff else
                         ('bit-identical to %s' % plans[0] if len(results) > 1 else '')))
                if args.algorithms and len(results) > 1:
                    for line in algorithm_differences(results[0], r):
                        print(line)
                sys.stdout.flush()
                failed |= bool(diff)
                del r.solver
    return 1 if failed else 0


if __name__ == '__main__':
    sys.exit(main())
