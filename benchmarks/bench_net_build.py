"""How long building real nets takes (CPU backend), against the time NumPy
takes to draw the same values, measured in one process.

    python3 benchmarks/bench_net_build.py [--repeat 3] [--nets vgg16_deploy,alexnet_train]

For every net: one untimed census build records what its fillers draw
(kind and count, weights and DummyData tops alike); then, `--repeat` times
and interleaved so that drift on a shared machine hits both alike, the
build (caffeplus.Net from the prototxt, parsing included, log at WARNING)
and NumPy drawing the census's values: for each filled array,
numpy.empty(n, float32) and Generator.standard_normal(out=) for gaussian
and msra, Generator.random(out=) for uniform, xavier and positive_unitball,
.fill() for constants and bilinear, numpy.zeros for the constant 0 of an
absent filler, every array kept until the last is filled, as a net keeps
them. Medians are printed, with build / NumPy (target <= 2.0), and, for a
net read from a file, the part of its build that protobuf's text parser
takes (read alone, in the same rounds).

Stock Caffe cannot run here. Its build times on record are LeNet's, in the
stock-Caffe reference logs (the time from "Initializing net from parameters"
to "Network initialization done"): reference/cli/time_lenet_dummy_b64.log
(DummyData) and the four reference/training/*/train.log runs (LMDB data, a
TRAIN and a TEST net each). The same window of caffeplus's log is timed for
the same nets and compared with them (target <= 1.5).
"""
import argparse
import collections
import gc
import logging
import os
import re
import statistics
import sys
import time

import numpy

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import caffeplus                                         # noqa: E402
from caffeplus import fillers, log, rng                 # noqa: E402
from caffeplus.proto import caffe_pb2                   # noqa: E402
from google.protobuf import text_format                 # noqa: E402

SHARED = os.environ.get('CAFFEPLUS_SHARED', '/work/shared')
if not os.path.isdir(SHARED):
    SHARED = os.path.join(ROOT, 'tests', 'data')
ZOO = os.path.join(SHARED, 'zoo', 'bvlc_caffe', 'models')
BENCH = os.path.join(SHARED, 'bench')
REFERENCE = os.path.join(SHARED, 'reference')


# -- the nets --------------------------------------------------------------------
def _read(path):
    return text_format.Parse(open(path).read(), caffe_pb2.NetParameter())


def vgg16_deploy(with_fillers):
    """VGG-16's deploy net (138,357,544 parameters, input 10x3x224x224): the
    bench's VGG-16 (NVIDIA Caffe's train_val) with DummyData made an Input
    and the loss and accuracies a Softmax. The Model Zoo's deploy file
    gives no fillers (every parameter constant 0): `with_fillers` False."""
    train = _read(os.path.join(BENCH, 'vgg16_b64.prototxt'))
    net = caffe_pb2.NetParameter(name='VGG_ILSVRC_16_layers')
    data = net.layer.add(name='data', type='Input', top=['data'])
    data.input_param.shape.add().dim.extend([10, 3, 224, 224])
    last = None
    for lp in train.layer:
        if lp.type in ('DummyData', 'SoftmaxWithLoss', 'Accuracy'):
            continue
        copy = net.layer.add()
        copy.CopyFrom(lp)
        if not with_fillers:
            for field in ('convolution_param', 'inner_product_param'):
                if copy.HasField(field):
                    getattr(copy, field).ClearField('weight_filler')
                    getattr(copy, field).ClearField('bias_filler')
        last = copy.top[0]
    net.layer.add(name='prob', type='Softmax', bottom=[last], top=['prob'])
    return net


def _zoo_train(model):
    """A zoo train_val with its data layers made DummyData (no databases here)."""
    from caffeplus.io import dummy
    return dummy.swap_data_layers(os.path.join(ZOO, model, 'train_val.prototxt'))


NETS = collections.OrderedDict([
    # name: (how to get the NetParameter, phase)
    ('lenet_dummy_b64', (lambda: os.path.join(REFERENCE, 'cli', 'lenet_dummy_b64.prototxt'),
                         caffe_pb2.TRAIN)),
    ('vgg16_deploy', (lambda: vgg16_deploy(True), caffe_pb2.TEST)),
    ('vgg16_deploy_zoo', (lambda: vgg16_deploy(False), caffe_pb2.TEST)),
    ('vgg16_b64_train', (lambda: os.path.join(BENCH, 'vgg16_b64.prototxt'), caffe_pb2.TRAIN)),
    ('alexnet_deploy', (lambda: os.path.join(ZOO, 'bvlc_alexnet', 'deploy.prototxt'),
                        caffe_pb2.TEST)),
    ('alexnet_train', (lambda: _zoo_train('bvlc_alexnet'), caffe_pb2.TRAIN)),
    ('googlenet_train', (lambda: _zoo_train('bvlc_googlenet'), caffe_pb2.TRAIN)),
    ('googlenet_deploy', (lambda: os.path.join(ZOO, 'bvlc_googlenet', 'deploy.prototxt'),
                          caffe_pb2.TEST)),
    ('resnet50_b32_train', (lambda: os.path.join(BENCH, 'resnet50_b32.prototxt'),
                            caffe_pb2.TRAIN)),
    ('resnet50_deploy', (lambda: os.path.join(SHARED, 'zoo', 'resnet_kaiminghe', 'prototxt',
                                              'ResNet-50-deploy.prototxt'), caffe_pb2.TEST)),
])


# -- what the fillers draw ---------------------------------------------------------
def census(source, phase):
    """[(kind, count, value)] of every array the net's fillers fill."""
    seen = []
    real = fillers._checked_shape

    def record(param, shape):
        shape = real(param, shape)
        count = int(numpy.prod(shape, dtype=numpy.int64))
        kind = param.type
        if kind == 'constant' and param.value == 0:
            kind = 'zeros'
        seen.append((kind, count, param.value))
        return shape
    fillers._checked_shape = record
    try:
        net = caffeplus.Net(source, phase)
    finally:
        fillers._checked_shape = real
    del net
    return seen


_NORMAL = ('gaussian', 'msra')
_UNIFORM = ('uniform', 'xavier', 'positive_unitball')


def numpy_draws(draws):
    """Seconds NumPy takes to allocate and fill arrays like `draws`. The
    arrays are kept until the end, as a net keeps its weights: freed one by
    one, each next array would reuse memory the last one already faulted in,
    which no build can."""
    g = rng.get()
    kept = []
    start = time.perf_counter()
    for kind, count, value in draws:
        if kind == 'zeros':
            a = numpy.zeros(count, dtype=numpy.float32)
        else:
            a = numpy.empty(count, dtype=numpy.float32)
            if kind in _NORMAL:
                g.standard_normal(dtype=numpy.float32, out=a)
            elif kind in _UNIFORM:
                g.random(dtype=numpy.float32, out=a)
            else:
                a.fill(value)
        kept.append(a)
    seconds = time.perf_counter() - start
    del kept
    return seconds


def parse_seconds(source):
    """Seconds reading the prototxt (protobuf's text parser, and the upgrade
    check every build makes); None for a net given as a NetParameter."""
    if not isinstance(source, str):
        return None
    from caffeplus.net import load_net_param
    start = time.perf_counter()
    load_net_param(source)
    return time.perf_counter() - start


def build_seconds(source, phase):
    start = time.perf_counter()
    net = caffeplus.Net(source, phase)
    seconds = time.perf_counter() - start
    del net
    return seconds


# -- the stock-Caffe build times on record --------------------------------------------
_STAMP = re.compile(r'^I\d{8} (\d\d):(\d\d):(\d\d\.\d+) ')

# (label, the stock log(s) relative to the reference set, which window in each
# log (0: the first net built, 1: the second), the net relative to the
# reference set, phase). The reference set's root is the working directory
# when the nets are built, as it was for stock Caffe (the LMDB paths in
# lenet_train_test.prototxt are relative to it).
STOCK_WINDOWS = [
    ('LeNet, DummyData b64, TRAIN', ['cli/time_lenet_dummy_b64.log'], 0,
     'cli/lenet_dummy_b64.prototxt', caffe_pb2.TRAIN),
    ('LeNet, LMDB b64, TRAIN', ['training/%s/train.log' % s for s in
                                ('sgd', 'nesterov', 'adagrad', 'adam')], 0,
     'training/lenet_train_test.prototxt', caffe_pb2.TRAIN),
    ('LeNet, LMDB b32, TEST', ['training/%s/train.log' % s for s in
                               ('sgd', 'nesterov', 'adagrad', 'adam')], 1,
     'training/lenet_train_test.prototxt', caffe_pb2.TEST),
]


def _windows(lines):
    """Seconds from each 'Initializing net from parameters' to the next
    'Network initialization done' in glog-format lines."""
    def seconds(line):
        h, m, s = _STAMP.match(line).groups()
        return int(h) * 3600 + int(m) * 60 + float(s)
    found, start = [], None
    for line in lines:
        if 'Initializing net from parameters' in line:
            start = seconds(line)
        elif 'Network initialization done' in line and start is not None:
            found.append(seconds(line) - start)
            start = None
    return found


def stock_caffe_seconds(logs, which):
    """The median of stock Caffe's window over `logs` (None when missing)."""
    paths = [os.path.join(REFERENCE, log_path) for log_path in logs]
    if not all(os.path.exists(path) for path in paths):
        return None
    return statistics.median(_windows(open(path).read().splitlines())[which]
                             for path in paths)


class _StampedDevnull:
    """A stream that discards what is written, noting when each of the two
    lines that bound stock Caffe's window is written."""
    KEYS = ('Initializing net from parameters', 'Network initialization done')

    def __init__(self):
        self.times = {}

    def write(self, text):
        for key in self.KEYS:
            if key in text:
                self.times[key] = time.perf_counter()
        return len(text)

    def flush(self):
        pass


def caffeplus_window_seconds(source, phase):
    """caffeplus's build timed over the window stock Caffe's log shows, with
    logging as the command line sets it (INFO, every line formatted as
    glog's and written by caffeplus's handler, to a stream that notes the
    two lines' times)."""
    stream = _StampedDevnull()
    handlers, level = log.logger.handlers[:], log.logger.level
    log.logger.handlers = [log.GlogHandler(stream)]
    log.logger.setLevel(logging.INFO)
    # A net left from the last round would otherwise be collected inside
    # this window, joining its prefetch threads: a cost stock's window lacks.
    gc.collect()
    try:
        net = caffeplus.Net(source, phase)
    finally:
        log.logger.handlers = handlers
        log.logger.setLevel(level)
    del net
    t = stream.times
    return t['Network initialization done'] - t['Initializing net from parameters']


# -- the run ----------------------------------------------------------------------------
def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    parser.add_argument('--repeat', type=int, default=3)
    parser.add_argument('--nets', default=','.join(NETS))
    parser.add_argument('--no-stock', dest='stock', action='store_false',
                        help='skip the windows compared with stock Caffe\'s logs')
    args = parser.parse_args(argv)
    caffeplus.set_mode_cpu()
    caffeplus.set_random_seed(1701)
    log.set_level(logging.WARNING)
    print('numpy %s, %d CPU(s), repeat %d (medians)' % (numpy.__version__, os.cpu_count(),
                                                       args.repeat))
    print('| net | phase | filled values | build s | of which parsing s | NumPy draws s '
          '| build / NumPy |')
    print('|---|---|---|---|---|---|---|')
    worst = 0.0
    for name in args.nets.split(','):
        make, phase = NETS[name]
        source = make()
        draws = census(source, phase)
        builds, parses, draws_s = [], [], []
        for _ in range(args.repeat):
            builds.append(build_seconds(source, phase))
            parses.append(parse_seconds(source))
            draws_s.append(numpy_draws(draws))
        build, base = statistics.median(builds), statistics.median(draws_s)
        parse = '-' if parses[0] is None else '%.3f' % statistics.median(parses)
        ratio = build / base if base > 0 else float('inf')
        worst = max(worst, ratio)
        print('| %s | %s | %s | %.3f | %s | %.3f | %.2f |'
              % (name, caffe_pb2.Phase.Name(phase), '{:,}'.format(sum(c for _, c, _ in draws)),
                 build, parse, base, ratio))
        sys.stdout.flush()
    print('worst build / NumPy: %.2f (target <= 2.0)' % worst)

    if args.stock:
        print()
        print('From "Initializing net from parameters" to "Network initialization done", '
              'against stock Caffe 1.0\'s reference logs (target <= 1.5):')
        print('| net | caffeplus ms | stock Caffe ms | ratio |')
        print('|---|---|---|---|')
        here = os.getcwd()
        os.chdir(REFERENCE)
        try:
            for label, logs, which, net_path, phase in STOCK_WINDOWS:
                stock = stock_caffe_seconds(logs, which)
                if stock is None:
                    print('| %s | - | (%s missing) | - |' % (label, ', '.join(logs)))
                    continue
                # A window is 2 ms: 21 of them cost nothing, and their median
                # stands where a neighbour's load slows a few of them.
                ours = statistics.median(caffeplus_window_seconds(net_path, phase)
                                         for _ in range(max(args.repeat, 21)))
                print('| %s | %.2f | %.2f | %.2f |' % (label, ours * 1e3, stock * 1e3,
                                                       ours / stock))
        finally:
            os.chdir(here)
    return 0


if __name__ == '__main__':
    sys.exit(main())
