#!/usr/bin/env python3
"""caffeplus's `stock` plan against stock BVLC Caffe 1.0's peak device memory.

Run on the GPU machine from the repository root:

    PYTHONPATH=$PWD python3 benchmarks/bench_stock_memory.py --bench-dir .gpu_carry/bench \\
        --json stock_memory.json --md stock_memory.md

For each bench net (all of bench/README.md's stock Caffe table by default,
or the names / prototxt paths given) it runs, in a subprocess,

    python3 -m caffeplus time -model NET -gpu 0 -iterations 5 --memory stock

with NVIDIA_TF32_OVERRIDE=0, as stock Caffe's `caffe time` was run, while
nvidia-smi samples the device's memory.used every 50 ms (the measurement
bench/README.md describes: the whole process, no solver history). It prints
the peak, stock Caffe's figure from the README's table, their ratio and
whether it is within 5%, and writes the same as JSON (--json) and a
Markdown table (--md). A net that fails or runs past --timeout is reported
and the next one runs. Exit status: 0 when every net ran and is within the
tolerance, 1 otherwise.

memory.used is device-wide: run it on an otherwise idle GPU. The idle
reading before each net is shown as `baseline`; the comparison uses the raw
peak, as stock Caffe's figure is. --smi-index is the nvidia-smi index of the
GPU -gpu names (they differ when CUDA_VISIBLE_DEVICES reorders devices).
"""
import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MARKER = 'Stock BVLC Caffe 1.0'      # the README section with stock Caffe's peaks
PEAK_COLUMN = 'peak device memory'


# -- stock Caffe's figures --------------------------------------------------------
def net_key(name):
    """'ResNet-50 b32', 'resnet50_b32' and 'resnet50_b32.prototxt' -> 'resnet50b32'."""
    name = os.path.basename(name)
    if name.endswith('.prototxt'):
        name = name[:-len('.prototxt')]
    return re.sub(r'[^a-z0-9]', '', name.lower())


def _mib(cell):
    m = re.search(r'([\d,]+(?:\.\d+)?)\s*MiB', cell)
    return float(m.group(1).replace(',', '')) if m else None


def parse_readme(text):
    """[(label, MiB)] of the stock Caffe table: the first Markdown table after
    the heading naming stock BVLC Caffe 1.0, its 'peak device memory' column."""
    lines = text.splitlines()
    start = next((i for i, l in enumerate(lines) if l.startswith('#') and MARKER in l), None)
    if start is None:
        raise ValueError('no section "%s" in the README' % MARKER)
    rows, column = [], None
    for line in lines[start + 1:]:
        if line.startswith('#'):
            break
        if not line.strip().startswith('|'):
            if rows or column is not None:
                if not line.strip():
                    continue
                break
            continue
        cells = [c.strip() for c in line.strip().strip('|').split('|')]
        if column is None:
            column = next((j for j, c in enumerate(cells) if PEAK_COLUMN in c.lower()), None)
            if column is None:
                raise ValueError('the stock Caffe table has no "%s" column' % PEAK_COLUMN)
            continue
        if set(''.join(cells)) <= set('-: '):
            continue                    # the |---|---| line
        value = _mib(cells[column]) if column < len(cells) else None
        if value is not None:
            rows.append((cells[0], value))
    if not rows:
        raise ValueError('the stock Caffe table has no rows')
    return rows


# -- sampling nvidia-smi --------------------------------------------------------------
def query_used(index):
    """memory.used of GPU `index` in MiB (one nvidia-smi call), None if it fails."""
    try:
        out = subprocess.run(['nvidia-smi', '--query-gpu=memory.used',
                              '--format=csv,noheader,nounits', '-i', str(index)],
                             capture_output=True, text=True, timeout=10)
        return float(out.stdout.strip().splitlines()[0])
    except Exception:
        return None


def query_name(index):
    try:
        out = subprocess.run(['nvidia-smi', '--query-gpu=name,memory.total',
                              '--format=csv,noheader', '-i', str(index)],
                             capture_output=True, text=True, timeout=10)
        return out.stdout.strip()
    except Exception:
        return None


class Sampler:
    """memory.used of one GPU every `interval_ms`, in a thread: nvidia-smi's
    own loop (-lms, one process) when it streams, else one call per sample."""

    def __init__(self, index, interval_ms=50):
        self.index, self.interval_ms = index, int(interval_ms)
        self.peak = None
        self.samples = 0
        self.trace = []             # (seconds since the epoch, MiB): where the peak falls
        self.mode = None
        self._stop = threading.Event()
        self._proc = None
        self._thread = None

    def _record(self, value):
        if value is None:
            return
        self.samples += 1
        self.trace.append((time.time(), value))
        if self.peak is None or value > self.peak:
            self.peak = value

    def start(self):
        try:
            self._proc = subprocess.Popen(
                ['nvidia-smi', '--query-gpu=memory.used', '--format=csv,noheader,nounits',
                 '-i', str(self.index), '-lms', str(self.interval_ms)],
                stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, bufsize=1)
            self.mode = 'stream'
            self._thread = threading.Thread(target=self._read_stream, daemon=True)
        except OSError:
            self._proc = None
            self.mode = 'poll'
            self._thread = threading.Thread(target=self._poll, daemon=True)
        self._thread.start()
        if self.mode == 'stream':
            # nvidia-smi that does not stream (or buffers): poll instead.
            deadline = time.time() + 3
            while self.samples == 0 and time.time() < deadline and self._proc.poll() is None:
                time.sleep(0.02)
            if self.samples == 0:
                self._end_stream()
                self.mode = 'poll'
                self._thread = threading.Thread(target=self._poll, daemon=True)
                self._thread.start()
        return self

    def _read_stream(self):
        for line in self._proc.stdout:
            try:
                self._record(float(line.strip()))
            except ValueError:
                pass
            if self._stop.is_set():
                break

    def _poll(self):
        while not self._stop.is_set():
            t0 = time.time()
            self._record(query_used(self.index))
            self._stop.wait(max(0.0, self.interval_ms / 1000.0 - (time.time() - t0)))

    def _end_stream(self):
        if self._proc is not None and self._proc.poll() is None:
            self._proc.send_signal(signal.SIGINT)   # nvidia-smi flushes and ends on ^C
            try:
                self._proc.wait(timeout=3)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()

    def stop(self):
        if self.mode == 'stream':
            time.sleep(self.interval_ms / 1000.0 * 2)  # the last samples in flight
        self._stop.set()
        self._end_stream()
        if self._thread is not None:
            self._thread.join(timeout=5)
        return self.peak


def wait_for_idle(index, baseline, settle_s, slack_mib=64):
    """Wait (at most settle_s) until memory.used is back near `baseline`."""
    deadline = time.time() + settle_s
    used = query_used(index)
    while used is not None and baseline is not None and used > baseline + slack_mib and \
            time.time() < deadline:
        time.sleep(0.5)
        used = query_used(index)
    return used


# -- one net ----------------------------------------------------------------------------
def fwd_bwd_ms(log_text):
    m = re.findall(r'Average Forward-Backward: ([\d.]+) ms', log_text)
    return float(m[-1]) if m else None


def tail(text, lines=15):
    return '\n'.join(text.rstrip().splitlines()[-lines:])


def run_net(prototxt, args, log_path):
    """Run `caffeplus time` on one net while sampling; a result dict."""
    cmd = [args.python, '-m', 'caffeplus', 'time', '-model', prototxt, '-gpu', str(args.gpu),
           '-iterations', str(args.iterations)]
    if args.plan:
        cmd += ['--memory', args.plan]
    cmd += args.extra_arg
    env = dict(os.environ)
    env.setdefault('NVIDIA_TF32_OVERRIDE', '0')         # as stock Caffe was measured
    env['PYTHONPATH'] = os.pathsep.join([ROOT] + [p for p in env.get('PYTHONPATH', '').split(
        os.pathsep) if p])
    baseline = query_used(args.smi_index)
    sampler = Sampler(args.smi_index, args.interval_ms).start()
    t0 = time.time()
    timed_out, rc, error = False, None, None
    lines = []                      # (arrival time, line) of the run's output
    with open(log_path, 'w') as log:
        try:
            proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                    env=env, cwd=ROOT, start_new_session=True, text=True,
                                    errors='replace', bufsize=1)
            reader = threading.Thread(target=_copy_lines, args=(proc.stdout, log, lines),
                                      daemon=True)
            reader.start()
            try:
                rc = proc.wait(timeout=args.timeout)
            except subprocess.TimeoutExpired:
                timed_out = True
                os.killpg(proc.pid, signal.SIGKILL)
                rc = proc.wait()
            reader.join(timeout=10)
        except OSError as exc:
            error = 'could not start: %s' % exc
    seconds = time.time() - t0
    peak = sampler.stop()
    with open(log_path, errors='replace') as f:
        text = f.read()
    if error is None and timed_out:
        error = 'timed out after %d s' % args.timeout
    elif error is None and rc != 0:
        error = 'exit status %s: %s' % (rc, tail(text, 3).replace('\n', ' | '))
    result = {'prototxt': prototxt, 'command': ' '.join(cmd), 'rc': rc, 'timed_out': timed_out,
              'seconds': round(seconds, 1), 'peak_mib': peak, 'baseline_mib': baseline,
              'samples': sampler.samples, 'sampling': sampler.mode,
              'fwd_bwd_ms': fwd_bwd_ms(text), 'error': error, 'log': log_path}
    result.update(peak_phases(sampler.trace, lines))
    return result


def _copy_lines(stream, log, lines):
    for line in stream:
        lines.append((time.time(), line.rstrip('\n')))
        log.write(line)
        log.flush()


BENCHMARK_BEGINS = '*** Benchmark begins ***'


def peak_phases(trace, lines):
    """Where the peak falls: {'setup_peak_mib': the peak before the timed
    iterations (net construction, the algorithm search, the untimed forward
    and backward), 'timed_peak_mib': the peak during them, 'peak_after':
    the last output line before the overall peak's sample}. Samples are
    placed by their arrival time beside the lines'; a sample can lag the
    memory it reports by up to one interval."""
    begins = next((t for t, line in lines if BENCHMARK_BEGINS in line), None)
    setup = [v for t, v in trace if begins is None or t < begins]
    timed = [v for t, v in trace if begins is not None and t >= begins]
    out = {'setup_peak_mib': max(setup) if setup else None,
           'timed_peak_mib': max(timed) if timed else None, 'peak_after': None}
    if trace:
        t_peak = max(trace, key=lambda tv: tv[1])[0]
        before = [line for t, line in lines if t <= t_peak]
        out['peak_after'] = before[-1][:200] if before else None
    return out


def judge(result, caffe_mib, tolerance):
    result['caffe_mib'] = caffe_mib
    peak = result['peak_mib']
    if peak is None or caffe_mib is None:
        result['ratio'] = None
        result['within'] = False
    else:
        result['ratio'] = round(peak / caffe_mib, 4)
        result['within'] = abs(peak / caffe_mib - 1) <= tolerance
    result['pass'] = bool(result['within'] and result['rc'] == 0 and not result['timed_out'])
    return result


# -- output ---------------------------------------------------------------------------------
def _fmt(v, spec='{:,.0f}'):
    return '-' if v is None else spec.format(v)


def markdown(results, plan, tolerance, device, iterations=5):
    out = ['# caffeplus `%s` plan against stock BVLC Caffe 1.0: peak device memory' % plan, '',
           'nvidia-smi memory.used, sampled during `caffeplus time -gpu 0 -iterations %d '
           '--memory %s`%s; pass: within %g%% of stock Caffe\'s peak (bench/README.md).'
           % (iterations, plan, ' on %s' % device if device else '', tolerance * 100), '',
           '| net | caffeplus `%s` | stock Caffe | ratio | within %g%% | baseline | '
           'forward-backward | before / during the timed iterations | status |'
           % (plan, tolerance * 100),
           '|---|---|---|---|---|---|---|---|---|']
    for r in results:
        status = 'ok' if not r.get('error') else r['error'].replace('|', '/')[:120]
        out.append('| %s | %s MiB | %s MiB | %s | %s | %s MiB | %s ms | %s / %s MiB | %s |' % (
            r['net'], _fmt(r['peak_mib']), _fmt(r['caffe_mib']),
            _fmt(r['ratio'], '{:.3f}'), 'yes' if r['pass'] else 'no',
            _fmt(r['baseline_mib']), _fmt(r['fwd_bwd_ms'], '{:.1f}'),
            _fmt(r.get('setup_peak_mib')), _fmt(r.get('timed_peak_mib')), status))
    return '\n'.join(out) + '\n'


def print_row(r, tolerance):
    print('%-16s peak %9s MiB  stock Caffe %9s MiB  ratio %6s  %s%s' % (
        r['net'], _fmt(r['peak_mib']), _fmt(r['caffe_mib']), _fmt(r['ratio'], '{:.3f}'),
        'PASS' if r['pass'] else 'FAIL', '' if not r.get('error') else '  (%s)' % r['error']),
        flush=True)
    if r.get('setup_peak_mib') is not None or r.get('timed_peak_mib') is not None:
        print('%-16s setup %s MiB, timed iterations %s MiB; peak after: %s' % (
            '', _fmt(r.get('setup_peak_mib')), _fmt(r.get('timed_peak_mib')),
            r.get('peak_after')), flush=True)


# -- main -------------------------------------------------------------------------------------
def default_bench_dir():
    shared = os.environ.get('CAFFEPLUS_SHARED', os.path.join(ROOT, 'tests', 'data'))
    for d in (os.path.join(ROOT, '.gpu_carry', 'bench'), os.path.join(shared, 'bench')):
        if os.path.isdir(d):
            return d
    return os.path.join(ROOT, '.gpu_carry', 'bench')


def resolve(name, bench_dir):
    """A prototxt path, or a net's name in any spelling ('ResNet-50 b32',
    resnet50_b32) -> the prototxt path (None if there is none)."""
    if os.path.isfile(name):
        return os.path.abspath(name)
    try:
        files = sorted(f for f in os.listdir(bench_dir) if f.endswith('.prototxt'))
    except OSError:
        return None
    match = [f for f in files if net_key(f) == net_key(name)]
    return os.path.abspath(os.path.join(bench_dir, match[0])) if match else None


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    p.add_argument('nets', nargs='*', help='bench net names (alexnet_b128, ...) or prototxt '
                   'paths; default: every net of the README\'s stock Caffe table')
    p.add_argument('--bench-dir', default=None, help='folder of the bench prototxts and '
                   'README.md (default: tests/data/bench)')
    p.add_argument('--readme', default=None, help='bench README.md with stock Caffe\'s '
                   'peaks (default: BENCH_DIR/README.md)')
    p.add_argument('--plan', default='stock', help='caffeplus memory plan (default stock; '
                   '"" for none)')
    p.add_argument('--gpu', type=int, default=0, help='the -gpu device for caffeplus')
    p.add_argument('--smi-index', type=int, default=None,
                   help='nvidia-smi index of that GPU (default: the same as --gpu)')
    p.add_argument('--iterations', type=int, default=5)
    p.add_argument('--interval-ms', type=int, default=50, help='sampling interval')
    p.add_argument('--timeout', type=int, default=900, help='seconds per net')
    p.add_argument('--settle', type=float, default=30.0,
                   help='seconds to wait between nets for the memory to come back')
    p.add_argument('--tolerance', type=float, default=0.05)
    p.add_argument('--python', default=sys.executable)
    p.add_argument('--extra-arg', action='append', default=[],
                   help='one more argument for caffeplus time (repeatable)')
    p.add_argument('--log-dir', default=None, help='where each run\'s output goes '
                   '(default: a temporary folder)')
    p.add_argument('--json', default=None, help='write the results as JSON here')
    p.add_argument('--md', default=None, help='write a Markdown table here')
    args = p.parse_args(argv)
    if args.smi_index is None:
        args.smi_index = args.gpu
    args.bench_dir = args.bench_dir or default_bench_dir()
    args.readme = args.readme or os.path.join(args.bench_dir, 'README.md')
    return args


def main(argv=None):
    args = parse_args(argv)
    try:
        with open(args.readme) as f:
            table = parse_readme(f.read())
    except (OSError, ValueError) as exc:
        print('bench_stock_memory: stock Caffe figures: %s' % exc, file=sys.stderr)
        return 1
    figures = {net_key(label): (label, mib) for label, mib in table}
    names = args.nets or [label for label, _ in table]
    log_dir = args.log_dir or tempfile.mkdtemp(prefix='bench_stock_memory_')
    os.makedirs(log_dir, exist_ok=True)
    device = query_name(args.smi_index)
    print('device: %s; plan: %s; logs: %s' % (device, args.plan or '(none)', log_dir), flush=True)
    idle = query_used(args.smi_index)
    results = []
    for name in names:
        label, caffe_mib = figures.get(net_key(name), (os.path.basename(name), None))
        stem = re.sub(r'[^A-Za-z0-9]+', '_', label).strip('_').lower()
        prototxt = resolve(name, args.bench_dir)
        if prototxt is None:
            r = {'prototxt': name, 'rc': None, 'timed_out': False, 'peak_mib': None,
                 'baseline_mib': None, 'samples': 0, 'fwd_bwd_ms': None, 'seconds': 0,
                 'error': 'no prototxt for %s (in %s)' % (name, args.bench_dir)}
        else:
            try:
                r = run_net(prototxt, args, os.path.join(log_dir, stem + '.log'))
            except Exception as exc:        # keep going with the next net
                r = {'prototxt': prototxt, 'rc': None, 'timed_out': False, 'peak_mib': None,
                     'baseline_mib': None, 'samples': 0, 'fwd_bwd_ms': None, 'seconds': 0,
                     'error': '%s: %s' % (type(exc).__name__, exc)}
        r['net'] = label
        judge(r, caffe_mib, args.tolerance)
        if caffe_mib is None and not r.get('error'):
            r['error'] = 'no stock Caffe figure for %s in %s' % (label, args.readme)
        results.append(r)
        print_row(r, args.tolerance)
        wait_for_idle(args.smi_index, idle, args.settle)
    doc = {'plan': args.plan, 'tolerance': args.tolerance, 'device': device,
           'iterations': args.iterations, 'interval_ms': args.interval_ms,
           'idle_mib': idle, 'readme': os.path.abspath(args.readme), 'results': results}
    if args.json:
        with open(args.json, 'w') as f:
            json.dump(doc, f, indent=1)
    if args.md:
        with open(args.md, 'w') as f:
            f.write(markdown(results, args.plan or 'none', args.tolerance, device,
                             args.iterations))
    passed = sum(r['pass'] for r in results)
    print('%d of %d nets within %g%% of stock Caffe' % (passed, len(results),
                                                        args.tolerance * 100), flush=True)
    return 0 if passed == len(results) else 1


if __name__ == '__main__':
    sys.exit(main())
