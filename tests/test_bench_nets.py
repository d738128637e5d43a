"""The like-for-like bench net for PyTorch's AlexNet (benchmarks/nets/), and
the benchmark's tables."""
import os

import pytest

import caffeplus
from benchmarks import bench_gpu

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _torch_out(size, kernel, stride=1, pad=0):
    """PyTorch's (floor) output size."""
    return (size + 2 * pad - kernel) // stride + 1


def test_torchvision_alexnet_as_caffe_net():
    path = bench_gpu.net_path('/nonexistent', 'alexnettv_b128')
    assert path == os.path.join(ROOT, 'benchmarks', 'nets', 'alexnettv_b128.prototxt')
    net = caffeplus.Net(path, caffeplus.TRAIN)
    # torchvision.models.alexnet at 224x224: floor-mode shapes, stage by stage.
    s = _torch_out(224, 11, 4, 2)
    want = {'conv1': (64, s)}
    s = _torch_out(s, 3, 2)
    want.update(pool1=(64, s), conv2=(192, s))
    s = _torch_out(s, 3, 2)
    want.update(pool2=(192, s), conv3=(384, s), conv4=(256, s), conv5=(256, s))
    want['pool5'] = (256, _torch_out(s, 3, 2))
    assert want['pool5'] == (256, 6)        # AdaptiveAvgPool2d(6) is the identity
    for name, (c, hw) in want.items():
        assert net.blobs[name].data.shape == (128, c, hw, hw), name
    assert net.blobs['fc8'].data.shape == (128, 1000)
    # torchvision's documented parameter count for alexnet
    assert sum(p.count for p in net.learnable_params) == 61100840
    types = [l.type for l in net.layers]
    assert 'LRN' not in types
    assert all(l.layer_param.convolution_param.group == 1
               for l in net.layers if l.type == 'Convolution')
    assert bench_gpu.TORCH_MODELS['alexnettv'] == 'alexnet'
    assert bench_gpu.INPUT_SIZE.get('alexnettv', 224) == 224


def test_the_benchmark_prints_issue_37s_ratios_from_rows_of_one_run():
    """bench_gpu's 16-bit table: speed against AMP FP16 and against the
    same plan's '/strict' FP32 row, peak against AMP's."""
    rows = [dict(framework='caffeplus', net='n', plan='arena/fp16', tf32=1, median_ms=10.0,
                 peak_used_mib=600.0),
            dict(framework='caffeplus', net='n', plan='arena/strict', tf32=0, median_ms=25.0,
                 peak_used_mib=900.0),
            dict(framework='pytorch', net='n', plan='-/amp-fp16', tf32=1, median_ms=12.0,
                 peak_used_mib=1200.0),
            dict(framework='caffeplus', net='m', plan='arena/fp16', error='boom')]
    table = bench_gpu.sixteen_bit_targets(rows)
    assert table[-1] == \
        '| n | arena/fp16 | 10.0 | -/amp-fp16 | 12.0 | 1.20x | 25.0 | 2.50x | - | - | 0.50x |'
    assert sum(line.startswith('| n |') or line.startswith('| m |') for line in table) == 1
    assert bench_gpu.sixteen_bit_targets(rows[1:3]) == []
    # BVLC's AlexNet is weighed against PyTorch's model of BVLC's form where
    # the run has one (in either order), not torchvision's lighter AlexNet.
    bvlc = dict(framework='pytorch', net='n', plan='bvlc/amp-fp16', tf32=1, median_ms=20.0,
                peak_used_mib=1500.0)
    for order in (rows + [bvlc], [bvlc] + rows):
        assert bench_gpu.sixteen_bit_targets(order)[-1] == \
            '| n | arena/fp16 | 10.0 | bvlc/amp-fp16 | 20.0 | 2.00x | 25.0 | 2.50x | - | - | 0.40x |'
    # A BFLOAT16 row is weighed against AMP in BFLOAT16, not FP16.
    bf16 = [dict(framework='caffeplus', net='n', plan='arena/bf16', tf32=1, median_ms=8.0,
                 peak_used_mib=600.0),
            dict(framework='pytorch', net='n', plan='-/amp-bf16', tf32=1, median_ms=16.0,
                 peak_used_mib=1000.0)]
    assert bench_gpu.sixteen_bit_targets(rows + bf16)[-2:] == [
        '| n | arena/fp16 | 10.0 | -/amp-fp16 | 12.0 | 1.20x | 25.0 | 2.50x | - | - | 0.50x |',
        '| n | arena/bf16 | 8.0 | -/amp-bf16 | 16.0 | 2.00x | 25.0 | 3.12x | - | - | 0.60x |']
    # The plan's TF32 row (no variant, TF32 on) gives its own column; a
    # strict-math row of that plan is not it.
    tf32 = [dict(framework='caffeplus', net='n', plan='arena', tf32=0, median_ms=30.0,
                 peak_used_mib=900.0),
            dict(framework='caffeplus', net='n', plan='arena', tf32=1, median_ms=16.0,
                 peak_used_mib=900.0)]
    assert bench_gpu.sixteen_bit_targets(rows + tf32[:1])[-1].endswith('| - | - | 0.50x |')
    assert bench_gpu.sixteen_bit_targets(rows + tf32)[-1] == \
        '| n | arena/fp16 | 10.0 | -/amp-fp16 | 12.0 | 1.20x | 25.0 | 2.50x | 16.0 | 1.60x | 0.50x |'


def test_a_batch_without_its_own_prototxt_takes_the_architectures_file():
    """Issue 37's ResNet-50 b256 has no prototxt of its own: the bench
    builds ResNet-50's at that batch; a kept file is used as it is."""
    bench = os.path.join(ROOT, 'tests', 'data', 'bench')
    assert bench_gpu.net_source(bench, 'resnet50_b64') == os.path.join(bench,
                                                                        'resnet50_b64.prototxt')
    param = bench_gpu.net_source(bench, 'resnet50_b256')
    net = caffeplus.Net(param, caffeplus.TRAIN)
    assert net.blobs['data'].data.shape == (256, 3, 224, 224)
    assert net.blobs['label'].data.shape == (256,)
    kept = caffeplus.Net(os.path.join(bench, 'resnet50_b64.prototxt'), caffeplus.TRAIN)
    assert [l.type for l in net.layers] == [l.type for l in kept.layers]
    with pytest.raises(SystemExit, match='no prototxt'):
        bench_gpu.net_source(bench, 'lenet_b64')


def test_only_alexnet_gets_a_bvlc_form_pytorch_peer():
    assert bench_gpu.torch_plans('alexnet_b128', 'torchvision,bvlc', 'fp16') == \
        ['-', '-/amp-fp16', 'bvlc', 'bvlc/amp-fp16']
    assert bench_gpu.torch_plans('resnet50_b64', 'torchvision,bvlc', 'fp16,bf16') == \
        ['-', '-/amp-fp16', '-/amp-bf16']
    assert bench_gpu.torch_plans('alexnettv_b128', 'torchvision,bvlc', '') == ['-']
    assert bench_gpu.torch_plans('alexnet_b128', 'torchvision,bvlc', 'fp16', plain=False) == \
        ['-/amp-fp16', 'bvlc/amp-fp16']
