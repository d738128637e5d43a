"""The solver loop, as Caffe's Solver: nets, step, test, snapshot, restore.

The update rules live in caffeplus.solver.sgd (SGDSolver and its family);
this module holds what every solver shares:

  * building the train net and the test nets from net / net_param /
    train_net / train_net_param / test_net / test_net_param with Caffe's
    NetState rules (train_state, test_state);
  * Step: clear diffs, test when due, iter_size forward/backward passes,
    Caffe's smoothed loss, display, callbacks, ApplyUpdate, snapshots and
    requested actions (SIGINT/SIGHUP through an action function);
  * Solve: the tail forward and test after the last update;
  * Snapshot / Restore in Caffe's file formats, with a caffeplus sidecar that
    makes a resumed CPU run bit-identical to an uninterrupted one.

Log lines are Caffe's, message for message (see the reference train.log).
"""
import os
import time

import numpy

from caffeplus import backend, log, precision, rng
from caffeplus.errors import CaffeplusError, FormatError
from caffeplus.proto import caffe_pb2
from caffeplus.solver import state as state_io

F32 = numpy.float32
TRAIN, TEST = caffe_pb2.TRAIN, caffe_pb2.TEST

# Actions an action function may request (Caffe's SolverAction).
NONE, STOP, SNAPSHOT = 'none', 'stop', 'snapshot'
ACTIONS = (NONE, STOP, SNAPSHOT)


def _text(message):
    """Text format as Caffe's DebugString prints it: whole floats without a
    trailing '.0', no final newline (glog adds none after one)."""
    import re
    from google.protobuf import text_format
    text = text_format.MessageToString(message)
    return re.sub(r'(?m)^(\s*\w+: -?\d+)\.0$', r'\1', text).rstrip('\n')


def read_solver_file(path):
    """A SolverParameter from a prototxt, with Caffe's snapshot_prefix
    default (the solver file name without extension, or <dir>/<stem> when the
    prefix names a directory)."""
    from caffeplus.io.prototxt import read_solver_param
    param = read_solver_param(os.fspath(path))
    upgrade_snapshot_prefix(param, os.fspath(path))
    return param


def upgrade_snapshot_prefix(param, path):
    if not param.HasField('snapshot_prefix'):
        param.snapshot_prefix = os.path.splitext(path)[0]
        log.info('snapshot_prefix was not specified and is set to %s', param.snapshot_prefix)
    elif os.path.isdir(param.snapshot_prefix):
        stem = os.path.splitext(os.path.basename(path))[0]
        param.snapshot_prefix = os.path.join(param.snapshot_prefix, stem)
        log.info('snapshot_prefix was a directory and is replaced to %s', param.snapshot_prefix)


class _Callback:
    def __init__(self, on_start=None, on_gradients_ready=None):
        self._start, self._ready = on_start, on_gradients_ready

    def on_start(self):
        if self._start is not None:
            self._start()

    def on_gradients_ready(self):
        if self._ready is not None:
            self._ready()


class Solver:
    """Base of all solvers. Construct with a SolverParameter or a path to a
    solver prototxt (pycaffe's caffe.SGDSolver('solver.prototxt'))."""

    type = None
    # The memory plan when caffeplus_param.memory_plan is not given: 'shared'
    # reuses dead activation buffers (blobs other than the net's outputs,
    # data-layer tops and caffeplus_param.keep are released after their last
    # use in an iteration). pycaffe's solver classes (caffeplus.SGDSolver,
    # caffeplus.get_solver, ...) use 'stock', so that scripts can read any
    # solver.net.blobs[...] after solver.step(), as with Caffe.
    default_memory_plan = 'shared'

    def __init__(self, param, rank=0, solver_count=1, solver_path=None, memory_plans=True):
        self.solver_path = solver_path
        # False: the nets keep no plan (caffeplus.memory.measure applies the
        # one it measures; a shared arena built first would sit beside it).
        self._memory_plans = memory_plans
        if not isinstance(param, caffe_pb2.SolverParameter):
            self.solver_path = os.fspath(param)
            param = read_solver_file(self.solver_path)
        else:
            p = caffe_pb2.SolverParameter()
            p.CopyFrom(param)
            param = p
        self.rank, self.solver_count = rank, solver_count
        self.callbacks = []
        self.update_guard = None        # a check's device guard the update skips on (step)
        self.guarded_update = False
        self._action_function = None
        self.requested_early_exit = False
        self.iter = 0
        self.current_step = 0
        self.losses = []
        self.smoothed_loss = F32(0)
        self.iterations_last = 0
        self._timer_start = time.perf_counter()
        self.net = None
        self.test_nets = []
        self._init(param)

    # -- construction --------------------------------------------------------
    def check_param(self, param):
        """Solver-specific checks (Caffe's constructor sanity checks)."""

    def _init(self, param):
        log.info('Initializing solver from parameters: \n%s', _text(param))
        self.param = param
        if param.average_loss < 1:
            raise CaffeplusError('average_loss should be non-negative (got %d)'
                                 % param.average_loss)
        if param.iter_size < 1:
            raise CaffeplusError('iter_size must be at least 1 (got %d)' % param.iter_size)
        self.check_param(param)
        precision.prepare_solver_param(param)
        self._apply_math_mode(param)
        self._check_snapshot_write_permissions()
        self._remove_stale_snapshot_temps()
        if param.random_seed >= 0:
            rng.set_random_seed(param.random_seed + self.rank)
        from caffeplus import config
        from caffeplus.io import workers
        # The solver's caffeplus_param settings hold while its nets are
        # built and planned (caffeplus.config).
        with config.scope(param, 'solver'):
            with workers.setting(workers.proto_value(param), 'caffeplus_param.data_workers'), \
                    precision.setting(param.caffeplus_param.precision):
                self._init_train_net()
                if self.rank == 0:      # as Caffe: only the root solver tests
                    self._init_test_nets()
            log.info('Solver scaffolding done.')
            self.iter = 0
            self.current_step = 0
            self.pre_solve()
            from caffeplus.solver.update_in_backward import UpdateInBackward
            self.in_backward = UpdateInBackward(self) if hasattr(self, 'update_params') else None
            # (Before the plans: a loss scaler reads every gradient before the update.)
            self.loss_scaler = precision.install_loss_scaling(self)
            self._apply_memory_plans()
            self._install_nan_check()

    def _apply_memory_plans(self):
        """caffeplus_param's memory plan for the train and test nets
        (caffeplus.solver.memory_plans.apply_solver_plans): memory_plan, keep,
        offload, memory_budget, workspace_limit. Without memory_plan the
        class's default_memory_plan applies: 'shared' (what `caffeplus train`
        and caffeplus.solver.get_solver build), 'stock' for the solvers
        pycaffe scripts create (caffeplus.SGDSolver, caffeplus.get_solver)."""
        if not getattr(self, '_memory_plans', True):
            return
        from caffeplus.solver.memory_plans import apply_solver_plans
        apply_solver_plans(self, default=self.default_memory_plan)

    def _install_nan_check(self):
        """Stop on a NaN/Inf loss or gradient (caffeplus.solver.nan_check;
        the nan_check setting, warn or off, changes it: caffeplus.config)."""
        from caffeplus.solver import nan_check
        nan_check.install(self)

    def pre_solve(self):
        """Allocate history (subclasses)."""

    @staticmethod
    def _apply_math_mode(param):
        """caffeplus_param.math (strict, tf32, deterministic) before the nets
        are built, in GPU mode (the CPU has one math; the name is still
        checked). Without the field the current mode stays as it is."""
        if not param.caffeplus_param.HasField('math'):
            return
        try:
            from caffeplus.backend import mathmode
        except ImportError:
            return
        mathmode.parse(param.caffeplus_param.math)     # a bad name is an error on the CPU too
        if backend.mode() == backend.GPU:
            mathmode.set_math_mode(param.caffeplus_param.math)

    def _check_snapshot_write_permissions(self):
        if self.rank != 0 or not self.param.snapshot:
            return
        if not self.param.HasField('snapshot_prefix'):
            raise CaffeplusError('In solver params, snapshot is specified but snapshot_prefix '
                                 'is not')
        probe = self.snapshot_filename('.tempfile')
        try:
            with open(probe, 'w'):
                pass
            os.remove(probe)
        except OSError as exc:
            raise CaffeplusError("Cannot write to snapshot prefix '%s'.  Make sure that the "
                                 "directory exists and is writable (%s)."
                                 % (self.param.snapshot_prefix, exc.strerror or exc))

    def _remove_stale_snapshot_temps(self):
        """Temporary files of snapshots a killed run left in the snapshot
        folder ('.<prefix>_iter_<N>.<kind>.XXXXXXXX.tmp', caffeplus.io.atomic's
        names for this prefix; nothing else is touched)."""
        if self.rank != 0 or not self.param.snapshot_prefix:
            return
        for path in state_io.stale_temp_files(self.param.snapshot_prefix):
            try:
                os.remove(path)
                log.info('Removed %s, left by an interrupted snapshot', path)
            except OSError as exc:
                log.warning('Cannot remove %s, left by an interrupted snapshot: %s', path,
                            exc.strerror or exc)

    def _read_net_file(self, path, what):
        from caffeplus.io.prototxt import read_net_param
        try:
            return read_net_param(path)
        except FormatError as exc:
            where = ' given in solver %s' % self.solver_path if self.solver_path else ''
            hint = ''
            if not os.path.exists(path) and not os.path.isabs(path):
                hint = ' (paths in a solver are relative to the working directory, %s)' \
                    % os.getcwd()
            raise CaffeplusError('cannot read the %s%s: %s%s' % (what, where, exc, hint))

    def _init_train_net(self):
        from caffeplus.net import Net
        p = self.param
        given = [f for f in ('net', 'net_param', 'train_net', 'train_net_param') if p.HasField(f)]
        fields = 'net, net_param, train_net, train_net_param'
        if not given:
            raise CaffeplusError('SolverParameter must specify a train net using one of these '
                                 'fields: %s' % fields)
        if len(given) > 1:
            raise CaffeplusError('SolverParameter must not contain more than one of these '
                                 'fields specifying a train_net: %s (it has %s)'
                                 % (fields, ', '.join(given)))
        net_param = caffe_pb2.NetParameter()
        if p.HasField('train_net_param'):
            log.info('Creating training net specified in train_net_param.')
            net_param.CopyFrom(p.train_net_param)
        elif p.HasField('train_net'):
            log.info('Creating training net from train_net file: %s', p.train_net)
            net_param = self._read_net_file(p.train_net, 'train_net file')
        if p.HasField('net_param'):
            log.info('Creating training net specified in net_param.')
            net_param.CopyFrom(p.net_param)
        if p.HasField('net'):
            log.info('Creating training net from net file: %s', p.net)
            net_param = self._read_net_file(p.net, 'net file')
        state = caffe_pb2.NetState()
        state.phase = TRAIN
        state.MergeFrom(net_param.state)
        state.MergeFrom(p.train_state)
        net_param.state.CopyFrom(state)
        self.net = Net(net_param)
        for weights in p.weights:
            self._load_net_weights(self.net, weights)

    def _init_test_nets(self):
        from caffeplus.net import Net
        p = self.param
        has_generic = int(p.HasField('net')) + int(p.HasField('net_param'))
        if has_generic > 1:
            raise CaffeplusError('Both net_param and net_file may not be specified.')
        num_test_nets = len(p.test_net_param) + len(p.test_net)
        if has_generic:
            if len(p.test_iter) < num_test_nets:
                raise CaffeplusError('test_iter must be specified for each test network.')
        elif len(p.test_iter) != num_test_nets:
            raise CaffeplusError('test_iter must be specified for each test network (%d '
                                 'test_iter for %d test nets).' % (len(p.test_iter), num_test_nets))
        num_generic_instances = len(p.test_iter) - num_test_nets
        num_instances = num_test_nets + num_generic_instances
        if len(p.test_state) and len(p.test_state) != num_instances:
            raise CaffeplusError('test_state must be unspecified or specified once per test '
                                 'net (%d test_state for %d test nets).'
                                 % (len(p.test_state), num_instances))
        if num_instances and p.test_interval <= 0:
            raise CaffeplusError('test_interval must be positive when the solver has test '
                                 'nets (got %d)' % p.test_interval)
        sources, params = [], []
        for tp in p.test_net_param:
            sources.append('test_net_param')
            q = caffe_pb2.NetParameter()
            q.CopyFrom(tp)
            params.append(q)
        for path in p.test_net:
            sources.append('test_net file: ' + path)
            params.append(path)
        remaining = len(p.test_iter) - len(sources)
        if p.HasField('net_param'):
            for _ in range(remaining):
                sources.append('net_param')
                q = caffe_pb2.NetParameter()
                q.CopyFrom(p.net_param)
                params.append(q)
        if p.HasField('net'):
            for _ in range(remaining):
                sources.append('net file: ' + p.net)
                params.append(p.net)
        self.test_nets = []
        for i in range(num_instances):
            q = params[i]
            if isinstance(q, str):
                q = self._read_net_file(q, 'test net file')
            state = caffe_pb2.NetState()
            state.phase = TEST
            state.MergeFrom(q.state)
            if len(p.test_state):
                state.MergeFrom(p.test_state[i])
            q.state.CopyFrom(state)
            log.info('Creating test net (#%d) specified by %s', i, sources[i])
            net = Net(q)
            net.debug_info = p.debug_info
            for weights in p.weights:
                self._load_net_weights(net, weights)
            self.test_nets.append(net)

    @staticmethod
    def _load_net_weights(net, model_list):
        for name in model_list.split(','):
            name = name.strip()
            log.info('Finetuning from %s', name)
            if not os.path.exists(name):
                raise CaffeplusError('weights file not found: %s' % name)
            net.copy_from([name])

    # -- callbacks and actions -----------------------------------------------
    def add_callback(self, callback, on_gradients_ready=None):
        """Add an object with on_start() and on_gradients_ready() methods, or
        two callables (pycaffe's add_callback(on_start, on_gradient))."""
        has_methods = hasattr(callback, 'on_start') or hasattr(callback, 'on_gradients_ready')
        if not has_methods or on_gradients_ready is not None:
            callback = _Callback(callback, on_gradients_ready)
        self.callbacks.append(callback)
        # What judges the final gradients stays after the callbacks that change
        # them (a data-parallel sync averages them across ranks, so every rank
        # judges the same ones): the loss scaler (caffeplus.precision), then
        # the NaN check (caffeplus.solver.nan_check), both installed with the
        # solver.
        self.callbacks.sort(key=lambda cb: (bool(getattr(cb, 'runs_last', False)),
                                            bool(getattr(cb, 'runs_after_sync', False))))

    def set_action_function(self, func):
        """func() -> 'none' | 'stop' | 'snapshot', polled once per iteration."""
        self._action_function = func

    def get_requested_action(self):
        if self._action_function is None:
            return NONE
        action = self._action_function()
        return action if action in ACTIONS else NONE

    # -- the loop ------------------------------------------------------------
    def step(self, iters):
        p = self.param
        start_iter = self.iter
        stop_iter = self.iter + iters
        average_loss = p.average_loss
        self.losses = []
        self.smoothed_loss = F32(0)
        self._timer_start = time.perf_counter()
        net = self.net
        display_every = p.display
        while self.iter < stop_iter:
            graph = self.start_gradients(graphs=True)
            if p.test_interval and self.iter % p.test_interval == 0 and \
                    (self.iter > 0 or p.test_initialization):
                if self.rank == 0:
                    self.test_all()
                if self.requested_early_exit:
                    break
            for cb in self.callbacks:
                cb.on_start()
            display = bool(display_every) and self.iter % display_every == 0
            net.debug_info = display and p.debug_info
            # On the GPU reading a loss waits for the work queued before it,
            # and the GPU then idles while the host queues more: the losses
            # stay on the device until the iteration's work is all queued
            # where a check guards the update (below), else they are read
            # before the update, as Caffe logs them.
            losses = []
            for _ in range(p.iter_size):
                if graph is not None:       # the gradients' zeroing too
                    clear, extra = self.graph_key()
                    losses.append(graph.run(clear=clear, extra=extra))
                else:
                    losses.append(net.forward_prefilled(defer_loss=True))
                    net.backward_all()
            self.end_backward()
            iteration = self.iter
            self.update_guard = None
            self.guarded_update = not display and self.can_guard_update() and \
                any(getattr(cb, 'guards_update', False) for cb in self.callbacks)
            if not self.guarded_update:
                loss = self._mean_loss(losses)      # a loss layer's error (a bad label) first
            if display:
                self.update_smoothed_loss(loss, start_iter, average_loss)
                self._display()
            # A check queues its verdict on the device: the update skips on
            # its guard, and the verdict is read once the update is queued
            # (caffeplus.solver.nan_check).
            for cb in self.callbacks:
                cb.on_gradients_ready()
            scaler = getattr(self, 'loss_scaler', None)     # caffeplus.precision
            if scaler is not None and scaler.skips_update():
                self.iter += 1      # its 16-bit gradients overflowed: the weights stay
            else:
                self.apply_update()
            if scaler is not None:
                scaler.settle()
            self.update_guard = None
            if self.guarded_update:
                loss = self._read_guarded_iteration(losses, iteration)
            if not display:
                self.update_smoothed_loss(loss, start_iter, average_loss, iteration)
            request = self.get_requested_action()
            if (p.snapshot and self.iter % p.snapshot == 0 and self.rank == 0) or \
                    request == SNAPSHOT:
                self.snapshot()
            if request == STOP:
                self.requested_early_exit = True
                break

    def start_gradients(self, graphs=False):
        """Before an iteration's forward: Caffe's ClearParamDiffs, or, where
        each update runs in backward, its preparation
        (caffeplus.solver.update_in_backward). With `graphs`, where the
        iteration's passes can run as a CUDA graph: the
        caffeplus.pass_graph.PassGraph that will zero the gradients and run
        them (returned; else None)."""
        ub = getattr(self, 'in_backward', None)
        in_backward = ub is not None and ub.ready()
        graph = self._pass_graph() if graphs else None
        if in_backward:
            ub.begin()
        elif graph is None:
            self.net.clear_param_diffs()
        return graph

    def graph_key(self):
        """(clear, extra) for PassGraph.run: whether the graph zeroes the
        gradients, and what an update in backward reads from the host this
        iteration (the rate, the rule's constants)."""
        ub = getattr(self, 'in_backward', None)
        if ub is None or not ub.pending:
            return True, None
        scalars = getattr(self, 'fused_scalars', None)
        return False, (float(ub.rate), tuple(float(v) for v in scalars()) if scalars else ())

    _graph = None

    def _pass_graph(self):
        """The train net's PassGraph when this iteration can use it (the
        cuda_graphs setting, caffeplus.config; caffeplus.pass_graph)."""
        if backend.mode() != backend.GPU:
            return None
        from caffeplus import pass_graph
        if not pass_graph.enabled(self.param):
            return None
        if self._graph is None or self._graph.net is not self.net:
            self._graph = pass_graph.PassGraph(self.net)
        return self._graph if self._graph.usable(self) else None

    def end_backward(self):
        """After the iteration's backward passes (before the callbacks)."""
        ub = getattr(self, 'in_backward', None)
        if ub is not None:
            ub.backward_done()

    def _display(self):
        # Caffe's CPU timer counts whole milliseconds.
        lapse = F32(int((time.perf_counter() - self._timer_start) * 1000) / 1000.0)
        per_s = F32(self.iter - self.iterations_last) / (lapse if lapse else F32(1))
        self._timer_start = time.perf_counter()
        self.iterations_last = self.iter
        if self.rank != 0:      # as Caffe, only the root solver logs them
            return
        log.info('Iteration %d (%g iter/s, %gs/%d iters), loss = %g', self.iter, per_s, lapse,
                 self.param.display, self.smoothed_loss)
        self._log_outputs(self.net, '    Train net output #%d: %s = %g%s')

    @staticmethod
    def _log_outputs(net, fmt):
        score_index = 0
        for blob_id in net.output_blob_indices:
            values = backend.to_numpy(net._blobs[blob_id].data).ravel()
            name = net._blob_names[blob_id]
            weight = F32(net._blob_loss_weights[blob_id])
            for v in values:
                extra = ' (* %g = %g loss)' % (weight, weight * v) if weight else ''
                log.info(fmt, score_index, name, v, extra)
                score_index += 1

    def _read_guarded_iteration(self, losses, iteration):
        """After a guarded update is queued, the iteration's loss: read with
        the loss layers' own errors (a label check), then the checks'
        verdicts (after_update). A loss layer that finds an error also makes
        the loss and its gradient NaN, so the guard skipped the update: the
        checks put the iteration back before the error is raised."""
        try:
            loss = self._mean_loss(losses)
        except Exception:
            for cb in self.callbacks:
                discard = getattr(cb, 'discard_update', None)
                if discard is not None:
                    discard(iteration)
            raise
        for cb in self.callbacks:
            after = getattr(cb, 'after_update', None)
            if after is not None:
                after(iteration)
        return loss

    @staticmethod
    def _mean_loss(losses):
        """The iteration's loss: the mean over iter_size passes, in float32 as
        Caffe sums it (float() reads a deferred loss)."""
        loss = F32(0)
        for one in losses:
            loss += F32(float(one))
        return loss / F32(len(losses))

    def can_guard_update(self):
        """Whether apply_update skips on a device guard (update_guard) that a
        check sets, so the check can be read after the update is queued."""
        return False

    def update_smoothed_loss(self, loss, start_iter, average_loss, iteration=None):
        loss = F32(loss)
        if len(self.losses) < average_loss:
            self.losses.append(loss)
            size = len(self.losses)
            self.smoothed_loss = F32((self.smoothed_loss * F32(size - 1) + loss) / F32(size))
        else:
            idx = ((self.iter if iteration is None else iteration) - start_iter) % average_loss
            self.smoothed_loss = F32(self.smoothed_loss +
                                     (loss - self.losses[idx]) / F32(average_loss))
            self.losses[idx] = loss

    def solve(self, resume_file=None):
        p = self.param
        log.info('Solving %s', self.net.name)
        log.info('Learning Rate Policy: %s', p.lr_policy)
        self.requested_early_exit = False
        if resume_file:
            log.info('Restoring previous solver status from %s', resume_file)
            self.restore(resume_file)
        start_iter = self.iter
        self.step(p.max_iter - self.iter)
        if p.snapshot_after_train and (not p.snapshot or self.iter % p.snapshot != 0):
            self.snapshot()
        if self.requested_early_exit:
            log.info('Optimization stopped early.')
            return
        if p.display and self.iter % p.display == 0:
            loss = F32(self.net.forward_prefilled())
            self.update_smoothed_loss(loss, start_iter, p.average_loss)
            log.info('Iteration %d, loss = %g', self.iter, self.smoothed_loss)
        if p.test_interval and self.iter % p.test_interval == 0:
            self.test_all()
        log.info('Optimization Done.')

    # -- testing -------------------------------------------------------------
    def test_all(self):
        for test_net_id in range(len(self.test_nets)):
            if self.requested_early_exit:
                break
            self.test(test_net_id)

    def _share_trained_layers(self, test_net):
        """Caffe's ShareTrainedLayersWith: the test net's parameters are the
        train net's, layer by layer name."""
        train_layers = self.net.layer_dict
        for name, layer in test_net.layer_dict.items():
            src = train_layers.get(name)
            if src is None or src is layer:
                continue
            if len(src.blobs) != len(layer.blobs):
                raise CaffeplusError('Incompatible number of blobs for layer %s' % name)
            for j, (dst, s) in enumerate(zip(layer.blobs, src.blobs)):
                if dst.data_storage is s.data_storage:
                    continue
                if dst.shape != s.shape:
                    raise CaffeplusError(
                        "Cannot share param %d weights from layer '%s'; shape mismatch.  "
                        "Source param shape is %s; target param shape is %s"
                        % (j, name, s.shape_string(), dst.shape_string()))
                dst.share_data(s)

    def test(self, test_net_id=0):
        p = self.param
        log.info('Iteration %d, Testing net (#%d)', self.iter, test_net_id)
        test_net = self.test_nets[test_net_id]
        self._share_trained_layers(test_net)
        test_score, test_score_output_id = [], []
        loss = F32(0)
        n_iter = p.test_iter[test_net_id]
        for i in range(n_iter):
            request = self.get_requested_action()
            while request != NONE:
                if request == SNAPSHOT:
                    self.snapshot()
                elif request == STOP:
                    self.requested_early_exit = True
                request = self.get_requested_action()
            if self.requested_early_exit:
                break
            iter_loss = F32(test_net.forward_prefilled())
            if p.test_compute_loss:
                loss += iter_loss
            idx = 0
            for j, blob_id in enumerate(test_net.output_blob_indices):
                values = backend.to_numpy(test_net._blobs[blob_id].data).ravel()
                for v in values:
                    if i == 0:
                        test_score.append(F32(v))
                        test_score_output_id.append(j)
                    else:
                        test_score[idx] = F32(test_score[idx] + v)
                    idx += 1
        if self.requested_early_exit:
            log.info('Test interrupted.')
            return
        if p.test_compute_loss:
            loss /= F32(n_iter)
            log.info('Test loss: %g', loss)
        for i, score in enumerate(test_score):
            blob_id = test_net.output_blob_indices[test_score_output_id[i]]
            name = test_net._blob_names[blob_id]
            weight = F32(test_net._blob_loss_weights[blob_id])
            mean_score = F32(score / F32(n_iter))
            extra = ' (* %g = %g loss)' % (weight, weight * mean_score) if weight else ''
            log.info('    Test net output #%d: %s = %g%s', i, name, mean_score, extra)

    # -- update (subclasses) -------------------------------------------------
    def apply_update(self):
        raise NotImplementedError

    def applies_own_update(self):
        """Whether the update is the solver's own rather than SGDSolver.apply_update
        (caffeplus.solver.update_in_backward: then it cannot update in backward)."""
        return True

    # -- snapshots -----------------------------------------------------------
    def snapshot_filename(self, extension):
        return '%s_iter_%d%s' % (self.param.snapshot_prefix, self.iter, extension)

    def snapshot(self):
        """Write <prefix>_iter_<N>.caffemodel[.h5] and .solverstate[.h5]
        (plus caffeplus's sidecar); return the two paths."""
        fmt = self.param.snapshot_format
        if fmt not in (caffe_pb2.SolverParameter.BINARYPROTO, caffe_pb2.SolverParameter.HDF5):
            raise CaffeplusError('Unsupported snapshot format %d.' % fmt)
        hdf5 = fmt == caffe_pb2.SolverParameter.HDF5
        model_filename = self.snapshot_filename('.caffemodel.h5' if hdf5 else '.caffemodel')
        try:
            if hdf5:
                log.info('Snapshotting to HDF5 file %s', model_filename)
                self.net.save_hdf5(model_filename, self.param.snapshot_diff)
            else:
                log.info('Snapshotting to binary proto file %s', model_filename)
                self.net.save(model_filename, self.param.snapshot_diff)
            state_filename = self.snapshot_solver_state(model_filename)
        except OSError as exc:
            raise CaffeplusError('cannot write the snapshot %s: %s'
                                 % (model_filename, exc.strerror or exc))
        return model_filename, state_filename

    def history_arrays(self):
        return []

    def snapshot_solver_state(self, model_filename):
        """Write the solver state after the weights file, and its caffeplus
        sidecar before it: the state file is the last write of a snapshot, so
        a state on disk always has its weights and its sidecar."""
        history = [backend.to_numpy(a) for a in self.history_arrays()]
        sidecar = self._sidecar_payload(model_filename)
        if self.param.snapshot_format == caffe_pb2.SolverParameter.HDF5:
            filename = self.snapshot_filename('.solverstate.h5')
            log.info('Snapshotting solver state to HDF5 file %s', filename)
            state_io.write_hdf5(filename, self.iter, model_filename, self.current_step, history,
                                sidecar=sidecar)
        else:
            filename = self.snapshot_filename('.solverstate')
            log.info('Snapshotting solver state to binary proto file %s', filename)
            state_io.write_binaryproto(filename, self.iter, model_filename, self.current_step,
                                       history, sidecar=sidecar)
        return filename

    def _all_nets(self):
        return [('train', self.net)] + [('test%d' % i, n) for i, n in enumerate(self.test_nets)]

    def _sidecar_payload(self, model_filename):
        layers = {}
        for key, net in self._all_nets():
            states = {}
            for name, layer in net.layer_dict.items():
                getter = getattr(layer, 'snapshot_state', None)
                if getter is not None:
                    value = getter()
                    if value is not None:
                        states[name] = value
            if states:
                layers[key] = states
        payload = {
            'iter': self.iter,
            'solver_type': self.type,
            'learned_net': model_filename,
            'learned_net_sha256': state_io.file_sha256(model_filename),
            'rng': rng.get_state(),
            'layers': layers,
        }
        scaler = getattr(self, 'loss_scaler', None)
        if scaler is not None:
            # An adaptive scale took the run's overflows to find: a resumed
            # run goes on from it instead of starting again at 2^16.
            payload['loss_scale'] = scaler.state()
        return payload

    def restore(self, state_file):
        """Resume from a .solverstate or .solverstate.h5 file."""
        state_file = os.fspath(state_file)
        loaded = state_io.read_state(state_file)
        self.iter = loaded.iter
        learned = ''
        if loaded.learned_net:
            learned = state_io.resolve_learned_net(state_file, loaded.learned_net)
            if learned != loaded.learned_net:
                log.info('Weights file %s not found relative to the working directory; '
                         'using %s beside the solver state', loaded.learned_net, learned)
            try:
                self.net.copy_from([learned])
            except CaffeplusError as exc:
                raise CaffeplusError('solver state %s: its weights file %s does not fit the '
                                     'net: %s' % (state_file, learned, exc))
        self.current_step = loaded.current_step
        self.restore_history(state_file, loaded)
        self._restore_sidecar(state_file, learned)

    def restore_history(self, state_file, loaded):
        arrays = self.history_arrays()
        if len(loaded.history) != len(arrays):
            raise CaffeplusError('solver state %s: Incorrect length of history blobs: the file '
                                 'has %d, a %s solver for this net needs %d'
                                 % (state_file, len(loaded.history), self.type, len(arrays)))
        if loaded.format == 'BINARYPROTO':
            log.info('%sSolver: restoring history', 'SGD')
        for i, (dst, src) in enumerate(zip(arrays, loaded.history)):
            if tuple(dst.shape) != tuple(src.shape):
                raise CaffeplusError('solver state %s: history blob %d has shape %s, the net '
                                     'needs %s' % (state_file, i, tuple(src.shape),
                                                   tuple(dst.shape)))
            xp = backend.get_array_module(dst)
            dst[...] = xp.asarray(src, dtype=numpy.float32)

    def _restore_sidecar(self, state_file, learned):
        payload, reason = state_io.read_sidecar(state_file)
        if payload is None:
            if os.path.exists(state_file + state_io.SIDECAR_SUFFIX):
                log.warning('Not restoring caffeplus RNG/data state: %s', reason)
                return
            others = state_io.caffeplus_sidecars_beside(state_file)
            if others:
                # caffeplus wrote this folder's snapshots, but not this one's
                # sidecar (deleted, or an older caffeplus killed between the
                # state and its sidecar).
                log.warning('Solver state %s has no caffeplus sidecar (%s), although '
                            'caffeplus wrote the snapshots beside it (%s): resuming as stock '
                            'Caffe would, with a fresh random stream and the data read from '
                            'the start of its source, so the run will not continue exactly '
                            'as the interrupted one would have.', state_file,
                            os.path.basename(state_file) + state_io.SIDECAR_SUFFIX,
                            ', '.join(others[-3:]))
            else:
                log.info('No caffeplus sidecar for %s (a state stock Caffe wrote?): the '
                         'random stream and data position start afresh, as in Caffe.',
                         state_file)
            return
        if learned and payload.get('learned_net_sha256') and \
                payload['learned_net_sha256'] != state_io.file_sha256(learned):
            raise CaffeplusError(
                'solver state %s: its weights file %s is not the one written with it (its '
                'SHA-256 differs from the one recorded in %s). Restore the matching weights '
                'file, or delete the sidecar to resume as stock Caffe would.'
                % (state_file, learned, state_file + state_io.SIDECAR_SUFFIX))
        if payload.get('iter') != self.iter:
            log.warning('Not restoring caffeplus RNG/data state: the sidecar is for iteration '
                        '%s, the state for %d', payload.get('iter'), self.iter)
            return
        rng.set_state(payload['rng'])
        scaler = getattr(self, 'loss_scaler', None)
        if scaler is not None and payload.get('loss_scale'):
            scaler.set_state(payload['loss_scale'])
            log.info('Restored global_grad_scale %g', scaler.scale)
        for key, net in self._all_nets():
            states = payload.get('layers', {}).get(key, {})
            layer_dict = net.layer_dict
            for name, value in states.items():
                layer = layer_dict.get(name)
                setter = getattr(layer, 'restore_state', None)
                if setter is not None:
                    setter(value)
        log.info('Restored caffeplus RNG and layer state from %s',
                 state_file + state_io.SIDECAR_SUFFIX)
