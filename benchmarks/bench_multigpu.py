#!/usr/bin/env python3
"""Data-parallel scaling: training throughput on 1 GPU against N GPUs.

For each benchmark net of $CAFFEPLUS_SHARED/bench (default VGG-16 b64 and
ResNet-50 b64: the batch in the file is the batch per GPU), trains with SGD
(momentum 0.9) through `caffeplus train`, once with `-gpu 0` and once with
`-gpu 0,1` (--gpus), and reads the throughput from the solver's own display
lines ("Iteration N (X iter/s, Ys/D iters)"): only the display windows that
start at or after --warmup count (cuDNN algorithm search, kernel builds and
memory pool growth happen in the first iterations), so

    images/s = (timed iterations / their seconds) x batch x GPUs

Prints a table, the ratio N-GPU / 1-GPU for each net and PASS/FAIL against
--target (default 1.8); exits 1 if a ratio is below it or a run fails.
--json and --md write the results (the Markdown as in
benchmarks/multigpu_results.md).

    python benchmarks/bench_multigpu.py [--nets vgg16_b64,resnet50_b64] [--gpus 0,1]
        [--iters 50] [--warmup 10] [--display 10] [--target 1.8]
        [--memory shared] [--extra "-math tf32"] [--json out.json] [--md out.md]
        [--keep DIR]

The defaults make four `caffeplus train` runs of 60 iterations each (most
of a run is start-up: CuPy kernels, cuDNN's timed algorithm search); the
results are written after each net, so a run stopped later keeps them.
"""
import argparse
import datetime
import json
import os
import re
import shlex
import shutil
import socket
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
GPU_NAME = re.compile(r'\] GPU (\d+): (.+)$', re.M)
PLAN = re.compile(r'\] (Gradient all-reduce: .+)$', re.M)
RANKS = re.compile(r'\] Data-parallel training on (\d+) ranks')
MEMORY_PLANS = ('stock', 'arena', 'shared', 'offload', 'auto')


def default_bench_dir():
    shared = os.environ.get('CAFFEPLUS_SHARED', os.path.join(ROOT, 'tests', 'data'))
    return os.path.join(shared, 'bench')


def batch_of(path):
    with open(path) as f:
        m = re.search(r'shape\s*\{\s*dim:\s*(\d+)', f.read())
    if not m:
        sys.exit('cannot find the batch size (first DummyData shape) in %s' % path)
    return int(m.group(1))


def train_env():
    env = dict(os.environ)
    env['PYTHONPATH'] = ROOT + os.pathsep + env.get('PYTHONPATH', '')
    env.setdefault('NCCL_NVLS_ENABLE', '0')     # never NVLink multicast (the ranks set it too)
    env['GLOG_minloglevel'] = '0'               # the rates are read from INFO lines
    return env


def train_flags(args):
    flags = ['--memory', args.memory] if args.memory else []
    return flags + shlex.split(args.extra)


def run_train(workdir, solver, gpus, flags, timeout, log_path):
    cmd = [sys.executable, '-m', 'caffeplus', 'train', '-solver', solver, '-gpu', gpus] + flags
    start = time.perf_counter()
    try:
        proc = subprocess.run(cmd, cwd=workdir, env=train_env(), capture_output=True, text=True,
                              timeout=timeout)
        code, text = proc.returncode, proc.stderr
    except subprocess.TimeoutExpired as exc:
        code = None
        text = exc.stderr.decode(errors='replace') if isinstance(exc.stderr, bytes) \
            else (exc.stderr or '')
        text += '\n(bench: stopped after %d s)\n' % timeout
    wall = time.perf_counter() - start
    with open(log_path, 'w') as f:
        f.write(text)
    return code, text, wall, cmd


def throughput(log_text, warmup):
    """(iter/s, iterations, seconds) over the display windows that start at
    or after iteration `warmup`; (None, 0, 0) when there are none."""
    iters = seconds = 0.0
    for m in DISPLAY.finditer(log_text):
        it, secs, n = int(m.group(1)), float(m.group(3)), int(m.group(4))
        if it == 0 or it - n < warmup:
            continue
        iters += n
        seconds += secs
    if not seconds:
        return None, 0, 0.0
    return iters / seconds, int(iters), seconds


def measure(name, label, spec, k, batch, workdir, solver, args):
    """One `caffeplus train` run; a result dict."""
    log_path = os.path.join(workdir, '%s_%dgpu.log' % (name, k))
    print('%s: training on %s (-gpu %s) ...' % (name, label, spec), flush=True)
    code, text, wall, cmd = run_train(workdir, solver, spec, train_flags(args), args.timeout,
                                      log_path)
    result = {'gpus': k, 'gpu_spec': spec, 'command': ' '.join(cmd[1:]), 'exit': code,
              'wall_s': round(wall, 1), 'log': log_path, 'iter_per_s': None,
              'images_per_s': None, 'timed_iterations': 0, 'timed_s': 0.0,
              'gpu_names': sorted(set(n.strip() for _, n in GPU_NAME.findall(text))),
              'gradient_plan': (PLAN.findall(text) or [None])[-1]}
    if code != 0:
        result['error'] = 'exit %s' % code
        print('  failed (%s); log: %s\n%s' % (result['error'], log_path, text[-3000:]))
        return result
    ranks = RANKS.findall(text)
    if k > 1 and (not ranks or int(ranks[-1]) != k):
        result['error'] = 'the log does not show %d data-parallel ranks' % k
        print('  %s; log: %s' % (result['error'], log_path))
        return result
    rate, counted, seconds = throughput(text, args.warmup)
    if rate is None:
        result['error'] = 'no display lines after the warm-up'
        print('  %s in %s' % (result['error'], log_path))
        return result
    result.update(iter_per_s=round(rate, 4), images_per_s=round(rate * batch * k, 1),
                  timed_iterations=counted, timed_s=round(seconds, 3))
    print('  %.3f iter/s over %d timed iterations (%.2f s): %.1f images/s (wall %.0f s)'
          % (rate, counted, seconds, rate * batch * k, wall), flush=True)
    return result


def bench_net(name, args, workdir, ngpu):
    net = os.path.join(args.bench_dir, name + '.prototxt')
    if not os.path.exists(net):
        sys.exit('benchmark net not found: %s' % net)
    batch = batch_of(net)
    solver = os.path.join(workdir, name + '_solver.prototxt')
    with open(solver, 'w') as f:
        f.write(SOLVER.format(net=os.path.abspath(net), display=args.display,
                              max_iter=args.warmup + args.iters))
    first = args.gpus.split(',')[0]
    runs = [measure(name, '1 GPU', first, 1, batch, workdir, solver, args),
            measure(name, '%d GPUs' % ngpu, args.gpus, ngpu, batch, workdir, solver, args)]
    one, many = runs[0]['images_per_s'], runs[1]['images_per_s']
    ratio = round(many / one, 3) if one and many else None
    ok = ratio is not None and ratio >= args.target
    print('  %s: ratio %s -> %s' % (name, '%.2fx' % ratio if ratio else '-',
                                    'pass' if ok else 'FAIL'), flush=True)
    return {'net': name, 'batch_per_gpu': batch, 'runs': runs, 'ratio': ratio, 'pass': ok}


def git_commit():
    try:
        return subprocess.run(['git', 'rev-parse', '--short', 'HEAD'], cwd=ROOT,
                              capture_output=True, text=True, timeout=10).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def _fmt(x, spec='%.1f'):
    return spec % x if x is not None else '-'


def print_table(report):
    ngpu = report['gpus']
    print()
    print('%-16s %10s %14s %14s %8s  %s' % ('net', 'batch/GPU', '1 GPU img/s',
                                            '%d GPUs img/s' % ngpu, 'ratio', 'result'))
    for r in report['nets']:
        one, many = r['runs'][0]['images_per_s'], r['runs'][1]['images_per_s']
        print('%-16s %10d %14s %14s %8s  %s' % (
            r['net'], r['batch_per_gpu'], _fmt(one), _fmt(many),
            _fmt(r['ratio'], '%.2fx'), 'pass' if r['pass'] else 'FAIL'))
    print('target >= %.2fx: %s' % (report['target'], 'PASS' if report['pass'] else 'FAIL'))


def markdown(report):
    ngpu = report['gpus']
    names = sorted({n for r in report['nets'] for run in r['runs'] for n in run['gpu_names']})
    lines = ['# Data-parallel training on %d GPUs' % ngpu, '',
             '`benchmarks/bench_multigpu.py` on %s (%s), %s, commit %s.' % (
                 report['host'], ', '.join(names) or 'GPUs', report['date'],
                 report['commit'] or '?'),
             '`caffeplus train -gpu %s` against `-gpu %s` on the bench nets (DummyData, '
             'prototxt batch per GPU, SGD), memory plan %s%s; images/s from rank 0\'s '
             'display lines over the timed iterations (%d after %d warm-up).' % (
                 report['gpu_spec'].split(',')[0], report['gpu_spec'],
                 report['memory'] or "caffeplus train's default",
                 ', flags `%s`' % report['extra'] if report['extra'] else '',
                 report['iters'], report['warmup']), '',
             '| net | batch per GPU | 1 GPU | %d GPUs | ratio (target >= %.1fx) |' % (
                 ngpu, report['target']),
             '|---|---|---|---|---|']
    for r in report['nets']:
        one, many = r['runs'][0], r['runs'][1]
        verdict = 'pass' if r['pass'] else 'not met'
        lines.append('| %s | %d | %s img/s | %s img/s | %s (%s; %d timed iterations) |' % (
            r['net'], r['batch_per_gpu'], _fmt(one['images_per_s']),
            _fmt(many['images_per_s']), _fmt(r['ratio'], '%.2fx'), verdict,
            many['timed_iterations']))
    lines.append('')
    for r in report['nets']:
        plan = r['runs'][1].get('gradient_plan')
        if plan:
            lines.append('- %s: %s' % (r['net'], plan))
        for run in r['runs']:
            if run.get('error'):
                lines.append('- %s on %d GPU(s) failed: %s (log %s)' % (
                    r['net'], run['gpus'], run['error'], run['log']))
    return '\n'.join(lines) + '\n'


def parse_args(argv):
    ap = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    ap.add_argument('--nets', default='vgg16_b64,resnet50_b64')
    ap.add_argument('--bench-dir', default=default_bench_dir())
    ap.add_argument('--gpus', default='0,1', help='the multi-GPU run (the 1-GPU run uses the '
                    'first of them)')
    ap.add_argument('--iters', type=int, default=50, help='timed iterations')
    ap.add_argument('--warmup', type=int, default=10, help='iterations left out first')
    ap.add_argument('--display', type=int, default=10)
    ap.add_argument('--target', type=float, default=1.8)
    ap.add_argument('--memory', default=None, choices=MEMORY_PLANS,
                    help="memory plan (caffeplus train --memory); default: caffeplus train's "
                    "own (shared)")
    ap.add_argument('--extra', default='', help='more `caffeplus train` flags, e.g. "-math tf32"')
    ap.add_argument('--timeout', type=int, default=300, help='seconds per run')
    ap.add_argument('--json', default=None, help='write the results here')
    ap.add_argument('--md', default=None, help='write a Markdown table here')
    ap.add_argument('--keep', default=None, help='keep solvers and logs in this folder')
    args = ap.parse_args(argv)
    if args.display < 1 or args.warmup % args.display or args.iters % args.display or \
            args.iters < args.display:
        ap.error('--warmup and --iters must be multiples of --display (and --iters >= it)')
    return args


def main(argv=None):
    args = parse_args(argv)
    ngpu = len(args.gpus.split(','))
    workdir = args.keep or tempfile.mkdtemp(prefix='caffeplus-bench-multigpu-')
    os.makedirs(workdir, exist_ok=True)
    report = {'format': 'caffeplus-bench-multigpu', 'version': 2,
              'date': datetime.date.today().isoformat(), 'host': socket.gethostname(),
              'commit': git_commit(), 'gpus': ngpu, 'gpu_spec': args.gpus,
              'iters': args.iters, 'warmup': args.warmup, 'display': args.display,
              'target': args.target, 'memory': args.memory, 'extra': args.extra, 'nets': []}
    start = time.perf_counter()
    try:
        for name in [n.strip() for n in args.nets.split(',') if n.strip()]:
            report['nets'].append(bench_net(name, args, workdir, ngpu))
            save(report, args, start)       # after each net: a stopped run keeps what it has
    finally:
        if not args.keep:
            shutil.rmtree(workdir, ignore_errors=True)
    save(report, args, start)
    print_table(report)
    print('(%.0f s in all)' % report['wall_s'])
    return 0 if report['pass'] else 1


def save(report, args, start):
    report['wall_s'] = round(time.perf_counter() - start, 1)
    report['pass'] = bool(report['nets']) and all(r['pass'] for r in report['nets'])
    if args.json:
        with open(args.json, 'w') as f:
            json.dump(report, f, indent=1, sort_keys=True)
            f.write('\n')
    if args.md:
        with open(args.md, 'w') as f:
            f.write(markdown(report))


if __name__ == '__main__':
    sys.exit(main())
