"""Start and supervise the ranks of data-parallel training.

Two ways in, both from `caffeplus train` (caffeplus/commands/train.py hands
over here when -gpu names several devices or an MPI launcher started the
process):

  * `caffeplus train -solver s.prototxt -gpu 0,1` (or `-gpu all`): this
    process validates the devices and NCCL, then starts one process per GPU
    (`python -m caffeplus.parallel RUNDIR RANK`, each in its own
    session, so no interpreter lock is shared) and supervises them. The
    ranks meet over TCP on localhost (rank 0 publishes its port in RUNDIR),
    rank 0 sends its NCCL unique id over that channel, and gradients go
    through NCCL. SIGINT, SIGHUP and SIGTERM sent to this process are
    passed to rank 0, which decides for all ranks (SIGTERM always stops
    them cleanly, with the final snapshot, and the run exits 0; a second
    SIGTERM stops the ranks at once, status 143). If a rank fails, the
    others are stopped and the error names the rank, its GPU and its
    message.

  * `mpirun -np N caffeplus train -solver s.prototxt [-gpu all]`: every MPI
    rank runs here. With -gpu (or a GPU solver_mode) each rank takes the
    device of its local rank on its host from the -gpu list (`all`: every
    GPU of the host), MPI carries the start-up and the NCCL unique id, NCCL
    the gradients. Without a GPU the ranks train on the CPU and all-reduce
    through MPI. A failing rank prints its error and aborts the MPI job.

supervise(args, param, devices) also accepts devices [None, None, ...]:
CPU ranks over the TCP channel (used by the tests to exercise the
supervisor without GPUs).

The supervisor hands the job to the ranks as RUNDIR/job.json (mode 0600 in
a private folder): the command-line flags, the solver parameter (its
protobuf bytes in base64), the devices. Nothing there is executable.
"""
import argparse
import base64
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import traceback

from caffeplus import config, log
from caffeplus.errors import CaffeplusError
from caffeplus.parallel import comm as comm_mod

# How long ranks that finished wait for the others before they count as hung.
FINISH_GRACE_S = 300.0
TERMINATE_GRACE_S = 5.0


# -- validation -------------------------------------------------------------------
def device_count():
    """The number of CUDA devices CuPy sees (a CaffeplusError without CuPy)."""
    try:
        import cupy
    except ImportError as exc:
        raise CaffeplusError('training on GPUs needs CuPy, which is not installed (%s). '
                             'Install it with `pip install caffeplus[gpu]`.' % exc)
    try:
        return int(cupy.cuda.runtime.getDeviceCount())
    except Exception as exc:  # no driver, no device
        raise CaffeplusError('no usable GPU: %s' % exc)


def validate_gpus(gpus, count, spec=None):
    """Check a -gpu list (distinct, and below `count` unless count is None);
    return it as a list of ints."""
    spec = spec if spec is not None else ','.join(str(g) for g in gpus)
    gpus = [int(g) for g in gpus]
    if not gpus:
        raise CaffeplusError('-gpu %s names no GPU' % spec)
    seen, dups = set(), []
    for g in gpus:
        if g in seen and g not in dups:
            dups.append(g)
        seen.add(g)
    if dups:
        raise CaffeplusError('-gpu %s names GPU %s more than once; each rank needs a GPU of '
                             'its own' % (spec, ', '.join(str(g) for g in dups)))
    if count is None:       # the device count is not known yet
        return gpus
    have = 'no GPU' if count == 0 else '%d GPU%s (%s)' % (
        count, '' if count == 1 else 's', ', '.join(str(i) for i in range(count)))
    bad = [g for g in gpus if g < 0 or g >= count]
    if bad:
        raise CaffeplusError('-gpu %s: there is no GPU %s on this machine; it has %s'
                             % (spec, ', '.join(str(g) for g in bad), have))
    return gpus


def check_gpu_launch(gpus, spec=None, count=None):
    """Everything that can be checked before any rank starts: the devices
    exist and are distinct, and CuPy can load NCCL."""
    validate_gpus(gpus, None, spec)     # duplicates first: no CUDA needed to see them
    if count is None:
        count = device_count()
    gpus = validate_gpus(gpus, count, spec)
    comm_mod.import_nccl()
    return gpus


def mpi_world_size():
    return comm_mod.mpi_env_world_size()


def gpu_name(device):
    from caffeplus.backend import gpu_name as name
    return name(device)


# -- the entry point from `caffeplus train` ---------------------------------------
def launch(args, param, gpus):
    """Run data-parallel training; returns the exit code."""
    if comm_mod.mpi_env_world_size() > 1:
        return run_mpi(args, param, gpus)
    return supervise(args, param, gpus)


# -- the environment of a rank ----------------------------------------------------------
# Where the interpreter finds its own modules: a rank gets these anyway.
def _interpreter_dirs():
    import site
    dirs = {sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix}
    try:
        dirs.update(site.getsitepackages())
    except AttributeError:      # some virtualenvs' site module
        pass
    user = getattr(site, 'getusersitepackages', lambda: None)()
    if user:
        dirs.add(user)
    return [os.path.abspath(d) for d in dirs if d]


def _under(path, dirs):
    return any(path == d or path.startswith(d.rstrip(os.sep) + os.sep) for d in dirs)


def rank_pythonpath(pythonpath, sys_path=None):
    """PYTHONPATH for a rank: the parent's own PYTHONPATH first, then the
    folder this caffeplus is imported from and whatever else the parent's
    sys.path holds beyond the interpreter's own folders (wheels carried in
    a folder put on sys.path, a source checkout), so a rank imports the
    same caffeplus and the same packages as the process that started it."""
    from caffeplus import __file__ as package_file
    entries = [p for p in (pythonpath or '').split(os.pathsep) if p]
    seen = {os.path.abspath(p) for p in entries}
    own = _interpreter_dirs()
    extra = [os.path.dirname(os.path.dirname(os.path.abspath(package_file)))]
    extra += list(sys.path if sys_path is None else sys_path)
    for p in extra:
        if not p or not os.path.isabs(p) or not os.path.isdir(p):
            continue
        p = os.path.abspath(p)
        if p not in seen and not _under(p, own):
            entries.append(p)
            seen.add(p)
    return os.pathsep.join(entries)


def gpu_rank_defaults(env):
    """What a GPU rank's environment holds unless it says otherwise: no
    NVLink multicast in NCCL (NVLS; the GPU machines' rule)."""
    env.setdefault('NCCL_NVLS_ENABLE', '0')
    return env


def gpu_rank_settings():
    """A GPU rank searches convolution algorithms as `caffeplus train -gpu N`
    does (ranks do not go through its use_device; without it they ran cuDNN's
    heuristic choices, slower than the one-GPU run they are compared with)."""
    config.set_command_default('cudnn_search', 'auto')


def rank_environ(base, rank, world, device):
    """The environment of spawned rank `rank`: the parent's, PYTHONPATH
    completed (rank_pythonpath), the rank variables, no MPI variables (a
    spawned rank must not mistake itself for an MPI rank), GPU defaults."""
    env = dict(base)
    env.update(_CAFFEPLUS_RANK=str(rank), _CAFFEPLUS_WORLD=str(world),
               _CAFFEPLUS_LOCAL_RANK=str(rank))
    for name in comm_mod._MPI_SIZE_VARS + ('_CAFFEPLUS_MPI',):
        env.pop(name, None)
    path = rank_pythonpath(env.get('PYTHONPATH', ''))
    if path:
        env['PYTHONPATH'] = path
    if device is not None:
        gpu_rank_defaults(env)
    return env


# -- supervisor ---------------------------------------------------------------------
def _describe(rank, device):
    return 'rank %d (%s)' % (rank, 'CPU' if device is None else 'GPU %d' % device)


def _signal_name(signum):
    try:
        return signal.Signals(signum).name
    except ValueError:
        return 'signal %d' % signum


class _Child:
    def __init__(self, rank, device, proc):
        self.rank, self.device, self.proc = rank, device, proc
        self.code = None
        self.exited_at = None


def supervise(args, param, devices, count=None):
    """Start one process per device (None: a CPU rank) and wait for them."""
    devices = list(devices)
    world = len(devices)
    if world < 1:
        raise CaffeplusError('no ranks to start')
    gpus = [d for d in devices if d is not None]
    if gpus:
        spec = getattr(args, 'gpu', None) or ','.join(str(g) for g in gpus)
        check_gpu_launch(gpus, spec, count)
        log.info('Using GPUs %s', ', '.join(str(g) for g in gpus))
        for g in gpus:
            log.info('GPU %d: %s', g, gpu_name(g))
    rundir = tempfile.mkdtemp(prefix='caffeplus-train-')
    children = []
    previous = {}
    try:
        write_job(rundir, args, param, devices, world)
        log.info('Starting %d ranks (one process per %s)', world, 'GPU' if gpus else 'rank')
        for rank, device in enumerate(devices):
            proc = subprocess.Popen(
                [sys.executable, '-m', 'caffeplus.parallel', rundir, str(rank)],
                env=rank_environ(os.environ, rank, world, device), start_new_session=True)
            children.append(_Child(rank, device, proc))

        terminating = []

        def forward(signum, frame):
            if signum == getattr(signal, 'SIGTERM', None):
                if terminating:
                    # The ranks did not stop after the first: stop them now
                    # (the finally below), as single-process training does.
                    raise SystemExit(128 + signum)
                terminating.append(signum)
            root = children[0].proc
            if root.poll() is None:
                try:
                    os.kill(root.pid, signum)
                except OSError:
                    pass
        for name in ('SIGINT', 'SIGHUP', 'SIGTERM'):
            signum = getattr(signal, name, None)
            if signum is not None:
                try:
                    previous[signum] = signal.signal(signum, forward)
                except ValueError:  # not the main thread: signals stay with the caller
                    pass
        return _monitor(children, rundir)
    finally:
        for signum, old in previous.items():
            signal.signal(signum, old)
        _stop_all(children, rundir)
        shutil.rmtree(rundir, ignore_errors=True)


JOB_FILE = 'job.json'
JOB_FORMAT = 'caffeplus-parallel-job'


def _plain(value):
    """JSON's kinds of value (lists of them too), else None."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return True
    if isinstance(value, (list, tuple)):
        return all(_plain(v) for v in value)
    return False


def write_job(rundir, args, param, devices, world):
    """RUNDIR/job.json for the ranks (private: mode 0600)."""
    flags = {k: v for k, v in sorted(vars(args).items()) if _plain(v)}
    job = {'format': JOB_FORMAT, 'version': 1, 'args': flags,
           'param': base64.b64encode(param.SerializeToString()).decode('ascii'),
           'devices': [None if d is None else int(d) for d in devices], 'world': int(world),
           'parent': os.getpid(), 'cwd': os.getcwd()}
    path = os.path.join(rundir, JOB_FILE)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, 'w') as f:
        json.dump(job, f)


def read_job(rundir):
    """(job dict, args Namespace, solver parameter bytes) from RUNDIR/job.json."""
    path = os.path.join(rundir, JOB_FILE)
    try:
        with open(path) as f:
            job = json.load(f)
        if job.get('format') != JOB_FORMAT:
            raise ValueError('not a %s file' % JOB_FORMAT)
        param = base64.b64decode(job['param'].encode('ascii'), validate=True)
        args = argparse.Namespace(**job['args'])
        world = int(job['world'])
        devices = [None if d is None else int(d) for d in job['devices']]
        if world < 1 or len(devices) != world:
            raise ValueError('%d devices for %d ranks' % (len(devices), world))
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise CaffeplusError('cannot read the job of this rank from %s: %s' % (path, exc))
    job['world'], job['devices'] = world, devices
    return job, args, param


def _read_error(rundir, rank):
    try:
        with open(os.path.join(rundir, 'rank%d.error' % rank)) as f:
            kind, _, message = f.read().partition('\n')
        return kind.strip(), message.strip()
    except OSError:
        return '', ''


def _monitor(children, rundir):
    first_done = None
    while True:
        now = time.monotonic()
        for c in children:
            if c.code is None:
                code = c.proc.poll()
                if code is not None:
                    c.code, c.exited_at = code, now
        failed = [c for c in children if c.code not in (None, 0)]
        if failed:
            break
        if all(c.code == 0 for c in children):
            return 0
        if first_done is None and any(c.code == 0 for c in children):
            first_done = now
        if first_done is not None and now - first_done > FINISH_GRACE_S:
            hung = [c for c in children if c.code is None]
            raise CaffeplusError('%s did not finish within %d s after the other ranks did; '
                                 'stopped it' % (', '.join(_describe(c.rank, c.device)
                                                           for c in hung), FINISH_GRACE_S))
        time.sleep(0.05)
    # A rank failed: let the others notice for a moment (their own errors
    # tell whether they are the cause or saw it), then stop them.
    _touch(os.path.join(rundir, 'abort'))
    deadline = time.monotonic() + 1.0
    while time.monotonic() < deadline and any(c.proc.poll() is None for c in children):
        time.sleep(0.05)
    for c in children:
        if c.code is None:
            code = c.proc.poll()
            if code is not None:
                c.code, c.exited_at = code, time.monotonic()
    failed = [c for c in children if c.code not in (None, 0)]
    reports = []
    for c in failed:
        kind, message = _read_error(rundir, c.rank)
        reports.append((c, kind, message))
    # The cause: a rank whose own error is not "lost another rank", the
    # earliest to exit first.
    reports.sort(key=lambda r: (r[1] == 'secondary', r[0].exited_at, r[0].rank))
    c, kind, message = reports[0]
    if c.rank == 0 and c.code == 130 and kind in ('interrupted', ''):
        _stop_all(children, rundir)
        return 130
    what = _describe(c.rank, c.device)
    if message:
        text = '%s failed: %s' % (what, message)
    elif c.code < 0:
        text = '%s was killed by %s' % (what, _signal_name(-c.code))
    else:
        text = '%s exited with status %d' % (what, c.code)
    stopped = [x for x in children if x is not c and x.code is None]
    _stop_all(children, rundir)
    if stopped:
        text += '; stopped %s' % ', '.join(_describe(x.rank, x.device) for x in stopped)
    raise CaffeplusError(text)


def _touch(path):
    try:
        with open(path, 'w'):
            pass
    except OSError:
        pass


def _stop_all(children, rundir):
    running = [c for c in children if c.proc.poll() is None]
    if not running:
        return
    _touch(os.path.join(rundir, 'abort'))
    for c in running:
        try:
            c.proc.terminate()
        except OSError:
            pass
    deadline = time.monotonic() + TERMINATE_GRACE_S
    for c in running:
        try:
            c.proc.wait(max(deadline - time.monotonic(), 0.01))
        except subprocess.TimeoutExpired:
            try:
                c.proc.kill()
            except OSError:
                pass
            c.proc.wait()


# -- a spawned rank -------------------------------------------------------------------
def _watch_parent(parent):
    """Exit when the supervisor is gone (it was killed and could not stop us)."""
    def loop():
        while True:
            time.sleep(1.0)
            if os.getppid() != parent:
                os._exit(1)
    threading.Thread(target=loop, name='caffeplus-watch-parent', daemon=True).start()


def _write_error(rundir, rank, kind, message):
    try:
        from caffeplus.io.atomic import atomic_write
        with atomic_write(os.path.join(rundir, 'rank%d.error' % rank), 'w') as f:
            f.write('%s\n%s' % (kind, message))
    except OSError:
        pass


def _error_text(exc):
    if isinstance(exc, CaffeplusError):
        return str(exc)
    text = str(exc)
    return '%s: %s' % (type(exc).__name__, text) if text else type(exc).__name__


def configure_rank_logging(rank):
    """Rank 0 logs as a single-process run would; the others warnings only
    (_CAFFEPLUS_LOG_ALL_RANKS=1, a debugging aid, keeps their INFO lines)."""
    if rank != 0 and os.environ.get('_CAFFEPLUS_LOG_ALL_RANKS', '') in ('', '0'):
        log.set_level(1)


def child_main(rundir, rank):
    rank = int(rank)
    try:
        job, args, param_bytes = read_job(rundir)
    except CaffeplusError as exc:
        _write_error(rundir, rank, 'primary', str(exc))
        print('caffeplus train: error: rank %d: %s' % (rank, exc), file=sys.stderr)
        return 1
    _watch_parent(job['parent'])
    from caffeplus.parallel.trainer import (RankTrainer, Terminated, defer_sigterm,
                                            exit_on_sigterm, ignore_control_signals,
                                            unwind_if_aborting)
    from caffeplus.proto import caffe_pb2
    configure_rank_logging(rank)
    exit_on_sigterm()
    world = job['world']
    device = job['devices'][rank]
    debug = getattr(args, 'debug', False)
    comm = None
    try:
        if job.get('cwd'):
            os.chdir(job['cwd'])
        if device is not None:
            gpu_rank_settings()
        param = caffe_pb2.SolverParameter()
        param.ParseFromString(param_bytes)
        comm = comm_mod.TCPComm(rank, world, rundir)
        if device is not None:
            comm = comm_mod.NCCLComm(comm, device)
        # The supervisor makes this file before it stops the ranks itself.
        abort_file = os.path.join(rundir, 'abort')
        if rank == 0:
            from caffeplus.signal_handler import SignalHandler
            with SignalHandler(args.sigint_effect, args.sighup_effect,
                               on_sigterm=unwind_if_aborting(abort_file)) as handler, \
                    config.cli_scope(args):
                code = RankTrainer(args, param, comm, device, handler).run()
        else:
            ignore_control_signals()
            defer_sigterm(abort_file)
            with config.cli_scope(args):
                code = RankTrainer(args, param, comm, device).run()
        comm.close()
        return code
    except KeyboardInterrupt:
        _write_error(rundir, rank, 'interrupted', 'interrupted')
        return 130
    except Terminated:
        _write_error(rundir, rank, 'secondary', 'stopped by SIGTERM')
        return 143
    except BaseException as exc:  # noqa: B902 - reported to the supervisor, then exit 1
        secondary = isinstance(exc, comm_mod.RankFailure)
        _write_error(rundir, rank, 'secondary' if secondary else 'primary', _error_text(exc))
        if debug or not isinstance(exc, CaffeplusError):
            traceback.print_exc()       # the supervisor prints the one-line error
        sys.stderr.flush()
        if comm is not None:
            comm.abort()
        return 1


# -- under an MPI launcher -----------------------------------------------------------
def mpi_devices(gpus, spec, local_rank, local_size, count):
    """The GPU of this MPI rank: its local rank's entry of the -gpu list
    (spec is the -gpu flag as given; '' when the solver's device_id chose)."""
    if not gpus:
        return None
    spec = (spec or '').strip()
    if spec == 'all':
        gpus = list(range(count))
    what = '-gpu %s' % spec if spec else "the solver's device_id %d" % gpus[0]
    validate_gpus(gpus, count, spec or str(gpus[0]))
    if spec == 'all':
        if local_size > len(gpus):
            raise CaffeplusError('-gpu all: this host runs %d ranks but has %d GPU%s; start at '
                                 'most one rank per GPU' % (local_size, len(gpus),
                                                           '' if len(gpus) == 1 else 's'))
    elif local_size != len(gpus):
        raise CaffeplusError('under MPI every rank drives one GPU: this host runs %d rank%s '
                             'but %s names %d device%s; start one rank per listed GPU on '
                             'each host, or give -gpu all'
                             % (local_size, '' if local_size == 1 else 's', what, len(gpus),
                                '' if len(gpus) == 1 else 's'))
    return gpus[local_rank]


def run_mpi(args, param, gpus):
    host = comm_mod.MPIComm()
    rank, world = host.rank, host.world
    configure_rank_logging(rank)
    os.environ.update(_CAFFEPLUS_RANK=str(rank), _CAFFEPLUS_WORLD=str(world),
                      _CAFFEPLUS_LOCAL_RANK=str(host.local_rank))
    from caffeplus.parallel.trainer import (RankTrainer, Terminated, defer_sigterm,
                                            exit_on_sigterm, ignore_control_signals,
                                            unwind_if_aborting)
    exit_on_sigterm()
    device = None
    comm = host
    try:
        if gpus:
            device = mpi_devices(gpus, getattr(args, 'gpu', ''), host.local_rank,
                                 host.local_size, device_count())
            gpu_rank_defaults(os.environ)   # before NCCL starts
            gpu_rank_settings()             # (train.run restores the command's defaults)
            comm_mod.import_nccl()
        where = host.gather_obj((socket.gethostname(), device))
        if rank == 0:
            hosts = sorted({h for h, _ in where})
            log.info('MPI: %d ranks on %d host%s', world, len(hosts),
                     '' if len(hosts) == 1 else 's')
            for r, (h, d) in enumerate(where):
                log.info('Rank %d: %s, %s', r, h,
                         'CPU' if d is None else 'GPU %d (%s)' % (d, gpu_name(d)))
        if device is not None:
            comm = comm_mod.NCCLComm(host, device)
        # mpirun stops a failed job with SIGKILL; a SIGTERM is a stop request.
        if rank == 0:
            from caffeplus.signal_handler import SignalHandler
            with SignalHandler(args.sigint_effect, args.sighup_effect,
                               on_sigterm=unwind_if_aborting(None)) as handler:
                return RankTrainer(args, param, comm, device, handler).run()
        ignore_control_signals()
        defer_sigterm(None)
        return RankTrainer(args, param, comm, device).run()
    except KeyboardInterrupt:
        sys.stderr.flush()
        host.abort(130)
        raise
    except Terminated:       # mpirun is stopping the job (another rank failed)
        sys.stderr.flush()
        os._exit(143)
    except BaseException as exc:  # noqa: B902 - one rank's failure must stop the job
        if getattr(args, 'debug', False) or not isinstance(exc, CaffeplusError):
            traceback.print_exc()
        print('caffeplus train: error: rank %d of %d (%s, %s) failed: %s'
              % (rank, world, socket.gethostname(),
                 'CPU' if device is None else 'GPU %d' % device, _error_text(exc)),
              file=sys.stderr)
        sys.stderr.flush()
        if world > 1:
            host.abort(1)
        raise


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 2:
        print('usage: python -m caffeplus.parallel RUNDIR RANK (started by '
              '`caffeplus train -gpu 0,1`)', file=sys.stderr)
        return 2
    return child_main(argv[0], argv[1])


if __name__ == '__main__':
    sys.exit(main())
