"""caffeplus extract_features: Caffe's extract_features.

    caffeplus extract_features WEIGHTS MODEL BLOB[,BLOB...] DB[,DB...] NUM_MINI_BATCHES \\
        lmdb|leveldb [CPU|GPU] [DEVICE_ID]

Builds MODEL (a net prototxt, usually with a Data layer) in the TEST phase
with WEIGHTS, runs NUM_MINI_BATCHES forward passes and writes, for each
named blob, one Datum per item of the batch to the matching new database:
float_data holds the item's values, channels/height/width the blob's
(legacy) shape, keys are the item number as %010d. As Caffe does.
"""
import sys

from caffeplus import backend, log
from caffeplus.errors import CaffeplusError
from caffeplus.io import db as db_io
from caffeplus.proto import caffe_pb2

COMMIT_EVERY = 1000


def add_arguments(parser):
    parser.add_argument('weights', metavar='WEIGHTS', help='pretrained .caffemodel (or .h5)')
    parser.add_argument('model', metavar='MODEL', help='feature extraction net prototxt')
    parser.add_argument('blob_names', metavar='BLOB[,BLOB...]', help='blobs to extract')
    parser.add_argument('dataset_names', metavar='DB[,DB...]',
                        help='one database to create per blob')
    parser.add_argument('num_mini_batches', metavar='NUM_MINI_BATCHES', type=int)
    parser.add_argument('db_type', metavar='DB_TYPE', help='lmdb or leveldb')
    parser.add_argument('mode', metavar='CPU|GPU', nargs='?', default='CPU')
    parser.add_argument('device_id', metavar='DEVICE_ID', nargs='?', type=int, default=0)


def feature_datum(blob_data, n, shape):
    """Caffe's Datum for item n of a blob: legacy shape fields and float_data."""
    datum = caffe_pb2.Datum()
    datum.height, datum.width, datum.channels = shape
    datum.float_data.extend(blob_data[n].ravel().tolist())
    return datum


def run(args):
    from caffeplus.net import TEST, Net
    mode = args.mode.upper()
    if mode == 'GPU':
        log.error('Using GPU')
        log.error('Using Device_id=%d', args.device_id)
        backend.set_mode_gpu(args.device_id)
    elif mode == 'CPU':
        log.error('Using CPU')
        backend.set_mode_cpu()
    else:
        raise CaffeplusError("the mode must be CPU or GPU, not '%s'" % args.mode)
    net = Net(args.model, TEST, weights=args.weights)
    blob_names = args.blob_names.split(',')
    dataset_names = args.dataset_names.split(',')
    if len(blob_names) != len(dataset_names):
        raise CaffeplusError('the number of blob names (%d) and dataset names (%d) must be equal'
                             % (len(blob_names), len(dataset_names)))
    for name in blob_names:
        if name not in net.blobs:
            raise CaffeplusError('Unknown feature blob name %s in the network %s (blobs: %s)'
                                 % (name, args.model, ', '.join(net.blobs)))
    if args.num_mini_batches < 0:
        raise CaffeplusError('NUM_MINI_BATCHES must be >= 0, not %d' % args.num_mini_batches)
    kind = db_io.backend_name(args.db_type)
    dbs = []
    try:
        for name in dataset_names:
            log.info('Opening dataset %s', name)
            dbs.append(db_io.open_db(name, kind, 'new'))
        log.error('Extracting Features')
        indices = [0] * len(blob_names)
        for _ in range(args.num_mini_batches):
            net.forward_prefilled()
            for i, name in enumerate(blob_names):
                blob = net.blobs[name]
                data = backend.to_numpy(blob.data)
                num = blob.shape[0] if blob.num_axes else 1
                data = data.reshape(num, -1)
                shape = (blob.legacy_shape(2), blob.legacy_shape(3), blob.legacy_shape(1)) \
                    if blob.num_axes <= 4 else (1, 1, data.shape[1])
                for n in range(num):
                    datum = feature_datum(data, n, shape)
                    dbs[i].put(b'%010d' % indices[i], datum.SerializeToString())
                    indices[i] += 1
                    if indices[i] % COMMIT_EVERY == 0:
                        dbs[i].commit()
                        log.error('Extracted features of %d query images for feature blob %s',
                                  indices[i], name)
        for i, name in enumerate(blob_names):
            if indices[i] % COMMIT_EVERY != 0:
                dbs[i].commit()
                log.error('Extracted features of %d query images for feature blob %s',
                          indices[i], name)
    finally:
        for db in dbs:
            db.close()
    log.error('Successfully extracted the features!')
    return 0


def main(argv=None):
    from caffeplus import cli
    return cli.main(['extract_features'] + list(sys.argv[1:] if argv is None else argv))
