"""Bad input: a clear one-line error naming what is wrong, exit 1, no traceback."""
import subprocess
import sys



GOOD = '''name: "tiny"
layer { name: "data" type: "Input" top: "x" input_param { shape { dim: 2 dim: 3 } } }
layer { name: "ip" type: "InnerProduct" bottom: "x" top: "y" inner_product_param { num_output: 2 } }
'''


def run_cli(*args, cwd=None):
    """Run `python -m caffeplus ARGS`; return (exit code, stdout+stderr)."""
    proc = subprocess.run([sys.executable, '-m', 'caffeplus'] + list(args), cwd=cwd,
                          capture_output=True, text=True, timeout=120)
    return proc.returncode, proc.stdout + proc.stderr


def write(tmp_path, name, text):
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def assert_clean_failure(rc, out, *needles):
    assert rc != 0, out
    assert 'Traceback' not in out, out
    for needle in needles:
        assert needle in out, (needle, out)


def test_malformed_prototxt_gives_file_line_column(tmp_path):
    path = write(tmp_path, 'bad.prototxt', GOOD.replace('num_output: 2 }', 'num_output: 2 ]'))
    rc, out = run_cli('time', '-model', path, '-iterations', '1')
    assert_clean_failure(rc, out, path + ':3:')


def test_fork_only_field_is_named_with_its_line(tmp_path):
    text = GOOD.replace('inner_product_param { num_output: 2 }',
                        'inner_product_param { num_output: 2 } cudnn_math_override: 1')
    path = write(tmp_path, 'fork.prototxt', text)
    rc, out = run_cli('time', '-model', path, '-iterations', '1')
    assert_clean_failure(rc, out, 'cudnn_math_override', path + ':3:')


def test_unknown_layer_type(tmp_path):
    text = GOOD + 'layer { name: "pb" type: "PriorBox" bottom: "y" top: "p" }\n'
    rc, out = run_cli('time', '-model', write(tmp_path, 'u.prototxt', text), '-iterations', '1')
    assert_clean_failure(rc, out, "'PriorBox'", "'pb'", 'Known types')


def test_missing_bottom(tmp_path):
    text = GOOD.replace('bottom: "x" top: "y"', 'bottom: "z" top: "y"')
    rc, out = run_cli('time', '-model', write(tmp_path, 'm.prototxt', text), '-iterations', '1')
    assert_clean_failure(rc, out, "'z'", "'ip'")


def test_weight_shape_mismatch(tmp_path):
    model = write(tmp_path, 'a.prototxt', GOOD)
    other = write(tmp_path, 'b.prototxt', GOOD.replace('num_output: 2', 'num_output: 3'))
    weights = str(tmp_path / 'b.caffemodel')
    import caffeplus
    caffeplus.Net(other, caffeplus.TEST).save(weights)
    rc, out = run_cli('test', '-model', model, '-weights', weights, '-iterations', '1')
    assert_clean_failure(rc, out, "layer 'ip'", 'param 0', '3 3 (9)', '2 3 (6)')


def test_truncated_caffemodel(tmp_path):
    model = write(tmp_path, 'a.prototxt', GOOD)
    weights = tmp_path / 'w.caffemodel'
    import caffeplus
    caffeplus.Net(model, caffeplus.TEST).save(str(weights))
    data = weights.read_bytes()
    weights.write_bytes(data[:len(data) - 7])
    rc, out = run_cli('test', '-model', model, '-weights', str(weights), '-iterations', '1')
    assert_clean_failure(rc, out, 'truncated')


def test_test_needs_weights(tmp_path):
    rc, out = run_cli('test', '-model', write(tmp_path, 'a.prototxt', GOOD), '-iterations', '1')
    assert_clean_failure(rc, out, 'weights')


def test_missing_file(tmp_path):
    rc, out = run_cli('time', '-model', str(tmp_path / 'nope.prototxt'), '-iterations', '1')
    assert_clean_failure(rc, out, 'nope.prototxt', 'not found')


def test_debug_shows_traceback(tmp_path):
    path = write(tmp_path, 'bad.prototxt', GOOD.replace('num_output: 2 }', 'num_output: 2 ]'))
    rc, out = run_cli('time', '-model', path, '-iterations', '1', '--debug')
    assert rc != 0 and 'Traceback' in out
