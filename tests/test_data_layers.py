"""Data, ImageData, HDF5Data, HDF5Output, MemoryData and the DataTransformer."""
import json
import os

import numpy
import pytest
from google.protobuf import text_format

import caffeplus
from conftest import REFERENCE, need
from caffeplus.blob import Blob
from caffeplus.errors import CaffeplusError, NetError
from caffeplus.io import datum as datum_io
from caffeplus.io import db as db_io
from caffeplus.io.transformer import DataTransformer
from caffeplus.layer import create_layer
from caffeplus.proto import caffe_pb2

DATA = os.path.join(REFERENCE, 'training', 'data')
IO = os.path.join(REFERENCE, 'io')
IMAGES = os.path.join(IO, 'images')
TRAIN_LMDB = os.path.join(DATA, 'mnist_synth_train_lmdb')
MEAN = os.path.join(IO, 'mnist_synth_train_mean.binaryproto')
SCALE = numpy.float32(0.00390625)


def make(text, ntop=2, phase=caffe_pb2.TRAIN):
    lp = text_format.Parse(text, caffe_pb2.LayerParameter())
    lp.phase = phase
    layer = create_layer(lp)
    tops = [Blob(name='t%d' % i) for i in range(ntop)]
    layer.setup([], tops)
    return layer, tops


def data_layer(extra='', batch=64, source=TRAIN_LMDB, transform='scale: 0.00390625',
               ntop=2, phase=caffe_pb2.TRAIN):
    need(source)
    return make('name: "mnist" type: "Data" top: "data" top: "label" '
                'transform_param { %s } data_param { source: "%s" batch_size: %d '
                'backend: LMDB %s }' % (transform, source, batch, extra),
                ntop=ntop, phase=phase)


def batches(layer, tops, n):
    out = []
    for _ in range(n):
        layer.forward([], tops)
        out.append(tuple(t.data.copy() for t in tops))
    return out


def mnist(split='train'):
    ref = numpy.load(need(os.path.join(DATA, 'mnist_synth_%s.npz' % split)))
    return ref['data'], ref['label']


# -- Data ----------------------------------------------------------------------
def test_data_layer_key_order_scale_and_wraparound(caplog_caffeplus):
    data, label = mnist()
    layer, tops = data_layer()
    try:
        assert tops[0].shape == (64, 1, 28, 28) and tops[1].shape == (64,)
        assert not layer.has_backward
        for it in range(9):   # 256 records: 4 batches a pass
            layer.forward([], tops)
            i = (it % 4) * 64
            numpy.testing.assert_array_equal(tops[0].data,
                                             data[i:i + 64].astype(numpy.float32) * SCALE)
            numpy.testing.assert_array_equal(tops[1].data, label[i:i + 64])
    finally:
        layer.close()
    assert 'Opened lmdb %s' % TRAIN_LMDB in caplog_caffeplus
    assert 'output data size: 64,1,28,28' in caplog_caffeplus
    assert 'Restarting data prefetching from start.' in caplog_caffeplus


def test_data_layer_batch_not_dividing_the_database():
    data, label = mnist('test')
    layer, tops = data_layer(batch=24, source=os.path.join(DATA, 'mnist_synth_test_lmdb'),
                             ntop=1)
    try:
        assert len(tops) == 1
        got = numpy.concatenate([b[0] for b in batches(layer, tops, 4)])
        idx = numpy.arange(96) % 64
        numpy.testing.assert_array_equal(got, data[idx].astype(numpy.float32) * SCALE)
    finally:
        layer.close()


def test_data_layer_in_a_net():
    need(TRAIN_LMDB)
    param = text_format.Parse(
        'name: "d" layer { name: "mnist" type: "Data" top: "data" top: "label" '
        'include { phase: TRAIN } transform_param { scale: 0.00390625 } '
        'data_param { source: "%s" batch_size: 64 backend: LMDB } }' % TRAIN_LMDB,
        caffe_pb2.NetParameter())
    net = caffeplus.Net(param, caffeplus.TRAIN)
    data, label = mnist()
    net.forward()
    net.forward()
    numpy.testing.assert_array_equal(net.blobs['data'].data,
                                     data[64:128].astype(numpy.float32) * SCALE)
    numpy.testing.assert_array_equal(net.blobs['label'].data, label[64:128])
    net.layers[0].close()


def test_data_layer_mean_file_and_mean_value():
    data, _ = mnist()
    mean = numpy.load(need(os.path.join(IO, 'mnist_synth_train_mean.npy')))[0]
    layer, tops = data_layer(transform='scale: 0.5 mean_file: "%s"' % MEAN)
    layer.forward([], tops)
    layer.close()
    expect = (data[:64].astype(numpy.float32) - mean) * numpy.float32(0.5)
    numpy.testing.assert_array_equal(tops[0].data, expect)
    layer, tops = data_layer(transform='mean_value: 57.078 scale: 0.25')
    layer.forward([], tops)
    layer.close()
    expect = (data[:64].astype(numpy.float32) - numpy.float32(57.078)) * numpy.float32(0.25)
    numpy.testing.assert_array_equal(tops[0].data, expect)


def test_data_layer_test_phase_centre_crop():
    data, _ = mnist()
    layer, tops = data_layer(transform='crop_size: 21 scale: 0.00390625',
                             phase=caffe_pb2.TEST)
    layer.forward([], tops)
    layer.close()
    assert tops[0].shape == (64, 1, 21, 21)
    off = (28 - 21) // 2
    numpy.testing.assert_array_equal(
        tops[0].data, data[:64, :, off:off + 21, off:off + 21].astype(numpy.float32) * SCALE)


def _reference_transform(images, seed, crop, mirror, mean=None, scale=1.0, train=True):
    """NumPy re-implementation of Caffe's Transform with caffeplus's generator."""
    caffeplus.set_random_seed(seed)
    gen = numpy.random.Generator(numpy.random.PCG64(
        int(caffeplus.rng.get().integers(0, 2 ** 32, dtype=numpy.uint64))))

    def rand(n):
        return int(gen.integers(0, 2 ** 32, dtype=numpy.uint64)) % n
    out = []
    for img in images:
        _, h, w = img.shape
        do_mirror = mirror and rand(2)
        if crop and train:
            ho, wo = rand(h - crop + 1), rand(w - crop + 1)
        elif crop:
            ho, wo = (h - crop) // 2, (w - crop) // 2
        else:
            ho, wo, crop = 0, 0, None
        ch = crop or h
        cw = crop or w
        x = img[:, ho:ho + ch, wo:wo + cw].astype(numpy.float32)
        if mean is not None:
            x = x - mean[:, ho:ho + ch, wo:wo + cw]
        x = x * numpy.float32(scale)
        if do_mirror:
            x = x[:, :, ::-1]
        out.append(x)
    return numpy.stack(out)


def test_data_layer_random_crop_and_mirror_follow_the_seed():
    data, _ = mnist()
    mean = numpy.load(need(os.path.join(IO, 'mnist_synth_train_mean.npy')))[0]
    expect = _reference_transform(list(data) + list(data[:64]), 77, 20, True, mean,
                                  0.0078125)
    caffeplus.set_random_seed(77)
    layer, tops = data_layer(transform='crop_size: 20 mirror: true scale: 0.0078125 '
                                       'mean_file: "%s"' % MEAN)
    got = batches(layer, tops, 5)
    layer.close()
    numpy.testing.assert_array_equal(got[0][0], expect[:64])
    numpy.testing.assert_array_equal(got[3][0], expect[192:256])
    numpy.testing.assert_array_equal(got[4][0], expect[256:])   # wrapped around
    # Mirrors and offsets really vary.
    assert not numpy.array_equal(got[0][0], got[4][0])


@pytest.mark.parametrize('prefetch', [0, 1, 4])
def test_prefetch_keeps_the_seeded_order(prefetch):
    """Same seed: identical batches, whatever the prefetch depth or timing."""
    def run(seed, extra):
        caffeplus.set_random_seed(seed)
        layer, tops = data_layer(extra, batch=48,
                                 transform='crop_size: 24 mirror: true scale: 0.00390625')
        out = batches(layer, tops, 7)
        layer.close()
        return out
    ref = run(5, 'prefetch: 0')
    got = run(5, 'prefetch: %d' % prefetch)
    for a, b in zip(ref, got):
        numpy.testing.assert_array_equal(a[0], b[0])
        numpy.testing.assert_array_equal(a[1], b[1])
    other = run(6, 'prefetch: %d' % prefetch)
    assert not all(numpy.array_equal(a[0], b[0]) for a, b in zip(ref, other))


def test_data_layer_state_resumes_identically():
    caffeplus.set_random_seed(11)
    layer, tops = data_layer(batch=40, transform='crop_size: 24 mirror: true')
    batches(layer, tops, 3)
    state = layer.get_state()
    json.loads(json.dumps(state))   # plain values: can go into a snapshot
    expect = batches(layer, tops, 6)
    layer.close()
    caffeplus.set_random_seed(999)  # a different stream: the state must carry it all
    other, tops2 = data_layer(batch=40, transform='crop_size: 24 mirror: true')
    batches(other, tops2, 1)        # some reads ahead, to be thrown away
    other.set_state(json.loads(json.dumps(state)))
    got = batches(other, tops2, 6)
    other.close()
    for a, b in zip(expect, got):
        numpy.testing.assert_array_equal(a[0], b[0])
        numpy.testing.assert_array_equal(a[1], b[1])


def test_data_layer_nvcaffe_cache_and_shuffle():
    """NVCaffe's data_param { cache: true shuffle: true }: the first pass in
    key order, then every pass a new permutation of all the records (served
    from memory); a resumed run continues the same order."""
    data, label = mnist()
    caffeplus.set_random_seed(4)
    layer, tops = data_layer('cache: true shuffle: true')
    try:
        seen = [b[0] for b in batches(layer, tops, 12)]          # 3 passes of 256
        state = layer.get_state()
        json.loads(json.dumps(state))
        expect = batches(layer, tops, 5)
    finally:
        layer.close()
    images = data.astype(numpy.float32) * SCALE
    numpy.testing.assert_array_equal(numpy.concatenate(seen[:4]), images)    # key order
    index = {images[i].tobytes(): i for i in range(len(images))}
    orders = [[index[x.tobytes()] for x in numpy.concatenate(seen[4 * k:4 * k + 4])]
              for k in (1, 2)]
    assert all(sorted(o) == list(range(256)) for o in orders)
    assert orders[0] != orders[1] and orders[0] != list(range(256))
    caffeplus.set_random_seed(77)
    other, tops2 = data_layer('cache: true shuffle: true')
    try:
        other.set_state(json.loads(json.dumps(state)))
        got = batches(other, tops2, 5)
    finally:
        other.close()
    for a, b in zip(expect, got):
        numpy.testing.assert_array_equal(a[0], b[0])
        numpy.testing.assert_array_equal(a[1], b[1])
    # cache alone: every pass in key order.
    cached, tops3 = data_layer('cache: true')
    try:
        again = [b[1] for b in batches(cached, tops3, 8)]
    finally:
        cached.close()
    numpy.testing.assert_array_equal(numpy.concatenate(again), numpy.concatenate([label] * 2))


def test_data_layer_legacy_transform_fields():
    data, _ = mnist()
    layer, tops = data_layer(extra='scale: 0.5', transform='')
    layer.forward([], tops)
    layer.close()
    numpy.testing.assert_array_equal(tops[0].data,
                                     data[:64].astype(numpy.float32) * numpy.float32(0.5))


def test_data_layer_encoded_datums(tmp_path):
    raw = numpy.load(need(os.path.join(IO, 'imageset_raw.npz')))
    src = need(os.path.join(IO, 'imageset_encoded_lmdb'))
    layer, tops = data_layer(batch=1, source=src, transform='force_color: true')
    for i in range(8):
        layer.forward([], tops)
        numpy.testing.assert_array_equal(tops[0].data[0], raw['data_%d' % i])
    layer.close()
    gray = numpy.load(need(os.path.join(IO, 'imageset_gray.npz')))
    layer, tops = data_layer(batch=1, source=src, transform='force_gray: true')
    for i in range(8):
        layer.forward([], tops)
        numpy.testing.assert_array_equal(tops[0].data[0], gray['data_%d' % i])
    layer.close()


def test_data_layer_errors_name_the_file(tmp_path):
    missing = str(tmp_path / 'missing_lmdb')
    with pytest.raises(CaffeplusError, match='missing_lmdb'):
        make('name: "d" type: "Data" top: "data" top: "label" data_param { source: "%s" '
             'batch_size: 4 backend: LMDB }' % missing)
    # The same error from a Net, before any training.
    param = text_format.Parse(
        'layer { name: "d" type: "Data" top: "data" data_param { source: "%s" '
        'batch_size: 4 backend: LMDB } }' % missing, caffe_pb2.NetParameter())
    with pytest.raises(CaffeplusError, match='missing_lmdb'):
        caffeplus.Net(param, caffeplus.TRAIN)
    with pytest.raises(CaffeplusError, match='batch_size'):
        data_layer(batch=0)
    # A mean image of the wrong shape: names the mean file and both shapes.
    with pytest.raises(CaffeplusError, match=r'mnist_synth_train_mean.*1 x 1 x 28 x 28.*'
                                             r'3 x 8 x 10'):
        data_layer(batch=2, source=need(os.path.join(IO, 'imageset_raw_lmdb')),
                   transform='mean_file: "%s"' % MEAN)
    with pytest.raises(CaffeplusError, match='crop_size 40'):
        data_layer(transform='crop_size: 40')
    with pytest.raises(CaffeplusError, match='mean_value'):
        data_layer(batch=2, source=need(os.path.join(IO, 'imageset_raw_lmdb')),
                   transform='mean_value: 1 mean_value: 2')
    with pytest.raises(CaffeplusError, match='no_mean.binaryproto'):
        data_layer(transform='mean_file: "%s"' % (tmp_path / 'no_mean.binaryproto'))


def test_data_layer_bad_record_is_reported_at_forward(tmp_path):
    path = str(tmp_path / 'bad_lmdb')
    with db_io.open_db(path, 'lmdb', 'new') as db:
        good = datum_io.array_to_datum(numpy.zeros((1, 4, 4), numpy.uint8), 1)
        db.put(b'00000000', good.SerializeToString())
        bad = caffe_pb2.Datum(channels=1, height=4, width=4, data=b'\0' * 10)
        db.put(b'00000001', bad.SerializeToString())
    layer, tops = data_layer(batch=2, source=path, transform='')
    with pytest.raises(CaffeplusError, match='datum 00000001.*10 bytes'):
        layer.forward([], tops)
    with pytest.raises(CaffeplusError, match='datum 00000001'):
        layer.forward([], tops)
    layer.close()


def test_data_layer_over_leveldb(tmp_path):
    pytest.importorskip('plyvel')
    data, label = mnist('test')
    path = str(tmp_path / 'test_leveldb')
    with db_io.open_db(path, 'leveldb', 'new') as out:
        for k, v in db_io.open_db(need(os.path.join(DATA, 'mnist_synth_test_lmdb'))).items():
            out.put(k, v)
    layer, tops = make('name: "d" type: "Data" top: "data" top: "label" '
                       'data_param { source: "%s" batch_size: 40 }' % path)   # default LEVELDB
    got = batches(layer, tops, 2)
    layer.close()
    idx = numpy.arange(80) % 64
    numpy.testing.assert_array_equal(numpy.concatenate([g[0] for g in got]), data[idx])
    numpy.testing.assert_array_equal(numpy.concatenate([g[1] for g in got]), label[idx])


def test_rand_skip_is_seeded(caplog_caffeplus):
    data, _ = mnist()

    def first(seed):
        caffeplus.set_random_seed(seed)
        layer, tops = data_layer('rand_skip: 100', batch=4, transform='')
        layer.forward([], tops)
        layer.close()
        return tops[0].data.copy()
    a = first(3)
    skips = [int(m.split()[2]) for m in caplog_caffeplus if m.startswith('Skipping first')]
    assert len(skips) == 1 and 0 <= skips[0] < 100
    numpy.testing.assert_array_equal(a, data[skips[0]:skips[0] + 4])
    numpy.testing.assert_array_equal(first(3), a)


# -- transformer ---------------------------------------------------------------
def test_transformer_matches_numpy_reference():
    rs = numpy.random.RandomState(0)
    imgs = [rs.randint(0, 256, (3, 9, 11)).astype(numpy.uint8) for _ in range(20)]
    mean = rs.rand(3, 9, 11).astype(numpy.float32) * 100
    for crop, mirror, train in [(5, True, True), (5, False, True), (0, True, True),
                                (6, True, False), (4, False, False), (0, False, True)]:
        expect = _reference_transform(imgs, 3, crop, mirror, mean, 0.5, train)
        caffeplus.set_random_seed(3)
        p = caffe_pb2.TransformationParameter(crop_size=crop, mirror=mirror, scale=0.5)
        t = DataTransformer(p, caffe_pb2.TRAIN if train else caffe_pb2.TEST)
        t.mean = mean   # as if read from a mean_file
        t.mean_file, t.mean_shape = 'm', mean.shape
        t.init_rand()
        got = numpy.stack([t.transform(i) for i in imgs])
        numpy.testing.assert_array_equal(got, expect)
        # The batch path draws in the same order.
        caffeplus.set_random_seed(3)
        t.init_rand()
        numpy.testing.assert_array_equal(t.transform_batch(imgs), expect)


def test_transformer_mean_values_and_float_data():
    x = numpy.arange(2 * 3 * 4, dtype=numpy.float32).reshape(2, 3, 4)
    t = DataTransformer(caffe_pb2.TransformationParameter(mean_value=[1, 2], scale=2))
    numpy.testing.assert_array_equal(t.transform(x),
                                     (x - numpy.array([1, 2], numpy.float32)[:, None, None]) * 2)
    t = DataTransformer(caffe_pb2.TransformationParameter(mean_value=[3]))
    numpy.testing.assert_array_equal(t.transform(x), x - 3)
    d = datum_io.array_to_datum(x, 4)
    numpy.testing.assert_array_equal(t.transform_datum(d), x - 3)
    with pytest.raises(CaffeplusError, match='mean_file and mean_value'):
        DataTransformer(caffe_pb2.TransformationParameter(mean_file=MEAN, mean_value=[1]))
    with pytest.raises(CaffeplusError, match='force_color and force_gray'):
        DataTransformer(caffe_pb2.TransformationParameter(force_color=True, force_gray=True))


def test_transformer_without_randomness_draws_nothing():
    caffeplus.set_random_seed(8)
    before = caffeplus.rng.get_state()
    t = DataTransformer(caffe_pb2.TransformationParameter(crop_size=3), caffe_pb2.TEST)
    t.init_rand()
    assert caffeplus.rng.get_state() == before and t.get_state() is None


# -- ImageData -----------------------------------------------------------------
def image_layer(extra='', batch=1, source=None, root=IMAGES + '/', transform=''):
    source = source or need(os.path.join(IMAGES, 'list.txt'))
    return make('name: "img" type: "ImageData" top: "data" top: "label" '
                'transform_param { %s } image_data_param { source: "%s" root_folder: "%s" '
                'batch_size: %d %s }' % (transform, source, root, batch, extra))


def list_labels():
    with open(need(os.path.join(IMAGES, 'list.txt'))) as f:
        return [int(line.split()[1]) for line in f if line.strip()]


def test_image_data_bgr_gray_and_resize(caplog_caffeplus):
    raw = numpy.load(need(os.path.join(IO, 'imageset_raw.npz')))
    gray = numpy.load(need(os.path.join(IO, 'imageset_gray.npz')))
    resized = numpy.load(need(os.path.join(IO, 'imageset_resized_6x5.npz')))
    labels = list_labels()
    layer, tops = image_layer()
    for i in range(9):
        layer.forward([], tops)
        numpy.testing.assert_array_equal(tops[0].data[0], raw['data_%d' % (i % 8)])
        assert tops[1].data[0] == labels[i % 8]
    layer.close()
    assert 'A total of 8 images.' in caplog_caffeplus
    assert 'output data size: 1,3,8,10' in caplog_caffeplus
    layer, tops = image_layer('is_color: false')
    for i in range(8):
        layer.forward([], tops)
        numpy.testing.assert_array_equal(tops[0].data[0], gray['data_%d' % i])
    layer.close()
    layer, tops = image_layer('new_height: 6 new_width: 5', batch=8, transform='scale: 0.5')
    layer.forward([], tops)
    layer.close()
    expect = numpy.stack([resized['data_%d' % i] for i in range(8)]).astype(numpy.float32) * 0.5
    numpy.testing.assert_array_equal(tops[0].data, expect)
    numpy.testing.assert_array_equal(tops[1].data, labels)


def test_image_data_shuffle_is_seeded_and_resumable():
    def run(seed, n=12, state=None):
        caffeplus.set_random_seed(seed)
        layer, tops = image_layer('shuffle: true new_height: 6 new_width: 5', batch=3,
                                  transform='mirror: true crop_size: 4')
        if state is not None:
            layer.set_state(state)
        out = batches(layer, tops, n)
        st = layer.get_state()
        layer.close()
        return out, st
    a, _ = run(21)
    b, _ = run(21)
    for x, y in zip(a, b):
        numpy.testing.assert_array_equal(x[0], y[0])
        numpy.testing.assert_array_equal(x[1], y[1])
    labels = numpy.concatenate([x[1] for x in a[:8]])   # 3 passes of 8 images
    assert sorted(labels[:8]) == sorted(list_labels())
    assert not numpy.array_equal(labels[:8], labels[8:16])   # reshuffled each pass
    first, st = run(21, 5)
    rest, _ = run(1234, 7, json.loads(json.dumps(st)))
    for x, y in zip(a[5:], rest):
        numpy.testing.assert_array_equal(x[0], y[0])
        numpy.testing.assert_array_equal(x[1], y[1])


def test_image_data_errors_name_image_and_list(tmp_path):
    need(os.path.join(IO, 'images', 'img_00.png'))
    lst = tmp_path / 'list.txt'
    lst.write_text('\nno_such_image.png 1\nimg_00.png 3\n')
    with pytest.raises(CaffeplusError, match=r"no_such_image.png.*line 2.*list.txt"):
        image_layer(source=str(lst), batch=2)   # the first image is read at setup
    lst.write_text('img_00.png 3\nimg_01.png 2\nimg_02.png 1\nno_such_image.png 1\n')
    layer, tops = image_layer(source=str(lst), batch=2, transform='crop_size: 5')
    layer.forward([], tops)
    with pytest.raises(CaffeplusError, match=r"no_such_image.png.*line 4.*list.txt"):
        layer.forward([], tops)
    layer.close()
    with pytest.raises(CaffeplusError, match='missing_list.txt'):
        image_layer(source=str(tmp_path / 'missing_list.txt'))
    lst.write_text('img_00.png three\n')
    with pytest.raises(CaffeplusError, match='line 1'):
        image_layer(source=str(lst))
    # Images of different sizes cannot share a batch without resize or crop.
    lst.write_text('img_00.png 3\nimg_01.png 2\n')
    layer, tops = image_layer(source=str(lst), batch=2)
    with pytest.raises(CaffeplusError, match='same shape'):
        layer.forward([], tops)
    layer.close()


# -- HDF5 ----------------------------------------------------------------------
def test_hdf5_output_then_hdf5_data_round_trip(tmp_path):
    h5py = pytest.importorskip('h5py')
    rs = numpy.random.RandomState(0)
    files = []
    rows = []
    for k in range(2):
        name = str(tmp_path / ('part%d.h5' % k))
        out = create_layer(text_format.Parse(
            'name: "out" type: "HDF5Output" bottom: "data" bottom: "label" '
            'hdf5_output_param { file_name: "%s" }' % name, caffe_pb2.LayerParameter()))
        bottoms = [Blob((5, 2, 3), 'data'), Blob((5,), 'label')]
        out.setup(bottoms, [])
        for _ in range(2):   # two forwards: rows are appended
            x = rs.randn(5, 2, 3).astype(numpy.float32)
            y = rs.randint(0, 10, 5).astype(numpy.float32)
            bottoms[0].data, bottoms[1].data = x, y
            out.forward(bottoms, [])
            rows.append((x, y))
        files.append(name)
        with h5py.File(name, 'r') as f:
            assert f['data'].shape == (10, 2, 3, 1) and f['label'].shape == (10, 1, 1, 1)
    lst = tmp_path / 'h5list.txt'
    lst.write_text('\n'.join(files) + '\n')
    x_all = numpy.concatenate([r[0] for r in rows]).reshape(20, 2, 3, 1)
    y_all = numpy.concatenate([r[1] for r in rows]).reshape(20, 1, 1, 1)
    layer, tops = make('name: "h5" type: "HDF5Data" top: "data" top: "label" '
                       'hdf5_data_param { source: "%s" batch_size: 8 }' % lst)
    assert tops[0].shape == (8, 2, 3, 1) and tops[1].shape == (8, 1, 1, 1)
    got = batches(layer, tops, 5)   # 40 rows: two passes over both files
    xs = numpy.concatenate([g[0] for g in got])
    ys = numpy.concatenate([g[1] for g in got])
    numpy.testing.assert_array_equal(xs, numpy.concatenate([x_all, x_all]))
    numpy.testing.assert_array_equal(ys, numpy.concatenate([y_all, y_all]))
    assert not layer.has_backward

    # Shuffled: each pass covers every row once; seeded; resumable.
    def shuffled(seed, n, state=None):
        caffeplus.set_random_seed(seed)
        layer, tops = make('name: "h5" type: "HDF5Data" top: "data" top: "label" '
                           'hdf5_data_param { source: "%s" batch_size: 4 shuffle: true }' % lst)
        if state is not None:
            layer.set_state(state)
        return batches(layer, tops, n), layer.get_state()
    a, _ = shuffled(3, 10)
    b, st = shuffled(3, 4)
    c, _ = shuffled(99, 6, json.loads(json.dumps(st)))
    for x, y in zip(a, b + c):
        numpy.testing.assert_array_equal(x[0], y[0])
    first_pass = numpy.concatenate([g[1] for g in a[:5]]).ravel()
    assert sorted(first_pass) == sorted(y_all.ravel())
    assert not numpy.array_equal(first_pass, y_all.ravel())


def test_hdf5_data_errors_name_file_and_dataset(tmp_path):
    h5py = pytest.importorskip('h5py')
    name = str(tmp_path / 'only_data.h5')
    with h5py.File(name, 'w') as f:
        f['data'] = numpy.zeros((4, 3), numpy.float32)
    lst = tmp_path / 'list.txt'
    lst.write_text(name + '\n')
    with pytest.raises(CaffeplusError, match=r"only_data.h5.*no dataset 'label'"):
        make('name: "h5" type: "HDF5Data" top: "data" top: "label" '
             'hdf5_data_param { source: "%s" batch_size: 2 }' % lst)
    lst.write_text(str(tmp_path / 'gone.h5') + '\n')
    with pytest.raises(CaffeplusError, match=r'gone.h5.*list.txt'):
        make('name: "h5" type: "HDF5Data" top: "data" '
             'hdf5_data_param { source: "%s" batch_size: 2 }' % lst, ntop=1)
    with pytest.raises(CaffeplusError, match='nolist.txt'):
        make('name: "h5" type: "HDF5Data" top: "data" '
             'hdf5_data_param { source: "%s" batch_size: 2 }' % (tmp_path / 'nolist.txt'),
             ntop=1)
    lst.write_text(name + '\n')
    with pytest.raises(NetError, match='does not transform'):
        make('name: "h5" type: "HDF5Data" top: "data" transform_param { scale: 2 } '
             'hdf5_data_param { source: "%s" batch_size: 2 }' % lst, ntop=1)


# -- MemoryData ----------------------------------------------------------------
def test_memory_data_reset_and_set_input_arrays():
    layer, tops = make('name: "m" type: "MemoryData" top: "data" top: "label" '
                       'memory_data_param { batch_size: 2 channels: 1 height: 2 width: 3 }')
    assert tops[0].shape == (2, 1, 2, 3) and tops[1].shape == (2,)
    with pytest.raises(CaffeplusError, match='reset'):
        layer.forward([], tops)
    x = numpy.arange(6 * 6, dtype=numpy.float32).reshape(6, 1, 2, 3)
    y = numpy.arange(6, dtype=numpy.float32)
    layer.set_input_arrays(x, y.reshape(6, 1, 1, 1))
    for i in range(4):
        layer.forward([], tops)
        j = (i % 3) * 2
        numpy.testing.assert_array_equal(tops[0].data, x[j:j + 2])
        numpy.testing.assert_array_equal(tops[1].data, y[j:j + 2])
    with pytest.raises(CaffeplusError, match='multiple of batch size'):
        layer.set_input_arrays(x[:5], y[:5])
    with pytest.raises(CaffeplusError, match='same first dimension'):
        layer.set_input_arrays(x, y[:4])
    with pytest.raises(CaffeplusError, match=r'\(N, 1, 2, 3\)'):
        layer.set_input_arrays(x.reshape(6, 2, 3), y)
    layer.reset(x * 2, y, 4)
    layer.forward([], tops)
    numpy.testing.assert_array_equal(tops[0].data, x[:2] * 2)


def test_memory_data_add_mat_vector_transforms():
    layer, tops = make('name: "m" type: "MemoryData" top: "data" top: "label" '
                       'transform_param { scale: 0.5 mean_value: 10 mean_value: 20 '
                       'mean_value: 30 } '
                       'memory_data_param { batch_size: 2 channels: 3 height: 4 width: 5 }')
    rs = numpy.random.RandomState(1)
    mats = [rs.randint(0, 256, (4, 5, 3)).astype(numpy.uint8) for _ in range(4)]
    layer.add_mat_vector(mats, [1, 2, 3, 4])
    layer.forward([], tops)
    layer.forward([], tops)
    expect = (mats[3].transpose(2, 0, 1).astype(numpy.float32) -
              numpy.array([10, 20, 30], numpy.float32)[:, None, None]) * 0.5
    numpy.testing.assert_array_equal(tops[0].data[1], expect)
    numpy.testing.assert_array_equal(tops[1].data, [3, 4])
    with pytest.raises(CaffeplusError, match='multiple of the batch size'):
        layer.add_mat_vector(mats[:3], [1, 2, 3])


# -- resuming a training run ---------------------------------------------------
def test_solver_resume_continues_the_data_identically(tmp_path):
    """Snapshot mid-epoch with random crops/mirrors, resume: the same weights."""
    from caffeplus.layer import layer_class
    try:
        from caffeplus.solver import get_solver
    except ImportError:
        pytest.skip('no solver yet')
    if layer_class('InnerProduct') is None or layer_class('SoftmaxWithLoss') is None:
        pytest.skip('InnerProduct/SoftmaxWithLoss not available')
    need(TRAIN_LMDB)
    net = ('layer { name: "mnist" type: "Data" top: "data" top: "label" '
           '  transform_param { scale: 0.00390625 crop_size: 24 mirror: true } '
           '  data_param { source: "%s" batch_size: 48 backend: LMDB } } '
           'layer { name: "ip" type: "InnerProduct" bottom: "data" top: "ip" '
           '  inner_product_param { num_output: 10 weight_filler { type: "xavier" } } } '
           'layer { name: "loss" type: "SoftmaxWithLoss" bottom: "ip" bottom: "label" '
           '  top: "loss" }' % TRAIN_LMDB)
    text = ('random_seed: 7 type: "SGD" base_lr: 0.1 momentum: 0.9 lr_policy: "fixed" '
            'max_iter: 9 snapshot_prefix: "%s/r" net_param { %s }' % (tmp_path, net))

    def solver(t):
        return get_solver(text_format.Parse(t, caffe_pb2.SolverParameter()))

    def weights(s):
        return [numpy.array(p.data) for p in s.net.learnable_params]
    straight = solver(text)
    straight.step(9)
    want = weights(straight)
    first = solver(text)
    first.step(4)   # 192 of 256 records: mid-epoch
    _, state = first.snapshot()
    first.step(2)
    resumed = solver(text.replace('random_seed: 7', 'random_seed: 8'))
    resumed.solve(state)
    assert resumed.iter == 9
    for g, w in zip(weights(resumed), want):
        numpy.testing.assert_array_equal(g, w)
    for s in (straight, first, resumed):
        s.net.layers[0].close()


# -- DummyData: host refill on the CPU, device refill on the GPU ---------------------------
DUMMY = ('name: "dummy" type: "DummyData" top: "a" top: "b" top: "c" dummy_data_param { '
         'shape { dim: 3 dim: 5 } shape { dim: 4 dim: 2 dim: 3 } shape { dim: 7 } '
         'data_filler { type: "gaussian" std: 2 mean: 1 } '
         'data_filler { type: "xavier" } data_filler { type: "constant" value: 3 } }')


def test_dummy_data_cpu_refill_is_fill_array_from_the_seeded_stream():
    """The CPU path: every forward draws, from caffeplus.rng, what
    fill_array would; constant tops are written once, at setup, and setup
    draws nothing (as Caffe, whose setup fills only the constant tops)."""
    from caffeplus.fillers import fill_array
    caffeplus.set_random_seed(11)
    first_draw = caffeplus.rng.get().random()
    caffeplus.set_random_seed(11)
    layer, tops = make(DUMMY, ntop=3)
    assert numpy.array_equal(tops[2].data, numpy.full(7, 3, numpy.float32))
    assert caffeplus.rng.get().random() == first_draw       # setup drew nothing
    caffeplus.set_random_seed(11)
    for _ in range(3):
        layer.forward([], tops)
    got = [numpy.array(t.data) for t in tops]
    next_draw = caffeplus.rng.get().random()
    caffeplus.set_random_seed(11)
    for _ in range(3):
        want = [fill_array(f, t.shape) for f, t in zip(layer.fillers[:2], tops)]
    for g, w in zip(got, want):
        assert numpy.array_equal(g, w)
    assert numpy.array_equal(got[2], numpy.full(7, 3, numpy.float32))
    assert caffeplus.rng.get().random() == next_draw    # the stream is where it was


def _filler(text):
    return text_format.Parse(text, caffe_pb2.FillerParameter())


def test_device_recipes_follow_the_fillers():
    from caffeplus.fillers import device_recipe
    shape = (8, 3, 2, 2)                                       # fan_in 12, fan_out 32
    assert device_recipe(_filler('type: "constant" value: 0.5'), shape) == ('constant', 0.5)
    assert device_recipe(_filler('type: "uniform" min: -2 max: 3'), shape) == \
        ('uniform', -2.0, 3.0)
    kind, mean, std = device_recipe(_filler('type: "gaussian" mean: 1 std: 0.25'), shape)
    assert (kind, mean, std) == ('normal', 1.0, 0.25)
    kind, low, high = device_recipe(_filler('type: "xavier"'), shape)
    assert kind == 'uniform' and high == -low and abs(high - (3.0 / 12) ** 0.5) < 1e-12
    kind, low, high = device_recipe(_filler('type: "xavier" variance_norm: AVERAGE'), shape)
    assert abs(high - (3.0 / 22) ** 0.5) < 1e-12
    kind, mean, std = device_recipe(_filler('type: "msra" variance_norm: FAN_OUT'), shape)
    assert kind == 'normal' and mean == 0 and abs(std - (2.0 / 32) ** 0.5) < 1e-7
    assert device_recipe(_filler('type: "positive_unitball"'), shape) == ('unitball', 8)
    # No device form: the host draws them.
    assert device_recipe(_filler('type: "gaussian" sparse: 2'), shape) is None
    assert device_recipe(_filler('type: "bilinear"'), shape) is None
    assert device_recipe(_filler('type: "uniform"'), (0, 3)) == ('constant', 0.0)


class _HostGen:
    """DeviceRandom's interface on NumPy arrays (fills in place)."""

    def __init__(self, seed=0):
        self.rs = numpy.random.RandomState(seed)

    def normal_(self, out, mean, std):
        out[...] = self.rs.normal(mean, std, size=out.shape)

    def uniform_(self, out, low, high):
        out[...] = self.rs.uniform(low, high, size=out.shape)


@pytest.mark.parametrize('text', ['type: "constant" value: 2', 'type: "uniform" min: 1 max: 4',
                                  'type: "gaussian" std: 3', 'type: "xavier"', 'type: "msra"',
                                  'type: "positive_unitball"'])
def test_draw_into_fills_the_array_in_place(text):
    from caffeplus.fillers import device_recipe, draw_into
    shape = (6, 4, 5)
    out = numpy.full(shape, numpy.nan, dtype=numpy.float32)
    buf = out.__array_interface__['data'][0]
    draw_into(device_recipe(_filler(text), shape), out, _HostGen())
    assert out.__array_interface__['data'][0] == buf and out.dtype == numpy.float32
    assert numpy.isfinite(out).all() and out.std() >= 0
    if 'constant' in text:
        assert (out == 2).all()
    elif 'uniform' in text:
        assert out.min() >= 1 and out.max() <= 4 and out.std() > 0
    elif 'unitball' in text:
        numpy.testing.assert_allclose(out.reshape(6, -1).sum(axis=1), 1, rtol=1e-5)
        assert (out >= 0).all()


class _FakeDevice:
    made = []

    def __init__(self, seed):
        self.seed = seed
        _FakeDevice.made.append(seed)


def test_device_random_is_made_once_per_device_and_source_without_a_draw():
    """One generator per device, kept while caffeplus.rng's generator stays
    (a new seed makes new ones); making them draws nothing from
    caffeplus.rng: every fill reseeds from it instead (fill_device), so a
    resumed run's draws are the uninterrupted run's."""
    from caffeplus.fillers import DeviceRandomRegistry
    device = {'id': 0}
    reg = DeviceRandomRegistry(_FakeDevice, device_id=lambda: device['id'])
    caffeplus.set_random_seed(1701)
    untouched = numpy.random.default_rng(1701).random()
    first = reg.get()
    assert reg.get() is first                             # kept while the seed stays
    caffeplus.set_random_seed(1701)
    again = reg.get()
    assert again is not first                             # a new source: new generators
    device['id'] = 1
    other = reg.get()
    assert other is not again and reg.get() is other
    device['id'] = 0
    caffeplus.set_random_seed(1701)
    reg.get()
    assert caffeplus.rng.get().random() == untouched      # nothing drawn


def test_device_random_falls_back_to_the_host_once(caplog_caffeplus):
    from caffeplus.fillers import DeviceRandomRegistry

    def broken(seed):
        raise OSError('libcurand.so: cannot open shared object file')
    reg = DeviceRandomRegistry(broken, device_id=lambda: 0)
    assert reg.get() is None and reg.get() is None
    assert sum('cannot make a cuRAND generator' in m for m in caplog_caffeplus) == 1


def test_dummy_data_gpu_mode_refills_in_place_without_host_draws(monkeypatch):
    """The layer's wiring in GPU mode (device simulated): tops the device
    can fill are filled in their own array and nothing is drawn on the
    host; a top without a device form (sparse gaussian) still is."""
    from caffeplus.layers import data as data_mod
    from caffeplus import backend
    from caffeplus.fillers import draw_into
    text = ('name: "d" type: "DummyData" top: "a" top: "b" dummy_data_param { '
            'shape { dim: 4 dim: 6 } data_filler { type: "uniform" min: 2 max: 3 } '
            'data_filler { type: "gaussian" sparse: 3 } }')
    layer, tops = make(text, ntop=2)
    arrays = [t.data for t in tops]
    calls = []

    def fill_device(recipe, out, staging=None):
        calls.append(recipe)
        if recipe is None:
            return False
        draw_into(recipe, out, _HostGen())
        return True
    host = []
    real_fill_array = data_mod.fill_array
    monkeypatch.setattr(data_mod, 'fill_device', fill_device)
    monkeypatch.setattr(data_mod, 'fill_array', lambda f, s: host.append(f.type) or
                        real_fill_array(f, s))
    monkeypatch.setattr(backend, 'mode', lambda: backend.GPU)
    layer.forward([], tops)
    assert calls == [('uniform', 2.0, 3.0), None]
    assert host == ['gaussian']                           # the sparse one only
    assert (2 <= tops[0].data).all() and (tops[0].data <= 3).all()
    assert numpy.shares_memory(tops[0].data, arrays[0])  # drawn into the top's own array


def test_dummy_data_declares_the_float32_draw_of_its_16_bit_tops(monkeypatch):
    """A 16-bit top drawn on the device is drawn in float32 first: the
    layer declares that buffer, as large as its largest such top, for its
    forward alone (a reusing plan places it: caffeplus.memory.scratch) and
    hands the plan's view to the fill; constant tops and FP32 tops need
    none, nor does the CPU."""
    from caffeplus.layers import data as data_mod
    from caffeplus import backend
    from caffeplus.memory import scratch
    text = ('name: "d" type: "DummyData" top: "a" top: "b" top: "c" dummy_data_param { '
            'shape { dim: 4 dim: 6 } shape { dim: 5 dim: 7 } shape { dim: 9 dim: 9 } '
            'data_filler { type: "gaussian" std: 1 } data_filler { type: "uniform" } '
            'data_filler { type: "constant" value: 1 } }')
    lp = text_format.Parse(text, caffe_pb2.LayerParameter())
    lp.phase = caffe_pb2.TRAIN
    layer = create_layer(lp)
    tops = [Blob(name='t%d' % i) for i in range(3)]
    for t in tops[1:]:
        t.set_storage_dtype(numpy.float16)          # b (refilled) and c (constant)
    layer.setup([], tops)
    assert layer.internal_buffers() == {}                   # the CPU draws on the host
    assert layer.gpu_internal_bytes() == 4 * 35             # b's draw; a is FP32, c constant
    seen = []
    monkeypatch.setattr(data_mod, 'fill_device',
                        lambda recipe, out, staging=None: seen.append(staging) or False)
    monkeypatch.setattr(backend, 'mode', lambda: backend.GPU)
    assert layer.internal_buffers() == {'fill staging': (35, numpy.float32)}
    placed = numpy.zeros(64, numpy.float32)
    scratch.set_views(layer, {'fill staging': placed})
    layer.forward([], tops)
    assert len(seen) == 2 and all(numpy.shares_memory(s, placed) and s.size == 35
                                  for s in seen)


@pytest.mark.gpu
def test_dummy_data_on_the_gpu_draws_in_place_reproducibly():
    import cupy
    caffeplus.set_mode_gpu(0)
    try:
        text = ('name: "d" type: "DummyData" top: "a" top: "b" top: "c" dummy_data_param { '
                'shape { dim: 64 dim: 3 dim: 32 dim: 32 } shape { dim: 3 dim: 5 } '
                'shape { dim: 9 dim: 4 } '
                'data_filler { type: "gaussian" std: 2 mean: 1 } '
                'data_filler { type: "gaussian" std: 1 } '          # 15 values: odd count
                'data_filler { type: "uniform" min: -1 max: 5 } }')
        runs = []
        for seed in (5, 5, 6):
            caffeplus.set_random_seed(seed)
            layer, tops = make(text, ntop=3)
            ptrs = [t.data.data.ptr for t in tops]
            # The device path takes one seed per filled top from
            # caffeplus.rng, nothing more (the host path would draw every
            # value from it).
            probe = numpy.random.default_rng()
            probe.bit_generator.state = caffeplus.rng.get_state()
            got = []
            for _ in range(2):
                layer.forward([], tops)
                for _ in tops:
                    probe.integers(0, 2 ** 63 - 1)
                assert caffeplus.rng.get_state() == probe.bit_generator.state
                assert [t.data.data.ptr for t in tops] == ptrs    # the same arrays
                assert all(isinstance(t.data, cupy.ndarray) for t in tops)
                got.append([cupy.asnumpy(t.data) for t in tops])
            runs.append(got)
        first, again, other = runs
        for a, b in zip(first, again):                    # reproducible
            for x, y in zip(a, b):
                assert numpy.array_equal(x, y)
        assert not numpy.array_equal(first[0][0], first[1][0])   # a new batch each forward
        assert not numpy.array_equal(first[0][0], other[0][0])   # another seed (rank)
        big = first[1][0]
        assert abs(big.mean() - 1) < 0.02 and abs(big.std() - 2) < 0.02
        assert numpy.isfinite(first[1][1]).all() and first[1][1].std() > 0
        u = first[1][2]
        assert u.min() >= -1 and u.max() <= 5 and u.std() > 0
    finally:
        caffeplus.set_mode_cpu()


def test_16_bit_tops_take_the_device_draw():
    """FLOAT16 and BFLOAT16 tops are drawn in float32 on the device and
    rounded there; BFLOAT16 is ml_dtypes' type, NumPy kind 'V' (a check
    for kind 'f' sent it to the host every forward). Integer types are not."""
    from caffeplus import precision
    from caffeplus.fillers import rounds_on_device
    assert rounds_on_device(numpy.float16)
    if precision.bfloat16_dtype() is not None:
        assert precision.bfloat16_dtype().kind == 'V'
        assert rounds_on_device(precision.bfloat16_dtype())
    assert not any(rounds_on_device(t) for t in (numpy.int16, numpy.uint16, numpy.float64))


@pytest.mark.gpu
@pytest.mark.parametrize('sixteen', ['float16', 'bfloat16'])
def test_dummy_data_on_the_gpu_draws_16_bit_tops_there(monkeypatch, sixteen):
    """A 16-bit DummyData top is refilled on the device each forward, in
    its own array: nothing drawn on the host (fill_array would be), the
    values of the filler's distribution rounded to the top's type."""
    import cupy
    from caffeplus import precision
    from caffeplus.layers import data as data_mod
    dtype = numpy.float16 if sixteen == 'float16' else precision.bfloat16_dtype()
    if dtype is None:
        pytest.skip('no ml_dtypes')
    monkeypatch.setattr(data_mod, 'fill_array', lambda f, s: pytest.fail('drawn on the host'))
    caffeplus.set_mode_gpu(0)
    try:
        text = ('name: "d" type: "DummyData" top: "a" dummy_data_param { '
                'shape { dim: 32 dim: 3 dim: 32 dim: 32 } '
                'data_filler { type: "gaussian" std: 2 mean: 1 } }')
        lp = text_format.Parse(text, caffe_pb2.LayerParameter())
        lp.phase = caffe_pb2.TRAIN
        layer = create_layer(lp)
        top = Blob(name='a')
        top.set_storage_dtype(dtype)
        layer.setup([], [top])
        ptr = top.data.data.ptr
        draws = []
        for _ in range(2):
            layer.forward([], [top])
            assert isinstance(top.data, cupy.ndarray) and top.data.dtype == dtype
            assert top.data.data.ptr == ptr
            draws.append(cupy.asnumpy(top.data.astype(cupy.float32)))
        assert not numpy.array_equal(draws[0], draws[1])           # a new batch each forward
        x = draws[1]
        assert abs(x.mean() - 1) < 0.03 and abs(x.std() - 2) < 0.03
    finally:
        caffeplus.set_mode_cpu()
