"""CPU speed of caffeplus against stock Caffe's `caffe time` numbers.

Times forward+backward of three BVLC nets with their Data layers replaced
by DummyData (Gaussian images, constant-0 labels), in the TRAIN phase:

    LeNet          batch 64,  1x28x28     stock Caffe  28.6 ms
    CIFAR10-quick  batch 100, 3x32x32     stock Caffe 185.6 ms
    AlexNet        batch 16,  3x227x227   stock Caffe 948   ms

Usage: python benchmarks/bench_cpu.py [--nets lenet,cifar10_quick,alexnet]
                                 [--iterations N] [--layers] [--zoo DIR]
                                 [--threads N] [--clock wall|cpu]
Prints ms/iter and the ratio to Caffe (target <= 1.0); --layers adds a
per-layer forward/backward breakdown like `caffe time`.

--threads N sets the BLAS/OpenMP thread count (before NumPy loads; the
default leaves BLAS to use every core). On a machine shared with other
jobs, multi-threaded BLAS slows down badly; `--threads 1 --clock cpu`
then measures the process's CPU time, which contention barely affects.
"""
import argparse
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

os.environ.setdefault('GLOG_minloglevel', '1')


def _early_threads(argv):
    """Apply --threads before NumPy (and its BLAS) is imported."""
    for i, a in enumerate(argv):
        value = None
        if a == '--threads' and i + 1 < len(argv):
            value = argv[i + 1]
        elif a.startswith('--threads='):
            value = a.split('=', 1)[1]
        if value:
            for var in ('OPENBLAS_NUM_THREADS', 'OMP_NUM_THREADS', 'MKL_NUM_THREADS'):
                os.environ[var] = value


if __name__ == '__main__':
    _early_threads(sys.argv[1:])

import numpy  # noqa: E402

import caffeplus  # noqa: E402
from caffeplus import log  # noqa: E402
from caffeplus.io.prototxt import read_net_param  # noqa: E402
from caffeplus.layer import layer_class  # noqa: E402
from caffeplus.proto import caffe_pb2  # noqa: E402

DEFAULT_ZOO = os.environ.get('CAFFEPLUS_ZOO', os.path.join(os.path.dirname(ROOT), 'shared', 'zoo'))

NETS = [
    # name, prototxt under the zoo, batch, (C, H, W), stock Caffe ms/iter
    ('lenet', 'bvlc_caffe/examples/mnist/lenet_train_test.prototxt', 64, (1, 28, 28), 28.6),
    ('cifar10_quick', 'bvlc_caffe/examples/cifar10/cifar10_quick_train_test.prototxt', 100,
     (3, 32, 32), 185.6),
    ('alexnet', 'bvlc_caffe/models/bvlc_alexnet/train_val.prototxt', 16, (3, 227, 227), 948.0),
]

DATA_TYPES = ('Data', 'ImageData', 'HDF5Data', 'WindowData', 'MemoryData')


def dummy_net_param(path, batch, chw):
    """The net of `path` with each data layer replaced by DummyData."""
    param = read_net_param(path)
    for lp in param.layer:
        if lp.type not in DATA_TYPES:
            continue
        tops = list(lp.top)
        keep = caffe_pb2.LayerParameter()
        keep.name, keep.type = lp.name, 'DummyData'
        keep.top.extend(tops)
        keep.include.extend(lp.include)
        keep.exclude.extend(lp.exclude)
        dp = keep.dummy_data_param
        dp.shape.add().dim.extend((batch,) + tuple(chw))
        dp.data_filler.add(type='gaussian', std=1.0)
        if len(tops) > 1:
            dp.shape.add().dim.extend((batch,))
            dp.data_filler.add(type='constant', value=0)
        lp.CopyFrom(keep)
    return param


def missing_types(param):
    return sorted({lp.type for lp in param.layer if layer_class(lp.type) is None})


def bench(name, param, iterations, per_layer, warmup=2, clock=time.perf_counter):
    net = caffeplus.Net(param, caffeplus.TRAIN)
    for _ in range(warmup):
        net.forward_prefilled()
        net.backward_all()
    fwd = numpy.zeros(len(net.layers))
    bwd = numpy.zeros(len(net.layers))
    times = []
    for _ in range(iterations):
        t0 = clock()
        if per_layer:
            for i, layer in enumerate(net.layers):
                t = clock()
                layer.forward(net.bottom_vecs[i], net.top_vecs[i])
                fwd[i] += clock() - t
            for i in range(len(net.layers) - 1, -1, -1):
                if net.layer_need_backward[i]:
                    t = clock()
                    net.layers[i].backward(net.top_vecs[i], net.bottom_need_backward[i],
                                           net.bottom_vecs[i])
                    bwd[i] += clock() - t
        else:
            net.forward_prefilled()
            net.backward_all()
        times.append(clock() - t0)
    if per_layer:
        print('  per layer (ms, mean):')
        for i, lname in enumerate(net._layer_names):
            print('    %-12s %-16s forward %8.3f  backward %8.3f'
                  % (lname, net.layers[i].layer_param.type, 1e3 * fwd[i] / iterations,
                     1e3 * bwd[i] / iterations))
    return 1e3 * float(numpy.mean(times)), 1e3 * float(numpy.median(times))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    ap.add_argument('--nets', default=','.join(n[0] for n in NETS))
    ap.add_argument('--iterations', type=int, default=10)
    ap.add_argument('--layers', action='store_true', help='per-layer breakdown')
    ap.add_argument('--zoo', default=DEFAULT_ZOO)
    ap.add_argument('--threads', type=int, default=None,
                    help='BLAS threads (applied before NumPy loads)')
    ap.add_argument('--clock', choices=('wall', 'cpu'), default='wall',
                    help='wall time, or this process\'s CPU time (use with --threads 1)')
    args = ap.parse_args(argv)
    log.set_level(1)
    caffeplus.set_mode_cpu()
    caffeplus.set_random_seed(1701)
    clock = time.perf_counter if args.clock == 'wall' else time.process_time
    wanted = args.nets.split(',')
    if hasattr(os, 'getloadavg'):
        load = os.getloadavg()[0]
        ncpu = os.cpu_count() or 1
        print('# %d CPUs, load average %.2f, BLAS threads %s, %s clock'
              % (ncpu, load, os.environ.get('OPENBLAS_NUM_THREADS', 'default'), args.clock))
        if load > 0.5 * ncpu and args.clock == 'wall':
            print('# warning: the machine is busy; wall times are inflated '
                  '(try --threads 1 --clock cpu)')
    status = 0
    print('%-14s %6s %12s %12s %10s %8s' % ('net', 'batch', 'ms/iter', 'median', 'caffe ms',
                                            'ratio'))
    for name, rel, batch, chw, caffe_ms in NETS:
        if name not in wanted:
            continue
        path = os.path.join(args.zoo, rel)
        if not os.path.exists(path):
            print('%-14s skipped: %s not found' % (name, path))
            status = 1
            continue
        param = dummy_net_param(path, batch, chw)
        missing = missing_types(param)
        if missing:
            print('%-14s skipped: layer types not registered yet: %s'
                  % (name, ', '.join(missing)))
            status = 1
            continue
        mean, median = bench(name, param, args.iterations, args.layers, clock=clock)
        print('%-14s %6d %12.1f %12.1f %10.1f %8.2f'
              % (name, batch, mean, median, caffe_ms, mean / caffe_ms))
        sys.stdout.flush()
    return status


if __name__ == '__main__':
    sys.exit(main())
