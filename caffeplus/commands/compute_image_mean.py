"""caffeplus compute_image_mean: Caffe's compute_image_mean.

    caffeplus compute_image_mean [--backend lmdb] INPUT_DB [OUTPUT_FILE]

Averages every Datum of INPUT_DB (raw uint8 pixels, float_data, or encoded
images, decoded natively) into a 1 x C x H x W BlobProto and writes it to
OUTPUT_FILE (a .binaryproto) byte for byte as stock Caffe does: the same
legacy num/channels/height/width fields and the same float32 arithmetic
(a running float32 sum, divided by the count). Logs the per-channel means.
"""
import sys

import numpy

from caffeplus import log
from caffeplus.errors import FormatError
from caffeplus.io import datum as datum_io
from caffeplus.io import db as db_io
from caffeplus.io.atomic import atomic_write
from caffeplus.proto import caffe_pb2

LOG_EVERY = 10000


def add_arguments(parser):
    parser.add_argument('input_db', metavar='INPUT_DB', help='the Datum database')
    parser.add_argument('output_file', metavar='OUTPUT_FILE', nargs='?',
                        help='where to write the mean .binaryproto (optional)')
    parser.add_argument('--backend', default='lmdb',
                        help='The backend {leveldb, lmdb} containing the images')


def _values(datum, key, source):
    """The datum's values as float32, decoding an encoded one natively."""
    if datum.encoded:
        arr = datum_io.datum_to_array(datum, key, datum_io.UNCHANGED)
        return arr.astype(numpy.float32).ravel(), arr.shape
    c, h, w = datum_io.datum_shape(datum, key)
    size = max(len(datum.data), len(datum.float_data))
    if size != c * h * w:
        raise FormatError('Incorrect data field size %d: datum %s in %s holds %d values but '
                          'claims %d x %d x %d' % (size, _key(key), source, size, c, h, w))
    if len(datum.data):
        vals = numpy.frombuffer(datum.data, dtype=numpy.uint8).astype(numpy.float32)
    else:
        vals = numpy.asarray(datum.float_data, dtype=numpy.float32)
    return vals, (c, h, w)


def _key(key):
    return key.decode('utf-8', 'replace') if isinstance(key, bytes) else str(key)


def compute_mean(source, backend='lmdb'):
    """The mean BlobProto of a database, exactly as stock Caffe computes it."""
    db = db_io.open_db(source, db_io.backend_name(backend), 'r')
    try:
        cursor = db.cursor()
        cursor.seek_to_first()
        if not cursor.valid():
            raise FormatError('database %s is empty: no mean to compute' % source)
        first = datum_io.parse_datum(cursor.value(), cursor.key(), source)
        if first.encoded:
            log.info('Decoding Datum')
        _, shape = _values(first, cursor.key(), source)
        total = None
        count = 0
        log.info('Starting iteration')
        while cursor.valid():
            key = cursor.key()
            datum = datum_io.parse_datum(cursor.value(), key, source)
            vals, this_shape = _values(datum, key, source)
            if vals.size != int(numpy.prod(shape)):
                raise FormatError('Incorrect data field size %d: datum %s in %s is %s, the '
                                  'first datum was %s' % (vals.size, _key(key), source,
                                                          'x'.join(map(str, this_shape)),
                                                          'x'.join(map(str, shape))))
            if total is None:
                total = numpy.zeros(vals.size, dtype=numpy.float32)
            total += vals            # float32, record by record, as Caffe's float sum
            count += 1
            if count % LOG_EVERY == 0:
                log.info('Processed %d files.', count)
            cursor.next()
        if count % LOG_EVERY != 0:
            log.info('Processed %d files.', count)
    finally:
        db.close()
    mean = total / numpy.float32(count)
    blob = caffe_pb2.BlobProto()
    blob.num = 1
    blob.channels, blob.height, blob.width = (int(d) for d in shape)
    blob.data.extend(mean.tolist())
    return blob, mean.reshape(shape)


def channel_means(mean_chw):
    """Caffe's per-channel means: a float32 running sum over H*W, divided by H*W."""
    c = mean_chw.shape[0]
    flat = mean_chw.reshape(c, -1).astype(numpy.float32)
    dim = flat.shape[1]
    return [float(numpy.cumsum(flat[i], dtype=numpy.float32)[-1] / numpy.float32(dim))
            if dim else 0.0 for i in range(c)]


def run(args):
    blob, mean = compute_mean(args.input_db, args.backend)
    if args.output_file:
        log.info('Write to %s', args.output_file)
        with atomic_write(args.output_file, 'wb') as f:
            f.write(blob.SerializeToString())
    log.info('Number of channels: %d', blob.channels)
    for c, value in enumerate(channel_means(mean)):
        log.info('mean_value channel [%d]: %g', c, numpy.float32(value))
    return 0


def main(argv=None):
    from caffeplus import cli
    return cli.main(['compute_image_mean'] + list(sys.argv[1:] if argv is None else argv))
