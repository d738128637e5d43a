"""The Data layer's throughput against one thread doing the same work the old way.

    python3 benchmarks/bench_data_pipeline.py [--images 320] [--batch 64] [--batches 15]
                                              [--repeats 3] [--workers 0] [--json out.json]

Makes two LMDBs in a temporary directory: `--images` random-looking 3 x 256 x
256 images (smooth blocks plus noise, so JPEG has real work) as JPEG-encoded
Datums, and the same images as raw uint8 Datums. For each it measures, in the
same run:

  (a) the Data layer delivering batches (crop_size 227, mirror, three
      mean_values), with --workers data workers (0: the default, one per
      core): images per second over --batches forwards after one warm-up
      forward, the consumer doing nothing else;
  (b) one thread reading the same records, decoding them with Pillow
      (Image.open, RGB -> BGR, H x W x C -> C x H x W: what the layer did
      before the workers) and transforming each image alone with the same
      TransformationParameter (DataTransformer.transform, the per-image path).

and prints the ratio (a) / (b). (a) and (b) alternate --repeats times and
the best rate of each counts, so that a busy host (other processes taking
the cores for a while) disturbs the comparison less. CPU only.
"""
import argparse
import io
import json
import os
import sys
import tempfile
import time

import numpy

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

from google.protobuf import text_format  # noqa: E402

import caffeplus  # noqa: E402
from caffeplus import log  # noqa: E402
from caffeplus.blob import Blob  # noqa: E402
from caffeplus.io import datum as datum_io  # noqa: E402
from caffeplus.io import db as db_io  # noqa: E402
from caffeplus.io import workers  # noqa: E402
from caffeplus.io.transformer import DataTransformer  # noqa: E402
from caffeplus.layer import create_layer  # noqa: E402
from caffeplus.proto import caffe_pb2  # noqa: E402

TRANSFORM = 'crop_size: 227 mirror: true mean_value: 104 mean_value: 117 mean_value: 123'
SIZE = 256


def make_images(n, seed=0):
    rs = numpy.random.RandomState(seed)
    for _ in range(n):
        base = rs.randint(0, 256, (SIZE // 8, SIZE // 8, 3)).astype(numpy.float32)
        smooth = numpy.kron(base, numpy.ones((8, 8, 1), numpy.float32))
        noise = rs.normal(0, 12, (SIZE, SIZE, 3))
        yield numpy.clip(smooth + noise, 0, 255).astype(numpy.uint8)     # H x W x RGB


def write_lmdbs(root, n):
    from PIL import Image
    jpeg_path, raw_path = os.path.join(root, 'jpeg_lmdb'), os.path.join(root, 'raw_lmdb')
    jpeg_bytes = 0
    with db_io.open_db(jpeg_path, 'lmdb', 'new') as jdb, \
            db_io.open_db(raw_path, 'lmdb', 'new') as rdb:
        for i, rgb in enumerate(make_images(n)):
            buf = io.BytesIO()
            Image.fromarray(rgb).save(buf, 'JPEG', quality=90)
            d = caffe_pb2.Datum(channels=3, height=SIZE, width=SIZE, data=buf.getvalue(),
                                encoded=True, label=i % 1000)
            jpeg_bytes += len(d.data)
            jdb.put(b'%08d' % i, d.SerializeToString())
            bgr_chw = numpy.ascontiguousarray(rgb[:, :, ::-1].transpose(2, 0, 1))
            rdb.put(b'%08d' % i, datum_io.array_to_datum(bgr_chw, i % 1000).SerializeToString())
    return jpeg_path, raw_path, jpeg_bytes / n


def data_layer_rate(source, batch, batches, count):
    """Images per second the Data layer delivers (after one warm-up forward)."""
    caffeplus.rng.set_random_seed(1)
    lp = text_format.Parse('name: "data" type: "Data" top: "data" top: "label" '
                           'transform_param { %s } data_param { source: "%s" batch_size: %d '
                           'backend: LMDB }' % (TRANSFORM, source, batch),
                           caffe_pb2.LayerParameter())
    lp.phase = caffe_pb2.TRAIN
    layer = create_layer(lp)
    tops = [Blob(), Blob()]
    with workers.setting(count or None):
        layer.setup([], tops)
    try:
        layer.forward([], tops)
        layer.timing.reset()
        t0, c0 = time.perf_counter(), time.process_time()
        for _ in range(batches):
            layer.forward([], tops)
        elapsed, cpu = time.perf_counter() - t0, time.process_time() - c0
        timing = layer.timing
        per_batch = {'read_ms': 1e3 * timing.read_s / timing.forwards,
                     'transform_ms': 1e3 * timing.transform_s / timing.forwards,
                     'cpu_ms_per_image': 1e3 * cpu / (batch * batches)}
        return batch * batches / elapsed, layer.data_workers, per_batch
    finally:
        layer.close()


def pillow_decode(value):
    """The per-image decode the layer did before: Pillow, RGB -> BGR, C x H x W."""
    from PIL import Image
    datum = caffe_pb2.Datum()
    datum.ParseFromString(value)
    if not datum.encoded:
        return numpy.frombuffer(datum.data, numpy.uint8).reshape(
            datum.channels, datum.height, datum.width)
    rgb = numpy.asarray(Image.open(io.BytesIO(datum.data)).convert('RGB'))
    return numpy.ascontiguousarray(rgb[:, :, ::-1].transpose(2, 0, 1))


def one_thread_rate(source, batch, batches):
    """Images per second of one thread: read, decode with Pillow, transform per image."""
    caffeplus.rng.set_random_seed(1)
    t = DataTransformer(text_format.Parse(TRANSFORM, caffe_pb2.TransformationParameter()),
                        caffe_pb2.TRAIN)
    t.init_rand()
    reader = db_io.RecordReader(source, 'lmdb')
    try:
        def one_batch():
            out = numpy.empty((batch, 3, 227, 227), numpy.float32)
            for i in range(batch):
                _, value = reader.next()
                t.transform(pillow_decode(value), out[i])
            return out
        one_batch()
        t0, c0 = time.perf_counter(), time.process_time()
        for _ in range(batches):
            one_batch()
        images = batch * batches
        return images / (time.perf_counter() - t0), 1e3 * (time.process_time() - c0) / images
    finally:
        reader.close()


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    p.add_argument('--images', type=int, default=320)
    p.add_argument('--batch', type=int, default=64)
    p.add_argument('--batches', type=int, default=15)
    p.add_argument('--repeats', type=int, default=3, help='alternating runs of (a) and (b)')
    p.add_argument('--workers', type=int, default=0, help='data workers (0: the default)')
    p.add_argument('--json', default='', help='also write the figures to this file')
    args = p.parse_args(argv)
    log.logger.setLevel('WARNING')
    results = {'host_cores': workers.host_cores(), 'load_average': os.getloadavg(),
               'images': args.images, 'batch': args.batch, 'batches': args.batches}
    with tempfile.TemporaryDirectory(prefix='bench_data_pipeline_') as root:
        jpeg_path, raw_path, jpeg_size = write_lmdbs(root, args.images)
        results['mean_jpeg_bytes'] = jpeg_size
        print('host: %d cores, load average %.2f %.2f %.2f'
              % ((results['host_cores'],) + tuple(results['load_average'])))
        print('%d images of 3 x %d x %d (JPEG %.0f bytes on average); batch %d, crop 227, '
              'mirror, mean values; %d timed batches'
              % (args.images, SIZE, SIZE, jpeg_size, args.batch, args.batches))
        for kind, path in (('JPEG', jpeg_path), ('raw', raw_path)):
            rates, bases = [], []
            for _ in range(args.repeats):
                rates.append(data_layer_rate(path, args.batch, args.batches, args.workers))
                bases.append(one_thread_rate(path, args.batch, args.batches))
            rate, count, per_batch = max(rates, key=lambda r: r[0])
            base, base_cpu = max(bases)
            results[kind] = {'data_layer_images_per_s': rate, 'data_workers': count,
                             'one_thread_pillow_images_per_s': base, 'ratio': rate / base,
                             'one_thread_cpu_ms_per_image': base_cpu,
                             'all_data_layer': [r[0] for r in rates],
                             'all_one_thread': [b[0] for b in bases], **per_batch}
            print('%-4s Data layer (%d workers): %7.1f images/s, %.2f CPU ms an image (a '
                  'batch: read and decode %.1f ms, transform %.1f ms)'
                  % (kind, count, rate, per_batch['cpu_ms_per_image'], per_batch['read_ms'],
                     per_batch['transform_ms']))
            print('%-4s one thread, Pillow + per-image transform: %7.1f images/s, %.2f CPU ms '
                  'an image' % (kind, base, base_cpu))
            print('%-4s ratio: %.2fx' % (kind, rate / base))
    if args.json:
        with open(args.json, 'w') as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == '__main__':
    sys.exit(main())
