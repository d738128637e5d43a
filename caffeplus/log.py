"""Logging in glog's line format, so Caffe log parsers keep working.

    I1122 07:18:59.142027 20030 net.py:131] Top shape: 64 20 24 24 (737280)

Caffe writes its log to stderr (GLOG_logtostderr=1 is the common setting);
caffeplus does the same. GLOG_minloglevel is honoured (0 INFO .. 3 FATAL).
"""
import collections.abc
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
        return self.line(record.levelno, record.created, record.process, record.filename,
                         record.lineno, record.getMessage())

    def line(self, levelno, created, process, filename, lineno, message):
        """One glog line (no newline)."""
        second = int(created)
        if second != self._second:
            self._stamp = time.strftime('%Y%m%d %H:%M:%S', time.localtime(second))
            self._second = second
        return '%s%s.%06d %5d %s:%d] %s' % (
            _LEVEL_CHAR.get(levelno, 'I'), self._stamp, int((created - second) * 1e6),
            process, filename, lineno, message)


class GlogHandler(logging.StreamHandler):
    """Glog lines on a stream (stderr by default): caffeplus's own handler.
    While it is the only place caffeplus's INFO lines go, log.info writes
    them to its stream itself (see info)."""

    def __init__(self, stream=None):
        super().__init__(stream)
        self.setFormatter(GlogFormatter())


logger = logging.getLogger('caffeplus')


def _configure():
    if logger.handlers:
        return
    logger.addHandler(GlogHandler(sys.stderr))
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


def _sole_glog_handler(level):
    """The GlogHandler a record at `level` would reach alone, unfiltered and
    formatted as glog's lines (None when any other handler, filter or
    formatter would see it)."""
    handlers = logger.handlers
    if len(handlers) != 1 or logger.filters or logger.propagate or logger.disabled:
        return None
    handler = handlers[0]
    if type(handler) is not GlogHandler or handler.filters or level < handler.level \
            or type(handler.formatter) is not GlogFormatter:
        return None
    return handler


def info(msg, *args, **kwargs):
    """An INFO line from the caller's file and line. Where the line goes to
    caffeplus's GlogHandler alone (the command line's setting), it is
    formatted and written here, as glog does: through logging's record and
    handler machinery each line cost as much as a layer's setup, and a
    build logs about ten lines a layer. The line is the one logging would
    write; anything else attached gets logging's records."""
    if not logger.isEnabledFor(logging.INFO):
        return
    # (exc_info, stack_info, extra, stacklevel: logging's own path.)
    handler = None if kwargs else _sole_glog_handler(logging.INFO)
    if handler is not None:
        caller = sys._getframe(1)
        try:
            values = args
            if len(args) == 1 and isinstance(args[0], collections.abc.Mapping) and args[0]:
                values = args[0]                # logging's "%(key)s" form
            message = str(msg) % values if values else str(msg)
            text = handler.formatter.line(logging.INFO, time.time(), os.getpid(),
                                          _basename(caller.f_code.co_filename),
                                          caller.f_lineno, message)
            with handler.lock:
                handler.stream.write(text + handler.terminator)
                handler.flush()
            return
        except Exception:       # logging's own path reports it as logging does
            pass
    kwargs['stacklevel'] = kwargs.get('stacklevel', 1) + 1
    logger.info(msg, *args, **kwargs)


_BASENAMES = {}


def _basename(path):
    name = _BASENAMES.get(path)
    if name is None:
        name = _BASENAMES[path] = os.path.basename(path)
    return name


warning = logger.warning
error = logger.error


class _CallableModule(types.ModuleType):
    """pycaffe's caffe.log(message) is a function (an INFO line), while this
    module is caffeplus.log, which every module imports: calling the module
    logs the message."""

    def __call__(self, message):
        logger.info('%s', message, stacklevel=2)


sys.modules[__name__].__class__ = _CallableModule
