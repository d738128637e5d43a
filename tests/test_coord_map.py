"""caffe.coord_map (pycaffe's): the coordinate maps between NetSpec tops
and crop(), checked on FCN's VGG-16 nets, whose published prototxts crop
with these offsets (voc-fcn32s: 19; voc-fcn16s: 5 and 27; voc-fcn8s: 5, 9
and 31), and on single layers against the conv arithmetic."""
import numpy
import pytest

import caffeplus as caffe
from caffeplus import coord_map as cm
from caffeplus import layers as L
from caffeplus import params as P


def _conv_relu(bottom, nout, ks=3, stride=1, pad=1):
    conv = L.Convolution(bottom, kernel_size=ks, stride=stride, num_output=nout, pad=pad)
    return conv, L.ReLU(conv, in_place=True)


def _pool(bottom):
    return L.Pooling(bottom, pool=P.Pooling.MAX, kernel_size=2, stride=2)


def _fcn_vgg16(n):
    """FCN's VGG-16 trunk (conv1_1 padded by 100) up to the class scores."""
    n.data = L.Input(shape=dict(dim=[1, 3, 500, 500]))
    bottom = n.data
    for stage, (nout, convs) in enumerate([(64, 2), (128, 2), (256, 3), (512, 3), (512, 3)], 1):
        for c in range(1, convs + 1):
            conv, relu = _conv_relu(bottom, nout, pad=100 if (stage, c) == (1, 1) else 1)
            setattr(n, 'conv%d_%d' % (stage, c), conv)
            setattr(n, 'relu%d_%d' % (stage, c), relu)
            bottom = relu
        bottom = _pool(bottom)
        setattr(n, 'pool%d' % stage, bottom)
    n.fc6, n.relu6 = _conv_relu(n.pool5, 4096, ks=7, pad=0)
    n.drop6 = L.Dropout(n.relu6, dropout_ratio=0.5, in_place=True)
    n.fc7, n.relu7 = _conv_relu(n.drop6, 4096, ks=1, pad=0)
    n.drop7 = L.Dropout(n.relu7, dropout_ratio=0.5, in_place=True)
    n.score_fr = L.Convolution(n.drop7, num_output=21, kernel_size=1, pad=0)
    return n


def _upscore(bottom, ks, stride):
    return L.Deconvolution(bottom, convolution_param=dict(num_output=21, kernel_size=ks,
                                                           stride=stride, bias_term=False))


def _offsets(layer_function):
    p = layer_function.fn.params['crop_param']
    return p['axis'], list(p['offset'])


def test_fcn32s_crops_by_19():
    n = _fcn_vgg16(caffe.NetSpec())
    n.upscore = _upscore(n.score_fr, 64, 32)
    n.score = cm.crop(n.upscore, n.data)
    assert _offsets(n.score) == (2, [19])


def test_fcn16s_and_fcn8s_skip_crops(tmp_path):
    n = _fcn_vgg16(caffe.NetSpec())
    n.upscore2 = _upscore(n.score_fr, 4, 2)
    n.score_pool4 = L.Convolution(n.pool4, num_output=21, kernel_size=1, pad=0)
    n.score_pool4c = cm.crop(n.score_pool4, n.upscore2)
    assert _offsets(n.score_pool4c) == (2, [5])
    n.fuse_pool4 = L.Eltwise(n.upscore2, n.score_pool4c, operation=P.Eltwise.SUM)
    # FCN-16s: the fused scores up 16x, cropped to the image by 27
    n.upscore16 = _upscore(n.fuse_pool4, 32, 16)
    assert _offsets(cm.crop(n.upscore16, n.data)) == (2, [27])
    # FCN-8s: one more skip from pool3, then up 8x, cropped by 31
    n.upscore_pool4 = _upscore(n.fuse_pool4, 4, 2)
    n.score_pool3 = L.Convolution(n.pool3, num_output=21, kernel_size=1, pad=0)
    n.score_pool3c = cm.crop(n.score_pool3, n.upscore_pool4)
    assert _offsets(n.score_pool3c) == (2, [9])
    n.fuse_pool3 = L.Eltwise(n.upscore_pool4, n.score_pool3c, operation=P.Eltwise.SUM)
    n.upscore8 = _upscore(n.fuse_pool3, 16, 8)
    n.score = cm.crop(n.upscore8, n.data)
    assert _offsets(n.score) == (2, [31])
    # the crops build: FCN-8s's score has the image's size
    path = tmp_path / 'fcn8s.prototxt'
    path.write_text(str(n.to_proto()))
    net = caffe.Net(str(path), caffe.TEST)
    assert net.blobs['score'].data.shape == (1, 21, 500, 500)


def test_single_layer_maps_follow_the_conv_arithmetic():
    n = caffe.NetSpec()
    n.data = L.Input(shape=dict(dim=[1, 1, 32, 32]))
    n.conv = L.Convolution(n.data, kernel_size=5, stride=2, pad=1, num_output=1)
    axis, scale, shift = cm.coord_map(n.conv.fn)
    # output i's window is centred on input 2 i - 1 + 2: input = 2 i + 1
    assert axis == 1 and scale == 0.5 and shift == (1 - 2) / 2
    assert cm.inverse((axis, scale, shift)) == (1, 2.0, 1.0)
    dil = L.Convolution(n.data, kernel_size=3, dilation=2, pad=2, num_output=1)
    assert cm.coord_map(dil.fn)[2] == 0            # a dilated 'same' convolution
    assert cm.coord_map(L.ReLU(n.data).fn) == (None, 1, 0)
    with pytest.raises(cm.UndefinedMapException):
        cm.coord_map(L.InnerProduct(n.data, num_output=2).fn)
    with pytest.raises(cm.AxisMismatchException):
        cm.compose((1, 1, 0), (2, 1, 0))
    assert cm.compose((None, 1, 0), (2, 0.5, 1)) == (2, 0.5, 1)


def test_crop_refuses_what_cannot_be_cropped():
    n = caffe.NetSpec()
    n.data = L.Input(shape=dict(dim=[1, 1, 32, 32]))
    n.half = L.Pooling(n.data, pool=P.Pooling.MAX, kernel_size=2, stride=2)
    with pytest.raises(AssertionError, match='scale mismatch'):
        cm.crop(n.half, n.data)
    n.big = L.Convolution(n.data, kernel_size=3, pad=3, num_output=1)
    with pytest.raises(AssertionError, match='negative offset'):
        cm.crop(n.data, n.big)
    n.other = L.Input(shape=dict(dim=[1, 1, 8, 8]))
    with pytest.raises(RuntimeError, match='connected by spatial layers'):
        cm.coord_map_from_to(n.data, n.other)


def test_import_caffe_coord_map_gives_it():
    import sys
    saved = {k: v for k, v in sys.modules.items() if k == 'caffe' or k.startswith('caffe.')}
    try:
        for k in saved:
            del sys.modules[k]
        caffe.install_caffe_alias()
        from caffe.coord_map import crop  # noqa: F401
        assert sys.modules['caffe.coord_map'] is cm
    finally:
        for k in [k for k in sys.modules if k == 'caffe' or k.startswith('caffe.')]:
            del sys.modules[k]
        sys.modules.update(saved)
    assert numpy.isclose(cm.coord_map(L.Deconvolution(
        L.Input(shape=dict(dim=[1, 1, 4, 4])), convolution_param=dict(
            num_output=1, kernel_size=4, stride=2)).fn)[2], 1.5)
