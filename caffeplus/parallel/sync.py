"""Gradient all-reduce for data-parallel training, overlapped with backward.

GradientSync(solver, comm) moves the diffs of the train net's learnable
parameters into one flat buffer (each parameter's diff storage becomes a
view of it, so layers write their gradients straight into it; Caffe's
GPUParams does the same), ordered by when backward finishes them: a
parameter is final once the lowest-numbered layer that uses it (shared
parameters have several) has run backward in the last of the solver's
iter_size passes.

The buffer is cut into buckets once, at start-up (plan_buckets): runs of
the parameters that become final at the same layer, closed at a layer as
soon as they hold `bucket_bytes`, and closed early when the next layer's
parameters are that large themselves, so a large gradient (VGG-16's fc6:
411 MB, final right after the first layers of backward) goes alone and at
once instead of waiting behind, or holding back, smaller ones. A hook per
layer (Net.on_layer_backward_done) starts every bucket whose last
parameter that layer finished: on the GPU the communicator's own stream
waits for an event on the compute stream, reduces, scales by 1/world and
records an event, so neither the compute stream nor the host waits while
backward goes on below. on_gradients_ready starts what is left and makes
the compute stream (not the host) wait for every bucket; the solver's
update, one kernel over all parameters, runs after that.

The scale is Caffe's: the gradients are summed over the solvers and
multiplied by 1/solver_count (NCCL<Dtype>::run / on_gradients_ready), i.e.
the gradient of the mean loss over the effective batch (per-rank batch x
world). Each bucket is summed and scaled by the same float32 operations on
every rank, so all ranks hold the same bits.

With layer_wise_reduce: false in the solver (Caffe's switch) the whole
buffer is one bucket, reduced in on_gradients_ready.

Caffe reduces in each of the iter_size passes; reducing only in the last
gives the same sum (reduction is linear) with 1/iter_size of the traffic.
"""
import hashlib
import os

import numpy

from caffeplus import backend, log

F32 = numpy.float32
DEFAULT_BUCKET_MB = 25
AFTER_BACKWARD = -1     # the launch layer of a bucket that on_gradients_ready starts


# The launcher's test hook (tests/test_parallel.py): another bucket size for
# every rank, in MiB, carried to ranks in other processes by the environment.
BUCKET_MB_ENV = '_CAFFEPLUS_BUCKET_MB'


def bucket_bytes_from_env(default_mb=DEFAULT_BUCKET_MB):
    try:
        return int(float(os.environ.get(BUCKET_MB_ENV, default_mb)) * 2 ** 20)
    except ValueError:
        return int(default_mb * 2 ** 20)


class Bucket:
    """A stretch [start, end) of the flat buffer (in floats), the learnable
    parameters it holds, and the layer whose backward makes it final
    (AFTER_BACKWARD: reduced in on_gradients_ready)."""
    __slots__ = ('index', 'layer', 'start', 'end', 'params')

    def __init__(self, index, layer, start, end, params):
        self.index, self.layer, self.start, self.end = index, layer, start, end
        self.params = params

    @property
    def size(self):
        return self.end - self.start

    def __repr__(self):
        return 'Bucket(%d, layer %d, [%d, %d), params %s)' % (
            self.index, self.layer, self.start, self.end, self.params)


def final_layers(net):
    """For each learnable parameter, the layer after whose backward its
    gradient is final: the lowest-numbered layer that uses it."""
    ready = [-1] * len(net.learnable_params)
    for net_param_id, (layer_id, _) in enumerate(net.param_layer_indices):
        lid = net.learnable_param_ids[net_param_id]
        ready[lid] = layer_id if ready[lid] < 0 else min(ready[lid], layer_id)
    return ready


def backward_order(ready):
    """Learnable ids in the order backward finishes them (highest layer
    first; a layer's own parameters in their order)."""
    return sorted(range(len(ready)), key=lambda i: (-ready[i], i))


def plan_buckets(order, sizes, ready, cap, layer_wise=True):
    """Cut `order` (learnable ids in backward order) into buckets.

    sizes[i]: floats of parameter i; ready[i]: its final layer; cap: the
    bucket size in floats. The parameters a layer finishes stay together;
    a bucket closes at a layer once it holds `cap` floats, or when the
    next layer's parameters hold `cap` floats themselves (those then go
    alone), or at the last parameters. Returns [Bucket], in launch order,
    covering the buffer [0, sum(sizes)) once, without gaps."""
    groups = []                         # [(layer, [ids])] in backward order
    for i in order:
        if groups and groups[-1][0] == ready[i]:
            groups[-1][1].append(i)
        else:
            groups.append((ready[i], [i]))
    if not layer_wise:
        ids = [i for _, g in groups for i in g]
        total = sum(sizes[i] for i in ids)
        return [Bucket(0, AFTER_BACKWARD, 0, total, ids)] if ids else []
    cap = max(int(cap), 1)
    buckets, ids, start, end = [], [], 0, 0
    for k, (layer, group) in enumerate(groups):
        ids.extend(group)
        end += sum(sizes[i] for i in group)
        nxt = sum(sizes[i] for i in groups[k + 1][1]) if k + 1 < len(groups) else None
        if end - start >= cap or nxt is None or nxt >= cap:
            buckets.append(Bucket(len(buckets), layer, start, end, ids))
            ids, start = [], end
    return buckets


class GradientSync:
    """Solver callback (on_start / on_gradients_ready) plus the per-layer
    backward hook that reduces gradients across the ranks of `comm`.

    Bookkeeping for tests and logs: `buckets` (the plan), and per
    iteration `launches` ([(bucket index, layer whose hook started it, or
    AFTER_BACKWARD)] in the order started)."""

    def __init__(self, solver, comm, bucket_bytes=None, layer_wise=None):
        self.solver = solver
        self.net = net = solver.net
        self.comm = comm
        self.world = comm.world
        self.iter_size = max(int(solver.param.iter_size), 1)
        if layer_wise is None:
            layer_wise = solver.param.layer_wise_reduce
        hooks = getattr(net, 'on_layer_backward_done', None)
        # A Net without the hook reduces after backward.
        self.layer_wise = bool(layer_wise) and self.world > 1 and hooks is not None
        self.bucket_elems = max(int(bucket_bytes if bucket_bytes is not None
                                    else bucket_bytes_from_env()) // 4, 1)
        self.scale = F32(1.0 / self.world)
        self._build()
        self._requests = []
        self._next = 0
        self._pass = 0
        self.launches = []
        if self.layer_wise:
            hooks.append(self.layer_done)

    # -- the flat buffer and its buckets -------------------------------------------
    def _build(self):
        net = self.net
        params = list(net.learnable_params)
        ready = final_layers(net)
        order = backward_order(ready)
        offsets, total = {}, 0
        for i in order:
            offsets[i] = total
            total += params[i].count
        xp = backend.xp()
        self.xp = xp
        self.total = total
        self.flat = xp.zeros(max(total, 1), dtype=numpy.float32)
        self.views = []
        for i, p in enumerate(params):
            view = self.flat[offsets[i]:offsets[i] + p.count]
            view[...] = p.diff.reshape(-1)
            self.views.append(view)
        self.params = params
        self.ready = ready
        self.offsets = [offsets[i] for i in range(len(params))]
        self._adopt()
        self.buckets = plan_buckets(order, [p.count for p in params], ready,
                                    self.bucket_elems, self.layer_wise)
        self.top_layer = len(net.layers) - 1

    def _adopt(self):
        for p, view in zip(self.params, self.views):
            p.diff_storage.array = view

    def _check_adopted(self):
        """A memory plan (or user code) may have given a diff new storage:
        take its values back into the buffer and point it at the view again."""
        for p, view in zip(self.params, self.views):
            arr = p.diff_storage.array
            if arr is not view:
                view[...] = p.diff.reshape(-1)
                p.diff_storage.array = view

    # -- solver callbacks ------------------------------------------------------------
    def on_start(self):
        self._check_adopted()
        self._requests = []
        self._next = 0
        self._pass = 0
        self.launches = []

    def layer_done(self, layer_id):
        if layer_id == self.top_layer:
            self._pass += 1
        if self._pass != self.iter_size:
            return
        buckets = self.buckets
        while self._next < len(buckets) and buckets[self._next].layer >= layer_id:
            self._launch(layer_id)

    def _launch(self, layer_id):
        bucket = self.buckets[self._next]
        self._next += 1
        self._requests.append(self.comm.iallreduce_(self.flat[bucket.start:bucket.end],
                                                    self.scale))
        self.launches.append((bucket.index, layer_id))

    def on_gradients_ready(self):
        if self.world == 1 or not self.total:
            return
        while self._next < len(self.buckets):
            self._launch(AFTER_BACKWARD)
        for req in self._requests:
            req.wait()          # on the GPU: the compute stream waits, not the host
        self._requests = []

    @property
    def buckets_last_iter(self):
        return len(self.launches)

    @property
    def overlapped_last_iter(self):
        """Buckets of the last iteration that started during backward."""
        return sum(1 for _, layer in self.launches if layer != AFTER_BACKWARD)

    # -- helpers -------------------------------------------------------------------
    def detach(self):
        hooks = getattr(self.net, 'on_layer_backward_done', None)
        if hooks and self.layer_done in hooks:
            hooks.remove(self.layer_done)


def broadcast_params(net, comm, root=0):
    """Make every rank's learnable parameters the root's (Caffe's NCCL
    broadcast of the root solver's weights at start-up)."""
    if comm.world == 1:
        return
    for p in net.learnable_params:
        data = p.data
        if data.flags.c_contiguous:
            comm.broadcast_(data, root)
        else:
            tmp = backend.get_array_module(data).ascontiguousarray(data)
            comm.broadcast_(tmp, root)
            data[...] = tmp


def broadcast_history(solver, comm, root=0):
    """The solver's history blobs too (all ranks restore the same state
    file; this guards against a rank that could not)."""
    if comm.world == 1:
        return
    for arr in solver.history_arrays():
        comm.broadcast_(arr, root)


def params_checksum(net):
    """SHA-256 of the trained parameters' bytes (lr_mult != 0), in order:
    equal on every rank when the ranks hold identical weights. Statistics
    that layers update in forward (BatchNorm's, lr_mult 0) follow each rank's
    own data, as in Caffe, and are left out. (A device-to-host copy of every
    parameter: only for _CAFFEPLUS_PARALLEL_CHECK and tests.)"""
    h = hashlib.sha256()
    for p, lr in zip(net.learnable_params, net.params_lr):
        if not lr:
            continue
        h.update(numpy.ascontiguousarray(backend.to_numpy(p.data), dtype=numpy.float32)
                 .tobytes())
    return h.hexdigest()


def describe_buckets(sync):
    """Log the plan; returns the bucket sizes in floats."""
    sizes = [b.size for b in sync.buckets]
    largest = max(sizes) * 4 / 2 ** 20 if sizes else 0.0
    log.info('Gradient all-reduce: %d parameters (%.1f MiB) in %d buckets (largest %.1f MiB)%s',
             len(sync.params), sync.total * 4 / 2 ** 20, len(sizes), largest,
             ' overlapped with backward' if sync.layer_wise else ' after backward')
    return sizes
