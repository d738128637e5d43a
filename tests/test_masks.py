"""Masks instead of maps (caffeplus.memory.masks): max pooling keeping a
one-byte argmax and ReLU keeping one bit a value, so a plan drops the maps
they would read in backward. Which layers are masked, the memory it gives
back, the masked layers against the unmasked ones (CPU, emulated kernels,
GPU), and training that stays the same."""
import os
import sys
import zlib

import numpy
import pytest

import caffeplus
from caffeplus import config
from caffeplus import backend, kernels, log
from caffeplus.blob import Blob
from caffeplus.errors import CaffeplusError
from caffeplus.layer import create_layer
from caffeplus.memory import budget, liveness, masks, shapes
from caffeplus.proto import caffe_pb2
from plan_helpers import param_of, sgd_run
from conftest import ROOT, SHARED, build_emulator, emulating

sys.path.insert(0, ROOT)
from dev import check_plans_equal as cpe  # noqa: E402

# relu1_1's map is conv1_2's input (its filter gradient reads it): never
# masked. relu1_2's and relu2_1's maps are read only by max poolings.
VGG_LIKE = '''
name: "vgg_like"
layer { name: "data" type: "DummyData" top: "data" top: "label"
        dummy_data_param { data_filler { type: "gaussian" std: 1 }
                           shape { dim: 4 dim: 3 dim: %(hw)d dim: %(hw)d }
                           data_filler { type: "uniform" min: 0 max: 2.99 } shape { dim: 4 } } }
layer { name: "conv1_1" type: "Convolution" bottom: "data" top: "conv1_1"
        convolution_param { num_output: 8 kernel_size: 3 pad: 1 weight_filler { type: "xavier" }
                            bias_filler { type: "constant" value: 0.05 } } }
layer { name: "relu1_1" type: "ReLU" bottom: "conv1_1" top: "conv1_1" }
layer { name: "conv1_2" type: "Convolution" bottom: "conv1_1" top: "conv1_2"
        convolution_param { num_output: 8 kernel_size: 3 pad: 1 weight_filler { type: "xavier" } } }
layer { name: "relu1_2" type: "ReLU" bottom: "conv1_2" top: "conv1_2" }
layer { name: "pool1" type: "Pooling" bottom: "conv1_2" top: "pool1"
        pooling_param { pool: MAX kernel_size: 2 stride: 2 } }
layer { name: "conv2_1" type: "Convolution" bottom: "pool1" top: "conv2_1"
        convolution_param { num_output: 16 kernel_size: 3 pad: 1 weight_filler { type: "xavier" } } }
layer { name: "relu2_1" type: "ReLU" bottom: "conv2_1" top: "conv2_1" }
layer { name: "pool2" type: "Pooling" bottom: "conv2_1" top: "pool2"
        pooling_param { pool: MAX kernel_size: %(k2)d stride: 2 } }
layer { name: "ip" type: "InnerProduct" bottom: "pool2" top: "ip"
        inner_product_param { num_output: 3 weight_filler { type: "xavier" } } }
layer { name: "loss" type: "SoftmaxWithLoss" bottom: "ip" bottom: "label" top: "loss" }
'''
MASKED = ('relu1_2', 'pool1', 'relu2_1', 'pool2')


def vgg_like(k2=3, hw=16):
    """pool2 overlapping (3x3, stride 2) or not (2x2). At 16x16 pool2's
    3x3 windows over 8x8 follow Caffe's ceil rule, which cuDNN's do not
    (the kernels run it unmasked too); at 18x18 (9x9) cuDNN's agree."""
    return param_of(VGG_LIKE % {'k2': k2, 'hw': hw})


@pytest.fixture(autouse=True)
def _quiet(monkeypatch):
    monkeypatch.delenv('CAFFEPLUS_MASKS', raising=False)
    level = log.logger.level
    log.logger.setLevel(30)
    yield
    log.logger.setLevel(level)


def build(param, memory=None, seed=3):
    caffeplus.set_random_seed(seed)
    return caffeplus.Net(param, caffeplus.TRAIN, memory=memory)


# -- which layers ------------------------------------------------------------------
def test_pools_and_the_relus_only_they_read_are_chosen():
    net = shapes.build_net(vgg_like())
    assert masks.choose(net) == MASKED
    assert masks.apply(net, masks.choose(net)) == MASKED == masks.applied(net)
    assert all(net.layers[net._layer_names.index(n)].backward_reads == frozenset()
               for n in MASKED)
    assert masks.apply(net, ()) == ()
    relu, pool = (net.layers[net._layer_names.index(n)] for n in ('relu1_2', 'pool1'))
    assert relu.backward_reads == frozenset(('top_data',))
    assert pool.backward_reads == frozenset(('bottom_data', 'top_data'))     # cuDNN's


def test_a_relu_whose_map_a_convolution_reads_is_not_masked():
    text = VGG_LIKE.replace('bottom: "pool1" top: "conv2_1"', 'bottom: "conv1_2" top: "conv2_1"')
    net = shapes.build_net(param_of(text % {'k2': 3, 'hw': 16}))
    # conv2_1 reads conv1_2's map now: neither relu1_2 nor pool1 (whose mask
    # would free nothing) is masked.
    assert masks.choose(net) == ('relu2_1', 'pool2')


SPLIT_NET = '''
name: "split"
layer { name: "data" type: "DummyData" top: "data" top: "label"
        dummy_data_param { data_filler { type: "gaussian" std: 1 }
                           shape { dim: 2 dim: 3 dim: 8 dim: 8 }
                           data_filler { type: "constant" value: 1 } shape { dim: 2 } } }
layer { name: "conv1" type: "Convolution" bottom: "data" top: "conv1"
        convolution_param { num_output: 4 kernel_size: 3 pad: 1 } }
layer { name: "relu1" type: "ReLU" bottom: "conv1" top: "conv1" }
layer { name: "pool1" type: "Pooling" bottom: "conv1" top: "pool1"
        pooling_param { pool: MAX kernel_size: 2 stride: 2 } }
layer { name: "conv2" type: "Convolution" bottom: "conv1" top: "conv2"
        convolution_param { num_output: 4 kernel_size: 3 } }
layer { name: "ipa" type: "InnerProduct" bottom: "pool1" top: "ipa"
        inner_product_param { num_output: 3 } }
layer { name: "ipb" type: "InnerProduct" bottom: "conv2" top: "ipb"
        inner_product_param { num_output: 3 } }
layer { name: "lossa" type: "SoftmaxWithLoss" bottom: "ipa" bottom: "label" top: "lossa" }
layer { name: "lossb" type: "SoftmaxWithLoss" bottom: "ipb" bottom: "label" top: "lossb" }
'''


def test_a_pool_whose_input_a_split_shares_with_a_convolution_is_not_masked():
    # pool1 and conv2 both read conv1's map: the net splits it, and the
    # Split's tops share the map conv2's backward reads.
    net = shapes.build_net(param_of(SPLIT_NET))
    assert any(l.layer_param.type == 'Split' for l in net.layers)
    assert masks.choose(net) == ()


def test_no_masks_without_the_fused_kernels():
    net = shapes.build_net(vgg_like())
    was = kernels.set_enabled(False)
    try:
        assert masks.choose(net) == ()
    finally:
        kernels.set_enabled(was)


def test_vgg16_masks_every_pool_and_the_relu_before_it():
    path = os.path.join(SHARED, 'bench', 'vgg16_b64.prototxt')
    if not os.path.exists(path):
        pytest.fail('test data missing: %s' % path)
    net = shapes.build_net(shapes.load_net_param(path))
    chosen = masks.choose(net)
    assert set(chosen) == {'pool%d' % i for i in range(1, 6)} | \
        {'relu1_2', 'relu2_2', 'relu3_3', 'relu4_3', 'relu5_3'}


@pytest.mark.parametrize('plan, env, want', [
    ('auto', None, MASKED), ('auto', '0', ()), ('shared', None, MASKED[:2]),
    ('shared', '0', ()), ('shared', '1', MASKED), ('offload', None, MASKED[:2]),
    ('offload', '1', MASKED), ('stock', '1', ()), ('arena', '1', ())])
def test_which_plans_mask(monkeypatch, plan, env, want):
    if env is not None:
        config.set('masks', env)
    # 18x18: pool2's overlapping windows are cuDNN's too, where the masked
    # pooling sums in another order; shared and offload keep cuDNN's there.
    net = shapes.build_net(vgg_like(hw=18))
    assert masks.for_plan(net, plan) == want
    if plan == 'auto':
        assert budget.estimate_plan(net, 'auto').masked == want
    else:
        assert budget.estimate_plan(net, plan).masked == want == masks.applied(net)


# -- the memory they give back ---------------------------------------------------------
def _life(bufs, kind, blob):
    return next((b.start, b.end) for b in bufs if b.kind == kind and blob in b.blobs)


def test_a_masked_map_dies_after_the_forward_of_its_pooling():
    net = shapes.build_net(vgg_like())
    L = len(net.layers)
    pool1 = net._layer_names.index('pool1')
    before = _life(liveness.buffers(net), 'data', 'conv1_2')
    assert before[1] >= L                       # read again in backward (relu1_2, pool1)
    masks.apply(net, masks.choose(net))
    after = _life(liveness.buffers(net), 'data', 'conv1_2')
    assert after[0] == before[0] and after[1] == pool1      # its last read: pool1's forward
    assert _life(liveness.buffers(net), 'data', 'conv1_1')[1] >= L     # conv1_2's input


def test_masks_lower_the_vgg16_b256_peak_and_auto_runs_less_again(monkeypatch):
    path = os.path.join(SHARED, 'bench', 'vgg16_b256.prototxt')
    if not os.path.exists(path):
        pytest.fail('test data missing: %s' % path)
    net = shapes.build_net(shapes.load_net_param(path))
    config.set('masks', '0')
    plain = budget.estimate_plan(net, 'shared')
    config.set('masks', None)
    assert budget.estimate_plan(net, 'shared').masked      # VGG-16's: the same bits
    config.set('masks', '1')
    masked = budget.estimate_plan(net, 'shared')    # the net stays masked (sizes below)
    # conv1_2's 3.3 GB map and the other four before the poolings leave;
    # the masks take 1/16 and 1/32 of them.
    assert masked.peak_bytes < plain.peak_bytes - 3 * 2 ** 30
    internal = sum(net.layers[net._layer_names.index(n)].gpu_internal_bytes()
                   for n in masked.masked)
    conv1_2 = 256 * 64 * 224 * 224 * 4
    assert conv1_2 // 32 + conv1_2 // 16 < internal < (plain.peak_bytes - masked.peak_bytes) / 5
    config.set('masks', None)
    # Under 12 GiB auto had to run four convolutions again; masked, one.
    auto = budget.estimate_plan(net, 'auto', budget=budget.parse_bytes('12G'))
    assert auto.masked and auto.peak_bytes <= budget.planned_budget(budget.parse_bytes('12G'))
    assert len(auto.recomputed) <= 1


# -- the layers ---------------------------------------------------------------------
LAYER_CASES = [
    ('pool_2x2', 'type: "Pooling" pooling_param { pool: MAX kernel_size: 2 stride: 2 }',
     (2, 3, 8, 8)),
    ('pool_3x3_s2_ceil', 'type: "Pooling" pooling_param { pool: MAX kernel_size: 3 stride: 2 }',
     (2, 3, 9, 8)),
    ('pool_3x3_s1_pad', 'type: "Pooling" pooling_param { pool: MAX kernel_size: 3 stride: 1 '
     'pad: 1 }', (2, 2, 7, 6)),
    ('pool_rect', 'type: "Pooling" pooling_param { pool: MAX kernel_h: 2 kernel_w: 3 '
     'stride_h: 3 stride_w: 2 }', (2, 2, 10, 9)),
    ('pool_2x2_odd', 'type: "Pooling" pooling_param { pool: MAX kernel_size: 2 stride: 2 }',
     (2, 3, 9, 7)),                                     # ceil: the windows do not tile
    ('pool_3x3_s3_tiles', 'type: "Pooling" pooling_param { pool: MAX kernel_size: 3 '
     'stride: 3 }', (2, 2, 9, 12)),
    ('relu', 'type: "ReLU"', (3, 4, 5, 7)),             # 420 values: not a multiple of 32
    ('relu_long', 'type: "ReLU"', (2, 3, 33, 31)),
]
EXACT = ('pool_2x2', 'pool_rect', 'pool_2x2_odd', 'pool_3x3_s3_tiles', 'relu', 'relu_long')


def _layer_run(text, shape, seed, masked, gpu=False, in_place=False):
    """Forward and backward twice; tops and bottom diffs as NumPy arrays."""
    caffeplus.set_mode_gpu() if gpu else caffeplus.set_mode_cpu()
    try:
        rng = numpy.random.default_rng(seed)
        lp = caffe_pb2.LayerParameter()
        from google.protobuf import text_format
        text_format.Parse('name: "t" ' + text, lp)
        layer = create_layer(lp)
        bottom = [Blob(shape, name='b')]
        top = bottom if in_place else [Blob(name='t')]
        out = {}
        for it in range(2):
            x = rng.standard_normal(shape).astype(numpy.float32)
            x[x < -1.2] = 0.0                      # ties at zero, as after a ReLU
            x.reshape(-1)[::17] = 0.75             # and positive ties
            bottom[0].data = x
            if it == 0:
                layer.setup(bottom, top)
                assert layer.set_masked(masked) == masked
            layer.reshape(bottom, top)
            layer.forward(bottom, top)
            out['top%d' % it] = backend.to_numpy(top[0].data).copy()
            top[0].diff = rng.standard_normal(top[0].shape).astype(numpy.float32)
            layer.backward(top, [True], bottom)
            out['bdiff%d' % it] = backend.to_numpy(bottom[0].diff).copy()
        return layer, out
    finally:
        caffeplus.set_mode_cpu()


def _check_layer(case, gpu=False, in_place=False):
    name, text, shape = case
    if in_place and not name.startswith('relu'):
        pytest.skip('pooling is never in place')
    seed = zlib.crc32(name.encode())
    was = kernels.set_enabled(False)
    try:
        _, want = _layer_run(text, shape, seed, False, in_place=in_place)
    finally:
        kernels.set_enabled(was)
    layer, got = _layer_run(text, shape, seed, True, gpu=gpu, in_place=in_place)
    assert layer.masked
    if (gpu or kernels.emulating()) and name.startswith('pool'):
        assert layer._arg8 is not None          # the masked kernels ran
    for key in want:
        # The first maximum of each window (ties too), dy * (y > 0) for the
        # ReLU: bit for bit. Where windows overlap, a value's gradients are
        # summed in another order than the CPU layer's.
        if key.startswith('top') or name in EXACT:
            numpy.testing.assert_array_equal(got[key].view(numpy.uint32),
                                             want[key].view(numpy.uint32), err_msg='%s %s'
                                             % (name, key))
        else:
            numpy.testing.assert_allclose(got[key], want[key], rtol=1e-6, atol=1e-6,
                                          err_msg='%s %s' % (name, key))


@pytest.mark.parametrize('case', LAYER_CASES, ids=[c[0] for c in LAYER_CASES])
def test_masked_layers_on_the_cpu(case):
    _check_layer(case)
    if case[0].startswith('relu'):
        _check_layer(case, in_place=True)


@pytest.mark.parametrize('case', LAYER_CASES, ids=[c[0] for c in LAYER_CASES])
def test_masked_layers_emulated(case, emulated):
    _check_layer(case)
    if case[0].startswith('relu'):
        _check_layer(case, in_place=True)


@pytest.mark.gpu
@pytest.mark.parametrize('case', LAYER_CASES, ids=[c[0] for c in LAYER_CASES])
def test_masked_layers_gpu(case):
    kernels.reset_kernels()
    _check_layer(case, gpu=True)
    if case[0].startswith('relu'):
        _check_layer(case, gpu=True, in_place=True)


def test_backward_before_forward_is_a_clear_error():
    net = build(vgg_like())
    relu = net.layers[net._layer_names.index('relu1_2')]
    relu.set_masked(True)
    with pytest.raises(CaffeplusError, match="relu1_2.*sign bits"):
        relu.backward([net.blobs['conv1_2']], [True], [net.blobs['conv1_2']])


# -- training -----------------------------------------------------------------------
def _same(a, b):
    (la, wa), (lb, wb) = a, b
    return la == lb and all(numpy.array_equal(x, y) for x, y in zip(wa, wb))


def test_auto_masked_training_is_bit_identical_to_stock_on_the_cpu():
    stock = sgd_run(build(vgg_like(), 'stock'), 4)
    auto = build(vgg_like(), 'auto')
    assert masks.applied(auto) == MASKED
    assert _same(sgd_run(auto, 4), stock)


def test_a_masked_map_is_released_and_says_so():
    net = build(vgg_like(), 'auto')
    net.forward_prefilled()
    net.backward_all()
    with pytest.raises(CaffeplusError, match="conv1_2"):
        net.blobs['conv1_2'].data     # noqa: B018


def test_masked_training_emulated_is_bit_identical(emulated, monkeypatch):
    """The masked kernels (emulated) in a net: shared with masks against
    shared without, every other layer the same."""
    plain = sgd_run(build(vgg_like(), 'shared'), 2)
    config.set('masks', '1')
    net = build(vgg_like(), 'shared')
    assert masks.applied(net) == MASKED
    assert _same(sgd_run(net, 2), plain)


@pytest.mark.gpu
@pytest.mark.parametrize('k2', [2, 3])
def test_gpu_masked_training_is_bit_identical_to_shared(monkeypatch, k2):
    """Deterministic math, the same algorithms: shared with every mask
    against shared with none (cuDNN's pooling, or for pool2 with k2=3 and
    Caffe's ceil rule the kernels' int32 argmax), 10 iterations, bit for
    bit."""
    param = vgg_like(k2)
    config.set('masks', '0')
    plain = cpe.train(param, 'shared', 10, 0, gpu=0, math='deterministic')
    config.set('masks', '1')
    masked = cpe.train(param, 'shared', 10, 0, gpu=0, math='deterministic')
    assert not cpe.differences(plain, masked), cpe.differences(plain, masked)


@pytest.mark.gpu
@pytest.mark.parametrize('k2', [2, 3])
def test_gpu_float16_masked_training_is_bit_identical_to_shared(k2):
    """A FLOAT16 net masks as an FP32 one (the mask kernels' 16-bit build):
    shared with every mask against shared with none, 10 iterations, bit for
    bit."""
    from caffeplus import precision
    param = vgg_like(k2)
    runs, applied = {}, {}
    for setting in ('0', '1'):
        config.set('masks', setting)
        with precision.setting('fp16'):
            runs[setting] = cpe.train(
                param, 'shared', 10, 0, gpu=0, math='deterministic',
                solver_hook=lambda s, k=setting: applied.__setitem__(k, masks.applied(s.net)))
    assert applied == {'0': (), '1': MASKED}
    assert not cpe.differences(runs['0'], runs['1']), cpe.differences(runs['0'], runs['1'])
    assert not kernels.failures()


@pytest.mark.gpu
def test_gpu_masked_layers_past_two_to_the_32_values():
    """64-bit indices: a ReLU and a 2x2 max pooling over 2**32 + 2**20
    values (VGG-16's conv1_2 map past batch 1300), checked at the start and
    the end against NumPy."""
    import cupy
    from caffeplus import kernels as K
    caffeplus.set_mode_gpu()
    try:
        n, c, h, w = 2 ** 16 + 16, 64, 32, 32
        total = n * c * h * w
        assert total > 2 ** 32
        relu = create_layer(param_of('layer { name: "r" type: "ReLU" bottom: "x" top: "x" }')
                            .layer[0])
        pool = create_layer(param_of('layer { name: "p" type: "Pooling" bottom: "x" top: "y" '
                                     'pooling_param { pool: MAX kernel_size: 2 stride: 2 } }')
                            .layer[0])
        x, y = Blob((n, c, h, w), name='x'), Blob(name='y')
        relu.setup([x], [x])
        pool.setup([x], [y])
        assert relu.set_masked(True) and pool.set_masked(True)
        rng = cupy.random.default_rng(5)
        flat = K.flat(x)
        for o in range(0, total, 2 ** 30):
            m = min(2 ** 30, total - o)
            flat[o:o + m] = rng.standard_normal(m, dtype=cupy.float32)
        head = backend.to_numpy(flat[:2 * c * h * w]).reshape(2, c, h, w)
        tail = backend.to_numpy(flat[total - 2 * c * h * w:total]).reshape(2, c, h, w)
        relu.forward([x], [x])
        pool.forward([x], [y])
        yd = K.flat(y, diff=True)
        yd[:y.count] = 1.0
        pool.backward([y], [True], [x])
        relu.backward([x], [True], [x])
        dx = K.flat(x, diff=True)
        for part, got_y, got_dx in (
                (head, K.flat(y)[:2 * c * 16 * 16], dx[:2 * c * h * w]),
                (tail, K.flat(y)[y.count - 2 * c * 16 * 16:y.count], dx[total - 2 * c * h * w:total])):
            r = numpy.maximum(part, 0)
            win = r.reshape(2, c, 16, 2, 16, 2).transpose(0, 1, 2, 4, 3, 5).reshape(2, c, 16, 16, 4)
            numpy.testing.assert_array_equal(backend.to_numpy(got_y).reshape(2, c, 16, 16),
                                             win.max(-1))
            first = win.argmax(-1)
            want = numpy.zeros_like(win)
            numpy.put_along_axis(want, first[..., None], 1.0, -1)
            want *= (win > 0)
            want = want.reshape(2, c, 16, 16, 2, 2).transpose(0, 1, 2, 4, 3, 5).reshape(2, c, h, w)
            numpy.testing.assert_array_equal(backend.to_numpy(got_dx).reshape(2, c, h, w), want)
    finally:
        caffeplus.set_mode_cpu()


def test_the_memory_command_names_the_masked_layers(tmp_path, capsys):
    import json
    from caffeplus import cli
    model = tmp_path / 'vgg_like.prototxt'
    model.write_text(VGG_LIKE % {'k2': 3, 'hw': 18})
    assert cli.main(['memory', '-model', str(model), '--estimate', '--json',
                     '--plans', 'shared,auto']) == 0
    plans = json.loads(capsys.readouterr().out)['plans']
    assert plans['auto']['masked'] == list(MASKED)
    assert plans['shared']['masked'] == ['relu1_2', 'pool1']      # the same bits as stock's


@pytest.fixture(scope='module')
def emulator_64():
    """The kernels built with no 32-bit index path: every launch takes the
    64-bit one (maps past 2**31 values)."""
    from caffeplus import kernels as K
    define = '#define CP_INDEX_32 2147483648ULL'
    assert define in K.SOURCE
    with emulating(build_emulator(K.SOURCE.replace(define, '#define CP_INDEX_32 0ULL'))) as emu:
        yield emu


@pytest.mark.parametrize('case', [c for c in LAYER_CASES if c[0].startswith('pool')],
                         ids=[c[0] for c in LAYER_CASES if c[0].startswith('pool')])
def test_masked_pooling_64_bit_indices_emulated(case, emulator_64):
    _check_layer(case)


@pytest.mark.parametrize('precision_name', [None, 'fp16', 'bf16'])
def test_a_pool_between_orders_is_not_masked_in_the_estimate(precision_name):
    """A 16-bit VGG-16 on the GPU stores conv5_3 channels-last and pool5
    in Caffe's order (fc6 reads it), so pool5 runs cuDNN between the orders
    and cannot be masked (the masked kernels take one order). The estimate,
    built on the host where every map is in Caffe's order, must choose as
    the GPU does: a plan masking pool5 did not fit the GPU's net (conv5_3
    read in pool5's backward outside its planned lives)."""
    from caffeplus import layout, precision
    path = os.path.join(SHARED, 'bench', 'vgg16_b64.prototxt')
    param = shapes.load_net_param(path, phase=caffe_pb2.TRAIN)
    if precision_name:
        precision.override(param, precision_name)
    net = shapes.build_net(param)
    with config.using(layout='nhwc'):
        nhwc = {net._blob_names[i] for i in layout.modelled_blobs(net)}
        chosen = set(masks.choose(net, same_bits=True))
    every = {'pool%d' % i for i in range(1, 6)} | \
        {'relu1_2', 'relu2_2', 'relu3_3', 'relu4_3', 'relu5_3'}
    if precision_name is None:
        assert not nhwc and chosen == every
    else:
        assert 'conv5_3' in nhwc and 'pool5' not in nhwc
        assert chosen == every - {'pool5', 'relu5_3'}
    with config.using(layout='nchw'):
        assert set(masks.choose(net, same_bits=True)) == every


ALEXNET_TV = os.path.join(ROOT, 'benchmarks', 'nets', 'alexnettv_b128.prototxt')
ALEXNET_TV_MASKED = ('relu1', 'pool1', 'relu2', 'pool2')


@pytest.mark.parametrize('precision_name', [None, 'fp16', 'bf16'])
def test_16_bit_overlapping_pools_on_channels_last_maps_are_masked_in_the_estimate(
        precision_name):
    """Torchvision's AlexNet: pool1's and pool2's 3 x 3 windows at stride 2
    overlap, where cuDNN's max pooling routes gradients otherwise than the
    masked kernels, so `shared` leaves them unmasked in FP32. In 16 bits
    their maps are channels-last on the GPU, which runs them on the argmax
    kernels (cuDNN's channels-last pooling is slow), and masking leaves every
    bit: the GPU's plan masks them and the ReLUs before them. The estimate,
    built on the host, must choose so too; unmasked, it kept conv1's and
    conv2's maps to backward, 76 MiB over the arena of the GPU's BFLOAT16 plan."""
    from caffeplus import precision
    param = shapes.load_net_param(ALEXNET_TV, batch=8, phase=caffe_pb2.TRAIN)
    if precision_name:
        precision.override(param, precision_name)
    net = shapes.build_net(param)
    with config.using(layout='nhwc'):
        assert masks.choose(net, same_bits=True) == \
            (ALEXNET_TV_MASKED if precision_name else ())
        # (every mask: pool5 too where it stays in one order, FP32)
        assert masks.choose(net)[:4] == ALEXNET_TV_MASKED
    with config.using(layout='nchw'):
        assert masks.choose(net, same_bits=True) == ()


@pytest.mark.gpu
@pytest.mark.parametrize('precision_name', [None, 'fp16', 'bf16'])
@pytest.mark.parametrize('model, batch', [(ALEXNET_TV, 4),
                                          (os.path.join(SHARED, 'bench', 'vgg16_b64.prototxt'), 1),
                                          (os.path.join(SHARED, 'bench', 'googlenet_b64.prototxt'), 2)])
def test_gpu_nets_mask_what_the_estimate_masks(gpu, model, batch, precision_name):
    """The estimate chooses its masks on a net built on the host; `caffeplus
    train` on the GPU's own net, whose maps are stored in the orders the
    estimate models and whose poolings run the kernels it models: both
    choose the same layers, bit-for-bit masks and every mask alike."""
    from caffeplus import precision
    param = shapes.load_net_param(model, batch=batch, phase=caffe_pb2.TRAIN)
    if precision_name:
        precision.override(param, precision_name)
    host = shapes.build_net(param)
    device_net = caffeplus.Net(param, caffeplus.TRAIN)
    for same_bits in (True, False):
        assert masks.choose(host, same_bits=same_bits) == \
            masks.choose(device_net, same_bits=same_bits)
    if model == ALEXNET_TV:
        assert masks.choose(device_net, same_bits=True) == \
            (ALEXNET_TV_MASKED if precision_name else ())


@pytest.mark.gpu
def test_gpu_memory_measures_a_16_bit_pooling_between_orders(tmp_path, capsys):
    """In FLOAT16 conv2_1's map is channels-last and pool2 writes Caffe's
    order for the InnerProduct: the GPU cannot mask pool2 (its kernels take
    one order), and `caffeplus memory -gpu` measures the plans the estimate
    made on the host. A plan masking pool2 did not fit the GPU's net: each
    plan came back estimated, with a measure_error."""
    import json
    from caffeplus import cli
    model = tmp_path / 'vgg_like.prototxt'
    model.write_text(VGG_LIKE % {'k2': 2, 'hw': 18})
    assert cli.main(['memory', '-model', str(model), '-gpu', '0', '--precision', 'fp16',
                     '--plans', 'shared,auto', '--iterations', '2', '--json']) == 0
    plans = json.loads(capsys.readouterr().out)['plans']
    for name in ('shared', 'auto'):
        assert 'measure_error' not in plans[name], plans[name]['measure_error']
        assert plans[name]['estimated'] is False and plans[name]['iter_ms'] > 0
    # (auto plans again in the measuring process, on the GPU's net: its masks)
    assert plans['auto']['estimate']['masked'] == ['relu1_2', 'pool1']
