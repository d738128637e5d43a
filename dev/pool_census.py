#!/usr/bin/env python3
"""What holds the device at a plan's steady peak, allocation by allocation.

    python dev/pool_census.py .gpu_carry/bench/alexnet_b128.prototxt --plan offload --offload free
    python dev/pool_census.py .gpu_carry/bench/resnet50_b64.prototxt --plan shared \
        --precision fp16 --batch 256
    python dev/pool_census.py benchmarks/nets/alexnettv_b128.prototxt --plan shared \
        --precision bf16 --plan-on net      # the plan train makes, not the estimate's

Builds the net as `caffeplus memory -gpu` does (TRAIN, SGD solver, the
estimated plan applied, its algorithm search), runs iterations until the
plan settles (caffeplus.memory.measure.settle), then runs
--iterations more with a CuPy memory hook that remembers every live block of
the pool and where it was taken (the innermost caffeplus frames). Prints the
live blocks at the pool's busiest moment grouped by site, what the pool held
cached but unused, and what the device holds outside the pool (context,
cuBLAS, cuDNN; with the CUDA per-thread stack limit the kernels settled
on): the three parts of `caffeplus memory`'s steady peak.
"""
import argparse
import collections
import os
import sys
import traceback

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
MiB = 2 ** 20


def _site():
    """The innermost two frames of this project's code taking a block."""
    frames = [f for f in traceback.extract_stack()[:-2]
              if ('caffeplus' in f.filename or '/layers/' in f.filename)
              and 'memory/measure.py' not in f.filename]
    return ' < '.join('%s:%d %s' % (os.path.basename(f.filename), f.lineno, f.name)
                      for f in reversed(frames[-2:])) or '(outside caffeplus)'


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    ap.add_argument('model')
    ap.add_argument('--plan', default='offload')
    ap.add_argument('--offload', default='free')
    ap.add_argument('--iterations', type=int, default=3)
    ap.add_argument('--top', type=int, default=25)
    ap.add_argument('--batch', type=int, default=None, help="as `caffeplus memory --batch`")
    ap.add_argument('--precision', default=None, help="as `caffeplus memory --precision`")
    ap.add_argument('--plan-on', choices=('host', 'net'), default='host',
                    help="host: the plan the estimate makes on a net built on the host, as "
                         "`caffeplus memory -gpu` measures it; net: the plan made on the "
                         "GPU's net, as `caffeplus train` and benchmarks/bench_gpu.py make it")
    ap.add_argument('--layout-json', help="write the arena's placed buffers there, as "
                                          "dev/arena_layout.py --json does")
    args = ap.parse_args(argv)
    # The algorithms `caffeplus memory` measures with (its child's setting):
    # another search picks other workspaces, and another arena.
    os.environ.setdefault('CAFFEPLUS_CUDNN_SEARCH', 'auto')
    import cupy
    from caffeplus import backend, precision
    from caffeplus.memory import budget, measure, shapes
    from caffeplus.proto import caffe_pb2
    backend.set_mode_gpu(0)
    pool = cupy.get_default_memory_pool()
    live = {}                    # device pointer -> (bytes, site)
    state = {'peak': 0, 'snapshot': {}, 'now': 0}
    chunks = []                  # (pointer, bytes, site) of every cudaMalloc, in order
    taken = {}                   # site -> largest block of 1 MiB or more taken while timed

    class Census(cupy.cuda.MemoryHook):
        name = 'PoolCensus'

        def malloc_postprocess(self, **kw):
            old = live.pop(kw['mem_ptr'], None)
            if old:
                state['now'] -= old[0]
            live[kw['mem_ptr']] = (kw['mem_size'], _site())
            if state.get('timed') and kw['mem_size'] >= MiB:
                taken[live[kw['mem_ptr']][1]] = max(taken.get(live[kw['mem_ptr']][1], 0),
                                                    kw['mem_size'])
            state['now'] += kw['mem_size']
            if state['now'] > state['peak']:
                state['peak'] = state['now']
                state['snapshot'] = dict(live)

        def alloc_postprocess(self, **kw):
            chunks.append((kw['mem_ptr'], kw['mem_size'], _site()))

        def free_postprocess(self, **kw):
            old = live.pop(kw['mem_ptr'], None)
            if old:
                state['now'] -= old[0]

    param = shapes.load_net_param(args.model, batch=args.batch, phase=caffe_pb2.TRAIN)
    if args.precision:
        precision.override(param, args.precision)
    with Census(), shapes.quiet():
        solver = measure._solver(param, 'SGD', args.iterations + 8)
        net = solver.net
        if args.plan_on == 'net':
            # As `caffeplus train` applies it: the solver's caffeplus_param.
            from caffeplus.solver.memory_plans import apply_solver_plans
            solver.param.caffeplus_param.offload.append(args.offload)
            apply_solver_plans(solver, default=args.plan)
        else:
            plan = budget.estimate_plan(shapes.build_net(param), args.plan,
                                        offload_policy=args.offload)
            measure.apply_plan(net, plan)
        pool.free_all_blocks()
        measure.settle(net, solver)
        cupy.cuda.Device().synchronize()
        state['peak'], state['snapshot'] = state['now'], dict(live)
        held_before = pool.total_bytes()
        state['timed'] = True
        for _ in range(args.iterations):
            measure.run_iteration(net, solver)
        cupy.cuda.Device().synchronize()
        state['timed'] = False
    free, total = cupy.cuda.runtime.memGetInfo()
    used = total - free
    from caffeplus.memory import thread_stack
    print('CUDA per-thread stack limit %d bytes' % thread_stack.current_bytes())
    by_site = collections.defaultdict(lambda: [0, 0])
    for size, site in state['snapshot'].values():
        by_site[site][0] += size
        by_site[site][1] += 1
    print('%s, plan %s (%s): pool live at its peak %.1f MiB in %d blocks; pool now holds '
          '%.1f MiB (%.1f MiB of it unused); device used %.1f MiB, outside the pool %.1f MiB'
          % (os.path.basename(args.model), args.plan, args.offload, state['peak'] / MiB,
             len(state['snapshot']), pool.total_bytes() / MiB,
             (pool.total_bytes() - pool.used_bytes()) / MiB, used / MiB,
             (used - pool.total_bytes()) / MiB))
    for site, (size, count) in sorted(by_site.items(), key=lambda kv: -kv[1][0])[:args.top]:
        print('  %9.1f MiB %4d  %s' % (size / MiB, count, site))
    print('pool held %.1f MiB when the timed iterations began; blocks of 1 MiB or more '
          'taken while they ran, by site (largest):' % (held_before / MiB))
    for site, size in sorted(taken.items(), key=lambda kv: -kv[1])[:args.top]:
        print('  %9.1f MiB  %s' % (size / MiB, site))
    pool.free_all_blocks()
    after_free = pool.total_bytes()
    # Which chunks the device gave the pool hold bytes no live block uses
    # (a chunk split for a smaller block cannot go back while that lives).
    owner = {}
    for ptr, (size, site) in live.items():
        for cptr, csize, csite in reversed(chunks):
            if cptr <= ptr < cptr + csize:
                owner.setdefault((cptr, csize, csite), []).append((size, site))
                break
    print('chunks partly unused (unused, chunk, where the chunk was taken; its live blocks):')
    for (cptr, csize, csite), blocks in sorted(owner.items(),
                                               key=lambda kv: sum(b[0] for b in kv[1]) - kv[0][1]):
        unused = csize - sum(b[0] for b in blocks)
        if unused >= MiB:
            print('  %8.1f of %8.1f MiB  %s; %s' % (
                unused / MiB, csize / MiB, csite,
                ', '.join('%.1f MiB %s' % (b[0] / MiB, b[1]) for b in blocks[:3])))
    measure.run_iteration(net, solver)
    cupy.cuda.Device().synchronize()
    print('pool after free_all_blocks %.1f MiB; after one more iteration %.1f MiB' % (
        after_free / MiB, pool.total_bytes() / MiB))
    applied = getattr(net, 'applied_plan', None)
    if applied is not None and hasattr(applied, 'info'):
        info = applied.info()
        print('arena %.1f MiB, offloaded %s' % ((info.get('arena_bytes') or 0) / MiB,
                                                 info.get('offloaded')))
        if args.layout_json:
            import json
            from dev.arena_layout import layout_record
            record = layout_record(net)
            record['sites'] = {'%s %s' % (name, kind): repr(site.choice)
                               for layer, name in zip(net.layers, net._layer_names)
                               for kind, site in (getattr(layer, '_sites', None) or {}).items()}
            with open(args.layout_json, 'w') as f:
                json.dump(record, f, indent=1)
    return 0


if __name__ == '__main__':
    sys.exit(main())
