"""The model zoo (../shared/zoo): BVLC's examples and models in their 2014 (V0),
2015 (V1) and current (V2) forms, and Kaiming He's ResNets.

- every net and solver prototxt parses and upgrades;
- the V0, V1 and V2 versions of one BVLC model upgrade to the same net, up to
  differences that are in the original files themselves (listed per pair);
- every net builds as a caffeplus.Net in TRAIN and TEST phase with its data
  layers swapped for DummyData (caffeplus.io.dummy, batch 2), and its layer
  list, top shapes and parameter shapes are those stock Caffe builds: the
  shapes are recomputed here independently with Caffe's rules, and LeNet is
  compared line by line with the "Top shape" lines of stock Caffe's log.
"""
import fnmatch
import glob
import math
import os

import numpy
import pytest

import caffeplus
from caffeplus.errors import FormatError
from caffeplus.io import dummy, prototxt, upgrade
from caffeplus.netstate import filter_net
from caffeplus.proto import caffe_pb2
from conftest import REFERENCE, ZOO, need
from python_layer_sources import PYLOSS


def _zoo_files():
    files = sorted(os.path.relpath(p, ZOO)
                   for p in glob.glob(os.path.join(ZOO, '**', '*.prototxt'), recursive=True))
    solvers = [f for f in files if 'solver' in os.path.basename(f)]
    nets = [f for f in files if f not in solvers]
    return nets, solvers


NETS, SOLVERS = _zoo_files()

# Not a Caffe file: `stepearly` (lr policy and field) never was in BVLC Caffe's
# schema; stock Caffe fails on it the same way ("Message type
# caffe.SolverParameter has no field named stepearly", line 18).
NOT_CAFFE = {'bvlc_caffe_v1_2015/examples/mnist/lenet_stepearly_solver.prototxt':
             ('stepearly', 18)}


def zoo(rel):
    return need(os.path.join(ZOO, rel))


def read_net(rel):
    return prototxt.read_net_param(zoo(rel))


# ---------------------------------------------------------------------------
# Everything parses and upgrades

@pytest.mark.parametrize('rel', NETS)
def test_net_parses_and_upgrades(rel):
    param = read_net(rel)
    assert len(param.layers) == 0 and len(param.input) == 0
    assert not upgrade.net_needs_v0_upgrade(param)
    assert not upgrade.net_needs_data_upgrade(param)
    assert len(param.layer) > 0
    for lp in param.layer:
        assert lp.type, lp.name
    # The text Caffe's upgrade tool would write reads back as the same net.
    again = prototxt.parse_text(upgrade.message_to_text(param), caffe_pb2.NetParameter())
    assert again == param


def _solver_root(rel):
    # bvlc_caffe/ and bvlc_caffe_v1_2015/ are laid out as a Caffe root; the
    # 2014 solvers name their nets relative to their own folder.
    top = rel.split(os.sep)[0]
    return os.path.join(ZOO, top), os.path.join(ZOO, os.path.dirname(rel))


@pytest.mark.parametrize('rel', [s for s in SOLVERS if s not in NOT_CAFFE])
def test_solver_parses_and_upgrades(rel):
    param = prototxt.read_solver_param(zoo(rel))
    assert not param.HasField('solver_type')
    assert param.type in ('SGD', 'Nesterov', 'AdaGrad', 'RMSProp', 'AdaDelta', 'Adam')
    inline = [param.net_param] if param.HasField('net_param') else []
    inline += [param.train_net_param] if param.HasField('train_net_param') else []
    inline += list(param.test_net_param)
    for net_param in inline:
        upgrade.upgrade_net_as_needed(net_param, rel)
        assert len(net_param.layer) > 0 and not net_param.layers
    # Net files named by the solver: those in the zoo parse and upgrade too.
    names = ([param.net] if param.net else []) + ([param.train_net] if param.train_net else []) \
        + list(param.test_net)
    for name in names:
        for base in _solver_root(rel):
            path = os.path.join(base, name)
            if os.path.exists(path):
                assert len(prototxt.read_net_param(path).layer) > 0


def test_solvers_with_legacy_solver_type_get_the_type_string():
    for rel, want in [('bvlc_caffe_v1_2015/examples/mnist/mnist_autoencoder_solver_nesterov'
                       '.prototxt', 'Nesterov'),
                      ('bvlc_caffe_v1_2015/examples/mnist/mnist_autoencoder_solver_adagrad'
                       '.prototxt', 'AdaGrad')]:
        with open(zoo(rel)) as f:
            assert 'solver_type' in f.read()
        assert prototxt.read_solver_param(zoo(rel)).type == want


@pytest.mark.parametrize('rel', sorted(NOT_CAFFE))
def test_file_stock_caffe_cannot_read_either(rel):
    field, line = NOT_CAFFE[rel]
    with pytest.raises(FormatError) as err:
        prototxt.read_solver_param(zoo(rel))
    assert '%s:%d:' % (zoo(rel), line) in str(err.value)
    assert field in str(err.value)


def test_zoo_is_complete():
    if not NETS:
        pytest.skip('zoo not found: %s' % ZOO)
    tops = {n.split(os.sep)[0] for n in NETS}
    assert tops == {'bvlc_caffe', 'bvlc_caffe_v0_2014', 'bvlc_caffe_v1_2015', 'resnet_kaiminghe'}
    assert len(NETS) >= 60 and len(SOLVERS) >= 40


# ---------------------------------------------------------------------------
# One model, three format versions: the same net

def _flat(msg, prefix=''):
    out = {}
    for field, value in msg.ListFields():
        repeated = field.label == field.LABEL_REPEATED if not hasattr(field, 'is_repeated') \
            else field.is_repeated
        if field.cpp_type == field.CPPTYPE_MESSAGE:
            items = list(enumerate(value)) if repeated else [(None, value)]
            for i, item in items:
                name = field.name if i is None else '%s[%d]' % (field.name, i)
                out.update(_flat(item, prefix + name + '.'))
        else:
            out[prefix + field.name] = list(value) if repeated else value
    return out


def net_diffs(a, b):
    """Differences between two nets, layer by layer in order, as strings
    'nameA|nameB: field: valueA vs valueB' (and 'net field: ...',
    'layer count: ...')."""
    out = []
    if len(a.layer) != len(b.layer):
        out.append('layer count: %d vs %d' % (len(a.layer), len(b.layer)))
    for x, y in zip(a.layer, b.layer):
        fx, fy = _flat(x), _flat(y)
        for key in sorted(set(fx) | set(fy)):
            if fx.get(key) != fy.get(key):
                out.append('%s|%s: %s: %r vs %r' % (x.name, y.name, key, fx.get(key), fy.get(key)))
    na = {k: v for k, v in _flat(a).items() if not k.startswith('layer[')}
    nb = {k: v for k, v in _flat(b).items() if not k.startswith('layer[')}
    for key in sorted(set(na) | set(nb)):
        if na.get(key) != nb.get(key):
            out.append('net %s: %r vs %r' % (key, na.get(key), nb.get(key)))
    return out


def phase_net(rel, phase):
    """The upgraded net as `phase` sees it, without the include/exclude rules
    that select it (a 2014 net is a single phase's file, the later ones
    hold both phases)."""
    param = read_net(rel)
    if phase is None:
        return param
    param.state.phase = phase
    param = filter_net(param)
    param.ClearField('state')
    for lp in param.layer:
        lp.ClearField('include')
        lp.ClearField('exclude')
    return param


def assert_same_net(a, b, known):
    """Every difference is explained by one of `known` ({pattern: reason}),
    and every listed reason is still needed."""
    diffs = net_diffs(a, b)
    unexplained = [d for d in diffs if not any(fnmatch.fnmatchcase(d, p) for p in known)]
    assert unexplained == [], unexplained
    unused = [p for p in known if not any(fnmatch.fnmatchcase(d, p) for d in diffs)]
    assert unused == [], unused


V0 = 'bvlc_caffe_v0_2014/examples/'
V1 = 'bvlc_caffe_v1_2015/'
V2 = 'bvlc_caffe/'
TRAIN, TEST = caffe_pb2.TRAIN, caffe_pb2.TEST

# Differences that are in the files themselves, by kind.
INPUT_NAMED_DATA = {'input|data: name: *': "V2 deploy files name their Input layer 'data'; "
                                           "Caffe's input-field upgrade names it 'input'"}
LMDB = {'*: data_param.backend: None vs 1': 'the 2015 files read LMDB, 2014 LevelDB',
        '*: data_param.source: *': 'database paths changed'}
MEAN = {'*: transform_param.mean_file: *': 'mean file paths changed'}
DB_MOVED = dict(LMDB, **MEAN)
LOSS_TOP = {'loss|loss: top: None vs *': "the 2015 files name the loss layer's top"}
V0_TEST_TAIL = {'prob|accuracy: *': "2014 test nets end Softmax 'prob' -> Accuracy; 2015 ones "
                                    "Accuracy and SoftmaxWithLoss on the scores",
                'accuracy|loss: *': 'same'}
CAFFE_NET_LEARNING = {'*: *_filler.*': '2014 deploy/val files carried fillers, 2015 ones not',
                      '*: param[[]*': '... and lr/decay multipliers'}

EQUIVALENT = [
    # (first, second, phase or None, known differences)
    (V0 + 'lenet/lenet.prototxt', V1 + 'examples/mnist/lenet.prototxt', None, {}),
    (V1 + 'examples/mnist/lenet.prototxt', V2 + 'examples/mnist/lenet.prototxt', None,
     INPUT_NAMED_DATA),
    (V0 + 'lenet/lenet_train.prototxt', V1 + 'examples/mnist/lenet_train_test.prototxt', TRAIN,
     dict(LMDB, **LOSS_TOP)),
    (V0 + 'lenet/lenet_test.prototxt', V1 + 'examples/mnist/lenet_train_test.prototxt', TEST,
     dict(LMDB, **V0_TEST_TAIL,
          **{'*: param[[]*].lr_mult: None vs *': 'the 2014 test net had no blobs_lr',
             'net name: *': "the 2014 test net is named 'LeNet-test'"})),
    (V1 + 'examples/mnist/lenet_train_test.prototxt',
     V2 + 'examples/mnist/lenet_train_test.prototxt', None, {}),
    (V0 + 'cifar10/cifar10_quick.prototxt', V1 + 'examples/cifar10/cifar10_quick.prototxt',
     None, {}),
    (V1 + 'examples/cifar10/cifar10_quick.prototxt', V2 + 'examples/cifar10/cifar10_quick.prototxt',
     None, INPUT_NAMED_DATA),
    (V0 + 'cifar10/cifar10_quick_train.prototxt',
     V1 + 'examples/cifar10/cifar10_quick_train_test.prototxt', TRAIN,
     dict(DB_MOVED, **LOSS_TOP, **{'net name: *': 'CIFAR10_quick_train vs CIFAR10_quick'})),
    (V0 + 'cifar10/cifar10_quick_test.prototxt',
     V1 + 'examples/cifar10/cifar10_quick_train_test.prototxt', TEST,
     dict(DB_MOVED, **V0_TEST_TAIL, **{'net name: *': 'CIFAR10_quick_test vs CIFAR10_quick'})),
    (V1 + 'examples/cifar10/cifar10_quick_train_test.prototxt',
     V2 + 'examples/cifar10/cifar10_quick_train_test.prototxt', None, {}),
    (V0 + 'cifar10/cifar10_full.prototxt', V1 + 'examples/cifar10/cifar10_full.prototxt', None,
     {'norm*|norm*: lrn_param.norm_region: None vs 1':
      'V0 had no norm_region: the 2014 cifar10_full normalised across channels, the 2015 one '
      'WITHIN_CHANNEL (a different net, in the files)'}),
    (V1 + 'examples/cifar10/cifar10_full.prototxt', V2 + 'examples/cifar10/cifar10_full.prototxt',
     None, INPUT_NAMED_DATA),
    (V0 + 'cifar10/cifar10_full_train.prototxt',
     V1 + 'examples/cifar10/cifar10_full_train_test.prototxt', TRAIN,
     dict(DB_MOVED, **LOSS_TOP, **{'norm*|norm*: lrn_param.norm_region: None vs 1': 'see above',
                                   'net name: *': 'CIFAR10_full_train vs CIFAR10_full'})),
    (V0 + 'cifar10/cifar10_full_test.prototxt',
     V1 + 'examples/cifar10/cifar10_full_train_test.prototxt', TEST,
     dict(DB_MOVED, **V0_TEST_TAIL,
          **{'norm*|norm*: lrn_param.norm_region: None vs 1': 'see above',
             'net name: *': 'CIFAR10_full_test vs CIFAR10_full'})),
    (V1 + 'examples/cifar10/cifar10_full_train_test.prototxt',
     V2 + 'examples/cifar10/cifar10_full_train_test.prototxt', None, {}),
    (V0 + 'imagenet/imagenet_deploy.prototxt',
     V1 + 'models/bvlc_reference_caffenet/deploy.prototxt',
     None, CAFFE_NET_LEARNING),
    (V1 + 'models/bvlc_reference_caffenet/deploy.prototxt',
     V2 + 'models/bvlc_reference_caffenet/deploy.prototxt', None, INPUT_NAMED_DATA),
    (V0 + 'imagenet/imagenet_train.prototxt',
     V1 + 'models/bvlc_reference_caffenet/train_val.prototxt',
     TRAIN, dict(DB_MOVED, **LOSS_TOP)),
    (V0 + 'imagenet/imagenet_val.prototxt',
     V1 + 'models/bvlc_reference_caffenet/train_val.prototxt',
     TEST, dict(DB_MOVED, **V0_TEST_TAIL, **{k: v for k, v in CAFFE_NET_LEARNING.items()})),
    (V1 + 'models/bvlc_reference_caffenet/train_val.prototxt',
     V2 + 'models/bvlc_reference_caffenet/train_val.prototxt', None, {}),
    (V0 + 'feature_extraction/imagenet_val.prototxt',
     V1 + 'examples/feature_extraction/imagenet_val.prototxt', None,
     dict({'layer count: 25 vs 26': "the 2015 file adds a SoftmaxWithLoss 'loss' at the end",
           '*: image_data_param.source: *': '$CAFFE_DIR/ prefix dropped',
           '*: transform_param.mean_file: *': '$CAFFE_DIR/ prefix dropped'})),
    (V1 + 'examples/feature_extraction/imagenet_val.prototxt',
     V2 + 'examples/feature_extraction/imagenet_val.prototxt', None, {}),
    (V0 + 'pascal-finetuning/pascal_finetune_train.prototxt',
     V1 + 'examples/finetune_pascal_detection/pascal_finetune_trainval_test.prototxt', TRAIN,
     {'*: window_data_param.source: *': 'window file paths changed',
      '*: transform_param.mean_file: *': 'mean file paths changed'}),
    (V0 + 'pascal-finetuning/pascal_finetune_val.prototxt',
     V1 + 'examples/finetune_pascal_detection/pascal_finetune_trainval_test.prototxt', TEST,
     {'*: window_data_param.source: *': 'window file paths changed',
      '*: transform_param.mean_file: *': 'mean file paths changed',
      'prob|loss: *': "2014 val net: Softmax 'prob' then Accuracy on it; 2015: "
                      "SoftmaxWithLoss and Accuracy on the scores",
      'accuracy|accuracy: bottom: *': 'same'}),
    (V1 + 'examples/finetune_pascal_detection/pascal_finetune_trainval_test.prototxt',
     V2 + 'examples/finetune_pascal_detection/pascal_finetune_trainval_test.prototxt', None, {}),
    (V1 + 'examples/hdf5_classification/train_val.prototxt',
     V2 + 'examples/hdf5_classification/train_val.prototxt', None,
     {'fc1|fc1: inner_product_param.weight_filler.*': 'fc1: gaussian std 0.01 (2015), xavier '
                                                      '(now)'}),
    (V1 + 'examples/imagenet/bvlc_caffenet_full_conv.prototxt',
     V2 + 'examples/net_surgery/bvlc_caffenet_full_conv.prototxt', None, INPUT_NAMED_DATA),
    (V1 + 'examples/mnist/mnist_autoencoder.prototxt',
     V2 + 'examples/mnist/mnist_autoencoder.prototxt', None, {}),
    (V1 + 'examples/siamese/mnist_siamese.prototxt', V2 + 'examples/siamese/mnist_siamese.prototxt',
     None, INPUT_NAMED_DATA),
    (V1 + 'examples/siamese/mnist_siamese_train_test.prototxt',
     V2 + 'examples/siamese/mnist_siamese_train_test.prototxt', None, {}),
    (V1 + 'models/bvlc_alexnet/deploy.prototxt', V2 + 'models/bvlc_alexnet/deploy.prototxt', None,
     INPUT_NAMED_DATA),
    (V1 + 'models/bvlc_alexnet/train_val.prototxt', V2 + 'models/bvlc_alexnet/train_val.prototxt',
     None, {}),
    (V1 + 'models/bvlc_googlenet/deploy.prototxt', V2 + 'models/bvlc_googlenet/deploy.prototxt',
     None, INPUT_NAMED_DATA),
    (V1 + 'models/bvlc_googlenet/train_val.prototxt',
     V2 + 'models/bvlc_googlenet/train_val.prototxt',
     None, {'*: *.weight_filler.std: * vs None': 'the 2015 file gave xavier fillers a std '
                                                 '(which xavier ignores)',
            'loss2/loss|loss2/loss: top: *': "top 'loss2/loss1' renamed 'loss2/loss2'"}),
    (V1 + 'models/bvlc_reference_rcnn_ilsvrc13/deploy.prototxt',
     V2 + 'models/bvlc_reference_rcnn_ilsvrc13/deploy.prototxt', None, INPUT_NAMED_DATA),
    (V1 + 'models/finetune_flickr_style/deploy.prototxt',
     V2 + 'models/finetune_flickr_style/deploy.prototxt', None, INPUT_NAMED_DATA),
    (V1 + 'models/finetune_flickr_style/train_val.prototxt',
     V2 + 'models/finetune_flickr_style/train_val.prototxt', None,
     {'loss|accuracy: *': "the last two layers ('loss', 'accuracy') swapped places",
      'accuracy|loss: *': 'same'}),
]


@pytest.mark.parametrize('first,second,phase,known', EQUIVALENT,
                         ids=['%s~%s%s' % (a.split('/')[0][-4:], b.replace('/', '.'),
                                           {None: '', TRAIN: '@TRAIN', TEST: '@TEST'}[p])
                              for a, b, p, _ in EQUIVALENT])
def test_versions_of_one_model_upgrade_to_the_same_net(first, second, phase, known):
    assert_same_net(phase_net(first, phase), phase_net(second, phase), known)


def test_every_v1_file_has_a_counterpart_checked():
    """Each V1 net with a V2 counterpart of the same path is compared above."""
    compared = {(a, b) for a, b, _, _ in EQUIVALENT}
    for rel in NETS:
        if rel.startswith(V1):
            twin = V2 + rel[len(V1):]
            if twin in NETS:
                assert (rel, twin) in compared, rel


# ---------------------------------------------------------------------------
# Building every net, with shapes computed here by Caffe's rules

# HDF5 inputs cannot be guessed from a source path: the BVLC example's
# features are 4 numbers per sample.
EXPLICIT_SHAPES = {'examples/hdf5_classification/': {'data': (2, 4)}}
# Nets whose TEST phase needs a stage to have any data layer (as their solvers say).
STAGES = {'examples/mnist/mnist_autoencoder.prototxt': (('test-on-train',), ('test-on-test',))}
NEEDS_PYTHON_LAYER = {'bvlc_caffe/examples/pycaffe/linreg.prototxt'}
BATCH = 2


def _build_cases():
    cases = []
    for rel in NETS:
        tail = rel.split('/', 1)[1]
        stages = STAGES.get(tail)
        cases.append((rel, 'TRAIN', ()))
        for stage in (stages or ((),)):
            cases.append((rel, 'TEST', stage))
    return cases


BUILD_CASES = _build_cases()


class _ZeroGenerator:
    """Stands in for the random stream while building: fillers of the big
    ImageNet nets (60M parameters, dozens of nets) would take minutes on two
    slow cores, and their values are not under test here (layer tests check
    fillers); everything else passes through."""

    def __init__(self, real):
        self._real = real

    def _zeros(self, size):
        return numpy.zeros(() if size is None else size, dtype=numpy.float32)

    def normal(self, loc=0.0, scale=1.0, size=None):
        assert scale >= 0
        return self._zeros(size)

    def uniform(self, low=0.0, high=1.0, size=None):
        assert high >= low
        return self._zeros(size)

    def random(self, size=None, *args, **kwargs):
        return self._zeros(size)

    def __getattr__(self, name):
        return getattr(self._real, name)


@pytest.fixture
def cheap_fillers(monkeypatch):
    from caffeplus import rng
    monkeypatch.setitem(rng._gen, 'rng', _ZeroGenerator(rng.get()))


def build_param(rel):
    param = read_net(rel)
    shapes = next((s for key, s in EXPLICIT_SHAPES.items() if key in rel), None)
    param = dummy.swap_data_layers(param, shapes=shapes, batch_size=BATCH)
    for lp in param.layer:
        if lp.type == 'Input':
            for shape in lp.input_param.shape:
                shape.dim[0] = BATCH
    return param


def _conv_geometry(p, spatial):
    def pick(rep, h, w, default):
        if h is not None:
            return [h, w]
        vals = list(rep) or [default]
        return [vals[0]] * spatial if len(vals) == 1 else vals
    kernel = pick(p.kernel_size, p.kernel_h if p.HasField('kernel_h') else None, p.kernel_w, None)
    pad = pick(p.pad, p.pad_h if p.HasField('pad_h') else None, p.pad_w, 0)
    stride = pick(p.stride, p.stride_h if p.HasField('stride_h') else None, p.stride_w, 1)
    dilation = list(p.dilation) or [1]
    dilation = dilation * spatial if len(dilation) == 1 else dilation
    return kernel, pad, stride, dilation


def expected_shapes(lp, bottoms):
    """(top shapes, param shapes) of layer `lp` by stock Caffe's rules."""
    t = lp.type
    if t == 'Input':
        shapes = [tuple(s.dim) for s in lp.input_param.shape]
        return (shapes * len(lp.top) if len(shapes) == 1 else shapes), []
    if t == 'DummyData':
        shapes = [tuple(s.dim) for s in lp.dummy_data_param.shape]
        return (shapes * len(lp.top) if len(shapes) == 1 else shapes), []
    b = bottoms[0] if bottoms else None
    if t == 'Convolution':
        p = lp.convolution_param
        n, c, spatial = b[0], b[1], b[2:]
        kernel, pad, stride, dil = _conv_geometry(p, len(spatial))
        out = tuple((s + 2 * pd - (d * (k - 1) + 1)) // st + 1
                    for s, k, pd, st, d in zip(spatial, kernel, pad, stride, dil))
        params = [(p.num_output, c // p.group) + tuple(kernel)]
        if p.bias_term:
            params.append((p.num_output,))
        return [(n, p.num_output) + out], params
    if t == 'Pooling':
        p = lp.pooling_param
        n, c, h, w = b
        if p.global_pooling:
            return [(n, c, 1, 1)], []
        kh, kw = (p.kernel_h, p.kernel_w) if p.HasField('kernel_h') else (p.kernel_size,) * 2
        ph, pw = (p.pad_h, p.pad_w) if p.HasField('pad_h') else (p.pad,) * 2
        sh, sw = (p.stride_h, p.stride_w) if p.HasField('stride_h') else (p.stride,) * 2
        rnd = math.ceil if p.round_mode == caffe_pb2.PoolingParameter.CEIL else math.floor

        def size(x, k, pd, s):
            o = int(rnd((x + 2 * pd - k) / float(s))) + 1
            if pd and (o - 1) * s >= x + pd:
                o -= 1
            return o
        return [(n, c, size(h, kh, ph, sh), size(w, kw, pw, sw))], []
    if t == 'InnerProduct':
        p = lp.inner_product_param
        axis = p.axis % len(b)
        k = int(numpy.prod(b[axis:]))
        params = [(k, p.num_output) if p.transpose else (p.num_output, k)]
        if p.bias_term:
            params.append((p.num_output,))
        return [tuple(b[:axis]) + (p.num_output,)], params
    if t in ('ReLU', 'Sigmoid', 'TanH', 'Dropout', 'LRN', 'Softmax', 'Power', 'AbsVal',
             'BNLL', 'Eltwise'):
        return [b], []
    if t == 'BatchNorm':
        return [b], [(b[1],), (b[1],), (1,)]
    if t == 'Scale':
        p = lp.scale_param
        axis = p.axis % len(b)
        shape = tuple(b[axis:]) if p.num_axes == -1 else tuple(b[axis:axis + p.num_axes])
        params = [shape] if len(bottoms) == 1 else []
        if p.bias_term:
            params.append(shape)
        return [b], params
    if t == 'Concat':
        p = lp.concat_param
        axis = p.concat_dim if p.HasField('concat_dim') else p.axis
        axis %= len(b)
        total = sum(x[axis] for x in bottoms)
        return [b[:axis] + (total,) + b[axis + 1:]], []
    if t == 'Slice':
        p = lp.slice_param
        axis = (p.slice_dim if p.HasField('slice_dim') else p.axis) % len(b)
        points = list(p.slice_point)
        if points:
            bounds = [0] + points + [b[axis]]
            sizes = [hi - lo for lo, hi in zip(bounds, bounds[1:])]
        else:
            sizes = [b[axis] // len(lp.top)] * len(lp.top)
        return [b[:axis] + (s,) + b[axis + 1:] for s in sizes], []
    if t == 'Flatten':
        p = lp.flatten_param
        start, end = p.axis % len(b), p.end_axis % len(b)
        return [b[:start] + (int(numpy.prod(b[start:end + 1])),) + b[end + 1:]], []
    if t == 'Split':
        return [b] * len(lp.top), []
    if t == 'Accuracy':
        p = lp.accuracy_param
        tops = [()]
        if len(lp.top) > 1:
            tops.append((b[p.axis % len(b)],))
        return tops, []
    if t in ('SoftmaxWithLoss', 'EuclideanLoss', 'SigmoidCrossEntropyLoss', 'ContrastiveLoss',
             'HingeLoss', 'InfogainLoss', 'MultinomialLogisticLoss'):
        tops = [()]
        if len(lp.top) > 1:   # SoftmaxWithLoss's optional probabilities
            tops.append(b)
        return tops, []
    if t == 'Silence':
        return [], []
    if t == 'Python' and lp.python_param.layer == 'EuclideanLossLayer':
        return [(1,)], []   # PYLOSS: top[0].reshape(1)
    raise AssertionError('no shape rule for layer type %s in this test' % t)


def check_built_net(net, param, phase, stages):
    """The caffeplus net has Caffe's layers (plus Caffe's Split layers) and
    every top and parameter blob has the shape Caffe would give it."""
    state = caffe_pb2.NetParameter()
    state.CopyFrom(param)
    state.state.phase = phase
    del state.state.stage[:]
    state.state.stage.extend(stages)
    filtered = filter_net(state)
    built = [(lp.name, lp.type) for lp in (l.layer_param for l in net.layers)]
    assert [x for x in built if x[1] != 'Split'] == [(lp.name, lp.type) for lp in filtered.layer]
    # Caffe splits a blob that more than one bottom reads (each version of a
    # blob counts apart: an in-place layer makes a new version), naming the
    # Split layer <blob>_<producing layer>_<top index>_split.
    producer, reads = {}, {}
    for lp in filtered.layer:
        for name in lp.bottom:
            reads[producer[name]] = reads.get(producer[name], 0) + 1
        for index, name in enumerate(lp.top):
            producer[name] = (name, lp.name, index)
    want_splits = sorted('%s_%s_%d_split' % key for key, n in reads.items() if n > 1)
    assert sorted(name for name, kind in built if kind == 'Split') == want_splits
    shapes = {}
    for layer, tops in zip(net.layers, net.top_vecs):
        lp = layer.layer_param
        bottoms = [shapes[name] for name in lp.bottom]
        want_tops, want_params = expected_shapes(lp, bottoms)
        got_tops = [tuple(top.shape) for top in tops]
        assert got_tops == [tuple(s) for s in want_tops], (lp.name, got_tops, want_tops)
        got_params = [tuple(blob.shape) for blob in layer.blobs]
        assert got_params == [tuple(s) for s in want_params], (lp.name, got_params, want_params)
        for name, shape in zip(lp.top, got_tops):
            shapes[name] = shape


@pytest.mark.parametrize('rel,phase,stages', BUILD_CASES,
                         ids=['%s@%s%s' % (r, p, ''.join('+' + s for s in st))
                              for r, p, st in BUILD_CASES])
def test_net_builds_with_caffes_shapes(rel, phase, stages, cheap_fillers, tmp_path,
                                       monkeypatch):
    if rel in NEEDS_PYTHON_LAYER:
        if 'Python' not in caffeplus.layer_type_list():
            pytest.skip('the Python layer type is not registered yet')
        (tmp_path / 'pyloss.py').write_text(PYLOSS)
        monkeypatch.syspath_prepend(str(tmp_path))
    param = build_param(rel)
    net = caffeplus.Net(param, getattr(caffeplus, phase), stages=list(stages))
    check_built_net(net, param, getattr(caffe_pb2, phase), stages)


def test_inline_nets_of_the_consolidated_solver_build(cheap_fillers):
    for version in (V1, V2):
        solver = prototxt.read_solver_param(zoo(version + 'examples/mnist/lenet_consolidated_'
                                                          'solver.prototxt'))
        param = dummy.swap_data_layers(solver.net_param, batch_size=BATCH)
        cases = [(caffe_pb2.TRAIN, ())] + [(caffe_pb2.TEST, tuple(s.stage))
                                           for s in solver.test_state]
        assert len(cases) == 3
        for phase, stages in cases:
            net = caffeplus.Net(param, phase, stages=list(stages))
            check_built_net(net, param, phase, stages)


# Key shapes written out by hand, as a check on the rules above.
KEY_SHAPES = [
    (V2 + 'examples/mnist/lenet_train_test.prototxt', 'TRAIN',
     {'conv1': (2, 20, 24, 24), 'pool2': (2, 50, 4, 4), 'ip1': (2, 500), 'loss': ()},
     {'conv1': [(20, 1, 5, 5), (20,)], 'ip1': [(500, 800), (500,)], 'ip2': [(10, 500), (10,)]}),
    (V2 + 'examples/cifar10/cifar10_quick_train_test.prototxt', 'TEST',
     {'conv1': (2, 32, 32, 32), 'pool1': (2, 32, 16, 16), 'pool3': (2, 64, 4, 4), 'ip1': (2, 64),
      'accuracy': ()},
     {'conv1': [(32, 3, 5, 5), (32,)], 'ip1': [(64, 1024), (64,)]}),
    (V0 + 'cifar10/cifar10_full_train.prototxt', 'TRAIN',
     {'pool1': (2, 32, 16, 16), 'pool3': (2, 64, 4, 4), 'ip1': (2, 10)},
     {'conv3': [(64, 32, 5, 5), (64,)], 'ip1': [(10, 1024), (10,)]}),
    (V1 + 'models/bvlc_alexnet/train_val.prototxt', 'TRAIN',
     {'conv1': (2, 96, 55, 55), 'pool1': (2, 96, 27, 27), 'conv2': (2, 256, 27, 27),
      'pool5': (2, 256, 6, 6), 'fc6': (2, 4096), 'fc8': (2, 1000)},
     {'conv2': [(256, 48, 5, 5), (256,)], 'fc6': [(4096, 9216), (4096,)]}),
    (V0 + 'imagenet/imagenet_deploy.prototxt', 'TEST',
     {'conv1': (2, 96, 55, 55), 'pool2': (2, 256, 13, 13), 'conv4': (2, 384, 13, 13),
      'prob': (2, 1000)},
     {'conv4': [(384, 192, 3, 3), (384,)], 'fc7': [(4096, 4096), (4096,)]}),
    (V0 + 'pascal-finetuning/pascal_finetune_train.prototxt', 'TRAIN',
     {'fc8_pascal': (2, 21)}, {'fc8_pascal': [(21, 4096), (21,)]}),
    ('resnet_kaiminghe/prototxt/ResNet-50-deploy.prototxt', 'TEST',
     {'conv1': (2, 64, 112, 112), 'pool1': (2, 64, 56, 56), 'res2a': (2, 256, 56, 56),
      'res5c': (2, 2048, 7, 7), 'pool5': (2, 2048, 1, 1), 'fc1000': (2, 1000)},
     {'bn_conv1': [(64,), (64,), (1,)], 'scale_conv1': [(64,), (64,)],
      'res2a_branch1': [(256, 64, 1, 1)], 'fc1000': [(1000, 2048), (1000,)]}),
    (V2 + 'models/bvlc_googlenet/train_val.prototxt', 'TEST',
     {'conv1/7x7_s2': (2, 64, 112, 112), 'inception_3a/output': (2, 256, 28, 28),
      'inception_5b/output': (2, 1024, 7, 7), 'loss3/classifier': (2, 1000)},
     {'inception_3a/5x5': [(32, 16, 5, 5), (32,)]}),
]


@pytest.mark.parametrize('rel,phase,tops,params', KEY_SHAPES, ids=[k[0] for k in KEY_SHAPES])
def test_key_shapes(rel, phase, tops, params, cheap_fillers):
    net = caffeplus.Net(build_param(rel), getattr(caffeplus, phase))
    for name, shape in tops.items():
        assert tuple(net.blobs[name].shape) == shape, name
    layers = net.layer_dict
    for name, shapes in params.items():
        assert [tuple(b.shape) for b in layers[name].blobs] == shapes, name


# ---------------------------------------------------------------------------
# LeNet against stock Caffe's own log

def _caffe_nets_from_log(path):
    """[(layer name, [top shape string, ...]), ...] for each net the log builds."""
    nets, current, layer = [], None, None
    with open(path) as f:
        for line in f:
            msg = line.split('] ', 1)[-1].rstrip('\n')
            if msg.startswith('Initializing net from parameters'):
                current = []
                nets.append(current)
            elif msg.startswith('Setting up ') and current is not None:
                layer = (msg[len('Setting up '):], [])
                current.append(layer)
            elif msg.startswith('Top shape: ') and layer is not None:
                layer[1].append(msg[len('Top shape: '):])
            elif msg.startswith('Network initialization done'):
                current, layer = None, None
    return nets


def test_lenet_top_shapes_match_stock_caffe_log(cheap_fillers):
    log_path = need(os.path.join(REFERENCE, 'training', 'sgd', 'train.log'))
    proto = need(os.path.join(REFERENCE, 'training', 'lenet_train_test.prototxt'))
    caffe_train, caffe_test = _caffe_nets_from_log(log_path)[:2]
    # Keep the prototxt's own batch sizes (64 TRAIN, 32 TEST), as Caffe ran it.
    param = dummy.swap_data_layers(prototxt.read_net_param(proto))
    for phase, expected in ((caffeplus.TRAIN, caffe_train), (caffeplus.TEST, caffe_test)):
        net = caffeplus.Net(param, phase)
        ours = [(name, [top.shape_string() for top in tops])
                for name, tops in zip(net._layer_names, net.top_vecs)]
        assert ours == expected
    assert [n for n, _ in caffe_test][:2] == ['mnist', 'label_mnist_1_split']


def test_swap_keeps_names_tops_and_rules():
    param = read_net(V2 + 'examples/mnist/lenet_train_test.prototxt')
    swapped = dummy.swap_data_layers(param, batch_size=3)
    data = [lp for lp in swapped.layer if lp.name == 'mnist']
    assert [lp.type for lp in data] == ['DummyData', 'DummyData']
    assert [lp.include[0].phase for lp in data] == [TRAIN, TEST]
    for lp in data:
        assert list(lp.top) == ['data', 'label']
        assert [tuple(s.dim) for s in lp.dummy_data_param.shape] == [(3, 1, 28, 28), (3,)]
        fill = lp.dummy_data_param.data_filler
        assert (fill[0].type, fill[0].std) == ('gaussian', 1.0)
        assert (fill[1].type, fill[1].value) == ('constant', 0.0)
    # Everything else is untouched, and the input is not modified.
    rest = [lp for lp in swapped.layer if lp.name != 'mnist']
    assert rest == [lp for lp in param.layer if lp.name != 'mnist']
    assert param.layer[0].type == 'Data'
    # Batch sizes of the layers themselves when none is given.
    own = dummy.swap_data_layers(param)
    assert [tuple(lp.dummy_data_param.shape[0].dim) for lp in own.layer[:2]] == \
        [(64, 1, 28, 28), (100, 1, 28, 28)]


def test_swap_shape_sources():
    v1 = prototxt.parse_text('''
      layers { name: "mem" type: MEMORY_DATA top: "m" top: "ml"
               memory_data_param { batch_size: 4 channels: 2 height: 5 width: 6 } }
      layers { name: "img" type: IMAGE_DATA top: "i" top: "il"
               image_data_param { source: "whatever.txt" batch_size: 3 new_height: 20
                                  new_width: 30 is_color: false } }
      layers { name: "win" type: WINDOW_DATA top: "w" top: "wl"
               transform_param { crop_size: 9 } window_data_param { source: "x" batch_size: 8 } }
      layers { name: "cif" type: DATA top: "c" top: "cl"
               data_param { source: "cifar10_train_lmdb" batch_size: 5 } }
      layers { name: "net" type: DATA top: "n" top: "nl"
               data_param { source: "ILSVRC2012_train" batch_size: 5 } }
      layers { name: "gray" type: DATA top: "g" transform_param { force_gray: true crop_size: 7 }
               data_param { source: "ilsvrc12" batch_size: 1 } }
      layers { name: "h5" type: HDF5_DATA top: "hd" top: "hl" top: "hw"
               hdf5_data_param { source: "list.txt" batch_size: 6 } }''',
                                 caffe_pb2.NetParameter())
    out = dummy.swap_data_layers(v1, shapes={'h5': (6, 10), 'hw': (6, 3)})
    got = {lp.name: [tuple(s.dim) for s in lp.dummy_data_param.shape] for lp in out.layer}
    assert got == {'mem': [(4, 2, 5, 6), (4,)], 'img': [(3, 1, 20, 30), (3,)],
                   'win': [(8, 3, 9, 9), (8,)], 'cif': [(5, 3, 32, 32), (5,)],
                   'net': [(5, 3, 256, 256), (5,)], 'gray': [(1, 1, 7, 7)],
                   'h5': [(6, 10), (6,), (6, 3)]}
    assert all(lp.type == 'DummyData' for lp in out.layer)
    with pytest.raises(FormatError, match="'h5'.*shapes="):
        dummy.swap_data_layers(v1)
    with pytest.raises(FormatError, match="'net'.*batch_size"):
        param = caffe_pb2.NetParameter()
        param.layer.add(name='net', type='Data', top=['d']).data_param.source = 'mnist'
        dummy.swap_data_layers(param)


def test_swap_accepts_a_path_and_leaves_other_layers(tmp_path):
    path = tmp_path / 'n.prototxt'
    path.write_text('layer { name: "d" type: "Data" top: "x" top: "y" '
                    'data_param { source: "mnist_train_lmdb" batch_size: 2 } }\n'
                    'layer { name: "dd" type: "DummyData" top: "z" '
                    'dummy_data_param { shape { dim: 1 } } }\n')
    out = dummy.swap_data_layers(str(path), shapes={'x': (2, 1, 3, 3)})
    assert [tuple(s.dim) for s in out.layer[0].dummy_data_param.shape] == [(2, 1, 3, 3), (2,)]
    assert out.layer[1].dummy_data_param.shape[0].dim == [1]
