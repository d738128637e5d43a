"""Where caffeplus used to differ from stock Caffe 1.0 (issue 35, points 1,
3 and 8): the order of a net's outputs, Python layer modules that
`import caffe` run from the command line, Caffe's global flags on every
command, blobproto_to_array's dtype, the upgrade tool's name in the upgrade
notes, the missing mean file message, defaults in --help, and suggestions
for mistyped field and layer type names.
"""
import os
import re
import subprocess
import sys

import numpy
import pytest

import caffeplus
from caffeplus import cli
from caffeplus.io import dummy, prototxt
from caffeplus.netstate import filter_net
from caffeplus.proto import caffe_pb2
from conftest import REFERENCE, ROOT, ZOO, need
from test_cli_train import _copy_training, _messages, run_cli


def net_from_text(tmp_path, text, name='net.prototxt', phase=caffeplus.TEST):
    path = tmp_path / name
    path.write_text(text)
    return caffeplus.Net(str(path), phase)


def subprocess_env():
    env = dict(os.environ)
    env['PYTHONPATH'] = ROOT + os.pathsep + env.get('PYTHONPATH', '')
    env.setdefault('OPENBLAS_NUM_THREADS', '1')
    return env


# -- 1. the order of a net's outputs ----------------------------------------------------
# Made in the order loss, s, accuracy; stock Caffe's outputs are sorted by name.
THREE_OUTPUTS = '''
name: "three"
layer { name: "data" type: "Input" top: "x" top: "t"
        input_param { shape { dim: 4 dim: 3 } shape { dim: 4 } } }
layer { name: "ip" type: "InnerProduct" bottom: "x" top: "y"
        inner_product_param { num_output: 3 weight_filler { type: "gaussian" std: 1 } } }
layer { name: "loss" type: "SoftmaxWithLoss" bottom: "y" bottom: "t" top: "loss" }
layer { name: "side" type: "Power" bottom: "x" top: "s" }
layer { name: "Accuracy" type: "Accuracy" bottom: "y" bottom: "t" top: "Accuracy" }
'''


def unconsumed_tops_sorted(param):
    """Stock Caffe's rule, reimplemented from the prototxt alone: the tops no
    later layer reads, sorted by their bytes (a std::set<std::string>)."""
    available = {}
    for lp in param.layer:
        for name in lp.bottom:
            available.pop(name, None)
        for name in lp.top:
            available[name] = True
    return sorted(available, key=lambda n: n.encode('utf-8'))


def test_outputs_come_in_sorted_order(tmp_path, caplog_caffeplus):
    net = net_from_text(tmp_path, THREE_OUTPUTS)
    # byte order: upper case before lower case, as std::string compares
    assert net.outputs == ['Accuracy', 'loss', 's']
    assert [net._blob_names[i] for i in net._outputs] == net.outputs
    produced = [m.split()[-1] for m in caplog_caffeplus
                if m.startswith('This network produces output ')]
    assert produced == ['Accuracy', 'loss', 's']


def test_forward_and_backward_dicts_follow_the_output_order(tmp_path):
    net = net_from_text(tmp_path, THREE_OUTPUTS)
    x = numpy.random.RandomState(0).randn(4, 3).astype(numpy.float32)
    out = net.forward(x=x, t=numpy.array([0, 1, 2, 0], numpy.float32))
    assert list(out) == ['Accuracy', 'loss', 's']
    out = net.forward(blobs=['y', 's'])
    assert list(out) == ['Accuracy', 'loss', 's', 'y']
    assert list(net.backward(diffs=['y'])) == ['x', 't', 'y']


def test_classifier_reads_the_first_sorted_output(tmp_path):
    text = '''
    name: "clf"
    layer { name: "data" type: "Input" top: "data"
            input_param { shape { dim: 1 dim: 3 dim: 4 dim: 4 } } }
    layer { name: "zfeat" type: "InnerProduct" bottom: "data" top: "zfeat"
            inner_product_param { num_output: 2 weight_filler { type: "gaussian" std: 1 } } }
    layer { name: "prob" type: "InnerProduct" bottom: "data" top: "prob"
            inner_product_param { num_output: 5 weight_filler { type: "gaussian" std: 1 } } }
    '''
    (tmp_path / 'deploy.prototxt').write_text(text)
    base = caffeplus.Net(str(tmp_path / 'deploy.prototxt'), caffeplus.TEST)
    base.save(str(tmp_path / 'w.caffemodel'))
    clf = caffeplus.Classifier(str(tmp_path / 'deploy.prototxt'), str(tmp_path / 'w.caffemodel'),
                               image_dims=(4, 4))
    assert clf.outputs == ['prob', 'zfeat']
    assert list(clf.forward_all(blobs=['data'], data=numpy.zeros((3, 3, 4, 4)))) == \
        ['prob', 'zfeat', 'data']
    image = numpy.random.RandomState(1).rand(4, 4, 3).astype(numpy.float32)
    assert clf.predict([image], oversample=False).shape == (1, 5)


# Zoo nets whose outputs are made in another order than stock Caffe's.
ZOO_REORDERED = ['bvlc_caffe/examples/hdf5_classification/train_val.prototxt',
                 'bvlc_caffe/examples/hdf5_classification/nonlinear_train_val.prototxt',
                 'bvlc_caffe_v1_2015/examples/hdf5_classification/train_val2.prototxt']
ZOO_SAME = ['bvlc_caffe/examples/mnist/lenet_train_test.prototxt',
            'bvlc_caffe/examples/mnist/mnist_autoencoder.prototxt']


@pytest.mark.parametrize('rel', ZOO_REORDERED + ZOO_SAME)
def test_zoo_net_outputs_in_stock_order(rel):
    param = prototxt.read_net_param(need(os.path.join(ZOO, rel)))
    param = dummy.swap_data_layers(param, shapes={'data': (2, 4)} if 'hdf5' in rel else None,
                                   batch_size=2)
    param.state.phase = caffe_pb2.TEST
    if 'autoencoder' in rel:
        param.state.stage.append('test-on-test')
    expected = unconsumed_tops_sorted(filter_net(param))
    assert len(expected) >= 2
    net = caffeplus.Net(param)
    assert net.outputs == expected
    made = [name for name in net._blob_names if name in expected]
    assert (made != expected) == (rel in ZOO_REORDERED)


def test_test_net_outputs_numbered_as_stock_caffe(tmp_path):
    """LeNet with its loss layer before its accuracy layer: the test outputs
    keep stock Caffe's numbering (#0 accuracy, #1 loss; reference log)."""
    root = _copy_training(tmp_path)
    net_path = os.path.join(root, 'training', 'lenet_train_test.prototxt')
    text = open(net_path).read()
    accuracy = re.search(r'layer \{\s*name: "accuracy".*?\n\}\n', text, re.S).group(0)
    text = text.replace(accuracy, '') + accuracy
    open(net_path, 'w').write(text)
    solver = open(os.path.join(REFERENCE, 'cli', 'resume_sgd_solver.prototxt')).read()
    solver = re.sub(r'max_iter: \d+', 'max_iter: 1', solver)
    open(os.path.join(root, 'solver.prototxt'), 'w').write(solver)
    rc, cap = run_cli(root, 'train', '-solver', 'solver.prototxt')
    assert rc == 0
    stock = _messages(os.path.join(REFERENCE, 'cli', 'train_resume_sgd.log'))

    def test_outputs(messages):
        return [re.match(r'\s*Test net output (#\d+: \S+) =', m).group(1)
                for m in messages if 'Test net output #' in m]

    def produced(messages):
        return [m for m in messages if m.startswith('This network produces output')]
    assert test_outputs(stock)[:2] == ['#0: accuracy', '#1: loss']
    assert test_outputs(cap.messages)[:2] == test_outputs(stock)[:2]
    assert produced(cap.messages) == produced(stock)


# -- 3. Python layers written for Caffe, from the command line ---------------------------
# A layer module as model zoos write them: `import caffe`, caffe.Layer, caffe.TRAIN.
CAFFE_STYLE_LAYER = '''
import caffe
import numpy as np


class HalfSquareLoss(caffe.Layer):
    """0.5 * sum(x^2) / num, written against stock pycaffe's API."""

    def setup(self, bottom, top):
        self.in_train = self.phase == caffe.TRAIN

    def reshape(self, bottom, top):
        top[0].reshape(1)

    def forward(self, bottom, top):
        x = bottom[0].data
        top[0].data[...] = 0.5 * np.sum(x * x) / x.shape[0]

    def backward(self, top, propagate_down, bottom):
        if propagate_down[0]:
            bottom[0].diff[...] = top[0].diff[0] * bottom[0].data / bottom[0].data.shape[0]
'''

PY_LOSS_NET = '''
name: "pyloss"
layer { name: "data" type: "DummyData" top: "data"
        dummy_data_param { shape { dim: 4 dim: 5 } data_filler { type: "gaussian" std: 1 } } }
layer { name: "ip" type: "InnerProduct" bottom: "data" top: "ip"
        inner_product_param { num_output: 3 weight_filler { type: "gaussian" std: 0.1 } } }
layer { name: "loss" type: "Python" bottom: "ip" top: "loss" loss_weight: 1
        python_param { module: "%s" layer: "HalfSquareLoss" } }
'''

PY_SOLVER = '''
net: "net.prototxt"
base_lr: 0.1
lr_policy: "fixed"
display: 1
max_iter: 3
snapshot_after_train: false
solver_mode: CPU
random_seed: 1701
'''


def _write_caffe_style_layer(folder, module):
    layer_dir = folder / 'layers_dir'
    layer_dir.mkdir()
    (layer_dir / (module + '.py')).write_text(CAFFE_STYLE_LAYER)
    (folder / 'net.prototxt').write_text(PY_LOSS_NET % module)
    (folder / 'solver.prototxt').write_text(PY_SOLVER)
    return layer_dir


@pytest.mark.parametrize('command', [['train', '-solver', 'solver.prototxt'],
                                     ['time', '-model', 'net.prototxt', '-iterations', '2']])
def test_caffe_style_python_layer_runs_from_the_command_line(tmp_path, command):
    layer_dir = _write_caffe_style_layer(tmp_path, 'caffe_style_pyloss')
    env = subprocess_env()
    env['PYTHONPATH'] = str(layer_dir) + os.pathsep + env['PYTHONPATH']
    proc = subprocess.run([sys.executable, '-m', 'caffeplus'] + command, cwd=str(tmp_path),
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert 'No module named' not in proc.stderr
    if command[0] == 'train':
        losses = [float(x) for x in re.findall(r'Iteration \d+ .*loss = (\S+)', proc.stderr)]
        assert len(losses) == 3 and all(l > 0 for l in losses) and numpy.isfinite(losses).all()
        assert 'Train net output #0: loss = ' in proc.stderr
    else:
        assert 'Average Forward-Backward' in proc.stderr


def test_caffe_style_layer_gets_caffeplus_beside_another_caffe(tmp_path, monkeypatch):
    """A process that imported some other `caffe` keeps it; the layer module
    still gets caffeplus (the alias is only in place while it is imported)."""
    import types
    layer_dir = _write_caffe_style_layer(tmp_path, 'caffe_style_beside')
    monkeypatch.syspath_prepend(str(layer_dir))
    other = types.ModuleType('caffe')
    monkeypatch.setitem(sys.modules, 'caffe', other)
    monkeypatch.delitem(sys.modules, 'caffe.io', raising=False)
    try:
        net = caffeplus.Net(str(tmp_path / 'net.prototxt'), caffeplus.TRAIN)
        module = sys.modules['caffe_style_beside']
        assert module.caffe is caffeplus
        assert sys.modules['caffe'] is other and 'caffe.io' not in sys.modules
        assert net.layer_dict['loss'].in_train
        assert numpy.isfinite(net.forward()['loss'])
    finally:
        sys.modules.pop('caffe_style_beside', None)


@pytest.fixture
def caffe_modules_restored():
    """Loading a Python layer leaves `caffe` aliased to caffeplus for the
    rest of the process; the tests after this one get sys.modules back."""
    before = {k: v for k, v in sys.modules.items() if k == 'caffe' or k.startswith('caffe.')}
    yield
    for name in [k for k in sys.modules if k == 'caffe' or k.startswith('caffe.')]:
        del sys.modules[name]
    sys.modules.update(before)


def test_layer_module_importing_a_missing_caffe_submodule_says_so(tmp_path, monkeypatch,
                                                                  caffe_modules_restored):
    # (SSD's fork ships caffe.model_libs; BVLC's pycaffe has no such module)
    (tmp_path / 'needs_model_libs.py').write_text('import caffe.model_libs\n')
    monkeypatch.syspath_prepend(str(tmp_path))
    (tmp_path / 'net.prototxt').write_text(PY_LOSS_NET % 'needs_model_libs')
    try:
        with pytest.raises(caffeplus.CaffeplusError, match=r"no module 'caffe\.model_libs'"):
            caffeplus.Net(str(tmp_path / 'net.prototxt'), caffeplus.TRAIN)
    finally:
        sys.modules.pop('needs_model_libs', None)


# -- 8. smaller differences ---------------------------------------------------------------
def test_blobproto_to_array_is_float64_as_stock_pycaffe():
    values = numpy.random.RandomState(2).randn(2, 3, 4).astype(numpy.float32)
    proto = caffeplus.io.array_to_blobproto(values)
    arr = caffeplus.io.blobproto_to_array(proto)
    # stock pycaffe: np.array(blob.data) over the repeated float field, whose
    # values its protobuf hands over as Python floats
    stock = numpy.array(list(proto.data)).reshape(proto.shape.dim)
    assert arr.dtype == stock.dtype == numpy.float64
    numpy.testing.assert_array_equal(arr, stock)
    numpy.testing.assert_array_equal(arr, values.astype(numpy.float64))
    listed = caffeplus.io.blobprotovector_str_to_arraylist(
        caffeplus.io.arraylist_to_blobprotovector_str([values]))
    assert listed[0].dtype == numpy.float64
    numpy.testing.assert_array_equal(listed[0], stock)


TINY_NET = '''
name: "tiny"
layer { name: "data" type: "DummyData" top: "data" top: "label"
        dummy_data_param { shape { dim: 4 dim: 5 } shape { dim: 4 }
                           data_filler { type: "gaussian" std: 1 }
                           data_filler { type: "constant" value: 1 } } }
layer { name: "ip" type: "InnerProduct" bottom: "data" top: "ip"
        inner_product_param { num_output: 3 weight_filler { type: "gaussian" std: 0.1 } } }
layer { name: "loss" type: "SoftmaxWithLoss" bottom: "ip" bottom: "label" top: "loss" }
'''


@pytest.fixture
def tiny(tmp_path):
    (tmp_path / 'tiny.prototxt').write_text(TINY_NET)
    (tmp_path / 'solver.prototxt').write_text(PY_SOLVER.replace('net.prototxt', 'tiny.prototxt'))
    return tmp_path


def test_every_caffe_flag_is_accepted_by_every_command(tiny):
    rc, cap = run_cli(tiny, 'train', '-solver', 'solver.prototxt', '-iterations', '5',
                      '-model', 'tiny.prototxt', '-phase', 'TEST')
    assert rc == 0
    assert 'Optimization Done.' in cap.messages
    unused = sorted(m for m in cap.messages if 'is not used by' in m)
    assert unused == ['Flag -iterations (5) is not used by `caffeplus train`; ignored.',
                      'Flag -model (tiny.prototxt) is not used by `caffeplus train`; ignored.',
                      'Flag -phase (TEST) is not used by `caffeplus train`; ignored.']
    rc, cap = run_cli(tiny, 'time', '-model', 'tiny.prototxt', '-iterations', '1',
                      '-solver', 'solver.prototxt', '-sigint_effect', 'none', '-weights=w')
    assert rc == 0
    assert sorted(m.split()[1] for m in cap.messages if 'is not used by' in m) == \
        ['-sigint_effect', '-solver', '-weights']
    # Caffe's flags only: anything else is still an error, with the command's usage
    with pytest.raises(SystemExit) as exc:
        run_cli(tiny, 'time', '-model', 'tiny.prototxt', '-bogus', '1')
    assert exc.value.code == 2


def test_unknown_flag_shows_the_commands_usage(tiny, capsys):
    with pytest.raises(SystemExit):
        cli.main(['train', '-solver', 'solver.prototxt', '-bogus', '1'])
    err = capsys.readouterr().err
    assert err.startswith('usage: caffeplus train ')
    assert 'unrecognized arguments: -bogus 1' in err


@pytest.mark.parametrize('command, flag, default', [
    ('time', '--iterations', '50'), ('test', '--iterations', '50'), ('train', '--memory', 'shared'),
    ('train', '--sighup_effect', 'snapshot'), ('time', '--level', '0'),
    ('memory', '--iterations', '3')])
def test_help_shows_defaults(capsys, command, flag, default):
    with pytest.raises(SystemExit) as exc:
        cli.main([command, '--help'])
    assert exc.value.code == 0
    out = ' '.join(capsys.readouterr().out.split())
    out = out[out.index('options:'):]
    section = out[out.index(flag + ' '):]
    section = section[:section.index(' --', 1)] if ' --' in section[1:] else section
    assert re.search(r'\(default: [^)]*%s' % re.escape(default), section), section


def test_help_names_each_setting_flag_once(capsys):
    """A flag with no underscore has no dashed spelling: --help lists it once
    (`--masks plan|off|on`, not `--masks ..., --masks ...`); one with an
    underscore lists both (`--memory_budget`, `--memory-budget`)."""
    with pytest.raises(SystemExit):
        cli.main(['train', '--help'])
    out = capsys.readouterr().out
    assert re.search(r'--masks plan\|off\|on\s', out)
    assert '--masks plan|off|on, --masks' not in out
    assert '--layout nchw|nhwc, --layout' not in out
    assert re.search(r'--update_in_backward [^,\n]*, --update-in-backward', out)


def test_v0_upgrade_note_names_caffeplus_upgrade(caplog_caffeplus):
    v0 = 'name: "old" layers { layer { name: "ip" type: "innerproduct" num_output: 2 } ' \
         'bottom: "x" top: "y" } input: "x" input_dim: 1 input_dim: 3 input_dim: 1 input_dim: 1'
    param = caffe_pb2.NetParameter()
    prototxt.parse_text(v0, param)
    from caffeplus.io import upgrade
    upgrade.upgrade_net_as_needed(param, 'old.prototxt')
    notes = [m for m in caplog_caffeplus if 'will not support V0NetParameter' in m]
    assert len(notes) == 1
    assert '`caffeplus upgrade OLD NEW`' in notes[0] and 'build/tools' not in notes[0]


def test_missing_mean_file_is_one_line_with_the_cwd(tmp_path, capsys):
    (tmp_path / 'm.prototxt').write_text(
        'layer { name: "d" type: "Data" top: "x" top: "y" transform_param { mean_file: '
        '"means/nope.binaryproto" } data_param { source: "db" batch_size: 1 } }\n')
    rc, _ = run_cli(tmp_path, 'time', '-model', 'm.prototxt')
    assert rc == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert err.count('means/nope.binaryproto') == 1
    assert 'layer d' in err and 'not found' in err
    assert 'current directory %s' % os.path.realpath(str(tmp_path)) in err


def test_unreadable_mean_file_names_it_once(tmp_path, capsys):
    (tmp_path / 'bad.binaryproto').write_bytes(b'\xff\xff\xff garbage')
    (tmp_path / 'm.prototxt').write_text(
        'layer { name: "d" type: "Data" top: "x" top: "y" transform_param { mean_file: '
        '"bad.binaryproto" } data_param { source: "db" batch_size: 1 } }\n')
    rc, _ = run_cli(tmp_path, 'time', '-model', 'm.prototxt')
    assert rc == 1
    err = capsys.readouterr().err
    assert err.count('bad.binaryproto') == 1 and 'not a valid binaryproto' in err


@pytest.mark.parametrize('text, line, message', [
    ('layer {\n  name: "ip" type: "InnerProduct"\n  inner_product_param { num_ouput: 3 }\n}\n',
     3, 'has no field named "num_ouput"; did you mean "num_output"?'),
    ('layer {\n  name: "p" type: "Pooling"\n  pooling_param { pool: MAXX }\n}\n',
     3, 'has no value named MAXX; did you mean "MAX"?'),
    ('layer { nmae: "p" }\n', 1, 'has no field named "nmae"; did you mean "name"?'),
])
def test_mistyped_field_gets_a_suggestion(tmp_path, text, line, message):
    path = tmp_path / 'typo.prototxt'
    path.write_text(text)
    with pytest.raises(caffeplus.CaffeplusError) as exc:
        caffeplus.Net(str(path), caffeplus.TEST)
    assert str(exc.value).startswith('%s:%d:' % (path, line))
    assert str(exc.value).endswith(message)


def test_far_fetched_field_gets_no_suggestion(tmp_path):
    path = tmp_path / 'typo.prototxt'
    path.write_text('layer { qqqzzz: 1 }\n')
    with pytest.raises(caffeplus.CaffeplusError) as exc:
        caffeplus.Net(str(path), caffeplus.TEST)
    assert 'has no field named "qqqzzz"' in str(exc.value)
    assert 'did you mean' not in str(exc.value)


def test_mistyped_layer_type_gets_a_suggestion(tmp_path):
    text = TINY_NET.replace('"InnerProduct"', '"InnerProdcut"')
    with pytest.raises(caffeplus.CaffeplusError) as exc:
        net_from_text(tmp_path, text)
    assert "Unknown layer type: 'InnerProdcut' (layer 'ip'); did you mean 'InnerProduct'?" \
        in str(exc.value)
    assert 'Known types: ' in str(exc.value)
