"""Format upgrades (caffeplus.io.upgrade) and `caffeplus upgrade`, against
stock Caffe's upgrade_net_proto_text / upgrade_solver_proto_text outputs in
reference/io/upgrade/ and against hand-written expectations for the rules
those files do not exercise."""
import json
import logging
import os
import re
import subprocess
import sys

import pytest
from google.protobuf import text_format

from caffeplus.errors import FormatError
from caffeplus.io import upgrade
from caffeplus.proto import caffe_pb2
from conftest import REFERENCE, ROOT, need

UPGRADE_DIR = os.path.join(REFERENCE, 'io', 'upgrade')


def _entries():
    path = os.path.join(UPGRADE_DIR, 'UPGRADES.json')
    with open(path) as f:
        return json.load(f)


ENTRIES = _entries()


def parse(text, message):
    return text_format.Merge(text, message)


def net(text):
    return parse(text, caffe_pb2.NetParameter())


def solver(text):
    return parse(text, caffe_pb2.SolverParameter())


class Records(logging.Handler):
    """Collects caffeplus log messages (the logger does not propagate)."""

    def __init__(self):
        super().__init__(logging.DEBUG)
        self.records = []

    def emit(self, record):
        self.records.append(record)

    @property
    def messages(self):
        return [r.getMessage() for r in self.records]

    def levels(self):
        return [r.levelname[0] for r in self.records]


@pytest.fixture
def logs():
    logger = logging.getLogger('caffeplus')
    handler = Records()
    old = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    yield handler
    logger.removeHandler(handler)
    logger.setLevel(old)


def run_cli(*args, cwd=None):
    env = dict(os.environ)
    env['PYTHONPATH'] = ROOT + os.pathsep + env.get('PYTHONPATH', '')
    proc = subprocess.run([sys.executable, '-m', 'caffeplus'] + list(args), cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=120)
    return proc.returncode, proc.stdout + proc.stderr


def assert_clean_failure(rc, out, *needles):
    assert rc == 1, out
    assert 'Traceback' not in out, out
    for needle in needles:
        assert needle in out, (needle, out)


# ---------------------------------------------------------------------------
# Stock Caffe's outputs, reproduced exactly

def _caffe_log_messages(path):
    """Messages of a glog file, without the tool's own last line."""
    out = []
    with open(path) as f:
        for line in f:
            m = re.match(r'^([IWEF])\d{8} [\d:.]+ +\d+ (\S+):\d+\] (.*)$', line.rstrip('\n'))
            if m and m.group(2).startswith('upgrade_proto'):
                out.append((m.group(1), m.group(3)))
    return out


@pytest.mark.parametrize('entry', ENTRIES, ids=[e['version'] + '/' + e['name'] for e in ENTRIES])
def test_reference_upgrade_matches_stock_caffe(entry, logs):
    base = os.path.join(UPGRADE_DIR, entry['version'], entry['name'])
    need(base + '.prototxt')
    assert entry['rc'] == 0
    with open(base + '.prototxt') as f:
        original = f.read()
    with open(base + '.upgraded.prototxt') as f:
        expected_text = f.read()
    # Caffe ran with the reference root as its cwd; name the file the same way.
    source = 'io/upgrade/%s/%s.prototxt' % (entry['version'], entry['name'])
    if entry['kind'] == 'net':
        param = net(original)
        assert upgrade.net_needs_upgrade(param)
        result = upgrade.upgrade_net_as_needed(param, source)
        expected = net(expected_text)
        assert not upgrade.net_needs_upgrade(result)
    else:
        param = solver(original)
        result = upgrade.upgrade_solver_as_needed(param, source)
        expected = solver(expected_text)
        assert not upgrade.solver_needs_upgrade(result)
    assert result is param
    assert result == expected
    assert upgrade.message_to_text(result) == expected_text
    # Same log lines (level and text) as Caffe's upgrade_proto.cpp wrote.
    caffe_lines = [(level, caffeplus_tool_named(msg))
                   for level, msg in _caffe_log_messages(base + '.log')]
    ours = list(zip(logs.levels(), logs.messages))
    assert ours == caffe_lines


STOCK_TOOLS = ('use ./build/tools/upgrade_net_proto_text for prototxt and '
               './build/tools/upgrade_net_proto_binary for model weights upgrade')


def caffeplus_tool_named(message):
    """Stock Caffe's V0 note with caffeplus's upgrade command in place of
    Caffe's two tools: the one line where the logs differ on purpose."""
    return message.replace(STOCK_TOOLS, 'use `caffeplus upgrade OLD NEW` (prototxt nets and '
                                        '.caffemodel weights) to upgrade')


def test_reference_set_covers_v0_v1_nets_and_solvers():
    if not ENTRIES:
        pytest.skip('reference data not found: %s' % UPGRADE_DIR)
    kinds = {(e['version'], e['kind']) for e in ENTRIES}
    assert kinds == {('v0', 'net'), ('v0', 'solver'), ('v1', 'net'), ('v1', 'solver')}


@pytest.mark.parametrize('entry', ENTRIES, ids=[e['version'] + '/' + e['name'] for e in ENTRIES])
def test_cli_writes_what_stock_caffe_wrote(entry, tmp_path):
    base = os.path.join(UPGRADE_DIR, entry['version'], entry['name'])
    need(base + '.prototxt')
    out_path = str(tmp_path / 'out.prototxt')
    rc, out = run_cli('upgrade', base + '.prototxt', out_path)
    assert rc == 0, out
    with open(out_path) as f, open(base + '.upgraded.prototxt') as g:
        assert f.read() == g.read()
    kind = 'NetParameter' if entry['kind'] == 'net' else 'SolverParameter'
    assert 'Wrote upgraded %s text proto to %s' % (kind, out_path) in out
    assert 'Traceback' not in out


def test_cli_already_current_file_is_copied_with_caffe_message(tmp_path):
    path = tmp_path / 'cur.prototxt'
    path.write_text('name: "x"\nlayer { name: "a" type: "Input" top: "a" '
                    'input_param { shape { dim: 1 } } }\n')
    out_path = str(tmp_path / 'o.prototxt')
    rc, out = run_cli('upgrade', str(path), out_path)
    assert rc == 0, out
    assert 'File already in latest proto format: %s' % path in out
    assert net(open(out_path).read()) == net(path.read_text())


def test_cli_help():
    rc, out = run_cli('upgrade', '-h')
    assert rc == 0
    assert 'IN' in out and 'OUT' in out and '--keep-going' in out


def test_cli_binary_caffemodel(tmp_path):
    v1 = net('''name: "b"
      layers { name: "ip" type: INNER_PRODUCT bottom: "x" top: "y" blobs_lr: 1 blobs_lr: 2
               inner_product_param { num_output: 2 }
               blobs { num: 1 channels: 1 height: 2 width: 3 data: 1 data: 2 data: 3
                       data: 4 data: 5 data: 6 }
               blobs { num: 1 channels: 1 height: 1 width: 2 data: 7 data: 8 } }''')
    src = tmp_path / 'old.caffemodel'
    src.write_bytes(v1.SerializeToString())
    dst = tmp_path / 'new.caffemodel'
    rc, out = run_cli('upgrade', str(src), str(dst))
    assert rc == 0, out
    assert 'Wrote upgraded NetParameter binary proto to %s' % dst in out
    result = caffe_pb2.NetParameter.FromString(dst.read_bytes())
    assert len(result.layers) == 0 and len(result.layer) == 1
    layer = result.layer[0]
    assert layer.type == 'InnerProduct'
    assert [p.lr_mult for p in layer.param] == [1, 2]
    assert list(layer.blobs[0].data) == [1, 2, 3, 4, 5, 6]
    assert list(layer.blobs[1].data) == [7, 8]
    assert (layer.blobs[0].num, layer.blobs[0].width) == (1, 3)


# ---------------------------------------------------------------------------
# Bad input: a clear error naming file, layer and field; exit 1; no traceback

V1_LENET_HEAD = '''name: "LeNet"
input: "data"
input_dim: 1 input_dim: 1 input_dim: 28 input_dim: 28
layers {
  name: "conv1"
  type: CONVOLUTION
  bottom: "data"
  top: "conv1"
  convolution_param { num_output: 2 kernel_size: 5 }
}
layers {
  name: "pool1"
  type: POOLNG
  bottom: "conv1"
  top: "pool1"
  pooling_param { pool: MAX kernel_size: 2 stride: 2 }
}
'''

V0_NET = '''name: "v0"
input: "data"
input_dim: 1 input_dim: 1 input_dim: 8 input_dim: 8
layers {
  layer { name: "conv1" type: "conv" num_output: 2 kernelsize: 3 }
  bottom: "data"
  top: "conv1"
}
layers {
  layer { name: "pool1" type: "%s" kernelsize: 2 stride: 2 }
  bottom: "conv1"
  top: "pool1"
}
'''


def test_cli_malformed_v1_enum_names_file_line_and_layer(tmp_path):
    path = tmp_path / 'bad_enum.prototxt'
    path.write_text(V1_LENET_HEAD)
    out_path = tmp_path / 'o.prototxt'
    rc, out = run_cli('upgrade', str(path), str(out_path))
    assert_clean_failure(rc, out, '%s:13:' % path, 'POOLNG', "layer 'pool1'")
    assert not out_path.exists()


def test_cli_unknown_v0_type_names_file_layer_and_field(tmp_path):
    path = tmp_path / 'bad_v0.prototxt'
    path.write_text(V0_NET % 'pooling')
    out_path = tmp_path / 'o.prototxt'
    rc, out = run_cli('upgrade', str(path), str(out_path))
    assert_clean_failure(rc, out, str(path), "layer 'pool1'", "'pooling'", 'type')
    assert 'unknown V0 layer type' in out
    assert not out_path.exists()


def test_library_unknown_v0_type_raises_format_error():
    with pytest.raises(FormatError, match=r"old\.prototxt: layer 'pool1'.*'maxpool'"):
        upgrade.upgrade_net_as_needed(net(V0_NET % 'maxpool'), 'old.prototxt')


def test_read_net_param_unknown_v0_type(tmp_path):
    from caffeplus.io.prototxt import read_net_param
    path = tmp_path / 'v0.prototxt'
    path.write_text(V0_NET % 'maxpool')
    with pytest.raises(FormatError, match=re.escape(str(path)) + ".*layer 'pool1'"):
        read_net_param(str(path))


def test_v0_field_meaningless_for_type_strict_and_keep_going(tmp_path, logs):
    text = V0_NET % 'pool'
    text = text.replace('type: "pool" kernelsize', 'type: "pool" num_output: 7 kernelsize')
    with pytest.raises(FormatError, match=r"f\.prototxt: layer 'pool1'.*'num_output'.*'pool'"):
        upgrade.upgrade_net_as_needed(net(text), 'f.prototxt')
    # Caffe's way: log the problem, drop the field, go on.
    param = net(text)
    assert upgrade.upgrade_net(param, 'f.prototxt', strict=False) is False
    assert 'Unknown parameter num_output for layer type pool' in logs.messages
    assert any(m.startswith('Warning: had one or more problems upgrading V0NetParameter')
               for m in logs.messages)
    pool = param.layer[2]
    assert pool.type == 'Pooling' and pool.pooling_param.kernel_size == 2
    # The CLI: an error by default, Caffe's behaviour with --keep-going.
    path = tmp_path / 'f.prototxt'
    path.write_text(text)
    out_path = tmp_path / 'o.prototxt'
    rc, out = run_cli('upgrade', str(path), str(out_path))
    assert_clean_failure(rc, out, "layer 'pool1'", 'num_output')
    assert not out_path.exists()
    rc, out = run_cli('upgrade', '--keep-going', str(path), str(out_path))
    assert rc == 1 and 'Traceback' not in out
    assert 'Unknown parameter num_output for layer type pool' in out
    assert 'Encountered error(s) while upgrading prototxt; see details above.' in out
    assert net(out_path.read_text()) == param


def test_padding_layer_feeding_a_non_conv_layer():
    text = '''input: "data" input_dim: 1 input_dim: 1 input_dim: 4 input_dim: 4
    layers { layer { name: "pad1" type: "padding" pad: 1 } bottom: "data" top: "p" }
    layers { layer { name: "relu1" type: "relu" } bottom: "p" top: "r" }'''
    with pytest.raises(FormatError, match=r"n\.prototxt: layer 'relu1'.*padding layer 'pad1'"):
        upgrade.upgrade_net_as_needed(net(text), 'n.prototxt')


def test_v0_unknown_bottom():
    text = '''layers { layer { name: "conv1" type: "conv" num_output: 1 kernelsize: 1 }
      bottom: "nothing" top: "c" }'''
    with pytest.raises(FormatError, match=r"layer 'conv1'.*'nothing'"):
        upgrade.upgrade_net_as_needed(net(text), 'n.prototxt')


def test_layer_and_layers_in_one_net():
    text = '''layer { name: "new" type: "Input" top: "x" input_param { shape { dim: 1 } } }
      layers { name: "old" type: RELU bottom: "x" top: "x" }'''
    with pytest.raises(FormatError, match=r"both 'layer'.*'layers'"):
        upgrade.upgrade_net_as_needed(net(text), 'n.prototxt')
    # Stock Caffe keeps only the V1 layers.
    param = net(text)
    assert upgrade.upgrade_net(param, 'n.prototxt', strict=False) is False
    assert [l.name for l in param.layer] == ['old']


def test_input_dim_count_mismatch():
    text = 'input: "a" input: "b" input_dim: 1 input_dim: 2 input_dim: 3 input_dim: 4'
    with pytest.raises(FormatError, match='input_dim'):
        upgrade.upgrade_net_as_needed(net(text), 'n.prototxt')


def test_solver_with_both_type_fields(tmp_path):
    text = 'base_lr: 0.1\nsolver_type: ADAM\ntype: "Adam"\n'
    with pytest.raises(FormatError, match=r's\.prototxt.*solver_type.*type'):
        upgrade.upgrade_solver_as_needed(solver(text), 's.prototxt')
    path = tmp_path / 's.prototxt'
    path.write_text(text)
    rc, out = run_cli('upgrade', str(path), str(tmp_path / 'o.prototxt'))
    assert_clean_failure(rc, out, str(path), 'solver_type')


def test_cli_missing_and_unparsable_input(tmp_path):
    rc, out = run_cli('upgrade', str(tmp_path / 'nope.prototxt'), str(tmp_path / 'o'))
    assert_clean_failure(rc, out, 'nope.prototxt', 'not found')
    bad = tmp_path / 'garbage.prototxt'
    bad.write_text('layers { name: "a" type: RELU \n')
    rc, out = run_cli('upgrade', str(bad), str(tmp_path / 'o'))
    assert_clean_failure(rc, out, str(bad))
    binary = tmp_path / 'w.caffemodel'
    binary.write_bytes(b'\xff\xff\xff\xff garbage')
    rc, out = run_cli('upgrade', str(binary), str(tmp_path / 'o.caffemodel'))
    assert_clean_failure(rc, out, str(binary))
    rc, out = run_cli('upgrade', str(bad))
    assert rc != 0 and 'Traceback' not in out


def test_cli_solver_parse_error_is_reported_as_solver(tmp_path):
    path = tmp_path / 's.prototxt'
    path.write_text('net: "x.prototxt"\nbase_lr: 0.01\nlr_policy: "fixed"\nmax_itr: 10\n')
    rc, out = run_cli('upgrade', str(path), str(tmp_path / 'o'))
    assert_clean_failure(rc, out, '%s:4:' % path, 'max_itr', 'SolverParameter')


# ---------------------------------------------------------------------------
# The individual rules

def test_v0_padding_layer_folds_into_the_convolution(logs):
    text = '''name: "pad"
    input: "data" input_dim: 1 input_dim: 3 input_dim: 8 input_dim: 8
    layers { layer { name: "pad1" type: "padding" pad: 2 } bottom: "data" top: "pad1" }
    layers { layer { name: "conv1" type: "conv" num_output: 4 kernelsize: 5 stride: 1
                     group: 1 biasterm: false } bottom: "pad1" top: "conv1" }
    layers { layer { name: "pad2" type: "padding" pad: 1 } bottom: "conv1" top: "pad2" }
    layers { layer { name: "pool1" type: "pool" pool: AVE kernelsize: 3 stride: 2 }
             bottom: "pad2" top: "pool1" }'''
    param = upgrade.upgrade_net_as_needed(net(text), 'pad.prototxt')
    expected = net('''name: "pad"
    layer { name: "input" type: "Input" top: "data"
            input_param { shape { dim: 1 dim: 3 dim: 8 dim: 8 } } }
    layer { name: "conv1" type: "Convolution" bottom: "data" top: "conv1"
            convolution_param { num_output: 4 bias_term: false pad: 2 kernel_size: 5
                                group: 1 stride: 1 } }
    layer { name: "pool1" type: "Pooling" bottom: "conv1" top: "pool1"
            pooling_param { pool: AVE pad: 1 kernel_size: 3 stride: 2 } }''')
    assert param == expected
    assert logs.messages[0] == ('Attempting to upgrade input file specified using deprecated '
                                'V0LayerParameter: pad.prototxt')


def test_v0_fields_go_to_each_types_param():
    text = '''
    layers { layer { name: "d" type: "data" source: "db" meanfile: "m.binaryproto"
                     batchsize: 5 cropsize: 7 mirror: true scale: 0.5 rand_skip: 3 }
             top: "data" top: "label" }
    layers { layer { name: "i" type: "images" source: "list.txt" batchsize: 2 rand_skip: 1
                     shuffle_images: true new_height: 30 new_width: 40 }
             top: "i" top: "il" }
    layers { layer { name: "h" type: "hdf5_data" source: "h.txt" batchsize: 3 }
             top: "h" top: "hl" }
    layers { layer { name: "w" type: "window_data" source: "w.txt" batchsize: 4
                     det_fg_threshold: 0.6 det_bg_threshold: 0.4 det_fg_fraction: 0.3
                     det_context_pad: 16 det_crop_mode: "square" }
             top: "w" top: "wl" }
    layers { layer { name: "ip" type: "innerproduct" num_output: 10 biasterm: false
                     weight_filler { type: "xavier" } bias_filler { type: "constant" value: 1 }
                     blobs_lr: 1 blobs_lr: 2 weight_decay: 1 weight_decay: 0 }
             bottom: "data" top: "ip" }
    layers { layer { name: "lrn" type: "lrn" local_size: 3 alpha: 0.1 beta: 0.5 k: 2 }
             bottom: "ip" top: "lrn" }
    layers { layer { name: "drop" type: "dropout" dropout_ratio: 0.3 } bottom: "lrn" top: "lrn" }
    layers { layer { name: "cat" type: "concat" concat_dim: 0 }
             bottom: "lrn" bottom: "ip" top: "cat" }
    layers { layer { name: "ig" type: "infogain_loss" source: "H.binaryproto" }
             bottom: "cat" bottom: "label" }
    layers { layer { name: "out" type: "hdf5_output" hdf5_output_param { file_name: "o.h5" } }
             bottom: "cat" bottom: "label" }
    '''
    param = upgrade.upgrade_net_as_needed(net(text), 'f.prototxt')
    expected = net('''
    layer { name: "d" type: "Data" top: "data" top: "label"
            transform_param { scale: 0.5 mirror: true crop_size: 7 mean_file: "m.binaryproto" }
            data_param { source: "db" batch_size: 5 rand_skip: 3 } }
    layer { name: "i" type: "ImageData" top: "i" top: "il"
            image_data_param { source: "list.txt" batch_size: 2 rand_skip: 1 shuffle: true
                               new_height: 30 new_width: 40 } }
    layer { name: "h" type: "HDF5Data" top: "h" top: "hl"
            hdf5_data_param { source: "h.txt" batch_size: 3 } }
    layer { name: "w" type: "WindowData" top: "w" top: "wl"
            window_data_param { source: "w.txt" batch_size: 4 fg_threshold: 0.6
                                bg_threshold: 0.4 fg_fraction: 0.3 context_pad: 16
                                crop_mode: "square" } }
    layer { name: "ip" type: "InnerProduct" bottom: "data" top: "ip"
            param { lr_mult: 1 decay_mult: 1 } param { lr_mult: 2 decay_mult: 0 }
            inner_product_param { num_output: 10 bias_term: false
                                  weight_filler { type: "xavier" }
                                  bias_filler { type: "constant" value: 1 } } }
    layer { name: "lrn" type: "LRN" bottom: "ip" top: "lrn"
            lrn_param { local_size: 3 alpha: 0.1 beta: 0.5 k: 2 } }
    layer { name: "drop" type: "Dropout" bottom: "lrn" top: "lrn"
            dropout_param { dropout_ratio: 0.3 } }
    layer { name: "cat" type: "Concat" bottom: "lrn" bottom: "ip" top: "cat"
            concat_param { concat_dim: 0 } }
    layer { name: "ig" type: "InfogainLoss" bottom: "cat" bottom: "label"
            infogain_loss_param { source: "H.binaryproto" } }
    layer { name: "out" type: "HDF5Output" bottom: "cat" bottom: "label"
            hdf5_output_param { file_name: "o.h5" } }
    ''')
    assert param == expected


@pytest.mark.parametrize('v0_type,v2_type', [
    ('accuracy', 'Accuracy'), ('bnll', 'BNLL'), ('concat', 'Concat'), ('conv', 'Convolution'),
    ('data', 'Data'), ('dropout', 'Dropout'), ('euclidean_loss', 'EuclideanLoss'),
    ('flatten', 'Flatten'), ('hdf5_data', 'HDF5Data'), ('hdf5_output', 'HDF5Output'),
    ('im2col', 'Im2col'), ('images', 'ImageData'), ('infogain_loss', 'InfogainLoss'),
    ('innerproduct', 'InnerProduct'), ('lrn', 'LRN'),
    ('multinomial_logistic_loss', 'MultinomialLogisticLoss'), ('pool', 'Pooling'),
    ('relu', 'ReLU'), ('sigmoid', 'Sigmoid'), ('softmax', 'Softmax'),
    ('softmax_loss', 'SoftmaxWithLoss'), ('split', 'Split'), ('tanh', 'TanH'),
    ('window_data', 'WindowData')])
def test_v0_type_names(v0_type, v2_type):
    param = net('layers { layer { name: "l" type: "%s" } }' % v0_type)
    assert upgrade.upgrade_net_as_needed(param).layer[0].type == v2_type


def test_every_v1_enum_has_its_v2_name():
    names = caffe_pb2.V1LayerParameter.LayerType.keys()
    assert set(caffe_pb2.V1LayerParameter.LayerType.Value(n)
               for n in names) == set(upgrade.V1_LAYER_TYPES)
    for name in names:
        param = net('layers { name: "l" type: %s }' % name)
        upgraded = upgrade.upgrade_net_as_needed(param).layer[0]
        if name == 'NONE':
            assert upgraded.type == ''
        else:
            # Every V2 name is the enum written in CamelCase, up to acronyms.
            squash = upgraded.type.replace('WithLoss', 'Loss').upper()
            assert squash == name.replace('_', ''), name


def test_v1_params_sharing_rules_and_messages():
    text = '''
    layers { name: "a" type: INNER_PRODUCT bottom: "x" top: "y"
             param: "w" param: "b" blob_share_mode: PERMISSIVE blob_share_mode: STRICT
             blobs_lr: 1 blobs_lr: 2 weight_decay: 1 weight_decay: 0
             include { phase: TRAIN stage: "s" } exclude { min_level: 2 }
             loss_weight: 0.5
             inner_product_param { num_output: 3 }
             blobs { shape { dim: 3 dim: 1 } data: 1 data: 2 data: 3 } }
    layers { name: "b" type: INNER_PRODUCT bottom: "x" top: "z" param: "w" blobs_lr: 3
             inner_product_param { num_output: 3 } }
    layers { name: "l" type: SOFTMAX_LOSS bottom: "y" bottom: "t"
             loss_param { ignore_label: 1 normalize: false } softmax_param { axis: 1 } }
    layers { name: "e" type: ELTWISE bottom: "y" bottom: "z" top: "e"
             eltwise_param { operation: MAX } }
    layers { name: "t" type: THRESHOLD bottom: "e" top: "t2" threshold_param { threshold: 2 } }
    '''
    param = upgrade.upgrade_net_as_needed(net(text))
    expected = net('''
    layer { name: "a" type: "InnerProduct" bottom: "x" top: "y" loss_weight: 0.5
            param { name: "w" share_mode: PERMISSIVE lr_mult: 1 decay_mult: 1 }
            param { name: "b" share_mode: STRICT lr_mult: 2 decay_mult: 0 }
            blobs { shape { dim: 3 dim: 1 } data: 1 data: 2 data: 3 }
            include { phase: TRAIN stage: "s" } exclude { min_level: 2 }
            inner_product_param { num_output: 3 } }
    layer { name: "b" type: "InnerProduct" bottom: "x" top: "z"
            param { name: "w" lr_mult: 3 } inner_product_param { num_output: 3 } }
    layer { name: "l" type: "SoftmaxWithLoss" bottom: "y" bottom: "t"
            loss_param { ignore_label: 1 normalize: false } softmax_param { axis: 1 } }
    layer { name: "e" type: "Eltwise" bottom: "y" bottom: "z" top: "e"
            eltwise_param { operation: MAX } }
    layer { name: "t" type: "Threshold" bottom: "e" top: "t2" threshold_param { threshold: 2 } }
    ''')
    assert param == expected


def test_data_transformation_fields_move_to_transform_param(logs):
    text = '''
    layers { name: "d" type: DATA top: "d" top: "l"
             data_param { source: "db" batch_size: 4 scale: 0.5 mean_file: "m" crop_size: 3
                          mirror: true backend: LMDB } }
    layers { name: "i" type: IMAGE_DATA top: "i" top: "il"
             image_data_param { source: "f.txt" crop_size: 5 } }
    layers { name: "w" type: WINDOW_DATA top: "w" top: "wl"
             window_data_param { source: "w.txt" batch_size: 2 mirror: false } }'''
    param = net(text)
    assert upgrade.net_needs_data_upgrade(param)
    upgrade.upgrade_net_as_needed(param, 'd.prototxt')
    expected = net('''
    layer { name: "d" type: "Data" top: "d" top: "l"
            transform_param { scale: 0.5 mirror: true crop_size: 3 mean_file: "m" }
            data_param { source: "db" batch_size: 4 backend: LMDB } }
    layer { name: "i" type: "ImageData" top: "i" top: "il"
            transform_param { crop_size: 5 } image_data_param { source: "f.txt" } }
    layer { name: "w" type: "WindowData" top: "w" top: "wl"
            transform_param { mirror: false }
            window_data_param { source: "w.txt" batch_size: 2 } }''')
    assert param == expected
    assert logs.messages[:4] == [
        'Attempting to upgrade input file specified using deprecated transformation '
        'parameters: d.prototxt',
        'Successfully upgraded file specified using deprecated data transformation parameters.',
        'Note that future Caffe releases will only support transform_param messages for '
        'transformation fields.',
        'Attempting to upgrade input file specified using deprecated V1LayerParameter: '
        'd.prototxt']


def test_input_fields_become_an_input_layer():
    with_shape = net('''input: "a" input: "b"
      input_shape { dim: 1 dim: 2 } input_shape { dim: 3 }
      layer { name: "r" type: "ReLU" bottom: "a" top: "r" }''')
    upgrade.upgrade_net_as_needed(with_shape)
    assert with_shape == net('''
      layer { name: "input" type: "Input" top: "a" top: "b"
              input_param { shape { dim: 1 dim: 2 } shape { dim: 3 } } }
      layer { name: "r" type: "ReLU" bottom: "a" top: "r" }''')
    # Old caffemodels name inputs without shapes: the names are just dropped.
    bare = net('input: "data" layer { name: "r" type: "ReLU" bottom: "data" top: "r" }')
    assert upgrade.net_needs_upgrade(bare)
    upgrade.upgrade_net_as_needed(bare)
    assert bare == net('layer { name: "r" type: "ReLU" bottom: "data" top: "r" }')


def test_batchnorm_with_three_param_specs(logs):
    text = '''
    layer { name: "bn0" type: "BatchNorm" bottom: "x" top: "x"
            param { lr_mult: 0 } param { lr_mult: 0 } param { lr_mult: 0 } }
    layer { name: "bn1" type: "BatchNorm" bottom: "x" top: "x"
            param { lr_mult: 1 decay_mult: 1 name: "m" } param { name: "v" share_mode: STRICT }
            param { lr_mult: 1 } }
    layer { name: "bn2" type: "BatchNorm" bottom: "x" top: "x" }
    layer { name: "bn3" type: "BatchNorm" bottom: "x" top: "x" param { lr_mult: 1 } }
    layer { name: "sc" type: "Scale" bottom: "x" top: "x"
            param { lr_mult: 1 } param { lr_mult: 1 } param { lr_mult: 1 } }'''
    param = net(text)
    assert upgrade.net_needs_upgrade(param)
    upgrade.upgrade_net_as_needed(param, 'bn.prototxt')
    expected = net('''
    layer { name: "bn0" type: "BatchNorm" bottom: "x" top: "x"
            param { lr_mult: 0 decay_mult: 0 } param { lr_mult: 0 decay_mult: 0 }
            param { lr_mult: 0 decay_mult: 0 } }
    layer { name: "bn1" type: "BatchNorm" bottom: "x" top: "x"
            param { lr_mult: 0 decay_mult: 0 name: "m" }
            param { name: "v" share_mode: STRICT lr_mult: 0 decay_mult: 0 }
            param { lr_mult: 0 decay_mult: 0 } }
    layer { name: "bn2" type: "BatchNorm" bottom: "x" top: "x" }
    layer { name: "bn3" type: "BatchNorm" bottom: "x" top: "x" param { lr_mult: 1 } }
    layer { name: "sc" type: "Scale" bottom: "x" top: "x"
            param { lr_mult: 1 } param { lr_mult: 1 } param { lr_mult: 1 } }''')
    assert param == expected
    assert logs.messages == [
        'Attempting to upgrade batch norm layers using deprecated params: bn.prototxt',
        'Successfully upgraded batch norm layers using deprecated params.']
    # As in Caffe, such a net keeps "needing" the (idempotent) upgrade.
    assert upgrade.net_needs_upgrade(param)
    assert upgrade.upgrade_net_as_needed(param) == expected


@pytest.mark.parametrize('enum,name', [('SGD', 'SGD'), ('NESTEROV', 'Nesterov'),
                                       ('ADAGRAD', 'AdaGrad'), ('RMSPROP', 'RMSProp'),
                                       ('ADADELTA', 'AdaDelta'), ('ADAM', 'Adam')])
def test_solver_type_enum_to_string(enum, name):
    param = solver('base_lr: 0.1 solver_type: %s' % enum)
    assert upgrade.solver_needs_upgrade(param)
    upgrade.upgrade_solver_as_needed(param, 's.prototxt')
    assert param.type == name and not param.HasField('solver_type')
    assert upgrade.message_to_text(param) == 'base_lr: 0.1\ntype: "%s"\n' % name


def test_current_files_are_left_alone(logs):
    text = 'name: "n" layer { name: "x" type: "Input" top: "x" }'
    param = net(text)
    assert not upgrade.net_needs_upgrade(param)
    assert upgrade.upgrade_net_as_needed(param, 'x') == net(text)
    s = solver('type: "Adam" base_lr: 0.1')
    assert upgrade.upgrade_solver_as_needed(s, 'x') == solver('type: "Adam" base_lr: 0.1')
    assert logs.messages == []


def test_message_to_text_formats_like_caffe():
    p = caffe_pb2.SolverParameter(base_lr=0.1, momentum=0.9, weight_decay=0.0005, delta=1e-8,
                                  gamma=0.123456789, power=1.0, random_seed=-5,
                                  snapshot_prefix='a "b"\n\\', solver_mode=0,
                                  test_initialization=False)
    text = upgrade.message_to_text(p)
    assert text == ('base_lr: 0.1\n'
                    'gamma: 0.123456791\n'
                    'power: 1\n'
                    'momentum: 0.9\n'
                    'weight_decay: 0.0005\n'
                    'snapshot_prefix: "a \\"b\\"\\n\\\\"\n'
                    'solver_mode: CPU\n'
                    'random_seed: -5\n'
                    'delta: 1e-08\n'
                    'test_initialization: false\n')
    assert solver(text) == p
    shape = caffe_pb2.NetParameter(name='n')
    shape.layer.add(name='l').input_param.shape.add(dim=[1, 2])
    assert upgrade.message_to_text(shape) == (
        'name: "n"\nlayer {\n  name: "l"\n  input_param {\n    shape {\n      dim: 1\n'
        '      dim: 2\n    }\n  }\n}\n')


def test_v0_net_with_current_layers_too():
    text = '''input: "x" input_dim: 1 input_dim: 1 input_dim: 1 input_dim: 1
      layer { name: "new" type: "ReLU" bottom: "x" top: "z" }
      layers { layer { name: "old" type: "relu" } bottom: "x" top: "y" }'''
    with pytest.raises(FormatError, match=r"n\.prototxt: net field layer"):
        upgrade.upgrade_net_as_needed(net(text), 'n.prototxt')
    param = net(text)
    assert upgrade.upgrade_net(param, 'n.prototxt', strict=False) is False
    assert [l.name for l in param.layer] == ['input', 'old']
