"""BFLOAT16 storage on the GPU: a BFLOAT16 net's maps and gradients are
bfloat16 device arrays (CuPy's type, ml_dtypes.bfloat16), read and written by
cuDNN and cuBLAS with BFLOAT16 descriptors and by the fused kernels' bfloat16
builds; its results stay within BFLOAT16's rounding (8 significant bits, 2^-8
relative a value) of the FP32 net's on the same GPU. The nets are
tests/test_precision_gpu.py's."""
import numpy
import pytest

from test_precision_gpu import (NET, POOL_NET, RESIDUAL, TRAIN_NET, _inputs, _net, _pair,
                                _relative, _run, _solver, _spy_kernels)

pytestmark = pytest.mark.gpu
ml_dtypes = pytest.importorskip('ml_dtypes')
BF16 = numpy.dtype(ml_dtypes.bfloat16)


def test_bfloat16_maps_are_bfloat16_arrays_and_follow_fp32(gpu, monkeypatch):
    from caffeplus import kernels
    asked = _spy_kernels(monkeypatch)
    nets = _pair(NET, 'bf16')
    x, label = _inputs()
    before = len(kernels.failures())
    loss32, grads32 = _run(nets['fp32'], x, label)
    loss16, grads16 = _run(nets['bf16'], x, label)
    assert kernels.failures()[before:] == []
    blobs = nets['bf16']._blob_dict
    for name in ('data', 'conv1', 'norm1', 'pool1', 'conv2', 'pool2', 'ip1', 'ip2'):
        assert blobs[name].data.dtype == BF16, name
        assert blobs[name].diff.dtype == BF16, name
    for name in ('label', 'loss'):
        assert blobs[name].data.dtype == numpy.float32, name
    assert all(p.data.dtype == numpy.float32 and p.diff.dtype == numpy.float32
               for p in nets['bf16'].learnable_params)
    assert nets['bf16'].blobs['conv1'].data.dtype == numpy.float32      # pycaffe's view
    # The ReLUs and the LRN ran their kernels' bfloat16 builds.
    for k in ('cp_relu_fwd', 'cp_relu_bwd', 'cp_lrn_fwd', 'cp_lrn_bwd'):
        assert (k, 'bfloat16') in asked, k
    # 8 significant bits a stored value, a few layers deep.
    assert loss16 == pytest.approx(loss32, rel=5e-2)
    for p, g16, g32 in zip(nets['bf16'].learnable_params, grads16, grads32):
        assert _relative(g16, g32) < 1e-1, p.name
    assert _relative(nets['bf16'].blobs['data'].diff, nets['fp32'].blobs['data'].diff) < 1e-1


def test_a_shared_plan_keeps_bfloat16_maps_in_its_arena(gpu):
    ref = _net('fp32', 'shared')
    weights = [p.data.get().copy() for p in ref.learnable_params]
    net = _net('bf16', 'shared', weights)
    x, label = _inputs()
    loss32, _ = _run(ref, x, label)
    loss16, _ = _run(net, x, label)
    conv1 = net._blob_dict['conv1'].data_storage.array
    assert conv1.dtype == BF16
    plan = net.applied_plan
    lo = int(plan.arena.data.ptr)
    assert lo <= int(conv1.data.ptr) < lo + plan.arena.nbytes
    assert loss16 == pytest.approx(loss32, rel=5e-2)


def test_a_bfloat16_residual_block_runs_its_fused_chain(gpu, monkeypatch):
    """BatchNorm, Scale and ReLU as one fused chain on the bfloat16 map, the
    Eltwise SUM and Split on their kernels' bfloat16 builds; no loss scale
    (BFLOAT16 has float32's range), only the test's loss weight."""
    from caffeplus import kernels
    asked = _spy_kernels(monkeypatch)
    nets = _pair(RESIDUAL, 'bf16')
    r = numpy.random.RandomState(5)
    x = (1000 * r.standard_normal((4, 4, 8, 8))).astype(numpy.float32)
    label = r.randint(0, 3, size=4).astype(numpy.float32)
    before = len(kernels.failures())
    got = {name: _run(net, x, label) + (net.blobs['conv1'].data.copy(),)
           for name, net in nets.items()}
    assert kernels.failures()[before:] == []
    assert nets['bf16']._blob_dict['conv1'].data.dtype == BF16
    chains = nets['bf16'].__dict__.get('_fused_chains') or []
    assert any(c.fwd_done and c.bwd_done for c in chains)
    assert ('cp_bn_fwd', 'bfloat16') in asked
    numpy.testing.assert_allclose(got['bf16'][2], got['fp32'][2], rtol=1e-1, atol=1e-1)
    assert got['bf16'][0] == pytest.approx(got['fp32'][0], rel=5e-2)
    for g16, g32 in zip(got['bf16'][1], got['fp32'][1]):
        assert numpy.isfinite(g16).all()
        assert _relative(g16, g32) < 2e-1


def test_bfloat16_caffe_window_pooling_and_softmax_loss(gpu, monkeypatch):
    asked = _spy_kernels(monkeypatch)
    nets = _pair(POOL_NET, 'bf16')
    r = numpy.random.RandomState(8)
    x = (3 * r.standard_normal((4, 3, 8, 8))).astype(numpy.float32)
    label = r.randint(0, 5, size=4).astype(numpy.float32)
    got = {name: (_run(net, x, label)[0], net.blobs['pool1'].data.copy())
           for name, net in nets.items()}
    for k in ('cp_pool_fwd', 'cp_pool_bwd', 'cp_softmax_loss_rows', 'cp_softmax_loss_bwd'):
        assert (k, 'bfloat16') in asked, k
    # Max pooling picks stored values: the map holds the inputs rounded.
    numpy.testing.assert_array_equal(got['bf16'][1],
                                     got['fp32'][1].astype(BF16).astype(numpy.float32))
    assert got['bf16'][0] == pytest.approx(got['fp32'][0], rel=5e-2)


def test_bfloat16_training_on_the_gpu_needs_no_loss_scale(gpu):
    solver = _solver(TRAIN_NET, precision='bf16')
    assert solver.net._blob_dict['conv1'].data.dtype == BF16
    assert getattr(solver, 'loss_scaler', None) is None
    solver.step(60)
    # Constant labels: the net learns to say 2.
    assert float(solver.net.blobs['loss'].data) < 0.1
    assert all(numpy.isfinite(p.data.get()).all() for p in solver.net.learnable_params)


LRN_NET = """
name: "lrn" force_backward: true
layer { name: "data" type: "Input" top: "data"
  input_param { shape { dim: 3 dim: 21 dim: 5 dim: 7 } } }
layer { name: "norm" type: "LRN" bottom: "data" top: "norm"
  lrn_param { local_size: 5 alpha: 2 beta: 0.75 k: 1 } }
layer { name: "out" type: "Power" bottom: "norm" top: "out" }
"""


def test_bfloat16_lrn_follows_cudnns_float32_lrn(gpu, monkeypatch):
    """cuDNN has no BFLOAT16 LRN: cp_lrn_fwd/cp_lrn_bwd's bfloat16 build
    against cuDNN's float32 LRN on the same (bfloat16-exact) values: y
    within one rounding, dx within a few (it reads the rounded y)."""
    asked = _spy_kernels(monkeypatch)
    nets = _pair(LRN_NET, 'bf16')
    r = numpy.random.RandomState(9)
    shape = (3, 21, 5, 7)
    x = (2 * r.standard_normal(shape)).astype(BF16).astype(numpy.float32)
    dy = r.standard_normal(shape).astype(BF16).astype(numpy.float32)
    got = {}
    for name, net in nets.items():
        # (The net's output stays float32: a Power layer of 1 reads the LRN's top.)
        net.forward(data=x)
        y = numpy.array(net.blobs['norm'].data, dtype=numpy.float32)
        dx = numpy.array(net.backward(out=dy)['data'], dtype=numpy.float32)
        got[name] = y, dx
    blobs = nets['bf16']._blob_dict
    assert blobs['data'].data.dtype == blobs['norm'].data.dtype == BF16
    assert ('cp_lrn_fwd', 'bfloat16') in asked and ('cp_lrn_bwd', 'bfloat16') in asked
    (y16, dx16), (y32, dx32) = got['bf16'], got['fp32']
    assert numpy.abs(y32 - x).max() > 0.1          # the normalisation is felt
    numpy.testing.assert_allclose(y16, y32, rtol=2 ** -8, atol=1e-6)
    assert _relative(dx16, dx32) < 1e-2
