"""caffeplus.config: one table of settings, one order of precedence, the
environment read in one place."""
import argparse
import os
import re

import pytest

from caffeplus import config
from caffeplus.errors import CaffeplusError
from caffeplus.proto import caffe_pb2

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOC = os.path.join(ROOT, 'docs', 'configuration.md')


def solver_param(**fields):
    p = caffe_pb2.SolverParameter()
    for name, value in fields.items():
        setattr(p.caffeplus_param, name, value)
    return p


def net_param(**fields):
    p = caffe_pb2.NetParameter()
    for name, value in fields.items():
        setattr(p.caffeplus_param, name, value)
    return p


# -- precedence ----------------------------------------------------------------------
def test_each_source_wins_over_the_ones_below_it(monkeypatch):
    monkeypatch.delenv('CAFFEPLUS_DATA_WORKERS', raising=False)
    assert config.lookup('data_workers') == (0, 'the default')
    with config.command_defaults(data_workers=7):
        assert config.get('data_workers') == 7
        monkeypatch.setenv('CAFFEPLUS_DATA_WORKERS', '6')
        config.reload_environment()
        assert config.lookup('data_workers') == (6, 'CAFFEPLUS_DATA_WORKERS=6')
        with config.using(data_workers=5):
            assert config.get('data_workers') == 5
            with config.scope(solver_param(data_workers=4), 'solver'):
                assert config.get('data_workers') == 4
                with config.scope(net_param(data_workers=3), 'net'):
                    assert config.get('data_workers') == 3
                with config.flags_scope({'data_workers': 2}):
                    assert config.lookup('data_workers') == (2, '--data_workers')
                    # A flag wins over a net built inside it, too.
                    with config.scope(net_param(data_workers=3), 'net'):
                        assert config.get('data_workers') == 2
            assert config.get('data_workers') == 5
        assert config.get('data_workers') == 6
    monkeypatch.delenv('CAFFEPLUS_DATA_WORKERS')
    config.reload_environment()
    assert config.get('data_workers') == 0


def test_parameters_passed_to_get_count_as_their_scopes():
    solver = solver_param(nan_check='warn')
    assert config.get('nan_check') == 'stop'
    assert config.lookup('nan_check', solver=solver) == (
        'warn', "the solver's caffeplus_param.nan_check")
    with config.flags_scope({'nan_check': 'off'}):
        assert config.get('nan_check', solver=solver) == 'off'


def test_the_environment_is_read_once(monkeypatch):
    monkeypatch.setenv('CAFFEPLUS_RECOMPUTE', 'convs')
    assert config.get('recompute') == 'convs'
    monkeypatch.setenv('CAFFEPLUS_RECOMPUTE', 'off')
    assert config.get('recompute') == 'convs'
    config.reload_environment()
    assert config.get('recompute') == 'off'


def test_a_command_default_ends_with_the_command(monkeypatch):
    monkeypatch.delenv('CAFFEPLUS_CUDNN_SEARCH', raising=False)
    with config.command_defaults():
        config.set_command_default('cudnn_search', 'auto')
        assert config.get('cudnn_search') == 'auto'
    assert config.get('cudnn_search') == 'heuristic'


def test_a_solver_fields_reach_what_it_plans_and_checks():
    from caffeplus.solver import nan_check, update_in_backward
    param = solver_param(nan_check='off', update_in_backward=False)

    class Bare:
        pass
    solver = Bare()
    solver.param = param
    assert nan_check.configured_mode(solver) == 'off'
    assert not update_in_backward.enabled(solver)
    assert config.get('nan_check') == 'stop' and update_in_backward.enabled()


# -- parsing -----------------------------------------------------------------------
@pytest.mark.parametrize('name,text,value', [
    ('recompute', '', 'plan'), ('recompute', '1', 'on'), ('recompute', 'OFF', 'off'),
    ('recompute', 'convs', 'convs'), ('masks', 'no', 'off'), ('masks', 'true', 'on'),
    ('update_in_backward', '0', False), ('update_in_backward', 'yes', True),
    ('no_python_layers', 'on', True), ('cudnn_search', 'Timed', 'timed'),
    ('data_workers', ' 3 ', 3), ('calibration', 'a.json', 'a.json'),
])
def test_values_are_parsed_to_their_type(name, text, value):
    assert config.setting(name).check(text, 'x') == value or \
        (text == '' and config.setting(name).check(text, 'x') is None)


@pytest.mark.parametrize('name,text,message', [
    ('nan_check', 'sometimes', "CAFFEPLUS_NAN_CHECK must be one of stop, warn, off, "
                               "not 'sometimes'"),
    ('data_workers', 'many', "CAFFEPLUS_DATA_WORKERS must be a whole number, not 'many'"),
    ('data_workers', '-2', "CAFFEPLUS_DATA_WORKERS must be 0 or more, not '-2'"),
    ('update_in_backward', 'maybe', 'CAFFEPLUS_UPDATE_IN_BACKWARD must be 1 or 0'),
    ('recompute', 'sometimes', 'CAFFEPLUS_RECOMPUTE must be one of plan, off, on'),
])
def test_a_bad_environment_value_names_the_variable_and_the_value(monkeypatch, name, text,
                                                                  message):
    monkeypatch.setenv(config.setting(name).env, text)
    config.reload_environment()
    with pytest.raises(CaffeplusError, match=re.escape('the environment variable ' + message)):
        config.get(name)


def test_a_bad_field_or_flag_names_where_it_came_from():
    with pytest.raises(CaffeplusError, match=r"the solver's caffeplus_param.masks must be one "
                                             r"of plan, off, on, not 'half'"):
        config.get('masks', solver=solver_param(masks='half'))
    with pytest.raises(CaffeplusError, match=r"--cudnn_search must be one of"):
        config.flags_scope({'cudnn_search': 'fastest'})
    with pytest.raises(CaffeplusError, match="no setting named 'recompte'"):
        config.set('recompte', 'on')


def test_cli_flags_parse_and_win(monkeypatch):
    parser = argparse.ArgumentParser()
    config.add_arguments(parser, 'train')
    args = parser.parse_args(['--recompute', 'convs', '--nan-check', 'warn'])
    monkeypatch.setenv('CAFFEPLUS_RECOMPUTE', 'off')
    with config.cli_scope(args):
        assert config.lookup('recompute') == ('convs', '--recompute')
        assert config.get('nan_check', solver=solver_param(nan_check='off')) == 'warn'
        assert config.flag_values() == {'recompute': 'convs', 'nan_check': 'warn'}
    assert config.get('recompute') == 'off'


def test_train_copies_setting_flags_into_the_solver_for_other_ranks(tmp_path):
    from caffeplus.commands import train
    (tmp_path / 'net.prototxt').write_text('name: "n"')
    solver = tmp_path / 'solver.prototxt'
    solver.write_text('net: "%s"\nbase_lr: 0.1\n' % (tmp_path / 'net.prototxt'))
    parser = argparse.ArgumentParser()
    train.add_arguments(parser)
    args = parser.parse_args(['--solver', str(solver), '--update_in_backward', '0',
                              '--masks', 'on', '--calibration', 'c.json'])
    cp = train.build_solver_param(args).caffeplus_param
    assert cp.update_in_backward is False and cp.HasField('update_in_backward')
    assert cp.masks == 'on' and cp.calibration == os.path.abspath('c.json')
    assert not cp.HasField('recompute') and not cp.HasField('nan_check')


# -- one place --------------------------------------------------------------------
def _package_sources():
    for top in ('caffeplus', 'layers'):
        for folder, _, files in os.walk(os.path.join(ROOT, top)):
            for name in files:
                if name.endswith('.py'):
                    yield os.path.join(folder, name)


ENV_READ = re.compile(r"(?:os\.environ(?:\.get)?\s*[\[(]|os\.getenv\s*\(|env\.get\s*\()"
                      r"\s*'(_?CAFFEPLUS_[A-Z0-9_]+)'")


def test_only_config_reads_caffeplus_variables():
    """No module but caffeplus/config.py reads a CAFFEPLUS_ variable; the
    parallel launcher's private protocol (_CAFFEPLUS_*) only in parallel/."""
    found = []
    for path in _package_sources():
        rel = os.path.relpath(path, ROOT)
        if rel == os.path.join('caffeplus', 'config.py'):
            continue
        with open(path) as f:
            text = f.read()
        for name in ENV_READ.findall(text):
            private = name.startswith('_') and rel.startswith(os.path.join('caffeplus',
                                                                           'parallel'))
            if not private:
                found.append((rel, name))
        # A name kept in a constant and read through it counts too.
        for const, name in re.findall(r"^(\w+) = '(CAFFEPLUS_[A-Z0-9_]+)'", text, re.M):
            if re.search(r"environ(?:\.get)?\s*[\[(]\s*%s\b" % const, text):
                found.append((rel, name))
    assert not found, found


def test_every_documented_variable_is_a_setting_and_the_other_way_round():
    with open(DOC) as f:
        doc = f.read()
    documented = set(re.findall(r'`(CAFFEPLUS_[A-Z0-9_]+)`', doc))
    table = {s.env for s in config.SETTINGS.values() if s.env}
    assert documented == table
    assert len(table) <= 10
    for s in config.SETTINGS.values():
        assert '`%s`' % s.name in doc, s.name
        if s.flag:
            assert '`%s`' % s.flag in doc, s.flag
        if s.solver_field:
            assert 'caffeplus_param.%s' % s.solver_field in doc, s.solver_field


def test_every_schema_field_a_setting_names_exists():
    solver_fields = caffe_pb2.CaffeplusSolverParameter.DESCRIPTOR.fields_by_name
    net_fields = caffe_pb2.CaffeplusNetParameter.DESCRIPTOR.fields_by_name
    for s in config.SETTINGS.values():
        assert s.solver_field is None or s.solver_field in solver_fields, s.name
        assert s.net_field is None or s.net_field in net_fields, s.name
