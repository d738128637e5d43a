#!/usr/bin/env python3
"""Where a memory plan's device memory goes, iteration by iteration (GPU).

    python tools/offload_probe.py NET.prototxt --configs shared,offload,offload/nographs

Each configuration runs in a process of its own: the net (TRAIN, a SGD
solver as `caffeplus memory` builds it) with the plan applied, timed
algorithm search as in training, then --iterations iterations. Per
iteration it prints the time, CuPy's pool peak of live bytes and the step
(layer and pass) where it was reached, the allocations of more than
--big MiB made in it with their steps, the re-layouts so far, how many
fused BatchNorm->Scale->ReLU chains ran whole, and the loss. Configuration
names: PLAN[/nographs][/nochains][/la1] (CUDA-graph replays off, fused
kernels off, offload look-ahead fixed at 1 instead of calibrated).
"""
import argparse
import json
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def one(args):
    sys.path.insert(0, ROOT)
    os.environ.setdefault('CAFFEPLUS_CUDNN_SEARCH', 'auto')
    import cupy
    import caffeplus
    from caffeplus import kernels
    from caffeplus.cudnn import api
    from caffeplus.io.prototxt import read_net_param
    from caffeplus.memory import measure
    from caffeplus.memory.apply import apply_named_plan
    plan, *variants = args.one.split('/')
    caffeplus.set_mode_gpu(0)
    api.set_graphs('nographs' not in variants)
    kernels.set_enabled('nochains' not in variants)
    solver = measure._solver(read_net_param(args.model), 'SGD', args.iterations)
    net = solver.net
    apply_named_plan(net, plan, training=True, lookahead=1 if 'la1' in variants else None)
    L = len(net.layers)
    state = {'step': -1, 'live': 0, 'peak': 0, 'peak_step': -1, 'big': []}
    big = args.big * 2 ** 20

    class Hook(cupy.cuda.MemoryHook):
        name = 'probe'

        def malloc_postprocess(self, **kw):
            state['live'] += kw['mem_size']
            if state['live'] > state['peak']:
                state['peak'], state['peak_step'] = state['live'], state['step']
            if kw['mem_size'] >= big:
                state['big'].append((state['step'], kw['mem_size'] >> 20))

        def free_postprocess(self, **kw):
            state['live'] -= kw['mem_size']

    def at(step):
        def hook(i):
            state['step'] = step(i)
        hook.chain_safe = True      # keeps the fused chains as they are
        return hook
    net.before_layer_forward.append(at(lambda i: i))
    net.before_layer_backward.append(at(lambda i: 2 * L - 1 - i))

    def where(step):
        if step < 0:
            return 'update/other'
        i = step if step < L else 2 * L - 1 - step
        return '%s %s' % (net._layer_names[i], 'fwd' if step < L else 'bwd')

    pool = cupy.get_default_memory_pool()
    with Hook():
        for it in range(args.iterations):
            cupy.cuda.Device().synchronize()
            state.update(peak=state['live'], peak_step=-1, big=[])
            t0 = time.perf_counter()
            measure.run_iteration(net, solver)
            state['step'] = -1
            cupy.cuda.Device().synchronize()
            ms = (time.perf_counter() - t0) * 1e3
            applied = net.applied_plan
            chains = net.__dict__.get('_fused_chains') or []
            loss = float(cupy.asarray(net._blob_dict[net.outputs[0]].data).sum())
            print(json.dumps({
                'config': args.one, 'iter': it, 'ms': round(ms, 2),
                'pool_peak_mib': state['peak'] >> 20, 'peak_at': where(state['peak_step']),
                'pool_total_mib': pool.total_bytes() >> 20,
                'arena_mib': getattr(applied, 'arena_bytes', 0) >> 20,
                'replans': getattr(applied, 'replans', 0),
                'chains_whole': sum(1 for c in chains if c.fwd_done and c.bwd_done),
                'chains': len(chains), 'loss': loss,
                'big_allocs': [(where(s), m) for s, m in state['big']][:12],
                'outside': {'%s %s' % k: v >> 20 for k, v in
                            getattr(getattr(applied, 'workspace', None), 'outside', {}).items()}
                }), flush=True)
    return 0


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    ap.add_argument('model')
    ap.add_argument('--configs', default='shared,offload')
    ap.add_argument('--iterations', type=int, default=6)
    ap.add_argument('--big', type=int, default=64, help='MiB: allocations to list')
    ap.add_argument('--timeout', type=int, default=200)
    ap.add_argument('--one', default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.one:
        return one(args)
    for config in args.configs.split(','):
        cmd = [sys.executable, os.path.abspath(__file__), args.model, '--one', config,
               '--iterations', str(args.iterations), '--big', str(args.big)]
        env = dict(os.environ, GLOG_minloglevel='2')
        try:
            p = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout, env=env)
        except subprocess.TimeoutExpired:
            print('%s: timeout' % config, flush=True)
            continue
        lines = [line for line in p.stdout.splitlines() if line.startswith('{')]
        for line in lines:
            r = json.loads(line)
            print('%-22s it%d %7.1f ms  pool peak %6d MiB at %-28s total %6d arena %6d '
                  'replans %d chains %d/%d loss %.4f big %s' % (
                      config, r['iter'], r['ms'], r['pool_peak_mib'], r['peak_at'],
                      r['pool_total_mib'], r['arena_mib'], r['replans'], r['chains_whole'],
                      r['chains'], r['loss'], r['big_allocs']), flush=True)
            if r.get('outside'):
                print('    calls outside the layout (MiB):', r['outside'], flush=True)
        if p.returncode:
            print('%s: exit %d: %s' % (config, p.returncode, p.stderr[-1500:]), flush=True)
    return 0


if __name__ == '__main__':
    sys.exit(main())
