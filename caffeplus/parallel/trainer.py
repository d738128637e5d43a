"""One rank of data-parallel training: a Solver plus the collective glue.

Every rank builds the same solver (rank 0 with the test nets, the others
without: only rank 0 tests, as in Caffe), shards the train net's data layers
(rank r reads the records r, r+world, ... of each stretch of
batch_size x world; see layers/data.py set_shard), takes rank 0's weights,
and trains with a GradientSync. Per iteration, after the update, the ranks
agree on what to do next over the communicator: rank 0 turns its pending
SIGINT/SIGHUP/SIGTERM into an action ('stop', 'snapshot' or 'none'; SIGTERM
always 'stop') and sends it to every rank, so all of them stop or go on at
the same iteration. A signal that arrives while rank 0 tests is acted on at
the end of that iteration (a second SIGINT still interrupts at once). The
other ranks train on after a SIGTERM until rank 0's stop reaches them.

Snapshots: rank 0 writes them (Caffe's files and sidecar, atomically). At
an iteration that ends in a snapshot the ranks first gather their random
states and data-layer positions to rank 0, which writes them beside the
solver state as <state>.ranks.json; `-snapshot` with the same number of
ranks gives every rank its own state back, so a resumed run continues as
the uninterrupted one would have.

_CAFFEPLUS_PARALLEL_CHECK=1 (or a folder; a check of the launcher's own, not a
user setting) makes the ranks compare SHA-256
checksums of their weights after every update (rank 0 raises if they differ;
with a folder each rank also appends "iter checksum" lines to
rank<r>.checksums there).
"""
import json
import os
import signal

from caffeplus import backend, log, rng
from caffeplus.errors import CaffeplusError
from caffeplus.parallel import sync as sync_mod
from caffeplus.solver.solver import NONE, SNAPSHOT, STOP

RANKS_SUFFIX = '.ranks.json'
RANKS_FORMAT = 'caffeplus-parallel-ranks'


def strip_test_nets(param):
    """A copy of the solver parameter without test nets (non-root ranks)."""
    from caffeplus.proto import caffe_pb2
    q = caffe_pb2.SolverParameter()
    q.CopyFrom(param)
    for field in ('test_net', 'test_net_param', 'test_iter', 'test_state'):
        q.ClearField(field)
    return q


def shardable_layers(net):
    """(name, layer) of the net's data layers that can read a rank's share."""
    return [(name, layer) for name, layer in net.layer_dict.items()
            if callable(getattr(layer, 'set_shard', None))]


def shard_data_layers(net, comm):
    """Give every rank the same starting position (rank 0's: a rand_skip or a
    shuffle drawn from rank 0's seed), keep each rank's own transformer
    stream (crops and mirrors differ per rank, as in Caffe), then shard."""
    layers = shardable_layers(net)
    for name, layer in layers:
        if comm.world > 1:
            state0 = comm.bcast_obj(layer.get_state() if comm.rank == 0 else None)
            if comm.rank != 0 and state0 is not None:
                own = layer.get_state()
                state = dict(state0)
                if 'transformer' in own:
                    state['transformer'] = own['transformer']
                layer.set_state(state)
        layer.set_shard(comm.rank, comm.world)
    return layers


def _json_default(obj):
    """The solver sidecar's conversions (NumPy scalars and arrays), and bytes
    as hex: data readers' states carry raw keys."""
    from caffeplus.solver.state import _json_default as sidecar_default
    if isinstance(obj, bytes):
        return obj.hex()
    try:
        return sidecar_default(obj)
    except TypeError:
        raise TypeError('cannot store %r in a rank state' % type(obj)) from None


class RankTrainer:
    """Drives one rank's solver; call run()."""

    def __init__(self, args, param, comm, gpu=None, handler=None):
        self.args = args
        self.comm = comm
        self.rank, self.world = comm.rank, comm.world
        self.gpu = gpu
        self.handler = handler
        self.param = param if self.rank == 0 else strip_test_nets(param)
        self.solver = None
        self.sync = None
        self._armed = False
        self._stash = None
        check = os.environ.get('_CAFFEPLUS_PARALLEL_CHECK', '')
        self.check = check not in ('', '0')
        self.check_dir = check if self.check and os.path.isdir(check) else None

    # -- set-up ------------------------------------------------------------------
    def build(self):
        from caffeplus.solver import get_solver
        if self.gpu is not None:
            backend.set_mode_gpu(self.gpu)
            self.param.device_id = self.gpu
        else:
            backend.set_mode_cpu()
        self.solver = solver = get_solver(self.param, solver_path=self.args.solver or None,
                                          rank=self.rank, solver_count=self.world)
        layers = shard_data_layers(solver.net, self.comm)
        if self.args.snapshot:
            self._restore(self.args.snapshot, layers)
        sync_mod.broadcast_params(solver.net, self.comm)
        if self.args.snapshot:
            sync_mod.broadcast_history(solver, self.comm)
        self.sync = sync_mod.GradientSync(solver, self.comm)
        solver.add_callback(self)
        solver.set_action_function(self.action)
        if self.rank == 0:
            self._log_setup(layers)
            original = solver.snapshot

            def snapshot():
                # Every rank's state first: the .solverstate stays the last
                # write of a snapshot, so a newest state always has its ranks.
                from caffeplus.proto import caffe_pb2
                hdf5 = solver.param.snapshot_format == caffe_pb2.SolverParameter.HDF5
                self._write_rank_states(solver.snapshot_filename(
                    '.solverstate.h5' if hdf5 else '.solverstate'))
                return original()
            solver.snapshot = snapshot
        else:
            solver.snapshot = lambda: None   # only rank 0 writes snapshots
        return solver

    def _log_setup(self, layers):
        net = self.solver.net
        ids = [net.layers.index(layer) for _, layer in layers] or [0]
        batch = 0
        for i in ids:
            tops = net.top_vecs[i] if i < len(net.top_vecs) else []
            if tops and tops[0].shape:
                batch = max(batch, tops[0].shape[0])
        if batch:
            log.info('Data-parallel training on %d ranks (%s): batch %d per rank, %d in all '
                     '(x iter_size %d)', self.world, self.comm.kind, batch,
                     batch * self.world, max(self.solver.param.iter_size, 1))
        else:
            log.info('Data-parallel training on %d ranks (%s)', self.world, self.comm.kind)
        sync_mod.describe_buckets(self.sync)

    # -- resume ----------------------------------------------------------------------
    def _layer_dict(self):
        return self.solver.net.layer_dict

    def _restore(self, state_file, layers):
        own_rng = rng.get_state()
        own_layers = {name: layer.get_state() for name, layer in layers}
        if self.rank == 0:
            log.info('Resuming from %s', state_file)
        self.solver.restore(state_file)
        payload, reason = self._read_rank_states(state_file)
        if payload is not None:
            mine = payload['ranks'][self.rank]
            rng.set_state(mine['rng'])
            layer_dict = self._layer_dict()
            for name, value in mine.get('layers', {}).items():
                layer = layer_dict.get(name)
                setter = getattr(layer, 'restore_state', None)
                if setter is not None:
                    setter(value)
            if self.rank == 0:
                log.info('Restored the random and data states of %d ranks from %s',
                         self.world, state_file + RANKS_SUFFIX)
            return
        if self.rank == 0:
            log.warning('Not restoring per-rank states: %s; every rank continues from rank '
                        "0's data position with its own random stream", reason)
        else:
            # Rank 0's sidecar gave this rank rank 0's generators: take back
            # this rank's own (fresh) ones, keep the data position.
            rng.set_state(own_rng)
            for name, layer in layers:
                own = own_layers.get(name) or {}
                if 'transformer' in own:
                    state = layer.get_state()
                    state['transformer'] = own['transformer']
                    layer.set_state(state)

    def _read_rank_states(self, state_file):
        path = state_file + RANKS_SUFFIX
        if not os.path.exists(path):
            return None, 'no %s' % os.path.basename(path)
        try:
            with open(path) as f:
                payload = json.load(f)
        except (OSError, ValueError) as exc:
            return None, 'cannot read %s (%s)' % (path, exc)
        if payload.get('format') != RANKS_FORMAT:
            return None, '%s is not a caffeplus rank-state file' % path
        if payload.get('world') != self.world or len(payload.get('ranks', [])) != self.world:
            return None, ('%s was written by %s ranks, this run has %d'
                          % (path, payload.get('world'), self.world))
        if payload.get('iter') != self.solver.iter:
            return None, ('%s is for iteration %s, the solver state for %d'
                          % (path, payload.get('iter'), self.solver.iter))
        return payload, ''

    def _rank_state(self):
        layers = {}
        for name, layer in shardable_layers(self.solver.net):
            getter = getattr(layer, 'snapshot_state', None)
            if getter is not None:
                layers[name] = getter()
        return {'rank': self.rank, 'rng': rng.get_state(), 'layers': layers}

    def _write_rank_states(self, state_file):
        stash = self._stash
        if stash is None or stash['iter'] != self.solver.iter or not state_file:
            return
        from caffeplus.io.atomic import atomic_write
        payload = {'format': RANKS_FORMAT, 'version': 1, 'world': self.world,
                   'iter': stash['iter'], 'state_file': os.path.basename(state_file),
                   'ranks': stash['states']}
        text = json.dumps(payload, sort_keys=True, default=_json_default)
        try:
            with atomic_write(state_file + RANKS_SUFFIX, 'w') as f:
                f.write(text)
        except OSError as exc:
            raise CaffeplusError('cannot write %s: %s' % (state_file + RANKS_SUFFIX,
                                                          exc.strerror or exc))

    # -- solver callbacks ----------------------------------------------------------
    def on_start(self):
        self.sync.on_start()

    def on_gradients_ready(self):
        self.sync.on_gradients_ready()
        self._armed = True   # the next action poll is the one after the update

    def action(self):
        """The solver's action function: collective after each update, NONE
        while rank 0 tests (the signal waits for the iteration's end)."""
        if not self._armed:
            return NONE
        self._armed = False
        local = NONE
        if self.handler is not None:
            local = self.handler.action()
        request = self.comm.bcast_obj(local if self.rank == 0 else None)
        if request not in (NONE, STOP, SNAPSHOT):
            request = NONE
        self.comm.check()
        solver = self.solver
        p = solver.param
        it = solver.iter
        if self.check:
            self._compare_checksums(it)
        due = (p.snapshot and it % p.snapshot == 0) or request == SNAPSHOT or \
            (p.snapshot_after_train and (request == STOP or it >= p.max_iter))
        if due:
            states = self.comm.gather_obj(self._rank_state())
            if self.rank == 0:
                self._stash = {'iter': it, 'states': states}
        return request

    def _compare_checksums(self, it):
        mine = sync_mod.params_checksum(self.solver.net)
        if self.check_dir:
            with open(os.path.join(self.check_dir, 'rank%d.checksums' % self.rank), 'a') as f:
                f.write('%d %s\n' % (it, mine))
        sums = self.comm.gather_obj(mine)
        bad = []
        if self.rank == 0:
            bad = [r for r, s in enumerate(sums) if s != sums[0]]
        bad = self.comm.bcast_obj(bad)
        if bad:
            raise CaffeplusError('the ranks hold different weights after iteration %d (ranks '
                                 '%s differ from rank 0)' % (it, ', '.join(map(str, bad))))

    # -- the run ---------------------------------------------------------------------
    def run(self):
        solver = self.build()
        if self.rank == 0:
            log.info('Starting Optimization')
        solver.solve()
        self.comm.barrier()
        if self.rank == 0:
            log.info('Optimization Done.')
        return 0


class Terminated(BaseException):
    """SIGTERM arrived (the supervisor or mpirun stops this rank): unwind so
    that a snapshot being written is abandoned cleanly (no temporary file
    left behind)."""


def exit_on_sigterm():
    """Until training starts, SIGTERM ends the rank at once (there is
    nothing to save yet)."""
    def handler(signum, frame):
        raise Terminated('stopped by SIGTERM')
    try:
        signal.signal(signal.SIGTERM, handler)
    except (ValueError, AttributeError):  # not the main thread / no SIGTERM
        pass


def unwind_if_aborting(abort_file):
    """on_sigterm for a training rank: the supervisor stopping its ranks
    (it makes `abort_file` first) unwinds at once; any other SIGTERM asks
    for a clean stop, which rank 0 decides for every rank. A rank never
    escalates on a second SIGTERM: a scheduler may signal every process
    while the supervisor forwards its own, so one stop can arrive twice.
    The supervisor (on its second SIGTERM) or mpirun (SIGKILL) escalates."""
    def on_sigterm(handler=None):
        if abort_file and os.path.exists(abort_file):
            raise Terminated('stopped by SIGTERM')
    return on_sigterm


def defer_sigterm(abort_file):
    """A non-root rank trains on after a SIGTERM until rank 0's stop ends
    every rank at the same iteration (rank 0 gets the SIGTERM too: from the
    supervisor, or from mpirun and schedulers, which signal every rank)."""
    on_sigterm = unwind_if_aborting(abort_file)

    def handler(signum, frame):
        on_sigterm()
    try:
        signal.signal(signal.SIGTERM, handler)
    except (ValueError, AttributeError):  # not the main thread / no SIGTERM
        pass


def ignore_control_signals():
    """Non-root ranks leave SIGINT/SIGHUP to rank 0 (which decides for all)."""
    for name in ('SIGINT', 'SIGHUP'):
        signum = getattr(signal, name, None)
        if signum is not None:
            try:
                signal.signal(signum, signal.SIG_IGN)
            except ValueError:  # not the main thread
                pass
