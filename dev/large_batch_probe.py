#!/usr/bin/env python3
"""Why a large batch fails on the GPU: one net at one batch, a plan applied,
two training iterations; prints the exception and where it was raised.

    python dev/large_batch_probe.py .gpu_carry/bench/vgg16_b64.prototxt --batch 672 \\
        [--plan shared | --plan auto --budget 78G] [--iterations 6 --card 12G]

--card emulates a smaller card: CuPy's pool is limited to what the card
would leave beside the memory in use at the start (the CUDA context), so a
plan that exceeds it fails as it would there.

(VGG-16 `auto` fails from batch 672 up, where conv1's output passes 2**31
elements, the limit of 32-bit sizes; benchmarks/max_batch.py records no reason.)
"""
import argparse
import os
import sys
import time
import traceback

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    ap.add_argument('model')
    ap.add_argument('--batch', type=int, required=True)
    ap.add_argument('--plan', default='shared')
    ap.add_argument('--budget', default=None)
    ap.add_argument('--iterations', type=int, default=2)
    ap.add_argument('--card', default=None,
                    help='act as a card of this size (e.g. 12G): CuPy\'s pool may take what '
                         'it leaves beside the memory in use before the net is built')
    ap.add_argument('--cpu', action='store_true', help='run on the CPU (a check of the script)')
    args = ap.parse_args(argv)
    os.environ.setdefault('CAFFEPLUS_CUDNN_SEARCH', 'auto')
    import caffeplus
    from caffeplus.memory import measure, shapes
    from caffeplus.memory.apply import apply_named_plan
    from caffeplus.memory.budget import parse_bytes
    if not args.cpu:
        caffeplus.set_mode_gpu(0)
    param = shapes.load_net_param(args.model, batch=args.batch)
    step = 'build'
    tracker = None
    if not args.cpu:
        import cupy
        if args.card:
            cupy.cuda.Device().synchronize()
            free, total = cupy.cuda.runtime.memGetInfo()
            limit = parse_bytes(args.card) - (total - free)
            cupy.get_default_memory_pool().set_limit(size=limit)
            print('card of %s: the pool may take %.2f GiB (%.2f GiB in use before)'
                  % (args.card, limit / 2 ** 30, (total - free) / 2 ** 30), flush=True)
        tracker = measure.PeakTracker().__enter__()
    try:
        solver = measure._solver(param, 'SGD', 2)
        net = solver.net
        biggest = max(net._blobs, key=lambda b: b.count)
        print('largest blob: %s, %d elements (2**31 = %d)'
              % (net._blob_names[net._blobs.index(biggest)], biggest.count, 2 ** 31), flush=True)
        step = 'plan'
        apply_named_plan(net, args.plan, training=True,
                         budget=parse_bytes(args.budget) if args.budget else None)
        for line in outside_the_arena(net):
            print(line, flush=True)
        where = {}
        if tracker is not None:
            # The step at which the pool's live bytes were highest (hooks
            # marked chain_safe leave the fused layer chains fused).
            def mark(t):
                def hook(i):
                    if tracker.live >= where.get('live', -1):
                        where.update(live=tracker.live, step=t(i))
                hook.chain_safe = True
                return hook
            net.before_layer_forward.append(mark(lambda i: 'forward of %s' % net._layer_names[i]))
            net.before_layer_backward.append(
                mark(lambda i: 'backward of %s' % net._layer_names[i]))
        for i in range(args.iterations):
            step = 'iteration %d' % (i + 1)
            t0 = time.time()
            if tracker is not None:
                tracker.reset()
                where.clear()
            measure.run_iteration(net, solver)
            used = ''
            if tracker is not None:
                import cupy
                cupy.cuda.Device().synchronize()
                free, total = cupy.cuda.runtime.memGetInfo()
                used = (', device memory used now %.2f GiB, pool peak %.2f GiB (highest before '
                        'a layer: %.2f GiB, %s)' % ((total - free) / 2 ** 30,
                                                    tracker.pool_peak / 2 ** 30,
                                                    where.get('live', 0) / 2 ** 30,
                                                    where.get('step')))
            print('%s: %.2f s%s' % (step, time.time() - t0, used), flush=True)
    except BaseException as exc:      # noqa: BLE001 -- the point is to see it
        print('FAILED at %s: %s: %s' % (step, type(exc).__name__, exc))
        print(''.join(line for line in traceback.format_exc().splitlines(True)
                      if 'site-packages' not in line and 'core.pyx' not in line
                      and 'memory.pyx' not in line))
        return 1
    print('ok')
    return 0


def outside_the_arena(net, least=32 << 20):
    """Lines naming the blob storages of at least `least` bytes that the
    applied plan does not place in its arena (kept whole: allocated on
    first touch beside it)."""
    applied = getattr(net, 'applied_plan', None)
    if applied is None or not hasattr(applied, 'entries'):
        return []
    placed = {id(e.storage) for e in applied.entries}
    params = {id(p.data_storage) for p in net.param_blobs} | \
        {id(p.diff_storage) for p in net.param_blobs}
    out = []
    for name, blob in zip(net._blob_names, net._blobs):
        for kind, st in (('data', blob.data_storage), ('diff', blob.diff_storage)):
            nbytes = blob.count * 4
            if nbytes >= least and id(st) not in placed and id(st) not in params:
                out.append('outside the arena: %s %s, %.1f MiB' % (name, kind, nbytes / 2 ** 20))
    return out


if __name__ == '__main__':
    sys.exit(main())
