"""The schema: generated module current, field numbers as Caffe's, files round-trip."""
import os
import subprocess
import sys

import pytest

from conftest import REFERENCE, ROOT, need
from caffeplus.proto import caffe_pb2


def test_generated_module_is_up_to_date():
    pytest.importorskip('grpc_tools')
    subprocess.check_call([sys.executable, os.path.join(ROOT, 'dev', 'gen_proto.py'), '--check'])


def _field(message, name):
    return message.DESCRIPTOR.fields_by_name[name]


@pytest.mark.parametrize('message,field,number', [
    (caffe_pb2.NetParameter, 'layer', 100), (caffe_pb2.NetParameter, 'layers', 2),
    (caffe_pb2.NetParameter, 'input_dim', 4), (caffe_pb2.NetParameter, 'force_backward', 5),
    (caffe_pb2.LayerParameter, 'convolution_param', 106), (caffe_pb2.LayerParameter, 'clip_param', 148),
    (caffe_pb2.LayerParameter, 'swish_param', 147), (caffe_pb2.LayerParameter, 'recurrent_param', 146),
    (caffe_pb2.LayerParameter, 'batch_norm_param', 139), (caffe_pb2.LayerParameter, 'propagate_down', 11),
    (caffe_pb2.SolverParameter, 'type', 40), (caffe_pb2.SolverParameter, 'weights', 42),
    (caffe_pb2.SolverParameter, 'layer_wise_reduce', 41), (caffe_pb2.SolverParameter, 'solver_type', 30),
    (caffe_pb2.V1LayerParameter, 'blobs_lr', 7), (caffe_pb2.V1LayerParameter, 'param', 1001),
    (caffe_pb2.V0LayerParameter, 'hdf5_output_param', 1001), (caffe_pb2.BlobProto, 'double_data', 8),
    (caffe_pb2.ConvolutionParameter, 'dilation', 18), (caffe_pb2.PoolingParameter, 'global_pooling', 12),
])
def test_caffe_field_numbers(message, field, number):
    assert _field(message, field).number == number


def test_caffe_defaults():
    assert caffe_pb2.SolverParameter().solver_mode == caffe_pb2.SolverParameter.GPU
    assert caffe_pb2.SolverParameter().delta == pytest.approx(1e-8)
    assert caffe_pb2.SolverParameter().momentum2 == pytest.approx(0.999)
    assert caffe_pb2.SolverParameter().random_seed == -1
    assert caffe_pb2.NetState().phase == caffe_pb2.TEST
    assert caffe_pb2.ParamSpec().lr_mult == 1.0
    assert caffe_pb2.BatchNormParameter().moving_average_fraction == pytest.approx(0.999)
    assert caffe_pb2.DataParameter().backend == caffe_pb2.DataParameter.LEVELDB
    assert caffe_pb2.FillerParameter().type == 'constant'
    assert caffe_pb2.LossParameter().normalization == caffe_pb2.LossParameter.VALID
    assert caffe_pb2.V1LayerParameter.DUMMY_DATA == 32 and caffe_pb2.V1LayerParameter.SLICE == 33


def test_caffeplus_fields_are_far_from_caffes():
    assert _field(caffe_pb2.SolverParameter, 'caffeplus_param').number >= 10000
    assert _field(caffe_pb2.NetParameter, 'caffeplus_param').number >= 10000


@pytest.mark.parametrize('path,message', [
    ('io/lenet_iter_2.caffemodel', caffe_pb2.NetParameter),
    ('training/init.caffemodel', caffe_pb2.NetParameter),
    ('training/sgd/lenet_iter_30.caffemodel', caffe_pb2.NetParameter),
    ('io/lenet_iter_2.solverstate', caffe_pb2.SolverState),
    ('training/adam/lenet_iter_30.solverstate', caffe_pb2.SolverState),
    ('io/mnist_synth_train_mean.binaryproto', caffe_pb2.BlobProto),
])
def test_stock_caffe_binary_files_round_trip_byte_for_byte(path, message):
    data = open(need(os.path.join(REFERENCE, path)), 'rb').read()
    msg = message()
    msg.ParseFromString(data)
    assert msg.SerializeToString() == data
    # Every field is one our schema knows (nothing kept as unknown bytes).
    msg2 = message()
    msg2.ParseFromString(data)
    msg2.DiscardUnknownFields()
    assert msg2.SerializeToString() == data
