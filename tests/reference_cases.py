"""Run one stock-Caffe layer case from ../shared/reference/layers/.

Each case is a whole prototxt net with the layer under test named `test`;
the npz holds Caffe's inputs, parameters, outputs and diffs (see that
folder's README). The net is built through the pycaffe-style API, fed the
stored inputs and parameters, and compared within the README's tolerances.
"""
import os

import numpy

import caffeplus

EXACT = {'Concat', 'Slice', 'Split', 'Flatten', 'Reshape', 'Crop', 'Tile', 'Filter',
         'BatchReindex', 'Silence', 'Parameter', 'Dropout', 'Im2col', 'ReLU', 'AbsVal',
         'Threshold', 'Clip', 'ArgMax', 'Accuracy', 'DummyData'}
ELEMENTWISE = {'Sigmoid', 'TanH', 'ELU', 'BNLL', 'Exp', 'Log', 'Power', 'Swish', 'PReLU',
               'Softmax', 'LRN'}


def tolerances(layer_type, case):
    """(rtol, atol) for outputs and for diffs."""
    if layer_type in EXACT or case.startswith(('pool_max', 'eltwise_max', 'spp_max')):
        return (0, 0), (0, 1e-6)
    if layer_type in ELEMENTWISE:
        return (1e-5, 1e-6), (1e-5, 1e-6)
    return (1e-4, 1e-5), (1e-4, 1e-4)


def case_names(layers_dir):
    return sorted(f[:-4] for f in os.listdir(layers_dir) if f.endswith('.npz'))


def _close(actual, expected, tol, what):
    rtol, atol = tol
    actual = numpy.asarray(actual, dtype=numpy.float32)
    assert actual.shape == expected.shape, '%s: shape %s, Caffe %s' % (what, actual.shape, expected.shape)
    if rtol == 0 and atol == 0:
        numpy.testing.assert_array_equal(actual, expected, err_msg=what)
    else:
        numpy.testing.assert_allclose(actual, expected, rtol=rtol, atol=atol, err_msg=what)


def run_case(layers_dir, case):
    d = numpy.load(os.path.join(layers_dir, case + '.npz'))
    phase = caffeplus.TRAIN if str(d['phase']) == 'TRAIN' else caffeplus.TEST
    net = caffeplus.Net(os.path.join(layers_dir, case + '.prototxt'), phase)
    assert list(net._layer_names) == [str(x) for x in d['net_layer_names']]
    assert [l.layer_param.type for l in net.layers] == [str(x) for x in d['net_layer_types']]
    layer_type = str(d['layer_type'])
    out_tol, diff_tol = tolerances(layer_type, case)
    layers = net.layer_dict
    # Empty when the layer under test is one Caffe inserted (a Split).
    test = layers.get(str(d['layer_name']))
    test_blobs = test.blobs if test is not None else []

    bottom_names = [str(x) for x in d['bottom_names']]
    top_names = [str(x) for x in d['top_names']]
    for i, name in enumerate(bottom_names):
        value = d['bottom_%d' % i]
        source = layers.get(name + '_source')
        if source is not None and source.blobs:
            source.blobs[0].data = value
        net.blobs[name].data = value
    k = 0
    while 'param_%d' % k in d:
        test_blobs[k].data = d['param_%d' % k]
        k += 1

    net.forward()
    for k, name in enumerate(top_names):
        _close(net.blobs[name].data, d['top_%d' % k], out_tol, '%s top %d' % (case, k))
    k = 0
    while 'param_after_forward_%d' % k in d:
        _close(test_blobs[k].data, d['param_after_forward_%d' % k], out_tol,
               '%s param %d after forward' % (case, k))
        k += 1

    if str(d['backward_mode']) != 'none':
        for k, name in enumerate(top_names):
            net.blobs[name].diff = d['top_diff_%d' % k]
        for b in test_blobs:
            b.diff[...] = 0
        net.backward()
        for i in [int(x) for x in d['bottoms_with_diff']]:
            _close(net.blobs[bottom_names[i]].diff, d['bottom_diff_%d' % i], diff_tol,
                   '%s bottom diff %d' % (case, i))
        k = 0
        while 'param_diff_%d' % k in d:
            _close(test_blobs[k].diff, d['param_diff_%d' % k], diff_tol,
                   '%s param diff %d' % (case, k))
            k += 1

    if 'bottom_0_pass2' in d:
        net.blobs[bottom_names[0]].data = d['bottom_0_pass2']
        net.forward()
        _close(net.blobs[top_names[0]].data, d['top_0_pass2'], out_tol, case + ' second forward')
        k = 0
        while 'param_after_forward2_%d' % k in d:
            _close(test_blobs[k].data, d['param_after_forward2_%d' % k], out_tol,
                   '%s param %d after second forward' % (case, k))
            k += 1
    return net
