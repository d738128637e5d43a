#!/usr/bin/env python3
"""Data-parallel scaling: training throughput on 1 GPU against N GPUs.

For each benchmark net of $CAFFEPLUS_SHARED/bench (default VGG-16 b64 and
ResNet-50 b64: the batch in the file is the batch per GPU), trains with SGD
(momentum 0.9) through `caffeplus train`, once with `-gpu 0` and once with
`-gpu 0,1` (--gpus), and reads the throughput from the solver's own display
lines ("Iteration N (X iter/s, ...)"), leaving out the first --warmup
iterations (cuDNN algorithm search, memory pool growth):

    images/s = iter/s x batch x GPUs

Prints a table and the ratio N-GPU / 1-GPU for each net; exits 1 if a ratio
is below --target (default 1.8) or a run fails.

    python tools/bench_multigpu.py [--nets vgg16_b64,resnet50_b64] [--gpus 0,1]
        [--iters 60] [--warmup 20] [--display 10] [--target 1.8]
        [--extra "-math tf32"] [--keep DIR]
"""
import argparse
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

SOLVER = '''net: "{net}"
base_lr: 0.0001
momentum: 0.9
weight_decay: 0.0005
lr_policy: "fixed"
display: {display}
average_loss: {display}
max_iter: {max_iter}
snapshot: 0
snapshot_after_train: false
random_seed: 1701
solver_mode: GPU
'''

DISPLAY = re.compile(r'\] Iteration (\d+) \(([\d.eE+-]+) iter/s, ([\d.eE+-]+)s/(\d+) iters\)')


def default_bench_dir():
    shared = os.environ.get('CAFFEPLUS_SHARED', os.path.join(os.path.dirname(ROOT), 'shared'))
    return os.path.join(shared, 'bench')


def batch_of(path):
    with open(path) as f:
        m = re.search(r'shape\s*\{\s*dim:\s*(\d+)', f.read())
    if not m:
        sys.exit('cannot find the batch size (first DummyData shape) in %s' % path)
    return int(m.group(1))


def run_train(workdir, solver, gpus, extra, timeout, log_path):
    cmd = [sys.executable, '-m', 'caffeplus', 'train', '-solver', solver, '-gpu', gpus] + extra
    env = dict(os.environ)
    env['PYTHONPATH'] = ROOT + os.pathsep + env.get('PYTHONPATH', '')
    start = time.perf_counter()
    proc = subprocess.run(cmd, cwd=workdir, env=env, capture_output=True, text=True,
                          timeout=timeout)
    wall = time.perf_counter() - start
    with open(log_path, 'w') as f:
        f.write(proc.stderr)
    return proc, wall


def throughput(log_text, warmup):
    """(iter/s over the display windows that start at or after `warmup`, iterations counted)."""
    iters = seconds = 0.0
    for m in DISPLAY.finditer(log_text):
        it, secs, n = int(m.group(1)), float(m.group(3)), int(m.group(4))
        if it - n < warmup or it == 0:
            continue
        iters += n
        seconds += secs
    if not seconds:
        return None, 0
    return iters / seconds, int(iters)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    ap.add_argument('--nets', default='vgg16_b64,resnet50_b64')
    ap.add_argument('--bench-dir', default=default_bench_dir())
    ap.add_argument('--gpus', default='0,1', help='the multi-GPU run (the 1-GPU run uses the '
                    'first of them)')
    ap.add_argument('--iters', type=int, default=60, help='timed iterations')
    ap.add_argument('--warmup', type=int, default=20, help='iterations left out first')
    ap.add_argument('--display', type=int, default=10)
    ap.add_argument('--target', type=float, default=1.8)
    ap.add_argument('--extra', default='', help='more `caffeplus train` flags, e.g. "-math tf32"')
    ap.add_argument('--timeout', type=int, default=1800, help='seconds per run')
    ap.add_argument('--keep', default=None, help='keep solvers and logs in this folder')
    args = ap.parse_args(argv)

    gpus = args.gpus
    ngpu = len(gpus.split(','))
    first = gpus.split(',')[0]
    extra = shlex.split(args.extra)
    if args.warmup % args.display or args.iters % args.display:
        sys.exit('--warmup and --iters must be multiples of --display')
    workdir = args.keep or tempfile.mkdtemp(prefix='caffeplus-bench-multigpu-')
    os.makedirs(workdir, exist_ok=True)
    rows, ok = [], True
    try:
        for name in [n.strip() for n in args.nets.split(',') if n.strip()]:
            net = os.path.join(args.bench_dir, name + '.prototxt')
            if not os.path.exists(net):
                sys.exit('benchmark net not found: %s' % net)
            batch = batch_of(net)
            solver = os.path.join(workdir, name + '_solver.prototxt')
            with open(solver, 'w') as f:
                f.write(SOLVER.format(net=os.path.abspath(net), display=args.display,
                                      max_iter=args.warmup + args.iters))
            result = {}
            for label, spec, k in (('1 GPU', first, 1), ('%d GPUs' % ngpu, gpus, ngpu)):
                log_path = os.path.join(workdir, '%s_%dgpu.log' % (name, k))
                print('%s: training on %s (-gpu %s) ...' % (name, label, spec), flush=True)
                proc, wall = run_train(workdir, solver, spec, extra, args.timeout, log_path)
                if proc.returncode != 0:
                    print('  failed (exit %d); log: %s\n%s' % (proc.returncode, log_path,
                                                              proc.stderr[-3000:]))
                    ok = False
                    result[k] = None
                    continue
                rate, counted = throughput(proc.stderr, args.warmup)
                if rate is None:
                    print('  no display lines after the warm-up in %s' % log_path)
                    ok = False
                    result[k] = None
                    continue
                images = rate * batch * k
                result[k] = images
                print('  %.3f iter/s over %d iterations: %.1f images/s (wall %.0f s)'
                      % (rate, counted, images, wall), flush=True)
            one, many = result.get(1), result.get(ngpu)
            ratio = many / one if one and many else None
            rows.append((name, batch, one, many, ratio))
            if ratio is None or ratio < args.target:
                ok = False
    finally:
        if not args.keep:
            shutil.rmtree(workdir, ignore_errors=True)
    print()
    print('%-16s %10s %14s %14s %8s' % ('net', 'batch/GPU', '1 GPU img/s',
                                        '%d GPUs img/s' % ngpu, 'ratio'))
    for name, batch, one, many, ratio in rows:
        print('%-16s %10d %14s %14s %8s' % (
            name, batch, '%.1f' % one if one else '-', '%.1f' % many if many else '-',
            '%.2fx' % ratio if ratio else '-'))
    print('target >= %.2fx: %s' % (args.target, 'PASS' if ok else 'FAIL'))
    return 0 if ok else 1


if __name__ == '__main__':
    sys.exit(main())
