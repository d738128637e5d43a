#!/usr/bin/env python
"""Fuzz caffeplus's readers: a hostile file gives a result or a CaffeplusError.

    python dev/fuzz_readers.py --seconds 600
    python dev/fuzz_readers.py --seconds 60 --targets net_text,datum --seed 7 --out fuzz-out

Every target takes the bytes of one file (or record) and runs it through a
reader, the way a user's file would go: the prototxt reader and upgrader
(and building a Net, in CPU mode, from what parses), .caffemodel,
.solverstate and .binaryproto files, HDF5 weights and solver states, Datum
records (raw and encoded) and the image list of an ImageData layer. The
property checked on every input:

  * the reader returns, or raises a caffeplus CaffeplusError whose message
    is not empty;
  * it raises no other exception type (IndexError, ValueError, MemoryError,
    OverflowError, ... are bugs), does not crash the interpreter, does not
    hang (each example runs under a time limit) and does not allocate memory
    sized by an untrusted field (the worker runs under an address-space
    limit, so such an allocation shows up as MemoryError).

Inputs come from seeds (the stock-Caffe files of /work/shared: zoo
prototxts in their V0/V1/V2 forms, reference caffemodels, solver states,
binaryprotos, LMDB Datums and images) changed by mutations (byte flips,
truncations, insertions, deletions, splices of two seeds, interesting
varints and numbers, prototxt-aware token swaps), and from generators
that build structurally valid inputs with hostile values (Datums claiming
2^31 channels, blob shapes claiming terabytes, HDF5 files with missing
datasets or the wrong dtypes, nets with huge layer parameters).

Each example runs in a worker process (`--worker`), so a crash or a hang
is seen and the worker restarted. Failing inputs are written to --out
with the traceback. The exit status is 1 when a bug was found.

The module doubles as the library of tests/test_fuzz_readers.py, which
runs a small fixed budget through hypothesis; here a deterministic
random.Random drives the same generators and mutations.
"""
import argparse
import base64
import collections
import faulthandler
import hashlib
import io
import json
import os
import random
import resource
import select
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import time
import traceback

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)
SHARED = os.environ.get('CAFFEPLUS_SHARED', os.path.join(ROOT, 'tests', 'data'))
REFERENCE = os.path.join(SHARED, 'reference')
ZOO = os.path.join(SHARED, 'zoo')

# Bounds the worker runs under. The blob bound is lowered from caffeplus's
# own (2^34 values) so that shapes a fuzzed file claims stay cheap to refuse
# or to build; the address-space limit turns any allocation that escapes a
# bound check into a MemoryError (a reported bug).
FUZZ_MAX_BLOB_COUNT = 2 ** 24
MEMORY_LIMIT_BYTES = 3 * 2 ** 30
EXAMPLE_TIME_LIMIT = 20.0
MAX_MESSAGE_CHARS = 4000

INTERESTING_INTS = (0, 1, -1, 2, 3, 7, 255, 256, 4096, 65535, 65536, 2 ** 24, 2 ** 31 - 1,
                    2 ** 31, -2 ** 31, 2 ** 32 - 1, 2 ** 32, 2 ** 40, 10 ** 12, 2 ** 62,
                    2 ** 63 - 1, -2 ** 63, 2 ** 64 - 1)
INTERESTING_NUMBER_TEXT = ('0', '-1', '1', '2', '3', '100', '65536', '2147483647', '2147483648',
                           '4294967296', '1000000000000', '9223372036854775807',
                           '18446744073709551616', '-9223372036854775808', '0.5', '-0.0',
                           '1e38', '1e39', '1e400', '-1e400', 'nan', 'inf', '-inf', '0x7fffffff',
                           '1e-45')
INTERESTING_STRINGS = ('', '.', '..', '/', 'x' * 300, '\\x00', 'caf\\xc3\\xa9', '\\xff\\xfe',
                       'data', 'label', 'loss', 'conv1', 'ip1', 'Input', 'Python', 'HDF5Output',
                       'Data', 'ImageData', 'missing.h5', 'list.txt', 'train_lmdb')


# -- drawing values: random.Random here, hypothesis in the tests --------------
class Draw:
    """The few draws the generators make, over random.Random."""

    def __init__(self, rnd):
        self.rnd = rnd

    def int(self, lo, hi):
        return self.rnd.randint(lo, hi)

    def choice(self, seq):
        seq = list(seq)
        return seq[self.rnd.randrange(len(seq))]

    def bool(self, p=0.5):
        return self.rnd.random() < p

    def bytes(self, n):
        return bytes(self.rnd.getrandbits(8) for _ in range(n))


class HypothesisDraw(Draw):
    """The same draws from hypothesis's `st.data()` (so examples shrink)."""

    def __init__(self, data):
        from hypothesis import strategies as st
        self.data, self.st = data, st

    def int(self, lo, hi):
        return self.data.draw(self.st.integers(lo, hi))

    def choice(self, seq):
        return self.data.draw(self.st.sampled_from(list(seq)))

    def bool(self, p=0.5):
        return self.data.draw(self.st.booleans())

    def bytes(self, n):
        return self.data.draw(self.st.binary(min_size=n, max_size=n))


def interesting_int(d, lo=None, hi=None):
    if d.bool(0.7):
        v = d.choice(INTERESTING_INTS)
    else:
        v = d.int(-300, 300)
    if lo is not None:
        v = max(lo, v)
    if hi is not None:
        v = min(hi, v)
    return v


# -- mutations ----------------------------------------------------------------
def _varint(value):
    value &= (1 << 64) - 1
    out = bytearray()
    while True:
        b = value & 0x7F
        value >>= 7
        if value:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


def _byte_mutation(data, d, seeds):
    op = d.choice(('flip', 'set', 'insert', 'delete', 'truncate', 'splice', 'dup', 'varint',
                   'field'))
    n = len(data)
    pos = d.int(0, max(n, 1) - 1) if n else 0
    if op == 'flip' and n:
        data[pos] ^= 1 << d.int(0, 7)
    elif op == 'set' and n:
        data[pos] = d.choice((0, 1, 0x7F, 0x80, 0xFF, d.int(0, 255)))
    elif op == 'insert':
        data[pos:pos] = d.bytes(d.int(1, 8))
    elif op == 'delete' and n:
        del data[pos:pos + d.int(1, 64)]
    elif op == 'truncate':
        del data[pos:]
    elif op == 'splice' and seeds:
        other = d.choice(seeds)
        cut = d.int(0, len(other))
        data[pos:] = other[cut:]
    elif op == 'dup' and n:
        chunk = data[pos:pos + d.int(1, 256)]
        at = d.int(0, len(data))
        data[at:at] = chunk
    elif op == 'varint':
        data[pos:pos + d.int(0, 5)] = _varint(d.choice(INTERESTING_INTS))
    elif op == 'field':
        # A protobuf field with a random tag and wire type, a hostile length
        # or value: makes parsers meet unknown fields, wrong wire types,
        # length-delimited fields that claim more than the file holds.
        number = d.choice((1, 2, 3, 4, 5, 6, 7, 8, 100, 147, 1000, 2 ** 29 - 1))
        wire = d.choice((0, 1, 2, 5, 3, 4, 6, 7))
        payload = _varint((number << 3) | wire)
        if wire == 0:
            payload += _varint(d.choice(INTERESTING_INTS))
        elif wire == 1:
            payload += d.bytes(8)
        elif wire == 5:
            payload += d.bytes(4)
        elif wire == 2:
            length = d.choice((0, 1, 4, 7, 2 ** 31 - 1, 2 ** 32 + 5, 2 ** 62))
            payload += _varint(length) + d.bytes(d.int(0, 8))
        data[pos:pos] = payload
    return data


_TEXT_IDENTS = None


def _text_idents():
    """Field names, enum value names and layer type names of caffe.proto."""
    global _TEXT_IDENTS
    if _TEXT_IDENTS is None:
        from caffeplus.proto import caffe_pb2
        names = set()

        def walk(desc, seen):
            if desc.full_name in seen:
                return
            seen.add(desc.full_name)
            for f in desc.fields:
                names.add(f.name)
                if f.enum_type is not None:
                    names.update(v.name for v in f.enum_type.values)
                if f.message_type is not None:
                    walk(f.message_type, seen)
        for msg in (caffe_pb2.NetParameter, caffe_pb2.SolverParameter):
            walk(msg.DESCRIPTOR, set())
        _TEXT_IDENTS = sorted(names)
    return _TEXT_IDENTS


def _text_mutation(data, d, seeds):
    import re
    text = data.decode('utf-8', 'surrogateescape')
    op = d.choice(('number', 'number', 'ident', 'string', 'dupline', 'delline', 'swaplines',
                   'brace', 'splice_lines', 'layer_type'))
    if op == 'number':
        spans = [m.span() for m in re.finditer(r'(?<![\w.])-?\d+(\.\d*)?([eE][-+]?\d+)?', text)]
        if spans:
            a, b = d.choice(spans)
            text = text[:a] + d.choice(INTERESTING_NUMBER_TEXT) + text[b:]
    elif op == 'ident':
        spans = [m.span() for m in re.finditer(r'\b[A-Za-z_]\w*\b', text)]
        if spans:
            a, b = d.choice(spans)
            text = text[:a] + d.choice(_text_idents()) + text[b:]
    elif op == 'string':
        spans = [m.span() for m in re.finditer(r'"[^"\n]*"|\'[^\'\n]*\'', text)]
        if spans:
            a, b = d.choice(spans)
            text = text[:a] + '"' + d.choice(INTERESTING_STRINGS) + '"' + text[b:]
    elif op == 'layer_type':
        spans = [m.span(1) for m in re.finditer(r'type:\s*"([^"]*)"', text)]
        if spans:
            import caffeplus
            a, b = d.choice(spans)
            text = text[:a] + d.choice(caffeplus.layer_type_list() + ['Python', 'Nope']) + \
                text[b:]
    else:
        lines = text.split('\n')
        if op == 'dupline' and lines:
            i = d.int(0, len(lines) - 1)
            lines[i:i] = lines[i:i + d.int(1, 12)]
        elif op == 'delline' and lines:
            i = d.int(0, len(lines) - 1)
            del lines[i:i + d.int(1, 4)]
        elif op == 'swaplines' and len(lines) > 1:
            i, j = d.int(0, len(lines) - 1), d.int(0, len(lines) - 1)
            lines[i], lines[j] = lines[j], lines[i]
        elif op == 'brace' and lines:
            i = d.int(0, len(lines) - 1)
            lines[i] += d.choice(('{', '}', ' }', ':', '"', '#', ' [', ']', '<', '>', '\\'))
        elif op == 'splice_lines' and seeds:
            other = d.choice(seeds).decode('utf-8', 'surrogateescape').split('\n')
            i = d.int(0, len(lines))
            j = d.int(0, len(other))
            lines[i:i] = other[j:j + d.int(1, 20)]
        text = '\n'.join(lines)
    return bytearray(text.encode('utf-8', 'surrogateescape'))


def mutate(seed, d, seeds, text=False, max_ops=4):
    data = bytearray(seed)
    for _ in range(d.int(1, max_ops)):
        if text and d.bool(0.9):
            data = _text_mutation(data, d, seeds)
        else:
            data = _byte_mutation(data, d, seeds)
    return bytes(data)


# -- seeds --------------------------------------------------------------------
def _read(path):
    with open(path, 'rb') as f:
        return f.read()


def _files(top, suffixes):
    out = []
    for dirpath, dirnames, filenames in os.walk(top):
        dirnames.sort()
        for name in sorted(filenames):
            if name.endswith(suffixes):
                out.append(os.path.join(dirpath, name))
    return out


def _is_solver_file(path):
    return 'solver' in os.path.basename(path)


def _lmdb_values(path, limit):
    import lmdb
    if not os.path.isdir(path):
        return []
    env = lmdb.open(path, readonly=True, lock=False, subdir=True)
    out = []
    try:
        with env.begin() as txn:
            for i, (_, value) in enumerate(txn.cursor()):
                if i >= limit:
                    break
                out.append(bytes(value))
    finally:
        env.close()
    return out


def tiny_net_text(extra=''):
    return ('name: "tiny"\n'
            'layer { name: "data" type: "Input" top: "data" top: "label"\n'
            '  input_param { shape { dim: 2 dim: 1 dim: 6 dim: 6 } shape { dim: 2 } } }\n'
            'layer { name: "conv" type: "Convolution" bottom: "data" top: "conv"\n'
            '  convolution_param { num_output: 2 kernel_size: 3 weight_filler { type: "xavier" } } }\n'
            'layer { name: "relu" type: "ReLU" bottom: "conv" top: "conv" }\n'
            'layer { name: "ip" type: "InnerProduct" bottom: "conv" top: "ip"\n'
            '  inner_product_param { num_output: 3 weight_filler { type: "gaussian" std: 0.1 } } }\n'
            'layer { name: "loss" type: "SoftmaxWithLoss" bottom: "ip" bottom: "label" '
            'top: "loss" }\n' + extra)


def _shrunk_zoo_text(path):
    """A zoo net upgraded, its data layers replaced by DummyData and its sizes
    cut down, so building it takes milliseconds (a seed for net building)."""
    from caffeplus.io import prototxt, upgrade
    from caffeplus.io.dummy import swap_data_layers
    param = prototxt.read_net_param(path)
    try:
        param = swap_data_layers(param, batch_size=1)
    except Exception:
        return None
    for lp in param.layer:
        if lp.type == 'DummyData':
            for shape in lp.dummy_data_param.shape:
                for i in range(2, len(shape.dim)):
                    shape.dim[i] = min(shape.dim[i], 32)
                if len(shape.dim) > 1:
                    shape.dim[1] = min(shape.dim[1], 3)
        if lp.type == 'Input':
            for shape in lp.input_param.shape:
                for i in range(len(shape.dim)):
                    shape.dim[i] = min(shape.dim[i], 32 if i >= 2 else 3)
        for field in ('convolution_param', 'inner_product_param'):
            if lp.HasField(field):
                sub = getattr(lp, field)
                if sub.num_output > 8:
                    sub.num_output = 8
                if field == 'convolution_param' and sub.group > 1:
                    sub.group = 1
        if lp.HasField('pooling_param') and lp.pooling_param.kernel_size > 3:
            lp.pooling_param.kernel_size = 3
    del param.input_dim[:]
    return upgrade.message_to_text(param).encode('utf-8')


_SEED_CACHE = {}


def seeds_for(name):
    if name not in _SEED_CACHE:
        _SEED_CACHE[name] = [s for s in TARGETS[name].seeds() if s]
    return _SEED_CACHE[name]


# -- the worker's fixed surroundings -------------------------------------------
class Context:
    """What targets share inside one worker: a scratch directory (the
    working directory), copies of the reference data there, cached nets."""

    def __init__(self, workdir):
        self.workdir = workdir
        self._lenet = None
        self._solver = None
        self.counter = 0

    def path(self, name):
        self.counter += 1
        return os.path.join(self.workdir, '%d_%s' % (self.counter, name))

    def write(self, name, data):
        path = self.path(name)
        with open(path, 'wb') as f:
            f.write(data)
        return path

    def lenet(self):
        """The reference LeNet (ip1 100) with DummyData instead of Data layers."""
        if self._lenet is None:
            self._lenet = shared_lenet()
        return self._lenet

    def solver(self):
        if self._solver is None:
            from caffeplus.proto import caffe_pb2
            from caffeplus.solver import get_solver
            sp = caffe_pb2.SolverParameter()
            sp.net_param.CopyFrom(lenet_param())
            sp.base_lr = 0.01
            sp.momentum = 0.9
            sp.max_iter = 1
            sp.lr_policy = 'fixed'
            sp.snapshot_prefix = os.path.join(self.workdir, 'snap')
            self._solver = get_solver(sp)
        return self._solver


_LENET = []


def shared_lenet():
    if not _LENET:
        import caffeplus
        _LENET.append(caffeplus.Net(lenet_param(), caffeplus.TRAIN))
    return _LENET[0]


def lenet_param():
    from caffeplus.io import prototxt
    from caffeplus.io.dummy import swap_data_layers
    path = os.path.join(REFERENCE, 'training', 'lenet_train_test.prototxt')
    param = swap_data_layers(prototxt.read_net_param(path), batch_size=2)
    param.state.phase = 0
    return param


def sandbox_net(param, workdir):
    """Keep a fuzzed net from touching anything outside the scratch
    directory: outputs go to scratch, absolute or parent paths of inputs
    become names that do not exist (reading is harmless, but a LevelDB open
    writes a LOCK file where it is pointed)."""
    for lp in param.layer:
        if lp.HasField('hdf5_output_param') or lp.type == 'HDF5Output':
            lp.hdf5_output_param.file_name = 'fuzz_output.h5'
        for field in ('data_param', 'image_data_param', 'hdf5_data_param', 'window_data_param'):
            if lp.HasField(field):
                sub = getattr(lp, field)
                src = sub.source
                if os.path.isabs(src) or '..' in src or '\x00' in src:
                    sub.source = 'not_here'
                if field == 'data_param' and sub.backend != 1 and not src.endswith('_lmdb'):
                    # LevelDB writes LOCK/LOG files into whatever it opens.
                    sub.source = 'not_here'
                if field == 'image_data_param' and (os.path.isabs(sub.root_folder) or
                                                    '..' in sub.root_folder):
                    sub.root_folder = ''
            if lp.HasField('transform_param'):
                mf = lp.transform_param.mean_file
                if mf and (os.path.isabs(mf) or '..' in mf):
                    lp.transform_param.mean_file = 'not_here'
    return param


def _small_enough_to_run(net, limit=2 ** 20):
    total = sum(b.count for b in net._blobs) + sum(p.count for p in net.learnable_params)
    return total <= limit


# -- targets ------------------------------------------------------------------
class Target:
    name = ''
    text = False          # prototxt-aware mutations
    generate = None       # optional: generate(d) -> bytes, structure-aware

    def seeds(self):
        return []

    def run(self, data, ctx):
        raise NotImplementedError


class NetText(Target):
    """Prototxt reader + upgrader (V0/V1/V2), then building the Net (CPU)."""
    name = 'net_text'
    text = True

    def seeds(self):
        out = [tiny_net_text().encode()]
        nets = [p for p in _files(ZOO, ('.prototxt',)) if not _is_solver_file(p)]
        for p in nets:
            out.append(_read(p))
        for p in nets:
            try:
                s = _shrunk_zoo_text(p)
            except Exception:
                s = None
            if s:
                out.append(s)
        layers = os.path.join(REFERENCE, 'layers')
        out += [_read(p) for p in _files(layers, ('.prototxt',))]
        out += [_read(p) for p in _files(os.path.join(REFERENCE, 'io', 'upgrade'), ('.prototxt',))
                if not _is_solver_file(p)]
        return out

    def run(self, data, ctx):
        import caffeplus
        from caffeplus.io import prototxt, upgrade
        from caffeplus.proto import caffe_pb2
        param = prototxt.parse_text(data, caffe_pb2.NetParameter(), 'fuzz.prototxt')
        # `caffeplus upgrade --keep-going` upgrades with strict=False.
        lenient = caffe_pb2.NetParameter()
        lenient.CopyFrom(param)
        upgrade.message_to_text(upgrade.upgrade_net_as_needed(lenient, 'fuzz.prototxt',
                                                              strict=False))
        param = upgrade.upgrade_net_as_needed(param, 'fuzz.prototxt')
        # Printing the upgraded net must work too (caffeplus upgrade writes it).
        upgrade.message_to_text(param)
        sandbox_net(param, ctx.workdir)
        phase = caffeplus.TEST if hashlib.md5(data).digest()[0] & 1 else caffeplus.TRAIN
        net = caffeplus.Net(param, phase)
        if _small_enough_to_run(net):
            net.forward()
        return 'net with %d layers' % len(net.layers)


class SolverText(Target):
    name = 'solver_text'
    text = True

    def seeds(self):
        paths = [p for p in _files(ZOO, ('.prototxt',)) if _is_solver_file(p)]
        paths += _files(os.path.join(REFERENCE, 'training'), ('solver.prototxt',))
        paths += [p for p in _files(os.path.join(REFERENCE, 'io'), ('.prototxt',))
                  if _is_solver_file(p)]
        return [_read(p) for p in paths]

    def run(self, data, ctx):
        from caffeplus.io import prototxt, upgrade
        from caffeplus.proto import caffe_pb2
        param = prototxt.parse_text(data, caffe_pb2.SolverParameter(), 'fuzz_solver.prototxt')
        param = upgrade.upgrade_solver_as_needed(param, 'fuzz_solver.prototxt')
        upgrade.message_to_text(param)
        return 'solver'


def _tiny_caffemodel_seeds():
    """Caffemodels of small nets with Input layers (they build on their own)."""
    import caffeplus
    from caffeplus.io import prototxt
    from caffeplus.proto import caffe_pb2
    out = []
    texts = [tiny_net_text()]
    for case in ('conv_basic', 'innerproduct_basic', 'batchnorm_train_2d', 'prelu_channel',
                 'lstm_basic', 'embed_basic', 'scale_bias'):
        p = os.path.join(REFERENCE, 'layers', case + '.prototxt')
        if os.path.exists(p):
            texts.append(_read(p).decode())
    for text in texts:
        try:
            param = prototxt.parse_text(text, caffe_pb2.NetParameter())
            net = caffeplus.Net(param, caffeplus.TRAIN)
            out.append(net.to_proto().SerializeToString())
        except Exception:
            continue
    return out


class Caffemodel(Target):
    """.caffemodel: read_net_param_binary, copy into LeNet, or build the net it holds."""
    name = 'caffemodel'

    def seeds(self):
        out = _tiny_caffemodel_seeds()
        out.append(_read(os.path.join(REFERENCE, 'training', 'init.caffemodel')))
        return out

    def run(self, data, ctx):
        import caffeplus
        from caffeplus.io import prototxt, weights
        path = ctx.write('fuzz.caffemodel', data)
        param = prototxt.read_net_param_binary(path)
        net = ctx.lenet()
        weights.copy_from_net_param(net, param, path)
        if any(lp.type == 'Input' for lp in param.layer):
            sandbox_net(param, ctx.workdir)
            caffeplus.Net(param, caffeplus.TRAIN)
        return 'caffemodel with %d layers' % len(param.layer)

    def generate(self, d):
        return generated_caffemodel(d)


class Solverstate(Target):
    """.solverstate (binary): read it, and restore it into an SGD solver on LeNet."""
    name = 'solverstate'

    def seeds(self):
        out = [_read(p) for p in _files(os.path.join(REFERENCE, 'training'), ('.solverstate',))]
        out.append(_read(os.path.join(REFERENCE, 'io', 'lenet_iter_2.solverstate')))
        return out[:3]

    def run(self, data, ctx):
        from caffeplus.solver import state as state_io
        path = ctx.write('fuzz.solverstate', data)
        loaded = state_io.read_state(path)
        solver = ctx.solver()
        # The seeds name weights files of the reference tree: point
        # learned_net at LeNet weights in scratch (a fuzzed name that is no
        # plain file name stays as it is, to be refused).
        if loaded.learned_net:
            _rewrite_learned_net(path, ctx)
        solver.restore(path)
        return 'state at iter %d' % loaded.iter

    def generate(self, d):
        return generated_solverstate(d)


def generated_solverstate(d):
    """A LeNet SGD state with hostile iter, current_step, learned_net or history."""
    from caffeplus.proto import caffe_pb2
    state = caffe_pb2.SolverState()
    state.ParseFromString(seeds_for('solverstate')[0])
    for _ in range(d.int(1, 3)):
        r = d.int(0, 7)
        if r == 0:
            state.iter = interesting_int(d, -2 ** 31, 2 ** 31 - 1)
        elif r == 1:
            state.current_step = interesting_int(d, -2 ** 31, 2 ** 31 - 1)
        elif r == 2:
            state.learned_net = d.choice(INTERESTING_STRINGS + ('lenet_iter_30.caffemodel',))
        elif r == 3:
            state.ClearField('learned_net')
        elif r == 4 and len(state.history):
            del state.history[d.int(0, len(state.history) - 1)]
        elif r == 5:
            b = state.history.add()
            b.shape.dim.extend([d.int(0, 3)])
            b.data.extend([0.0] * d.int(0, 3))
        elif r == 6 and len(state.history):
            b = state.history[d.int(0, len(state.history) - 1)]
            if len(b.shape.dim):
                b.shape.dim[d.int(0, len(b.shape.dim) - 1)] = interesting_int(
                    d, -2 ** 63, 2 ** 63 - 1)
        elif r == 7 and len(state.history):
            b = state.history[d.int(0, len(state.history) - 1)]
            b.double_data.extend([1.0] * d.int(0, 2))
    return state.SerializeToString()


def _rewrite_learned_net(path, ctx):
    from caffeplus.proto import caffe_pb2
    state = caffe_pb2.SolverState()
    with open(path, 'rb') as f:
        state.ParseFromString(f.read())
    if state.learned_net.endswith('lenet_iter_30.caffemodel'):
        weights = os.path.join(ctx.workdir, 'weights_lenet.caffemodel')
        if not os.path.exists(weights):
            ctx.lenet().save(weights)
        state.learned_net = weights
    elif os.path.isabs(state.learned_net) or '..' in state.learned_net:
        state.learned_net = 'not_here.caffemodel'
    with open(path, 'wb') as f:
        f.write(state.SerializeToString())


class Binaryproto(Target):
    name = 'binaryproto'

    def seeds(self):
        from caffeplus.proto import caffe_pb2
        out = [_read(os.path.join(REFERENCE, 'io', 'mnist_synth_train_mean.binaryproto'))]
        b = caffe_pb2.BlobProto(num=1, channels=2, height=2, width=2)
        b.double_data.extend([0.5] * 8)
        out.append(b.SerializeToString())
        v = caffe_pb2.BlobProtoVector()
        for shape in ((2, 3), (1,), ()):
            blob = v.blobs.add()
            blob.shape.dim.extend(shape)
            n = 1
            for s in shape:
                n *= s
            blob.data.extend([1.0] * n)
        out.append(v.SerializeToString())
        return out

    def run(self, data, ctx):
        from caffeplus.io import blobproto
        path = ctx.write('fuzz.binaryproto', data)
        errors = []
        for reader in (blobproto.read_mean, blobproto.read_blobproto_vector):
            try:
                reader(path)
            except _caffeplus_error() as exc:
                errors.append(exc)
        if len(errors) == 2:
            raise errors[0]
        return 'binaryproto'

    def generate(self, d):
        return generated_blobproto(d)


class HDF5Bytes(Target):
    """HDF5 weights and solver states, damaged byte by byte."""
    name = 'hdf5_bytes'

    def seeds(self):
        return [_read(os.path.join(REFERENCE, 'io', 'lenet_iter_2.solverstate.h5')),
                _small_h5_weights()]

    def run(self, data, ctx):
        return _run_h5(data, ctx)


class HDF5Struct(Target):
    """HDF5 weights and solver states with missing datasets, wrong dtypes and shapes."""
    name = 'hdf5_struct'

    def seeds(self):
        return [_small_h5_weights()]

    def run(self, data, ctx):
        return _run_h5(data, ctx)

    def generate(self, d):
        return generated_hdf5(d)


def _run_h5(data, ctx):
    from caffeplus.io import weights
    from caffeplus.solver import state as state_io
    path = ctx.write('fuzz.h5', data)
    errors = []
    for reader in (lambda: weights.copy_from_hdf5(ctx.lenet(), path),
                   lambda: state_io.read_state(path)):
        try:
            reader()
        except _caffeplus_error() as exc:
            errors.append(exc)
    if len(errors) == 2:
        raise errors[0]
    return 'hdf5'


def _small_h5_weights():
    import h5py
    import numpy
    buf = io.BytesIO()
    with h5py.File(buf, 'w') as f:
        g = f.create_group('data')
        net = shared_lenet()
        for name, layer in zip(net._layer_names, net.layers):
            lg = g.create_group(name)
            for j, b in enumerate(layer.blobs):
                lg.create_dataset(str(j), data=numpy.full(b.shape, 0.01, numpy.float32))
        f.create_dataset('iter', data=numpy.array([3], '<i4'))
        f.create_dataset('current_step', data=numpy.array([0], '<i4'))
        f.create_group('history')
    return buf.getvalue()


class DatumTarget(Target):
    """Datum records: parse, decode (raw, float, encoded) and transform."""
    name = 'datum'

    def seeds(self):
        out = _lmdb_values(os.path.join(REFERENCE, 'training', 'data', 'mnist_synth_train_lmdb'), 2)
        for variant in ('raw', 'encoded', 'gray', 'resized_6x5'):
            out += _lmdb_values(os.path.join(REFERENCE, 'io', 'imageset_%s_lmdb' % variant), 2)
        return out

    def run(self, data, ctx):
        from caffeplus.io import datum as datum_io
        from caffeplus.io.transformer import DataTransformer
        from caffeplus.proto import caffe_pb2
        d = datum_io.parse_datum(data, b'fuzzkey', 'fuzz_lmdb')
        modes = (datum_io.UNCHANGED, datum_io.COLOR, datum_io.GRAY) if d.encoded else \
            (datum_io.UNCHANGED,)
        for mode in modes:
            arr = datum_io.datum_to_array(d, b'fuzzkey', mode=mode)
        tp = caffe_pb2.TransformationParameter(scale=0.5, mirror=True, crop_size=2)
        if arr.shape[0] in (1, 3):
            tp.mean_value.extend([1.0] * arr.shape[0])
        t = DataTransformer(tp, caffe_pb2.TRAIN, 'fuzz')
        t.init_rand()
        t.transform_datum(d, key=b'fuzzkey')
        return 'datum %s' % (arr.shape,)

    def generate(self, d):
        return generated_datum(d)


class DataLayerTarget(Target):
    """A Data layer over an LMDB whose records are fuzzed Datums (with a
    good record before or after), run for two batches through the prefetch
    thread: errors must come out of forward as CaffeplusError."""
    name = 'data_layer'

    def seeds(self):
        return DatumTarget().seeds()

    def run(self, data, ctx):
        import lmdb
        import caffeplus
        from caffeplus.io import prototxt
        from caffeplus.proto import caffe_pb2
        good = seeds_for(self.name)[0]
        path = ctx.path('lmdb')
        env = lmdb.open(path, map_size=1 << 24, subdir=True)
        h = hashlib.md5(data).digest()
        records = [good, data] if h[0] & 1 else [data, good]
        with env.begin(write=True) as txn:
            for i, value in enumerate(records):
                txn.put(b'%08d' % i, value)
        env.close()
        text = ('layer { name: "data" type: "Data" top: "data" top: "label"\n'
                '  transform_param { scale: 0.5 mirror: %s crop_size: %d %s }\n'
                '  data_param { source: "%s" batch_size: %d backend: LMDB prefetch: %d } }\n'
                % ('true' if h[1] & 1 else 'false', h[2] % 3 * 2,
                   'force_color: true' if h[3] & 1 else '', path, 1 + h[4] % 2, h[5] % 3))
        param = prototxt.parse_text(text, caffe_pb2.NetParameter())
        net = caffeplus.Net(param, caffeplus.TRAIN)
        try:
            net.forward()
            net.forward()
        finally:
            for layer in net.layers:
                close = getattr(layer, 'close', None)
                if close is not None:
                    close()
        return 'data layer %s' % (net.blobs['data'].shape,)

    def generate(self, d):
        return generated_datum(d)


class ImageTarget(Target):
    """Encoded images (what an encoded Datum or an ImageData file holds)."""
    name = 'image'

    def seeds(self):
        out = [_read(p) for p in _files(os.path.join(REFERENCE, 'io', 'images'), ('.png',))][:4]
        out += _synthetic_images()
        return out

    def run(self, data, ctx):
        from caffeplus.io import datum as datum_io
        for mode in (datum_io.UNCHANGED, datum_io.COLOR, datum_io.GRAY):
            datum_io.decode_image(data, mode)
        path = ctx.write('fuzz.img', data)
        arr = datum_io.read_image(path, True, 5, 7)
        datum_io.read_image(path, False)
        return 'image %s' % (arr.shape,)


def _synthetic_images():
    import numpy
    from PIL import Image
    out = []
    a = (numpy.arange(5 * 6 * 3) % 256).astype(numpy.uint8).reshape(5, 6, 3)
    for fmt, mode in (('JPEG', 'RGB'), ('BMP', 'RGB'), ('GIF', 'P'), ('PNG', 'I;16'),
                      ('TIFF', 'RGB'), ('PNG', 'LA')):
        img = Image.fromarray(a)
        if mode == 'P':
            img = img.convert('P')
        elif mode == 'I;16':
            img = Image.fromarray(a[:, :, 0].astype(numpy.uint16) * 257)
        elif mode == 'LA':
            img = img.convert('LA')
        buf = io.BytesIO()
        try:
            img.save(buf, fmt)
        except Exception:
            continue
        out.append(buf.getvalue())
    return out


class ImageList(Target):
    """The list file of an ImageData layer, read and run for one batch."""
    name = 'image_list'
    text = True

    def seeds(self):
        listing = _read(os.path.join(REFERENCE, 'io', 'images', 'list.txt'))
        return [listing, b'img_00.png 0\nimg_06.png 1\n', b'  img_03.png   7  \r\n\n',
                b'img_07.png -3\nimg_01.png 2147483647\n']

    def run(self, data, ctx):
        import caffeplus
        from caffeplus.io import prototxt
        from caffeplus.proto import caffe_pb2
        from caffeplus.layers import data as data_layers
        path = ctx.write('list.txt', data)
        lines = data_layers.read_image_list(path, 'fuzz')
        h = int(hashlib.md5(data).hexdigest(), 16)
        text = ('layer { name: "data" type: "ImageData" top: "data" top: "label"\n'
                '  image_data_param { source: "%s" root_folder: "%s/" batch_size: %d '
                'shuffle: %s new_height: %d new_width: %d is_color: %s }\n'
                '  transform_param { mirror: true crop_size: 3 } }\n'
                % (path, os.path.join(REFERENCE, 'io', 'images'), 1 + h % 3,
                   'true' if h & 8 else 'false', 4 * (h >> 4 & 1), 4 * (h >> 4 & 1),
                   'true' if h & 32 else 'false'))
        param = prototxt.parse_text(text, caffe_pb2.NetParameter())
        net = caffeplus.Net(param, caffeplus.TRAIN)
        try:
            net.forward()
            net.forward()
        finally:
            for layer in net.layers:
                close = getattr(layer, 'close', None)
                if close is not None:
                    close()
        return 'image list of %d lines' % len(lines)


class NetGen(Target):
    """Generated nets: an Input layer and one layer of each kind, with hostile
    parameter values (huge num_output, kernel, pad, stride, shapes ...)."""
    name = 'net_gen'
    text = True

    def run(self, data, ctx):
        return NetText().run(data, ctx)

    def generate(self, d):
        return generated_net_text(d, hostile=True).encode('utf-8')


class SelfTest(Target):
    """Runs the example as Python code: only for checking that the engine
    reports crashes, hangs and unbounded allocations (not in TARGETS)."""
    name = '_selftest'

    def run(self, data, ctx):
        from caffeplus.errors import CaffeplusError
        exec(compile(data.decode(), '<selftest>', 'exec'), {'CaffeplusError': CaffeplusError})
        return 'ran'


def _caffeplus_error():
    from caffeplus.errors import CaffeplusError
    return CaffeplusError


TARGETS = collections.OrderedDict((t.name, t) for t in (
    NetText(), NetGen(), SolverText(), Caffemodel(), Solverstate(), Binaryproto(),
    HDF5Bytes(), HDF5Struct(), DatumTarget(), DataLayerTarget(), ImageTarget(), ImageList()))


# -- generators -----------------------------------------------------------------
_LAYER_FIELDS = {
    'Convolution': ('convolution_param', {'num_output': 'pos', 'kernel_size': 'rep',
                                          'pad': 'rep', 'stride': 'rep', 'dilation': 'rep',
                                          'group': 'pos', 'axis': 'axis', 'kernel_h': 'pos',
                                          'kernel_w': 'pos', 'bias_term': 'bool'}),
    'Deconvolution': ('convolution_param', {'num_output': 'pos', 'kernel_size': 'rep',
                                            'pad': 'rep', 'stride': 'rep', 'group': 'pos'}),
    'Pooling': ('pooling_param', {'kernel_size': 'pos', 'pad': 'pos', 'stride': 'pos',
                                  'pool': 'enum3', 'global_pooling': 'bool', 'kernel_h': 'pos',
                                  'kernel_w': 'pos', 'pad_h': 'pos', 'stride_w': 'pos'}),
    'InnerProduct': ('inner_product_param', {'num_output': 'pos', 'axis': 'axis',
                                             'transpose': 'bool', 'bias_term': 'bool'}),
    'Embed': ('embed_param', {'num_output': 'pos', 'input_dim': 'pos'}),
    'LRN': ('lrn_param', {'local_size': 'pos', 'norm_region': 'enum2'}),
    'Tile': ('tile_param', {'axis': 'axis', 'tiles': 'int'}),
    'Reshape': ('reshape_param', {'shape': 'shape', 'axis': 'axis', 'num_axes': 'axis'}),
    'Flatten': ('flatten_param', {'axis': 'axis', 'end_axis': 'axis'}),
    'Concat': ('concat_param', {'axis': 'axis'}),
    'Slice': ('slice_param', {'axis': 'axis', 'slice_point': 'rep'}),
    'Crop': ('crop_param', {'axis': 'axis', 'offset': 'rep'}),
    'Softmax': ('softmax_param', {'axis': 'axis'}),
    'ArgMax': ('argmax_param', {'top_k': 'pos', 'axis': 'axis', 'out_max_val': 'bool'}),
    'Reduction': ('reduction_param', {'axis': 'axis', 'operation': 'enum4'}),
    'SPP': ('spp_param', {'pyramid_height': 'pos'}),
    'Im2col': ('convolution_param', {'kernel_size': 'rep', 'pad': 'rep', 'stride': 'rep'}),
    'DummyData': ('dummy_data_param', {'shape': 'shape', 'num': 'rep', 'channels': 'rep',
                                       'height': 'rep', 'width': 'rep'}),
    'RNN': ('recurrent_param', {'num_output': 'pos'}),
    'LSTM': ('recurrent_param', {'num_output': 'pos'}),
    'Scale': ('scale_param', {'axis': 'axis', 'num_axes': 'axis', 'bias_term': 'bool'}),
    'Bias': ('bias_param', {'axis': 'axis', 'num_axes': 'axis'}),
    'PReLU': ('prelu_param', {'channel_shared': 'bool'}),
    'BatchNorm': ('batch_norm_param', {'use_global_stats': 'bool'}),
    'MVN': ('mvn_param', {'across_channels': 'bool'}),
    'Parameter': ('parameter_param', {'shape': 'shape'}),
    'Eltwise': ('eltwise_param', {'operation': 'enum3', 'coeff': 'rep'}),
    'Filter': (None, {}),
    'BatchReindex': (None, {}),
    'Split': (None, {}),
    'Silence': (None, {}),
}


def _shape_text(d, hostile):
    n = d.int(0, 5)
    dims = []
    for _ in range(n):
        dims.append(interesting_int(d, -2 ** 63, 2 ** 63 - 1) if hostile and d.bool(0.03)
                    else d.int(1, 5))
    return 'shape { %s}' % ''.join('dim: %d ' % v for v in dims)


def _value_text(d, kind, hostile):
    def small():
        return d.int(0, 6)
    big = hostile and d.bool(0.35)
    if kind == 'bool':
        return d.choice(('true', 'false'))
    if kind.startswith('enum'):
        return str(d.int(0, int(kind[4:]) - 1 + (1 if big else 0)))
    if kind == 'shape':
        return None
    # Mostly within the field's protobuf range (uint32 sizes, int32 axes),
    # so the parser lets it through to the layer.
    if kind == 'axis':
        return str(interesting_int(d, -2 ** 31, 2 ** 31 - 1) if big else d.int(-4, 4))
    if kind == 'int':
        return str(interesting_int(d, -2 ** 31, 2 ** 31 - 1) if big else small())
    return str(interesting_int(d, 0, 2 ** 32 - 1) if big else d.int(1, 6))


def _blob_counts(d, kind):
    """Bottom and top counts the layer type accepts (mostly)."""
    from caffeplus.layer import layer_class
    cls = layer_class(kind)

    def pick(exact, lo, hi, default_lo):
        if exact >= 0:
            return exact
        lo = max(lo, default_lo) if lo >= 0 else default_lo
        hi = hi if hi >= 0 else max(lo, 3)
        return d.int(lo, max(lo, min(hi, 3)))
    if cls is None or d.bool(0.1):
        return d.int(0, 3), d.int(0, 2)
    nb = pick(cls.exact_num_bottom, cls.min_num_bottom, cls.max_num_bottom, 1)
    nt = pick(cls.exact_num_top, cls.min_num_top, cls.max_num_top, 1)
    if cls.equal_num_bottom_top:
        nt = nb
    return nb, nt


def generated_net_text(d, hostile=True):
    """An Input layer (random shape, possibly huge) feeding a chain of random layers."""
    lines = ['name: "gen"']
    n_inputs = d.int(1, 3)
    tops = ['in%d' % i for i in range(n_inputs)]
    shapes = ''.join(_shape_text(d, hostile) for _ in range(n_inputs))
    lines.append('layer { name: "input" type: "Input" %s input_param { %s } }'
                 % (''.join('top: "%s" ' % t for t in tops), shapes))
    available = list(tops)
    for i in range(d.int(1, 3)):
        kind = d.choice(sorted(_LAYER_FIELDS))
        field, fields = _LAYER_FIELDS[kind]
        parts = []
        for fname in sorted(fields):
            if not d.bool(0.6):
                continue
            ftype = fields[fname]
            if ftype == 'shape':
                parts.append(_shape_text(d, hostile).replace('shape', fname, 1))
                continue
            count = d.int(1, 3) if ftype == 'rep' or fname in ('num', 'channels', 'height',
                                                               'width') else 1
            for _ in range(count):
                parts.append('%s: %s' % (fname, _value_text(d, 'pos' if ftype == 'rep'
                                                             else ftype, hostile)))
        if kind in ('Convolution', 'Deconvolution', 'InnerProduct', 'Embed', 'RNN', 'LSTM') \
                and not any(p.startswith('num_output') for p in parts):
            parts.append('num_output: %d' % d.int(1, 4))
        if kind in ('Convolution', 'Deconvolution', 'Im2col') and \
                not any(p.startswith('kernel') for p in parts):
            parts.append('kernel_size: %d' % d.int(1, 3))
        if kind == 'Embed' and not any(p.startswith('input_dim') for p in parts):
            parts.append('input_dim: %d' % d.int(1, 4))
        if kind == 'Pooling' and not any(p.startswith('kernel') or p.startswith('global')
                                         for p in parts):
            parts.append('kernel_size: %d' % d.int(1, 3))
        nb, nt = _blob_counts(d, kind)
        bottoms = [d.choice(available) for _ in range(nb)]
        my_tops = ['l%d_%d' % (i, j) for j in range(nt)]
        body = '%s { %s }' % (field, ' '.join(parts)) if field and parts else ''
        lines.append('layer { name: "l%d" type: "%s" %s%s %s }'
                     % (i, kind, ''.join('bottom: "%s" ' % b for b in bottoms),
                        ''.join('top: "%s" ' % t for t in my_tops), body))
        available += my_tops
    return '\n'.join(lines) + '\n'


def generated_blobproto(d):
    from caffeplus.proto import caffe_pb2

    def blob():
        b = caffe_pb2.BlobProto()
        if d.bool(0.3):
            for f in ('num', 'channels', 'height', 'width'):
                if d.bool(0.8):
                    setattr(b, f, interesting_int(d, -2 ** 31, 2 ** 31 - 1) if d.bool(0.3)
                            else d.int(0, 4))
        else:
            for _ in range(d.int(0, 4)):
                b.shape.dim.append(interesting_int(d, -2 ** 63, 2 ** 63 - 1) if d.bool(0.3)
                                   else d.int(0, 4))
        n = d.int(0, 40)
        which = d.choice(('data', 'double_data', 'diff', 'double_diff', 'data+double'))
        for name in which.split('+'):
            getattr(b, name if name != 'double' else 'double_data').extend([0.5] * n)
        return b
    if d.bool():
        return blob().SerializeToString()
    v = caffe_pb2.BlobProtoVector()
    for _ in range(d.int(0, 3)):
        v.blobs.add().CopyFrom(blob())
    return v.SerializeToString()


def generated_datum(d):
    from caffeplus.proto import caffe_pb2
    datum = caffe_pb2.Datum()
    dims = []
    for f in ('channels', 'height', 'width'):
        v = interesting_int(d, -2 ** 31, 2 ** 31 - 1) if d.bool(0.3) else d.int(0, 4)
        setattr(datum, f, v)
        dims.append(v)
    count = dims[0] * dims[1] * dims[2] if all(v > 0 for v in dims) else 0
    if count > 4096 or d.bool(0.2):
        count = d.int(0, 64)
    kind = d.choice(('data', 'float', 'both', 'none', 'encoded', 'encoded_png'))
    if kind in ('data', 'both'):
        datum.data = d.bytes(min(count + d.choice((0, 0, 1, -1)), 4096)) if count else b''
    if kind in ('float', 'both'):
        datum.float_data.extend([1.5] * max(count + d.choice((0, 0, 1, -1)), 0))
    if kind == 'encoded':
        datum.encoded = True
        datum.data = d.bytes(d.int(0, 64))
    if kind == 'encoded_png':
        datum.encoded = True
        datum.data = _png_header(d)
    datum.label = interesting_int(d, -2 ** 31, 2 ** 31 - 1)
    return datum.SerializeToString()


def _png_header(d):
    """A PNG whose IHDR claims a hostile size (the CRC made right)."""
    import zlib
    w = interesting_int(d, 0, 2 ** 31 - 1) if d.bool() else d.int(1, 4)
    h = interesting_int(d, 0, 2 ** 31 - 1) if d.bool() else d.int(1, 4)
    color = d.choice((0, 2, 3, 4, 6, 1))
    depth = d.choice((8, 16, 1, 3))
    ihdr = struct.pack('>IIBBBBB', w, h, depth, color, 0, 0, 0)
    chunk = b'IHDR' + ihdr
    out = b'\x89PNG\r\n\x1a\n' + struct.pack('>I', len(ihdr)) + chunk + \
        struct.pack('>I', zlib.crc32(chunk) & 0xFFFFFFFF)
    raw = zlib.compress(d.bytes(d.int(0, 32)))
    idat = b'IDAT' + raw
    out += struct.pack('>I', len(raw)) + idat + struct.pack('>I', zlib.crc32(idat) & 0xFFFFFFFF)
    out += b'\x00\x00\x00\x00IEND\xaeB`\x82'
    return out


def generated_caffemodel(d):
    """LeNet's weights with hostile blob shapes, counts and legacy fields."""
    from caffeplus.proto import caffe_pb2
    param = caffe_pb2.NetParameter()
    param.ParseFromString(seeds_for('caffemodel')[0])
    for lp in param.layer:
        for b in lp.blobs:
            r = d.int(0, 9)
            if r == 0:
                b.shape.dim.append(interesting_int(d, -2 ** 63, 2 ** 63 - 1))
            elif r == 1 and len(b.shape.dim):
                b.shape.dim[d.int(0, len(b.shape.dim) - 1)] = interesting_int(
                    d, -2 ** 63, 2 ** 63 - 1)
            elif r == 2:
                b.num = interesting_int(d, -2 ** 31, 2 ** 31 - 1)
            elif r == 3:
                del b.data[d.int(0, len(b.data)):]
            elif r == 4:
                b.double_data.extend([0.25] * d.int(0, 3))
        if d.bool(0.1):
            lp.blobs.add()
    return param.SerializeToString()


_H5_DTYPES = ('<f4', '<f8', '<i4', '<u1', '|b1', '<c8', 'S8', 'vlen_str', 'compound')


def _h5_dataset(h5py, numpy, group, name, shape, dtype):
    if name in group:
        return
    if dtype == 'vlen_str':
        group.create_dataset(name, data='a string', dtype=h5py.string_dtype())
    elif dtype == 'compound':
        dt = numpy.dtype([('a', '<i4'), ('b', '<f4')])
        group.create_dataset(name, shape=shape, dtype=dt)
    else:
        group.create_dataset(name, data=numpy.ones(shape, dtype=dtype))


def generated_hdf5(d):
    """Caffe's HDF5 weight / solver-state layout with pieces missing or wrong."""
    import h5py
    import numpy
    net = shared_lenet()
    buf = io.BytesIO()
    with h5py.File(buf, 'w') as f:
        top = d.choice(('group', 'group', 'group', 'dataset', 'none'))
        if top == 'dataset':
            f.create_dataset('data', data=numpy.zeros(3, 'f4'))
        elif top == 'group':
            g = f.create_group('data')
            for name, layer in zip(net._layer_names, net.layers):
                if not layer.blobs and d.bool(0.8):
                    continue
                what = d.choice(('group', 'group', 'group', 'missing', 'dataset'))
                if what == 'missing':
                    continue
                if what == 'dataset':
                    g.create_dataset(name, data=numpy.zeros(2, 'f4'))
                    continue
                lg = g.create_group(name)
                n = len(layer.blobs) + d.choice((0, 0, 0, 1, -1))
                for j in range(max(n, 0)):
                    shape = layer.blobs[j].shape if j < len(layer.blobs) else (2,)
                    r = d.int(0, 6)
                    if r == 0:
                        shape = tuple(shape) + (1,)
                    elif r == 1:
                        shape = ()
                    elif r == 2 and shape:
                        shape = (shape[0] + 1,) + tuple(shape[1:])
                    dtype = d.choice(_H5_DTYPES) if d.bool(0.3) else '<f4'
                    key = str(j) if d.bool(0.9) else d.choice(('x', '-1', '%d' % (j + 5)))
                    if d.bool(0.05) and key not in lg:
                        lg.create_group(key)
                        continue
                    _h5_dataset(h5py, numpy, lg, key, shape, dtype)
        for key in ('iter', 'current_step'):
            what = d.choice(('ok', 'ok', 'missing', 'scalar', 'empty', 'string', 'float',
                             'huge', 'group'))
            if what == 'ok':
                f.create_dataset(key, data=numpy.array([d.int(0, 9)], '<i4'))
            elif what == 'scalar':
                f.create_dataset(key, data=numpy.int32(4))
            elif what == 'empty':
                f.create_dataset(key, data=numpy.zeros(0, '<i4'))
            elif what == 'string':
                f.create_dataset(key, data='seven', dtype=h5py.string_dtype())
            elif what == 'float':
                f.create_dataset(key, data=numpy.array([float('nan')], '<f8'))
            elif what == 'huge':
                f.create_dataset(key, data=numpy.array([2 ** 62], '<i8'))
            elif what == 'group':
                f.create_group(key)
        what = d.choice(('ok', 'missing', 'vlen', 'int', 'badutf8', 'array'))
        if what == 'ok':
            f.create_dataset('learned_net', data=numpy.array(b'x.caffemodel.h5\0', 'S16'))
        elif what == 'vlen':
            f.create_dataset('learned_net', data='x.h5', dtype=h5py.string_dtype())
        elif what == 'int':
            f.create_dataset('learned_net', data=numpy.int32(3))
        elif what == 'badutf8':
            f.create_dataset('learned_net', data=numpy.array(b'\xff\xfe\0', 'S3'))
        elif what == 'array':
            f.create_dataset('learned_net', data=numpy.zeros((0,), 'S4'))
        what = d.choice(('group', 'group', 'missing', 'dataset'))
        if what == 'group':
            g = f.create_group('history')
            for j in range(d.int(0, 3)):
                key = str(j) if d.bool(0.85) else d.choice(('a', str(j + 2)))
                _h5_dataset(h5py, numpy, g, key, (d.int(0, 3),),
                            d.choice(_H5_DTYPES) if d.bool(0.3) else '<f4')
        elif what == 'dataset':
            f.create_dataset('history', data=numpy.zeros(2))
    return buf.getvalue()


# -- running one example ------------------------------------------------------
class TimeLimit(BaseException):
    """Raised by the per-example timer (BaseException: no `except Exception`
    in the code under test can swallow it)."""


def _on_alarm(signum, frame):
    raise TimeLimit()


def check(target_name, data, ctx, time_limit=EXAMPLE_TIME_LIMIT):
    """Run one example in this process. Returns a dict: outcome 'ok', 'error'
    (a CaffeplusError: allowed), 'bug' (anything else), 'hang'."""
    from caffeplus.errors import CaffeplusError
    target = SelfTest() if target_name == SelfTest.name else TARGETS[target_name]
    old = signal.signal(signal.SIGALRM, _on_alarm)
    signal.setitimer(signal.ITIMER_REAL, time_limit)
    # If the time limit cannot interrupt (a loop inside a C library), the
    # worker's stack goes to stderr, where the parent finds it.
    faulthandler.dump_traceback_later(time_limit + 2, exit=False)
    try:
        result = target.run(data, ctx)
        return {'outcome': 'ok', 'message': str(result)}
    except CaffeplusError as exc:
        msg = str(exc)
        if not msg.strip():
            return {'outcome': 'bug', 'message': '%s with an empty message' % type(exc).__name__,
                    'trace': traceback.format_exc()}
        if len(msg) > MAX_MESSAGE_CHARS:
            return {'outcome': 'bug', 'message': '%s message of %d characters'
                    % (type(exc).__name__, len(msg)), 'trace': msg[:2000]}
        if 'not enough memory' in msg:
            # Net construction turns MemoryError into a clean error; under the
            # fuzz bounds it means an allocation escaped the bound checks.
            # The trace is the MemoryError's own (where it was allocated).
            cause = exc.__cause__ or exc.__context__
            trace = ''.join(traceback.format_exception(type(cause), cause, cause.__traceback__)) \
                if cause is not None else traceback.format_exc()
            return {'outcome': 'bug', 'message': 'MemoryError: (reported as %s: %s)'
                    % (type(exc).__name__, msg[:300]), 'trace': trace}
        return {'outcome': 'error', 'message': '%s: %s' % (type(exc).__name__, msg)}
    except TimeLimit:
        return {'outcome': 'hang', 'message': 'no result within %g s' % time_limit,
                'trace': traceback.format_exc()}
    except BaseException as exc:  # the bugs the fuzzer looks for
        if isinstance(exc, KeyboardInterrupt):
            raise
        return {'outcome': 'bug', 'message': '%s: %s' % (type(exc).__name__, str(exc)[:500]),
                'trace': traceback.format_exc()}
    finally:
        faulthandler.cancel_dump_traceback_later()
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def bug_signature(result):
    """Where a bug was raised: exception type and the innermost caffeplus frame."""
    trace = result.get('trace', '')
    frames = [line.strip() for line in trace.splitlines() if line.strip().startswith('File "')]
    if 'most recent call first' in trace:   # faulthandler's order (a hang)
        frames.reverse()
    ours = [f for f in frames if '/caffeplus/' in f or '/layers/' in f] or frames
    where = ours[-1] if ours else ''
    return '%s @ %s' % (result.get('message', '').split(':', 1)[0], where)


# Problems the fuzzer finds in code this tool's owner may not change (files
# of colleagues still at work on them). Each has a regression test marked
# xfail in tests/test_fuzz_readers.py; remove the entry once it is fixed.
# (file fragment, function or '', outcome, exception type or ''): reason.
KNOWN_ISSUES = {}   # every finding so far is fixed (see tests/test_fuzz_readers.py)


def known_issue(result):
    """The reason text of a KNOWN_ISSUES entry this result matches, or None."""
    if result.get('outcome') not in ('bug', 'hang'):
        return None
    sig = bug_signature(result)
    etype, _, where = sig.partition(' @ ')
    for (fragment, func, outcome, exc_type), reason in KNOWN_ISSUES.items():
        if outcome != result['outcome'] or fragment not in where:
            continue
        if func and (' in %s' % func) not in where:
            continue
        if exc_type and etype != exc_type:
            continue
        return reason
    return None


def problem(result):
    """None when a result satisfies the property (or is a known issue),
    else a description of what went wrong."""
    if result['outcome'] in ('ok', 'error') or known_issue(result):
        return None
    return '%s: %s\n%s' % (result['outcome'], result.get('message', ''),
                           result.get('trace', '')[-4000:])


# -- the worker process ---------------------------------------------------------
def worker_setup(workdir, memory_limit=MEMORY_LIMIT_BYTES):
    """Make this process a fuzz worker: CPU mode, quiet log, scratch cwd,
    lowered blob bound and an address-space limit."""
    os.environ.setdefault('GLOG_minloglevel', '3')
    os.environ['CAFFEPLUS_NO_PYTHON_LAYERS'] = '1'
    import numpy  # noqa: F401  (imported before the limit)
    import caffeplus
    from caffeplus import blob, log
    log.set_level(3)
    caffeplus.set_mode_cpu()
    set_python = getattr(caffeplus, 'set_python_layers_allowed', None)
    if set_python is not None:
        set_python(False)
    blob.MAX_BLOB_COUNT = FUZZ_MAX_BLOB_COUNT
    try:
        from caffeplus.io import datum
        datum.MAX_DATUM_COUNT = min(datum.MAX_DATUM_COUNT, FUZZ_MAX_BLOB_COUNT)
        datum.MAX_IMAGE_VALUES = min(datum.MAX_IMAGE_VALUES, FUZZ_MAX_BLOB_COUNT)
    except ImportError:
        pass
    os.chdir(workdir)
    ctx = Context(workdir)
    # Warm up what every example uses, before the memory limit.
    for name in TARGETS:
        seeds_for(name)
    ctx.lenet()
    if memory_limit:
        soft, hard = resource.getrlimit(resource.RLIMIT_AS)
        used = _vm_size()
        limit = used + memory_limit
        if hard != resource.RLIM_INFINITY:
            limit = min(limit, hard)
        resource.setrlimit(resource.RLIMIT_AS, (limit, hard))
    return ctx


def _vm_size():
    try:
        with open('/proc/self/status') as f:
            for line in f:
                if line.startswith('VmSize:'):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def worker_main(workdir=None):
    """Read {"target", "data"} lines from stdin, answer one JSON line each
    on the original stdout (everything else the code prints goes to stderr)."""
    out = os.fdopen(os.dup(1), 'w')
    os.dup2(2, 1)
    # The parent owns the scratch folder: a worker killed for a hang or a
    # crash never reaches its own clean-up.
    workdir = workdir or tempfile.mkdtemp(prefix='caffeplus-fuzz-')
    try:
        ctx = worker_setup(workdir)
        out.write(json.dumps({'ready': True}) + '\n')
        out.flush()
        for line in sys.stdin:
            req = json.loads(line)
            if 'seeds' in req:
                seeds = [base64.b64encode(s).decode() for s in seeds_for(req['seeds'])]
                out.write(json.dumps({'seeds': seeds}) + '\n')
                out.flush()
                continue
            data = base64.b64decode(req['data'])
            result = check(req['target'], data, ctx, req.get('time_limit', EXAMPLE_TIME_LIMIT))
            out.write(json.dumps(result) + '\n')
            out.flush()
            _clean_scratch(workdir)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def _clean_scratch(workdir):
    for name in os.listdir(workdir):
        path = os.path.join(workdir, name)
        if name.startswith(('snap', 'weights_')):
            continue
        if os.path.isdir(path):
            shutil.rmtree(path, ignore_errors=True)
        else:
            try:
                os.unlink(path)
            except OSError:
                pass


class Worker:
    """A fuzz worker process: send an example, get its outcome; a crash or
    a hang (no answer within the time limit plus slack) is an outcome too,
    after which the worker is restarted."""

    def __init__(self, time_limit=EXAMPLE_TIME_LIMIT, startup_timeout=120):
        self.time_limit = time_limit
        self.startup_timeout = startup_timeout
        self.proc = None
        self.restarts = 0

    def start(self):
        env = dict(os.environ)
        env['PYTHONPATH'] = ROOT + os.pathsep + env.get('PYTHONPATH', '')
        env.setdefault('OPENBLAS_NUM_THREADS', '1')
        env.setdefault('OMP_NUM_THREADS', '1')
        self.stderr = tempfile.TemporaryFile()
        self.workdir = tempfile.mkdtemp(prefix='caffeplus-fuzz-')
        self.proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), '--worker',
                                      '--workdir', self.workdir],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=self.stderr, env=env, cwd=ROOT)
        reply = self._read(self.startup_timeout)
        if reply is None or not reply.get('ready'):
            err = self._stderr_tail()
            self.stop()
            raise RuntimeError('fuzz worker did not start: %s' % err)

    def _stderr_tail(self, n=3000):
        try:
            self.stderr.seek(0)
            return self.stderr.read().decode('utf-8', 'replace')[-n:]
        except Exception:
            return ''

    def _read(self, timeout):
        fd = self.proc.stdout.fileno()
        ready, _, _ = select.select([fd], [], [], timeout)
        if not ready:
            return None
        line = self.proc.stdout.readline()
        if not line:
            return None
        return json.loads(line)

    def seeds(self, target):
        if self.proc is None:
            self.start()
        self.proc.stdin.write((json.dumps({'seeds': target}) + '\n').encode())
        self.proc.stdin.flush()
        reply = self._read(self.startup_timeout)
        return [base64.b64decode(s) for s in reply['seeds']]

    def run(self, target, data):
        if self.proc is None:
            self.start()
        req = json.dumps({'target': target, 'data': base64.b64encode(data).decode(),
                          'time_limit': self.time_limit})
        self.stderr.seek(0)
        self.stderr.truncate()
        try:
            self.proc.stdin.write((req + '\n').encode())
            self.proc.stdin.flush()
        except BrokenPipeError:
            pass
        reply = self._read(self.time_limit + 15)
        if reply is not None:
            return reply
        try:   # it closed its end: it died (or is dying); else it hangs
            rc = self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            rc = None
        if rc is None:
            result = {'outcome': 'hang', 'message': 'worker gave no answer within %g s'
                      % (self.time_limit + 15), 'trace': self._stderr_tail(6000)}
        else:
            result = {'outcome': 'crash', 'message': 'worker died (exit status %s)' % rc,
                      'trace': self._stderr_tail()}
        self.stop()
        self.restarts += 1
        return result

    def stop(self):
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        shutil.rmtree(self.workdir, ignore_errors=True)
        for f in (self.proc.stdin, self.proc.stdout):
            try:
                f.close()
            except Exception:
                pass
        self.stderr.close()
        self.proc = None


# -- the command line ------------------------------------------------------------
def make_example(target_name, d, seeds):
    """One input for a target: a mutated seed, or a generated input."""
    target = TARGETS[target_name]
    if target.generate is not None and (not seeds or d.bool(0.4)):
        data = target.generate(d)
        if d.bool(0.2):
            data = mutate(data, d, seeds, target.text, max_ops=2)
        return data
    if not seeds:
        return b''
    return mutate(d.choice(seeds), d, seeds, target.text)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    parser.add_argument('--seconds', type=float, default=60, help='total fuzzing time')
    parser.add_argument('--targets', default=','.join(TARGETS),
                        help='comma-separated targets (default all): %s' % ', '.join(TARGETS))
    parser.add_argument('--seed', type=int, default=1, help='random seed (runs repeat)')
    parser.add_argument('--out', default='fuzz-findings',
                        help='folder for failing inputs and their tracebacks')
    parser.add_argument('--time-limit', type=float, default=EXAMPLE_TIME_LIMIT,
                        help='seconds one example may take before it counts as a hang')
    parser.add_argument('--worker', action='store_true', help=argparse.SUPPRESS)
    parser.add_argument('--workdir', help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        worker_main(args.workdir)
        return 0
    names = [n for n in args.targets.split(',') if n]
    for n in names:
        if n not in TARGETS:
            parser.error('unknown target %s (known: %s)' % (n, ', '.join(TARGETS)))
    from caffeplus import log
    log.set_level(3)
    rnd = random.Random(args.seed)
    d = Draw(rnd)
    worker = Worker(args.time_limit)
    worker.start()
    seeds = {n: worker.seeds(n) for n in names}
    stats = {n: collections.Counter() for n in names}
    bugs = collections.OrderedDict()
    start = time.time()
    deadline = start + args.seconds
    i = 0
    try:
        while time.time() < deadline:
            name = names[i % len(names)]
            i += 1
            data = make_example(name, d, seeds[name])
            result = worker.run(name, data)
            known = known_issue(result)
            stats[name]['known' if known else result['outcome']] += 1
            if result['outcome'] in ('ok', 'error'):
                continue
            sig = '%s: %s: %s' % ('known' if known else name, result['outcome'],
                                  bug_signature(result))
            if sig not in bugs:
                bugs[sig] = (data, result)
                _save_finding(args.out, name, data, result, len(bugs))
                print('FOUND %s' % sig, flush=True)
    except KeyboardInterrupt:
        print('interrupted', flush=True)
    finally:
        worker.stop()
    elapsed = time.time() - start
    print('\nfuzz_readers: %.0f s, seed %d, %d examples, %d worker restarts'
          % (elapsed, args.seed, sum(sum(c.values()) for c in stats.values()), worker.restarts))
    print('%-12s %8s %8s %8s %6s %6s %6s %6s' % ('target', 'examples', 'ok', 'error', 'bug',
                                                 'hang', 'crash', 'known'))
    for n in names:
        c = stats[n]
        print('%-12s %8d %8d %8d %6d %6d %6d %6d' % (n, sum(c.values()), c['ok'], c['error'],
                                                     c['bug'], c['hang'], c['crash'],
                                                     c['known']))
    new = [sig for sig in bugs if not sig.startswith('known:')]
    known = [sig for sig in bugs if sig.startswith('known:')]
    if known:
        print('\n%d distinct known issue(s) (see KNOWN_ISSUES), inputs in %s:'
              % (len(known), args.out))
        for sig in known:
            print('  ' + sig)
    if new:
        print('\n%d distinct new problem(s), inputs in %s:' % (len(new), args.out))
        for sig in new:
            print('  ' + sig)
        return 1
    print('\nno new problems found')
    return 0


def _save_finding(out, name, data, result, index):
    os.makedirs(out, exist_ok=True)
    base = os.path.join(out, '%03d_%s_%s' % (index, name, result['outcome']))
    with open(base + '.bin', 'wb') as f:
        f.write(data)
    with open(base + '.txt', 'w') as f:
        f.write('target: %s\noutcome: %s\nmessage: %s\n\n%s\n'
                % (name, result['outcome'], result.get('message', ''), result.get('trace', '')))


if __name__ == '__main__':
    sys.exit(main())
