#!/usr/bin/env python3
"""Training throughput from a real input pipeline against DummyData, on the GPU.

For each bench net (../tests/data/bench: AlexNet b128, ResNet-50 b64 by
default) this makes LMDBs of random 3x256x256 images, raw and JPEG-encoded
(as `convert_imageset` and `convert_imageset --encoded` would), swaps the
net's DummyData for a Data layer over them (`crop_size` 227 or 224,
`mirror: true`, three `mean_value`s), and runs `caffeplus train -gpu 0`
on each input in turn, in this one run:

  constant  DummyData with constant fillers (filled once: compute-bound)
  raw       Data over raw uint8 Datums
  jpeg      Data over JPEG-encoded Datums
  raw_host, jpeg_host   the same with TRANSFORM_ON_HOST (layers/data.py): transformed
            on the host, the float32 batch copied (not run by default)

and prints ms per iteration (from the log's timestamps, iterations
--first to --last) and each input's throughput as a fraction of constant's.

The images are smooth random fields plus noise, so that their JPEGs are the
size of photographs' (about 25 KB at quality 90), not of white noise.

    python3 benchmarks/bench_data_gpu.py [--nets alexnet_b128,resnet50_b64]
        [--images 2048] [--workers N] [--math tf32] [--precision fp16] [--json out.json]

A 16-bit net (--precision fp16 or bf16) takes a batch in about half FP32's
time, so the input pipeline must deliver twice the images a second:
`--precision` shows whether it does. Nets: the bench set's, and
torchvision's AlexNet (alexnettv_b128, benchmarks/nets/).
"""
import argparse
import io
import json
import os
import re
import subprocess
import sys
import tempfile
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCH = os.path.join(ROOT, 'tests', 'data', 'bench')
sys.path.insert(0, ROOT)
from benchmarks.bench_gpu import net_path  # noqa: E402  (bench set, else benchmarks/nets)
CROP = {'alexnet_b128': 227}
MEANS = (104, 117, 123)
STAMP = re.compile(r'^I\d{4,8} (\d\d):(\d\d):(\d\d\.\d+) .*Iteration (\d+)[ ,]')


def smooth_images(n, seed=0, size=256):
    """n uint8 images (C, H, W) in BGR: random low-frequency fields plus noise."""
    from PIL import Image
    rng = np.random.default_rng(seed)
    for _ in range(n):
        coarse = rng.integers(0, 256, size=(8, 8, 3), dtype=np.uint8)
        img = np.asarray(Image.fromarray(coarse).resize((size, size), Image.BICUBIC), dtype=np.int16)
        img = img + rng.integers(-12, 13, size=img.shape, dtype=np.int16)
        yield np.clip(img, 0, 255).astype(np.uint8).transpose(2, 0, 1)


def make_lmdbs(folder, n):
    """Raw and JPEG LMDBs of the same n images; returns their paths."""
    import lmdb
    from PIL import Image
    sys.path.insert(0, ROOT)
    from caffeplus.proto import caffe_pb2
    paths = {'raw': os.path.join(folder, 'raw_lmdb'), 'jpeg': os.path.join(folder, 'jpeg_lmdb')}
    envs = {k: lmdb.open(p, map_size=1 << 34) for k, p in paths.items()}
    txns = {k: e.begin(write=True) for k, e in envs.items()}
    jpeg_bytes = 0
    for i, chw in enumerate(smooth_images(n)):
        key = b'%08d' % i
        d = caffe_pb2.Datum(channels=3, height=chw.shape[1], width=chw.shape[2],
                            data=chw.tobytes(), label=i % 1000)
        txns['raw'].put(key, d.SerializeToString())
        buf = io.BytesIO()
        # The file holds RGB; the decoder gives BGR back, as OpenCV does.
        Image.fromarray(chw[::-1].transpose(1, 2, 0)).save(buf, format='JPEG', quality=90)
        e = caffe_pb2.Datum(label=i % 1000, encoded=True, data=buf.getvalue())
        jpeg_bytes += len(buf.getvalue())
        txns['jpeg'].put(key, e.SerializeToString())
    for k in txns:
        txns[k].commit()
        envs[k].close()
    return paths, jpeg_bytes / n


def data_layer(source, batch, crop):
    means = ''.join('    mean_value: %d\n' % m for m in MEANS)
    return ('layer {\n  name: "data"\n  type: "Data"\n  top: "data"\n  top: "label"\n'
            '  include { phase: TRAIN }\n'
            '  transform_param {\n    crop_size: %d\n    mirror: true\n%s  }\n'
            '  data_param {\n    source: "%s"\n    batch_size: %d\n    backend: LMDB\n  }\n}\n'
            % (crop, means, source, batch))


def swap_input(text, replacement):
    """The net's text with its first layer (the DummyData) replaced."""
    start = text.index('layer {')
    depth, i = 0, start
    while True:
        if text[i] == '{':
            depth += 1
        elif text[i] == '}':
            depth -= 1
            if depth == 0:
                break
        i += 1
    return text[:start] + replacement + text[i + 1:]


def constant_input(text):
    return re.sub(r'data_filler \{[^}]*\}', 'data_filler { type: "constant" value: 0.5 }', text, count=1)


def batch_of(text):
    return int(re.search(r'shape \{ dim: (\d+)', text).group(1))


def solver_text(net_path, iters, prefix):
    return ('net: "%s"\nbase_lr: 0.001\nmomentum: 0.9\nlr_policy: "fixed"\nweight_decay: 0.0005\n'
            'display: 10\nmax_iter: %d\nsnapshot: 0\nsnapshot_prefix: "%s"\nsolver_mode: GPU\n'
            % (net_path, iters, prefix))


def ms_per_iter(log, first, last):
    times = {}
    for line in log.splitlines():
        m = STAMP.match(line)
        if m:
            h, mi, s, it = m.groups()
            times[int(it)] = int(h) * 3600 + int(mi) * 60 + float(s)
    if first not in times or last not in times:
        return None
    return 1000.0 * (times[last] - times[first]) / (last - first)


# `caffeplus train` with Data transforming on the host (layers/data.py's
# TRANSFORM_ON_HOST, a comparison switch and no user setting).
ON_HOST_MAIN = ('import sys; from caffeplus.layers import data; data.TRANSFORM_ON_HOST = True; '
                'from caffeplus.cli import main; sys.exit(main(sys.argv[1:]))')


def run_train(folder, name, net_text, args, on_host=False):
    net_path = os.path.join(folder, name + '.prototxt')
    with open(net_path, 'w') as f:
        f.write(net_text)
    solver = os.path.join(folder, name + '_solver.prototxt')
    with open(solver, 'w') as f:
        f.write(solver_text(net_path, args.last + 10, os.path.join(folder, name)))
    start = [sys.executable, '-c', ON_HOST_MAIN] if on_host else [sys.executable, '-m', 'caffeplus']
    cmd = start + ['train', '-solver', solver, '-gpu', str(args.gpu)]
    if args.workers:
        cmd += ['--data_workers', str(args.workers)]
    if args.math:
        cmd += ['--math', args.math]
    if args.precision:
        cmd += ['--precision', args.precision]
    t = time.time()
    p = subprocess.run(cmd, cwd=folder, capture_output=True, text=True)
    log = p.stdout + p.stderr
    if p.returncode != 0:
        print(log[-3000:], file=sys.stderr)
        return None, time.time() - t, log
    return ms_per_iter(log, args.first, args.last), time.time() - t, log


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    ap.add_argument('--nets', default='alexnet_b128,resnet50_b64')
    ap.add_argument('--images', type=int, default=2048)
    ap.add_argument('--inputs', default='constant,raw,jpeg')
    ap.add_argument('--workers', type=int, default=0, help='--data_workers (0: the default)')
    ap.add_argument('--gpu', type=int, default=0)
    ap.add_argument('--first', type=int, default=20)
    ap.add_argument('--last', type=int, default=50)
    ap.add_argument('--math', help='--math of caffeplus train (strict, the default; tf32)')
    ap.add_argument('--precision', choices=('fp32', 'tf32', 'fp16', 'bf16'),
                    help='--precision of caffeplus train (the nets as written, FP32, by default)')
    ap.add_argument('--json')
    ap.add_argument('--logs', help='folder for the training logs')
    args = ap.parse_args(argv)
    results = []
    with tempfile.TemporaryDirectory(prefix='caffeplus-bench-data-') as folder:
        lmdbs, jpeg_size = {}, 0
        if set(args.inputs.split(',')) - {'constant'}:
            t = time.time()
            lmdbs, jpeg_size = make_lmdbs(folder, args.images)
            print('made %d images (raw and JPEG, %.1f KB a JPEG) in %.1f s'
                  % (args.images, jpeg_size / 1024, time.time() - t), flush=True)
        print('| net | input | ms / iteration | images / s | of constant |')
        print('|---|---|---|---|---|')
        for net in args.nets.split(','):
            with open(net_path(BENCH, net)) as f:
                text = f.read()
            batch, crop = batch_of(text), CROP.get(net, 224)
            base = None
            for inp in args.inputs.split(','):
                db = inp[:-len('_host')] if inp.endswith('_host') else inp
                body = (constant_input(text) if inp == 'constant'
                        else swap_input(text, data_layer(lmdbs[db], batch, crop)))
                ms, wall, log = run_train(folder, '%s_%s' % (net, inp), body, args,
                                          on_host=inp.endswith('_host'))
                if args.logs:
                    os.makedirs(args.logs, exist_ok=True)
                    with open(os.path.join(args.logs, '%s_%s.log' % (net, inp)), 'w') as f:
                        f.write(log)
                if inp == 'constant':
                    base = ms
                frac = (base / ms) if (ms and base) else None
                results.append({'net': net, 'input': inp, 'ms': ms, 'batch': batch,
                                'of_constant': frac, 'wall_s': wall})
                print('| %s | %s | %s | %s | %s |' % (
                    net, inp, '%.1f' % ms if ms else 'failed',
                    '{:,.0f}'.format(batch * 1000 / ms) if ms else '',
                    '%.0f%%' % (100 * frac) if frac else ''), flush=True)
    if args.json:
        with open(args.json, 'w') as f:
            json.dump({'images': args.images, 'jpeg_kb': jpeg_size / 1024, 'math': args.math or 'strict',
                       'precision': args.precision or 'as written', 'results': results}, f,
                      indent=1)
    return 0


if __name__ == '__main__':
    sys.exit(main())
