"""The cuDNN layers on the GPU against their generic CPU twins, and every
stock-Caffe reference case in GPU mode.

Each case builds the layer twice from one LayerParameter: in CPU mode (the
generic NumPy code) and in GPU mode (the cuDNN class on CuPy arrays), gives
both the same parameters, inputs and top diffs, and compares the tops, the
bottom diffs and the parameter diffs. `via` records which path the GPU layer
took, so a silent fallback to the generic CuPy code shows in the test.
"""
import os
import zlib

import numpy
import pytest
from google.protobuf import text_format

import caffeplus
from caffeplus import backend
from caffeplus.blob import Blob
from caffeplus.layer import create_layer
from caffeplus.proto import caffe_pb2

from conftest import REFERENCE
from reference_cases import case_names, run_case
import reference_cases

pytestmark = pytest.mark.gpu

# (id, layer prototxt, bottom shape, whether cuDNN (not the generic path) must run it)
CASES = [
    ('conv_plain', 'type: "Convolution" convolution_param { num_output: 6 kernel_size: 3 }',
     (2, 3, 9, 9), True),
    ('conv_pad_stride', 'type: "Convolution" convolution_param { num_output: 5 kernel_size: 3 '
     'pad: 1 stride: 2 }', (2, 4, 11, 10), True),
    ('conv_k4s3p2', 'type: "Convolution" convolution_param { num_output: 4 kernel_size: 4 '
     'stride: 3 pad: 2 }', (2, 3, 13, 13), True),
    ('conv_rect', 'type: "Convolution" convolution_param { num_output: 4 kernel_h: 3 kernel_w: 5 '
     'pad_h: 1 pad_w: 2 stride_h: 1 stride_w: 2 }', (2, 3, 8, 12), True),
    ('conv_1x1', 'type: "Convolution" convolution_param { num_output: 7 kernel_size: 1 }',
     (3, 5, 6, 6), True),
    ('conv_group2', 'type: "Convolution" convolution_param { num_output: 6 kernel_size: 3 '
     'group: 2 pad: 1 }', (2, 4, 8, 8), True),
    ('conv_group4_nobias', 'type: "Convolution" convolution_param { num_output: 8 kernel_size: 3 '
     'group: 4 bias_term: false }', (2, 8, 7, 7), True),
    ('conv_dilation2', 'type: "Convolution" convolution_param { num_output: 4 kernel_size: 3 '
     'dilation: 2 pad: 2 }', (2, 3, 10, 10), True),
    ('conv_3d', 'type: "Convolution" convolution_param { num_output: 4 kernel_size: 3 pad: 1 }',
     (2, 3, 5, 6, 7), True),
    ('conv_1d', 'type: "Convolution" convolution_param { num_output: 4 kernel_size: 3 }',
     (2, 3, 11), True),
    ('conv_axis2', 'type: "Convolution" convolution_param { num_output: 4 kernel_size: 3 '
     'axis: 2 }', (2, 3, 4, 9, 9), False),
    ('deconv_plain', 'type: "Deconvolution" convolution_param { num_output: 4 kernel_size: 3 }',
     (2, 3, 6, 6), True),
    ('deconv_stride2_pad1', 'type: "Deconvolution" convolution_param { num_output: 3 '
     'kernel_size: 4 stride: 2 pad: 1 }', (2, 4, 5, 5), True),
    ('deconv_group2', 'type: "Deconvolution" convolution_param { num_output: 6 kernel_size: 3 '
     'group: 2 bias_term: false }', (2, 4, 5, 5), True),
    ('pool_max_floor_agrees', 'type: "Pooling" pooling_param { pool: MAX kernel_size: 2 stride: 2 }',
     (2, 3, 8, 8), True),
    ('pool_max_ceil_differs', 'type: "Pooling" pooling_param { pool: MAX kernel_size: 3 stride: 2 }',
     (2, 3, 8, 8), False),
    ('pool_max_pad', 'type: "Pooling" pooling_param { pool: MAX kernel_size: 3 stride: 2 pad: 1 }',
     (2, 3, 7, 7), True),
    ('pool_ave_agrees', 'type: "Pooling" pooling_param { pool: AVE kernel_size: 3 stride: 2 }',
     (2, 3, 7, 7), True),
    ('pool_ave_pad', 'type: "Pooling" pooling_param { pool: AVE kernel_size: 3 stride: 2 pad: 1 }',
     (2, 3, 7, 7), True),
    ('pool_ave_ceil_differs', 'type: "Pooling" pooling_param { pool: AVE kernel_size: 3 stride: 2 }',
     (2, 3, 6, 6), False),
    ('pool_global_ave', 'type: "Pooling" pooling_param { pool: AVE global_pooling: true }',
     (2, 5, 7, 7), True),
    ('pool_global_max', 'type: "Pooling" pooling_param { pool: MAX global_pooling: true }',
     (2, 5, 6, 6), True),
    ('lrn_across5', 'type: "LRN" lrn_param { local_size: 5 alpha: 0.0001 beta: 0.75 }',
     (2, 7, 5, 5), True),
    ('lrn_across3_k2', 'type: "LRN" lrn_param { local_size: 3 alpha: 0.5 beta: 0.6 k: 2 }',
     (2, 6, 4, 4), True),
    ('lrn_within3', 'type: "LRN" lrn_param { local_size: 3 norm_region: WITHIN_CHANNEL }',
     (2, 3, 6, 6), False),
    ('softmax_axis1', 'type: "Softmax"', (3, 7, 2, 2), True),
    ('softmax_axis2', 'type: "Softmax" softmax_param { axis: 2 }', (2, 3, 5, 4), True),
    ('softmax_2d', 'type: "Softmax"', (6, 10), True),
    ('relu', 'type: "ReLU"', (2, 3, 4, 5), True),
    ('relu_leaky', 'type: "ReLU" relu_param { negative_slope: 0.1 }', (2, 3, 4, 5), False),
    ('sigmoid', 'type: "Sigmoid"', (2, 3, 4, 5), True),
    ('tanh', 'type: "TanH"', (2, 3, 4, 5), True),
    ('elu', 'type: "ELU"', (2, 3, 4, 5), True),
    ('elu_alpha0.5', 'type: "ELU" elu_param { alpha: 0.5 }', (4, 6), True),
]
TOL = {'Convolution': 2e-4, 'Deconvolution': 2e-4, 'LRN': 1e-4}


def _param(text, name='test'):
    lp = caffe_pb2.LayerParameter()
    text_format.Parse('name: "%s" %s' % (name, text), lp)
    if lp.type in ('Convolution', 'Deconvolution'):
        lp.convolution_param.weight_filler.type = 'gaussian'
        lp.convolution_param.weight_filler.std = 0.3
        lp.convolution_param.bias_filler.type = 'gaussian'
    return lp


def _via(layer):
    """Which path the GPU layer took: 'cudnn' or 'generic'."""
    t = layer.layer_param.type
    if t in ('Convolution', 'Deconvolution'):
        ok = layer._cudnn_geometry_ok() and layer._cd is not None
    elif t == 'Pooling':
        ok = layer.cudnn_agrees() and layer._pd is not None
    elif t == 'LRN':
        ok = layer._cudnn_ok(layer._last_bottom[0].shape) and layer._desc is not None
    elif t == 'Softmax':
        ok = layer._desc is not None
    else:
        ok = getattr(layer, '_act_key', None) is not None and layer._act_ok(
            layer._last_bottom, layer._last_top)
    return 'cudnn' if ok else 'generic'


def _run(lp, x, dy, params, gpu, in_place=False):
    caffeplus.set_mode_gpu() if gpu else caffeplus.set_mode_cpu()
    layer = create_layer(lp)
    bottom = [Blob(x.shape, name='x')]
    bottom[0].data = x
    top = bottom if in_place else [Blob(name='y')]
    layer.setup(bottom, top)
    layer._last_bottom, layer._last_top = bottom, top
    if params is None:
        params = [backend.to_numpy(b.data).copy() for b in layer.blobs]
    for b, v in zip(layer.blobs, params):
        b.data = v
    layer.forward(bottom, top)
    y = backend.to_numpy(top[0].data).copy()
    if dy is None:
        dy = numpy.random.default_rng(7).standard_normal(y.shape).astype(numpy.float32)
    top[0].diff = dy
    for b in layer.blobs:
        b.diff[...] = 0
    layer.backward(top, [True], bottom)
    dx = backend.to_numpy(bottom[0].diff).copy()
    dparams = [backend.to_numpy(b.diff).copy() for b in layer.blobs]
    return layer, y, dx, dparams, params, dy


def _assert_close(a, b, tol, what):
    scale = max(float(numpy.abs(b).max()) if b.size else 1.0, 1.0)
    numpy.testing.assert_allclose(a, b, rtol=tol, atol=tol * scale, err_msg=what)


@pytest.mark.parametrize('case', CASES, ids=[c[0] for c in CASES])
def test_gpu_layer_matches_cpu_twin(case):
    name, text, shape, want_cudnn = case
    lp = _param(text)
    rng = numpy.random.default_rng(zlib.crc32(name.encode()))
    x = rng.standard_normal(shape).astype(numpy.float32)
    if lp.type == 'Pooling' and lp.pooling_param.pool == caffe_pb2.PoolingParameter.MAX:
        x = rng.permutation(x.size).astype(numpy.float32).reshape(shape) / x.size  # no ties
    caffeplus.set_random_seed(3)
    _, y_cpu, dx_cpu, dp_cpu, params, dy = _run(lp, x, None, None, gpu=False)
    layer, y_gpu, dx_gpu, dp_gpu, _, _ = _run(lp, x, dy, params, gpu=True)
    assert type(layer).__name__.startswith('CuDNN'), type(layer)
    via = _via(layer)
    assert via == ('cudnn' if want_cudnn else 'generic'), (name, via)
    tol = TOL.get(lp.type, 2e-5)
    _assert_close(y_gpu, y_cpu, tol, name + ' top')
    _assert_close(dx_gpu, dx_cpu, tol, name + ' bottom diff')
    for i, (a, b) in enumerate(zip(dp_gpu, dp_cpu)):
        _assert_close(a, b, tol, '%s param diff %d' % (name, i))


@pytest.mark.parametrize('text', ['type: "ReLU"', 'type: "Sigmoid"', 'type: "TanH"',
                                  'type: "ELU"', 'type: "Softmax"'])
def test_gpu_in_place_neurons(text):
    lp = _param(text)
    x = numpy.random.default_rng(5).standard_normal((2, 3, 4, 4)).astype(numpy.float32)
    _, y_cpu, dx_cpu, _, _, dy = _run(lp, x, None, None, gpu=False, in_place=True)
    _, y_gpu, dx_gpu, _, _, _ = _run(lp, x, dy, [], gpu=True, in_place=True)
    _assert_close(y_gpu, y_cpu, 2e-5, 'top')
    _assert_close(dx_gpu, dx_cpu, 2e-5, 'bottom diff')


def test_param_diffs_accumulate_like_caffe():
    """Two backwards without zeroing: weight and bias diffs add up (beta = 1)."""
    lp = _param('type: "Convolution" convolution_param { num_output: 4 kernel_size: 3 group: 2 }')
    x = numpy.random.default_rng(2).standard_normal((2, 4, 6, 6)).astype(numpy.float32)
    caffeplus.set_mode_gpu()
    layer = create_layer(lp)
    bottom, top = [Blob(x.shape)], [Blob()]
    bottom[0].data = x
    layer.setup(bottom, top)
    layer.forward(bottom, top)
    top[0].diff = numpy.ones(top[0].shape, numpy.float32)
    for b in layer.blobs:
        b.diff[...] = 0
    layer.backward(top, [True], bottom)
    once = [backend.to_numpy(b.diff).copy() for b in layer.blobs]
    layer.backward(top, [True], bottom)
    for b, o in zip(layer.blobs, once):
        _assert_close(backend.to_numpy(b.diff), 2 * o, 1e-5, 'accumulated diff')


# -- every reference case in GPU mode ----------------------------------------------
LAYERS = os.path.join(REFERENCE, 'layers')
REF_CASES = case_names(LAYERS)
REFUSED = ('swl_two_tops_default_loss_weight', 'swl_two_tops_explicit_loss_weight')


@pytest.mark.parametrize('case', REF_CASES)
def test_reference_case_on_gpu(case, monkeypatch):
    if case in REFUSED:
        pytest.skip('stock Caffe refuses to build this net')
    close = reference_cases._close

    def close_on_host(actual, expected, tol, what):   # layer.blobs are device arrays
        return close(backend.to_numpy(actual), expected, tol, what)
    monkeypatch.setattr(reference_cases, '_close', close_on_host)
    caffeplus.set_mode_gpu()
    net = run_case(LAYERS, case)
    if case.startswith('pool_'):
        layer = [l for l in net.layers if l.layer_param.type == 'Pooling'][0]
        print('%s: %s' % (case, 'cudnn' if layer.cudnn_agrees() else 'generic CuPy'))


# -- CUDA-graph replays, math types, per-group convolutions (issue #6) ---------------
def _conv_round(layer, bottom, top, dy):
    layer.reshape(bottom, top)
    layer.forward(bottom, top)
    top[0].diff = dy
    for b in layer.blobs:
        b.diff[...] = 0
    layer.backward(top, [True], bottom)
    return [backend.to_numpy(a).copy() for a in
            [top[0].data, bottom[0].diff] + [b.diff for b in layer.blobs]]


@pytest.mark.parametrize('text', [
    'type: "Convolution" convolution_param { num_output: 6 kernel_size: 3 group: 2 pad: 1 }',
    'type: "Deconvolution" convolution_param { num_output: 4 kernel_size: 3 stride: 2 }',
    'type: "Pooling" pooling_param { pool: MAX kernel_size: 2 stride: 2 }',
    'type: "LRN" lrn_param { local_size: 5 alpha: 0.0001 beta: 0.75 }',
    'type: "Softmax"', 'type: "Sigmoid"'])
def test_replayed_calls_equal_direct_calls(text):
    """From the second pass on the cuDNN calls run as CUDA graphs: every pass
    gives bit for bit what the direct calls give."""
    from caffeplus.cudnn import api
    lp = _param(text)
    rng = numpy.random.default_rng(11)
    x = rng.standard_normal((2, 4, 8, 8)).astype(numpy.float32)
    caffeplus.set_mode_gpu()
    previous = api.set_graphs(False)
    try:
        layer = create_layer(lp)
        bottom, top = [Blob(x.shape)], [Blob()]
        bottom[0].data = x
        layer.setup(bottom, top)
        dy = rng.standard_normal(top[0].shape).astype(numpy.float32)
        direct = _conv_round(layer, bottom, top, dy)
        api.set_graphs(True)
        launched = api.graph_stats()['launched']
        for _ in range(4):
            again = _conv_round(layer, bottom, top, dy)
            for a, b in zip(again, direct):
                numpy.testing.assert_array_equal(a, b)
        assert api.graph_stats()['launched'] > launched, api.graph_stats()
    finally:
        api.set_graphs(previous)


def test_replays_follow_new_pointers():
    """A replay is keyed by its pointers: new arrays get their own graph, not
    the old one's writes."""
    lp = _param('type: "Convolution" convolution_param { num_output: 3 kernel_size: 3 }')
    rng = numpy.random.default_rng(12)
    caffeplus.set_mode_gpu()
    layer = create_layer(lp)
    x = rng.standard_normal((2, 2, 6, 6)).astype(numpy.float32)
    bottom, top = [Blob(x.shape)], [Blob()]
    bottom[0].data = x
    layer.setup(bottom, top)
    for i in range(3):
        b2, t2 = [Blob(x.shape)], [Blob()]
        b2[0].data = x * (i + 1)
        layer.reshape(b2, t2)
        layer.forward(b2, t2)
        layer.forward(b2, t2)
        layer.forward(b2, t2)
        if i == 0:
            first = backend.to_numpy(t2[0].data).copy()
        _assert_close(backend.to_numpy(t2[0].data), first * (i + 1) - (
            (i) * backend.to_numpy(layer.blobs[1].data).reshape(1, -1, 1, 1)), 1e-4, 'pass %d' % i)


def test_grouped_convolution_per_group_variant():
    """Timed search may run a grouped convolution one call per group: that
    variant gives the same values."""
    from caffeplus.memory import workspace
    lp = _param('type: "Convolution" convolution_param { num_output: 8 kernel_size: 3 '
                'group: 2 pad: 1 }')
    x = numpy.random.default_rng(13).standard_normal((2, 6, 7, 7)).astype(numpy.float32)
    _, y_cpu, dx_cpu, dp_cpu, params, dy = _run(lp, x, None, None, gpu=False)
    previous = workspace.set_search('timed')
    try:
        layer, y_gpu, dx_gpu, dp_gpu, _, _ = _run(lp, x, dy, params, gpu=True)
        assert layer._cd_groups is not None and layer._cd_groups.loops == 2
        room = layer._manager().nbytes
        for site in layer._sites.values():
            assert site.choice is not None
            per_group = [c for c in site.candidates if c.variant == 1 and c.memory <= room]
            assert per_group, site.candidates
            site.choice = per_group[0]
        bottom, top = layer._last_bottom, layer._last_top
        got = _conv_round(layer, bottom, top, dy)
    finally:
        workspace.set_search(previous)
    for a, b, what in zip(got, [y_cpu, dx_cpu] + dp_cpu, ['top', 'dx', 'dw', 'db']):
        _assert_close(a, b, 2e-4, 'per-group ' + what)


@pytest.mark.parametrize('math', ['strict', 'tf32'])
def test_tf32_mode_convolution_and_inner_product(math):
    """TF32 mode reaches cuDNN (each algorithm with the math type it was
    timed with) and cuBLAS; values stay within TF32's rounding."""
    from caffeplus.backend import mathmode
    from caffeplus.memory import workspace
    rng = numpy.random.default_rng(14)
    tol = 2e-4 if math == 'strict' else 2e-2
    cases = [('type: "Convolution" convolution_param { num_output: 32 kernel_size: 3 pad: 1 }',
              (4, 16, 12, 12)),
             ('type: "InnerProduct" inner_product_param { num_output: 40 '
              'weight_filler { type: "gaussian" std: 0.1 } bias_filler { type: "gaussian" } }',
              (8, 3, 5, 7))]
    for text, shape in cases:
        lp = _param(text)
        x = rng.standard_normal(shape).astype(numpy.float32)
        _, y_cpu, dx_cpu, dp_cpu, params, dy = _run(lp, x, None, None, gpu=False)
        old_math = mathmode.set_math_mode(math)
        old_search = workspace.set_search('timed')
        try:
            layer, y_gpu, dx_gpu, dp_gpu, _, _ = _run(lp, x, dy, params, gpu=True)
        finally:
            mathmode.set_math_mode(old_math)
            workspace.set_search(old_search)
        for a, b, what in zip([y_gpu, dx_gpu] + dp_gpu, [y_cpu, dx_cpu] + dp_cpu,
                              ['top', 'dx', 'dw', 'db']):
            _assert_close(a, b, tol, '%s %s %s' % (lp.type, math, what))
        if lp.type == 'Convolution':
            for site in layer._sites.values():
                cd = layer._descs_for(site.choice)
                conv = cd.conv_for(site.choice.math)
                assert (conv is cd.conv) == (math == 'strict' or site.choice.math == cd.math)


@pytest.mark.parametrize('text,shape', [
    ('inner_product_param { num_output: 7 }', (5, 3, 4)),
    ('inner_product_param { num_output: 7 transpose: true }', (5, 12)),
    ('inner_product_param { num_output: 6 bias_term: false }', (4, 9)),
    ('inner_product_param { num_output: 3 axis: 2 }', (2, 3, 4, 5)),
])
def test_inner_product_gpu_matches_cpu(text, shape):
    lp = caffe_pb2.LayerParameter()
    text_format.Parse('name: "ip" type: "InnerProduct" %s' % text, lp)
    lp.inner_product_param.weight_filler.type = 'gaussian'
    lp.inner_product_param.bias_filler.type = 'gaussian'
    x = numpy.random.default_rng(15).standard_normal(shape).astype(numpy.float32)
    caffeplus.set_random_seed(3)
    _, y_cpu, dx_cpu, dp_cpu, params, dy = _run(lp, x, None, None, gpu=False)
    layer, y_gpu, dx_gpu, dp_gpu, _, _ = _run(lp, x, dy, params, gpu=True)
    assert type(layer).__name__ == 'GPUInnerProductLayer'
    _assert_close(y_gpu, y_cpu, 2e-5, 'top')
    _assert_close(dx_gpu, dx_cpu, 2e-5, 'dx')
    for i, (a, b) in enumerate(zip(dp_gpu, dp_cpu)):
        _assert_close(a, b, 2e-5, 'param diff %d' % i)
    # the parameter diffs accumulate (beta = 1), as Caffe's
    layer.backward(layer._last_top, [True], layer._last_bottom)
    for i, (b, once) in enumerate(zip(layer.blobs, dp_gpu)):
        _assert_close(backend.to_numpy(b.diff), 2 * once, 2e-5, 'accumulated %d' % i)


@pytest.mark.parametrize('dtype', ['float32', 'float16'])
@pytest.mark.parametrize('axis,shapes', [(1, [(2, 3, 4, 5), (2, 1, 4, 5), (2, 4, 4, 5)]),
                                         (0, [(1, 3, 2), (2, 3, 2)]),
                                         (2, [(2, 3, 1, 2), (2, 3, 4, 2)])])
def test_concat_gpu_matches_cpu(axis, shapes, dtype):
    """The GPU's byte copies give the CPU's values, for 16-bit maps too
    (values exact in float16, so both sides hold the same numbers)."""
    lp = caffe_pb2.LayerParameter()
    text_format.Parse('name: "cat" type: "Concat" concat_param { axis: %d }' % axis, lp)
    rng = numpy.random.default_rng(16)
    xs = [rng.standard_normal(s).astype(numpy.float16).astype(numpy.float32) for s in shapes]
    out = {}
    for gpu in (False, True):
        caffeplus.set_mode_gpu() if gpu else caffeplus.set_mode_cpu()
        layer = create_layer(lp)
        bottom = [Blob(s) for s in shapes]
        top = [Blob()]
        for b in bottom + top:
            b.set_storage_dtype(dtype)
        taken = []
        if gpu:
            copies = layer._copies
            layer._copies = lambda *a: taken.append(copies(*a)) or taken[-1]
        for b, x in zip(bottom, xs):
            b.data = x
        layer.setup(bottom, top)
        layer.forward(bottom, top)
        if not gpu:
            dy = rng.standard_normal(top[0].shape).astype(numpy.float16).astype(numpy.float32)
        top[0].diff = dy
        prop = [True, False] + [True] * (len(bottom) - 2)
        for b in bottom:
            b.diff[...] = 7
        layer.backward(top, prop, bottom)
        out[gpu] = [backend.to_numpy(top[0].data).copy()] + \
            [backend.to_numpy(b.diff).copy() for b in bottom]
        if gpu:
            assert type(layer).__name__ == 'GPUConcatLayer'
            assert top[0].data_storage.array.dtype == numpy.dtype(dtype)
            assert taken == [True, True]        # both ways took the byte copies
    for a, b in zip(out[True], out[False]):
        numpy.testing.assert_array_equal(a, b)


@pytest.mark.parametrize('math', ['strict', 'tf32'])
def test_convolution_im2col_gemm_variant(math, monkeypatch):
    """Timed search weighs im2col + cuBLAS against cuDNN for few input
    channels (algo_search.GEMM_SEARCH); that variant gives the convolution's
    values and gradients, the same bits every pass."""
    from caffeplus.cudnn import algo_search
    monkeypatch.setattr(algo_search, 'GEMM_SEARCH', True)
    from caffeplus.backend import mathmode
    from caffeplus.memory import workspace
    lp = _param('type: "Convolution" convolution_param { num_output: 8 kernel_size: 5 '
                'stride: 2 pad: 1 }')
    x = numpy.random.default_rng(17).standard_normal((5, 3, 15, 13)).astype(numpy.float32)
    _, y_cpu, dx_cpu, dp_cpu, params, dy = _run(lp, x, None, None, gpu=False)
    old_search = workspace.set_search('timed')
    old_math = mathmode.set_math_mode(math)
    try:
        layer, _, _, _, _, _ = _run(lp, x, dy, params, gpu=True)
        assert layer._gemm is not None
        for kind in ('fwd', 'bwd_filter'):
            site = layer._sites[kind]
            gemm = [c for c in site.candidates if c.variant == 2]
            assert gemm and gemm[0].name == 'CUBLAS_GEMM', site.candidates
            site.choice = gemm[0]
        mgr = layer._manager()
        mgr._buffer.resize(max(mgr.nbytes, layer._gemm.memory('bwd_filter')), layer, 'arena')
        got = _conv_round(layer, layer._last_bottom, layer._last_top, dy)
        got2 = _conv_round(layer, layer._last_bottom, layer._last_top, dy)
    finally:
        workspace.set_search(old_search)
        mathmode.set_math_mode(old_math)
    tol = 2e-4 if math == 'strict' else 2e-2
    for a, b, what in zip(got, [y_cpu, dx_cpu] + dp_cpu, ['top', 'dx', 'dw', 'db']):
        _assert_close(a, b, tol, 'im2col+GEMM %s %s' % (math, what))
    # top and filter gradient are the variant's (dx is cuDNN's backward data,
    # whose algorithm may sum with atomics)
    for i in (0, 2):
        numpy.testing.assert_array_equal(got[i], got2[i])


def _type_and_tolerance(type_name):
    """(dtype, tolerance) of a convolution's GPU values against the others
    in `type_name` (float32, float16 or bfloat16)."""
    if type_name == 'bfloat16':
        return pytest.importorskip('ml_dtypes').bfloat16, 3e-2
    if type_name == 'float16':
        return numpy.float16, 4e-3
    return numpy.float32, 2e-4


def _exact_conv_inputs(lp, shape, dtype, seed):
    """A convolution's image, parameters and top gradient as values `dtype`
    holds exactly, so every path reads the same inputs, and the CPU's
    float32 results over them: (x, params, dy, [y, dx, dw, db])."""
    x = numpy.random.default_rng(seed).standard_normal(shape).astype(dtype).astype(numpy.float32)
    _, _, _, _, params, dy = _run(lp, x, None, None, gpu=False)
    params = [p.astype(dtype).astype(numpy.float32) for p in params]
    dy = dy.astype(dtype).astype(numpy.float32)
    _, y, dx, dparams, _, _ = _run(lp, x, dy, params, gpu=False)
    return x, params, dy, [y, dx] + dparams


def _forced_conv_passes(lp, x, dy, params, dtype, pick, kinds=('fwd', 'bwd_filter'),
                        passes=1, check=None):
    """Forward and backward passes of a convolution over `dtype` maps on
    the GPU under timed search, each call in `kinds` (or kinds(layer))
    forced to the first candidate of pick(site, arena bytes), which must
    list one (None: the search's choice stays); the arena grows to hold
    them. check(layer) runs after the first forward. Returns (layer, top,
    [each pass's top, dx and parameter gradients])."""
    from caffeplus.memory import workspace
    caffeplus.set_mode_gpu()
    old_search = workspace.set_search('timed')
    try:
        layer = create_layer(lp)
        bottom, top = [Blob(x.shape, name='x')], [Blob(name='y')]
        if numpy.dtype(dtype) != numpy.float32:
            for b in bottom + top:
                b.set_storage_dtype(dtype)
        bottom[0].data = x
        layer.setup(bottom, top)
        for b, v in zip(layer.blobs, params):
            b.data = v
        layer.forward(bottom, top)
        if check is not None:
            check(layer)
        mgr = layer._manager()
        need = mgr.nbytes
        for kind in kinds(layer) if callable(kinds) else kinds:
            site = layer._sites[kind]
            chosen = pick(site, mgr.nbytes)
            if chosen is None:
                continue
            assert chosen, site.candidates
            site.choice = chosen[0]
            need = max(need, chosen[0].memory)
        mgr._buffer.resize(need, layer, 'arena')
        got = [_conv_round(layer, bottom, top, dy) for _ in range(passes)]
    finally:
        workspace.set_search(old_search)
    return layer, top, got


def _sixteen_bit_conv_round(lp, x, dy, params, dtype, gemm):
    """One forward and backward of a convolution over `dtype` maps on the
    GPU, its calls forced to the cuBLAS variant (`gemm`) or left to cuDNN."""
    def pick(site, arena):
        if (site.choice.variant == 2) == gemm:
            return None
        # cuDNN's fastest that the arena holds, or the cuBLAS variant
        return [c for c in site.candidates if (c.variant == 2) == gemm and
                (gemm or c.memory <= arena)]
    layer, top, (got,) = _forced_conv_passes(lp, x, dy, params, dtype, pick,
                                             kinds=lambda layer: layer._gemm.kinds())
    assert top[0].data_storage.array.dtype == numpy.dtype(dtype)
    assert all(b.diff.dtype == numpy.float32 for b in layer.blobs)     # the FP32 masters
    return got


@pytest.mark.parametrize('type_name', ['float16', 'bfloat16'])
@pytest.mark.parametrize('conv, shape', [
    ('num_output: 8 kernel_size: 5 stride: 2 pad: 1', (5, 3, 15, 13)),
    ('num_output: 24 kernel_size: 1', (6, 16, 9, 7))])
def test_sixteen_bit_convolution_gemm_variant_follows_cudnn(type_name, conv, shape, monkeypatch):
    """A 16-bit layer's cuBLAS variant (im2col of 16-bit values, tensor-core
    GEMMs, the filter gradient summed in float32 into the FP32 master's):
    its top and gradients within the type's rounding of cuDNN's 16-bit
    calls on the same values, and of the CPU's float32 convolution."""
    from caffeplus.cudnn import algo_search
    monkeypatch.setattr(algo_search, 'GEMM_SEARCH_SIXTEEN_BIT', True)
    dtype, tol = _type_and_tolerance(type_name)
    lp = _param('type: "Convolution" convolution_param { %s }' % conv)
    x, params, dy, cpu = _exact_conv_inputs(lp, shape, dtype, 29)
    gemm = _sixteen_bit_conv_round(lp, x, dy, params, dtype, True)
    cudnn = _sixteen_bit_conv_round(lp, x, dy, params, dtype, False)
    for a, b, c, what in zip(gemm, cudnn, cpu, ['top', 'dx', 'dw', 'db']):
        _assert_close(a, b, tol, '%s cuBLAS against cuDNN, %s' % (type_name, what))
        _assert_close(a, c, tol, '%s cuBLAS against the CPU, %s' % (type_name, what))


@pytest.mark.parametrize('math', ['strict', 'tf32'])
def test_convolution_1x1_gemm_variant(math):
    """Timed search weighs cuBLAS against cuDNN for every call of a 1x1
    stride-1 convolution (on by default); forced to it, the three calls give
    the convolution's values and gradients, the same bits every pass."""
    from caffeplus.backend import mathmode
    from caffeplus.memory import workspace
    lp = _param('type: "Convolution" convolution_param { num_output: 24 kernel_size: 1 }')
    x = numpy.random.default_rng(19).standard_normal((6, 16, 9, 7)).astype(numpy.float32)
    _, y_cpu, dx_cpu, dp_cpu, params, dy = _run(lp, x, None, None, gpu=False)
    old_search = workspace.set_search('timed')
    old_math = mathmode.set_math_mode(math)
    try:
        layer, _, _, _, _, _ = _run(lp, x, dy, params, gpu=True)
        assert layer._gemm is not None and layer._gemm.direct
        for kind in ('fwd', 'bwd_data', 'bwd_filter'):
            site = layer._sites[kind]
            gemm = [c for c in site.candidates if c.variant == 2]
            assert gemm and gemm[0].name == 'CUBLAS_GEMM', site.candidates
            site.choice = gemm[0]
        mgr = layer._manager()
        mgr._buffer.resize(max(mgr.nbytes, layer._gemm.memory('bwd_filter')), layer, 'arena')
        got = _conv_round(layer, layer._last_bottom, layer._last_top, dy)
        got2 = _conv_round(layer, layer._last_bottom, layer._last_top, dy)
    finally:
        workspace.set_search(old_search)
        mathmode.set_math_mode(old_math)
    tol = 2e-4 if math == 'strict' else 2e-2
    for a, b, what in zip(got, [y_cpu, dx_cpu] + dp_cpu, ['top', 'dx', 'dw', 'db']):
        _assert_close(a, b, tol, '1x1 GEMM %s %s' % (math, what))
    for a, b in zip(got, got2):
        numpy.testing.assert_array_equal(a, b)
