"""FLOAT16 storage on the GPU: a 16-bit net's maps and gradients are float16
device arrays, its layers read and write them (cuDNN with 16-bit
descriptors and 16-bit copies of the FP32 master weights, the generic code
elsewhere), and its results stay within FP16's rounding of the FP32 net's.
The references are the same net in FP32 on the same GPU, and float64 NumPy
for the loss."""
import numpy
import pytest
from google.protobuf import text_format

import caffeplus
from caffeplus import precision
from caffeplus.memory import apply
from caffeplus.proto import caffe_pb2

pytestmark = pytest.mark.gpu

# Convolutions (grouped, with and without bias), in-place ReLUs, max and
# average pooling, LRN, dropout off (TEST-free), InnerProducts and the loss:
# the layers of the bench's AlexNet and VGG-16.
NET = """
name: "small"
layer { name: "data" type: "Input" top: "data" top: "label"
  input_param { shape { dim: 8 dim: 3 dim: 20 dim: 20 } shape { dim: 8 } } }
layer { name: "conv1" type: "Convolution" bottom: "data" top: "conv1"
  convolution_param { num_output: 8 kernel_size: 3 pad: 1
    weight_filler { type: "gaussian" std: 0.2 } bias_filler { type: "constant" value: 0.1 } } }
layer { name: "relu1" type: "ReLU" bottom: "conv1" top: "conv1" }
layer { name: "norm1" type: "LRN" bottom: "conv1" top: "norm1"
  lrn_param { local_size: 5 alpha: 0.0001 beta: 0.75 } }
layer { name: "pool1" type: "Pooling" bottom: "norm1" top: "pool1"
  pooling_param { pool: MAX kernel_size: 2 stride: 2 } }
layer { name: "conv2" type: "Convolution" bottom: "pool1" top: "conv2"
  convolution_param { num_output: 8 kernel_size: 3 group: 2 bias_term: false
    weight_filler { type: "gaussian" std: 0.2 } } }
layer { name: "relu2" type: "ReLU" bottom: "conv2" top: "conv2" }
layer { name: "pool2" type: "Pooling" bottom: "conv2" top: "pool2"
  pooling_param { pool: AVE kernel_size: 2 stride: 2 } }
layer { name: "ip1" type: "InnerProduct" bottom: "pool2" top: "ip1"
  inner_product_param { num_output: 16 weight_filler { type: "gaussian" std: 0.2 }
    bias_filler { type: "constant" value: 0.1 } } }
layer { name: "relu3" type: "ReLU" bottom: "ip1" top: "ip1" }
layer { name: "ip2" type: "InnerProduct" bottom: "ip1" top: "ip2"
  inner_product_param { num_output: 5 weight_filler { type: "gaussian" std: 0.2 } } }
layer { name: "loss" type: "SoftmaxWithLoss" bottom: "ip2" bottom: "label" top: "loss" }
"""


def _net(precision_name, plan=None, weights=None):
    param = text_format.Parse(NET, caffe_pb2.NetParameter())
    with precision.setting(precision_name):
        net = caffeplus.Net(param, caffe_pb2.TRAIN)
    if plan is not None:
        apply.apply_named_plan(net, plan, keep=('ip2',))
    if weights is not None:
        for p, w in zip(net.learnable_params, weights):
            p.data = w
    return net


def _inputs(seed=3):
    r = numpy.random.RandomState(seed)
    return r.standard_normal((8, 3, 20, 20)).astype(numpy.float32), \
        r.randint(0, 5, size=8).astype(numpy.float32)


def _run(net, x, label):
    net.blobs['data'].data[...] = x
    net.blobs['label'].data[...] = label
    net.clear_param_diffs()
    net.forward_prefilled()
    net.backward_all()
    return float(net.blobs['loss'].data), [p.diff.get().copy() for p in net.learnable_params]


def _relative(a, b):
    return float(numpy.linalg.norm(a - b) / max(numpy.linalg.norm(b), 1e-30))


def _pair(text, sixteen='fp16'):
    """{'fp32': the net of `text` in FP32, `sixteen`: the same net in that
    precision, with the FP32 net's weights}."""
    nets = {}
    for name in ('fp32', sixteen):
        with precision.setting(name):
            nets[name] = caffeplus.Net(text_format.Parse(text, caffe_pb2.NetParameter()),
                                       caffe_pb2.TRAIN)
    for p, q in zip(nets[sixteen].learnable_params, nets['fp32'].learnable_params):
        p.data = q.data.get()
    return nets


def _spy_kernels(monkeypatch):
    """The (kernel, dtype name) pairs asked of caffeplus.kernels from now on."""
    from caffeplus import kernels
    asked = set()
    real = kernels.kernel

    def spy(name, dtype=None):
        asked.add((name, None if dtype is None else numpy.dtype(dtype).name))
        return real(name, dtype)
    monkeypatch.setattr(kernels, 'kernel', spy)
    return asked


def test_float16_maps_are_float16_arrays_on_the_device(gpu):
    net = _net('fp16')
    x, label = _inputs()
    _run(net, x, label)
    blobs = net._blob_dict
    for name in ('data', 'conv1', 'norm1', 'pool1', 'conv2', 'pool2', 'ip1', 'ip2'):
        assert blobs[name].data.dtype == numpy.float16, name
        assert blobs[name].diff.dtype == numpy.float16, name
    for name in ('label', 'loss'):
        assert blobs[name].data.dtype == numpy.float32, name
    assert all(p.data.dtype == numpy.float32 and p.diff.dtype == numpy.float32
               for p in net.learnable_params)
    # pycaffe still reads float32 host values.
    assert net.blobs['conv1'].data.dtype == numpy.float32
    # The layers with 16-bit paths took them (none fell back on an error).
    from caffeplus import kernels
    assert not kernels.failures()


@pytest.mark.parametrize('plan', [None, 'shared'])
def test_float16_loss_and_gradients_follow_fp32_within_fp16_rounding(gpu, plan):
    ref = _net('fp32', plan)
    weights = [p.data.get().copy() for p in ref.learnable_params]
    half = _net('fp16', plan, weights)
    x, label = _inputs()
    loss32, grads32 = _run(ref, x, label)
    loss16, grads16 = _run(half, x, label)
    # The FP32 net against float64 NumPy's loss of its own scores.
    scores = ref.blobs['ip2'].data.astype(numpy.float64)
    p = numpy.exp(scores - scores.max(axis=1, keepdims=True))
    p /= p.sum(axis=1, keepdims=True)
    want = -numpy.mean(numpy.log(p[numpy.arange(8), label.astype(int)]))
    assert loss32 == pytest.approx(want, rel=1e-5)
    # FP16 keeps 11 significant bits: each stored map and gradient is off by
    # up to 2^-11 relative, a few layers deep.
    assert loss16 == pytest.approx(loss32, rel=1e-2)
    for p, g16, g32 in zip(half.learnable_params, grads16, grads32):
        assert _relative(g16, g32) < 2e-2, p.name
    if plan is None:    # (a plan need not keep the data's gradient)
        assert _relative(half.blobs['data'].diff, ref.blobs['data'].diff) < 2e-2


def test_float16_layers_read_the_weights_of_each_iteration(gpu):
    """The 16-bit weight copies are made once a pass, by the forward, and
    the backward reads the forward's: after the weights change, the next
    iteration's loss and gradients are the new weights' (the bottom
    gradients read the filters, so stale copies would show there)."""
    ref = _net('fp32')
    weights = [p.data.get().copy() for p in ref.learnable_params]
    half = _net('fp16', weights=weights)
    x, label = _inputs()
    _run(half, x, label)
    changed = [-1.5 * w for w in weights]
    for p, w in zip(half.learnable_params, changed):
        p.data = w
    loss16, grads16 = _run(half, x, label)
    ref2 = _net('fp32', weights=changed)
    loss32, grads32 = _run(ref2, x, label)
    assert loss16 == pytest.approx(loss32, rel=1e-2)
    for p, g16, g32 in zip(half.learnable_params, grads16, grads32):
        assert _relative(g16, g32) < 2e-2, p.name
    assert _relative(half.blobs['data'].diff, ref2.blobs['data'].diff) < 2e-2
    # From the second pass on, the pass's one launch wrote the copies.
    for name in ('conv1', 'conv2', 'ip1', 'ip2'):
        copies = half.layer_dict[name]._weight_copies
        assert all(by_pass for _, _, by_pass, _ in copies.values()), name


def test_a_shared_plan_gives_16_bit_maps_16_bit_views_of_its_arena(gpu):
    net = _net('fp16', 'shared')
    x, label = _inputs()
    _run(net, x, label)
    plan = net.applied_plan
    assert plan is not None and plan.arena_bytes > 0
    conv1 = net._blob_dict['conv1'].data_storage.array
    assert conv1.dtype == numpy.float16
    # The map lies inside the arena, not in memory of its own.
    lo, hi = int(plan.arena.data.ptr), int(plan.arena.data.ptr) + plan.arena.nbytes
    assert lo <= int(conv1.data.ptr) < hi
    # Its bytes are counted at two per value: the placed maps and gradients
    # (all but the labels and the loss 16-bit) take about half FP32's.
    single = _net('fp32', 'shared')
    _run(single, x, label)
    assert 0.45 < _map_bytes(net) / _map_bytes(single) < 0.55


def _map_bytes(net):
    bufs, placed, _ = net.applied_plan.layout
    return sum(b.nbytes for b in bufs[:len(placed)])


SOLVER = """
base_lr: 0.05 momentum: 0.9 lr_policy: "fixed" max_iter: 100 display: 0
snapshot_after_train: false solver_mode: GPU random_seed: 7
"""


def _solver(net_text, **caffeplus_param):
    from caffeplus.solver import get_solver
    p = text_format.Parse(SOLVER, caffe_pb2.SolverParameter())
    p.net_param.CopyFrom(text_format.Parse(net_text, caffe_pb2.NetParameter()))
    for k, v in caffeplus_param.items():
        setattr(p.caffeplus_param, k, v)
    return get_solver(p)


TRAIN_NET = NET.replace(
    'layer { name: "data" type: "Input" top: "data" top: "label"\n'
    '  input_param { shape { dim: 8 dim: 3 dim: 20 dim: 20 } shape { dim: 8 } } }',
    'layer { name: "data" type: "DummyData" top: "data" top: "label"\n'
    '  dummy_data_param { shape { dim: 8 dim: 3 dim: 20 dim: 20 } shape { dim: 8 }\n'
    '    data_filler { type: "gaussian" std: 1 } data_filler { type: "constant" value: 2 } } }')


@pytest.mark.filterwarnings('ignore:invalid value:RuntimeWarning')
def test_float16_training_on_the_gpu_recovers_from_an_overflowing_scale(gpu, caplog_caffeplus):
    net = TRAIN_NET.replace('name: "small"', 'name: "small"\nglobal_grad_scale_adaptive: true\n'
                            'global_grad_scale: %d' % 2 ** 40)
    solver = _solver(net, precision='fp16', loss_scale_window=5)
    assert solver.net._blob_dict['conv1'].data.dtype == numpy.float16
    first = [p.data.get().copy() for p in solver.net.learnable_params]
    solver.step(1)
    scaler = solver.loss_scaler
    assert scaler._unscale is not None     # one kernel for every gradient
    assert scaler.scale == 2 ** 39 and scaler.skipped_steps == 1
    for p, before in zip(solver.net.learnable_params, first):
        numpy.testing.assert_array_equal(p.data.get(), before)      # the step was skipped
    solver.step(60)
    assert scaler.scale < 2 ** 30
    assert any('global_grad_scale raised to' in m for m in caplog_caffeplus)
    # Constant labels: the net learns to say 2.
    assert float(solver.net.blobs['loss'].data) < 0.1
    assert all(numpy.isfinite(p.data.get()).all() for p in solver.net.learnable_params)


# A residual block as ResNet-50's: convolution, BatchNorm, Scale, ReLU, a
# shortcut through a Split and Eltwise SUM. The input is large (|x| in the
# thousands): a variance summed from float16 squares would overflow. The loss
# weight stands in for the loss scale FP16 training uses: at 1, BatchNorm's
# input gradient here (~1e-8) is below float16's smallest subnormal and the
# first convolution's weight gradient is off by ~20% in any 16-bit arithmetic
# (the CPU's emulation agrees).
RESIDUAL = """
name: "residual"
layer { name: "data" type: "Input" top: "data" top: "label"
  input_param { shape { dim: 4 dim: 4 dim: 8 dim: 8 } shape { dim: 4 } } }
layer { name: "conv1" type: "Convolution" bottom: "data" top: "conv1"
  convolution_param { num_output: 4 kernel_size: 3 pad: 1 bias_term: false
    weight_filler { type: "gaussian" std: 0.3 } } }
layer { name: "bn1" type: "BatchNorm" bottom: "conv1" top: "conv1" }
layer { name: "scale1" type: "Scale" bottom: "conv1" top: "conv1"
  scale_param { bias_term: true filler { type: "constant" value: 1.5 }
    bias_filler { type: "constant" value: 0.1 } } }
layer { name: "relu1" type: "ReLU" bottom: "conv1" top: "conv1" }
layer { name: "sum" type: "Eltwise" bottom: "conv1" bottom: "data" top: "sum" }
layer { name: "relu2" type: "ReLU" bottom: "sum" top: "sum" }
layer { name: "ip" type: "InnerProduct" bottom: "sum" top: "ip"
  inner_product_param { num_output: 3 weight_filler { type: "gaussian" std: 0.0005 } } }
layer { name: "loss" type: "SoftmaxWithLoss" bottom: "ip" bottom: "label" top: "loss"
  loss_weight: 64 }
"""


# (shape, loss weight, whether BatchNorm shares a channel among blocks: its
# split kernels, whose smaller gradients a value need a larger loss scale).
# Runs of 64 and 2,304 values take 16-byte vectors, 14 x 14's 196 8-byte ones.
@pytest.mark.parametrize('shape,loss_weight,split', [
    ((4, 4, 8, 8), 64, False), ((8, 4, 48, 48), 1024, True),
    ((4, 4, 14, 14), 64, False), ((96, 4, 14, 14), 1024, True)])
def test_a_float16_residual_block_follows_fp32(gpu, shape, loss_weight, split):
    from caffeplus import kernels
    assert split == (kernels.blocks_per_channel(shape[1], shape[0] * shape[2] * shape[3]) > 1)
    text = RESIDUAL.replace('shape { dim: 4 dim: 4 dim: 8 dim: 8 } shape { dim: 4 }',
                            'shape { dim: %d dim: %d dim: %d dim: %d } shape { dim: %d }'
                            % (shape + (shape[0],))).replace('loss_weight: 64',
                                                             'loss_weight: %d' % loss_weight)
    nets = _pair(text)
    r = numpy.random.RandomState(5)
    x = (1000 * r.standard_normal(shape)).astype(numpy.float32)
    label = r.randint(0, 3, size=shape[0]).astype(numpy.float32)
    got = {name: _run(net, x, label) + (net.blobs['conv1'].data.copy(),)
           for name, net in nets.items()}
    assert nets['fp16']._blob_dict['conv1'].data.dtype == numpy.float16
    # BatchNorm, Scale and ReLU ran as one fused chain on the 16-bit map, the
    # Eltwise SUM and Split backward on their kernels' 16-bit builds.
    assert not kernels.failures()
    chains = nets['fp16'].__dict__.get('_fused_chains') or []
    assert any(c.fwd_done and c.bwd_done for c in chains)
    assert numpy.isfinite(got['fp16'][2]).all()
    # Normalized, scaled by 1.5 and shifted: values of a few units, to FP16's
    # 2^-11 relative rounding of a map a few layers deep.
    numpy.testing.assert_allclose(got['fp16'][2], got['fp32'][2], rtol=2e-2, atol=2e-2)
    assert got['fp16'][0] == pytest.approx(got['fp32'][0], rel=1e-2)
    for g16, g32 in zip(got['fp16'][1], got['fp32'][1]):
        assert numpy.isfinite(g16).all()
        assert _relative(g16, g32) < 5e-2


# Pooling with Caffe's ceil-rule windows (8 x 8, 3 x 3 / 2, pad 1: Caffe's
# output is 5 x 5, cuDNN's would be 4 x 4) and SoftmaxWithLoss on 16-bit
# maps run their kernels' 16-bit builds.
POOL_NET = """
name: "pools"
force_backward: true
layer { name: "data" type: "Input" top: "data" top: "label"
  input_param { shape { dim: 4 dim: 3 dim: 8 dim: 8 } shape { dim: 4 } } }
layer { name: "pool1" type: "Pooling" bottom: "data" top: "pool1"
  pooling_param { pool: MAX kernel_size: 3 stride: 2 pad: 1 } }
layer { name: "pool2" type: "Pooling" bottom: "pool1" top: "pool2"
  pooling_param { pool: AVE kernel_size: 3 stride: 2 } }
layer { name: "ip" type: "InnerProduct" bottom: "pool2" top: "ip"
  inner_product_param { num_output: 5 weight_filler { type: "gaussian" std: 0.1 } } }
layer { name: "loss" type: "SoftmaxWithLoss" bottom: "ip" bottom: "label" top: "loss"
  loss_weight: 64 }
"""


def test_float16_caffe_window_pooling_and_softmax_loss_follow_fp32(gpu, monkeypatch):
    from caffeplus import kernels
    asked = _spy_kernels(monkeypatch)
    nets = _pair(POOL_NET)
    r = numpy.random.RandomState(8)
    x = (3 * r.standard_normal((4, 3, 8, 8))).astype(numpy.float32)
    label = r.randint(0, 5, size=4).astype(numpy.float32)
    got = {name: (_run(net, x, label)[0], net.blobs['data'].diff.copy(),
                  net.blobs['pool1'].data.copy()) for name, net in nets.items()}
    assert nets['fp16']._blob_dict['pool1'].data.dtype == numpy.float16
    assert nets['fp16'].blobs['pool1'].data.shape == (4, 3, 5, 5)
    for k in ('cp_pool_fwd', 'cp_pool_bwd', 'cp_softmax_loss_rows', 'cp_softmax_loss_bwd'):
        assert (k, 'float16') in asked, k
    assert not kernels.failures()
    # Max pooling picks stored values: the FP16 map holds the inputs rounded.
    numpy.testing.assert_array_equal(got['fp16'][2],
                                     got['fp32'][2].astype(numpy.float16).astype(numpy.float32))
    assert got['fp16'][0] == pytest.approx(got['fp32'][0], rel=1e-2)
    assert _relative(got['fp16'][1], got['fp32'][1]) < 2e-2


# A Scale with no BatchNorm before it (not chained), in place, learning its
# scale and bias.
SCALE_NET = """
name: "scale"
layer { name: "data" type: "Input" top: "data" top: "label"
  input_param { shape { dim: 4 dim: 3 dim: 12 dim: 12 } shape { dim: 4 } } }
layer { name: "conv" type: "Convolution" bottom: "data" top: "conv"
  convolution_param { num_output: 6 kernel_size: 3 pad: 1
    weight_filler { type: "gaussian" std: 0.3 } bias_filler { type: "constant" value: 0.1 } } }
layer { name: "scale" type: "Scale" bottom: "conv" top: "conv"
  scale_param { bias_term: true filler { type: "uniform" min: 0.5 max: 1.5 }
    bias_filler { type: "constant" value: 0.2 } } }
layer { name: "relu" type: "ReLU" bottom: "conv" top: "conv" }
layer { name: "ip" type: "InnerProduct" bottom: "conv" top: "ip"
  inner_product_param { num_output: 5 weight_filler { type: "gaussian" std: 0.1 } } }
layer { name: "loss" type: "SoftmaxWithLoss" bottom: "ip" bottom: "label" top: "loss"
  loss_weight: 64 }
"""


def test_an_unchained_float16_scale_runs_its_kernels_16_bit_build(gpu):
    """The Scale's kernels take the 16-bit map as it is (its kept bottom copy
    16-bit too) and follow the FP32 net within FP16's rounding."""
    from caffeplus import kernels
    nets = _pair(SCALE_NET)
    r = numpy.random.RandomState(6)
    x = r.standard_normal((4, 3, 12, 12)).astype(numpy.float32)
    label = r.randint(0, 5, size=4).astype(numpy.float32)
    before = len(kernels.failures())
    got = {name: _run(net, x, label) for name, net in nets.items()}
    assert kernels.failures()[before:] == []
    scale = nets['fp16'].layer_dict['scale']
    assert scale._keep_buf is not None and scale._keep_buf.dtype == numpy.float16
    assert scale.internal_buffers()['bottom_copy'][1] == numpy.float16
    assert got['fp16'][0] == pytest.approx(got['fp32'][0], rel=1e-2)
    for g16, g32 in zip(got['fp16'][1], got['fp32'][1]):
        assert numpy.isfinite(g16).all()
        assert _relative(g16, g32) < 3e-2
