"""Logging in glog's line format, so Caffe log parsers keep working.

    I1122 07:18:59.142027 20030 net.py:131] Top shape: 64 20 24 24 (737280)

Caffe writes its log to stderr (GLOG_logtostderr=1 is the common setting);
caffeplus does the same. GLOG_minloglevel is honoured (0 INFO .. 3 FATAL).
"""
import logging
import os
import sys
import time
import types

_LEVEL_CHAR = {logging.DEBUG: 'I', logging.INFO: 'I', logging.WARNING: 'W',
               logging.ERROR: 'E', logging.CRITICAL: 'F'}


class GlogFormatter(logging.Formatter):
    # A net's build logs a few lines per layer; strftime for each line was a
    # quarter of the cost of logging it, and the stamp changes once a second.
    _second, _stamp = None, ''

    def format(self, record):
        t = record.created
        second = int(t)
        if second != self._second:
            self._stamp = time.strftime('%Y%m%d %H:%M:%S', time.localtime(second))
            self._second = second
        head = '%s%s.%06d %5d %s:%d] ' % (
            _LEVEL_CHAR.get(record.levelno, 'I'), self._stamp, int((t - second) * 1e6),
            record.process, record.filename, record.lineno)
        return head + record.getMessage()


logger = logging.getLogger('caffeplus')


def _configure():
    if logger.handlers:
        return
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(GlogFormatter())
    logger.addHandler(handler)
    logger.propagate = False
    levels = {0: logging.INFO, 1: logging.WARNING, 2: logging.ERROR, 3: logging.CRITICAL}
    try:
        minlevel = int(os.environ.get('GLOG_minloglevel', '0'))
    except ValueError:
        minlevel = 0
    logger.setLevel(levels.get(minlevel, logging.INFO))


_configure()


def set_level(level):
    """Set the minimum level: an int in glog's scale or a logging level."""
    if isinstance(level, int) and level <= 3:
        level = {0: logging.INFO, 1: logging.WARNING, 2: logging.ERROR, 3: logging.CRITICAL}[level]
    logger.setLevel(level)


info = logger.info
warning = logger.warning
error = logger.error


class _CallableModule(types.ModuleType):
    """pycaffe's caffe.log(message) is a function (an INFO line), while this
    module is caffeplus.log, which every module imports: calling the module
    logs the message."""

    def __call__(self, message):
        logger.info('%s', message, stacklevel=2)


sys.modules[__name__].__class__ = _CallableModule
