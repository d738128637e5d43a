"""caffeplus's log: glog's line format, written by log.info itself where
caffeplus's GlogHandler is the only place the line goes, and by logging's
records and handlers otherwise; both write the same lines."""
import io
import logging
import os
import re

import pytest

import caffeplus
from caffeplus import log

_GLOG = re.compile(r'^([IWEF])(\d{8} \d\d:\d\d:\d\d\.\d{6}) +(\d+) ([^ :]+):(\d+)\] (.*)$')


@pytest.fixture
def logger_state():
    handlers, level = log.logger.handlers[:], log.logger.level
    filters = log.logger.filters[:]
    yield log.logger
    log.logger.handlers = handlers
    log.logger.setLevel(level)
    log.logger.filters = filters


def _lines(text):
    """(level, pid, file, line, message) of each glog line, time left out."""
    found = []
    for line in text.splitlines():
        match = _GLOG.match(line)
        if match:
            level, _, pid, filename, number, message = match.groups()
            found.append((level, int(pid), filename, int(number), message))
    return found


def _records_made(monkeypatch):
    """Counts the records logging makes for caffeplus's logger."""
    made = []
    real = log.logger.makeRecord

    def make(*args, **kwargs):
        made.append(args)
        return real(*args, **kwargs)
    monkeypatch.setattr(log.logger, 'makeRecord', make)
    return made


class _Formatted(logging.StreamHandler):
    """A handler of the user's own: logging's records, formatted as glog's."""

    def __init__(self, stream):
        super().__init__(stream)
        self.setFormatter(log.GlogFormatter())


LENET = os.path.join(os.path.dirname(__file__), 'data', 'reference', 'cli',
                     'lenet_dummy_b64.prototxt')


def _build_log(handler):
    log.logger.handlers = [handler]
    log.logger.setLevel(logging.INFO)
    caffeplus.set_mode_cpu()
    caffeplus.Net(LENET, caffeplus.TRAIN)


def test_a_builds_lines_are_the_same_written_directly_or_through_logging(logger_state,
                                                                          monkeypatch):
    made = _records_made(monkeypatch)
    direct, through = io.StringIO(), io.StringIO()
    _build_log(log.GlogHandler(direct))
    records_for_direct = len(made)
    _build_log(_Formatted(through))
    ours, theirs = _lines(direct.getvalue()), _lines(through.getvalue())
    assert len(ours) > 60 and ours == theirs
    messages = [m for _, _, _, _, m in ours]
    assert any(m.startswith('Initializing net from parameters') for m in messages)
    assert messages[-1] == 'Network initialization done.'
    assert {f for _, _, f, _, _ in ours} >= {'net.py'}
    assert ours[0][1] == os.getpid()
    # The first build wrote every line itself; the second made a record each.
    assert records_for_direct == 0 and len(made) == len(theirs)


@pytest.mark.parametrize('attach', [
    lambda logger, handler: logger.addHandler(logging.NullHandler()),
    lambda logger, handler: logger.addFilter(lambda record: True),
    lambda logger, handler: handler.addFilter(lambda record: True),
    lambda logger, handler: handler.setFormatter(logging.Formatter('%(message)s')),
    lambda logger, handler: handler.setLevel(logging.WARNING),
], ids=['another handler', 'logger filter', 'handler filter', 'other formatter',
        'handler level'])
def test_anything_else_attached_gets_loggings_records(logger_state, attach):
    seen = []
    stream = io.StringIO()
    handler = log.GlogHandler(stream)
    log.logger.handlers = [handler]
    log.logger.setLevel(logging.INFO)
    attach(log.logger, handler)
    log.logger.addFilter(lambda record: seen.append(record.getMessage()) or True)
    log.info('Top shape: %s (%d)', '64 20 24 24', 737280)
    assert seen == ['Top shape: 64 20 24 24 (737280)']


@pytest.mark.parametrize('args, message', [
    (('Top shape: %s (%d)', '64 20 24 24', 737280), 'Top shape: 64 20 24 24 (737280)'),
    (('layer %(name)s', {'name': 'conv1'}), 'layer conv1'),
    (('100% done',), '100% done'),
    ((7,), '7'),
])
def test_info_formats_as_logging_does(logger_state, monkeypatch, args, message):
    made = _records_made(monkeypatch)
    stream = io.StringIO()
    log.logger.handlers = [log.GlogHandler(stream)]
    log.logger.setLevel(logging.INFO)
    log.info(*args); here = _this_line()
    (level, pid, filename, number, text), = _lines(stream.getvalue())
    assert (level, pid, filename, number, text) == ('I', os.getpid(), 'test_log.py', here,
                                                      message)
    assert made == []


def test_a_bad_format_is_reported_as_logging_reports_it(logger_state, capsys):
    stream = io.StringIO()
    log.logger.handlers = [log.GlogHandler(stream)]
    log.logger.setLevel(logging.INFO)
    log.info('%d layers', 'three')
    assert stream.getvalue() == ''
    assert 'Logging error' in capsys.readouterr().err


def test_logging_keywords_take_loggings_path(logger_state, monkeypatch):
    made = _records_made(monkeypatch)
    stream = io.StringIO()
    log.logger.handlers = [log.GlogHandler(stream)]
    log.logger.setLevel(logging.INFO)
    try:
        raise ValueError('bad')
    except ValueError:
        log.info('failed: %s', 'x', exc_info=True); here = _this_line()
    (args,) = made
    name, level, filename, lineno, msg, values, exc_info = args[:7]
    assert exc_info[0] is ValueError and lineno == here and filename == __file__
    (level, _, filename, number, text), = _lines(stream.getvalue())
    assert (level, filename, number, text) == ('I', 'test_log.py', here, 'failed: x')


def test_nothing_is_written_below_the_level(logger_state):
    stream = io.StringIO()
    log.logger.handlers = [log.GlogHandler(stream)]
    log.logger.setLevel(logging.WARNING)
    log.info('quiet')
    log.warning('loud')
    (level, _, _, _, text), = _lines(stream.getvalue())
    assert (level, text) == ('W', 'loud')


def _this_line():
    import sys
    return sys._getframe(1).f_lineno
