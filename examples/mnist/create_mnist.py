#!/usr/bin/env python3
"""Build examples/mnist/mnist_{train,test}_lmdb from MNIST files you already have.

Give the folder holding the four IDX files (train-images-idx3-ubyte,
train-labels-idx1-ubyte, t10k-images-idx3-ubyte, t10k-labels-idx1-ubyte;
gzipped .gz versions work too), as Caffe's create_mnist.sh expects:

    python examples/mnist/create_mnist.py /path/to/mnist
    caffeplus train --solver examples/mnist/lenet_solver.prototxt
"""
import gzip
import os
import struct
import sys

import lmdb
import numpy

HERE = os.path.dirname(os.path.abspath(__file__))


def _open(folder, name):
    for candidate in (name, name + '.gz'):
        path = os.path.join(folder, candidate)
        if os.path.exists(path):
            return gzip.open(path, 'rb') if path.endswith('.gz') else open(path, 'rb')
    sys.exit('create_mnist: %s not found in %s' % (name, folder))


def read_idx(folder, name, magic):
    with _open(folder, name) as f:
        header = f.read(4)
        if struct.unpack('>I', header)[0] != magic:
            sys.exit('create_mnist: %s is not an MNIST IDX file (bad magic number)' % name)
        ndim = magic & 0xFF
        dims = struct.unpack('>' + 'I' * ndim, f.read(4 * ndim))
        data = numpy.frombuffer(f.read(), dtype=numpy.uint8)
    if data.size != int(numpy.prod(dims)):
        sys.exit('create_mnist: %s is truncated' % name)
    return data.reshape(dims)


def convert(folder, images_name, labels_name, out):
    from caffeplus.proto import caffe_pb2
    images = read_idx(folder, images_name, 0x00000803)
    labels = read_idx(folder, labels_name, 0x00000801)
    if len(images) != len(labels):
        sys.exit('create_mnist: %d images but %d labels' % (len(images), len(labels)))
    env = lmdb.open(out, map_size=1 << 30)
    with env.begin(write=True) as txn:
        for i, (img, label) in enumerate(zip(images, labels)):
            datum = caffe_pb2.Datum(channels=1, height=img.shape[0], width=img.shape[1],
                                    data=img.tobytes(), label=int(label))
            txn.put(('%08d' % i).encode('ascii'), datum.SerializeToString())
    env.close()
    print('wrote %d items to %s' % (len(images), out))


def main():
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    folder = sys.argv[1]
    convert(folder, 'train-images-idx3-ubyte', 'train-labels-idx1-ubyte',
            os.path.join(HERE, 'mnist_train_lmdb'))
    convert(folder, 't10k-images-idx3-ubyte', 't10k-labels-idx1-ubyte',
            os.path.join(HERE, 'mnist_test_lmdb'))


if __name__ == '__main__':
    main()
