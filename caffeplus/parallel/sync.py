"""Gradient all-reduce for data-parallel training, overlapped with backward.

GradientSync(solver, comm) moves the diffs of the train net's learnable
parameters into one flat buffer (each parameter's diff storage becomes a
view of it, so layers write their gradients straight into it; Caffe's
GPUParams does the same), ordered by when backward finishes them: a
parameter is final once the lowest-numbered layer that uses it (shared
parameters have several) has run backward in the last of the solver's
iter_size passes. A hook per layer (Net.on_layer_backward_done) advances the
frontier of final gradients and starts an all-reduce on the next contiguous
bucket of at least `bucket_bytes` as soon as it is complete, on the
communicator's own stream on the GPU, so communication runs while backward
continues below. on_gradients_ready starts what is left, waits, and scales
by 1/world: Caffe sums the gradients over the solvers and multiplies by
1/solver_count (NCCL<Dtype>::run / on_gradients_ready), i.e. the gradient
of the mean loss over the effective batch (per-rank batch x world).

With layer_wise_reduce: false in the solver (Caffe's switch) the whole
buffer is reduced once, in on_gradients_ready.

Caffe reduces in each of the iter_size passes; reducing only in the last
gives the same sum (reduction is linear) with 1/iter_size of the traffic.
"""
import hashlib
import os

import numpy

from caffeplus import backend, log

F32 = numpy.float32
DEFAULT_BUCKET_MB = 25


def bucket_bytes_from_env(default_mb=DEFAULT_BUCKET_MB):
    try:
        return int(float(os.environ.get('CAFFEPLUS_BUCKET_MB', default_mb)) * 2 ** 20)
    except ValueError:
        return int(default_mb * 2 ** 20)


class GradientSync:
    """Solver callback (on_start / on_gradients_ready) plus the per-layer
    backward hook that reduces gradients across the ranks of `comm`."""

    def __init__(self, solver, comm, bucket_bytes=None, layer_wise=None):
        self.solver = solver
        self.net = net = solver.net
        self.comm = comm
        self.world = comm.world
        self.iter_size = max(int(solver.param.iter_size), 1)
        if layer_wise is None:
            layer_wise = solver.param.layer_wise_reduce
        self.layer_wise = bool(layer_wise) and self.world > 1
        self.bucket_elems = max(int(bucket_bytes if bucket_bytes is not None
                                    else bucket_bytes_from_env()) // 4, 1)
        self.scale = F32(1.0 / self.world)
        self._build()
        self._requests = []
        self._launched = 0
        self._pass = 0
        self.buckets_last_iter = 0
        if self.layer_wise:
            hooks = getattr(net, 'on_layer_backward_done', None)
            if hooks is None:   # a Net without the hook: reduce after backward
                self.layer_wise = False
            else:
                hooks.append(self.layer_done)

    # -- the flat buffer -------------------------------------------------------
    def _build(self):
        net = self.net
        params = list(net.learnable_params)
        n_layers = len(net.layers)
        ready = [-1] * len(params)
        for net_param_id, (layer_id, _) in enumerate(net.param_layer_indices):
            lid = net.learnable_param_ids[net_param_id]
            # Final once the lowest-numbered user has run backward.
            ready[lid] = layer_id if ready[lid] < 0 else min(ready[lid], layer_id)
        order = sorted(range(len(params)), key=lambda i: (-ready[i], i))
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
        self._adopt()
        self.params = params
        # frontier[layer] = end (in elements) of the gradients final once
        # `layer` has run backward; layers run from the top down.
        self.frontier = [0] * (n_layers + 1)
        end, k = 0, 0
        for layer_id in range(n_layers - 1, -1, -1):
            while k < len(order) and ready[order[k]] >= layer_id:
                end = offsets[order[k]] + params[order[k]].count
                k += 1
            self.frontier[layer_id] = end
        self.top_layer = n_layers - 1

    def _adopt(self):
        for p, view in zip(self.net.learnable_params, self.views):
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
        self._launched = 0
        self._pass = 0
        self.buckets_last_iter = 0

    def layer_done(self, layer_id):
        if layer_id == self.top_layer:
            self._pass += 1
        if self._pass != self.iter_size:
            return
        end = self.frontier[layer_id]
        if end - self._launched >= self.bucket_elems:
            self._launch(end)

    def _launch(self, end):
        start = self._launched
        if end <= start:
            return
        self._requests.append(self.comm.iallreduce_(self.flat[start:end]))
        self._launched = end
        self.buckets_last_iter += 1

    def on_gradients_ready(self):
        if self.world == 1 or not self.total:
            return
        self._launch(self.total)
        for req in self._requests:
            req.wait()
        self._requests = []
        self.flat[:self.total] *= self.scale

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
    own data, as in Caffe, and are left out."""
    h = hashlib.sha256()
    for p, lr in zip(net.learnable_params, net.params_lr):
        if not lr:
            continue
        h.update(numpy.ascontiguousarray(backend.to_numpy(p.data), dtype=numpy.float32)
                 .tobytes())
    return h.hexdigest()


def describe_buckets(sync):
    sizes = []
    prev = 0
    for layer_id in range(len(sync.frontier) - 2, -1, -1):
        end = sync.frontier[layer_id]
        if end - prev >= sync.bucket_elems:
            sizes.append(end - prev)
            prev = end
    if sync.total > prev:
        sizes.append(sync.total - prev)
    log.info('Gradient all-reduce: %d parameters (%.1f MB) in %d buckets%s',
             len(sync.params), sync.total * 4 / 2 ** 20, len(sizes),
             ' overlapped with backward' if sync.layer_wise else ' after backward')
    return sizes
