"""The like-for-like bench net for PyTorch's AlexNet (benchmarks/nets/)."""
import os

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
