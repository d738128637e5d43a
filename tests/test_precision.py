"""Mixed precision: NVCaffe's FP16 schema, 16-bit storage on the CPU, loss scaling,
the --precision switch. References: IEEE rounding computed in float64 from the
formats' own bit patterns, FP32 training, stock Caffe's binary files."""
import json
import os
import re
import shutil
import subprocess
import sys

import numpy
import pytest
from google.protobuf import text_format

from conftest import ROOT
from caffeplus import precision
from caffeplus.errors import CaffeplusError, NetError
from caffeplus.net import Net
from caffeplus.proto import caffe_pb2
from caffeplus.solver import get_solver


# -- the schema ----------------------------------------------------------------------
def _number(message, name):
    return message.DESCRIPTOR.fields_by_name[name].number


def test_nvcaffe_type_enum_keeps_its_names_and_values():
    assert [(v.name, v.number) for v in caffe_pb2.Type.DESCRIPTOR.values][:5] == \
        [('DOUBLE', 0), ('FLOAT', 1), ('FLOAT16', 2), ('INT', 3), ('UINT', 4)]
    assert caffe_pb2.BFLOAT16 not in range(5)


@pytest.mark.parametrize('message,field,number', [
    (caffe_pb2.NetParameter, 'default_forward_type', 11),
    (caffe_pb2.NetParameter, 'default_backward_type', 12),
    (caffe_pb2.NetParameter, 'default_forward_math', 13),
    (caffe_pb2.NetParameter, 'default_backward_math', 14),
    (caffe_pb2.SolverParameter, 'solver_data_type', 44),
    (caffe_pb2.BlobProto, 'raw_data_type', 10), (caffe_pb2.BlobProto, 'raw_data', 12),
    # NVCaffe 0.17's numbers where BVLC's schema leaves them free.
    (caffe_pb2.NetParameter, 'global_grad_scale', 15),
    (caffe_pb2.SolverParameter, 'min_lr', 43),
    (caffe_pb2.SolverParameter, 'store_blobs_in_old_format', 45),
    (caffe_pb2.DataParameter, 'cache', 13), (caffe_pb2.DataParameter, 'shuffle', 14),
    (caffe_pb2.BatchNormParameter, 'scale_filler', 5),
    (caffe_pb2.BatchNormParameter, 'bias_filler', 6),
    (caffe_pb2.BatchNormParameter, 'scale_bias', 7),
    # Not in the NVCaffe schema checked: 18000 + the number it is said to have.
    (caffe_pb2.NetParameter, 'global_grad_scale_adaptive', 18016),
    # NVCaffe's 145-148 are BVLC's: BVLC keeps them.
    (caffe_pb2.LayerParameter, 'parameter_param', 145),
    (caffe_pb2.LayerParameter, 'recurrent_param', 146),
    (caffe_pb2.LayerParameter, 'swish_param', 147),
    (caffe_pb2.LayerParameter, 'clip_param', 148),
    (caffe_pb2.LayerParameter, 'forward_type', 18145),
    (caffe_pb2.LayerParameter, 'backward_type', 18146),
    (caffe_pb2.LayerParameter, 'forward_math', 18147),
    (caffe_pb2.LayerParameter, 'backward_math', 18148),
])
def test_precision_field_numbers(message, field, number):
    assert _number(message, field) == number


def test_nvcaffe_binary_fields_read_on_its_numbers():
    """A NetParameter, SolverParameter and BatchNormParameter as NVCaffe's
    protoc would write them (its field numbers, built here byte by byte)
    read into the same fields."""
    import struct

    def uvarint(n):
        out = b''
        while True:
            low, n = n & 0x7f, n >> 7
            out += bytes([low | (0x80 if n else 0)])
            if not n:
                return out

    def fixed32(number, value):
        return uvarint((number << 3) | 5) + struct.pack('<f', value)

    def varint(number, value):
        return uvarint(number << 3) + uvarint(value)
    net = caffe_pb2.NetParameter.FromString(
        bytes([0x0a, 3]) + b'net' + fixed32(15, 128.0) + varint(11, caffe_pb2.FLOAT16))
    assert (net.name, net.global_grad_scale, net.default_forward_type) == \
        ('net', 128.0, caffe_pb2.FLOAT16)
    solver = caffe_pb2.SolverParameter.FromString(
        fixed32(43, 0.5) + varint(44, caffe_pb2.FLOAT16) + varint(45, 1))
    assert (solver.min_lr, solver.solver_data_type, solver.store_blobs_in_old_format) == \
        (0.5, caffe_pb2.FLOAT16, True)
    bn = caffe_pb2.BatchNormParameter.FromString(varint(7, 1) + varint(1, 1))
    assert bn.scale_bias and bn.use_global_stats
    data = caffe_pb2.DataParameter.FromString(varint(13, 1) + varint(14, 1) + varint(10, 2))
    assert data.cache and data.shuffle and data.prefetch == 2


def test_a_layer_nvcaffe_wrote_with_forward_type_on_145_still_reads():
    # NVCaffe writes forward_type (an enum, varint) on 145, BVLC's
    # parameter_param (a message): the value is kept as an unknown field.
    lp = caffe_pb2.LayerParameter(name='conv1', type='Convolution')
    lp.blobs.add().data.extend([1.5, -2.0])
    nvcaffe_forward_type = bytes([0x88, 0x09, caffe_pb2.FLOAT16])   # tag (145 << 3) | 0
    read = caffe_pb2.LayerParameter()
    read.ParseFromString(lp.SerializeToString() + nvcaffe_forward_type)
    assert read.name == 'conv1' and list(read.blobs[0].data) == [1.5, -2.0]
    assert not read.HasField('parameter_param')


NVCAFFE_LENET = """
name: "LeNet"
default_forward_type: FLOAT16
default_backward_type: FLOAT16
default_forward_math: FLOAT
default_backward_math: FLOAT
global_grad_scale_adaptive: true
layer { name: "data" type: "DummyData" top: "data" top: "label"
  dummy_data_param { shape { dim: 8 dim: 1 dim: 12 dim: 12 } shape { dim: 8 }
    data_filler { type: "gaussian" std: 1 } data_filler { type: "constant" value: 1 } } }
layer { name: "conv1" type: "Convolution" bottom: "data" top: "conv1"
  forward_math: FLOAT16
  convolution_param { num_output: 4 kernel_size: 5 weight_filler { type: "xavier" }
    bias_filler { type: "constant" } } }
layer { name: "pool1" type: "Pooling" bottom: "conv1" top: "pool1"
  pooling_param { pool: MAX kernel_size: 2 stride: 2 } }
layer { name: "ip1" type: "InnerProduct" bottom: "pool1" top: "ip1"
  forward_type: FLOAT backward_type: FLOAT
  inner_product_param { num_output: 16 weight_filler { type: "xavier" } } }
layer { name: "relu1" type: "ReLU" bottom: "ip1" top: "relu1" }
layer { name: "ip2" type: "InnerProduct" bottom: "relu1" top: "ip2"
  inner_product_param { num_output: 3 weight_filler { type: "xavier" } } }
layer { name: "loss" type: "SoftmaxWithLoss" bottom: "ip2" bottom: "label" top: "loss" }
"""

NVCAFFE_SOLVER = """
base_lr: 0.01 momentum: 0.9 weight_decay: 0.0005 lr_policy: "fixed"
max_iter: 4 display: 1 snapshot_after_train: false solver_mode: CPU random_seed: 3
solver_data_type: FLOAT16
store_blobs_in_old_format: true
"""


def _net_param(text=NVCAFFE_LENET, **fields):
    p = text_format.Parse(text, caffe_pb2.NetParameter())
    for k, v in fields.items():
        setattr(p, k, v)
    return p


def _is_float16(a):
    a = numpy.asarray(a, dtype=numpy.float32)
    return numpy.array_equal(a, a.astype(numpy.float16).astype(numpy.float32))


# -- rounding against float64 references -------------------------------------------
def _reference_round(x, grid_bits, to_float64):
    """IEEE round-to-nearest-even of float64 values `x` onto the format whose
    non-negative bit patterns 0..grid_bits[-1] (the last one infinity) map to
    float64 by `to_float64`; infinity counts as the value one step past the
    largest finite one, as IEEE's rounding of overflow says."""
    patterns = numpy.arange(grid_bits + 1, dtype=numpy.uint32)
    values = to_float64(patterns)
    top = values[-2] + (values[-2] - values[-3])            # where infinity sits
    values = numpy.concatenate([values[:-1], [top]])
    mag = numpy.abs(x)
    hi = numpy.clip(numpy.searchsorted(values, mag), 1, len(values) - 1)
    lo = hi - 1
    d_lo, d_hi = mag - values[lo], values[hi] - mag
    pick = numpy.where(d_lo < d_hi, lo, numpy.where(d_hi < d_lo, hi, numpy.where(lo % 2 == 0, lo, hi)))
    pick = numpy.where(mag >= top, len(values) - 1, pick)
    out = numpy.where(pick == len(values) - 1, numpy.inf, values[pick])
    return numpy.copysign(out, x)


def _f16_to_f64(bits):
    return bits.astype(numpy.uint16).view(numpy.float16).astype(numpy.float64)


def _bf16_to_f64(bits):
    return (bits.astype(numpy.uint32) << 16).view(numpy.float32).astype(numpy.float64)


def _test_values(grid_bits, to_float64, seed):
    r = numpy.random.RandomState(seed)
    grid = to_float64(numpy.arange(grid_bits, dtype=numpy.uint32))
    mids = (grid[1:] + grid[:-1]) / 2                       # exact ties
    span = numpy.log2(grid[-1])
    random = numpy.exp2(r.uniform(-30, span + 2, 20000)) * r.choice([-1, 1], 20000)
    values = numpy.concatenate([mids[::7], -mids[::11], grid[::5], random,
                                [0.0, -0.0, grid[-1] * 1.01, -grid[-1] * 4]])
    with numpy.errstate(over='ignore'):     # beyond float32's range: inf, kept as a case
        return values.astype(numpy.float32)


def test_float16_rounding_matches_ieee_reference():
    x = _test_values(0x7C00, _f16_to_f64, 0)
    got = precision.round_to_float16(x.copy())
    want = _reference_round(x.astype(numpy.float64), 0x7C00, _f16_to_f64)
    numpy.testing.assert_array_equal(got.astype(numpy.float64), want)


def test_bfloat16_rounding_matches_ieee_reference():
    x = _test_values(0x7F80, _bf16_to_f64, 1)
    got = precision.round_to_bfloat16(x.copy())
    want = _reference_round(x.astype(numpy.float64), 0x7F80, _bf16_to_f64)
    numpy.testing.assert_array_equal(got.astype(numpy.float64), want)
    assert numpy.signbit(precision.round_to_bfloat16(numpy.array([-0.0], numpy.float32)))[0]


def test_bfloat16_keeps_nan_and_infinity():
    x = numpy.array([numpy.nan, -numpy.nan, numpy.inf, -numpy.inf], dtype=numpy.float32)
    got = precision.round_to_bfloat16(x.copy())
    assert numpy.isnan(got[:2]).all() and list(got[2:]) == [numpy.inf, -numpy.inf]


def test_bfloat16_agrees_with_ml_dtypes_where_installed():
    ml_dtypes = pytest.importorskip('ml_dtypes')
    x = _test_values(0x7F80, _bf16_to_f64, 2)
    want = x.astype(ml_dtypes.bfloat16).astype(numpy.float32)
    numpy.testing.assert_array_equal(precision.round_to_bfloat16(x.copy()), want)


@pytest.mark.parametrize('kind', [caffe_pb2.FLOAT16, caffe_pb2.BFLOAT16, caffe_pb2.FLOAT])
def test_nvcaffe_raw_blob_data_reads(kind):
    values = precision.round_to_bfloat16(numpy.array([0.5, -3.25, 1e-3, 7e4], numpy.float32))
    blob = caffe_pb2.BlobProto(raw_data_type=kind)
    if kind == caffe_pb2.FLOAT16:
        values[3] = 6e4
        values = values.astype(numpy.float16).astype(numpy.float32)
        blob.raw_data = values.astype('<f2').tobytes()
    elif kind == caffe_pb2.BFLOAT16:
        blob.raw_data = precision.float32_to_bfloat16_bits(values).astype('<u2').tobytes()
    else:
        blob.raw_data = values.astype('<f4').tobytes()
    numpy.testing.assert_array_equal(precision.raw_blob_values(blob), values)


def test_raw_blob_data_of_a_truncated_file_is_an_error():
    blob = caffe_pb2.BlobProto(raw_data_type=caffe_pb2.FLOAT, raw_data=b'\0' * 6)
    with pytest.raises(CaffeplusError, match='whole number'):
        precision.raw_blob_values(blob)


def test_a_caffemodel_with_nvcaffe_fp16_weights_loads(tmp_path):
    """NVCaffe writes 16-bit nets' weights as raw FLOAT16 bytes; a BVLC net
    of the same layers loads them (into FP32 blobs)."""
    net = Net(_net_param(), caffe_pb2.TRAIN)
    model = caffe_pb2.NetParameter(name='LeNet')
    written = {}
    rng = numpy.random.default_rng(3)
    for name in ('conv1', 'ip1', 'ip2'):
        lp = model.layer.add(name=name, type=net.layer_dict[name].layer_param.type)
        for j, b in enumerate(net.layer_dict[name].blobs):
            v = rng.standard_normal(b.shape).astype(numpy.float16)
            bp = lp.blobs.add(raw_data_type=caffe_pb2.FLOAT16, raw_data=v.astype('<f2').tobytes())
            bp.shape.dim.extend(b.shape)
            written[name, j] = v.astype(numpy.float32)
    path = tmp_path / 'nvcaffe_fp16.caffemodel'
    path.write_bytes(model.SerializeToString())
    net.copy_from(str(path))
    for (name, j), v in written.items():
        numpy.testing.assert_array_equal(net.layer_dict[name].blobs[j].data, v)
    short = caffe_pb2.BlobProto(raw_data_type=caffe_pb2.FLOAT16, raw_data=b'\0' * 6)
    short.shape.dim.append(4)
    model.layer[0].blobs[0].CopyFrom(short)
    path.write_bytes(model.SerializeToString())
    with pytest.raises(CaffeplusError, match='conv1'):
        net.copy_from(str(path))


# -- storage in a net ------------------------------------------------------------------
def test_nvcaffe_fp16_net_stores_float16_tops_and_gradients():
    net = Net(_net_param(), caffe_pb2.TRAIN)
    assert net.precision is not None
    net.forward_prefilled()
    net.backward_all()
    blobs = net.blobs
    assert _is_float16(blobs['conv1'].data) and _is_float16(blobs['pool1'].data)
    assert _is_float16(blobs['conv1'].diff) and _is_float16(net.params['conv1'][0].diff)
    # ip1's own types are FLOAT: its top and the gradient it writes are not rounded.
    assert not _is_float16(blobs['ip1'].data)
    assert not _is_float16(blobs['pool1'].diff)
    # Master weights and the loss stay FP32.
    assert not _is_float16(net.params['conv1'][0].data)
    assert not _is_float16(blobs['loss'].data)


def test_fp16_storage_matches_a_float64_reference_of_rounded_layers():
    text = """
      default_forward_type: FLOAT16 default_backward_type: FLOAT16
      layer { name: "in" type: "Input" top: "x" input_param { shape { dim: 4 dim: 5 } } }
      layer { name: "ip" type: "InnerProduct" bottom: "x" top: "y"
        inner_product_param { num_output: 3 weight_filler { type: "gaussian" std: 1 }
          bias_filler { type: "gaussian" std: 1 } } }
      layer { name: "sig" type: "Sigmoid" bottom: "y" top: "z" }
      layer { name: "out" type: "Power" bottom: "z" top: "w" power_param { scale: 3 } }"""
    net = Net(_net_param(text), caffe_pb2.TRAIN)
    x = numpy.random.RandomState(0).randn(4, 5).astype(numpy.float32) * 3
    net.blobs['x'].data[...] = x
    net.forward_prefilled()
    W, b = (p.data.astype(numpy.float64) for p in net.params['ip'])

    def r16(a):
        return a.astype(numpy.float16).astype(numpy.float64)
    # The Input layer's top is stored in FLOAT16 too, and the InnerProduct
    # multiplies by FLOAT16 copies of its weights.
    y = r16(r16(x) @ r16(W).T + r16(b))
    z = r16(1 / (1 + numpy.exp(-y)))
    numpy.testing.assert_allclose(net.blobs['y'].data, y, rtol=1e-3, atol=0)
    numpy.testing.assert_allclose(net.blobs['z'].data, z, rtol=1e-3, atol=0)
    assert _is_float16(net.blobs['z'].data)
    # The net's output is not rounded (nothing reads it).
    numpy.testing.assert_allclose(net.blobs['w'].data, 3 * z, rtol=1e-6)


def test_16_bit_layers_multiply_by_rounded_weights_and_keep_fp32_masters():
    """A FLOAT16 InnerProduct computes with a FLOAT16 copy of its weights (as
    NVCaffe's and AMP's do); the master weights stay FP32 through forward,
    backward and the update."""
    text = """
      default_forward_type: FLOAT16 default_backward_type: FLOAT16
      force_backward: true
      layer { name: "in" type: "Input" top: "x" input_param { shape { dim: 4 dim: 6 } } }
      layer { name: "ip" type: "InnerProduct" bottom: "x" top: "y"
        inner_product_param { num_output: 3 weight_filler { type: "gaussian" std: 1 }
          bias_filler { type: "gaussian" std: 1 } } }"""
    net = Net(_net_param(text), caffe_pb2.TRAIN)
    rng = numpy.random.RandomState(2)
    x = rng.randn(4, 6).astype(numpy.float32)
    net.blobs['x'].data[...] = x
    masters = [p.data.copy() for p in net.params['ip']]
    assert not all(_is_float16(m) for m in masters)
    net.forward_prefilled()

    def r16(a):
        return numpy.asarray(a).astype(numpy.float16).astype(numpy.float64)
    W, b = masters
    want = r16(x) @ r16(W).T + r16(b)           # y is the net's output: not rounded
    numpy.testing.assert_allclose(net.blobs['y'].data, want, rtol=1e-6, atol=1e-6)
    unrounded = r16(x) @ W.astype(numpy.float64).T + b
    assert numpy.abs(unrounded - want).max() > 1e-4        # the test can tell them apart
    dy = rng.randn(4, 3).astype(numpy.float32)
    net.blobs['y'].diff[...] = dy
    net.backward()
    # dx = dy W with the rounded weights (and stored in FLOAT16).
    numpy.testing.assert_allclose(net.blobs['x'].diff, r16(dy @ r16(W)), rtol=2e-3, atol=1e-6)
    for p, m in zip(net.params['ip'], masters):
        numpy.testing.assert_array_equal(p.data, m)         # the masters are back
    numpy.testing.assert_allclose(net.params['ip'][0].diff, r16(dy.T @ r16(x)), rtol=2e-3,
                                  atol=1e-6)


def test_fp32_nets_are_untouched():
    fp32 = Net(_net_param(default_forward_type=caffe_pb2.FLOAT,
                          default_backward_type=caffe_pb2.FLOAT), caffe_pb2.TRAIN)
    assert fp32.precision is None
    assert not fp32.after_layer_forward and not fp32.on_layer_backward_done


def test_precision_switch_overrides_the_files_types():
    with precision.setting('fp32'):
        net = Net(_net_param(), caffe_pb2.TRAIN)
    assert net.precision is None
    bvlc = text_format.Parse(NVCAFFE_LENET, caffe_pb2.NetParameter())
    for f in ('default_forward_type', 'default_backward_type', 'default_forward_math',
              'default_backward_math', 'global_grad_scale_adaptive'):
        bvlc.ClearField(f)
    for lp in bvlc.layer:
        for f in ('forward_type', 'backward_type', 'forward_math'):
            lp.ClearField(f)
    with precision.setting('bf16'):
        net = Net(bvlc, caffe_pb2.TRAIN)
    assert {t for pair in net.precision.types for t in pair} == {caffe_pb2.BFLOAT16}
    with precision.setting('fp16'):
        net = Net(bvlc, caffe_pb2.TRAIN)
    assert net.net_param.global_grad_scale_adaptive      # fp16 scales the loss by default


def test_int_storage_is_an_error_naming_the_layer():
    p = _net_param()
    p.layer[1].forward_type = caffe_pb2.INT
    with pytest.raises(NetError, match=r'conv1 \(Convolution\): forward_type INT'):
        Net(p, caffe_pb2.TRAIN)


def test_a_gpu_run_of_a_bfloat16_net_without_ml_dtypes_runs_fp32_and_says_so(
        monkeypatch, caplog_caffeplus):
    from caffeplus import backend
    monkeypatch.setattr(precision.backend, 'mode', lambda: backend.GPU)
    monkeypatch.setattr(precision, '_BFLOAT16', [None])        # no ml_dtypes
    net = Net(_net_param(default_forward_type=caffe_pb2.BFLOAT16,
                         default_backward_type=caffe_pb2.BFLOAT16), caffe_pb2.TRAIN)
    assert net.precision is None
    assert any('only with the ml_dtypes package' in m for m in caplog_caffeplus)


def test_the_memory_estimate_counts_bfloat16_maps_at_two_bytes_without_ml_dtypes(monkeypatch):
    monkeypatch.setattr(precision, '_BFLOAT16', [None])        # no ml_dtypes
    p = _net_param(default_forward_type=caffe_pb2.BFLOAT16,
                   default_backward_type=caffe_pb2.BFLOAT16)
    types = precision.resolve(p)
    assert precision.top_storage_dtypes(p, types) == {}       # a GPU run: FP32
    sized = precision.top_storage_dtypes(p, types, sizes_only=True)
    assert sized and all(d.itemsize == 2 for tops in sized.values() for d in tops.values())


def test_a_gpu_run_of_a_bfloat16_net_stores_its_maps_as_ml_dtypes_bfloat16(
        monkeypatch, caplog_caffeplus):
    ml_dtypes = pytest.importorskip('ml_dtypes')
    from caffeplus import backend
    monkeypatch.setattr(precision.backend, 'mode', lambda: backend.GPU)
    monkeypatch.setattr(precision, '_BFLOAT16', [])
    p = _net_param(default_forward_type=caffe_pb2.BFLOAT16,
                   default_backward_type=caffe_pb2.BFLOAT16)
    net = Net(p, caffe_pb2.TRAIN)
    assert net.precision is not None and not net.precision.emulate
    assert any('stores BFLOAT16 activations and gradients on the GPU' in m
               for m in caplog_caffeplus)
    stored = precision.top_storage_dtypes(p, precision.resolve(p))
    assert stored and {d for tops in stored.values() for d in tops.values()} == \
        {numpy.dtype(ml_dtypes.bfloat16)}


def test_a_gpu_run_of_a_float16_net_stores_its_maps_in_16_bits(monkeypatch, caplog_caffeplus):
    from caffeplus import backend
    monkeypatch.setattr(precision.backend, 'mode', lambda: backend.GPU)
    net = Net(_net_param(), caffe_pb2.TRAIN)
    assert net.precision is not None and not net.precision.emulate
    assert any('stores FLOAT16 activations and gradients on the GPU' in m
               for m in caplog_caffeplus)


HALF, SINGLE = numpy.dtype(numpy.float16), numpy.dtype(numpy.float32)


def _planned(text=NVCAFFE_LENET):
    """The net as the memory planner builds it for the GPU (shape only)."""
    from caffeplus.memory import shapes
    return shapes.build_net(_net_param(text))


def test_which_tops_a_float16_net_stores_in_16_bits():
    # The maps later layers read, in the producing layer's forward type; the
    # labels, an FP32 layer's top, the loss stay float32. The types are set
    # before any layer allocates.
    net = _planned()
    want = {'data': HALF, 'label': SINGLE, 'conv1': HALF, 'pool1': HALF, 'ip1': SINGLE,
            'relu1': HALF, 'ip2': HALF, 'loss': SINGLE}
    got = {name: net._blob_dict[name].data_storage.dtype for name in want}
    assert got == want
    assert all(net._blob_dict[n].diff_storage.dtype == want[n] for n in want)


def test_the_cpu_emulates_16_bit_storage_in_float32_arrays():
    net = Net(_net_param(), caffe_pb2.TRAIN)
    assert all(b.data_storage.dtype == SINGLE and b.data.dtype == SINGLE
               for b in net._blobs)


def test_an_in_place_top_keeps_its_producers_storage_type():
    text = NVCAFFE_LENET.replace('top: "relu1" }', 'top: "ip1" }').replace(
        'bottom: "relu1" top: "ip2"', 'bottom: "ip1" top: "ip2"')
    assert _planned(text)._blob_dict['ip1'].data_storage.dtype == SINGLE


def _bench_model(name):
    return os.path.join(os.path.dirname(__file__), 'data', 'bench', name + '.prototxt')


def _estimated_breakdowns(capsys, model, plan):
    """{'fp32' | 'fp16': `caffeplus memory --estimate`'s breakdown of `plan`}."""
    from caffeplus import cli
    out = {}
    for name in ('fp32', 'fp16'):
        assert cli.main(['memory', '--model', model, '--estimate', '--plans', plan,
                         '--precision', name, '--json']) == 0
        out[name] = json.loads(capsys.readouterr().out)['plans'][plan]['breakdown']
    return out


def test_the_memory_estimate_counts_16_bit_maps_at_two_bytes(capsys):
    sizes = _estimated_breakdowns(capsys, _bench_model('vgg16_b64'), 'arena')
    # Every map and its gradient but the labels', the loss's and the
    # accuracies': half the bytes. Parameters, their gradients and the
    # solver's history stay FP32.
    for key in ('activations', 'activation_diffs'):
        assert sizes['fp16'][key] == pytest.approx(sizes['fp32'][key] / 2, rel=0.01), key
    for key in ('parameters', 'parameter_diffs', 'solver_history'):
        assert sizes['fp16'][key] == sizes['fp32'][key], key
    # The convolutions and InnerProducts keep 16-bit copies of their
    # weights and biases: VGG-16's 138,357,544 values at two bytes, in other;
    # the 16-bit image DummyData draws is drawn in float32 first; the
    # first convolution reads it channels-last, padded to 4 channels; and the
    # channels-last bias gradients' double partial sums fill their scratch's
    # cap (2**19: the 512-channel convolutions).
    staged = 4 * 64 * 3 * 224 * 224
    relaid = 2 * 64 * 4 * 224 * 224
    partials = 8 * 2 ** 19
    assert sizes['fp16']['other'] - sizes['fp32']['other'] == \
        2 * 138357544 + staged + relaid + partials


def test_the_16_bit_images_float32_draw_is_placed_for_its_forward_alone():
    """VGG-16 in FLOAT16: DummyData's float32 draw of the 16-bit image
    (64 x 3 x 224 x 224 values) lives at the data layer's step only, so
    `shared` lends its bytes on and its peak does not hold it; `arena`,
    which places nothing, holds it in other."""
    from caffeplus.memory import budget, shapes, workspace_model as wm
    param = shapes.load_net_param(_bench_model('vgg16_b64'))
    precision.override(param, 'fp16')
    with shapes.quiet():
        net = shapes.build_net(param)
    staged = 4 * 64 * 3 * 224 * 224
    shared = budget.estimate_plan(net, 'shared')
    draw = [b for b in shared.buffers if b.key == ('internal', 'data', 'kept')]
    assert [(b.nbytes, b.start, b.end) for b in draw] == [(staged, 0, 0)]
    arena = budget.estimate_plan(net, 'arena')
    assert wm.internals(net, 'arena') >= staged
    assert arena.breakdown['other'] >= staged


def test_batchnorm_keeps_its_normalized_copy_in_the_maps_type(capsys):
    """ResNet-50 in FLOAT16: BatchNorm's kept normalized copies count at two
    bytes a value, as the GPU keeps them, beside the 16-bit weight copies."""
    model = _bench_model('resnet50_b64')
    other = {k: b['other'] for k, b in _estimated_breakdowns(capsys, model, 'arena').items()}
    net = Net(model, caffe_pb2.TRAIN)       # (on the CPU: the counts)
    normalized = sum(layer.internal_buffers()['x_norm'][0] for layer in net.layers
                     if layer.layer_param.type == 'BatchNorm')
    assert normalized > 0
    copies = sum(b.count for layer in net.layers
                 if layer.layer_param.type in ('Convolution', 'InnerProduct') for b in layer.blobs)
    # The 16-bit image's float32 draw; the stem reads the image as it is
    # (space-to-depth), so no channels-last copy of it.
    staged = 4 * 64 * 3 * 224 * 224
    partials = 8 * 64 * 4096                # conv1's bias gradient, 64 channels, 4096 blocks
    assert other['fp32'] - other['fp16'] == \
        2 * normalized - 2 * copies - staged - partials


def test_an_unchained_scale_keeps_its_bottom_copy_in_the_maps_type():
    """An in-place Scale with no BatchNorm before it keeps a copy of its
    bottom for the scale gradient: in a FLOAT16 net, two bytes a value, in
    what it declares (the plans place it so) and in the estimate."""
    from caffeplus.memory import shapes, workspace_model as wm
    text = ('name: "s" layer { name: "d" type: "Input" top: "x" input_param { shape { '
            'dim: 2 dim: 3 dim: 4 dim: 5 } } } layer { name: "c" type: "Convolution" '
            'bottom: "x" top: "y" convolution_param { num_output: 6 kernel_size: 1 } } '
            'layer { name: "s" type: "Scale" bottom: "y" top: "y" '
            'scale_param { bias_term: true } } force_backward: true')
    kept = {}
    for name in ('fp32', 'fp16'):
        param = text_format.Parse(text, caffe_pb2.NetParameter())
        precision.override(param, name)
        net = shapes.build_net(param)
        count, dtype = net.layers[2].internal_buffers()['bottom_copy']
        assert count == 2 * 6 * 4 * 5
        kept[name] = (numpy.dtype(dtype).itemsize, wm.internal_bytes(net, 2))
    assert kept == {'fp32': (4, 4 * 240), 'fp16': (2, 2 * 240)}


def test_the_estimate_keeps_every_gradient_of_a_loss_scaled_net(capsys):
    """The loss scaler judges all the gradients before any update, so a
    FLOAT16 solver cannot update in backward: under `shared` every parameter
    gradient lives to the update (as measured on the GPU: VGG-16's 553 MB
    at the peak), where an FP32 net's large ones are placed in backward."""
    parts = _estimated_breakdowns(capsys, _bench_model('vgg16_b64'), 'shared')
    assert parts['fp16']['parameter_diffs'] == parts['fp16']['parameters']
    assert parts['fp32']['parameter_diffs'] < parts['fp32']['parameters'] / 10


def test_the_time_model_runs_16_bit_convolutions_faster_and_moves_two_bytes_a_value(capsys):
    """The estimate's layer times over 16-bit maps: a convolution at
    SIXTEEN_BIT_CONV_TIME of its FP32 time (its call overhead aside), an
    elementwise layer moving half the bytes; the table says so."""
    from caffeplus import cli
    from caffeplus.memory import shapes
    from caffeplus.memory import workspace_model as wm
    model = _bench_model('vgg16_b64')
    nets = {}
    for name in ('fp32', 'fp16', 'bf16'):
        with precision.setting(name):
            nets[name] = shapes.build_net(shapes.load_net_param(model), caffe_pb2.TRAIN)
    names = [l.layer_param.name for l in nets['fp32'].layers]
    conv, relu = names.index('conv3_2'), names.index('relu3_2')
    f32, b32 = wm.layer_seconds(nets['fp32'], conv)
    for name in ('fp16', 'bf16'):
        f16, b16 = wm.layer_seconds(nets[name], conv)
        assert f16 - wm.LAYER_OVERHEAD == pytest.approx(
            wm.SIXTEEN_BIT_CONV_TIME * (f32 - wm.LAYER_OVERHEAD))
        assert b16 - wm.LAYER_OVERHEAD == pytest.approx(
            wm.SIXTEEN_BIT_CONV_TIME * (b32 - wm.LAYER_OVERHEAD))
        r16, r32 = wm.own_layer_seconds(nets[name], relu), wm.own_layer_seconds(nets['fp32'], relu)
        assert r16[0] - wm.OWN_CALL_SECONDS == pytest.approx((r32[0] - wm.OWN_CALL_SECONDS) / 2)
    notes = {}
    for name in ('fp32', 'fp16'):
        assert cli.main(['memory', '--model', model, '--estimate', '--plans', 'arena',
                         '--precision', name]) == 0
        notes[name] = capsys.readouterr().out
    note = "iter ms estimates put the FLOAT16 layers' convolutions at 0.25x FP32's time"
    assert note in notes['fp16'] and note not in notes['fp32']


WEIGHT_GRADIENTS = """
  default_forward_type: FLOAT16 default_backward_type: FLOAT16
  layer { name: "data" type: "Input" top: "x" top: "t"
    input_param { shape { dim: 2 dim: 1 dim: 5 dim: 5 } shape { dim: 2 dim: 3 } } }
  layer { name: "conv" type: "Convolution" bottom: "x" top: "c"
    convolution_param { num_output: 2 kernel_size: 3 weight_filler { type: "gaussian" std: 30 } } }
  layer { name: "ip" type: "InnerProduct" bottom: "c" top: "y"
    inner_product_param { num_output: 3 weight_filler { type: "gaussian" std: 0.01 } } }
  layer { name: "loss" type: "EuclideanLoss" bottom: "y" bottom: "t" top: "loss"
    loss_weight: 200 }
"""


@pytest.mark.filterwarnings('ignore:overflow encountered in cast:RuntimeWarning')
def test_the_emulation_rounds_the_weight_gradients_the_gpu_rounds():
    """As on the GPU: a Convolution's weight gradient is taken in FLOAT16
    (each pass's, then added to the float32 total), an InnerProduct's is
    summed in float32, so one past FLOAT16's range stays finite."""
    import caffeplus
    caffeplus.set_random_seed(3)
    net = Net(_net_param(WEIGHT_GRADIENTS), caffe_pb2.TRAIN)
    r = numpy.random.RandomState(2)
    inputs = [r.standard_normal((2, 1, 5, 5)) for _ in range(2)]
    net.blobs['t'].data[...] = 0

    def run(x, clear=True):
        net.blobs['x'].data[...] = x
        if clear:
            net.clear_param_diffs()
        net.forward_prefilled()
        net.backward_all()
        return net.layers[1].blobs[0].diff.copy(), net.layers[2].blobs[0].diff.copy()
    conv_1, ip_w = run(inputs[0])
    assert numpy.isfinite(ip_w).all() and numpy.abs(ip_w).max() > 65504
    assert not _is_float16(ip_w)
    assert _is_float16(conv_1) and numpy.isfinite(conv_1).all()
    conv_2, _ = run(inputs[1])
    # Two passes without clearing between: the sum of two rounded
    # gradients, in float32, not a rounded total.
    run(inputs[0])
    total, _ = run(inputs[1], clear=False)
    numpy.testing.assert_array_equal(total, conv_1 + conv_2)
    assert not _is_float16(total)


# -- loss scaling -------------------------------------------------------------------------
def _solver(net_text, solver_text=NVCAFFE_SOLVER, **cp):
    p = text_format.Parse(solver_text, caffe_pb2.SolverParameter())
    p.net_param.CopyFrom(_net_param(net_text))
    for k, v in cp.items():
        setattr(p.caffeplus_param, k, v)
    return get_solver(p)


TINY_GRADIENTS = """
  default_forward_type: FLOAT16 default_backward_type: FLOAT16
  layer { name: "data" type: "DummyData" top: "x" top: "t"
    dummy_data_param { shape { dim: 4 dim: 6 } shape { dim: 4 dim: 2 }
      data_filler { type: "gaussian" std: 1 } data_filler { type: "gaussian" std: 1 } } }
  layer { name: "ip" type: "InnerProduct" bottom: "x" top: "y"
    inner_product_param { num_output: 2 weight_filler { type: "gaussian" std: 1 } } }
  layer { name: "loss" type: "EuclideanLoss" bottom: "y" bottom: "t" top: "loss"
    loss_weight: 1e-8 }
"""


def _gradients(solver):
    net = solver.net
    net.clear_param_diffs()
    net.forward_prefilled()
    net.backward_all()
    if solver.loss_scaler is not None:
        solver.loss_scaler.on_gradients_ready()
    return [p.diff.copy() for p in net.learnable_params]


def test_static_loss_scale_saves_gradients_fp16_would_lose():
    import caffeplus
    caffeplus.set_random_seed(5)
    fp32 = _gradients(_solver(TINY_GRADIENTS, precision='fp32'))
    caffeplus.set_random_seed(5)
    unscaled = _gradients(_solver(TINY_GRADIENTS))
    caffeplus.set_random_seed(5)
    scaled = _solver(TINY_GRADIENTS.replace('default_backward_type: FLOAT16',
                                            'default_backward_type: FLOAT16 '
                                            'global_grad_scale: 65536'))
    assert scaled.loss_scaler.scale == 65536 and not scaled.loss_scaler.adaptive
    scaled = _gradients(scaled)
    # Top gradients near 1e-8 round to zero in FP16 (its subnormals are 6e-8 apart) ...
    assert numpy.abs(unscaled[0] - fp32[0]).max() > 0.2 * numpy.abs(fp32[0]).max()
    # ... and survive when the loss is scaled (to 1%: the inputs and the
    # top gradient are stored in FP16 too).
    numpy.testing.assert_allclose(scaled[0], fp32[0], rtol=1e-2, atol=1e-12)


@pytest.mark.filterwarnings('ignore:invalid value:RuntimeWarning')   # inf * 0 when it overflows
def test_an_overflowing_fp16_run_lowers_its_scale_and_recovers(caplog_caffeplus):
    net = NVCAFFE_LENET.replace('global_grad_scale_adaptive: true',
                                'global_grad_scale_adaptive: true global_grad_scale: %d' % 2 ** 40)
    solver = _solver(net, loss_scale_window=3)
    first = [p.data.copy() for p in solver.net.learnable_params]
    solver.step(1)
    assert solver.iter == 1 and solver.loss_scaler.scale == 2 ** 39
    for p, before in zip(solver.net.learnable_params, first):
        numpy.testing.assert_array_equal(p.data, before)      # the step was skipped
    solver.step(40)
    scaler = solver.loss_scaler
    assert scaler.skipped_steps >= 10 and scaler.scale < 1e9
    assert any(not numpy.array_equal(p.data, b) for p, b in zip(solver.net.learnable_params, first))
    assert all(numpy.isfinite(p.data).all() for p in solver.net.learnable_params)
    lowered = [m for m in caplog_caffeplus if 'step skipped, global_grad_scale lowered to' in m]
    raised = [m for m in caplog_caffeplus if 'global_grad_scale raised to' in m]
    assert len(lowered) == scaler.skipped_steps and raised
    assert re.match(r'Iteration 0, gradient overflow in FLOAT16: step skipped, '
                    r'global_grad_scale lowered to 5.49756e\+11', lowered[0])


def test_loss_scaling_sees_the_gradients_a_later_callback_syncs(caplog_caffeplus):
    """A data-parallel sync is added to the solver after it is built and
    averages the gradients across ranks: the loss scaler must judge the
    averaged ones (another rank's overflow reaches this rank there), so every
    rank skips the same steps. Here the 'sync' brings an inf."""
    solver = _solver(NVCAFFE_LENET, loss_scale_window=3)

    class Sync:
        def on_start(self):
            pass

        def on_gradients_ready(self):
            solver.net.learnable_params[0].diff[0] = numpy.inf
    solver.add_callback(Sync())
    first = [p.data.copy() for p in solver.net.learnable_params]
    scale = solver.loss_scaler.scale
    solver.step(1)                  # no NumericalError: the scaler saw the inf
    assert solver.loss_scaler.skipped_steps == 1 and solver.loss_scaler.scale == scale / 2
    for p, before in zip(solver.net.learnable_params, first):
        numpy.testing.assert_array_equal(p.data, before)


@pytest.mark.filterwarnings('ignore:invalid value:RuntimeWarning')
def test_a_resumed_fp16_run_keeps_its_adaptive_loss_scale(tmp_path, monkeypatch):
    """The scale an adaptive run has found is saved with its snapshot and
    restored with it: the resumed run continues as the uninterrupted one."""
    import caffeplus
    monkeypatch.chdir(tmp_path)
    net = NVCAFFE_LENET.replace('global_grad_scale_adaptive: true',
                                'global_grad_scale_adaptive: true global_grad_scale: %d' % 2 ** 40)
    caffeplus.set_random_seed(9)
    whole = _solver(net, loss_scale_window=3)
    whole.step(12)
    at_12 = (whole.loss_scaler.scale, whole.loss_scaler.good_steps,
             whole.loss_scaler.skipped_steps)
    assert at_12[0] < 2 ** 40                       # it has moved
    whole.param.snapshot_prefix = str(tmp_path / 'fp16')
    whole.snapshot()
    whole.step(6)
    caffeplus.set_random_seed(123)                  # the sidecar's stream wins
    resumed = _solver(net, loss_scale_window=3)
    assert resumed.loss_scaler.scale == 2 ** 40
    resumed.restore(str(tmp_path / 'fp16_iter_12.solverstate'))
    assert (resumed.loss_scaler.scale, resumed.loss_scaler.good_steps,
            resumed.loss_scaler.skipped_steps) == at_12
    resumed.step(6)
    assert resumed.loss_scaler.scale == whole.loss_scaler.scale
    for a, b in zip(resumed.net.learnable_params, whole.net.learnable_params):
        numpy.testing.assert_array_equal(a.data, b.data)


def test_bad_precision_in_the_solver_file_is_a_clear_error():
    with pytest.raises(CaffeplusError, match="caffeplus_param.precision must be one of "
                                             "fp32, tf32, fp16, bf16, not 'half'"):
        _solver(NVCAFFE_LENET, precision='half')


def test_cli_train_precision_flag(tmp_path):
    net = NVCAFFE_LENET
    for line in ('default_forward_type: FLOAT16', 'default_backward_type: FLOAT16',
                 'global_grad_scale_adaptive: true', 'forward_math: FLOAT16',
                 'forward_type: FLOAT backward_type: FLOAT'):
        net = net.replace(line, '')
    (tmp_path / 'net.prototxt').write_text(net)
    (tmp_path / 'solver.prototxt').write_text(
        'net: "%s"\n' % (tmp_path / 'net.prototxt') +
        NVCAFFE_SOLVER.replace('solver_data_type: FLOAT16', ''))
    env = dict(os.environ, PYTHONPATH=ROOT)
    proc = subprocess.run([sys.executable, '-m', 'caffeplus', 'train', '-solver',
                           str(tmp_path / 'solver.prototxt'), '-precision', 'fp16'],
                          capture_output=True, text=True, timeout=300, cwd=tmp_path, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert 'stores FLOAT16 activations and gradients' in proc.stderr
    assert 'Loss scaling: global_grad_scale 65536, adaptive' in proc.stderr
    bad = subprocess.run([sys.executable, '-m', 'caffeplus', 'train', '--solver',
                          str(tmp_path / 'solver.prototxt'), '--precision', 'fp8'],
                         capture_output=True, text=True, timeout=300, cwd=tmp_path, env=env)
    assert bad.returncode != 0 and 'fp8' in bad.stderr and 'Traceback' not in bad.stderr


# -- NVCaffe's FP16 ResNet form: BatchNorm scale_bias, two Data layers ------------------------
NVCAFFE_RESNET_FP16 = """
name: "Resnet_fp16"

default_forward_type:  FLOAT16
default_backward_type: FLOAT16
default_forward_math:  FLOAT
default_backward_math: FLOAT

layer { name: "data" type: "Data" top: "data" top: "label"
  data_param { source: "examples/imagenet/ilsvrc12_train_lmdb" backend: LMDB batch_size: 4 }
  transform_param { crop_size: 16 mirror: true }
  include: { phase: TRAIN } }
layer { name: "data" type: "Data" top: "data" top: "label"
  data_param { source: "examples/imagenet/ilsvrc12_val_lmdb" backend: LMDB batch_size: 2 }
  transform_param { crop_size: 16 mirror: false }
  include: { phase: TEST } }
layer { name: "conv1" type: "Convolution" bottom: "data" top: "conv1"
  convolution_param { num_output: 8 kernel_size: 3 pad: 1 stride: 2
    weight_filler { type: "msra" } bias_term: false } }
layer { name: "conv1/bn" type: "BatchNorm" bottom: "conv1" top: "conv1/bn"
  batch_norm_param { moving_average_fraction: 0.9 eps: 0.0001 scale_bias: true } }
layer { name: "conv1/relu" type: "ReLU" bottom: "conv1/bn" top: "conv1/bn" }
layer { name: "res2.1.conv1" type: "Convolution" bottom: "conv1/bn" top: "res2.1.conv1"
  convolution_param { num_output: 8 kernel_size: 3 pad: 1
    weight_filler { type: "msra" } bias_term: false } }
layer { name: "res2.1.conv1/bn" type: "BatchNorm" bottom: "res2.1.conv1" top: "res2.1.conv1/bn"
  batch_norm_param { moving_average_fraction: 0.9 eps: 0.0001 scale_bias: true } }
layer { name: "res2.1.sum" type: "Eltwise" bottom: "res2.1.conv1/bn" bottom: "conv1/bn"
  top: "res2.1.sum" eltwise_param { operation: SUM } }
layer { name: "res2.1.relu" type: "ReLU" bottom: "res2.1.sum" top: "res2.1.sum" }
layer { name: "pool2" type: "Pooling" bottom: "res2.1.sum" top: "pool2"
  pooling_param { pool: AVE kernel_size: 8 } }
layer { name: "fc" type: "InnerProduct" bottom: "pool2" top: "fc"
  inner_product_param { num_output: 10 weight_filler { type: "msra" }
    bias_filler { type: "constant" value: 0 } } }
layer { name: "loss" type: "SoftmaxWithLoss" bottom: "fc" bottom: "label" top: "loss" }
layer { name: "accuracy/top-1" type: "Accuracy" bottom: "fc" bottom: "label"
  top: "accuracy/top-1" accuracy_param { top_k: 1 } }
layer { name: "accuracy/top-5" type: "Accuracy" bottom: "fc" bottom: "label"
  top: "accuracy/top-5" accuracy_param { top_k: 5 } }
"""


def test_nvcaffe_fp16_resnet_form_trains_with_its_data_layers_swapped(tmp_path):
    """NVCaffe's FP16 ResNet train_val form (per-file types, BatchNorm with
    scale_bias, Data layers per phase) loads as written and trains: the
    BatchNorm scales and biases learn, the statistics move, the tops are
    FLOAT16 values, and the solver's update keeps FP32 master weights."""
    import caffeplus
    from caffeplus.io import dummy
    path = tmp_path / 'train_val_fp16.prototxt'
    path.write_text(NVCAFFE_RESNET_FP16)
    param = dummy.swap_data_layers(str(path), shapes={'data': (4, 3, 16, 16), 'label': (4,)})
    caffeplus.set_random_seed(7)
    solver_param = text_format.Parse(
        'base_lr: 0.05 lr_policy: "poly" power: 2.0 momentum: 0.9 weight_decay: 1e-4 '
        'max_iter: 3 display: 1 snapshot_after_train: false random_seed: 1',
        caffe_pb2.SolverParameter())
    solver_param.net_param.CopyFrom(param)
    solver = get_solver(solver_param)
    net = solver.net
    bn = net.layer_dict['conv1/bn']
    assert len(bn.blobs) == 5
    assert net.params_lr[1:6] == [0, 0, 0, 1, 1]          # after conv1's weights
    scale0, bias0 = bn.blobs[3].data.copy(), bn.blobs[4].data.copy()
    solver.solve()
    assert numpy.isfinite(float(net.blobs['loss'].data))
    assert not numpy.array_equal(bn.blobs[3].data, scale0)       # scale_bias learns
    assert not numpy.array_equal(bn.blobs[4].data, bias0)
    assert float(bn.blobs[2].data[0]) > 0                         # statistics accumulated
    assert _is_float16(net.blobs['conv1/bn'].data)               # FLOAT16 storage
    assert not _is_float16(bn.blobs[3].data)                      # FP32 master weights
    assert set(net.outputs) == {'loss', 'accuracy/top-1', 'accuracy/top-5'}


BN_NET = """
name: "bn16" force_backward: true
default_forward_type: FLOAT16 default_backward_type: FLOAT16
layer { name: "x" type: "DummyData" top: "x" top: "t"
  dummy_data_param { shape { dim: 4 dim: 3 dim: 5 dim: 5 } shape { dim: 4 dim: 6 }
    data_filler { type: "gaussian" std: 3 } data_filler { type: "gaussian" } } }
layer { name: "bn" type: "BatchNorm" bottom: "x" top: "y" %s }
layer { name: "ip" type: "InnerProduct" bottom: "y" top: "z"
  inner_product_param { num_output: 6 weight_filler { type: "gaussian" std: 0.1 } } }
layer { name: "loss" type: "EuclideanLoss" bottom: "z" bottom: "t" top: "loss" }
"""


@pytest.mark.parametrize('scale_bias', [False, True])
def test_emulated_batchnorm_keeps_its_normalized_copy_rounded(scale_bias):
    """The CPU emulation keeps BatchNorm's normalized copy as the GPU does, in
    the maps' 16-bit type, and (scale_bias) computes the top from that
    rounded copy; the backward reads it: its gradient is the float64 formula
    on the rounded copy."""
    extra = 'batch_norm_param { scale_bias: true ' \
        'scale_filler { type: "constant" value: 1.7 } ' \
        'bias_filler { type: "constant" value: 0.3 } }' if scale_bias else ''
    net = Net(text_format.Parse(BN_NET % extra, caffe_pb2.NetParameter()), caffe_pb2.TRAIN)
    net.forward()
    bn = net.layer_dict['bn']
    kept = bn._x_norm.astype(numpy.float64).reshape(4, 3, 5, 5)
    assert _is_float16(bn._x_norm)
    top = net.blobs['y'].data.astype(numpy.float64)
    if scale_bias:
        expected = precision.round_to_float16(
            (bn._x_norm * numpy.float32(1.7) + numpy.float32(0.3)).astype(numpy.float32))
        assert numpy.array_equal(net.blobs['y'].data, expected.reshape(4, 3, 5, 5))
    else:
        assert numpy.array_equal(top, kept)
    net.backward()
    dy = net.blobs['y'].diff.astype(numpy.float64).reshape(4, 3, 25)
    if scale_bias:
        dy = dy * 1.7
    xn = kept.reshape(4, 3, 25)
    std = bn._std.astype(numpy.float64).reshape(1, 3, 1)
    dx = (dy - dy.mean(axis=(0, 2), keepdims=True)
          - xn * (dy * xn).mean(axis=(0, 2), keepdims=True)) / std
    got = net.blobs['x'].diff.reshape(4, 3, 25)
    assert _is_float16(got)
    numpy.testing.assert_allclose(got, dx, rtol=2e-3, atol=2e-3 * numpy.abs(dx).max())


# -- LeNet on the bundled digits ------------------------------------------------------------
@pytest.fixture(scope='module')
def digits(tmp_path_factory):
    pytest.importorskip('sklearn')
    work = tmp_path_factory.mktemp('digits')
    shutil.copytree(os.path.join(ROOT, 'examples', 'digits'), work / 'examples' / 'digits',
                    ignore=shutil.ignore_patterns('*_lmdb', 'lenet_iter_*'))
    subprocess.check_call([sys.executable, 'examples/digits/make_digits_lmdb.py'], cwd=work,
                          stdout=subprocess.DEVNULL)
    return work


def _digits_accuracy(work, name, iterations):
    from caffeplus.solver import read_solver_file
    cwd = os.getcwd()
    os.chdir(work)
    try:
        p = read_solver_file('examples/digits/lenet_solver.prototxt')
        p.max_iter = p.test_interval = iterations
        p.snapshot = 0
        p.snapshot_after_train = False
        p.caffeplus_param.precision = name
        solver = get_solver(p)
        solver.solve()
        net = solver.test_nets[0]
        correct = 0.0
        for _ in range(p.test_iter[0]):
            net.forward_prefilled()
            correct += float(net.blobs['accuracy'].data)
        return correct / p.test_iter[0], solver
    finally:
        os.chdir(cwd)


@pytest.mark.slow
def test_lenet_digits_fp16_and_bf16_reach_fp32_accuracy(digits):
    # 200 iterations (a fifth of the example's) keep this near two minutes on
    # two cores; FP32 is at about 98% by then.
    fp32, _ = _digits_accuracy(digits, 'fp32', 200)
    fp16, solver = _digits_accuracy(digits, 'fp16', 200)
    assert solver.loss_scaler is not None and solver.loss_scaler.adaptive
    bf16, _ = _digits_accuracy(digits, 'bf16', 200)
    assert fp32 > 0.95
    assert abs(fp16 - fp32) <= 0.005, (fp32, fp16)
    assert abs(bf16 - fp32) <= 0.005, (fp32, bf16)
