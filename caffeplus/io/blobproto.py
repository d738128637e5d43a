"""`.binaryproto` files: one BlobProto (a mean image) or a BlobProtoVector."""
import numpy

from caffeplus.blob import proto_array, proto_shape
from caffeplus.errors import FormatError
from caffeplus.io.atomic import atomic_write
from caffeplus.io.prototxt import read_binary
from caffeplus.proto import caffe_pb2


def array_to_blobproto(arr, diff=None):
    proto = caffe_pb2.BlobProto()
    arr = numpy.asarray(arr, dtype=numpy.float32)
    proto.shape.dim.extend(arr.shape)
    proto.data.extend(arr.ravel().tolist())
    if diff is not None:
        proto.diff.extend(numpy.asarray(diff, numpy.float32).ravel().tolist())
    return proto


def blobproto_to_array(proto, return_diff=False):
    shape = proto_shape(proto)
    count = int(numpy.prod(shape)) if shape else 1
    which = 'diff' if return_diff else 'data'
    return proto_array(proto, which, count).reshape(shape)


def read_blobproto(path):
    return read_binary(path, caffe_pb2.BlobProto(), 'binaryproto')


def read_mean(path):
    """The array in a mean `.binaryproto` (C,H,W or N,C,H,W as stored)."""
    try:
        return blobproto_to_array(read_blobproto(path))
    except FormatError as exc:
        if path in str(exc):
            raise
        raise FormatError('%s: %s' % (path, exc))


def write_blobproto(proto, path):
    data = proto.SerializeToString()
    with atomic_write(path, 'wb') as f:
        f.write(data)


def read_blobproto_vector(path):
    vec = read_binary(path, caffe_pb2.BlobProtoVector(), 'binaryproto')
    return [blobproto_to_array(b) for b in vec.blobs]


def write_blobproto_vector(arrays, path):
    vec = caffe_pb2.BlobProtoVector()
    for a in arrays:
        vec.blobs.add().CopyFrom(array_to_blobproto(a))
    write_blobproto(vec, path)
