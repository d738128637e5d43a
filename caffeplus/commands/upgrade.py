"""caffeplus upgrade IN OUT: Caffe's upgrade_net_proto_text,
upgrade_solver_proto_text and upgrade_net_proto_binary in one command.

    caffeplus upgrade old_net.prototxt new_net.prototxt
    caffeplus upgrade old_solver.prototxt new_solver.prototxt
    caffeplus upgrade old.caffemodel new.caffemodel

Whether IN is a net or a solver is read from its fields (--net / --solver
decide when a file could be either). A file ending in .caffemodel (or with
--binary) is read and written as binary protobuf. The output is written
atomically, in the text layout Caffe's tools write.

Where stock Caffe would drop a setting it cannot convert (and carry on), the
command stops with an error naming the file, the layer and the field, and
writes nothing; --keep-going instead writes what Caffe would write, logs
Caffe's error lines and exits 1, as the stock tools do.
"""
import re

from caffeplus import log
from caffeplus.errors import FormatError
from caffeplus.io import prototxt
from caffeplus.io import upgrade
from caffeplus.io.atomic import atomic_write
from caffeplus.proto import caffe_pb2

# Fields only a solver has; used to tell which kind a broken file meant to be.
_SOLVER_WORDS = re.compile(
    r'^\s*(net|train_net|test_net|net_param|train_net_param|test_net_param|base_lr|lr_policy|'
    r'max_iter|solver_type|solver_mode|test_iter|test_interval|snapshot_prefix|stepsize|'
    r'momentum|weight_decay|display|snapshot|regularization_type)\s*[:{]', re.M)
_NET_WORDS = re.compile(r'^\s*(layer|layers|input|input_dim|input_shape)\s*[:{]', re.M)


def add_arguments(parser):
    parser.add_argument('input', metavar='IN',
                        help='old net prototxt, solver prototxt or .caffemodel')
    parser.add_argument('output', metavar='OUT', help='where to write the upgraded file')
    kind = parser.add_mutually_exclusive_group()
    kind.add_argument('--net', dest='kind', action='store_const', const='net',
                      help='IN is a net (NetParameter)')
    kind.add_argument('--solver', dest='kind', action='store_const', const='solver',
                      help='IN is a solver (SolverParameter)')
    parser.add_argument('--binary', action='store_true',
                        help='IN and OUT are binary NetParameters (the default for '
                             '.caffemodel files)')
    parser.add_argument('--keep-going', action='store_true',
                        help='as stock Caffe: drop what cannot be converted, write the '
                             'result anyway and exit 1')


def run(args):
    if args.binary or args.input.endswith('.caffemodel'):
        if args.kind == 'solver':
            raise FormatError('a binary file is upgraded as a net (.caffemodel), not a solver')
        return _upgrade_binary(args)
    raw = prototxt._read_bytes(args.input, 'input')
    try:
        text = raw.decode('utf-8')
    except UnicodeDecodeError as exc:
        raise FormatError('%s: not a text prototxt (invalid UTF-8 at byte %d); for weights '
                          'use a .caffemodel name or --binary' % (args.input, exc.start))
    kind = args.kind or _guess_kind(text, args.input)
    if kind == 'solver':
        return _upgrade_solver_text(args, text)
    return _upgrade_net_text(args, text)


def _guess_kind(text, path):
    try:
        prototxt.parse_text(text, caffe_pb2.NetParameter(), path)
        return 'net'
    except FormatError:
        pass
    try:
        prototxt.parse_text(text, caffe_pb2.SolverParameter(), path)
        return 'solver'
    except FormatError:
        pass
    # Neither parses: report the error of the kind the file looks like.
    if _NET_WORDS.search(text) or not _SOLVER_WORDS.search(text):
        return 'net'
    return 'solver'


def _parse(text, message, path):
    try:
        return prototxt.parse_text(text, message, path)
    except FormatError as exc:
        where = _layer_at(text, _error_line(str(exc), path))
        if where:
            raise FormatError('%s (in %s)' % (exc, where))
        raise


def _upgrade_net_text(args, text):
    param = _parse(text, caffe_pb2.NetParameter(), args.input)
    ok = True
    if upgrade.net_needs_upgrade(param):
        ok = upgrade.upgrade_net(param, args.input, strict=not args.keep_going)
        if not ok:
            log.error('Encountered error(s) while upgrading prototxt; see details above.')
    else:
        log.error('File already in latest proto format: %s', args.input)
    _write_text(args.output, upgrade.message_to_text(param))
    log.info('Wrote upgraded NetParameter text proto to %s', args.output)
    return 0 if ok else 1


def _upgrade_solver_text(args, text):
    param = _parse(text, caffe_pb2.SolverParameter(), args.input)
    ok = True
    if upgrade.solver_needs_upgrade(param):
        ok = upgrade.upgrade_solver(param, args.input)
        if not ok:
            log.error('Encountered error(s) while upgrading prototxt; see details above.')
    else:
        log.error('File already in latest proto format: %s', args.input)
    _write_text(args.output, upgrade.message_to_text(param))
    log.info('Wrote upgraded SolverParameter text proto to %s', args.output)
    return 0 if ok else 1


def _upgrade_binary(args):
    param = prototxt.read_binary(args.input, caffe_pb2.NetParameter(), 'caffemodel')
    ok = True
    if upgrade.net_needs_upgrade(param):
        ok = upgrade.upgrade_net(param, args.input, strict=not args.keep_going)
        if not ok:
            log.error('Encountered error(s) while upgrading prototxt; see details above.')
    else:
        log.error('File already in latest proto format: %s', args.input)
    with atomic_write(args.output, 'wb') as f:
        f.write(param.SerializeToString())
    log.info('Wrote upgraded NetParameter binary proto to %s', args.output)
    return 0 if ok else 1


def _write_text(path, text):
    try:
        with atomic_write(path, 'w') as f:
            f.write(text)
    except OSError as exc:
        raise FormatError('cannot write %s: %s' % (path, exc.strerror or exc))


# ---------------------------------------------------------------------------
# Naming the layer a parse error sits in

def _error_line(message, path):
    m = re.match(re.escape(path) + r':(\d+):', message)
    return int(m.group(1)) if m else None


def _strip_comment(line):
    out, quote = [], None
    i = 0
    while i < len(line):
        c = line[i]
        if quote:
            if c == '\\':
                out.append(line[i:i + 2])
                i += 2
                continue
            if c == quote:
                quote = None
        elif c in '"\'':
            quote = c
        elif c == '#':
            break
        out.append(c)
        i += 1
    return ''.join(out)


_TOKEN = re.compile(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'|[{}]|[A-Za-z_][A-Za-z0-9_]*|[^\s]')


def _layer_at(text, line_no):
    """"layer 'conv1'" for the top-level layer/layers block holding line
    `line_no` (1-based), or None."""
    if not line_no:
        return None
    stack = []          # field names of the open blocks
    current = None      # [kind, name, start line] of the open top-level layer block
    found = None
    prev = []
    for n, line in enumerate(text.splitlines(), 1):
        for tok in _TOKEN.findall(_strip_comment(line)):
            if tok == '{':
                name = prev[-1] if prev and prev[-1] != ':' else (prev[-2] if len(prev) > 1
                                                                   else '')
                stack.append(name)
                if len(stack) == 1 and name in ('layer', 'layers'):
                    current = [name, None, n]
            elif tok == '}':
                if stack:
                    stack.pop()
                if not stack and current is not None:
                    if current[2] <= line_no <= n:
                        found = current
                    current = None
            elif current is not None and tok[0] in '"\'' and len(prev) >= 2 and \
                    prev[-1] == ':' and prev[-2] == 'name' and current[1] is None and \
                    (len(stack) == 1 or stack[1:] == ['layer']):
                current[1] = tok[1:-1]
            prev = (prev + [tok])[-3:]
        if found is not None:
            break
    if found is None and current is not None and current[2] <= line_no:
        found = current
    if found is None:
        return None
    if found[1]:
        return "layer '%s'" % found[1]
    return 'the layer block starting at line %d' % found[2]
