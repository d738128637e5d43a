"""Weights: .caffemodel (binary, legacy shapes, V1) and HDF5, and .binaryproto."""
import builtins
import json
import os
import select
import signal
import sys
import threading

import h5py
import numpy
import pytest

import caffeplus
from conftest import REFERENCE, need
from caffeplus.errors import FormatError, NetError
from caffeplus.io import blobproto
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


class _Stop(BaseException):
    """What a stop signal's handler raises (as trainer.Terminated does)."""


def _temporary_files(folder):
    return [p.name for p in folder.iterdir() if p.name.endswith('.tmp')]


@pytest.mark.skipif(not hasattr(signal, 'pthread_sigmask'), reason='needs POSIX signal masks')
def test_sigterm_taken_by_another_thread_as_the_temporary_file_is_made_leaves_none(
        tmp_path, monkeypatch):
    """A SIGTERM sent to the process is taken by a thread that does not block
    it (OpenBLAS's, the prefetch thread's) while the main thread blocks it;
    Python still runs the handler in the main thread, at its next bytecode.
    Here that bytecode comes right after the call that made the temporary
    file returns, before the writer has its result: the old good file stays
    and no temporary file is left behind."""
    from caffeplus.io import atomic
    target = tmp_path / 'model.caffemodel'
    target.write_bytes(b'old good snapshot')
    made = {}
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)

    def signal_once_made(real):
        def wrapper(file, *args, **kwargs):
            name = os.fspath(file) if isinstance(file, (str, bytes, os.PathLike)) else None
            fresh = isinstance(name, str) and name.startswith(str(tmp_path)) and \
                name.endswith('.tmp') and not made and not os.path.exists(name)
            result = real(file, *args, **kwargs)
            if fresh and os.path.exists(name):
                made['name'] = name
                try:
                    os.kill(os.getpid(), signal.SIGTERM)
                    # The C-level handler (in the other thread) writes to the
                    # wakeup fd once the signal is tripped; the main thread
                    # runs the Python handler at its next bytecode, here.
                    ready, _, _ = select.select([wake_r], [], [], 120)
                    assert ready, 'the helper thread never took the SIGTERM'
                    for _ in range(1000):
                        pass
                except _Stop:
                    made['raised_at_creation'] = True
                    result.close() if hasattr(result, 'close') else os.close(result)
                    raise
            return result
        return wrapper

    def handler(signum, frame):
        raise _Stop()
    release = threading.Event()
    helper = threading.Thread(target=release.wait, name='takes-sigterm')
    old_handler = signal.signal(signal.SIGTERM, handler)
    old_wakeup = signal.set_wakeup_fd(wake_w, warn_on_full_buffer=False)
    helper.start()          # before the block: it keeps SIGTERM unblocked
    old_mask = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
    try:
        monkeypatch.setattr(os, 'open', signal_once_made(os.open))
        monkeypatch.setattr(builtins, 'open', signal_once_made(builtins.open))
        with pytest.raises(_Stop):
            with atomic.atomic_write(str(target)) as f:
                f.write(b'half a new snapshot')
    finally:
        monkeypatch.undo()
        signal.pthread_sigmask(signal.SIG_SETMASK, old_mask)
        signal.set_wakeup_fd(old_wakeup)
        signal.signal(signal.SIGTERM, old_handler)
        release.set()
        helper.join()
        os.close(wake_r)
        os.close(wake_w)
    assert made.get('raised_at_creation'), 'the handler did not run in the window: %r' % made
    assert target.read_bytes() == b'old good snapshot'
    assert _temporary_files(tmp_path) == []


def test_an_exception_at_any_bytecode_of_the_write_leaves_a_whole_file(tmp_path):
    """A stop signal's handler may raise between any two bytecodes: raised
    at each one of the atomic write in turn, the target is always the old
    file or the whole new one, and no temporary file is left."""
    from caffeplus.io import atomic
    target = tmp_path / 'model.caffemodel'
    old, new = b'old good snapshot', b'the whole new snapshot'

    def write(raise_at):
        """The number of bytecodes atomic.py ran (raising at the
        raise_at-th one; a trace function that raises is removed, so once)."""
        count = [0]

        def each_bytecode(frame, event, arg):
            if event == 'opcode':
                count[0] += 1
                if count[0] == raise_at:
                    raise _Stop()
            return each_bytecode

        def each_call(frame, event, arg):
            if frame.f_code.co_filename != atomic.__file__:
                return None
            frame.f_trace_opcodes = True
            return each_bytecode
        previous = sys.gettrace()
        sys.settrace(each_call)
        try:
            with atomic.atomic_write(str(target)) as f:
                f.write(new)
        except _Stop:
            pass
        finally:
            sys.settrace(previous)
        return count[0]

    target.write_bytes(old)
    total = write(raise_at=0)
    assert target.read_bytes() == new and total > 20
    for raise_at in range(1, total + 1):
        target.write_bytes(old)
        write(raise_at)
        assert target.read_bytes() in (old, new), raise_at
        assert _temporary_files(tmp_path) == [], raise_at


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
