#!/usr/bin/env python3
"""Training speed of LeNet on the CPU, against stock Caffe's 41 iter/s.

Copies the reference set's LeNet (training/lenet_train_test.prototxt with
ip1 back at BVLC's 500 outputs, and its LMDBs) to a temporary folder, then trains it with the SGD
solver of the reference runs (batch 64) for --iters iterations, without
tests, display or snapshots, and prints iterations per second and the ratio
to stock Caffe (41 iter/s on the reference machine, single-threaded
OpenBLAS). It also prints the process's CPU time per iteration, a view
that a busy machine distorts less than the wall clock.

    python benchmarks/bench_train_cpu.py [--iters 200] [--warmup 10] [--solver SGD]
                                    [--threads 1|N|keep] [--profile out.prof]

BLAS runs single-threaded by default, as in the stock-Caffe measurement;
--threads N or keep changes that (on a loaded machine OpenBLAS's spinning
threads can make several threads far slower than one).

--reference points at the reference set (default: $CAFFEPLUS_SHARED/reference
or tests/data/reference beside the repository).
"""
import argparse
import os
import shutil
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STOCK_CAFFE_ITER_S = 41.0


def default_reference():
    shared = os.environ.get('CAFFEPLUS_SHARED', os.path.join(ROOT, 'tests', 'data'))
    return os.path.join(shared, 'reference')


SOLVER = '''
net: "training/lenet_train_test.prototxt"
base_lr: 0.01
momentum: {momentum}
weight_decay: 0.0005
lr_policy: "inv"
gamma: 0.0001
power: 0.75
display: 0
max_iter: {max_iter}
snapshot: 0
snapshot_after_train: false
random_seed: 1701
type: "{type}"
solver_mode: CPU
'''


def prepare(reference, workdir):
    src = os.path.join(reference, 'training')
    if not os.path.isdir(src):
        sys.exit('reference set not found: %s' % src)
    dst = os.path.join(workdir, 'training')
    os.makedirs(dst)
    shutil.copytree(os.path.join(src, 'data'), os.path.join(dst, 'data'))
    for name in ('lenet_train_test.prototxt', 'init.caffemodel'):
        shutil.copy(os.path.join(src, name), dst)
    # The reference runs shrink ip1 to 100 outputs; stock Caffe's 41 iter/s is
    # BVLC's LeNet (ip1 500): time that net (its fillers start it, not
    # init.caffemodel, whose ip1 has the other shape).
    net = os.path.join(dst, 'lenet_train_test.prototxt')
    with open(net) as f:
        text = f.read()
    with open(net, 'w') as f:
        f.write(text.replace('num_output: 100', 'num_output: 500'))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    ap.add_argument('--iters', type=int, default=200)
    ap.add_argument('--warmup', type=int, default=10)
    ap.add_argument('--solver', default='SGD', help='solver type (SGD, Adam, ...)')
    ap.add_argument('--reference', default=default_reference())
    ap.add_argument('--profile', default=None, help='write cProfile stats of the timed part')
    ap.add_argument('--quiet', action='store_true', help='only warnings on stderr')
    ap.add_argument('--threads', default='1',
                    help="BLAS threads (default 1, as stock Caffe's 41 iter/s was measured); "
                         "'keep' leaves the environment as it is")
    args = ap.parse_args(argv)
    if args.threads != 'keep':
        if 'numpy' in sys.modules:
            print('warning: NumPy is already imported; --threads may not take effect',
                  file=sys.stderr)
        for var in ('OPENBLAS_NUM_THREADS', 'OMP_NUM_THREADS', 'MKL_NUM_THREADS'):
            os.environ[var] = str(int(args.threads))

    sys.path.insert(0, ROOT)
    import caffeplus
    from caffeplus import log
    from caffeplus.io.prototxt import parse_text
    from caffeplus.proto import caffe_pb2
    from caffeplus.solver import get_solver

    if args.quiet:
        log.set_level(1)
    caffeplus.set_mode_cpu()
    cwd = os.getcwd()
    with tempfile.TemporaryDirectory(prefix='caffeplus_bench_') as tmp:
        prepare(args.reference, tmp)
        os.chdir(tmp)
        try:
            momentum = 0.0 if args.solver in ('AdaGrad', 'RMSProp') else 0.9
            text = SOLVER.format(momentum=momentum, type=args.solver,
                                 max_iter=args.iters + args.warmup)
            param = parse_text(text, caffe_pb2.SolverParameter())
            solver = get_solver(param)
            solver.step(args.warmup)
            profiler = None
            if args.profile:
                import cProfile
                profiler = cProfile.Profile()
                profiler.enable()
            t0, c0 = time.perf_counter(), time.process_time()
            solver.step(args.iters)
            elapsed = time.perf_counter() - t0
            cpu = time.process_time() - c0
            if profiler is not None:
                profiler.disable()
                profiler.dump_stats(os.path.join(cwd, args.profile)
                                    if not os.path.isabs(args.profile) else args.profile)
        finally:
            os.chdir(cwd)
    rate = args.iters / elapsed
    print('LeNet (batch 64) %s on the CPU: %d iterations in %.2f s = %.1f iter/s, '
          '%.1f ms/iter; %.2fx stock Caffe (%.0f iter/s)'
          % (args.solver, args.iters, elapsed, rate, 1000 * elapsed / args.iters,
             rate / STOCK_CAFFE_ITER_S, STOCK_CAFFE_ITER_S))
    # On a busy machine wall time overstates the cost; CPU time (all threads
    # of this process: BLAS threads and the data prefetch thread included)
    # is a second view. With OPENBLAS_NUM_THREADS=1 and an idle machine the
    # two agree.
    print('  process CPU time: %.1f ms/iter (%d threads available, load average %s)'
          % (1000 * cpu / args.iters, os.cpu_count() or 1,
             ' '.join('%.2f' % x for x in os.getloadavg()) if hasattr(os, 'getloadavg')
             else 'n/a'))
    return 0


if __name__ == '__main__':
    sys.exit(main())
