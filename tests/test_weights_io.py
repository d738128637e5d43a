"""Weights: .caffemodel (binary, legacy shapes, V1) and HDF5, and .binaryproto."""
import json
import os
import shutil

import h5py
import numpy
import pytest

import caffeplus
from conftest import REFERENCE, need
from caffeplus.errors import CaffeplusError, FormatError, NetError
from caffeplus.io import blobproto
from caffeplus.io.prototxt import parse_text
from caffeplus.proto import caffe_pb2

IO = os.path.join(REFERENCE, 'io')

# LeNet's TRAIN net without its data layer, so no LMDB is needed.
LENET_NO_DATA = '''
name: "LeNet"
layer { name: "mnist" type: "Input" top: "data" top: "label"
        input_param { shape { dim: 2 dim: 1 dim: 28 dim: 28 } shape { dim: 2 } } }
layer { name: "conv1" type: "Convolution" bottom: "data" top: "conv1"
        convolution_param { num_output: 20 kernel_size: 5 } }
layer { name: "pool1" type: "Pooling" bottom: "conv1" top: "pool1"
        pooling_param { pool: MAX kernel_size: 2 stride: 2 } }
layer { name: "conv2" type: "Convolution" bottom: "pool1" top: "conv2"
        convolution_param { num_output: 50 kernel_size: 5 } }
layer { name: "pool2" type: "Pooling" bottom: "conv2" top: "pool2"
        pooling_param { pool: MAX kernel_size: 2 stride: 2 } }
layer { name: "ip1" type: "InnerProduct" bottom: "pool2" top: "ip1" inner_product_param { num_output: 500 } }
layer { name: "relu1" type: "ReLU" bottom: "ip1" top: "ip1" }
layer { name: "ip2" type: "InnerProduct" bottom: "ip1" top: "ip2" inner_product_param { num_output: 10 } }
layer { name: "loss" type: "SoftmaxWithLoss" bottom: "ip2" bottom: "label" top: "loss" }
'''


def lenet(tmp_path):
    path = tmp_path / 'lenet.prototxt'
    path.write_text(LENET_NO_DATA)
    return caffeplus.Net(str(path), caffeplus.TRAIN)


def expected_blobs():
    with open(need(os.path.join(IO, 'lenet_iter_2_blobs.json'))) as f:
        return json.load(f)


def check_against_json(net):
    for entry in expected_blobs():
        blob = net.params[entry['layer']][entry['blob']]
        assert list(blob.shape) == entry['shape']
        data = blob.data.astype(numpy.float64)
        assert data.sum() == pytest.approx(entry['sum'], rel=1e-5, abs=1e-6)
        assert numpy.abs(data).sum() == pytest.approx(entry['abs_sum'], rel=1e-6)
        numpy.testing.assert_array_equal(blob.data.ravel()[:len(entry['first'])],
                                         numpy.float32(entry['first']))


def test_load_stock_caffemodel(tmp_path):
    net = lenet(tmp_path)
    net.copy_from(need(os.path.join(IO, 'lenet_iter_2.caffemodel')))
    check_against_json(net)


def test_load_stock_hdf5_weights_equal_binary(tmp_path):
    net = lenet(tmp_path)
    net.copy_from(need(os.path.join(IO, 'lenet_iter_2.caffemodel.h5')))
    check_against_json(net)


def test_write_caffemodel_is_readable_and_round_trips_values(tmp_path):
    need(os.path.join(IO, 'lenet_iter_2.caffemodel'))
    net = lenet(tmp_path)
    net.copy_from(os.path.join(IO, 'lenet_iter_2.caffemodel'))
    out = tmp_path / 'out.caffemodel'
    net.save(str(out))
    stock = caffe_pb2.NetParameter()
    stock.ParseFromString(open(os.path.join(IO, 'lenet_iter_2.caffemodel'), 'rb').read())
    ours = caffe_pb2.NetParameter()
    ours.ParseFromString(out.read_bytes())
    stock_blobs = {l.name: l.blobs for l in stock.layer}
    for layer in ours.layer:
        for mine, theirs in zip(layer.blobs, stock_blobs.get(layer.name, [])):
            # Byte-identical blob encoding (shape + packed float data).
            assert mine.SerializeToString() == theirs.SerializeToString()
    net2 = lenet(tmp_path)
    net2.copy_from(str(out))
    check_against_json(net2)


def test_hdf5_layout_matches_caffe(tmp_path):
    need(os.path.join(IO, 'lenet_iter_2.caffemodel'))
    net = lenet(tmp_path)
    net.copy_from(os.path.join(IO, 'lenet_iter_2.caffemodel'))
    out = tmp_path / 'out.caffemodel.h5'
    net.save_hdf5(str(out))
    names = []
    with h5py.File(str(out)) as f:
        f.visit(names.append)
    stock = []
    with h5py.File(need(os.path.join(IO, 'lenet_iter_2.caffemodel.h5'))) as f:
        f.visit(stock.append)
    assert sorted(names) == sorted(stock)
    net2 = lenet(tmp_path)
    net2.load_hdf5(str(out))
    check_against_json(net2)


def test_legacy_4d_blob_shapes_load(tmp_path):
    net = lenet(tmp_path)
    param = caffe_pb2.NetParameter()
    layer = param.layer.add(name='ip2', type='InnerProduct')
    w = numpy.arange(5000, dtype=numpy.float32).reshape(10, 500)
    b = layer.blobs.add(num=1, channels=1, height=10, width=500)
    b.data.extend(w.ravel().tolist())
    bias = layer.blobs.add(num=1, channels=1, height=1, width=10)
    bias.data.extend([1.0] * 10)
    net.copy_from(param)
    numpy.testing.assert_array_equal(net.params['ip2'][0].data, w)


def test_weight_shape_mismatch_names_layer_index_and_shapes(tmp_path):
    need(os.path.join(IO, 'lenet_iter_2.caffemodel'))
    text = LENET_NO_DATA.replace('num_output: 500', 'num_output: 400')
    path = tmp_path / 'small.prototxt'
    path.write_text(text)
    net = caffeplus.Net(str(path), caffeplus.TRAIN)
    with pytest.raises(NetError) as info:
        net.copy_from(os.path.join(IO, 'lenet_iter_2.caffemodel'))
    msg = str(info.value)
    assert "param 0 weights from layer 'ip1'" in msg
    assert '500 800 (400000)' in msg and '400 800 (320000)' in msg


def test_truncated_caffemodel_is_a_clear_error(tmp_path):
    need(os.path.join(IO, 'lenet_iter_2.caffemodel'))
    src = open(os.path.join(IO, 'lenet_iter_2.caffemodel'), 'rb').read()
    bad = tmp_path / 'truncated.caffemodel'
    bad.write_bytes(src[:len(src) // 2])
    net = lenet(tmp_path)
    with pytest.raises(FormatError, match='truncated'):
        net.copy_from(str(bad))
    junk = tmp_path / 'junk.caffemodel'
    junk.write_bytes(b'\xff\xfe not a protobuf at all \x00\x01')
    with pytest.raises(FormatError):
        net.copy_from(str(junk))


def test_mean_binaryproto_matches_numpy():
    arr = blobproto.read_mean(need(os.path.join(IO, 'mnist_synth_train_mean.binaryproto')))
    expected = numpy.load(os.path.join(IO, 'mnist_synth_train_mean.npy'))
    numpy.testing.assert_array_equal(arr.reshape(expected.shape), expected)


def test_binaryproto_write_is_byte_identical_to_stock(tmp_path):
    path = need(os.path.join(IO, 'mnist_synth_train_mean.binaryproto'))
    proto = blobproto.read_blobproto(path)
    arr = blobproto.blobproto_to_array(proto)
    out = tmp_path / 'mean.binaryproto'
    # Stock Caffe writes the legacy 4-D fields for means; keep them.
    copy = caffe_pb2.BlobProto()
    copy.CopyFrom(proto)
    del copy.data[:]
    copy.data.extend(arr.ravel().tolist())
    blobproto.write_blobproto(copy, str(out))
    assert out.read_bytes() == open(path, 'rb').read()


def test_blobproto_vector_round_trip(tmp_path):
    arrays = [numpy.arange(6, dtype=numpy.float32).reshape(2, 3), numpy.ones((4,), numpy.float32)]
    out = tmp_path / 'v.binaryproto'
    blobproto.write_blobproto_vector(arrays, str(out))
    back = blobproto.read_blobproto_vector(str(out))
    for a, b in zip(arrays, back):
        numpy.testing.assert_array_equal(a, b)


def test_a_stop_signal_while_the_temporary_file_is_made_leaves_none(tmp_path, monkeypatch):
    """SIGTERM (mpirun stopping a rank) arriving just as the temporary file
    is created, before its name is known: the signal waits until the name
    is, then its handler's exception removes the file; the old one stays."""
    import signal
    import tempfile
    from caffeplus.io import atomic
    target = tmp_path / 'model.caffemodel'
    target.write_bytes(b'old good snapshot')

    class Stop(BaseException):
        pass

    def handler(signum, frame):
        raise Stop()
    real = tempfile.mkstemp

    def mkstemp_then_signal(*a, **k):
        made = real(*a, **k)
        os.kill(os.getpid(), signal.SIGTERM)    # delivered now, unless held back
        return made
    old = signal.signal(signal.SIGTERM, handler)
    try:
        monkeypatch.setattr(tempfile, 'mkstemp', mkstemp_then_signal)
        with pytest.raises(Stop):
            with atomic.atomic_write(str(target)) as f:
                f.write(b'half a new snapshot')
    finally:
        signal.signal(signal.SIGTERM, old)
    assert target.read_bytes() == b'old good snapshot'
    assert [p.name for p in tmp_path.iterdir() if p.name.endswith('.tmp')] == []


def test_blob_shape_bound_checked():
    proto = caffe_pb2.BlobProto()
    proto.shape.dim.extend([1 << 20, 1 << 20, 1 << 10])
    with pytest.raises(FormatError, match='claims'):
        blobproto.blobproto_to_array(proto)


def test_snapshot_write_is_atomic(tmp_path, monkeypatch):
    """An interrupted write leaves the old file untouched."""
    net = lenet(tmp_path)
    target = tmp_path / 'model.caffemodel'
    target.write_bytes(b'old good snapshot')

    def boom(*a, **k):
        raise KeyboardInterrupt
    monkeypatch.setattr(os, 'fsync', boom)
    with pytest.raises(KeyboardInterrupt):
        net.save(str(target))
    assert target.read_bytes() == b'old good snapshot'
    assert [p.name for p in tmp_path.iterdir() if p.name.endswith('.tmp')] == []
