#!/usr/bin/env python3
"""Localise an offload-vs-shared difference on the GPU (deterministic math).

    python3 dev/offload_race_probe.py resnet50 --batch 4 --iters 6

Trains the model (dev/check_plans_equal.py's nets) under `shared`, then
under `offload` (policy all, look-ahead 1) in variants, and prints, for
each, the first iteration whose loss differs and the parameter blobs that
differ: plain; nographs (cuDNN calls made directly, not replayed as CUDA
graphs); nochains (fused kernels off: the generic layers); syncout (the
device synchronised after every copy out is enqueued, so copies out
finish before anything else runs); syncin (likewise after every copy in);
fused (runtime option fused_chains: the BatchNorm->Scale->ReLU and
Eltwise->ReLU chains stay fused under offload, as under shared; the plain
variant runs them unfused, offload's default); fused-bn and fused-sum (only
the BatchNorm chains, or only the Eltwise->ReLU chains, fused, in both
plans).
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    ap.add_argument('model')
    ap.add_argument('--batch', type=int, default=4)
    ap.add_argument('--iters', type=int, default=6)
    ap.add_argument('--variants', default='plain,fused,nographs,nochains,syncout,syncin')
    args = ap.parse_args(argv)
    import tempfile
    import cupy
    from caffeplus import kernels
    from caffeplus.cudnn import api
    from caffeplus.memory import offload_runtime
    from dev import check_plans_equal as cpe
    work = tempfile.mkdtemp()
    param, test_nets = cpe.net_param(args.model, work, args.batch)

    from caffeplus.layers import fused_chain as L
    real_find = L._find_chains

    def run(plan, variant='plain', **kw):
        api.set_graphs(variant != 'nographs')
        keep = {'fused-bn': L._Chain, 'fused-sum': L._SumChain}.get(variant)
        L._find_chains = real_find if keep is None else \
            (lambda net: [c for c in real_find(net) if isinstance(c, keep)])
        kernels.set_enabled(variant != 'nochains')
        real_d2h, real_h2d = offload_runtime.CupyDevice.d2h, offload_runtime.CupyDevice.h2d

        def d2h(self, view, host):
            real_d2h(self, view, host)
            cupy.cuda.Device().synchronize()

        def h2d(self, host, view):
            real_h2d(self, host, view)
            cupy.cuda.Device().synchronize()
        if variant == 'syncout':
            offload_runtime.CupyDevice.d2h = d2h
        if variant == 'syncin':
            offload_runtime.CupyDevice.h2d = h2d
        try:
            return cpe.train(param, plan, args.iters, test_nets, gpu=0, math='deterministic',
                             **kw)
        finally:
            offload_runtime.CupyDevice.d2h, offload_runtime.CupyDevice.h2d = real_d2h, real_h2d

    for variant in args.variants.split(','):
        shared = run('shared', variant)
        off = run('offload', variant, offload='all', lookahead=1,
                  runtime_options={'fused_chains': variant.startswith('fused')})
        diff = cpe.differences(shared, off)
        print('%-9s %s' % (variant, 'identical' if not diff else '; '.join(diff[:4])),
              flush=True)
    return 0


if __name__ == '__main__':
    sys.exit(main())
