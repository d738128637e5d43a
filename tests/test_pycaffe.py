"""pycaffe compatibility: scripts in the style of BVLC's pycaffe examples run
unchanged apart from `import caffeplus as caffe`.

Covers classification with the Transformer, net surgery (fc -> conv),
LeNet written with NetSpec and trained with solver.step(1), Python layers
(the linreg example's EuclideanLossLayer, gradients checked numerically),
caffe.io, Classifier/Detector, forward_all, and bad input.
"""
import os
import sys
import textwrap

import numpy as np
import pytest

import caffeplus as caffe
from caffeplus import layers as L
from caffeplus import params as P
from conftest import REFERENCE, ZOO, need
from python_layer_sources import PYLOSS

IMAGES = os.path.join(REFERENCE, 'io', 'images')


@pytest.fixture(autouse=True)
def _quiet_log():
    # Nets log their whole definition; keep test output short (restored after).
    from caffeplus import log
    level = log.logger.level
    log.set_level(2)
    yield
    log.logger.setLevel(level)


def _write(path, text):
    with open(path, 'w') as f:
        f.write(textwrap.dedent(text))
    return str(path)


# -- a small deploy net --------------------------------------------------------
DEPLOY = """
name: "SmallNet"
layer { name: "data" type: "Input" top: "data"
        input_param { shape: { dim: 2 dim: 3 dim: 12 dim: 12 } } }
layer { name: "conv1" type: "Convolution" bottom: "data" top: "conv1"
        convolution_param { num_output: 4 kernel_size: 3
          weight_filler { type: "gaussian" std: 0.1 } bias_filler { type: "gaussian" std: 0.1 } } }
layer { name: "relu1" type: "ReLU" bottom: "conv1" top: "conv1" }
layer { name: "pool1" type: "Pooling" bottom: "conv1" top: "pool1"
        pooling_param { pool: MAX kernel_size: 2 stride: 2 } }
layer { name: "fc" type: "InnerProduct" bottom: "pool1" top: "fc"
        inner_product_param { num_output: 5
          weight_filler { type: "gaussian" std: 0.1 } bias_filler { type: "gaussian" std: 0.1 } } }
layer { name: "prob" type: "Softmax" bottom: "fc" top: "prob" }
"""


def _numpy_small_net(net, x):
    """The SmallNet forward in float64 NumPy, from the net's own parameters."""
    w1, b1 = (np.asarray(b.data, np.float64) for b in net.params['conv1'])
    n, c, h, w = x.shape
    k = w1.shape[2]
    oh, ow = h - k + 1, w - k + 1
    conv = np.zeros((n, w1.shape[0], oh, ow))
    for i in range(oh):
        for j in range(ow):
            patch = x[:, :, i:i + k, j:j + k].reshape(n, -1)
            conv[:, :, i, j] = patch @ w1.reshape(w1.shape[0], -1).T + b1
    conv = np.maximum(conv, 0)
    pool = conv.reshape(n, conv.shape[1], oh // 2, 2, ow // 2, 2).max(axis=(3, 5))
    wf, bf = (np.asarray(b.data, np.float64) for b in net.params['fc'])
    fc = pool.reshape(n, -1) @ wf.T + bf
    e = np.exp(fc - fc.max(1, keepdims=True))
    return e / e.sum(1, keepdims=True)


@pytest.fixture
def deploy(tmp_path):
    return _write(tmp_path / 'deploy.prototxt', DEPLOY)


def test_classification_with_transformer(deploy):
    # As examples/00-classification.ipynb, on a small net with random weights.
    image_path = need(os.path.join(IMAGES, 'img_02.png'))       # 12 x 12 RGB
    caffe.set_mode_cpu()
    net = caffe.Net(deploy, caffe.TEST)
    mu = np.array([104.0, 117.0, 123.0])
    transformer = caffe.io.Transformer({'data': net.blobs['data'].data.shape})
    transformer.set_transpose('data', (2, 0, 1))
    transformer.set_mean('data', mu)
    transformer.set_raw_scale('data', 255)
    transformer.set_channel_swap('data', (2, 1, 0))
    net.blobs['data'].reshape(1, 3, 12, 12)
    image = caffe.io.load_image(image_path)
    transformed_image = transformer.preprocess('data', image)
    net.blobs['data'].data[...] = transformed_image
    output = net.forward()
    output_prob = output['prob'][0]

    rgb = np.load(os.path.join(IMAGES, 'images.npz'))['img_02'].astype(np.float64)
    expected_in = rgb[:, :, ::-1].transpose(2, 0, 1) - mu[:, None, None]
    np.testing.assert_allclose(transformed_image, expected_in, atol=1e-4)
    assert transformed_image.dtype == np.float32 and transformed_image.shape == (3, 12, 12)
    ref = _numpy_small_net(net, expected_in[None])
    assert output['prob'].shape == (1, 5)
    np.testing.assert_allclose(output_prob, ref[0], rtol=1e-4, atol=1e-6)
    assert output_prob.argmax() == ref[0].argmax()
    top_inds = output_prob.argsort()[::-1][:3]
    assert list(top_inds) == list(ref[0].argsort()[::-1][:3])
    # deprocess undoes preprocess.
    back = transformer.deprocess('data', net.blobs['data'].data[0])
    np.testing.assert_allclose(back, image, atol=1e-5)


def test_classifier_predict_oversample_and_centre(deploy, tmp_path):
    image_path = need(os.path.join(IMAGES, 'img_02.png'))
    net = caffe.Net(deploy, caffe.TEST)
    weights = str(tmp_path / 'small.caffemodel')
    net.save(weights)
    mean = np.array([0.4, 0.5, 0.6])
    clf = caffe.Classifier(deploy, weights, image_dims=(16, 16), mean=mean, raw_scale=1.0,
                           channel_swap=(2, 1, 0))
    image = caffe.io.load_image(image_path)
    scores = clf.predict([image, image[::-1]])
    assert scores.shape == (2, 5)
    np.testing.assert_allclose(scores.sum(1), 1, rtol=1e-5)
    # By hand: resize, ten crops, preprocess, forward, average.
    resized = caffe.io.resize_image(image, (16, 16))
    crops = caffe.io.oversample([resized], (12, 12))
    assert crops.shape == (10, 12, 12, 3)
    np.testing.assert_array_equal(crops[0], resized[:12, :12])
    np.testing.assert_array_equal(crops[3], resized[4:, 4:])
    np.testing.assert_array_equal(crops[4], resized[2:14, 2:14])
    np.testing.assert_array_equal(crops[5], resized[:12, :12][:, ::-1])
    batch = np.array([clf.transformer.preprocess('data', c) for c in crops])
    probs = clf.forward_all(data=batch)['prob']
    np.testing.assert_allclose(scores[0], probs.mean(0), rtol=1e-5, atol=1e-7)
    centre = clf.predict([image], oversample=False)
    expect = clf.forward_all(data=batch[4:5])['prob']
    np.testing.assert_allclose(centre, expect, rtol=1e-5, atol=1e-7)


def test_detector_windows(deploy, tmp_path):
    image_path = need(os.path.join(IMAGES, 'img_02.png'))
    net = caffe.Net(deploy, caffe.TEST)
    weights = str(tmp_path / 'small.caffemodel')
    net.save(weights)
    det = caffe.Detector(deploy, weights, mean=np.array([0.5, 0.5, 0.5]), raw_scale=1.0,
                         context_pad=2)
    windows = np.array([[0, 0, 8, 8], [2, 3, 12, 12]])
    dets = det.detect_windows([(image_path, windows)])
    assert len(dets) == 2
    assert dets[0]['filename'] == image_path
    assert dets[1]['prediction'].shape == (5,)
    np.testing.assert_allclose(dets[0]['prediction'].sum(), 1, rtol=1e-5)


def test_forward_all_batches_and_pads(deploy):
    net = caffe.Net(deploy, caffe.TEST)            # batch 2
    rng = np.random.RandomState(0)
    x = rng.randn(5, 3, 12, 12).astype(np.float32)
    out = net.forward_all(data=x, blobs=['fc'])
    assert out['prob'].shape == (5, 5) and out['fc'].shape == (5, 5)
    np.testing.assert_allclose(out['prob'], _numpy_small_net(net, x.astype(np.float64)),
                               rtol=1e-4, atol=1e-6)
    outs, diffs = net.forward_backward_all(data=x, prob=np.ones((5, 5), np.float32))
    assert outs['prob'].shape == (5, 5)
    assert diffs['data'].shape == (5, 3, 12, 12)
    # The softmax of constant top diffs has zero gradient.
    np.testing.assert_allclose(diffs['data'], 0, atol=1e-6)
    with pytest.raises(Exception, match='Input blob arguments do not match'):
        net.forward(wrong=x[:2])


def test_pycaffe_net_attributes(deploy):
    net = caffe.Net(deploy, caffe.TEST)
    assert list(net._layer_names) == ['data', 'conv1', 'relu1', 'pool1', 'fc', 'prob']
    assert [layer.type for layer in net.layers] == ['Input', 'Convolution', 'ReLU',
                                                    'Pooling', 'InnerProduct', 'Softmax']
    assert len(net._blobs) == len(net.blobs) == 5
    assert list(net.blobs) == ['data', 'conv1', 'pool1', 'fc', 'prob']
    assert net.inputs == ['data'] and net.outputs == ['prob']
    assert [net._blob_names[i] for i in net._inputs] == ['data']
    assert [net._blob_names[i] for i in net._outputs] == ['prob']
    assert list(net.params) == ['conv1', 'fc']
    assert net.params['conv1'][0].data.shape == (4, 3, 3, 3)
    assert net.layers[1].blobs[1].count == 4
    assert net.layer_dict['fc'].blobs[0].shape == (5, 100)
    assert net.top_names['relu1'] == ['conv1'] and net.bottom_names['fc'] == ['pool1']
    assert [net._blob_names[i] for i in net._top_ids(3)] == ['pool1']
    assert [net._blob_names[i] for i in net._bottom_ids(4)] == ['pool1']
    blob = net.blobs['data']
    assert (blob.num, blob.channels, blob.height, blob.width) == (2, 3, 12, 12)
    blob.reshape(3, 3, 12, 12)
    net.reshape()
    assert net.blobs['prob'].data.shape == (3, 5)
    assert blob.count == 3 * 3 * 12 * 12


def test_blob_data_wrong_shape_names_both_shapes(deploy):
    net = caffe.Net(deploy, caffe.TEST)
    with pytest.raises(Exception) as info:
        net.blobs['data'].data = np.zeros((2, 2), np.float32)
    text = str(info.value)
    assert '(2, 2)' in text and '(2, 3, 12, 12)' in text
    with pytest.raises(ValueError) as info:
        net.blobs['data'].data[...] = np.zeros((4, 3), np.float32)
    assert '(4,3)' in str(info.value).replace(' ', '') and '(2,3,12,12)' in \
        str(info.value).replace(' ', '')
    with pytest.raises(Exception, match='batch sized'):
        net.forward(data=np.zeros((3, 3, 12, 12), np.float32))


# -- net surgery -----------------------------------------------------------------
FC_NET = """
name: "fcnet"
layer { name: "data" type: "Input" top: "data"
        input_param { shape: { dim: 1 dim: 1 dim: 10 dim: 10 } } }
layer { name: "conv1" type: "Convolution" bottom: "data" top: "conv1"
        convolution_param { num_output: 4 kernel_size: 3
          weight_filler { type: "gaussian" std: 0.3 } bias_filler { type: "constant" value: 0.1 } } }
layer { name: "pool1" type: "Pooling" bottom: "conv1" top: "pool1"
        pooling_param { pool: MAX kernel_size: 2 stride: 2 } }
layer { name: "fc6" type: "InnerProduct" bottom: "pool1" top: "fc6"
        inner_product_param { num_output: 8
          weight_filler { type: "gaussian" std: 0.3 } bias_filler { type: "gaussian" std: 0.1 } } }
layer { name: "relu6" type: "ReLU" bottom: "fc6" top: "fc6" }
layer { name: "fc7" type: "InnerProduct" bottom: "fc6" top: "fc7"
        inner_product_param { num_output: 3
          weight_filler { type: "gaussian" std: 0.3 } bias_filler { type: "gaussian" std: 0.1 } } }
"""

FULL_CONV_NET = """
name: "fcnet_full_conv"
layer { name: "data" type: "Input" top: "data"
        input_param { shape: { dim: 1 dim: 1 dim: 14 dim: 14 } } }
layer { name: "conv1" type: "Convolution" bottom: "data" top: "conv1"
        convolution_param { num_output: 4 kernel_size: 3 } }
layer { name: "pool1" type: "Pooling" bottom: "conv1" top: "pool1"
        pooling_param { pool: MAX kernel_size: 2 stride: 2 } }
layer { name: "fc6-conv" type: "Convolution" bottom: "pool1" top: "fc6-conv"
        convolution_param { num_output: 8 kernel_size: 4 } }
layer { name: "relu6" type: "ReLU" bottom: "fc6-conv" top: "fc6-conv" }
layer { name: "fc7-conv" type: "Convolution" bottom: "fc6-conv" top: "fc7-conv"
        convolution_param { num_output: 3 kernel_size: 1 } }
"""


def test_net_surgery_fc_to_conv(tmp_path):
    # As examples/net_surgery.ipynb: cast the fc layers to convolutions.
    fc_proto = _write(tmp_path / 'fc.prototxt', FC_NET)
    conv_proto = _write(tmp_path / 'full_conv.prototxt', FULL_CONV_NET)
    net = caffe.Net(fc_proto, caffe.TEST)
    fc_weights = str(tmp_path / 'fc.caffemodel')
    net.save(fc_weights)
    params = ['fc6', 'fc7']
    fc_params = {pr: (net.params[pr][0].data, net.params[pr][1].data) for pr in params}
    for fc in params:
        print('{} weights are {} dimensional and biases are {} dimensional'.format(
            fc, fc_params[fc][0].shape, fc_params[fc][1].shape))
    net_full_conv = caffe.Net(conv_proto, fc_weights, caffe.TEST)
    params_full_conv = ['fc6-conv', 'fc7-conv']
    conv_params = {pr: (net_full_conv.params[pr][0].data, net_full_conv.params[pr][1].data)
                   for pr in params_full_conv}
    assert conv_params['fc6-conv'][0].shape == (8, 4, 4, 4)
    for pr, pr_conv in zip(params, params_full_conv):
        conv_params[pr_conv][0].flat = fc_params[pr][0].flat   # flat unrolls the arrays
        conv_params[pr_conv][1][...] = fc_params[pr][1]
    np.testing.assert_array_equal(net_full_conv.params['conv1'][0].data,
                                  net.params['conv1'][0].data)
    full_conv_weights = str(tmp_path / 'full_conv.caffemodel')
    net_full_conv.save(full_conv_weights)

    rng = np.random.RandomState(3)
    image = rng.rand(1, 1, 14, 14).astype(np.float32)
    reloaded = caffe.Net(conv_proto, full_conv_weights, caffe.TEST)
    out = reloaded.forward(data=image)['fc7-conv']
    assert out.shape == (1, 3, 3, 3)
    # Each output position is the fc net on the 10 x 10 window at 2 * position.
    for i in range(3):
        for j in range(3):
            window = image[:, :, 2 * i:2 * i + 10, 2 * j:2 * j + 10]
            expect = net.forward(data=window)['fc7'][0]
            np.testing.assert_allclose(out[0, :, i, j], expect, rtol=1e-5, atol=1e-6)


def test_net_surgery_editing_conv_weights():
    # Part one of the net surgery example: reshape the input, set filters by hand.
    conv_proto = need(os.path.join(ZOO, 'bvlc_caffe', 'examples', 'net_surgery',
                                   'conv.prototxt'))
    net = caffe.Net(conv_proto, caffe.TEST)
    assert net.blobs['data'].data.shape == (1, 1, 100, 100)
    assert net.params['conv'][0].data.shape == (3, 1, 5, 5)
    rng = np.random.RandomState(1)
    im = rng.rand(21, 17).astype(np.float32)
    im_input = im[np.newaxis, np.newaxis, :, :]
    net.blobs['data'].reshape(*im_input.shape)
    net.blobs['data'].data[...] = im_input
    net.forward()                                   # Caffe reshapes the layers on forward
    assert net.blobs['conv'].data.shape == (1, 3, 17, 13)
    net.params['conv'][0].data[...] = 0
    net.params['conv'][0].data[0, 0, 2, 2] = 1      # identity (centre tap)
    net.params['conv'][0].data[1, 0] = 1.0 / 25     # box blur
    net.params['conv'][0].data[2, 0, 2, 1:4] = [-1, 0, 1]   # horizontal gradient
    net.params['conv'][1].data[...] = [0, 0.5, 0]
    net.forward()
    out = net.blobs['conv'].data[0]
    np.testing.assert_allclose(out[0], im[2:-2, 2:-2], atol=1e-6)
    box = np.array([[im[i:i + 5, j:j + 5].mean() for j in range(13)] for i in range(17)])
    np.testing.assert_allclose(out[1], box + 0.5, atol=1e-5)
    np.testing.assert_allclose(out[2], im[2:-2, 3:-1] - im[2:-2, 1:-3], atol=1e-6)


# -- NetSpec -----------------------------------------------------------------------
def lenet(lmdb, batch_size):
    # our version of LeNet: a series of linear and simple nonlinear transformations
    n = caffe.NetSpec()
    n.data, n.label = L.Data(batch_size=batch_size, backend=P.Data.LMDB, source=lmdb,
                             transform_param=dict(scale=1. / 255), ntop=2)
    n.conv1 = L.Convolution(n.data, kernel_size=5, num_output=20,
                            weight_filler=dict(type='xavier'))
    n.pool1 = L.Pooling(n.conv1, kernel_size=2, stride=2, pool=P.Pooling.MAX)
    n.conv2 = L.Convolution(n.pool1, kernel_size=5, num_output=50,
                            weight_filler=dict(type='xavier'))
    n.pool2 = L.Pooling(n.conv2, kernel_size=2, stride=2, pool=P.Pooling.MAX)
    n.fc1 = L.InnerProduct(n.pool2, num_output=500, weight_filler=dict(type='xavier'))
    n.relu1 = L.ReLU(n.fc1, in_place=True)
    n.score = L.InnerProduct(n.relu1, num_output=10, weight_filler=dict(type='xavier'))
    n.loss = L.SoftmaxWithLoss(n.score, n.label)
    return n.to_proto()


def test_netspec_lenet_text():
    proto = lenet('mnist/mnist_train_lmdb', 64)
    assert [l.name for l in proto.layer] == ['data', 'conv1', 'pool1', 'conv2', 'pool2',
                                             'fc1', 'relu1', 'score', 'loss']
    assert list(proto.layer[0].top) == ['data', 'label']
    assert proto.layer[0].data_param.backend == caffe.proto.caffe_pb2.DataParameter.LMDB
    assert abs(proto.layer[0].transform_param.scale - 1 / 255.) < 1e-9
    assert list(proto.layer[1].convolution_param.kernel_size) == [5]
    assert proto.layer[1].convolution_param.weight_filler.type == 'xavier'
    assert proto.layer[2].pooling_param.pool == P.Pooling.MAX
    relu = proto.layer[6]
    assert list(relu.bottom) == ['fc1'] and list(relu.top) == ['fc1']
    assert list(proto.layer[8].bottom) == ['score', 'label']
    text = str(proto)
    assert 'layer {\n  name: "data"\n  type: "Data"\n  top: "data"\n  top: "label"' in text
    assert 'kernel_size: 5' in text and 'pool: MAX' in text


def test_netspec_naming_and_params():
    data = L.Input(shape=dict(dim=[1, 3, 8, 8]))
    conv = L.Convolution(data, num_output=2, kernel_size=[3], pad=1,
                         param=[dict(lr_mult=1, decay_mult=1), dict(lr_mult=2, decay_mult=0)],
                         include=dict(phase=caffe.TEST))
    top_a, top_b = L.Slice(conv, slice_param=dict(axis=1, slice_point=1), ntop=2)
    silence = L.Silence(top_b, ntop=0)
    loss = L.EuclideanLoss(top_a, top_a, loss_weight=0.5)
    proto = caffe.to_proto(loss, silence)
    names = [l.name for l in proto.layer]
    assert names == ['Input1', 'Convolution1', 'Slice1', 'EuclideanLoss1', 'Silence1']
    assert list(proto.layer[2].top) == ['Slice1', 'Slice2']
    assert list(proto.layer[4].bottom) == ['Slice2'] and len(proto.layer[4].top) == 0
    conv_p = proto.layer[1]
    assert [p.lr_mult for p in conv_p.param] == [1, 2]
    assert [p.decay_mult for p in conv_p.param] == [1, 0]
    assert list(conv_p.convolution_param.pad) == [1]      # scalar -> repeated
    assert conv_p.include[0].phase == caffe.TEST
    assert list(proto.layer[0].input_param.shape[0].dim) == [1, 3, 8, 8]
    assert list(proto.layer[3].loss_weight) == [0.5]
    # Names from a NetSpec; unnamed layers counted per type; enum names as strings.
    n = caffe.NetSpec()
    n.data = L.Input(shape=dict(dim=[1, 1, 4, 4]))
    n.pool = L.Pooling(L.Pooling(n.data, pool='AVE', kernel_size=1), kernel_size=1)
    n['out'] = L.ReLU(n.pool, in_place=True)
    proto = n.to_proto()
    assert [l.name for l in proto.layer] == ['data', 'Pooling1', 'pool', 'out']
    assert proto.layer[1].pooling_param.pool == P.Pooling.AVE
    assert list(proto.layer[3].top) == ['pool']
    assert 'out' in n.keys() and n.out is n['out']
    with pytest.raises(caffe.CaffeplusError, match="unknown parameter 'num_outputs'"):
        caffe.to_proto(L.InnerProduct(n.data, num_outputs=3))
    # A NetSpec net builds and runs.
    n = caffe.NetSpec()
    n.data = L.Input(shape=dict(dim=[2, 3]))
    n.ip = L.InnerProduct(n.data, num_output=4, weight_filler=dict(type='gaussian', std=1))
    n.prob = L.Softmax(n.ip)
    net = caffe.Net(n.to_proto(), caffe.TEST)
    out = net.forward(data=np.ones((2, 3), np.float32))
    np.testing.assert_allclose(out['prob'].sum(1), 1, rtol=1e-6)


def test_lenet_netspec_trained_with_manual_step_loop(tmp_path, monkeypatch):
    train_lmdb = need(os.path.join(REFERENCE, 'training', 'data', 'mnist_synth_train_lmdb'))
    test_lmdb = need(os.path.join(REFERENCE, 'training', 'data', 'mnist_synth_test_lmdb'))
    if 'Data' not in caffe.layer_type_list():
        pytest.skip('the Data layer is not available in this build')
    monkeypatch.chdir(tmp_path)
    os.makedirs('mnist')
    with open('mnist/lenet_auto_train.prototxt', 'w') as f:
        f.write(str(lenet(train_lmdb, 16)))
    with open('mnist/lenet_auto_test.prototxt', 'w') as f:
        f.write(str(lenet(test_lmdb, 32)))
    _write('mnist/lenet_auto_solver.prototxt', """
        train_net: "mnist/lenet_auto_train.prototxt"
        test_net: "mnist/lenet_auto_test.prototxt"
        test_iter: 2
        test_interval: 500
        base_lr: 0.01
        momentum: 0.9
        weight_decay: 0.0005
        lr_policy: "inv"
        gamma: 0.0001
        power: 0.75
        display: 100
        max_iter: 10000
        snapshot: 5000
        snapshot_prefix: "mnist/lenet"
        random_seed: 1701
        """)
    caffe.set_mode_cpu()
    solver = caffe.SGDSolver('mnist/lenet_auto_solver.prototxt')
    assert [(k, v.data.shape) for k, v in solver.net.blobs.items()][:2] == \
        [('data', (16, 1, 28, 28)), ('label', (16,))]
    assert [(k, v[0].data.shape) for k, v in solver.net.params.items()][0] == \
        ('conv1', (20, 1, 5, 5))
    solver.net.forward()
    solver.test_nets[0].forward()
    assert solver.net.blobs['label'].data[:8].shape == (8,)
    solver.step(1)
    assert solver.iter == 1
    niter = 9
    train_loss = np.zeros(niter)
    for it in range(niter):
        solver.step(1)        # SGD by Caffe
        train_loss[it] = solver.net.blobs['loss'].data
    assert solver.iter == 10
    assert np.all(np.isfinite(train_loss))
    assert train_loss[-3:].mean() < 0.85 * train_loss[:3].mean(), train_loss
    correct = 0
    for _ in range(2):
        solver.test_nets[0].forward()
        correct += (solver.test_nets[0].blobs['score'].data.argmax(1) ==
                    solver.test_nets[0].blobs['label'].data).sum()
    print('test accuracy after 10 iterations: %g' % (correct / 64.0))
    assert correct / 64.0 > 0.2


def test_solver_classes_and_get_solver(tmp_path):
    net = _write(tmp_path / 'net.prototxt', """
        layer { name: "x" type: "DummyData" top: "x" top: "y"
                dummy_data_param { shape { dim: 4 dim: 3 } shape { dim: 4 dim: 2 }
                                   data_filler { type: "gaussian" } } }
        layer { name: "ip" type: "InnerProduct" bottom: "x" top: "ip"
                inner_product_param { num_output: 2 weight_filler { type: "gaussian" } } }
        layer { name: "loss" type: "EuclideanLoss" bottom: "ip" bottom: "y" top: "loss" }
        """)
    kinds = {'SGD': caffe.SGDSolver, 'Nesterov': caffe.NesterovSolver,
             'AdaGrad': caffe.AdaGradSolver, 'RMSProp': caffe.RMSPropSolver,
             'AdaDelta': caffe.AdaDeltaSolver, 'Adam': caffe.AdamSolver}
    for kind, cls in kinds.items():
        momentum = '' if kind in ('AdaGrad', 'RMSProp') else 'momentum: 0.9'
        extra = 'rms_decay: 0.98' if kind == 'RMSProp' else ''
        path = _write(tmp_path / ('%s_solver.prototxt' % kind), """
            net: "%s"
            type: "%s"
            base_lr: 0.01
            lr_policy: "fixed"
            %s
            %s
            max_iter: 3
            snapshot_prefix: "%s"
            """ % (net, kind, momentum, extra, tmp_path / kind))
        solver = caffe.get_solver(path)
        assert isinstance(solver, cls), kind
        solver.step(2)
        assert solver.iter == 2
    solver = caffe.SGDSolver(path.replace('Adam', 'SGD'))
    starts, ready = [], []
    solver.add_callback(lambda: starts.append(solver.iter), lambda: ready.append(solver.iter))
    solver.step(2)
    assert starts == [0, 1] and ready == [0, 1]
    solver.snapshot()
    assert os.path.exists(str(tmp_path / 'SGD_iter_2.caffemodel'))
    solver.restore(str(tmp_path / 'SGD_iter_2.solverstate'))
    assert solver.iter == 2
    test_net = caffe.Net(net, caffe.TEST)
    solver.share_weights(test_net)
    np.testing.assert_array_equal(test_net.params['ip'][0].data,
                                  solver.net.params['ip'][0].data)


# -- Python layers -------------------------------------------------------------------
@pytest.fixture
def pymodule(tmp_path, monkeypatch):
    """Write Python layer modules into a folder on sys.path; forget them after."""
    monkeypatch.syspath_prepend(str(tmp_path))
    written = []

    def write(name, source):
        _write(tmp_path / (name + '.py'), source)
        sys.modules.pop(name, None)
        written.append(name)
    yield write
    for name in written:
        sys.modules.pop(name, None)


def test_python_loss_layer_linreg(pymodule):
    linreg = need(os.path.join(ZOO, 'bvlc_caffe', 'examples', 'pycaffe', 'linreg.prototxt'))
    pymodule('pyloss', PYLOSS)
    net = caffe.Net(linreg, caffe.TRAIN)
    assert net.layer_dict['loss'].type == 'Python'
    assert net.blob_loss_weights['loss'] == 1
    loss = net.forward()['loss']
    x = net.blobs['ipx'].data.astype(np.float64)
    y = net.blobs['ipy'].data.astype(np.float64)
    np.testing.assert_allclose(loss, [((x - y) ** 2).sum() / 10 / 2], rtol=1e-5)
    # The Python object's own attributes reach through net.layers, as in pycaffe.
    np.testing.assert_allclose(net.layer_dict['loss'].diff, x - y, rtol=1e-5, atol=1e-6)
    net.clear_param_diffs()
    net.backward()
    np.testing.assert_allclose(net.blobs['ipx'].diff, (x - y) / 10, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(net.blobs['ipy'].diff, (y - x) / 10, rtol=1e-5, atol=1e-7)

    # Numerical gradients of the parameters of ipx and ipy (the DummyData
    # inputs stay fixed: forward from ipx on).
    rng = np.random.RandomState(0)
    eps = 1e-2
    for layer in ('ipx', 'ipy'):
        for param_id in (0, 1):
            blob = net.params[layer][param_id]
            analytic = blob.diff.copy()
            for k in rng.choice(blob.count, 6, replace=False):
                # Re-read blob.data after each forward: in GPU mode it is a
                # host mirror, synced when read (as in pycaffe).
                old = blob.data.flat[k]
                blob.data.flat[k] = old + eps
                plus = float(net.forward(start='ipx')['loss'][0])
                blob.data.flat[k] = old - eps
                minus = float(net.forward(start='ipx')['loss'][0])
                blob.data.flat[k] = old
                numeric = (plus - minus) / (2 * eps)
                assert abs(numeric - analytic.reshape(-1)[k]) <= \
                    2e-3 + 2e-2 * abs(numeric), (layer, param_id, k, numeric)


PYPARAM = """
import json
import caffeplus as caffe


class ScaleByParam(caffe.Layer):
    def setup(self, bottom, top):
        self.config = json.loads(self.param_str)
        self.seen_phase = self.phase
        if len(self.blobs) == 0:
            self.blobs.add_blob(1)
            self.blobs[0].data[...] = self.config['init']

    def reshape(self, bottom, top):
        top[0].reshape(*bottom[0].data.shape)

    def forward(self, bottom, top):
        top[0].data[...] = bottom[0].data * self.blobs[0].data[0]

    def backward(self, top, propagate_down, bottom):
        self.blobs[0].diff[0] += (top[0].diff * bottom[0].data).sum()
        if propagate_down[0]:
            bottom[0].diff[...] = top[0].diff * self.blobs[0].data[0]


class Broken(caffe.Layer):
    def setup(self, bottom, top):
        pass

    def reshape(self, bottom, top):
        top[0].reshape(*bottom[0].data.shape)

    def forward(self, bottom, top):
        raise ValueError('boom in forward')


class NeedsArgs(Exception):
    def __init__(self, code, why):
        super().__init__(code, why)


class BrokenSetup(caffe.Layer):
    def setup(self, bottom, top):
        kind = self.param_str
        if kind == 'runtime':
            raise RuntimeError('cannot set up')
        if kind == 'file':
            raise FileNotFoundError(2, 'no such list', 'list.txt')
        raise NeedsArgs(7, 'its own arguments')
"""

PYNET = """
layer { name: "data" type: "Input" top: "data"
        input_param { shape { dim: 2 dim: 3 } } }
layer { name: "scale" type: "Python" bottom: "data" top: "scaled"
        python_param { module: "%s" layer: "%s" param_str: '{"init": 2.5}' } }
layer { name: "loss" type: "Reduction" bottom: "scaled" top: "loss"
        reduction_param { operation: SUM } loss_weight: 1 }
force_backward: true
"""


def test_python_layer_param_str_blobs_and_phase(pymodule, tmp_path):
    pymodule('pyparam_layers', PYPARAM)
    proto = _write(tmp_path / 'py.prototxt', PYNET % ('pyparam_layers', 'ScaleByParam'))
    net = caffe.Net(proto, caffe.TRAIN)
    layer = net.layer_dict['scale']
    assert layer.seen_phase == caffe.TRAIN and layer.param_str == '{"init": 2.5}'
    assert layer.param_str_ == layer.param_str      # pre-1.0 layers read param_str_
    assert list(net.params) == ['scale'] and net.params['scale'][0].data[0] == 2.5
    x = np.arange(6, dtype=np.float32).reshape(2, 3)
    out = net.forward(data=x)
    np.testing.assert_allclose(out['loss'], x.sum() * 2.5, rtol=1e-6)
    net.clear_param_diffs()
    net.backward()
    np.testing.assert_allclose(net.params['scale'][0].diff, [x.sum()], rtol=1e-6)
    np.testing.assert_allclose(net.blobs['data'].diff, np.full((2, 3), 2.5), rtol=1e-6)
    # The learnable blob round-trips through a caffemodel.
    net.params['scale'][0].data[...] = 4.0
    weights = str(tmp_path / 'py.caffemodel')
    net.save(weights)
    net2 = caffe.Net(proto, weights, caffe.TEST)
    assert net2.params['scale'][0].data[0] == 4.0
    assert net2.layer_dict['scale'].seen_phase == caffe.TEST


def test_python_layer_that_raises_names_the_layer(pymodule, tmp_path):
    pymodule('pyparam_layers', PYPARAM)
    proto = _write(tmp_path / 'py.prototxt', PYNET % ('pyparam_layers', 'Broken'))
    net = caffe.Net(proto, caffe.TEST)
    with pytest.raises(caffe.CaffeplusError) as info:
        net.forward()
    text = str(info.value)
    assert "'scale'" in text and 'pyparam_layers.Broken' in text
    assert 'ValueError: boom in forward' in text
    assert isinstance(info.value.__cause__, ValueError)
    # As in pycaffe, the layer's own exception type comes through: a script
    # catches it by that type (BVLC's test_python_layer: RuntimeError).
    assert isinstance(info.value, ValueError)


@pytest.mark.parametrize('kind, caught', [('runtime', RuntimeError), ('file', OSError),
                                          ('args', Exception)])
def test_a_python_layers_exception_is_caught_by_its_type(pymodule, tmp_path, kind, caught):
    pymodule('pyparam_layers', PYPARAM)
    proto = _write(tmp_path / 'py.prototxt', (PYNET % ('pyparam_layers', 'BrokenSetup')).replace(
        '\'{"init": 2.5}\'', '"%s"' % kind))
    with pytest.raises(caught) as info:
        caffe.Net(proto, caffe.TEST)
    assert isinstance(info.value, caffe.CaffeplusError)     # one line from the commands
    assert "'scale'" in str(info.value) and 'in setup' in str(info.value)


def test_python_layer_module_not_found_names_module_and_path(tmp_path):
    proto = _write(tmp_path / 'py.prototxt', PYNET % ('no_such_pylayer_module', 'X'))
    with pytest.raises(caffe.CaffeplusError) as info:
        caffe.Net(proto, caffe.TEST)
    text = str(info.value)
    assert "'no_such_pylayer_module'" in text and "'scale'" in text
    assert 'search path' in text.lower()
    assert sys.path[1] in text or sys.path[0] in text


def test_python_layer_missing_class(pymodule, tmp_path):
    pymodule('pyparam_layers', PYPARAM)
    proto = _write(tmp_path / 'py.prototxt', PYNET % ('pyparam_layers', 'NoSuchClass'))
    with pytest.raises(caffe.CaffeplusError, match="has no class 'NoSuchClass'"):
        caffe.Net(proto, caffe.TEST)


def test_python_layers_can_be_refused(pymodule, tmp_path, monkeypatch):
    pymodule('pyparam_layers', PYPARAM)
    proto = _write(tmp_path / 'py.prototxt', PYNET % ('pyparam_layers', 'ScaleByParam'))
    caffe.set_python_layers_allowed(False)
    try:
        assert not caffe.python_layers_allowed()
        with pytest.raises(caffe.CaffeplusError) as info:
            caffe.Net(proto, caffe.TEST)
        assert "layer 'scale'" in str(info.value) and 'refused' in str(info.value)
    finally:
        caffe.set_python_layers_allowed(True)
    from caffeplus import config
    monkeypatch.setenv('CAFFEPLUS_NO_PYTHON_LAYERS', '1')
    config.reload_environment()         # (read once a process otherwise)
    with pytest.raises(caffe.CaffeplusError, match='CAFFEPLUS_NO_PYTHON_LAYERS'):
        caffe.Net(proto, caffe.TEST)
    monkeypatch.delenv('CAFFEPLUS_NO_PYTHON_LAYERS')
    config.reload_environment()
    caffe.Net(proto, caffe.TEST)


def test_python_layer_module_importing_caffe_works_with_alias(pymodule, tmp_path):
    # A zoo module that says `import caffe`, unmodified.
    pymodule('pyplain_layers', PYPARAM.replace('import caffeplus as caffe', 'import caffe'))
    proto = _write(tmp_path / 'py.prototxt', PYNET % ('pyplain_layers', 'ScaleByParam'))
    had_caffe = 'caffe' in sys.modules
    if had_caffe and sys.modules['caffe'] is not caffe:
        pytest.skip('a real caffe module is imported')
    try:
        caffe.install_caffe_alias()
        net = caffe.Net(proto, caffe.TEST)
        assert net.params['scale'][0].data[0] == 2.5
    finally:
        if not had_caffe:
            for name in [m for m in sys.modules if m == 'caffe' or m.startswith('caffe.')]:
                del sys.modules[name]


# -- caffe.io ----------------------------------------------------------------------------
def test_load_image_matches_pixels():
    arrays = np.load(need(os.path.join(IMAGES, 'images.npz')))
    for name in arrays.files:
        pixels = arrays[name].astype(np.float64)
        img = caffe.io.load_image(os.path.join(IMAGES, name + '.png'))
        assert img.dtype == np.float32 and img.ndim == 3 and img.shape[2] == 3
        if pixels.ndim == 2:
            pixels = np.repeat(pixels[:, :, None], 3, axis=2)
        np.testing.assert_allclose(img * 255, pixels[:, :, :3], atol=1e-3)
        grey = caffe.io.load_image(os.path.join(IMAGES, name + '.png'), color=False)
        assert grey.shape == pixels.shape[:2] + (1,)
        if arrays[name].ndim == 3 and arrays[name].shape[2] == 3:
            expect = pixels @ np.array([0.2125, 0.7154, 0.0721]) / 255
            np.testing.assert_allclose(grey[:, :, 0], expect, atol=1e-5)
        assert grey.min() >= 0 and grey.max() <= 1


def test_resize_image_and_transformer_details():
    ramp = np.tile(np.arange(4, dtype=np.float32), (2, 1))[:, :, None]      # 2 x 4 x 1
    up = caffe.io.resize_image(ramp, (2, 8))
    assert up.shape == (2, 8, 1) and up.dtype == np.float32
    np.testing.assert_allclose(up[0, :, 0], [0, 0.25, 0.75, 1.25, 1.75, 2.25, 2.75, 3])
    near = caffe.io.resize_image(ramp, (4, 8), interp_order=0)
    np.testing.assert_array_equal(near[0, :, 0], [0, 0, 1, 1, 2, 2, 3, 3])
    const = np.full((5, 7, 3), 0.3, np.float32)
    np.testing.assert_allclose(caffe.io.resize_image(const, (9, 2)), 0.3, rtol=1e-6)
    t = caffe.io.Transformer({'data': (1, 3, 4, 4)})
    with pytest.raises(Exception, match='not one of the net inputs'):
        t.set_raw_scale('nope', 2)
    with pytest.raises(Exception, match='Transpose order'):
        t.set_transpose('data', (1, 0))
    with pytest.raises(Exception, match='Channel swap'):
        t.set_channel_swap('data', (1, 0))
    with pytest.raises(ValueError, match='Mean channels'):
        t.set_mean('data', np.zeros(4))
    t.set_mean('data', np.zeros((3, 4, 4)))
    t.set_transpose('data', (2, 0, 1))
    t.set_input_scale('data', 0.5)
    img = np.random.RandomState(0).rand(8, 8, 3).astype(np.float32)
    before = img.copy()
    out = t.preprocess('data', img)
    np.testing.assert_array_equal(img, before)          # the input is not changed
    assert out.shape == (3, 4, 4)
    np.testing.assert_allclose(t.deprocess('data', out), caffe.io.resize_image(img, (4, 4)),
                               rtol=1e-6)


def test_blobproto_and_datum_helpers():
    arrays = [np.arange(6, dtype=np.float32).reshape(1, 2, 3), np.ones((4,), np.float32)]
    s = caffe.io.arraylist_to_blobprotovector_str(arrays)
    back = caffe.io.blobprotovector_str_to_arraylist(s)
    assert len(back) == 2
    for a, b in zip(arrays, back):
        np.testing.assert_array_equal(a, b)
    proto = caffe.io.array_to_blobproto(arrays[0])
    np.testing.assert_array_equal(caffe.io.blobproto_to_array(proto), arrays[0])
    img = np.random.RandomState(1).randint(0, 256, (3, 5, 4)).astype(np.uint8)
    datum = caffe.io.array_to_datum(img, label=7)
    assert (datum.channels, datum.height, datum.width, datum.label) == (3, 5, 4, 7)
    np.testing.assert_array_equal(caffe.io.datum_to_array(datum), img)
    fdatum = caffe.io.array_to_datum(img.astype(np.float32) / 3)
    np.testing.assert_allclose(caffe.io.datum_to_array(fdatum), img / 3.0, rtol=1e-6)
    assert caffe.io.caffe_pb2.Datum is type(datum)


PYDATA = """
import json
import numpy as np
import caffeplus as caffe


class ArrayData(caffe.Layer):
    \"\"\"A data layer in the FCN style: it loads the next batch in reshape(),
    which Caffe calls before every forward.\"\"\"

    def setup(self, bottom, top):
        params = json.loads(self.param_str)
        self.batch = params['batch']
        rng = np.random.RandomState(params['seed'])
        self.x = rng.randn(64, 4).astype(np.float32)
        self.y = (self.x @ rng.randn(4, 3)).argmax(1).astype(np.float32)
        self.idx = 0
        self.reshapes = 0

    def reshape(self, bottom, top):
        sel = (np.arange(self.batch) + self.idx) % len(self.x)
        self.data, self.label = self.x[sel], self.y[sel]
        self.idx += self.batch
        self.reshapes += 1
        top[0].reshape(*self.data.shape)
        top[1].reshape(*self.label.shape)

    def forward(self, bottom, top):
        top[0].data[...] = self.data
        top[1].data[...] = self.label

    def backward(self, top, propagate_down, bottom):
        pass
"""


def test_python_data_layer_trains_with_the_solver(pymodule, tmp_path):
    pymodule('pydata_layers', PYDATA)
    _write(tmp_path / 'net.prototxt', """
        layer { name: "data" type: "Python" top: "data" top: "label"
                python_param { module: "pydata_layers" layer: "ArrayData"
                               param_str: '{"batch": 16, "seed": 5}' } }
        layer { name: "ip" type: "InnerProduct" bottom: "data" top: "ip"
                inner_product_param { num_output: 3 weight_filler { type: "xavier" } } }
        layer { name: "loss" type: "SoftmaxWithLoss" bottom: "ip" bottom: "label" top: "loss" }
        """)
    solver_path = _write(tmp_path / 'solver.prototxt', """
        net: "%s"
        base_lr: 0.5
        lr_policy: "fixed"
        momentum: 0.9
        max_iter: 100
        snapshot_prefix: "%s"
        random_seed: 1
        """ % (tmp_path / 'net.prototxt', tmp_path / 'snap'))
    solver = caffe.get_solver(solver_path)
    data_layer = solver.net.layers[0]
    assert data_layer.type == 'Python'
    losses = []
    for _ in range(40):
        solver.step(1)
        losses.append(float(solver.net.blobs['loss'].data))
    # setup's reshape, then one reshape per forward: a new batch each iteration.
    assert data_layer.reshapes == 41 and data_layer.idx == 41 * 16
    assert np.mean(losses[-5:]) < 0.5 * np.mean(losses[:5]), losses


PARTIAL_NET = """\
name: "partial"
force_backward: true
layer { name: "data" type: "Input" top: "data"
        input_param { shape { dim: 2 dim: 1 dim: 4 dim: 4 } } }
layer { name: "conv" type: "Convolution" bottom: "data" top: "conv"
        convolution_param { num_output: 3 kernel_size: 3
                            weight_filler { type: "gaussian" std: 0.5 } } }
layer { name: "ip" type: "InnerProduct" bottom: "conv" top: "ip_blob"
        inner_product_param { num_output: 5 weight_filler { type: "gaussian" std: 0.5 }
                              bias_filler { type: "gaussian" std: 0.5 } } }
"""


def test_forward_and_backward_between_layers_return_their_blobs(tmp_path):
    """pycaffe's forward(start, end) gives the end layer's tops and
    backward(start, end) the diffs of its bottoms, whatever the layers are
    named (BVLC's test_net: layer 'ip' writes 'ip_blob' from 'conv')."""
    net = caffe.Net(_write(tmp_path / 'partial.prototxt', PARTIAL_NET), caffe.TRAIN)
    conv, ip = net.blobs['conv'], net.blobs['ip_blob']
    rng = np.random.default_rng(3)
    conv.data[...] = rng.uniform(size=conv.data.shape).astype(np.float32)
    out = net.forward(start='ip', end='ip')
    assert set(out) == {'ip_blob'}
    w, b = net.params['ip'][0].data.astype(np.float64), net.params['ip'][1].data
    want = conv.data.reshape(2, -1).astype(np.float64) @ w.T + b
    np.testing.assert_allclose(ip.data, want, rtol=1e-5, atol=1e-6)
    top_diff = rng.uniform(size=ip.diff.shape).astype(np.float32)
    ip.diff[...] = top_diff
    back = net.backward(start='ip', end='ip')
    assert set(back) == {'conv'}
    np.testing.assert_allclose(back['conv'].reshape(2, -1), top_diff.astype(np.float64) @ w,
                               rtol=1e-5, atol=1e-6)
    # with extra blobs asked for, and over the whole net
    assert set(net.forward(blobs=['conv'], end='ip')) == {'conv', 'ip_blob'}
    assert set(net.backward(diffs=['conv'])) == {'data', 'conv'}


def test_netspec_and_caffe_io_raise_pycaffes_exception_types():
    """As pycaffe (BVLC's test_net_spec.test_type_error, test_io's
    test_no_shape): a bottom that is not a Top is a TypeError with
    pycaffe's message; a BlobProto whose values do not fill its shape is a
    ValueError (NumPy's reshape in pycaffe)."""
    import re
    n = caffe.NetSpec()
    n.data, n.label = L.DummyData(ntop=2, shape=dict(dim=[2, 3]))
    with pytest.raises(TypeError) as info:
        L.Silence((n.data, n.label), ntop=0)
    assert re.match(r"^Silence input 0 is not a Top \(type is <class 'tuple'>\)$",
                    str(info.value))
    assert isinstance(info.value, caffe.CaffeplusError)
    from caffeplus.proto import caffe_pb2
    blob = caffe_pb2.BlobProto()
    blob.data.extend([1.0] * 100)
    with pytest.raises(ValueError, match='100 data values'):
        caffe.io.blobproto_to_array(blob)
    scalar = caffe_pb2.BlobProto()
    scalar.data.append(123.0)
    assert caffe.io.blobproto_to_array(scalar) == 123
