#!/usr/bin/env python3
"""Times the channels-last BatchNorm vector kernels (caffeplus/kernel_sources_nhwc.py)
on ResNet-50's BatchNorm shapes, one or more versions of their source side by
side in one process, in FLOAT16, launched as layers/fused_chain.py launches
them; beside them a device copy of the same bytes (the memory's pace).

    python dev/bn_nhwc_bench.py [--batch 256] [--variants old=git:538c690,current]
        [--row-chunks 8192,1024] [--lane-rows 32,128]

A variant is a Python file defining CHANNELS_LAST_BATCHNORM (the module
source), git:REV for caffeplus/kernel_sources_nhwc.py at commit REV, or
'current', the package's. Prints, per kernel and shape, device
microseconds (median of --reps), GB/s of maps moved, and each kernel's
registers a thread. --row-chunks and --lane-rows time each variant under
other launch shapes too (layers/fused_chain.py's NHWC_ROW_CHUNKS, the
per-value passes' most blocks, and NHWC_LANE_ROWS, the rows a lane of the
sums walks).
"""
import argparse
import importlib.util
import os
import statistics
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

# (rows per image, channels, layers of that shape) of ResNet-50's BatchNorms
SHAPES = [(112 * 112, 64, 1), (56 * 56, 64, 6), (56 * 56, 256, 4), (28 * 28, 128, 8),
          (28 * 28, 512, 4), (14 * 14, 256, 12), (14 * 14, 1024, 6), (7 * 7, 512, 6),
          (7 * 7, 2048, 4)]
FWD_FLAGS, BWD_FLAGS = 1 | 2 | 4 | 8 | 16, 1 | 4 | 8 | 16 | 32 | 64 | 128
# (kernel, maps read, maps written)
KERNELS = [('cp_bn_stats_part_nhwc_vec', 1, 0), ('cp_bn_apply_nhwc_vec', 1, 2),
           ('cp_bn_bwd_part_nhwc_vec', 2, 0), ('cp_bn_dx_nhwc_vec', 2, 1)]


def _source(path):
    if path == 'current':
        from caffeplus.kernel_sources_nhwc import CHANNELS_LAST_BATCHNORM
        return CHANNELS_LAST_BATCHNORM
    if path.startswith('git:'):
        # The module as a commit had it (the helpers it calls: the current COMMON's)
        import subprocess
        text = subprocess.run(['git', 'show', path[4:] + ':caffeplus/kernel_sources_nhwc.py'],
                              cwd=ROOT, capture_output=True, text=True, check=True).stdout
        namespace = {}
        exec(compile(text, path, 'exec'), namespace)        # noqa: S102 -- a source file of ours
        return namespace['CHANNELS_LAST_BATCHNORM']
    spec = importlib.util.spec_from_file_location('variant', path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.CHANNELS_LAST_BATCHNORM


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    ap.add_argument('--batch', type=int, default=256)
    ap.add_argument('--variants', default='current',
                    help="name=path (or 'current'), comma-separated")
    ap.add_argument('--reps', type=int, default=15)
    ap.add_argument('--dx-in-place', action='store_true',
                    help='dx written over dy, as the in-place chains run it')
    ap.add_argument('--row-chunks', default=None, help='NHWC_ROW_CHUNKS values, comma-separated')
    ap.add_argument('--lane-rows', default=None, help='NHWC_LANE_ROWS values, comma-separated')
    args = ap.parse_args(argv)
    import cupy
    import numpy
    from caffeplus import kernels
    from caffeplus.kernel_sources import COMMON
    from caffeplus.kernel_sources_extra import EXTRA
    from caffeplus.layers import fused_chain
    chunk_values = [int(v) for v in (args.row_chunks or str(fused_chain.NHWC_ROW_CHUNKS)).split(',')]
    lane_values = [int(v) for v in (args.lane_rows or str(fused_chain.NHWC_LANE_ROWS)).split(',')]
    launches = [(ch, lr) for ch in chunk_values for lr in lane_values]

    def launch(m, c, chunks_cap, lane_rows):
        saved = fused_chain.NHWC_ROW_CHUNKS, fused_chain.NHWC_LANE_ROWS
        fused_chain.NHWC_ROW_CHUNKS, fused_chain.NHWC_LANE_ROWS = chunks_cap, lane_rows
        try:
            return fused_chain.nhwc_vec_launch(m, c, 8)
        finally:
            fused_chain.NHWC_ROW_CHUNKS, fused_chain.NHWC_LANE_ROWS = saved
    head = '#include <cuda_fp16.h>\n#define CP_A __half\n'
    variants = []
    for item in args.variants.split(','):
        name, _, path = item.partition('=')
        try:
            mod = cupy.RawModule(code=head + COMMON + EXTRA + _source(path or name),
                                 options=kernels.COMPILE_OPTIONS)
            mod.get_function(KERNELS[0][0])
        except Exception as exc:        # (the other variants still run)
            print('%s: does not build: %s' % (name, str(exc)[:2000]), flush=True)
            continue
        variants.append((name, mod))
        print('%s: registers a thread %s' % (name, {
            k: mod.get_function(k).num_regs for k, _, _ in KERNELS}), flush=True)
    f16, u32, i32, f32 = numpy.float16, numpy.uint32, numpy.int32, numpy.float32

    def timed(fn):
        fn()
        times = []
        for _ in range(args.reps):
            a, b = cupy.cuda.Event(), cupy.cuda.Event()
            a.record()
            fn()
            b.record()
            b.synchronize()
            times.append(cupy.cuda.get_elapsed_time(a, b) * 1e3)
        return statistics.median(times)

    totals = {}
    print('%-26s %9s %5s %10s %8s' % ('kernel', 'rows', 'C', 'us', 'GB/s'))
    for rows, c, layers in SHAPES:
        m = rows * args.batch
        x = cupy.random.standard_normal((m, c), dtype=f32).astype(f16)
        y, xn, dy, dx = (cupy.empty_like(x) for _ in range(4))
        dy[...] = x[::-1]
        one = lambda v: cupy.full(c, v, f32)      # noqa: E731
        sc, bi, ms, sd = one(1.1), one(0.1), one(0.0), one(1.0)
        md = cupy.zeros(2 * c, f32)
        nbytes = m * c * 2
        t = timed(lambda: cupy.copyto(y, x))
        print('%-26s %9d %5d %10.1f %8.0f' % ('(copy)', m, c, t, 2 * nbytes / t / 1e3))
        totals['(copy)'] = totals.get('(copy)', 0) + t * layers
        for (name, mod), (chunks_cap, lane_rows) in [(v, l) for v in variants for l in launches]:
            block, P, chunks = launch(m, c, chunks_cap, lane_rows)
            if len(launches) > 1:
                name = '%s@%d/%d' % (name, chunks_cap, lane_rows)
            part, kv = cupy.empty(2 * c * P, numpy.float64), cupy.empty(c, f32)
            calls = {
                'cp_bn_stats_part_nhwc_vec': ((P,), (x, part, kv, u32(m), u32(c), u32(P))),
                'cp_bn_apply_nhwc_vec': ((chunks,), (x, y, xn, ms, sd, sc, bi, u32(m), u32(c),
                                                     i32(FWD_FLAGS))),
                'cp_bn_bwd_part_nhwc_vec': ((P,), (dy, xn, sc, bi, part, u32(m), u32(c),
                                                   u32(P), i32(BWD_FLAGS))),
                'cp_bn_dx_nhwc_vec': ((chunks,), (dy, xn, sd, dy if args.dx_in_place else dx,
                                                  sc, bi, md, u32(m), u32(c),
                                                  i32(BWD_FLAGS)))}
            for k, reads, writes in KERNELS:
                fn = mod.get_function(k)
                grid, kargs = calls[k]
                t = timed(lambda: fn(grid, block, kargs))
                print('%-26s %9d %5d %10.1f %8.0f' % (
                    name + ':' + k.replace('cp_bn_', '').replace('_nhwc_vec', ''), m, c, t,
                    (reads + writes) * nbytes / t / 1e3))
                totals[name + ':' + k] = totals.get(name + ':' + k, 0) + t * layers
    print('ResNet-50 b%d, all its BatchNorms (ms):' % args.batch)
    for k, t in totals.items():
        print('  %-40s %8.2f' % (k, t / 1e3))
    return 0


if __name__ == '__main__':
    sys.exit(main())
