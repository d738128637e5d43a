"""Text and binary protobuf files: parse with clear errors, upgrade old formats.

Errors name the file, the line and column, and protobuf's own message, so a
user can find the typo; fields that stock Caffe does not know (fork-only
fields) are reported the same way. A mistyped field or enum value name gets
the closest known name as a suggestion (Caffe offers none).
"""
import difflib
import re

from google.protobuf import descriptor_pool
from google.protobuf import message as pb_message
from google.protobuf import text_format

from caffeplus.errors import FormatError
from caffeplus.proto import caffe_pb2


def _read_bytes(path, what):
    try:
        with open(path, 'rb') as f:
            return f.read()
    except FileNotFoundError:
        raise FormatError('%s file not found: %s' % (what, path))
    except IsADirectoryError:
        raise FormatError('%s path is a directory, not a file: %s' % (what, path))
    except OSError as exc:
        raise FormatError('cannot read %s file %s: %s' % (what, path, exc.strerror or exc))
    except ValueError as exc:       # a NUL byte in the name (from a fuzzed or binary file)
        raise FormatError('cannot read %s file %r: %s' % (what, path, exc))


def parse_text(text, message, source='<string>'):
    """Parse prototxt `text` into `message`; errors name source:line:col."""
    if isinstance(text, bytes):
        try:
            text = text.decode('utf-8')
        except UnicodeDecodeError as exc:
            raise FormatError('%s: not a text protobuf file (invalid UTF-8 at byte %d)'
                              % (source, exc.start))
    try:
        text_format.Merge(text, message)
    except text_format.ParseError as exc:
        line, col = exc.GetLine(), exc.GetColumn()
        msg = str(exc)
        # protobuf prefixes "line:col : "; keep only the explanation.
        if line is not None and msg.startswith('%s:%s' % (line, col)):
            msg = msg.split(':', 2)[-1].lstrip(' :')
        where = '%s:%s:%s' % (source, line, col) if line is not None else source
        raise FormatError('%s: %s' % (where, with_suggestion(msg)))
    return message


def did_you_mean(word, choices):
    """The one of `choices` closest to the mistyped `word` (case ignored:
    `max` finds MAX), or None when none is close."""
    by_lower = {}
    for choice in choices:
        by_lower.setdefault(choice.lower(), choice)
    close = difflib.get_close_matches(word.lower(), list(by_lower), n=1, cutoff=0.6)
    return by_lower[close[0]] if close else None


_UNKNOWN_FIELD = re.compile(r'Message type "([\w.]+)" has no field named "(\w+)"\.?$')
_UNKNOWN_ENUM_VALUE = re.compile(r'Enum type "([\w.]+)" has no value named (\w+)\.?$')


def _known_names(kind, full_name):
    pool = descriptor_pool.Default()
    try:
        if kind == 'field':
            return [f.name for f in pool.FindMessageTypeByName(full_name).fields]
        return [v.name for v in pool.FindEnumTypeByName(full_name).values]
    except KeyError:
        return []


def with_suggestion(msg):
    """protobuf's parse error, with '; did you mean "num_output"?' where it
    names an unknown field or enum value that is close to a known one."""
    for kind, pattern in (('field', _UNKNOWN_FIELD), ('value', _UNKNOWN_ENUM_VALUE)):
        m = pattern.search(msg)
        if m:
            guess = did_you_mean(m.group(2), _known_names(kind, m.group(1)))
            if guess is not None:
                return '%s; did you mean "%s"?' % (msg.rstrip('.'), guess)
    return msg


def read_text(path, message, what='prototxt'):
    return parse_text(_read_bytes(path, what), message, path)


def read_binary(path, message, what='binary protobuf'):
    data = _read_bytes(path, what)
    try:
        message.ParseFromString(data)
    except (pb_message.DecodeError, RuntimeError, ValueError) as exc:
        raise FormatError('%s: not a valid %s file (truncated or not protobuf: %s)'
                          % (path, what, exc))
    return message


def write_text(message, path):
    """Write a message as Caffe's tools write prototxt text."""
    from caffeplus.io.atomic import atomic_write
    from caffeplus.io.upgrade import message_to_text
    with atomic_write(path, 'w') as f:
        f.write(message_to_text(message))


def read_net_param(path):
    """A NetParameter from a prototxt, upgraded to the current format."""
    from caffeplus.io import upgrade
    param = read_text(path, caffe_pb2.NetParameter(), 'net')
    return upgrade.upgrade_net_as_needed(param, path)


def read_net_param_binary(path):
    """A NetParameter from a .caffemodel, upgraded to the current format."""
    from caffeplus.io import upgrade
    param = read_binary(path, caffe_pb2.NetParameter(), 'caffemodel')
    return upgrade.upgrade_net_as_needed(param, path)


def read_solver_param(path):
    from caffeplus.io import upgrade
    param = read_text(path, caffe_pb2.SolverParameter(), 'solver')
    return upgrade.upgrade_solver_as_needed(param, path)


def is_solver_text(text):
    """Guess whether prototxt text is a solver (True) or a net (False)."""
    try:
        parse_text(text, caffe_pb2.SolverParameter())
        return True
    except FormatError:
        return False
