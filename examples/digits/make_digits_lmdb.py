#!/usr/bin/env python3
"""Build the bundled handwritten-digits example: two LMDBs of Caffe Datums.

The images are scikit-learn's digits set (1,797 8x8 images shipped inside
the package, no download), scaled onto 28x28 like MNIST so BVLC's LeNet
runs unchanged. The last 297 images (a fixed, shuffled split) are the test
set. Usage: python examples/digits/make_digits_lmdb.py [--force]
"""
import os
import sys

import lmdb
import numpy
from PIL import Image

HERE = os.path.dirname(os.path.abspath(__file__))
TRAIN_DB = os.path.join(HERE, 'digits_train_lmdb')
TEST_DB = os.path.join(HERE, 'digits_test_lmdb')
NUM_TEST = 297


def load_digits_28x28():
    try:
        from sklearn.datasets import load_digits
    except ImportError:
        sys.exit('make_digits_lmdb: needs scikit-learn (pip install scikit-learn)')
    digits = load_digits()
    images = numpy.empty((len(digits.images), 28, 28), dtype=numpy.uint8)
    for i, img in enumerate(digits.images):
        # sklearn's pixels are 0..16; spread to 0..255, then upscale with a
        # 2-pixel border as MNIST digits have.
        small = Image.fromarray(numpy.uint8(numpy.round(img * 255.0 / 16.0)))
        images[i] = 0
        images[i, 2:26, 2:26] = numpy.asarray(small.resize((24, 24), Image.BILINEAR))
    return images, digits.target.astype(numpy.int64)


def write_lmdb(path, images, labels):
    from caffeplus.proto import caffe_pb2
    env = lmdb.open(path, map_size=1 << 28)
    with env.begin(write=True) as txn:
        for i, (img, label) in enumerate(zip(images, labels)):
            datum = caffe_pb2.Datum(channels=1, height=28, width=28,
                                    data=img.tobytes(), label=int(label))
            txn.put(('%08d' % i).encode('ascii'), datum.SerializeToString())
    env.close()


def main():
    force = '--force' in sys.argv
    if not force and os.path.exists(os.path.join(TRAIN_DB, 'data.mdb')) and \
            os.path.exists(os.path.join(TEST_DB, 'data.mdb')):
        print('digits LMDBs already exist in %s (use --force to rebuild)' % HERE)
        return
    images, labels = load_digits_28x28()
    order = numpy.random.RandomState(1701).permutation(len(images))
    images, labels = images[order], labels[order]
    for path in (TRAIN_DB, TEST_DB):
        if os.path.exists(path):
            for name in os.listdir(path):
                os.unlink(os.path.join(path, name))
    write_lmdb(TRAIN_DB, images[:-NUM_TEST], labels[:-NUM_TEST])
    write_lmdb(TEST_DB, images[-NUM_TEST:], labels[-NUM_TEST:])
    print('wrote %d training and %d test images to %s and %s'
          % (len(images) - NUM_TEST, NUM_TEST, TRAIN_DB, TEST_DB))


if __name__ == '__main__':
    main()
