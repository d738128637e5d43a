"""Caffe's companion tools: convert_imageset and compute_image_mean against the
stock outputs in reference/io, extract_features, parse_log on stock and
caffeplus logs, plot_training_log, draw_net."""
import csv
import logging
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

import caffeplus
from caffeplus import cli, log
from caffeplus.log import GlogFormatter
from caffeplus.proto import caffe_pb2
from conftest import REFERENCE, ROOT, need

IO = os.path.join(REFERENCE, 'io')
TRAINING = os.path.join(REFERENCE, 'training')
VARIANTS = {
    'raw': [],
    'encoded': ['-encoded'],
    'resized_6x5': ['-resize_height', '6', '-resize_width', '5'],
    'gray': ['-gray'],
}
RUNS = ('sgd', 'nesterov', 'adagrad', 'adam')


class Capture(logging.Handler):
    def __init__(self):
        super().__init__()
        self.setFormatter(GlogFormatter())
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def run_cli(*argv, cwd=None):
    """caffeplus <argv> in process: (exit code, logged messages)."""
    cap = Capture()
    log.logger.addHandler(cap)
    old_level = log.logger.level
    log.logger.setLevel(logging.INFO)
    old = os.getcwd()
    if cwd:
        os.chdir(cwd)
    try:
        rc = cli.main([str(a) for a in argv])
    finally:
        os.chdir(old)
        log.logger.removeHandler(cap)
        log.logger.setLevel(old_level)
    return rc, cap.messages


def lmdb_items(path):
    import lmdb
    env = lmdb.open(str(path), readonly=True, lock=False)
    try:
        with env.begin() as txn:
            return [(bytes(k), bytes(v)) for k, v in txn.cursor()]
    finally:
        env.close()


def datum(value):
    d = caffe_pb2.Datum()
    d.ParseFromString(value)
    return d


# -- convert_imageset -----------------------------------------------------------------
@pytest.mark.parametrize('variant', sorted(VARIANTS))
def test_convert_imageset_matches_stock(variant, tmp_path):
    stock = need(os.path.join(IO, 'imageset_%s_lmdb' % variant))
    out = tmp_path / ('imageset_%s_lmdb' % variant)
    rc, messages = run_cli('convert_imageset', *VARIANTS[variant], 'io/images/',
                           'io/images/list.txt', out, cwd=REFERENCE)
    assert rc == 0
    assert 'A total of 8 images.' in messages and 'Processed 8 files.' in messages
    ours, theirs = lmdb_items(out), lmdb_items(stock)
    assert [k for k, _ in ours] == [k for k, _ in theirs]
    assert ours[0][0] == b'00000000_img_00.png'
    # Byte for byte: the same Datum fields, pixels (BGR, OpenCV's resize and
    # grey conversion) and, for -encoded, the PNG file's own bytes.
    assert [v for _, v in ours] == [v for _, v in theirs]
    npz = np.load(os.path.join(IO, 'imageset_%s.npz' % variant))
    for k, (_, value) in enumerate(ours):
        d = datum(value)
        assert d.label == npz['labels'][k]
        if d.encoded:
            assert d.data == npz['encoded_%d' % k].tobytes()
        else:
            np.testing.assert_array_equal(caffeplus.io.datum_to_array(d), npz['data_%d' % k])


def test_convert_imageset_options_and_bad_lines(tmp_path):
    images = need(os.path.join(IO, 'images'))
    lst = tmp_path / 'list.txt'
    lst.write_text('img_00.png 3\nmissing.png 1\nimg_02.png 4\nimg_07.png 6\n')
    out = tmp_path / 'db'
    rc, messages = run_cli('convert_imageset', '--encode_type', 'jpg', '-resize_height', '8',
                           '-resize_width', '8', images + '/', lst, out)
    assert rc == 0
    assert any('Could not open or find file' in m and 'missing.png' in m for m in messages)
    assert 'encode_type specified, assuming encoded=true.' in messages
    items = lmdb_items(out)
    assert [k for k, _ in items] == [b'00000000_img_00.png', b'00000002_img_02.png',
                                     b'00000003_img_07.png']
    d = datum(items[1][1])
    assert d.encoded and d.label == 4 and d.data[:2] == b'\xff\xd8'     # a JPEG
    pixels = caffeplus.io.datum_to_array(d)
    assert pixels.shape == (3, 8, 8)
    # --check_size stops at the first image of another size.
    rc = cli.main(['convert_imageset', '--check_size', images + '/',
                   os.path.join(images, 'list.txt'), str(tmp_path / 'db2')])
    assert rc == 1
    # --shuffle keeps every image with its label.
    rc, _ = run_cli('convert_imageset', '--shuffle', images + '/',
                    os.path.join(images, 'list.txt'), tmp_path / 'db3')
    assert rc == 0
    got = sorted((k.split(b'_', 1)[1], datum(v).label) for k, v in lmdb_items(tmp_path / 'db3'))
    want = sorted((l.split()[0].encode(), int(l.split()[1]))
                  for l in open(os.path.join(images, 'list.txt')))
    assert got == want
    # An existing database is not overwritten.
    assert cli.main(['convert_imageset', images + '/', str(lst), str(out)]) == 1


def test_convert_imageset_tool_script(tmp_path):
    images = need(os.path.join(IO, 'images'))
    proc = subprocess.run([sys.executable, os.path.join(ROOT, 'tools', 'convert_imageset.py'),
                           '-gray', images + '/', os.path.join(images, 'list.txt'),
                           str(tmp_path / 'gray_lmdb')], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert 'A total of 8 images.' in proc.stderr
    assert [v for _, v in lmdb_items(tmp_path / 'gray_lmdb')] == \
        [v for _, v in lmdb_items(os.path.join(IO, 'imageset_gray_lmdb'))]


# -- compute_image_mean ------------------------------------------------------------
def test_compute_image_mean_matches_stock_bytes(tmp_path):
    stock = need(os.path.join(IO, 'mnist_synth_train_mean.binaryproto'))
    out = tmp_path / 'mean.binaryproto'
    rc, messages = run_cli('compute_image_mean', '-backend', 'lmdb',
                           'training/data/mnist_synth_train_lmdb', out, cwd=REFERENCE)
    assert rc == 0
    with open(stock, 'rb') as f:
        expected = f.read()
    assert out.read_bytes() == expected
    assert messages[-5:] == ['Starting iteration', 'Processed 256 files.',
                             'Write to %s' % out, 'Number of channels: 1',
                             'mean_value channel [0]: 57.078']
    mean = caffeplus.io.blobproto_to_array(caffeplus.io.blobproto.read_blobproto(str(out)))
    np.testing.assert_array_equal(mean, np.load(os.path.join(IO, 'mnist_synth_train_mean.npy')))


def test_compute_image_mean_colour_encoded_and_sizes(tmp_path):
    raw = need(os.path.join(IO, 'imageset_resized_6x5_lmdb'))
    out = tmp_path / 'mean.binaryproto'
    rc, _ = run_cli('compute_image_mean', raw, out)
    assert rc == 0
    npz = np.load(os.path.join(IO, 'imageset_resized_6x5.npz'))
    stack = np.array([npz['data_%d' % k] for k in range(8)], np.float32)
    blob = caffe_pb2.BlobProto()
    blob.ParseFromString(out.read_bytes())
    assert (blob.num, blob.channels, blob.height, blob.width) == (1, 3, 6, 5)
    np.testing.assert_allclose(np.array(blob.data).reshape(3, 6, 5), stack.mean(0), rtol=1e-6)
    # The encoded set holds images of different sizes: refused, naming the record.
    rc, _ = run_cli('compute_image_mean', os.path.join(IO, 'imageset_encoded_lmdb'),
                    tmp_path / 'bad.binaryproto')
    assert rc == 1
    with pytest.raises(caffeplus.CaffeplusError, match='Incorrect data field size .*img_01'):
        from caffeplus.commands.compute_image_mean import compute_mean
        compute_mean(os.path.join(IO, 'imageset_raw_lmdb'))


# -- extract_features ---------------------------------------------------------------
FEATURE_NET = """
name: "features"
layer { name: "data" type: "Data" top: "data" top: "label"
        data_param { source: "%s" batch_size: 8 backend: LMDB } }
layer { name: "ip" type: "InnerProduct" bottom: "data" top: "ip"
        inner_product_param { num_output: 3
          weight_filler { type: "gaussian" std: 0.01 } bias_filler { type: "constant" value: 1 } } }
"""


def test_extract_features(tmp_path):
    source = need(os.path.join(TRAINING, 'data', 'mnist_synth_test_lmdb'))
    model = tmp_path / 'features.prototxt'
    model.write_text(FEATURE_NET % source)
    net = caffeplus.Net(str(model), caffeplus.TEST)
    weights = str(tmp_path / 'features.caffemodel')
    net.save(weights)
    w, b = (np.asarray(p.data, np.float64) for p in net.params['ip'])
    del net
    rc, messages = run_cli('extract_features', weights, model, 'ip,data',
                           '%s,%s' % (tmp_path / 'ip_lmdb', tmp_path / 'data_lmdb'), 2, 'lmdb')
    assert rc == 0
    assert 'Successfully extracted the features!' in messages
    assert 'Extracted features of 16 query images for feature blob ip' in messages
    pixels = np.load(os.path.join(TRAINING, 'data', 'mnist_synth_test.npz'))['data'][:16]
    ip_items = lmdb_items(tmp_path / 'ip_lmdb')
    data_items = lmdb_items(tmp_path / 'data_lmdb')
    assert [k for k, _ in ip_items] == [b'%010d' % i for i in range(16)]
    for i, (_, value) in enumerate(data_items):
        d = datum(value)
        assert (d.channels, d.height, d.width) == (1, 28, 28)
        np.testing.assert_array_equal(np.array(d.float_data).reshape(1, 28, 28), pixels[i])
    for i, (_, value) in enumerate(ip_items):
        d = datum(value)
        assert (d.channels, d.height, d.width) == (3, 1, 1)
        expect = pixels[i].reshape(-1).astype(np.float64) @ w.T + b
        np.testing.assert_allclose(d.float_data, expect, rtol=1e-4)
    rc, _ = run_cli('extract_features', weights, model, 'nope', tmp_path / 'x', 1, 'lmdb')
    assert rc == 1


# -- parse_log -----------------------------------------------------------------------
@pytest.mark.parametrize('run', RUNS)
def test_parse_log_on_stock_logs(run, tmp_path):
    logfile = need(os.path.join(TRAINING, run, 'train.log'))
    from caffeplus.commands.parse_log import parse_log
    train, test = parse_log(logfile)
    ref = np.load(os.path.join(TRAINING, run, 'loss.npz'))
    assert [r['NumIters'] for r in train] == list(range(30))
    assert list(train[0]) == ['NumIters', 'Seconds', 'LearningRate', 'loss']
    # "Train net output" lines: the iteration's loss to 6 digits (loss_log is
    # the smoothed "Iteration N, loss" value, which drifts by ~1e-7).
    np.testing.assert_allclose([r['loss'] for r in train], ref['loss_blob'], rtol=1e-5,
                               atol=1e-7)
    np.testing.assert_allclose([r['loss'] for r in train], ref['loss_log'][:30], rtol=2e-5,
                               atol=1e-6)
    np.testing.assert_allclose([r['LearningRate'] for r in train], ref['lr'], rtol=1e-6)
    seconds = [r['Seconds'] for r in train]
    assert seconds == sorted(seconds) and 0 <= seconds[0] < 5
    assert [r['NumIters'] for r in test] == list(ref['test_iter'])
    assert list(test[0]) == ['NumIters', 'Seconds', 'LearningRate', 'accuracy', 'loss']
    np.testing.assert_allclose([r['accuracy'] for r in test], ref['test_accuracy'], rtol=1e-6)
    np.testing.assert_allclose([r['loss'] for r in test], ref['test_loss'], rtol=1e-5)
    # The CSV files, as Caffe's script writes them.
    rc, _ = run_cli('parse_log', logfile, tmp_path)
    assert rc == 0
    with open(tmp_path / 'train.log.train', newline='') as f:
        rows = list(csv.reader(f))
    assert rows[0] == ['NumIters', 'Seconds', 'LearningRate', 'loss']
    assert rows[1][0] == '0.0' and float(rows[1][3]) == train[0]['loss']
    assert len(rows) == 31
    with open(tmp_path / 'train.log.test', newline='') as f:
        rows = list(csv.reader(f))
    assert rows[0] == ['NumIters', 'Seconds', 'LearningRate', 'accuracy', 'loss']
    assert [float(r[0]) for r in rows[1:]] == [0, 10, 20, 30]


TINY_NET = """
name: "tiny"
layer { name: "data" type: "DummyData" top: "x" top: "y"
        dummy_data_param { shape { dim: 8 dim: 4 } shape { dim: 8 }
          data_filler { type: "gaussian" } data_filler { type: "constant" value: 1 } } }
layer { name: "ip" type: "InnerProduct" bottom: "x" top: "ip"
        inner_product_param { num_output: 3 weight_filler { type: "gaussian" std: 0.1 } } }
layer { name: "loss" type: "SoftmaxWithLoss" bottom: "ip" bottom: "y" top: "loss" }
layer { name: "acc" type: "Accuracy" bottom: "ip" bottom: "y" top: "acc"
        include { phase: TEST } }
"""

TINY_SOLVER = """
net: "tiny.prototxt"
test_iter: 1
test_interval: 2
base_lr: 0.1
lr_policy: "step"
gamma: 0.5
stepsize: 2
display: 1
max_iter: 5
snapshot_prefix: "tiny"
random_seed: 3
"""


def test_parse_log_on_a_caffeplus_log(tmp_path):
    (tmp_path / 'tiny.prototxt').write_text(TINY_NET)
    (tmp_path / 'solver.prototxt').write_text(TINY_SOLVER)
    logfile = tmp_path / 'caffeplus_train.log'
    handler = logging.FileHandler(str(logfile))
    handler.setFormatter(GlogFormatter())
    log.logger.addHandler(handler)
    old_level = log.logger.level
    log.logger.setLevel(logging.INFO)
    old = os.getcwd()
    os.chdir(str(tmp_path))
    try:
        caffeplus.get_solver('solver.prototxt').solve()
    finally:
        os.chdir(old)
        log.logger.removeHandler(handler)
        log.logger.setLevel(old_level)
        handler.close()
    from caffeplus.commands.parse_log import parse_log
    train, test = parse_log(str(logfile))
    assert [r['NumIters'] for r in train] == [0, 1, 2, 3, 4]
    assert [r['LearningRate'] for r in train] == pytest.approx([0.1, 0.1, 0.05, 0.05, 0.025])
    assert all(np.isfinite(r['loss']) for r in train)
    assert [r['NumIters'] for r in test] == [0, 2, 4]     # 5 is no multiple of 2
    assert set(test[0]) == {'NumIters', 'Seconds', 'LearningRate', 'acc', 'loss'}


def test_parse_log_timestamps_with_and_without_year(tmp_path):
    lines = [
        'I1231 23:59:58.000000  1 solver.cpp:289] Solving LeNet',
        'I1231 23:59:59.500000  1 solver.cpp:239] Iteration 0 (0 iter/s, 0s/1 iters), '
        'loss = 2.5',
        'I1231 23:59:59.500001  1 solver.cpp:258]     Train net output #0: loss = 2.5 '
        '(* 1 = 2.5 loss)',
        'I1231 23:59:59.600000  1 sgd_solver.cpp:112] Iteration 0, lr = 0.01',
        'I0101 00:00:01.000000  1 solver.cpp:239] Iteration 1 (1 iter/s, 1s/1 iters), '
        'loss = nan',
        'I0101 00:00:01.000001  1 solver.cpp:258]     Train net output #0: loss = nan',
        'I0101 00:00:01.100000  1 sgd_solver.cpp:112] Iteration 1, lr = 1e-3',
    ]
    path = tmp_path / 'old.log'
    path.write_text('\n'.join(lines) + '\n')
    from caffeplus.commands.parse_log import parse_log
    train, test = parse_log(str(path))
    assert test == []
    assert [r['NumIters'] for r in train] == [0, 1]
    assert [r['Seconds'] for r in train] == pytest.approx([1.500001, 3.000001])
    assert [r['LearningRate'] for r in train] == [0.01, 0.001]
    assert np.isnan(train[1]['loss'])
    path2 = tmp_path / 'new.log'
    path2.write_text('\n'.join('I2026' + l[1:] if l.startswith('I1231') else
                               'I2027' + l[1:] for l in lines) + '\n')
    train2, _ = parse_log(str(path2))
    assert [r['Seconds'] for r in train2] == pytest.approx([1.500001, 3.000001])


def test_parse_log_tool_script(tmp_path):
    logfile = need(os.path.join(TRAINING, 'sgd', 'train.log'))
    proc = subprocess.run([sys.executable, os.path.join(ROOT, 'tools', 'parse_log.py'),
                           logfile, str(tmp_path), '--delimiter', ';', '--verbose'],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    header = (tmp_path / 'train.log.test').read_text().splitlines()[0]
    assert header == 'NumIters;Seconds;LearningRate;accuracy;loss'


# -- plot_training_log ------------------------------------------------------------------
def test_plot_training_log_all_chart_types(tmp_path):
    pytest.importorskip('matplotlib')
    logs = [need(os.path.join(TRAINING, run, 'train.log')) for run in ('sgd', 'adam')]
    from caffeplus.commands.plot_training_log import chart_data
    for chart_type in range(8):
        out = tmp_path / ('chart_%d.png' % chart_type)
        rc, _ = run_cli('plot_training_log', chart_type, out, *logs)
        assert rc == 0
        assert out.read_bytes()[:8] == b'\x89PNG\r\n\x1a\n'
    xs, ys = chart_data(0, logs[0])
    assert xs == [0, 10, 20, 30] and ys[-1] == 1.0
    xs, ys = chart_data(7, logs[1])
    assert len(xs) == 30 and xs == sorted(xs)
    assert run_cli('plot_training_log', 8, tmp_path / 'x.png', logs[0])[0] == 1


# -- draw_net ---------------------------------------------------------------------------
def test_draw_net_graph_construction():
    pytest.importorskip('pydot')
    from caffeplus import draw
    from caffeplus.io.prototxt import read_net_param
    net = read_net_param(need(os.path.join(IO, 'lenet_train_test.prototxt')))
    graph = draw.get_pydot_graph(net, 'TB', phase=caffeplus.TRAIN)
    names = {n.get_name().strip('"') for n in graph.get_nodes()}
    assert {'mnist_Data', 'conv1_Convolution', 'pool1_Pooling', 'ip1_InnerProduct',
            'relu1_ReLU', 'loss_SoftmaxWithLoss', 'data_blob', 'label_blob'} <= names
    assert 'accuracy_Accuracy' not in names          # TEST only
    edges = {(e.get_source().strip('"'), e.get_destination().strip('"'))
             for e in graph.get_edges()}
    assert ('data_blob', 'conv1_Convolution') in edges
    assert ('conv1_Convolution', 'conv1_blob') in edges
    assert ('relu1_ReLU', 'ip1_blob') in edges and ('ip1_blob', 'relu1_ReLU') in edges
    conv = graph.get_node('"conv1_Convolution"')[0]
    assert 'kernel size: 5' in conv.get('label') and conv.get('fillcolor').strip('"') == '#FF5050'
    assert graph.get_rankdir() == 'TB'
    lr = draw.get_pydot_graph(net, 'LR', phase='TEST', display_lrm=True)
    assert 'accuracy_Accuracy' in {n.get_name().strip('"') for n in lr.get_nodes()}
    assert '\\n(Convolution)\\n' in lr.get_node('"conv1_Convolution"')[0].get('label')
    assert 'lr mult: 1, 2' in lr.to_string()
    edge = [e for e in lr.get_edges() if e.get_source() == '"conv1_Convolution"'][0]
    assert edge.get('label') == '"20"'
    with pytest.raises(caffeplus.CaffeplusError, match='rankdir'):
        draw.get_pydot_graph(net, 'XY')
    dot = draw.draw_net(net, 'BT', ext='dot').decode()
    assert dot.startswith('digraph') and 'rankdir=BT' in dot


def test_draw_net_renders_or_says_graphviz_is_missing(tmp_path, monkeypatch):
    pytest.importorskip('pydot')
    model = need(os.path.join(IO, 'lenet_train_test.prototxt'))
    if shutil.which('dot'):
        out = tmp_path / 'net.png'
        rc, _ = run_cli('draw_net', model, out, '--rankdir', 'TB', '--phase', 'TEST')
        assert rc == 0 and out.read_bytes()[:8] == b'\x89PNG\r\n\x1a\n'
        proc = subprocess.run([sys.executable, os.path.join(ROOT, 'tools', 'draw_net.py'),
                               model, str(tmp_path / 'net.svg')], capture_output=True,
                              text=True, timeout=120)
        assert proc.returncode == 0, proc.stderr
        assert b'<svg' in (tmp_path / 'net.svg').read_bytes()
    monkeypatch.setenv('PATH', str(tmp_path / 'empty'))
    from caffeplus import draw
    from caffeplus.io.prototxt import read_net_param
    with pytest.raises(caffeplus.CaffeplusError, match="Graphviz's `dot` program was not found"):
        draw.draw_net_to_file(read_net_param(model), str(tmp_path / 'x.png'))
    draw.draw_net_to_file(read_net_param(model), str(tmp_path / 'x.dot'))
    assert (tmp_path / 'x.dot').read_text().startswith('digraph')


def test_convert_imageset_progress_bar_only_on_a_terminal():
    import io
    from caffeplus.commands.convert_imageset import Progress

    class TTY(io.StringIO):
        def isatty(self):
            return True
    tty = TTY()
    bar = Progress(5000, stream=tty)
    bar.update(2500, force=True)
    assert '2500/5000 images' in tty.getvalue() and ' 50%' in tty.getvalue()
    bar.clear()
    assert tty.getvalue().endswith('\r\033[K')
    quiet = TTY()
    Progress(10, stream=quiet).update(5, force=True)          # short runs: no bar
    Progress(5000, enabled=False, stream=quiet).update(5, force=True)
    pipe = io.StringIO()
    Progress(5000, stream=pipe).update(5, force=True)          # not a terminal
    assert quiet.getvalue() == '' and pipe.getvalue() == ''


def test_max_batch_search_finds_the_largest_fitting_multiple():
    from benchmarks import max_batch
    assert max_batch.largest(lambda b: b <= 100, 16, 1000) == 96
    assert max_batch.largest(lambda b: True, 16, 1000) == 992
    assert max_batch.largest(lambda b: False, 16, 1000) == 0
    # The estimate: LeNet at batch 64 fits 1 GiB, not 1 MiB.
    from conftest import ROOT
    import os
    lenet = os.path.join(ROOT, 'examples', 'mnist', 'lenet_train_test.prototxt')
    if os.path.exists(lenet):
        assert max_batch.fits_estimate(lenet, 64, 2 ** 30) is not None
        assert max_batch.fits_estimate(lenet, 64, 2 ** 20) is None


def test_estimate_timeline_lists_the_steps_and_what_holds_the_peak(capsys):
    """dev/estimate_timeline.py: one line a step (2L + the end), the peak
    marked where the plan's live curve is highest, and at a step asked for
    the buffers live there, whose bytes add up to that step's line (a
    step's filter call half a step early counts once: none in LeNet's conv1
    forward)."""
    from dev import estimate_timeline
    path = os.path.join(ROOT, 'examples', 'mnist', 'lenet_train_test.prototxt')
    plan = estimate_timeline.main([path, '--plan', 'shared', '--steps', '1', '--min-mib', '0'])
    out = capsys.readouterr().out.splitlines()
    live = plan.live_curve()
    rows = [line for line in out if line[:3].strip().isdigit()]
    assert len(rows) == len(live)
    assert rows[1].split()[1:3] == ['F', 'conv1']
    peak = [i for i, line in enumerate(rows) if line.endswith('<- peak')]
    assert peak and all(live[i] == max(live) for i in peak)
    listed = out[out.index('step 1 (F conv1):') + 1:]
    total = sum(float(line.split()[-4]) for line in listed)      # '... 3.4 MiB  [1, 1]'
    assert abs(total - live[1] / 2.0 ** 20) < 0.05 * len(listed) + 1e-6
