#!/usr/bin/env python3
"""JPEG decoding speed: caffeplus's CPU workers against NVIDIA's nvJPEG.

Encodes --images random 3x256x256 images as bench_data_gpu.py does (smooth
fields plus noise, quality 90), then decodes them all, in this one run:

  cpu     caffeplus.io.datum.decode_image (libjpeg-turbo through simplejpeg)
          on a WorkerPool of --workers threads, into C x H x W BGR, the way
          a Data layer's workers decode;
  nvjpeg  torchvision.io.decode_jpeg(list of encoded tensors, device='cuda')
          in batches of --batch, the encoded bytes copied to the GPU first
          and the device synchronised at the end (skipped when torch,
          torchvision or CUDA is missing).

and prints images per second (best of --repeat passes), and how nvJPEG's
pixels compare with libjpeg-turbo's (identical values, largest difference),
since its IDCT and upsampling may round differently.

    python3 benchmarks/bench_jpeg_decoders.py [--images 2048] [--workers 16]
        [--batch 128] [--json out.json]
"""
import argparse
import io
import json
import os
import sys
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def encoded_images(n, quality=90):
    from PIL import Image
    from benchmarks.bench_data_gpu import smooth_images
    out = []
    for chw in smooth_images(n):
        buf = io.BytesIO()
        Image.fromarray(chw[::-1].transpose(1, 2, 0)).save(buf, format='JPEG', quality=quality)
        out.append(buf.getvalue())
    return out


def best_rate(run, n, repeat):
    best = None
    for _ in range(repeat):
        t = time.perf_counter()
        result = run()
        dt = time.perf_counter() - t
        best = dt if best is None else min(best, dt)
    return n / best, result


def cpu_decode(jpegs, workers, repeat):
    from caffeplus.io import datum as datum_io
    from caffeplus.io.workers import WorkerPool
    pool = WorkerPool(workers, 'bench')
    try:
        pool.map(datum_io.decode_image, jpegs[:workers * 2])      # threads started
        return best_rate(lambda: pool.map(datum_io.decode_image, jpegs), len(jpegs), repeat)
    finally:
        pool.close()


def nvjpeg_decode(jpegs, batch, repeat):
    import torch
    import torchvision
    from torchvision.io import decode_jpeg
    if not torch.cuda.is_available():
        raise RuntimeError('torch sees no CUDA device')
    tensors = [torch.frombuffer(bytearray(j), dtype=torch.uint8) for j in jpegs]

    def run():
        out = []
        for lo in range(0, len(tensors), batch):
            out.extend(decode_jpeg(tensors[lo:lo + batch], device='cuda'))
        torch.cuda.synchronize()
        return out
    run()                                   # nvJPEG's handles and buffers made
    rate, out = best_rate(run, len(jpegs), repeat)
    return rate, out, torchvision.__version__


def compare(cpu_chw_bgr, gpu_chw_rgb):
    same = total = 0
    worst = 0
    for c, g in zip(cpu_chw_bgr, gpu_chw_rgb):
        g = g.cpu().numpy()[::-1]           # RGB -> BGR
        d = np.abs(c.astype(np.int16) - g.astype(np.int16))
        same += int((d == 0).sum())
        total += d.size
        worst = max(worst, int(d.max()))
    return same / total, worst


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    ap.add_argument('--images', type=int, default=2048)
    ap.add_argument('--workers', type=int, default=os.cpu_count())
    ap.add_argument('--batch', type=int, default=128)
    ap.add_argument('--repeat', type=int, default=3)
    ap.add_argument('--json')
    args = ap.parse_args(argv)
    jpegs = encoded_images(args.images)
    kb = sum(map(len, jpegs)) / len(jpegs) / 1024
    print('%d JPEGs of 256 x 256, %.1f KB each' % (len(jpegs), kb))
    result = {'images': len(jpegs), 'jpeg_kb': kb, 'workers': args.workers,
              'batch': args.batch}
    rate, cpu_pixels = cpu_decode(jpegs, args.workers, args.repeat)
    result['cpu_images_per_s'] = rate
    print('cpu (simplejpeg, %d workers): %.0f images/s' % (args.workers, rate))
    try:
        rate, gpu_pixels, tv = nvjpeg_decode(jpegs, args.batch, args.repeat)
    except Exception as exc:    # reported, not fatal: the CPU figure stands
        print('nvjpeg: not measured (%s: %s)' % (type(exc).__name__, exc))
        result['nvjpeg_error'] = str(exc)
    else:
        same, worst = compare(cpu_pixels, gpu_pixels)
        result.update(nvjpeg_images_per_s=rate, torchvision=tv, identical_fraction=same,
                      max_abs_difference=worst)
        print('nvjpeg (torchvision %s, batches of %d): %.0f images/s, %.2fx the CPU'
              % (tv, args.batch, rate, rate / result['cpu_images_per_s']))
        print('pixels identical to libjpeg-turbo\'s: %.4f%%, largest difference %d'
              % (100 * same, worst))
    if args.json:
        with open(args.json, 'w') as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == '__main__':
    sys.exit(main())
