"""Datum, image, LMDB/LevelDB and mean-file I/O against stock Caffe's files."""
import os

import numpy
import pytest

from conftest import REFERENCE, need
from caffeplus.errors import CaffeplusError, FormatError
from caffeplus.io import datum as datum_io
from caffeplus.io import db as db_io
from caffeplus.io.blobproto import array_to_blobproto, read_mean, write_blobproto
from caffeplus.io.transformer import DataTransformer
from caffeplus.proto import caffe_pb2

DATA = os.path.join(REFERENCE, 'training', 'data')
IO = os.path.join(REFERENCE, 'io')
IMAGES = os.path.join(IO, 'images')


def _npz(path):
    return numpy.load(need(path), allow_pickle=False)


# -- reference LMDBs -----------------------------------------------------------
@pytest.mark.parametrize('split', ['train', 'test'])
def test_mnist_lmdb_matches_npz(split):
    ref = _npz(os.path.join(DATA, 'mnist_synth_%s.npz' % split))
    path = need(os.path.join(DATA, 'mnist_synth_%s_lmdb' % split))
    records = list(db_io.read_datums(path, 'lmdb'))
    assert len(records) == len(ref['label'])
    keys = [k for k, _ in records]
    assert keys == sorted(keys)
    assert keys[0] == b'00000000'
    data = numpy.stack([datum_io.datum_to_array(d, k) for k, d in records])
    assert data.dtype == numpy.uint8
    numpy.testing.assert_array_equal(data, ref['data'])
    numpy.testing.assert_array_equal([d.label for _, d in records], ref['label'])


@pytest.mark.parametrize('variant', ['raw', 'resized_6x5', 'gray', 'encoded'])
def test_imageset_lmdb_matches_npz(variant):
    ref = _npz(os.path.join(IO, 'imageset_%s.npz' % variant))
    raw = _npz(os.path.join(IO, 'imageset_raw.npz'))
    records = list(db_io.read_datums(need(os.path.join(IO, 'imageset_%s_lmdb' % variant))))
    assert [k.decode() for k, _ in records] == list(ref['keys'])
    numpy.testing.assert_array_equal([d.label for _, d in records], ref['labels'])
    for i, (key, d) in enumerate(records):
        assert bool(d.encoded) == bool(ref['encoded'][i])
        assert [d.channels, d.height, d.width] == list(ref['chw'][i])
        if d.encoded:
            numpy.testing.assert_array_equal(numpy.frombuffer(d.data, numpy.uint8),
                                             ref['encoded_%d' % i])
            # Decoded in colour the PNG bytes give exactly the raw datum (BGR).
            color = datum_io.datum_to_array(d, key, datum_io.COLOR)
            numpy.testing.assert_array_equal(color, raw['data_%d' % i])
        else:
            numpy.testing.assert_array_equal(datum_io.datum_to_array(d, key),
                                             ref['data_%d' % i])


def test_encoded_datum_native_and_forced_decoding():
    records = list(db_io.read_datums(need(os.path.join(IO, 'imageset_encoded_lmdb'))))
    gray = _npz(os.path.join(IO, 'imageset_gray.npz'))
    images = _npz(os.path.join(IMAGES, 'images.npz'))
    channels = []
    for i, (key, d) in enumerate(records):
        native = datum_io.datum_to_array(d, key)
        channels.append(native.shape[0])
        src = images['img_%02d' % i]
        if src.ndim == 2:
            numpy.testing.assert_array_equal(native[0], src)
        elif src.shape[2] == 4:     # BGRA keeps alpha
            numpy.testing.assert_array_equal(native.transpose(1, 2, 0), src[:, :, [2, 1, 0, 3]])
        else:
            numpy.testing.assert_array_equal(native.transpose(1, 2, 0), src[:, :, ::-1])
        numpy.testing.assert_array_equal(datum_io.datum_to_array(d, key, datum_io.GRAY),
                                         gray['data_%d' % i])
    assert channels == [3, 3, 3, 3, 1, 1, 4, 3]


# -- images --------------------------------------------------------------------
def test_read_image_bgr_gray_and_resize_match_convert_imageset():
    raw = _npz(os.path.join(IO, 'imageset_raw.npz'))
    gray = _npz(os.path.join(IO, 'imageset_gray.npz'))
    resized = _npz(os.path.join(IO, 'imageset_resized_6x5.npz'))
    images = _npz(os.path.join(IMAGES, 'images.npz'))
    for i in range(8):
        path = os.path.join(IMAGES, 'img_%02d.png' % i)
        bgr = datum_io.read_image(path)
        numpy.testing.assert_array_equal(bgr, raw['data_%d' % i])
        src = images['img_%02d' % i]
        if src.ndim == 3:   # RGB(A) written -> BGR read
            numpy.testing.assert_array_equal(bgr[::-1].transpose(1, 2, 0), src[:, :, :3])
        else:               # grey replicated to 3 channels
            for c in range(3):
                numpy.testing.assert_array_equal(bgr[c], src)
        numpy.testing.assert_array_equal(datum_io.read_image(path, is_color=False),
                                         gray['data_%d' % i])
        numpy.testing.assert_array_equal(datum_io.read_image(path, True, 6, 5),
                                         resized['data_%d' % i])


def test_resize_linear_identity_and_constant():
    rs = numpy.random.RandomState(0)
    img = rs.randint(0, 256, (7, 9, 3)).astype(numpy.uint8)
    numpy.testing.assert_array_equal(datum_io.resize_linear(img, 7, 9), img)
    const = numpy.full((5, 8, 3), 77, numpy.uint8)
    for h, w in [(3, 4), (10, 16), (11, 5), (1, 1)]:
        out = datum_io.resize_linear(const, h, w)
        assert out.shape == (h, w, 3)
        assert (out == 77).all()
    # Exact 2x downscale is the 2x2 average, rounded.
    out = datum_io.resize_linear(img[:6, :8], 3, 4).astype(int)
    blocks = img[:6, :8].astype(int).reshape(3, 2, 4, 2, 3).sum(axis=(1, 3))
    numpy.testing.assert_array_equal(out, (blocks + 2) >> 2)


def test_read_image_errors_name_the_file(tmp_path):
    with pytest.raises(CaffeplusError, match='nope.png'):
        datum_io.read_image(str(tmp_path / 'nope.png'))
    bad = tmp_path / 'bad.png'
    bad.write_bytes(b'not an image at all')
    with pytest.raises(FormatError, match='bad.png'):
        datum_io.read_image(str(bad))


def test_jpeg_decoding(tmp_path):
    from PIL import Image
    rs = numpy.random.RandomState(1)
    rgb = rs.randint(0, 256, (16, 12, 3)).astype(numpy.uint8)
    path = str(tmp_path / 'x.jpg')
    Image.fromarray(rgb).save(path, quality=95)
    bgr = datum_io.read_image(path)
    decoded = numpy.asarray(Image.open(path).convert('RGB'))
    numpy.testing.assert_array_equal(bgr.transpose(1, 2, 0), decoded[:, :, ::-1])
    g = datum_io.read_image(path, is_color=False)
    assert g.shape == (1, 16, 12)
    # libjpeg's luma is close to the BT.601 grey of the decoded colours.
    approx = decoded.astype(float) @ numpy.array([0.299, 0.587, 0.114])
    assert numpy.abs(g[0] - approx).max() <= 3


# -- Datum <-> array -----------------------------------------------------------
def test_array_to_datum_round_trip():
    rs = numpy.random.RandomState(0)
    u8 = rs.randint(0, 256, (3, 4, 5)).astype(numpy.uint8)
    d = datum_io.array_to_datum(u8, 7)
    assert (d.channels, d.height, d.width, d.label) == (3, 4, 5, 7)
    assert d.data == u8.tobytes() and len(d.float_data) == 0
    back = datum_io.datum_to_array(caffe_pb2.Datum.FromString(d.SerializeToString()))
    assert back.dtype == numpy.uint8
    numpy.testing.assert_array_equal(back, u8)
    f = rs.randn(2, 3, 3).astype(numpy.float32)
    d = datum_io.array_to_datum(f)
    assert len(d.data) == 0 and len(d.float_data) == 18
    numpy.testing.assert_array_equal(datum_io.datum_to_array(d), f)
    with pytest.raises(FormatError, match='3-D'):
        datum_io.array_to_datum(numpy.zeros((2, 2)))


def test_datum_validation_names_the_key():
    d = caffe_pb2.Datum(channels=1, height=4, width=4, data=b'\0' * 15)
    with pytest.raises(FormatError, match=r'datum 00000042.*15 bytes.*16'):
        datum_io.datum_to_array(d, b'00000042')
    d = caffe_pb2.Datum(channels=1, height=2, width=2)
    d.float_data.extend([1, 2, 3])
    with pytest.raises(FormatError, match='k9.*3 float_data.*4'):
        datum_io.datum_to_array(d, 'k9')
    # A corrupt header claiming a huge image is refused before any allocation.
    d = caffe_pb2.Datum(channels=60000, height=60000, width=60000, data=b'\0')
    with pytest.raises(FormatError, match='corrupt'):
        datum_io.datum_to_array(d, b'big')
    d = caffe_pb2.Datum(channels=0, height=2, width=2, data=b'')
    with pytest.raises(FormatError, match='invalid shape'):
        datum_io.datum_to_array(d, b'zero')
    with pytest.raises(FormatError, match='no pixel data'):
        datum_io.datum_to_array(caffe_pb2.Datum(channels=1, height=1, width=1), b'empty')
    with pytest.raises(FormatError, match='datum xyz in db.*not a valid Datum'):
        datum_io.parse_datum(b'\xff\xff\xff\xff', b'xyz', 'db')


# -- mean files ----------------------------------------------------------------
def test_mean_binaryproto_matches_npy():
    mean = read_mean(need(os.path.join(IO, 'mnist_synth_train_mean.binaryproto')))
    ref = numpy.load(need(os.path.join(IO, 'mnist_synth_train_mean.npy')))
    assert mean.shape == ref.shape == (1, 1, 28, 28)
    numpy.testing.assert_array_equal(mean, ref)
    # And it is the per-pixel mean of the training images (float32 accumulation).
    data = _npz(os.path.join(DATA, 'mnist_synth_train.npz'))['data']
    numpy.testing.assert_allclose(mean[0], data.mean(axis=0), rtol=1e-6, atol=1e-4)
    t = DataTransformer(caffe_pb2.TransformationParameter(
        mean_file=os.path.join(IO, 'mnist_synth_train_mean.binaryproto')))
    numpy.testing.assert_array_equal(t.mean, ref[0])


# -- databases -----------------------------------------------------------------
def test_lmdb_write_read_and_key_order(tmp_path, monkeypatch):
    # A tiny initial map forces the writer to grow it, as Caffe does.
    monkeypatch.setattr(db_io, '_LMDB_INITIAL_MAP', 64 * 1024)
    path = str(tmp_path / 'out_lmdb')
    rs = numpy.random.RandomState(3)
    arrays = [rs.randint(0, 256, (3, 32, 32)).astype(numpy.uint8) for _ in range(60)]
    order = rs.permutation(60)
    with db_io.open_db(path, 'lmdb', 'new') as db:
        for i in order:   # written out of order; read back in key order
            db.put('%08d' % i, datum_io.array_to_datum(arrays[i], int(i)).SerializeToString())
    db = db_io.open_db(path, 'lmdb')
    assert db.count() == 60
    for n, (key, value) in enumerate(db.items()):
        assert key == b'%08d' % n
        d = datum_io.parse_datum(value, key)
        numpy.testing.assert_array_equal(datum_io.datum_to_array(d), arrays[n])
        assert d.label == n
    db.close()
    with pytest.raises(CaffeplusError, match='already exists'):
        db_io.open_db(path, 'lmdb', 'new')


def test_missing_and_wrong_databases_give_clear_errors(tmp_path):
    missing = str(tmp_path / 'no_such_lmdb')
    with pytest.raises(CaffeplusError, match='no_such_lmdb'):
        db_io.open_db(missing, 'lmdb')
    with pytest.raises(CaffeplusError, match='no_such_lmdb'):
        db_io.RecordReader(missing, caffe_pb2.DataParameter.LMDB)
    empty_dir = tmp_path / 'empty_dir'
    empty_dir.mkdir()
    with pytest.raises(CaffeplusError, match='empty_dir.*not an LMDB'):
        db_io.open_db(str(empty_dir), 'lmdb')
    lmdb_path = need(os.path.join(DATA, 'mnist_synth_test_lmdb'))
    try:
        import plyvel  # noqa: F401
    except ImportError:
        with pytest.raises(CaffeplusError, match='plyvel'):
            db_io.open_db(str(empty_dir), 'leveldb')
    # An LMDB read with the default LEVELDB backend: say what to change.
    with pytest.raises(CaffeplusError, match='backend: LMDB'):
        db_io.open_db(lmdb_path, caffe_pb2.DataParameter.LEVELDB)
    with pytest.raises(CaffeplusError, match='unknown database backend'):
        db_io.open_db(lmdb_path, 'rocksdb')
    new = str(tmp_path / 'empty_lmdb')
    db_io.open_db(new, 'lmdb', 'new').close()
    with pytest.raises(CaffeplusError, match='empty'):
        db_io.RecordReader(new, 'lmdb')


def test_leveldb_round_trip(tmp_path):
    pytest.importorskip('plyvel')
    path = str(tmp_path / 'out_leveldb')
    with db_io.open_db(path, 'leveldb', 'new') as db:
        for i in (2, 0, 1):
            db.put(b'%08d' % i, b'v%d' % i)
    db = db_io.open_db(path, 'leveldb')
    assert list(db.items()) == [(b'00000000', b'v0'), (b'00000001', b'v1'),
                                (b'00000002', b'v2')]
    db.close()


def test_record_reader_wraps_and_restores(caplog_caffeplus):
    path = need(os.path.join(DATA, 'mnist_synth_test_lmdb'))
    r = db_io.RecordReader(path, 'lmdb')
    keys = [r.next()[0] for _ in range(70)]
    assert keys[:64] == [b'%08d' % i for i in range(64)]
    assert keys[64:] == [b'%08d' % i for i in range(6)]
    assert any('Opened lmdb %s' % path in m for m in caplog_caffeplus)
    assert sum('Restarting data prefetching from start.' in m for m in caplog_caffeplus) == 1
    state = r.state()
    assert state['offset'] == 70 and state['position'] == 6
    after = [r.next()[0] for _ in range(5)]
    r2 = db_io.RecordReader(path, 'lmdb')
    r2.restore(state)
    assert [r2.next()[0] for _ in range(5)] == after
    r.close()
    r2.close()


def _small_lmdb(tmp_path, n=7):
    path = str(tmp_path / 'small_lmdb')
    with db_io.open_db(path, 'lmdb', 'new') as db:
        for i in range(n):
            db.put('%08d' % i, datum_io.array_to_datum(
                numpy.full((1, 2, 2), i, numpy.uint8), i).SerializeToString())
    return path, [b'%08d' % i for i in range(n)]


def test_cached_reader_serves_later_passes_from_memory(tmp_path):
    path, keys = _small_lmdb(tmp_path)
    r = db_io.CachedRecordReader(db_io.RecordReader(path, 'lmdb', in_place=True))
    # Copied at once: in place, the first pass's values are views of the
    # mapped database, valid while it is open.
    first = [tuple(bytes(b) for b in r.next()) for _ in range(7)]
    assert [k for k, _ in first] == keys and r.complete
    r.reader.close()                    # the database is no longer read
    again = [r.next() for _ in range(10)]
    assert again == first + first[:3]
    assert r.position == 3 and r.offset == 17


def test_shuffled_cache_draws_a_new_order_every_pass_and_restores(tmp_path):
    path, keys = _small_lmdb(tmp_path)

    def reader(seed):
        return db_io.CachedRecordReader(db_io.RecordReader(path, 'lmdb'), shuffle=True,
                                        rng=numpy.random.default_rng(seed))
    r = reader(5)
    passes = [[r.next()[0] for _ in range(7)] for _ in range(4)]
    assert passes[0] == keys                                   # the first pass: key order
    assert all(sorted(p) == keys for p in passes[1:])          # then permutations of all
    assert len({tuple(p) for p in passes[1:]}) == 3            # a new one every pass
    # Resumed mid-pass (fresh reader, another seed): the same continuation.
    for read in (3, 7 * 4 + 2):
        r = reader(5)
        for _ in range(read):
            r.next()
        state = r.state()
        want = [r.next()[0] for _ in range(12)]
        other = reader(99)
        other.restore(state)
        assert [other.next()[0] for _ in range(12)] == want, read


def test_write_mean_round_trip(tmp_path):
    arr = numpy.arange(12, dtype=numpy.float32).reshape(1, 3, 2, 2)
    path = str(tmp_path / 'm.binaryproto')
    write_blobproto(array_to_blobproto(arr), path)
    numpy.testing.assert_array_equal(read_mean(path), arr)


def test_a_reader_released_while_another_opens_does_not_deadlock(tmp_path, monkeypatch):
    """The garbage collector can run inside the shared-environment lock (in
    lmdb.open) and finalize an unreachable reader, which releases its
    environment there, in the same thread: that must not wait on the lock
    its own thread holds (a CI run hung so, in test_training_reference)."""
    import threading
    paths = []
    for name in ('a_lmdb', 'b_lmdb'):
        path = str(tmp_path / name)
        with db_io.open_db(path, 'lmdb', 'new') as db:
            db.put('k', b'v')
        paths.append(path)
    first = db_io.open_db(paths[0], 'lmdb')
    lmdb = db_io._lmdb_module()
    real_open = lmdb.open

    def open_and_collect(*args, **kwargs):
        first.close()       # what the finalizer does, mid-open
        return real_open(*args, **kwargs)
    monkeypatch.setattr(lmdb, 'open', open_and_collect)
    done = []
    worker = threading.Thread(target=lambda: done.append(db_io.open_db(paths[1], 'lmdb')),
                              daemon=True)
    worker.start()
    worker.join(120)     # a deadline against a deadlock
    assert not worker.is_alive(), 'opening a database deadlocked on the shared lock'
    second = done[0]
    assert second.count() == 1
    assert os.path.realpath(paths[0]) not in db_io._SHARED_ENVS    # released and closed
    second.close()
    assert os.path.realpath(paths[1]) not in db_io._SHARED_ENVS
