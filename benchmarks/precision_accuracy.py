"""Train one solver in several precisions and compare their test accuracy
with FP32's (the 16-bit types must reach it within --tolerance points).

Each precision is a `caffeplus train --solver S --precision P` run in a
subprocess (FLOAT16 with its adaptive loss scaling), snapshots written to a
temporary folder; the accuracy compared is the last test pass's. On the CPU
the 16-bit types are emulated bit for bit; with --gpu they run on the device.

    python3 benchmarks/precision_accuracy.py                 # digits LeNet, CPU
    python3 benchmarks/precision_accuracy.py --gpu 0 --precisions fp32,fp16
    python3 benchmarks/precision_accuracy.py --gpu 0 --seeds 1,2,3 \
        --solver examples/digits/cifar10_full_solver.prototxt

With --seeds every precision trains once per random seed and the means are
compared: on a small test set (the digits' 297 images, a third of a point
each) one run's accuracy moves by more than the tolerance from seed to seed.
"""
import argparse
import os
import re
import subprocess
import sys
import tempfile
import time

from google.protobuf import text_format

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from caffeplus.proto import caffe_pb2  # noqa: E402

_TEST_OUTPUT = re.compile(r'Test net output #\d+: (\S+) = ([-+0-9.eE]+|nan|inf)')


def last_test_outputs(log_text):
    """The values of the last test pass's outputs, by name."""
    found = {}
    for line in log_text.splitlines():
        if 'Testing net (#0)' in line:
            found = {}
        m = _TEST_OUTPUT.search(line)
        if m:
            found[m.group(1)] = float(m.group(2))
    return found


def train(solver_path, precision, gpu, workdir, seed=None):
    """Run one training (the solver's random_seed unless `seed`); returns
    (last test outputs, overflow steps, seconds, log path)."""
    param = caffe_pb2.SolverParameter()
    with open(solver_path) as f:
        text_format.Merge(f.read(), param)
    name = precision if seed is None else '%s_seed%d' % (precision, seed)
    if seed is not None:
        param.random_seed = seed
    param.snapshot_prefix = os.path.join(workdir, name)
    param.solver_mode = caffe_pb2.SolverParameter.GPU if gpu is not None else \
        caffe_pb2.SolverParameter.CPU
    solver = os.path.join(workdir, name + '_solver.prototxt')
    with open(solver, 'w') as f:
        f.write(text_format.MessageToString(param))
    cmd = [sys.executable, '-m', 'caffeplus', 'train', '--solver', solver,
           '--precision', precision]
    if gpu is not None:
        cmd += ['-gpu', str(gpu)]
    log_path = os.path.join(workdir, name + '.log')
    t0 = time.time()
    with open(log_path, 'w') as log:
        rc = subprocess.call(cmd, stdout=log, stderr=subprocess.STDOUT)
    seconds = time.time() - t0
    text = open(log_path).read()
    if rc != 0:
        raise SystemExit('%s run failed (exit %d); its log:\n%s' % (precision, rc, text[-3000:]))
    return last_test_outputs(text), text.count('gradient overflow'), seconds, log_path


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    ap.add_argument('--solver', default='examples/digits/lenet_solver.prototxt')
    ap.add_argument('--precisions', default='fp32,fp16,bf16')
    ap.add_argument('--gpu', type=int, default=None)
    ap.add_argument('--output', default='accuracy', help='the test output compared')
    ap.add_argument('--tolerance', type=float, default=0.5, help='points of accuracy')
    ap.add_argument('--keep', default=None, help='keep the logs in this folder')
    ap.add_argument('--seeds', default=None,
                    help='comma-separated random seeds: a run per seed, means compared')
    args = ap.parse_args(argv)
    precisions = args.precisions.split(',')
    if precisions[0] != 'fp32':
        precisions.insert(0, 'fp32')
    seeds = [int(v) for v in args.seeds.split(',')] if args.seeds else [None]
    workdir = args.keep or tempfile.mkdtemp(prefix='caffeplus_accuracy_')
    os.makedirs(workdir, exist_ok=True)
    print('solver %s, %s%s' % (args.solver, 'GPU %d' % args.gpu if args.gpu is not None else
                               'CPU', ', seeds %s' % args.seeds if args.seeds else ''))
    print('| precision | %s | vs FP32 (points) | per seed | overflow steps | train s |'
          % args.output)
    print('|---|---|---|---|---|---|')
    base, worst = None, 0.0
    for p in precisions:
        accs, overflows, seconds = [], 0, 0.0
        for seed in seeds:
            outputs, o, t, _ = train(args.solver, p, args.gpu, workdir, seed)
            if args.output not in outputs:
                raise SystemExit('%s run: no test output named %r (%s)'
                                 % (p, args.output, sorted(outputs)))
            accs.append(outputs[args.output] * 100)
            overflows += o
            seconds += t
        acc = sum(accs) / len(accs)
        if base is None:
            base = acc
        worst = max(worst, base - acc)
        print('| %s | %.2f%% | %+.2f | %s | %d | %.0f |'
              % (p, acc, acc - base, ' '.join('%.2f' % a for a in accs), overflows, seconds))
        sys.stdout.flush()
    ok = worst <= args.tolerance
    print('largest loss against FP32: %.2f points (tolerance %.2f): %s'
          % (worst, args.tolerance, 'met' if ok else 'NOT met'))
    if args.keep:
        print('logs in %s' % workdir)
    return 0 if ok else 1


if __name__ == '__main__':
    sys.exit(main())
