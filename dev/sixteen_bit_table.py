#!/usr/bin/env python3
"""The README's "16 bits on the GPU" table from `STEPS=amp` runs
(benchmarks/bench_gpu.py --json files): per net, caffeplus FP16 and BF16
under one plan beside PyTorch's AMP in the same type, and caffeplus's strict
FP32 and TF32 rows of the same plan, all from the file that holds the net.

    python3 dev/sixteen_bit_table.py benchmarks/gpu_16bit_*.json [--plan shared:timed]
"""
import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.bench_gpu import amp_peers, caffeplus_row, parse_net  # noqa: E402

NAMES = {'alexnet_b128': "AlexNet b128 (BVLC's)", 'alexnettv_b128': "AlexNet b128 (torchvision's)",
         'googlenet_b64': 'GoogLeNet b64', 'vgg16_b64': 'VGG-16 b64',
         'resnet50_b64': 'ResNet-50 b64', 'resnet50_b256': 'ResNet-50 b256'}


def table(rows, plan):
    ok = [r for r in rows if 'error' not in r]
    nets = sorted({r['net'] for r in ok if r['framework'] == 'caffeplus'},
                  key=lambda n: list(NAMES).index(n) if n in NAMES else len(NAMES))
    out = ['| net | caffeplus FP16 | AMP FP16 | speed, peak against AMP | caffeplus BF16 | '
           'AMP BF16 | speed, peak against AMP | FP32 | TF32 | FP16, BF16 against FP32 | '
           'FP16, BF16 against TF32 |', '|' + '---|' * 11]
    amp = amp_peers(ok)
    for net in nets:
        fp32, tf32 = caffeplus_row(ok, net, plan + '/strict'), caffeplus_row(ok, net, plan, True)
        cells = [NAMES.get(net, net)]
        mine = {}
        for kind in ('fp16', 'bf16'):
            r, a = caffeplus_row(ok, net, plan + '/' + kind), amp.get((net, kind))
            mine[kind] = r
            cells.append('%.1f ms, %s MiB' % (r['median_ms'], format(round(r['peak_used_mib']), ','))
                         if r else '-')
            cells.append('%.1f ms, %s MiB' % (a['median_ms'], format(round(a['peak_used_mib']), ','))
                         if a else '-')
            cells.append('%.2fx, %.2fx' % (a['median_ms'] / r['median_ms'],
                                           r['peak_used_mib'] / a['peak_used_mib'])
                         if r and a else '-')
        for base in (fp32, tf32):
            cells.append('%.1f ms' % base['median_ms'] if base else '-')
        for base in (fp32, tf32):
            cells.append(', '.join('%.2fx' % (base['median_ms'] / mine[k]['median_ms'])
                                   if base and mine[k] else '-' for k in ('fp16', 'bf16')))
        out.append('| ' + ' | '.join(cells) + ' |')
    return '\n'.join(out)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    ap.add_argument('runs', nargs='+', help='bench_gpu.py --json files')
    ap.add_argument('--plan', default='shared:timed')
    args = ap.parse_args(argv)
    rows = []
    for path in args.runs:
        rows += json.load(open(path))
    for r in rows:
        parse_net(r['net'])       # an unknown net name stops here, named
    print(table(rows, args.plan))
    return 0


if __name__ == '__main__':
    sys.exit(main())
