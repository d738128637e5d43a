"""Solver state files, as Caffe writes them, plus caffeplus's sidecar.

Binary (`.solverstate`): a SolverState message: iter, learned_net (the
weights file written with it), history (one BlobProto per history blob),
current_step.

HDF5 (`.solverstate.h5`): in the root, datasets `iter` (int32, shape (1,)),
`learned_net` (a scalar, NUL-terminated fixed-length string) and
`current_step` (int32, shape (1,)); group `history` with datasets `0`, `1`,
... (float32, the blob shapes).

Sidecar (`<state file>.caffeplus.json`, caffeplus only): the random
generator's state and the state of layers that have one (a data cursor, for
example), so that a resumed run continues exactly where the original was.
It records the SHA-256 of the state file and of the weights file, and is
used only while they still match; stock Caffe never reads it and the state
files themselves stay exactly what Caffe writes.

All files are written through caffeplus.io.atomic: an interrupted snapshot
leaves the previous good file in place. A snapshot writes the weights file,
then the sidecar (with the SHA-256 of the state file's bytes, computed
before they are written), and the state file last: a run killed in between
leaves no state file without its sidecar (a sidecar without its state file
is ignored). stale_temp_files() finds the temporary files such a kill leaves
behind.
"""
import hashlib
import json
import os

import numpy

from caffeplus.errors import CaffeplusError, FormatError
from caffeplus.io.atomic import atomic_path, atomic_write
from caffeplus.io.prototxt import read_binary
from caffeplus.proto import caffe_pb2

SIDECAR_SUFFIX = '.caffeplus.json'
SIDECAR_FORMAT = 'caffeplus-solverstate-sidecar'
SIDECAR_VERSION = 1


def _h5py():
    try:
        import h5py
    except ImportError:
        raise FormatError('HDF5 snapshots need the h5py package: pip install h5py')
    return h5py


def file_sha256(path):
    h = hashlib.sha256()
    with open(path, 'rb') as f:
        for chunk in iter(lambda: f.read(1 << 20), b''):
            h.update(chunk)
    return h.hexdigest()


# -- writing -----------------------------------------------------------------
def write_binaryproto(filename, it, learned_net, current_step, history, sidecar=None):
    """history: float32 arrays (NumPy). `sidecar`: a payload for
    write_sidecar, written before the state file (the state is the last
    write of a snapshot)."""
    state = caffe_pb2.SolverState()
    state.iter = int(it)
    state.learned_net = learned_net
    state.current_step = int(current_step)
    for arr in history:
        proto = state.history.add()
        proto.shape.dim.extend(arr.shape)
        proto.data.extend(numpy.asarray(arr, numpy.float32).ravel().tolist())
    data = state.SerializeToString()
    if sidecar is not None:
        write_sidecar(filename, sidecar, hashlib.sha256(data).hexdigest())
    with atomic_write(filename, 'wb') as f:
        f.write(data)


def _write_h5_string(h5py, group, name, value):
    raw = value.encode('utf-8')
    tid = h5py.h5t.C_S1.copy()
    tid.set_size(len(raw) + 1)
    tid.set_strpad(h5py.h5t.STR_NULLTERM)
    sid = h5py.h5s.create(h5py.h5s.SCALAR)
    ds = h5py.h5d.create(group.id, name.encode('ascii'), tid, sid)
    ds.write(h5py.h5s.ALL, h5py.h5s.ALL, numpy.array(raw, dtype='S%d' % (len(raw) + 1)))


def write_hdf5(filename, it, learned_net, current_step, history, sidecar=None):
    """As write_binaryproto, in Caffe's HDF5 layout."""
    h5py = _h5py()
    with atomic_path(filename) as tmp:
        with h5py.File(tmp, 'w') as f:
            f.create_dataset('iter', data=numpy.array([it], dtype='<i4'))
            _write_h5_string(h5py, f, 'learned_net', learned_net)
            f.create_dataset('current_step', data=numpy.array([current_step], dtype='<i4'))
            g = f.create_group('history')
            for i, arr in enumerate(history):
                g.create_dataset(str(i), data=numpy.asarray(arr, numpy.float32))
        if sidecar is not None:
            # The bytes the state file will have once renamed into place.
            write_sidecar(filename, sidecar, file_sha256(tmp))


def write_sidecar(state_file, payload, state_sha256=None):
    """Write `state_file`'s sidecar; `state_sha256`: the SHA-256 of the
    state file's bytes when the state file is not written yet (else it is
    read from the file)."""
    payload = dict(payload)
    payload.update(format=SIDECAR_FORMAT, version=SIDECAR_VERSION,
                   state_file=os.path.basename(state_file),
                   state_file_sha256=state_sha256 or file_sha256(state_file))
    text = json.dumps(payload, sort_keys=True, default=_json_default)
    with atomic_write(state_file + SIDECAR_SUFFIX, 'w') as f:
        f.write(text)


def _json_default(obj):
    if isinstance(obj, numpy.integer):
        return int(obj)
    if isinstance(obj, numpy.floating):
        return float(obj)
    if isinstance(obj, numpy.ndarray):
        return obj.tolist()
    raise TypeError('%r is not JSON serializable' % (obj,))


# -- reading -----------------------------------------------------------------
class LoadedState:
    """What a state file holds: iter, learned_net ('' if none), current_step,
    history (list of float32 arrays)."""

    def __init__(self, path, it, learned_net, current_step, history, fmt):
        self.path = path
        self.iter = it
        self.learned_net = learned_net
        self.current_step = current_step
        self.history = history
        self.format = fmt


def read_state(path):
    if not os.path.exists(path):
        raise FormatError('solver state file not found: %s' % path)
    if path.endswith('.h5'):
        return _read_hdf5(path)
    return _read_binaryproto(path)


INT32_MAX = 2 ** 31 - 1


def _check_counter(path, field, value):
    """iter and current_step: Caffe's int fields, never negative."""
    if not 0 <= value <= INT32_MAX:
        raise FormatError("%s: '%s' is %d; a solver state holds a non-negative 32-bit integer "
                          "there" % (path, field, value))
    return value


def _read_binaryproto(path):
    from caffeplus.blob import proto_array, proto_shape
    state = read_binary(path, caffe_pb2.SolverState(), 'solverstate')
    history = []
    for i, proto in enumerate(state.history):
        try:
            shape = proto_shape(proto)
            count = int(numpy.prod(shape)) if len(shape) else 1
            history.append(proto_array(proto, 'data', count).reshape(shape))
        except FormatError as exc:
            raise FormatError('%s: history blob %d: %s' % (path, i, exc))
    learned = state.learned_net if state.HasField('learned_net') else ''
    if isinstance(learned, bytes):    # protobuf hands back bytes that are not UTF-8
        raise FormatError("%s: 'learned_net' (the weights file name) is not valid UTF-8 text: %r"
                          % (path, learned[:200]))
    _check_counter(path, 'iter', state.iter)
    _check_counter(path, 'current_step', state.current_step)
    return LoadedState(path, state.iter, learned, state.current_step, history, 'BINARYPROTO')


# What h5py raises on a damaged or unexpected file: the HDF5 library's errors
# come out as these (bad signatures, truncated objects, unreadable chunks,
# types it cannot convert).
_H5_ERRORS = (OSError, RuntimeError, KeyError, ValueError, TypeError, IndexError, AttributeError,
              OverflowError, UnicodeError)


def _h5(path, field, func):
    """func() with h5py's errors as a FormatError naming the file and the field."""
    try:
        return func()
    except _H5_ERRORS as exc:
        raise FormatError("%s: cannot read '%s': the HDF5 file is damaged or not a Caffe solver "
                          "state (%s: %s)" % (path, field, type(exc).__name__, exc))


def _h5_dataset(h5py, parent, path, field, key=None, required=True):
    """parent[key] if it is a dataset; None if absent and not `required`."""
    key = field if key is None else key
    if not _h5(path, field, lambda: key in parent):
        if not required:
            return None
        raise FormatError("%s: no '%s' in the file: not a Caffe HDF5 solver state" % (path, field))
    ds = _h5(path, field, lambda: parent[key])
    if not isinstance(ds, h5py.Dataset):
        raise FormatError("%s: '%s' is a group, not a dataset" % (path, field))
    return ds


def _h5_shape_count(path, field, ds):
    shape = _h5(path, field, lambda: ds.shape)
    if shape is None:      # a null dataspace: no values at all
        return None, 0
    shape = tuple(int(d) for d in shape)
    count = 1
    for d in shape:
        count *= d
    return shape, count


def _h5_int(h5py, f, path, field):
    """A Caffe int field (iter, current_step): one integer value. The type is
    checked before reading (libhdf5 can loop forever reading a damaged
    variable-length string)."""
    ds = _h5_dataset(h5py, f, path, field)
    dtype = _h5(path, field, lambda: ds.dtype)
    if dtype.kind not in 'iu':
        raise FormatError("%s: '%s' has type %s; Caffe writes an integer there"
                          % (path, field, dtype))
    shape, count = _h5_shape_count(path, field, ds)
    if count != 1:
        raise FormatError("%s: '%s' holds %d values (shape %s); Caffe writes exactly one"
                          % (path, field, count, shape))
    value = _h5(path, field, lambda: numpy.asarray(ds[()]).ravel()[0])
    return _check_counter(path, field, int(value))


def _h5_string(h5py, f, path, field):
    """learned_net: a fixed-length, NUL-terminated string ('' if absent)."""
    ds = _h5_dataset(h5py, f, path, field, required=False)
    if ds is None:
        return ''
    dtype = _h5(path, field, lambda: ds.dtype)
    if dtype.kind != 'S':
        raise FormatError("%s: '%s' has type %s; Caffe writes a fixed-length string there"
                          % (path, field, dtype))
    shape, count = _h5_shape_count(path, field, ds)
    if count != 1:
        raise FormatError("%s: '%s' holds %d values (shape %s); Caffe writes one string"
                          % (path, field, count, shape))
    raw = _h5(path, field, lambda: ds[()])
    if isinstance(raw, numpy.ndarray):
        raw = raw.ravel()[0]
    if isinstance(raw, numpy.bytes_):
        raw = bytes(raw)
    if not isinstance(raw, bytes):
        raise FormatError("%s: '%s' is not a string (%s)" % (path, field, type(raw).__name__))
    raw = raw.split(b'\0', 1)[0]
    try:
        return raw.decode('utf-8')
    except UnicodeDecodeError:
        raise FormatError("%s: '%s' (the weights file name) is not valid UTF-8 text: %r"
                          % (path, field, raw[:200]))


def _h5_history(h5py, f, path):
    """The 'history' group's datasets '0', '1', ... as float32 arrays."""
    from caffeplus.blob import check_count
    if not _h5(path, 'history', lambda: 'history' in f):
        raise FormatError("%s: no 'history' in the file: not a Caffe HDF5 solver state" % path)
    group = _h5(path, 'history', lambda: f['history'])
    if not isinstance(group, h5py.Group):
        raise FormatError("%s: 'history' is a dataset, not a group of history blobs" % path)
    names = set(_h5(path, 'history', lambda: list(group)))
    history = []
    for i in range(len(names)):
        field = 'history/%d' % i
        if str(i) not in names:
            raise FormatError("%s: the history group lacks dataset '%d' (it has %s)"
                              % (path, i, ', '.join(sorted(names)[:10])))
        ds = _h5_dataset(h5py, group, path, field, key=str(i))
        dtype = _h5(path, field, lambda: ds.dtype)
        if dtype.kind not in 'fiu':
            raise FormatError("%s: '%s' has type %s; expected float values"
                              % (path, field, dtype))
        shape, _ = _h5_shape_count(path, field, ds)
        if shape is None:
            raise FormatError("%s: '%s' has no dataspace (no values)" % (path, field))
        try:
            check_count(shape, '%s: %s' % (path, field))
        except CaffeplusError as exc:
            raise FormatError(str(exc))
        history.append(numpy.asarray(_h5(path, field, lambda: ds[()]), dtype=numpy.float32)
                       .reshape(shape))
    return history


def _read_hdf5(path):
    """Caffe's HDF5 solver state. Every h5py access is guarded, every type
    checked before reading: a damaged or foreign file is a FormatError
    naming the file and the field."""
    h5py = _h5py()
    try:
        f = h5py.File(path, 'r')
    except _H5_ERRORS as exc:
        raise FormatError('%s: not a readable HDF5 file (%s)' % (path, exc))
    with f:
        for key in ('iter', 'current_step', 'history'):
            if not _h5(path, key, lambda: key in f):
                raise FormatError("%s: no '%s' in the file: not a Caffe HDF5 solver state"
                                  % (path, key))
        it = _h5_int(h5py, f, path, 'iter')
        current_step = _h5_int(h5py, f, path, 'current_step')
        learned = _h5_string(h5py, f, path, 'learned_net')
        history = _h5_history(h5py, f, path)
    return LoadedState(path, it, learned, current_step, history, 'HDF5')


def read_sidecar(state_file):
    """The sidecar's dict if it exists and belongs to `state_file` as it is
    now, else (None, reason)."""
    path = state_file + SIDECAR_SUFFIX
    if not os.path.exists(path):
        return None, 'no %s' % os.path.basename(path)
    try:
        with open(path) as f:
            payload = json.load(f)
    except (OSError, ValueError) as exc:
        return None, '%s is unreadable (%s)' % (path, exc)
    if payload.get('format') != SIDECAR_FORMAT or payload.get('version') != SIDECAR_VERSION:
        return None, '%s is not a caffeplus sidecar of version %d' % (path, SIDECAR_VERSION)
    if payload.get('state_file_sha256') != file_sha256(state_file):
        return None, '%s was written for a different %s' % (path, os.path.basename(state_file))
    return payload, ''


def _temp_pattern(prefix_name):
    """What caffeplus.io.atomic names the temporary files of a snapshot of
    `prefix_name` (the base name of snapshot_prefix): '.<name>.XXXXXXXX.tmp'
    for <name> = <prefix>_iter_<N>.caffemodel[.h5], .solverstate[.h5] and
    their sidecars (.caffeplus.json, caffeplus.parallel's .ranks.json)."""
    import re
    return re.compile(r'^\.%s_iter_\d+\.(caffemodel|solverstate)(\.h5)?'
                      r'(\.caffeplus\.json|\.ranks\.json)?\.[A-Za-z0-9_]{8}\.tmp$'
                      % re.escape(prefix_name))


def stale_temp_files(snapshot_prefix):
    """Temporary files a killed snapshot of `snapshot_prefix` left in the
    snapshot folder (only names caffeplus.io.atomic gives a snapshot's
    files; nothing else in the folder)."""
    directory = os.path.dirname(snapshot_prefix) or '.'
    pattern = _temp_pattern(os.path.basename(snapshot_prefix))
    try:
        names = os.listdir(directory)
    except OSError:
        return []
    return sorted(os.path.join(directory, n) for n in names if pattern.match(n) and
                  os.path.isfile(os.path.join(directory, n)))


def caffeplus_sidecars_beside(state_file):
    """Other caffeplus sidecars of the same snapshot prefix beside
    `state_file` (a sign that caffeplus wrote the snapshots of that folder)."""
    import re
    directory = os.path.dirname(state_file) or '.'
    m = re.match(r'^(.*)_iter_\d+\.solverstate(\.h5)?$', os.path.basename(state_file))
    if not m:
        return []
    pattern = re.compile(r'^%s_iter_\d+\.solverstate(\.h5)?%s$'
                         % (re.escape(m.group(1)), re.escape(SIDECAR_SUFFIX)))
    try:
        names = os.listdir(directory)
    except OSError:
        return []
    own = os.path.basename(state_file) + SIDECAR_SUFFIX
    return sorted(n for n in names if pattern.match(n) and n != own)


def resolve_learned_net(state_path, learned_net):
    """Where the weights file named in a state file is: as written
    (relative to the working directory, as Caffe reads it), else beside the
    state file."""
    if os.path.exists(learned_net):
        return learned_net
    beside = os.path.join(os.path.dirname(state_path), os.path.basename(learned_net))
    if os.path.exists(beside):
        return beside
    raise CaffeplusError(
        "solver state %s: its weights file (learned_net) '%s' was not found, neither "
        "relative to the working directory %s nor beside the state file as %s"
        % (state_path, learned_net, os.getcwd(), beside))
