#!/usr/bin/env python3
"""What offload policy 'free' sees and chooses on the GPU, net by net.

    python dev/free_offload_probe.py .gpu_carry/bench/resnet50_b64.prototxt [--iterations 8]

Builds the net as `caffeplus memory` does (TRAIN, SGD solver), applies plan
offload with policy free, trains --iterations iterations and prints: the
step times the runtime measured (forward and backward totals), the link
bandwidth, the candidates and the maps chosen (bytes, release and prefetch
steps), the arena before and after, whether the choice was kept, and each
iteration's time and CuPy pool peak.
"""
import argparse
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    ap.add_argument('model')
    ap.add_argument('--iterations', type=int, default=8)
    ap.add_argument('--baseline', action='store_true',
                    help='first time the same iterations under plan shared, in this process')
    ap.add_argument('--json', help='write the measured step times here (layer names, types, '
                    'forward and backward seconds) to fit the layer-time model against')
    args = ap.parse_args(argv)
    os.environ.setdefault('CAFFEPLUS_CUDNN_SEARCH', 'auto')
    import cupy
    import caffeplus
    from caffeplus.io.prototxt import read_net_param
    from caffeplus.memory import free_offload, measure, offload_runtime
    from caffeplus.memory.apply import apply_named_plan
    from caffeplus.memory.budget import format_bytes
    caffeplus.set_mode_gpu(0)
    seen = {}
    real = offload_runtime.OffloadRuntime._choose_free

    def spy(self, seconds, bandwidth):
        hidden = real(self, seconds, bandwidth)
        seen.update(seconds=list(seconds), bandwidth=bandwidth, hidden=hidden,
                    arena_before=self.applied.arena_bytes, iteration=self.iteration)
        return hidden
    offload_runtime.OffloadRuntime._choose_free = spy
    pool = cupy.get_default_memory_pool()
    if args.baseline:
        solver = measure._solver(read_net_param(args.model), 'SGD', args.iterations)
        apply_named_plan(solver.net, 'shared', training=True)
        times = []
        for it in range(args.iterations):
            cupy.cuda.Device().synchronize()
            t0 = time.perf_counter()
            measure.run_iteration(solver.net, solver)
            cupy.cuda.Device().synchronize()
            times.append((time.perf_counter() - t0) * 1e3)
            ap = solver.net.applied_plan
            print('shared iteration %d: arena %s, workspace views %s, pool %s, replans %d'
                  % (it + 1, format_bytes(ap.arena_bytes), format_bytes(ap.workspace_bytes),
                     format_bytes(pool.total_bytes()), ap.replans))
        print('shared: ' + ', '.join('%.1f' % t for t in times) + ' ms', flush=True)
        del solver
        import gc
        gc.collect()
        pool.free_all_blocks()
    solver = measure._solver(read_net_param(args.model), 'SGD', args.iterations)
    net = solver.net
    apply_named_plan(net, 'offload', offload_policy='free', training=True)
    L = len(net.layers)
    for it in range(args.iterations):
        cupy.cuda.Device().synchronize()
        t0 = time.perf_counter()
        measure.run_iteration(net, solver)
        cupy.cuda.Device().synchronize()
        applied = net.applied_plan
        print('iteration %d: %.1f ms, pool %s, arena %s, workspace views %s, offloaded %d, '
              'replans %d' % (it + 1, (time.perf_counter() - t0) * 1e3,
                              format_bytes(pool.total_bytes()), format_bytes(applied.arena_bytes),
                              format_bytes(applied.workspace_bytes),
                              len(applied.info()['offloaded']), applied.replans), flush=True)
    if not seen:
        print('the runtime never chose (not calibrated)')
        return 1
    runtime = net.applied_plan.runtime
    steady = {}
    if runtime is not None:
        # One more iteration with every step timed: where offload's steps
        # take longer than the calibration's, compute waited for a copy.
        runtime.time_next_iteration(lambda sec: steady.update(seconds=sec))
        measure.run_iteration(net, solver)
        cupy.cuda.Device().synchronize()
    if steady:
        cal, now = seen['seconds'], steady['seconds']
        print('timed iteration under offload: forward %.1f ms, backward %.1f ms'
              % (sum(now[:L]) * 1e3, sum(now[L:]) * 1e3))
        names = net._layer_names
        waits = {}
        for s_ in range(2 * L):
            who = ['copied:' + it.name for it in runtime.wait_copied_at[s_]] + \
                ['fetched:' + it.name for it in runtime.consume_at[s_]]
            waits[s_] = who
        worst = sorted(range(2 * L), key=lambda t: cal[t] - now[t])[:15]
        for t in worst:
            where = ('fwd ' + names[t]) if t < L else ('bwd ' + names[2 * L - 1 - t])
            print('  step %3d %-28s %.2f -> %.2f ms  waits %s'
                  % (t, where[:28], cal[t] * 1e3, now[t] * 1e3, ' '.join(waits[t])[:120]))
    s = seen['seconds']
    print('chose at iteration %d: forward %.1f ms, backward %.1f ms, link %s/s'
          % (seen['iteration'], sum(s[:L]) * 1e3, sum(s[L:]) * 1e3,
             format_bytes(seen['bandwidth'])))
    hidden = seen['hidden']
    from caffeplus.memory import liveness, offload
    bufs = liveness.buffers(net, training=True)
    cands = offload.choose(net, bufs, 'all')
    size = {b.key: b.nbytes for b in bufs}
    print('candidates %d (%s); chosen %d (%s); arena before %s, after %s'
          % (len(cands), format_bytes(sum(size[k] for k in cands)), len(hidden),
             format_bytes(sum(size[k] for k in hidden)), format_bytes(seen['arena_before']),
             format_bytes(net.applied_plan.arena_bytes)))
    for k, h in sorted(hidden.items(), key=lambda kv: kv[1].release)[:40]:
        print('  %-40s %10s release %3d prefetch %3d' % ('/'.join(k[1])[:40],
                                                         format_bytes(size[k]), h.release,
                                                         h.prefetch))
    if args.json:
        import json
        with open(args.json, 'w') as f:
            json.dump({'model': os.path.basename(args.model), 'names': list(net._layer_names),
                       'types': [layer.layer_param.type for layer in net.layers],
                       'forward_s': s[:L], 'backward_s': s[L:][::-1],
                       'bandwidth': seen['bandwidth'],
                       'chosen': ['/'.join(k[1]) for k in hidden]}, f, indent=1)
    ms = [round(x * 1e3, 2) for x in s]
    print('step ms forward:', ms[:L])
    print('step ms backward:', ms[L:])
    # What a fast link would allow: the bound is the link, not the gaps.
    for factor in (2, 4, 10):
        more = free_offload.choose_hidden(net, bufs, cands, s, seen['bandwidth'] * factor)
        print('with a %dx link: %d maps (%s)' % (factor, len(more),
                                                 format_bytes(sum(size[k] for k in more))))
    return 0


if __name__ == '__main__':
    sys.exit(main())
