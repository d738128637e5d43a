"""pycaffe's process-wide functions (caffe.init_log, caffe.log, caffe.Timer,
solver count and rank, caffe.NCCL) and Net's callbacks, as BVLC's
python/train.py uses them, on the CPU."""
import logging
import os
import time

import numpy
import pytest
from google.protobuf import text_format

import caffeplus as caffe
from caffeplus import log, pycaffe_runtime
from caffeplus.errors import CaffeplusError
from caffeplus.proto import caffe_pb2
from conftest import REFERENCE

LENET = os.path.join(REFERENCE, 'training', 'lenet_train_test.prototxt')
TRAIN_LMDB = os.path.join(REFERENCE, 'training', 'data', 'mnist_synth_train_lmdb')


@pytest.fixture
def ranks():
    saved = dict(pycaffe_runtime._globals)
    yield
    pycaffe_runtime._globals.update(saved)


@pytest.fixture
def records():
    """Log records of the caffeplus logger while the test runs."""
    seen = []

    class Keep(logging.Handler):
        def emit(self, record):
            seen.append(record)
    handler = Keep()
    log.logger.addHandler(handler)
    level = log.logger.level
    yield seen
    log.logger.removeHandler(handler)
    log.logger.setLevel(level)


def _solver_file(tmp_path, **fields):
    values = dict(net=LENET, base_lr=0.01, momentum=0.9, lr_policy='fixed', display=0,
                  max_iter=2, snapshot=0, random_seed=1701, snapshot_prefix=str(tmp_path / 'lenet'))
    values.update(fields)
    param = caffe_pb2.SolverParameter(**values)
    path = tmp_path / 'solver.prototxt'
    path.write_text(text_format.MessageToString(param))
    return str(path)


def test_log_and_init_log_are_pycaffes_functions(records):
    caffe.init_log()
    caffe.log('Using devices [0]')
    assert [(r.levelno, r.getMessage()) for r in records] == [(logging.INFO, 'Using devices [0]')]
    caffe.init_log(1)           # WARNING and above, as glog's minloglevel 1
    caffe.log('dropped')
    assert len(records) == 1
    caffe.init_log(0, True)
    caffe.log('kept')
    assert records[-1].getMessage() == 'kept'
    # the module stays the logging module every other module imports
    assert callable(log.info) and log.logger.name == 'caffeplus'


def test_timer_times_from_start_to_stop(records):
    t = caffe.Timer()
    assert t.ms == 0.0 and 'never been run' in records[-1].getMessage()
    t.start()
    time.sleep(0.02)
    t.stop()
    first = t.ms
    assert 20.0 <= first < 1000.0
    time.sleep(0.02)
    assert t.ms == first            # stopped: reading does not move it
    t.start()
    time.sleep(0.01)
    running = t.ms                  # read while running: stopped there
    assert 10.0 <= running < first


def test_net_callbacks_run_where_caffes_do(tmp_path):
    net = caffe.Net(os.path.join(REFERENCE, 'cli', 'lenet_dummy_b64.prototxt'), caffe.TRAIN)
    calls = []
    net.before_forward(lambda i: calls.append(('bf', i)))
    net.after_forward(lambda i: calls.append(('af', i)))
    net.before_backward(lambda i: calls.append(('bb', i)))
    net.after_backward(lambda i: calls.append(('ab', i)))
    net.forward()
    net.backward()
    n = len(net.layers)
    forward = [(k, i) for i in range(n) for k in ('bf', 'af')]
    # every layer in backward, those that need none included, as Caffe's Net
    backward = [(k, i) for i in reversed(range(n)) for k in ('bb', 'ab')]
    assert calls == forward + backward
    calls.clear()
    net._forward(1, 2)
    assert calls == [('bf', 1), ('af', 1), ('bf', 2), ('af', 2)]


def _lmdb_labels(count):
    from caffeplus.io.db import read_datums
    labels = []
    for _, datum in read_datums(TRAIN_LMDB):
        labels.append(datum.label)
        if len(labels) == count:
            break
    return labels


def test_a_solver_of_several_reads_its_ranks_records(tmp_path, monkeypatch, ranks):
    monkeypatch.chdir(REFERENCE)
    want = _lmdb_labels(128)[1::2]
    caffe.set_solver_count(2)
    caffe.set_solver_rank(1)
    caffe.set_multiprocess(True)
    solver = caffe.SGDSolver(_solver_file(tmp_path, test_iter=[2], test_interval=10))
    assert (solver.rank, solver.solver_count) == (1, 2)
    assert solver.test_nets == []           # Caffe's root solver alone builds them
    solver.net.forward()
    labels = list(solver.net.blobs['label'].data.astype(int))
    # Caffe's DataLayer::Skip: of every 2 records the second (rank 1)
    assert labels == want
    caffe.set_solver_rank(2)
    with pytest.raises(CaffeplusError, match='rank 2 is not below the solver count 2'):
        caffe.SGDSolver(_solver_file(tmp_path))
    with pytest.raises(CaffeplusError):
        caffe.set_solver_count(0)


def test_one_solver_reads_every_record(tmp_path, monkeypatch, ranks):
    monkeypatch.chdir(REFERENCE)
    want = _lmdb_labels(64)
    solver = caffe.SGDSolver(_solver_file(tmp_path))
    assert (caffe.solver_count(), caffe.solver_rank()) == (1, 0)
    solver.net.forward()
    assert list(solver.net.blobs['label'].data.astype(int)) == want


class _TwoRanks:
    """An all-reduce as if a second rank held the same arrays."""
    rank, world = 0, 2

    def __init__(self):
        self.reduced = []

    def allreduce_(self, array):
        self.reduced.append(array.shape)
        array *= 2
        return array

    def broadcast_(self, array, root=0):
        array[...] = 7.0
        return array


def test_nccl_averages_the_gradients_as_a_solver_or_net_callback(tmp_path, monkeypatch, ranks):
    """python/train.py's use: caffe.NCCL(solver, uid), bcast(), then
    solver.add_callback(nccl) or, with layer_wise_reduce, the net's
    after_backward. One solver: nothing to exchange."""
    monkeypatch.chdir(REFERENCE)
    solver = caffe.SGDSolver(_solver_file(tmp_path, layer_wise_reduce=False))
    nccl = caffe.NCCL(solver, None)
    before = [p.data.copy() for p in solver.net.learnable_params]
    nccl.bcast()
    solver.add_callback(nccl)
    solver.step(1)              # a world of one: as without it
    assert nccl._comm is None
    # Two ranks: the gradients summed, then divided by the count.
    nccl._comm, nccl.count = _TwoRanks(), 2
    for p in solver.net.learnable_params:
        p.diff[...] = 3.0
    nccl.on_gradients_ready()
    assert all(numpy.all(p.diff == 3.0) for p in solver.net.learnable_params)
    assert len(nccl._comm.reduced) == len(solver.net.learnable_params)
    nccl.bcast()
    assert all(numpy.all(p.data == 7.0) for p in solver.net.learnable_params)
    assert not numpy.all(before[0] == 7.0)
    with pytest.raises(CaffeplusError, match='layer_wise_reduce'):
        nccl(1)


def test_layer_wise_nccl_averages_each_layers_blobs(tmp_path, monkeypatch, ranks):
    monkeypatch.chdir(REFERENCE)
    solver = caffe.SGDSolver(_solver_file(tmp_path))     # layer_wise_reduce: true, Caffe's default
    nccl = caffe.NCCL(solver, None)
    nccl._comm, nccl.count = _TwoRanks(), 2
    conv1 = solver.net._layer_names.index('conv1')
    blobs = solver.net.layers[conv1].blobs
    for b in blobs:
        b.diff[...] = 5.0
    nccl(conv1)
    assert [tuple(s) for s in nccl._comm.reduced] == [tuple(b.shape) for b in blobs]
    assert all(numpy.all(b.diff == 5.0) for b in blobs)
    nccl.on_gradients_ready()           # already reduced layer by layer
    assert len(nccl._comm.reduced) == len(blobs)


def test_several_solvers_need_the_gpu_and_nccl(tmp_path, monkeypatch, ranks):
    monkeypatch.chdir(REFERENCE)
    solver = caffe.SGDSolver(_solver_file(tmp_path))
    caffe.set_solver_count(2)
    with pytest.raises(CaffeplusError, match='needs the GPU'):
        caffe.NCCL(solver, None)
    if not caffe.has_nccl():
        with pytest.raises(CaffeplusError, match='NCCL|CuPy'):
            caffe.NCCL.new_uid()


@pytest.mark.gpu
def test_timer_and_one_solvers_nccl_on_the_gpu(tmp_path, monkeypatch, ranks):
    """python/train.py with one GPU: the Timer times device work; NCCL with
    one solver trains as without it."""
    import cupy
    caffe.set_mode_gpu()
    try:
        a = cupy.ones(1 << 24, dtype=cupy.float32)
        t = caffe.Timer()
        t.start()
        for _ in range(10):
            a = a * 1.0001
        t.stop()
        assert 0.0 < t.ms < 1000.0
        monkeypatch.chdir(REFERENCE)
        solver = caffe.SGDSolver(_solver_file(tmp_path))
        uid = caffe.NCCL.new_uid() if caffe.has_nccl() else None
        nccl = caffe.NCCL(solver, uid)
        nccl.bcast()
        solver.add_callback(nccl)
        solver.net.after_backward(nccl)
        solver.step(2)
        assert solver.iter == 2 and numpy.isfinite(float(solver.net.blobs['loss'].data))
    finally:
        caffe.set_mode_cpu()


def test_only_the_root_solver_logs_its_iterations(tmp_path, monkeypatch, ranks, records):
    """Caffe's LOG_IF(INFO, Caffe::root_solver()) on the display lines."""
    monkeypatch.chdir(REFERENCE)
    shown = {}
    for rank in (0, 1):
        caffe.set_solver_count(2)
        caffe.set_solver_rank(rank)
        solver = caffe.SGDSolver(_solver_file(tmp_path, display=1))
        del records[:]
        solver.step(2)
        shown[rank] = [r.getMessage() for r in records if r.getMessage().startswith('Iteration')]
    assert 'Iteration 0, lr = 0.01' in shown[0]
    assert sum(', loss = ' in m for m in shown[0]) == 2
    assert shown[1] == []


def test_nccl_uids_are_bytes_as_pycaffes(monkeypatch):
    """BVLC's test_nccl: under Python 3 caffe.NCCL.new_uid() is bytes; a
    CuPy whose NCCL ids are tuples of signed chars gets its own form back."""
    import types
    from caffeplus.parallel import comm
    made = []
    tuple_id = tuple(range(-128, 0))

    class FakeCommunicator:
        def __init__(self, world, uid, rank):
            if not isinstance(uid, tuple):      # as CuPy's typed `tuple commId`
                raise TypeError('commId must be a tuple')
            made.append((world, uid, rank))

    fake = types.SimpleNamespace(get_unique_id=lambda: tuple_id,
                                 NcclCommunicator=FakeCommunicator)
    monkeypatch.setattr(comm, 'import_nccl', lambda: fake)
    uid = caffe.NCCL.new_uid()
    assert isinstance(uid, bytes) and uid == bytes(range(128, 256))
    cupy = types.SimpleNamespace(cuda=types.SimpleNamespace(
        Device=lambda d: __import__('contextlib').nullcontext(),
        Stream=lambda **k: None))
    monkeypatch.setitem(__import__('sys').modules, 'cupy', cupy)
    comm.NCCLComm.from_uid(uid, 1, 2, 0)
    assert made == [(2, tuple_id, 1)]
