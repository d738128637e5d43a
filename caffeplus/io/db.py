"""Key-value databases of Datum records: LMDB (the lmdb package) and LevelDB.

    db = open_db('train_lmdb', 'lmdb')          # read: key order, like Caffe
    for key, value in db.items(): ...
    with open_db('out_lmdb', 'lmdb', 'new') as db:
        db.put(b'00000000', datum.SerializeToString()); db.commit()

Modes: 'r' read only (the database must exist), 'new' create (fails if the
path exists, as Caffe's NEW), 'w' create or append.

LMDB is opened read-only without locking for reading (as Caffe's MDB_RDONLY |
MDB_NOTLS, and safe while another process writes elsewhere). LevelDB needs the
`plyvel` package; without it opening a LevelDB gives an error that says so.

`RecordReader` walks a database in key order forever, wrapping around at the
end with Caffe's log line "Restarting data prefetching from start.", and can
report and restore its position so a resumed run reads on where it stopped.
"""
import copy
import os
import threading

from caffeplus import log
from caffeplus.errors import CaffeplusError
from caffeplus.proto import caffe_pb2

LMDB, LEVELDB = 'lmdb', 'leveldb'
_LMDB_INITIAL_MAP = 1 << 30


class DatabaseError(CaffeplusError):
    """A database that is missing, of the wrong kind, or cannot be opened."""


def backend_name(backend):
    """'lmdb' or 'leveldb' from a name or a DataParameter.DB value."""
    if isinstance(backend, str):
        name = backend.strip().lower()
        if name in (LMDB, LEVELDB):
            return name
        raise DatabaseError("unknown database backend '%s' (expected LMDB or LEVELDB)" % backend)
    value = int(backend)
    if value == caffe_pb2.DataParameter.LMDB:
        return LMDB
    if value == caffe_pb2.DataParameter.LEVELDB:
        return LEVELDB
    raise DatabaseError('unknown database backend %d' % value)


def is_lmdb(path):
    return os.path.isfile(os.path.join(path, 'data.mdb'))


def is_leveldb(path):
    return os.path.isfile(os.path.join(path, 'CURRENT'))


def open_db(path, backend=LMDB, mode='r'):
    """An LMDB or LevelDB database at `path`."""
    backend = backend_name(backend)
    path = os.fspath(path)
    if mode not in ('r', 'w', 'new'):
        raise ValueError("mode must be 'r', 'w' or 'new', not %r" % (mode,))
    if mode == 'new' and os.path.exists(path):
        raise DatabaseError('cannot create %s database %s: the path already exists'
                            % (backend.upper() if backend == LMDB else 'LevelDB', path))
    if backend == LMDB:
        return LMDBDatabase(path, mode)
    return LevelDBDatabase(path, mode)


def _check_readable(path, kind):
    if not path:
        raise DatabaseError('no %s database given (data_param.source is empty)' % kind)
    if not os.path.exists(path):
        raise DatabaseError('%s database not found: %s (no such file or directory; paths '
                            'are relative to the current directory %s)'
                            % (kind, path, os.getcwd()))


class Database:
    """Common interface: items(), cursor(), put(), commit(), close()."""
    kind = ''

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        if exc[0] is None and self.writable:
            self.commit()
        self.close()

    def items(self):
        """(key, value) pairs in key order."""
        cur = self.cursor()
        cur.seek_to_first()
        while cur.valid():
            yield cur.key(), cur.value()
            cur.next()

    def __len__(self):
        return self.count()


# -- LMDB ----------------------------------------------------------------------
def _lmdb_module():
    try:
        import lmdb
    except ImportError:
        raise DatabaseError("the LMDB backend needs the 'lmdb' package, which is not "
                            "installed (pip install lmdb)")
    return lmdb


class LMDBDatabase(Database):
    kind = 'LMDB'

    def __init__(self, path, mode='r'):
        lmdb = _lmdb_module()
        self.path = path
        self.writable = mode != 'r'
        self._pending = []
        self._shared = False
        if not self.writable:
            _check_readable(path, 'LMDB')
            subdir = os.path.isdir(path)
            if subdir and not is_lmdb(path):
                hint = ' (it looks like a LevelDB; use backend: LEVELDB)' \
                    if is_leveldb(path) else ''
                raise DatabaseError('%s is not an LMDB database: no data.mdb in it%s'
                                    % (path, hint))
            self.env = _open_shared_env(path, subdir)
            self._shared = True
        else:
            if not os.path.exists(path):
                try:
                    os.makedirs(path, 0o755)
                except OSError as exc:
                    raise DatabaseError('cannot create LMDB directory %s: %s'
                                        % (path, exc.strerror or exc))
            try:
                self.env = lmdb.open(path, map_size=_LMDB_INITIAL_MAP, subdir=True)
            except lmdb.Error as exc:
                raise DatabaseError('cannot open LMDB database %s for writing: %s'
                                    % (path, exc))
            # Grow past what is already stored.
            info = self.env.info()
            used = (info['last_pgno'] + 1) * self.env.stat()['psize']
            if used * 2 > info['map_size']:
                self.env.set_mapsize(used * 2)
        log.info('Opened lmdb %s', path)

    def count(self):
        return self.env.stat()['entries']

    def cursor(self, in_place=False):
        """A cursor; in_place: values are read-only views of the database's
        mapped pages, not copies, valid while the database stays open."""
        return _LMDBCursor(self, in_place)

    def get(self, key):
        with self.env.begin() as txn:
            return txn.get(_bytes(key))

    def put(self, key, value):
        if not self.writable:
            raise DatabaseError('LMDB database %s was opened read-only' % self.path)
        self._pending.append((_bytes(key), bytes(value)))

    def commit(self):
        lmdb = _lmdb_module()
        if not self._pending:
            return
        while True:
            try:
                with self.env.begin(write=True) as txn:
                    for k, v in self._pending:
                        txn.put(k, v)
                break
            except lmdb.MapFullError:
                # Caffe doubles the map when full; the aborted txn left nothing.
                self.env.set_mapsize(self.env.info()['map_size'] * 2)
        self._pending = []

    def close(self):
        if getattr(self, 'env', None) is not None:
            if self._shared:
                _release_shared_env(self.env)
            else:
                self.env.close()
            self.env = None


# The lmdb package refuses to open one environment twice in a process, so
# readers of the same database (a TRAIN and a TEST net, two layers) share one
# read-only Environment; each has its own transaction and cursor.
_SHARED_ENVS = {}
# Re-entrant: lmdb.open (or anything allocating under the lock) can run the
# garbage collector, whose finalizer of an unreachable reader releases its
# environment here, in the same thread (a plain Lock deadlocked the suite).
_SHARED_LOCK = threading.RLock()


def _open_shared_env(path, subdir):
    lmdb = _lmdb_module()
    real = os.path.realpath(path)
    with _SHARED_LOCK:
        entry = _SHARED_ENVS.get(real)
        if entry is None:
            try:
                env = lmdb.open(path, readonly=True, lock=False, subdir=subdir,
                                readahead=False, max_readers=512)
            except lmdb.Error as exc:
                raise DatabaseError('cannot open LMDB database %s: %s' % (path, exc))
            entry = _SHARED_ENVS[real] = [env, 0]
        entry[1] += 1
        return entry[0]


def _release_shared_env(env):
    with _SHARED_LOCK:
        for real, entry in list(_SHARED_ENVS.items()):
            if entry[0] is env:
                entry[1] -= 1
                if entry[1] <= 0:
                    del _SHARED_ENVS[real]
                    env.close()
                return


class _LMDBCursor:
    def __init__(self, db, in_place=False):
        # The read transaction lasts as long as the cursor: LMDB keeps the
        # pages it sees, so in-place values stay valid while it lives.
        self._txn = db.env.begin(buffers=bool(in_place))
        self._cur = self._txn.cursor()
        self._valid = self._cur.first()

    def seek_to_first(self):
        self._valid = self._cur.first()

    def seek(self, key):
        """Position at `key` exactly; False (and invalid) if it is absent."""
        self._valid = self._cur.set_key(_bytes(key))
        return self._valid

    def next(self):
        self._valid = self._cur.next()

    def valid(self):
        return self._valid

    def key(self):
        return bytes(self._cur.key())

    def value(self):
        return self._cur.value()


# -- LevelDB -------------------------------------------------------------------
def _plyvel_module():
    try:
        import plyvel
    except ImportError:
        raise DatabaseError("the LevelDB backend needs the 'plyvel' package, which is not "
                            "installed (pip install plyvel); or convert the database to "
                            "LMDB and set backend: LMDB")
    return plyvel


class LevelDBDatabase(Database):
    kind = 'LevelDB'

    def __init__(self, path, mode='r'):
        self.path = path
        self.writable = mode != 'r'
        if not self.writable:
            _check_readable(path, 'LevelDB')
            if is_lmdb(path):
                raise DatabaseError('%s is an LMDB database but the backend is LEVELDB (the '
                                    'default of data_param.backend); set backend: LMDB' % path)
        plyvel = _plyvel_module()
        try:
            self.db = plyvel.DB(path, create_if_missing=self.writable,
                                error_if_exists=(mode == 'new'),
                                block_size=65536, write_buffer_size=268435456,
                                max_open_files=100)
        except Exception as exc:
            raise DatabaseError('Failed to open leveldb %s: %s' % (path, exc))
        self._batch = None
        log.info('Opened leveldb %s', path)

    def count(self):
        n = 0
        for _ in self.db.iterator(include_value=False):
            n += 1
        return n

    def cursor(self):
        return _LevelDBCursor(self)

    def get(self, key):
        return self.db.get(_bytes(key))

    def put(self, key, value):
        if not self.writable:
            raise DatabaseError('LevelDB database %s was opened read-only' % self.path)
        if self._batch is None:
            self._batch = self.db.write_batch()
        self._batch.put(_bytes(key), bytes(value))

    def commit(self):
        if self._batch is not None:
            self._batch.write()
            self._batch = None

    def close(self):
        if getattr(self, 'db', None) is not None:
            self.db.close()
            self.db = None


class _LevelDBCursor:
    def __init__(self, db):
        self._snapshot = db.db.snapshot()
        self._it = self._snapshot.iterator()
        self.seek_to_first()

    def _advance(self):
        try:
            self._kv = next(self._it)
        except StopIteration:
            self._kv = None

    def seek_to_first(self):
        self._it.seek_to_start()
        self._advance()

    def seek(self, key):
        key = _bytes(key)
        self._it.seek(key)
        self._advance()
        if self._kv is not None and self._kv[0] != key:
            self._kv = None
        return self._kv is not None

    def next(self):
        self._advance()

    def valid(self):
        return self._kv is not None

    def key(self):
        return self._kv[0]

    def value(self):
        return self._kv[1]


def _bytes(key):
    if isinstance(key, str):
        return key.encode('utf-8')
    return bytes(key)


# -- Caffe's looping reader ----------------------------------------------------
class RecordReader:
    """Records of a database in key order, forever, as Caffe's DataLayer reads.

    `next()` returns (key, value) and moves on; at the end it logs "Restarting
    data prefetching from start." and starts over. `offset` counts the records
    read so far (over all passes); `state()`/`restore()` give and take the
    position as plain Python values.
    """

    def __init__(self, source, backend=LMDB, in_place=False):
        self.source = os.fspath(source)
        self.db = open_db(self.source, backend, 'r')
        # in_place (LMDB): values are views of the mapped database, valid
        # until close(); copying a 196 KB image value costs page faults and
        # holds the GIL, which the net's own thread then waits for.
        self.cursor = self.db.cursor(in_place=True) if in_place and self.db.kind == 'LMDB' \
            else self.db.cursor()
        self.position = 0       # index in key order of the current record
        self.offset = 0         # records consumed
        self.cursor.seek_to_first()
        if not self.cursor.valid():
            raise DatabaseError('%s database %s is empty' % (self.db.kind, self.source))

    def current(self):
        return self.cursor.key(), self.cursor.value()

    def advance(self):
        self.cursor.next()
        self.position += 1
        if not self.cursor.valid():
            log.info('Restarting data prefetching from start.')
            self.cursor.seek_to_first()
            self.position = 0
        self.offset += 1

    def next(self):
        record = self.current()
        self.advance()
        return record

    def state(self):
        return {'offset': self.offset, 'position': self.position,
                'key': self.cursor.key().hex()}

    def restore(self, state):
        key = bytes.fromhex(state['key']) if state.get('key') is not None else None
        if key is None or not self.cursor.seek(key):
            # The key is gone (a different database?): fall back to the index.
            self.cursor.seek_to_first()
            for _ in range(int(state.get('position', 0))):
                self.cursor.next()
                if not self.cursor.valid():
                    self.cursor.seek_to_first()
        self.position = int(state.get('position', 0))
        self.offset = int(state.get('offset', 0))

    def close(self):
        self.db.close()


class CachedRecordReader:
    """NVCaffe's `cache` and `shuffle` (data_param) over a RecordReader: the
    first pass reads the database in key order and keeps each record's bytes;
    later passes are served from memory, each in a new random order when
    `shuffle`. The same interface as RecordReader; state() and restore()
    give and take the position (a restore after the first pass reads the
    database once again to refill the cache, and redraws the pass's order
    from the generator state kept before it was drawn).
    """

    def __init__(self, reader, shuffle=False, rng=None):
        self.reader = reader
        self.source = reader.source
        self.shuffle = bool(shuffle)
        self.rng = rng
        self.records = []
        self.complete = False       # every record cached
        self.order = None
        self.index = 0              # position in this pass's order
        self.offset = 0
        self._order_state = None

    @property
    def position(self):
        return self.index if self.complete else self.reader.position

    def current(self):
        if self.complete:
            return self.records[self.order[self.index]]
        return self.reader.current()

    def _cache_current(self):
        """Keep a copy of the database's current record and move on; whether
        that read the database through (the reader is back at its start)."""
        self.records.append(tuple(bytes(b) for b in self.reader.current()))
        self.reader.advance()
        return self.reader.position == 0

    def advance(self):
        self.offset += 1
        if not self.complete:
            if self._cache_current():
                self._begin_pass(from_memory=True)
            return
        self.index += 1
        if self.index == len(self.records):
            log.info('Restarting data prefetching from start.')
            self._begin_pass()

    def _begin_pass(self, from_memory=False):
        if from_memory:
            self.complete = True
            log.info('Cached %d records of %s in memory%s', len(self.records), self.source,
                     '; shuffling them every pass' if self.shuffle else '')
        self.index = 0
        if self.shuffle:
            self._order_state = copy.deepcopy(self.rng.bit_generator.state)
            self.order = self.rng.permutation(len(self.records))
        else:
            self.order = range(len(self.records))

    def next(self):
        record = self.current()
        self.advance()
        return record

    def state(self):
        if not self.complete:
            # The generator as it is now will draw the second pass's order.
            rng = copy.deepcopy(self.rng.bit_generator.state) if self.shuffle else None
            return {'reader': self.reader.state(), 'cached': False, 'offset': self.offset,
                    'order_rng': rng}
        return {'cached': True, 'index': self.index, 'offset': self.offset,
                'order_rng': self._order_state}

    def restore(self, state):
        if not state.get('cached'):
            # The first pass: the records before the position are read again
            # into the cache.
            self.records, self.complete = [], False
            target = int(state['reader'].get('position', 0))
            self.reader.restore({'position': 0, 'offset': 0})
            for _ in range(target):
                self._cache_current()
            if self.shuffle:
                self.rng.bit_generator.state = copy.deepcopy(state['order_rng'])
            self.offset = int(state.get('offset', 0))
            return
        if not self.complete:
            self.reader.restore({'position': 0, 'offset': 0})
            self.records = []
            while not self._cache_current():
                pass
            self.complete = True
        if self.shuffle:
            self.rng.bit_generator.state = copy.deepcopy(state['order_rng'])
        self._begin_pass()
        self.index = int(state['index'])
        self.offset = int(state.get('offset', 0))

    def close(self):
        self.reader.close()
        self.records = []


def read_datums(path, backend=LMDB):
    """(key, Datum) pairs of a database in key order."""
    from caffeplus.io.datum import parse_datum
    db = open_db(path, backend, 'r')
    try:
        for key, value in db.items():
            yield key, parse_datum(value, key, path)
    finally:
        db.close()
