#!/usr/bin/env python
"""Soak test: a long `caffeplus train` of LeNet must not grow or leak.

    python dev/soak.py                       # CPU: 20,000 iterations, snapshot every 1,000
    python dev/soak.py --iterations 1000 --snapshot 100     # a short run
    python dev/soak.py --gpu 0               # GPU: 2,000 iterations, device memory too

Trains the reference LeNet (the stock-Caffe reference set's
training/lenet_train_test.prototxt over its synthetic MNIST LMDBs, copied
to a scratch folder) with BVLC's lenet_solver settings through the real
command line, and samples the training process each time it snapshots:

  * resident memory (VmRSS) and its peak (VmHWM), from /proc/<pid>/status;
  * open file descriptors (/proc/<pid>/fd) and threads;
  * with --gpu, the device memory the process holds (nvidia-smi).

Then it says whether memory stayed flat (growth from the first snapshot to
the last below --tolerance-mb, default 16 MB, and below 5%), whether the
descriptor and thread counts stayed constant, and whether every snapshot
loads. The exit status is 1 if not. The first snapshot is the baseline
(the allocator and the prefetch queues settle during the first iterations).
"""
import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)
from dev import kill_test as kt  # noqa: E402

SOLVER = '''net: "training/lenet_train_test.prototxt"
test_iter: 2
test_interval: {test_interval}
base_lr: 0.01
momentum: 0.9
weight_decay: 0.0005
lr_policy: "inv"
gamma: 0.0001
power: 0.75
display: {display}
max_iter: {max_iter}
snapshot: {snapshot}
snapshot_prefix: "snap/lenet"
solver_mode: {mode}
random_seed: 1701
'''


def proc_status(pid, repeat=5, pause=0.02):
    """{'rss_mb', 'hwm_mb', 'threads', 'fds'} of a live process. Descriptors
    and threads are the least of a few looks, so a file that a snapshot has
    open for a moment does not count as a leak."""
    looks = []
    for i in range(repeat):
        if i:
            time.sleep(pause)
        try:
            look = _proc_status_once(pid)
        except OSError:
            break
        if 'rss_mb' in look and 'threads' in look:   # a zombie has no VmRSS
            looks.append(look)
    if not looks:
        raise OSError('process %d has ended' % pid)
    out = dict(looks[0])
    out['fds'] = min(x['fds'] for x in looks)
    out['threads'] = min(x['threads'] for x in looks)
    return out


def _proc_status_once(pid):
    out = {}
    with open('/proc/%d/status' % pid) as f:
        for line in f:
            key, _, value = line.partition(':')
            if key == 'VmRSS':
                out['rss_mb'] = int(value.split()[0]) / 1024.0
            elif key == 'VmHWM':
                out['hwm_mb'] = int(value.split()[0]) / 1024.0
            elif key == 'Threads':
                out['threads'] = int(value)
    out['fds'] = len(os.listdir('/proc/%d/fd' % pid))
    return out


def gpu_memory_mb(pid):
    """Device memory the process holds (MiB, summed over GPUs), or None."""
    try:
        text = subprocess.run(['nvidia-smi', '--query-compute-apps=pid,used_memory',
                               '--format=csv,noheader,nounits'], capture_output=True,
                              text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    total = None
    for line in text.splitlines():
        parts = [p.strip() for p in line.split(',')]
        if len(parts) == 2 and parts[0] == str(pid):
            try:
                total = (total or 0) + float(parts[1])
            except ValueError:
                pass
    return total


def make_workdir(path):
    os.makedirs(os.path.join(path, 'training', 'data'), exist_ok=True)
    for name in ('mnist_synth_train_lmdb', 'mnist_synth_test_lmdb'):
        dst = os.path.join(path, 'training', 'data', name)
        if not os.path.exists(dst):
            shutil.copytree(os.path.join(kt.TRAINING_DATA, name), dst)
    shutil.copy(os.path.join(kt.REFERENCE, 'training', 'lenet_train_test.prototxt'),
                os.path.join(path, 'training', 'lenet_train_test.prototxt'))
    os.makedirs(os.path.join(path, 'snap'), exist_ok=True)
    return path


def soak(workdir, iterations, snapshot, gpu=None, display=100, test_interval=500,
         tolerance_mb=16.0):
    mode = 'GPU' if gpu is not None else 'CPU'
    with open(os.path.join(workdir, 'solver.prototxt'), 'w') as f:
        # A few iterations past the last snapshot, so the last sample is
        # taken while training, not while the process winds down.
        f.write(SOLVER.format(max_iter=iterations + 20, snapshot=snapshot, mode=mode,
                              display=display, test_interval=test_interval) +
                'snapshot_after_train: false\n')
    args = ['-solver', 'solver.prototxt'] + (['-gpu', str(gpu)] if gpu is not None else [])
    start = time.time()
    t = kt.Train(workdir, *args)
    samples = []
    try:
        t.wait_for(r'Starting Optimization', timeout=300)
        first = proc_status(t.proc.pid)
        first.update(iteration=0, seconds=time.time() - start,
                     gpu_mb=gpu_memory_mb(t.proc.pid) if gpu is not None else None)
        samples.append(first)
        print('%9s %9s %9s %9s %6s %8s %8s' % ('iteration', 'seconds', 'rss MB', 'peak MB',
                                              'fds', 'threads', 'gpu MB'), flush=True)
        _print(first)
        n_snapshots = iterations // snapshot if snapshot else 0
        for _ in range(n_snapshots):
            line = t.wait_for(r'Snapshotting solver state to .*_iter_(\d+)\.solverstate',
                              timeout=3600)
            it = int(re.search(r'_iter_(\d+)\.solverstate', line).group(1))
            try:
                s = proc_status(t.proc.pid)
            except OSError:
                break
            s.update(iteration=it, seconds=time.time() - start,
                     gpu_mb=gpu_memory_mb(t.proc.pid) if gpu is not None else None)
            samples.append(s)
            _print(s)
        rc = t.wait(timeout=3600)
    finally:
        t.kill()
    elapsed = time.time() - start
    losses = [float(m.group(1)) for m in
              (re.search(r'\] Iteration \d+ \(.*loss = ([-+\d.einfa]+)', l) for l in t.lines) if m]
    return rc, samples, elapsed, losses, t


def _print(s):
    gpu = '%8.0f' % s['gpu_mb'] if s.get('gpu_mb') is not None else '%8s' % '-'
    print('%9d %9.1f %9.1f %9.1f %6d %8d %s' % (s['iteration'], s['seconds'], s['rss_mb'],
                                               s['hwm_mb'], s['fds'], s['threads'], gpu),
          flush=True)


def verdict(samples, tolerance_mb):
    """Problems (strings) with the samples: growth, leaks."""
    problems = []
    steady = [s for s in samples if s['iteration'] > 0]
    if len(steady) < 2:
        return ['too few snapshots to judge (%d); run longer or snapshot more often'
                % len(steady)]
    base, end = steady[0], steady[-1]
    growth = end['rss_mb'] - base['rss_mb']
    if growth > tolerance_mb and growth > 0.05 * base['rss_mb']:
        problems.append('resident memory grew by %.1f MB (%.1f -> %.1f MB) between iterations '
                        '%d and %d' % (growth, base['rss_mb'], end['rss_mb'], base['iteration'],
                                       end['iteration']))
    fds = sorted(set(s['fds'] for s in steady))
    if len(fds) > 1:
        problems.append('open file descriptors changed: %s' % ', '.join(map(str, fds)))
    threads = sorted(set(s['threads'] for s in steady))
    if len(threads) > 1:
        problems.append('thread count changed: %s' % ', '.join(map(str, threads)))
    gpus = [s['gpu_mb'] for s in steady if s.get('gpu_mb') is not None]
    if len(gpus) >= 2 and gpus[-1] - gpus[0] > tolerance_mb:
        problems.append('device memory grew by %.0f MB (%.0f -> %.0f MB)'
                        % (gpus[-1] - gpus[0], gpus[0], gpus[-1]))
    return problems


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    parser.add_argument('--iterations', type=int, default=None,
                        help='default 20000 on the CPU, 2000 with --gpu')
    parser.add_argument('--snapshot', type=int, default=None,
                        help='snapshot interval (default 1000, or iterations/10 if fewer)')
    parser.add_argument('--gpu', type=int, default=None, help='train on this GPU')
    parser.add_argument('--tolerance-mb', type=float, default=16.0,
                        help='allowed growth of resident (and device) memory')
    parser.add_argument('--keep', default=None, help='work in this folder and keep it')
    args = parser.parse_args(argv)
    from caffeplus import log
    log.set_level(3)   # this process only checks files; the run logs itself
    iterations = args.iterations or (2000 if args.gpu is not None else 20000)
    snapshot = args.snapshot or min(1000, max(1, iterations // 10))
    workdir = make_workdir(args.keep or tempfile.mkdtemp(prefix='caffeplus-soak-'))
    print('soak: LeNet, %d iterations on the %s, snapshot every %d, in %s'
          % (iterations, 'GPU %d' % args.gpu if args.gpu is not None else 'CPU', snapshot,
             workdir), flush=True)
    try:
        rc, samples, elapsed, losses, t = soak(workdir, iterations, snapshot, args.gpu,
                                               tolerance_mb=args.tolerance_mb)
        problems = []
        if rc != 0:
            problems.append('caffeplus train exited with status %d:\n%s' % (rc, t.tail()))
        problems += verdict(samples, args.tolerance_mb)
        problems += kt.check_snapshots(os.path.join(workdir, 'snap'),
                                       os.path.join(workdir, 'training',
                                                    'lenet_train_test.prototxt'), workdir)
    finally:
        if not args.keep:
            shutil.rmtree(workdir, ignore_errors=True)
    steady = [s for s in samples if s['iteration'] > 0]
    print('\nsoak: %d iterations in %.0f s (%.1f ms/iteration)'
          % (iterations, elapsed, 1000.0 * elapsed / max(iterations, 1)))
    if samples:
        print('  resident memory: %.1f MB at start, %.1f MB at the first snapshot, %.1f MB at '
              'the end (peak %.1f MB)' % (samples[0]['rss_mb'],
                                         steady[0]['rss_mb'] if steady else float('nan'),
                                         samples[-1]['rss_mb'], samples[-1]['hwm_mb']))
        print('  open file descriptors: %s; threads: %s'
              % (' -> '.join(str(s['fds']) for s in (samples[0], samples[-1])),
                 ' -> '.join(str(s['threads']) for s in (samples[0], samples[-1]))))
        gpus = [s['gpu_mb'] for s in samples if s.get('gpu_mb') is not None]
        if gpus:
            print('  device memory: %.0f MB -> %.0f MB' % (gpus[0], gpus[-1]))
    if losses:
        print('  loss: %.4g at the first display, %.4g at the last' % (losses[0], losses[-1]))
    for p in problems:
        print('PROBLEM: ' + p)
    print('soak: %s' % ('memory flat, no leaks' if not problems else 'FAILED'))
    return 1 if problems else 0


if __name__ == '__main__':
    sys.exit(main())
