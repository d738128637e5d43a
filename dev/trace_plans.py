#!/usr/bin/env python3
"""Where the GPU waits during training iterations, plan beside plan: a CUPTI
timeline of every kernel, copy and memset in the process (PyTorch's
profiler, which records CuPy's and cuDNN's work as well), summarised.

    python dev/trace_plans.py --net tests/data/bench/alexnet_b128.prototxt \\
        --plans arena,shared --gpu 0 [--iters 5] [--gaps 12] [--trace-dir DIR] [--offload free]

For each plan (its own solver, built as benchmarks/time_plans.py builds them,
warmed up, then --iters steps traced) it prints: the traced span per
iteration, the GPU's busy time (the union of its kernels, copies and
memsets), the idle rest, the device time by kernel family where the plans
differ, and the longest idle gaps with the work on each side and the CUDA
API calls the host was in while the GPU waited (a synchronisation is where
the host caught the GPU up). `shared` no slower than `arena` is a claim
about the wall clock; when the busy times agree, this shows where the
difference is spent.
"""
import argparse
import collections
import json
import os
import re
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

DEVICE_CATS = ('kernel', 'gpu_memcpy', 'gpu_memset')
API_CATS = ('cuda_runtime', 'cuda_driver')


def family(name):
    """A kernel's name without template arguments and numbers, to group by."""
    name = re.sub(r'<.*', '', name)
    name = re.sub(r'\(.*', '', name)
    return re.sub(r'\d+', '#', name)[:60]


def load_events(path):
    with open(path) as f:
        doc = json.load(f)
    events = [e for e in doc.get('traceEvents', []) if e.get('ph') == 'X' and 'dur' in e]
    device = sorted((e for e in events if e.get('cat') in DEVICE_CATS), key=lambda e: e['ts'])
    api = sorted((e for e in events if e.get('cat') in API_CATS), key=lambda e: e['ts'])
    return device, api


def busy_union(device):
    """(busy microseconds, [(gap start, gap end, event before, event after)])."""
    busy, gaps = 0.0, []
    end, last = None, None
    for e in device:
        s, t = e['ts'], e['ts'] + e['dur']
        if end is None:
            busy += t - s
        elif s > end:
            gaps.append((end, s, last, e))
            busy += t - s
        elif t > end:
            busy += t - end
        if end is None or t > end:
            end, last = t, e
    return busy, gaps


def _compute_stream(device):
    """The stream with the most kernel time (the layers' stream)."""
    time = collections.Counter()
    for e in device:
        if e.get('cat') == 'kernel':
            time[e.get('args', {}).get('stream')] += e['dur']
    return time.most_common(1)[0][0] if time else None


def _host_calls(api, s, t, most):
    """The CUDA API calls the host was in during (s, t), the most frequent first."""
    calls = collections.Counter(a['name'] for a in api if a['ts'] < t and a['ts'] + a['dur'] > s)
    return ', '.join('%s x%d' % kv for kv in calls.most_common(most)) or '-'


def _compute_stream_gaps(plan, device, stream, copies, api, iters, n_gaps):
    """With copies on other streams (offload), the union hides the layers'
    stream waiting for them: its own busy time and longest gaps, with the
    copies in flight across each gap."""
    mine = [e for e in device if e.get('args', {}).get('stream') == stream]
    busy, gaps = busy_union(mine)
    span = mine[-1]['ts'] + mine[-1]['dur'] - mine[0]['ts']
    print('%s, the layers\' stream %s alone: busy %.3f ms, idle %.3f ms an iteration; copies on '
          'other streams %.3f ms an iteration' % (plan, stream, busy / 1e3 / iters,
                                                   (span - busy) / 1e3 / iters,
                                                   sum(c['dur'] for c in copies) / 1e3 / iters))
    for s, t, before, after in sorted(gaps, key=lambda g: g[0] - g[1])[:n_gaps]:
        flying = collections.Counter(family(c.get('name', '?')) for c in copies
                                     if c['ts'] < t and c['ts'] + c['dur'] > s)
        ending = [c for c in copies if s < c['ts'] + c['dur'] <= t + 2]
        print('   gap %7.1f us  before %-36s copies across it: %s%s; host in: %s'
              % (t - s, family(after.get('name', '?'))[:36],
                 ', '.join('%s x%d' % kv for kv in flying.most_common(2)) or '-',
                 ' (one ends %.0f us before the kernel)' % (t - max(c['ts'] + c['dur']
                                                                 for c in ending))
                 if ending else '', _host_calls(api, s, t, 3)))


def summarise(plan, device, api, iters, n_gaps):
    if not device:
        print('%s: no device events traced (is CUPTI available?)' % plan)
        return {}
    span = device[-1]['ts'] + device[-1]['dur'] - device[0]['ts']
    busy, gaps = busy_union(device)
    by_family = collections.Counter()
    for e in device:
        by_family[(e.get('cat'), family(e.get('name', '?')))] += e['dur']
    print('%s: %.3f ms span an iteration, GPU busy %.3f ms, idle %.3f ms in %d gaps '
          '(%d device events an iteration)'
          % (plan, span / 1e3 / iters, busy / 1e3 / iters, (span - busy) / 1e3 / iters,
             len(gaps), len(device) // iters))
    for s, t, before, after in sorted(gaps, key=lambda g: g[0] - g[1])[:n_gaps]:
        print('   gap %7.1f us  after %-40s before %-40s host in: %s'
              % (t - s, family(before.get('name', '?'))[:40], family(after.get('name', '?'))[:40],
                 _host_calls(api, s, t, 4)))
    stream = _compute_stream(device)
    copies = [e for e in device if e.get('cat') == 'gpu_memcpy' and
              e.get('args', {}).get('stream') != stream]
    if copies:
        _compute_stream_gaps(plan, device, stream, copies, api, iters, n_gaps)
    return {'span_ms': span / 1e3 / iters, 'busy_ms': busy / 1e3 / iters,
            'idle_ms': (span - busy) / 1e3 / iters,
            'families': {'%s %s' % k: v / 1e3 / iters for k, v in by_family.items()}}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    ap.add_argument('--net', required=True)
    ap.add_argument('--plans', default='arena,shared')
    ap.add_argument('--gpu', type=int, default=0)
    ap.add_argument('--iters', type=int, default=5)
    ap.add_argument('--warmup', type=int, default=8)
    ap.add_argument('--gaps', type=int, default=10)
    ap.add_argument('--trace-dir', default=None, help='keep the chrome traces here')
    ap.add_argument('--offload', default=None, help="offload policy for plan offload (e.g. free)")
    args = ap.parse_args(argv)
    import torch
    from torch.profiler import ProfilerActivity, profile
    from caffeplus.memory import shapes
    from benchmarks.time_plans import build_solvers, training_device
    sync = training_device(args.gpu)
    torch.cuda.init()
    plans = [p.strip() for p in args.plans.split(',') if p.strip()]
    out_dir = args.trace_dir or tempfile.mkdtemp(prefix='trace_plans_')
    os.makedirs(out_dir, exist_ok=True)
    results = {}
    with shapes.quiet():
        solvers = build_solvers(args.net, plans, args.warmup, sync, offload=args.offload)
        for plan in plans:
            solvers[plan].step(2)
            sync()
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                solvers[plan].step(args.iters)
                sync()
            path = os.path.join(out_dir, '%s_%s.json' % (
                os.path.splitext(os.path.basename(args.net))[0], re.sub(r'[^\w.-]', '_', plan)))
            prof.export_chrome_trace(path)
            device, api = load_events(path)
            results[plan] = summarise(plan, device, api, args.iters, args.gaps)
    peer = plans[0]
    if len(plans) > 1 and results.get(peer):
        print('device time by kernel family, ms an iteration, where the plans differ by 0.02 ms '
              'or more:')
        keys = set()
        for r in results.values():
            keys |= set(r.get('families', {}))
        rows = []
        for k in keys:
            values = [results[p].get('families', {}).get(k, 0.0) for p in plans]
            if max(values) - min(values) >= 0.02:
                rows.append((max(values) - min(values), k, values))
        for _, k, values in sorted(rows, reverse=True)[:25]:
            print('   %-70s %s' % (k[:70], '  '.join('%8.3f' % v for v in values)))
    print('traces in %s' % out_dir)
    return results


if __name__ == '__main__':
    main()
