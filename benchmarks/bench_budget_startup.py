"""Does a memory budget hold for the whole `caffeplus train` process, start-up included?

    python3 benchmarks/bench_budget_startup.py [--model NET.prototxt] [--budget 12G]
        [--plans auto,shared] [--iterations 5] [--interval-ms 100] [--gpu 0] [--json OUT]

For each plan, `caffeplus train -gpu N --memory PLAN [--memory_budget B]` runs
the net (a DummyData training prototxt; default: the bench's VGG-16 at batch
256) for a few iterations while nvidia-smi samples the GPU's used memory
every --interval-ms. Start-up is everything before the solver's first
"Iteration N (...), loss" line (construction, plan auto's algorithm timing
and planning, the arena, the first iteration's searches); training is the
rest. The figures are the process's: the device's used memory less what was
used before it started (the GPU is assumed otherwise idle). `--memory_budget`
is passed to the plans that take one (auto).

Prints one line per plan and, with --json, writes the figures.
"""
import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import threading

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from caffeplus.memory.budget import parse_bytes  # noqa: E402
from caffeplus.memory.sampler import MiB, NvidiaSmiSampler, read_used_mib  # noqa: E402

SHARED = os.environ.get('CAFFEPLUS_SHARED', os.path.join(os.path.dirname(ROOT), 'shared'))
# The bench set: ../shared's where it is, else the copy the tests keep.
DEFAULT_MODEL = os.path.join(SHARED, 'bench', 'vgg16_b256.prototxt')
if not os.path.exists(DEFAULT_MODEL):
    DEFAULT_MODEL = os.path.join(ROOT, 'tests', 'data', 'bench', 'vgg16_b256.prototxt')
FIRST_ITERATION = re.compile(r'Iteration \d+ \(.*\), loss')


def write_solver(directory, model, iterations):
    path = os.path.join(directory, 'solver.prototxt')
    with open(path, 'w') as f:
        f.write('net: "%s"\nbase_lr: 0.001\nmomentum: 0.9\nlr_policy: "fixed"\n'
                'display: 1\nmax_iter: %d\nsnapshot_after_train: false\n'
                'solver_mode: GPU\n' % (os.path.abspath(model), iterations))
    return path


def watch_training(model, plan, budget=None, iterations=5, interval_ms=100, gpu=0,
                   timeout_s=540):
    """Run `caffeplus train` under nvidia-smi's sampling; returns the
    figures (bytes over the idle baseline, by phase) and the run's exit code."""
    baseline = read_used_mib(gpu)
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, '-m', 'caffeplus', 'train', '-solver',
               write_solver(tmp, model, iterations), '-gpu', str(gpu), '--memory', plan]
        if budget is not None:
            cmd += ['--memory_budget', str(int(budget))]
        sampler = NvidiaSmiSampler(gpu, interval_ms)
        sampler.start()
        sampler.wait_for_samples(1)
        log = []
        proc = subprocess.Popen(cmd, cwd=tmp, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True)

        def follow():
            for line in proc.stdout:
                log.append(line.rstrip('\n'))
                if sampler.phase == 'startup' and FIRST_ITERATION.search(line):
                    sampler.set_phase('training')
        reader = threading.Thread(target=follow, daemon=True)
        reader.start()
        try:
            code = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            code = proc.wait()
        reader.join()
        sampler.stop()
    startup, training = sampler.peak('startup'), sampler.peak('training')
    return {
        'plan': plan, 'budget_bytes': budget, 'model': os.path.basename(model),
        'iterations': iterations, 'interval_ms': interval_ms, 'exit_code': code,
        'baseline_bytes': baseline, 'samples': len(sampler.samples),
        'startup_peak_bytes': max(startup - baseline, 0),
        'training_peak_bytes': max(training - baseline, 0),
        'process_peak_bytes': max(max(startup, training) - baseline, 0),
        'reached_training': training > 0,
        'log_tail': log[-15:],
    }


def describe(r):
    budget = r['budget_bytes']
    verdict = ''
    if budget:
        verdict = '  (budget %d MiB: %s)' % (budget // MiB, 'within' if
                                             r['process_peak_bytes'] <= budget else 'OVER')
    return ('%-7s whole process %6d MiB: start-up %6d MiB, training %6d MiB; exit %s%s'
            % (r['plan'], r['process_peak_bytes'] // MiB, r['startup_peak_bytes'] // MiB,
               r['training_peak_bytes'] // MiB, r['exit_code'], verdict))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument('--model', default=DEFAULT_MODEL)
    p.add_argument('--budget', default='12G')
    p.add_argument('--plans', default='auto')
    p.add_argument('--iterations', type=int, default=5)
    p.add_argument('--interval-ms', type=int, default=100)
    p.add_argument('--gpu', type=int, default=0)
    p.add_argument('--json', default=None)
    args = p.parse_args(argv)
    budget = parse_bytes(args.budget)
    results = []
    for plan in [s.strip() for s in args.plans.split(',') if s.strip()]:
        r = watch_training(args.model, plan, budget if plan == 'auto' else None,
                           args.iterations, args.interval_ms, args.gpu)
        print(describe(r), flush=True)
        if r['exit_code'] != 0:
            print('\n'.join(r['log_tail']), flush=True)
        results.append(r)
    if args.json:
        with open(args.json, 'w') as f:
            json.dump({'results': results}, f, indent=1)
            f.write('\n')
    return 0 if all(r['exit_code'] == 0 for r in results) else 1


if __name__ == '__main__':
    sys.exit(main())
