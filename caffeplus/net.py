"""Net: build a graph of layers from a NetParameter and run it, as Caffe does.

Construction follows Caffe's Net::Init step by step (state filtering, split
insertion, in-place tops, parameter sharing, loss weights, the backward
decision, outputs) and logs the same lines. Forward and backward run the
layers in order; memory placement belongs to caffeplus.memory, not here.
"""
import collections
import contextlib
import os

import numpy

from caffeplus import backend, kernels, layout, log, precision
from caffeplus.blob import Blob, HostBlob, virtual_allocation
from caffeplus.deferred_loss import DeferredLoss
from caffeplus.errors import CaffeplusError, NetError
from caffeplus.layer import create_layer
from caffeplus.netstate import filter_net
from caffeplus.proto import caffe_pb2
from caffeplus.splits import insert_splits

TRAIN, TEST = caffe_pb2.TRAIN, caffe_pb2.TEST


def _phase_value(phase):
    if isinstance(phase, str):
        try:
            return {'TRAIN': TRAIN, 'TEST': TEST}[phase.upper()]
        except KeyError:
            raise CaffeplusError("phase must be TRAIN or TEST, not '%s'" % phase)
    return int(phase)


def load_net_param(network):
    """A NetParameter from a path (text prototxt) or a NetParameter."""
    if isinstance(network, caffe_pb2.NetParameter):
        from caffeplus.io import upgrade
        param = caffe_pb2.NetParameter()
        param.CopyFrom(network)
        return upgrade.upgrade_net_as_needed(param)
    from caffeplus.io.prototxt import read_net_param
    return read_net_param(os.fspath(network))


def output_order(names):
    """The net's outputs in Caffe's order: byte-wise sorted names. Caffe
    keeps the blobs no layer consumed in a std::set<string> and takes the
    outputs from it, so the order is alphabetical, not the order the layers
    made them; net.outputs[0], the "This network produces output" lines and
    the numbering of "Test net output #k" (which log parsers key on) all
    follow it. UTF-8 byte order and code point order agree."""
    return sorted(names)


def unique_names(names):
    """`names` without repeats, in their first order: the keys of the dicts
    forward() and backward() return come in the net's output (or input)
    order, then the extra blobs asked for, not in a set's arbitrary order."""
    return list(dict.fromkeys(names))


def hook_table(hooks):
    """[(hook, layers)] of a list of per-layer hooks, taken as a pass starts
    (hooks added or removed during the pass count from the next one). A
    hook with an `at` attribute (a set of layer indices, or None) is called
    at those layers only: the memory plans' hooks have work at a few layers
    of ~170 (GoogLeNet), and each call they skip is host time on nets whose
    GPU waits for the host. Without one, at every layer."""
    return [(hook, getattr(hook, 'at', None)) for hook in hooks]


def call_hooks(table, i):
    """Call the hooks of a hook_table that run at layer `i` (the loops of
    Net's passes do this inline)."""
    for hook, at in table:
        if at is None or i in at:
            hook(i)


class Net:
    """A Caffe net. Accepts pycaffe's forms too:

        Net(prototxt, phase)             Net(prototxt, weights, phase)
        Net(prototxt, phase, weights=w, level=0, stages=[...])
        Net(prototxt, phase, memory='shared', keep=['conv1'])   # a memory plan
    """

    def __init__(self, network, *args, phase=None, level=None, stages=None, weights=None,
                 memory=None, keep=None):
        args = list(args)
        if args and isinstance(args[0], (str, os.PathLike)):
            weights = args.pop(0)
        if args:
            phase = args.pop(0)
        if args:
            raise CaffeplusError('Net(): unexpected arguments %r' % (args,))
        param = load_net_param(network)
        if phase is not None:
            param.state.phase = _phase_value(phase)
        if level is not None:
            param.state.level = int(level)
        if stages is not None:
            del param.state.stage[:]
            param.state.stage.extend(stages)
        # Its data layers take their worker count from the net's own
        # caffeplus_param, else from the solver or CLI building it.
        from caffeplus.io import workers
        with workers.setting(workers.proto_value(param), 'caffeplus_param.data_workers'):
            self._init(param)
        if weights is not None:
            self.copy_from(weights)
        if memory is not None or keep:
            # A memory plan (caffeplus.memory.apply): stock, arena, shared, offload, auto.
            from caffeplus.memory.apply import apply_named_plan
            apply_named_plan(self, memory or 'stock', keep=keep or ())

    # -- construction --------------------------------------------------------
    def _init(self, in_param):
        self.phase = in_param.state.phase
        # Callables hook(layer_id), run after each layer's backward (Caffe's
        # Net::after_backward): caffeplus.parallel starts gradient all-reduces
        # there, overlapped with the rest of backward.
        self.on_layer_backward_done = []
        # Callables hook(layer_id) before/after each layer's forward and before
        # each layer's backward (caffeplus.memory.offload_runtime's copies), and
        # the memory plan applied to the net (caffeplus.memory.apply), if any.
        # A hook with an `at` attribute runs at those layers only (hook_table).
        self.before_layer_forward, self.after_layer_forward = [], []
        self.before_layer_backward = []
        self.applied_plan = None
        filtered = filter_net(in_param)
        logging_info = log.logger.isEnabledFor(log.logging.INFO)
        if logging_info:                    # printing a big net costs ms
            log.info('Initializing net from parameters: \n%s', _text(filtered).rstrip('\n'))
        param = insert_splits(filtered)
        self.name = param.name
        self.net_param = param
        self.debug_info = param.debug_info
        # The storage types (NVCaffe's fields, or the precision switch), known
        # before any layer allocates: 16-bit tops are stored so from the start.
        self.layer_types = precision.resolve(param)
        top_dtypes = precision.top_storage_dtypes(param, self.layer_types,
                                                  sizes_only=virtual_allocation()) \
            if backend.mode() == backend.GPU or virtual_allocation() else {}

        self.layers, self._layer_names = [], []
        self._blobs, self._blob_names = [], []
        self.blob_need_backward = []
        self.bottom_vecs, self.bottom_id_vecs, self.bottom_need_backward = [], [], []
        self.top_vecs, self.top_id_vecs = [], []
        self.layer_need_backward = []
        self.param_blobs, self.param_id_vecs, self.param_layer_indices = [], [], []
        self.param_owners, self.param_display_names, self.param_names_index = [], [], {}
        self.learnable_params, self.learnable_param_ids = [], []
        self.params_lr, self.params_weight_decay = [], []
        self.has_params_lr, self.has_params_decay = [], []
        self.input_blob_indices, self.output_blob_indices = [], []
        self._blob_loss_weights = []
        blob_index = {}
        available = collections.OrderedDict()
        memory_used = 0

        for layer_id, lp in enumerate(param.layer):
            if not lp.HasField('phase'):
                param.layer[layer_id].phase = self.phase
                lp = param.layer[layer_id]
            if len(lp.propagate_down) and len(lp.propagate_down) != len(lp.bottom):
                raise NetError('layer %s: propagate_down must be given either 0 or bottom_size '
                               '(%d) times' % (lp.name, len(lp.bottom)))
            log.info('Creating layer %s', lp.name)
            with _out_of_memory_as_error(lp, 'create it'):
                layer = create_layer(lp)
            self.layers.append(layer)
            self._layer_names.append(lp.name)
            log.info('Creating Layer %s', lp.name)
            need_backward = False
            bottoms, bottom_ids, bottom_nb = [], [], []
            for bottom_id, name in enumerate(lp.bottom):
                if name not in available:
                    raise NetError("Unknown bottom blob '%s' (layer '%s', bottom index %d)"
                                   % (name, lp.name, bottom_id))
                blob_id = blob_index[name]
                log.info('%s <- %s', lp.name, name)
                bottoms.append(self._blobs[blob_id])
                bottom_ids.append(blob_id)
                nb = self.blob_need_backward[blob_id]
                if len(lp.propagate_down):
                    nb = lp.propagate_down[bottom_id]
                bottom_nb.append(nb)
                del available[name]
                need_backward |= self.blob_need_backward[blob_id]
            self.bottom_vecs.append(bottoms)
            self.bottom_id_vecs.append(bottom_ids)
            self.bottom_need_backward.append(bottom_nb)

            tops, top_ids = [], []
            num_top = len(lp.top)
            needed = num_top
            if layer.auto_top_blobs:
                needed = max(num_top, layer.min_num_top, layer.exact_num_top)
            for top_id in range(needed):
                name = lp.top[top_id] if top_id < num_top else '(automatic)'
                if top_id < num_top and top_id < len(lp.bottom) and name == lp.bottom[top_id]:
                    log.info('%s -> %s (in-place)', lp.name, name)
                    blob_id = blob_index[name]
                elif top_id < num_top and name in blob_index:
                    raise NetError("Top blob '%s' produced by multiple sources (layer '%s')"
                                   % (name, lp.name))
                else:
                    log.info('%s -> %s', lp.name, name)
                    blob_id = len(self._blobs)
                    self._blobs.append(Blob(name=name))
                    dtype = top_dtypes.get(layer_id, {}).get(top_id)
                    if dtype is not None:
                        self._blobs[-1].set_storage_dtype(dtype)
                    self._blob_names.append(name)
                    self.blob_need_backward.append(False)
                    if top_id < num_top:
                        blob_index[name] = blob_id
                if top_id < num_top:
                    available[name] = blob_id
                tops.append(self._blobs[blob_id])
                top_ids.append(blob_id)
                if lp.type == 'Input':
                    self.input_blob_indices.append(blob_id)
            self.top_vecs.append(tops)
            self.top_id_vecs.append(top_ids)

            with _out_of_memory_as_error(lp, 'set it up'):
                layer.setup(bottoms, tops)
            log.info('Setting up %s', lp.name)
            for top_id, top in enumerate(tops):
                while len(self._blob_loss_weights) <= top_ids[top_id]:
                    self._blob_loss_weights.append(0.0)
                self._blob_loss_weights[top_ids[top_id]] = layer.loss_weights[top_id] \
                    if top_id < len(layer.loss_weights) else 0.0
                if logging_info:           # (a big net's shape strings cost ms)
                    log.info('Top shape: %s', top.shape_string())
                if layer.loss(top_id):
                    log.info('    with loss weight %g', layer.loss_weights[top_id])
                memory_used += top.count * top.data_storage.dtype.itemsize    # bytes
            log.info('Memory required for data: %d', memory_used)

            num_param_blobs = len(layer.blobs)
            if len(lp.param) > num_param_blobs:
                raise NetError('layer %s: too many params specified (%d param entries for %d '
                               'parameter blobs)' % (lp.name, len(lp.param), num_param_blobs))
            for param_id in range(num_param_blobs):
                spec = lp.param[param_id] if param_id < len(lp.param) else caffe_pb2.ParamSpec()
                param_need_backward = spec.lr_mult != 0
                need_backward |= param_need_backward
                layer.set_param_propagate_down(param_id, param_need_backward)
            self.param_id_vecs.append([])
            for param_id in range(num_param_blobs):
                self._append_param(layer_id, param_id)
            self.layer_need_backward.append(need_backward)
            if need_backward:
                for blob_id in top_ids:
                    self.blob_need_backward[blob_id] = True
        self.memory_used_bytes = memory_used

        self._decide_backward(param.force_backward)
        for name in output_order(available):
            log.info('This network produces output %s', name)
            self.output_blob_indices.append(available[name])
        self._share_weights()
        self._blob_dict = collections.OrderedDict(zip(self._blob_names, self._blobs))
        # The layout setting: a 16-bit net's convolution maps channels-last
        # where every layer touching them can (caffeplus.layout).
        layout.apply(self)
        # GPU mode: the net's cuDNN layers share one workspace arena
        # (caffeplus.memory.workspace; apply_workspace_plan picks another plan).
        from caffeplus.memory import workspace
        workspace.attach_default(self)
        # 16-bit storage, where the types ask for it (caffeplus.precision).
        precision.attach(self)
        log.info('Network initialization done.')
        # Data layers start prefetching only now: in Python their threads
        # would hold the interpreter's lock while the net is still being
        # built, where Caffe's run on another core beside it.
        for layer in self.layers:
            layer.net_ready()

    @property
    def blobs(self):
        """pycaffe's net.blobs: name -> blob. In GPU mode each comes wrapped
        (caffeplus.blob.HostBlob) so that .data/.diff are host NumPy arrays
        kept in sync with the device, as Caffe's SyncedMemory does."""
        if backend.mode() == backend.GPU:
            if getattr(self, '_host_blob_dict', None) is None:    # wrappers hold no state
                self._host_blob_dict = collections.OrderedDict(
                    (k, HostBlob(b)) for k, b in self._blob_dict.items())
            return self._host_blob_dict
        return self._blob_dict

    def _append_param(self, layer_id, param_id):
        layer = self.layers[layer_id]
        lp = layer.layer_param
        spec = lp.param[param_id] if param_id < len(lp.param) else caffe_pb2.ParamSpec()
        param_name = spec.name if param_id < len(lp.param) else ''
        self.param_display_names.append(param_name or str(param_id))
        net_param_id = len(self.param_blobs)
        self.param_blobs.append(layer.blobs[param_id])
        self.param_id_vecs[layer_id].append(net_param_id)
        self.param_layer_indices.append((layer_id, param_id))
        if not param_name or param_name not in self.param_names_index:
            self.param_owners.append(-1)
            if param_name:
                self.param_names_index[param_name] = net_param_id
            self.learnable_param_ids.append(len(self.learnable_params))
            self.learnable_params.append(self.param_blobs[net_param_id])
            self.has_params_lr.append(spec.HasField('lr_mult'))
            self.has_params_decay.append(spec.HasField('decay_mult'))
            self.params_lr.append(spec.lr_mult)
            self.params_weight_decay.append(spec.decay_mult)
            return
        owner_id = self.param_names_index[param_name]
        self.param_owners.append(owner_id)
        owner_layer_id, owner_param_id = self.param_layer_indices[owner_id]
        log.info("Sharing parameters '%s' owned by layer '%s', param index %d",
                 param_name, self._layer_names[owner_layer_id], owner_param_id)
        this_blob = layer.blobs[param_id]
        owner_blob = self.layers[owner_layer_id].blobs[owner_param_id]
        owner_name = self._layer_names[owner_layer_id]
        if spec.share_mode == caffe_pb2.ParamSpec.PERMISSIVE:
            if this_blob.count != owner_blob.count:
                raise NetError("Cannot share param '%s' owned by layer '%s' with layer '%s'; "
                               "count mismatch.  Owner layer param shape is %s; sharing layer "
                               "shape is %s" % (param_name, owner_name, lp.name,
                                                owner_blob.shape_string(), this_blob.shape_string()))
        elif this_blob.shape != owner_blob.shape:
            raise NetError("Cannot share param '%s' owned by layer '%s' with layer '%s'; "
                           "shape mismatch.  Owner layer param shape is %s; sharing layer "
                           "expects shape %s" % (param_name, owner_name, lp.name,
                                                 owner_blob.shape_string(), this_blob.shape_string()))
        learnable_id = self.learnable_param_ids[owner_id]
        self.learnable_param_ids.append(learnable_id)
        if spec.HasField('lr_mult'):
            if self.has_params_lr[learnable_id]:
                if spec.lr_mult != self.params_lr[learnable_id]:
                    raise NetError("Shared param '%s' has mismatched lr_mult." % param_name)
            else:
                self.has_params_lr[learnable_id] = True
                self.params_lr[learnable_id] = spec.lr_mult
        if spec.HasField('decay_mult'):
            if self.has_params_decay[learnable_id]:
                if spec.decay_mult != self.params_weight_decay[learnable_id]:
                    raise NetError("Shared param '%s' has mismatched decay_mult." % param_name)
            else:
                self.has_params_decay[learnable_id] = True
                self.params_weight_decay[learnable_id] = spec.decay_mult

    def _decide_backward(self, force_backward):
        """Caffe's walk from the last layer back: who contributes to a loss,
        who can skip backward; then force_backward."""
        under_loss, skip_backprop = set(), set()
        for layer_id in range(len(self.layers) - 1, -1, -1):
            layer = self.layers[layer_id]
            contributes, skip = False, True
            for top_id, blob_id in enumerate(self.top_id_vecs[layer_id]):
                name = self._blob_names[blob_id]
                if layer.loss(top_id) or name in under_loss:
                    contributes = True
                if name not in skip_backprop:
                    skip = False
                if contributes and not skip:
                    break
            if self.layer_need_backward[layer_id] and skip:
                self.layer_need_backward[layer_id] = False
                self.bottom_need_backward[layer_id] = [False] * len(self.bottom_vecs[layer_id])
            if not contributes:
                self.layer_need_backward[layer_id] = False
            if self.layer_need_backward[layer_id]:
                log.info('%s needs backward computation.', self._layer_names[layer_id])
            else:
                log.info('%s does not need backward computation.', self._layer_names[layer_id])
            for bottom_id, blob_id in enumerate(self.bottom_id_vecs[layer_id]):
                name = self._blob_names[blob_id]
                if contributes:
                    under_loss.add(name)
                else:
                    self.bottom_need_backward[layer_id][bottom_id] = False
                if not self.bottom_need_backward[layer_id][bottom_id]:
                    skip_backprop.add(name)
        if force_backward:
            for layer_id, layer in enumerate(self.layers):
                self.layer_need_backward[layer_id] = True
                for bottom_id, blob_id in enumerate(self.bottom_id_vecs[layer_id]):
                    nb = self.bottom_need_backward[layer_id][bottom_id] or \
                        layer.allow_force_backward(bottom_id)
                    self.bottom_need_backward[layer_id][bottom_id] = nb
                    self.blob_need_backward[blob_id] = self.blob_need_backward[blob_id] or nb
                for param_id in range(len(layer.blobs)):
                    layer.set_param_propagate_down(param_id, True)

    def _share_weights(self):
        for i, owner in enumerate(self.param_owners):
            if owner >= 0:
                self.param_blobs[i].share_data(self.param_blobs[owner])
                self.param_blobs[i].share_diff(self.param_blobs[owner])

    # -- running -------------------------------------------------------------
    def layer_index(self, name):
        try:
            return self._layer_names.index(name)
        except ValueError:
            raise CaffeplusError("net %s has no layer named '%s'" % (self.name, name))

    def forward_from_to(self, start, end, defer_loss=False):
        """Run layers start..end; return their total weighted loss, a float,
        or with `defer_loss` a caffeplus.deferred_loss.DeferredLoss (on the
        GPU, reading the loss now would wait for the pass to finish)."""
        plan = self.applied_plan    # memory plan: clears release marks, re-places on growth
        if plan is not None:
            plan.before_forward(start, end)
        kernels.begin_pass(self, start, end)    # fused chains of layers (GPU)
        before, after = hook_table(self.before_layer_forward), hook_table(self.after_layer_forward)
        loss = DeferredLoss() if defer_loss else 0.0
        for i in range(start, end + 1):
            for hook, at in before:
                if at is None or i in at:
                    hook(i)
            # Caffe's Layer::Forward reshapes first, so an input reshaped from
            # Python (pycaffe's blob.reshape, then forward) flows through, and
            # Python layers that load data in reshape() get called each pass.
            layer = self.layers[i]
            layer.reshape(self.bottom_vecs[i], self.top_vecs[i])
            if defer_loss:
                # (A forward set on the instance, a wrapper, is called as it is.)
                run = layer.forward if 'forward' in vars(layer) else layer.forward_deferred
                loss.add(run(self.bottom_vecs[i], self.top_vecs[i]))
            else:
                loss += layer.forward(self.bottom_vecs[i], self.top_vecs[i])
            if self.debug_info:
                self._forward_debug_info(i)
            for hook, at in after:
                if at is None or i in at:
                    hook(i)
        if plan is not None:        # marks blobs whose memory the plan reuses
            plan.after_forward(start, end)
        return loss

    def forward_prefilled(self, defer_loss=False):
        """Run every layer; return the total weighted loss (Caffe's Forward;
        `defer_loss`: see forward_from_to)."""
        return self.forward_from_to(0, len(self.layers) - 1, defer_loss)

    def backward_from_to(self, start, end):
        plan = self.applied_plan    # memory plan: clears release marks
        if plan is not None:
            plan.before_backward(start, end)
        kernels.begin_pass(self, start, end, backward=True)
        before, done = hook_table(self.before_layer_backward), \
            hook_table(self.on_layer_backward_done)
        for i in range(start, end - 1, -1):
            for hook, at in before:
                if at is None or i in at:
                    hook(i)
            if self.layer_need_backward[i]:
                self.layers[i].backward(self.top_vecs[i], self.bottom_need_backward[i],
                                        self.bottom_vecs[i])
                if self.debug_info:
                    self._backward_debug_info(i)
            for hook, at in done:       # every layer, as Caffe's (unless it says `at`)
                if at is None or i in at:
                    hook(i)
        if plan is not None:        # marks blobs whose memory the plan reuses
            plan.after_backward(start, end)

    def backward_all(self):
        self.backward_from_to(len(self.layers) - 1, 0)
        if self.debug_info:
            asum_data = asum_diff = sumsq_data = sumsq_diff = 0.0
            for p in self.learnable_params:
                d, g = backend.to_numpy(p.data).astype(numpy.float64), \
                    backend.to_numpy(p.diff).astype(numpy.float64)
                asum_data += numpy.abs(d).sum()
                asum_diff += numpy.abs(g).sum()
                sumsq_data += (d * d).sum()
                sumsq_diff += (g * g).sum()
            log.info('    [Backward] All net params (data, diff): L1 norm = (%g, %g); '
                     'L2 norm = (%g, %g)', asum_data, asum_diff,
                     numpy.sqrt(sumsq_data), numpy.sqrt(sumsq_diff))

    def reshape(self):
        for i, layer in enumerate(self.layers):
            layer.reshape(self.bottom_vecs[i], self.top_vecs[i])
        if self.applied_plan is not None:   # the memory plan follows the new sizes
            self.applied_plan.reshaped()

    def clear_param_diffs(self):
        if kernels.active() and kernels.zero_diffs(self.learnable_params):
            return                  # GPU: one memset per diff
        for p in self.learnable_params:
            p.diff[...] = 0

    def update(self, indices=None):
        """data -= diff for every learnable parameter (Caffe's Net::Update),
        or for the learnable params `indices` (an update in backward)."""
        params = self.learnable_params
        for p in params if indices is None else (params[i] for i in indices):
            p.data[...] -= p.diff

    # -- pycaffe-style API ---------------------------------------------------
    @property
    def params(self):
        """pycaffe's net.params: layer name -> its parameter blobs."""
        if backend.mode() == backend.GPU:     # host views, as net.blobs
            return collections.OrderedDict(
                (name, [HostBlob(b) for b in layer.blobs])
                for name, layer in zip(self._layer_names, self.layers) if layer.blobs)
        return collections.OrderedDict(
            (name, layer.blobs) for name, layer in zip(self._layer_names, self.layers)
            if layer.blobs)

    @property
    def blob_loss_weights(self):
        return collections.OrderedDict(zip(self._blob_names, self._blob_loss_weights))

    @property
    def top_names(self):
        return collections.OrderedDict(
            (name, [self._blob_names[i] for i in ids])
            for name, ids in zip(self._layer_names, self.top_id_vecs))

    @property
    def bottom_names(self):
        return collections.OrderedDict(
            (name, [self._blob_names[i] for i in ids])
            for name, ids in zip(self._layer_names, self.bottom_id_vecs))

    @property
    def layer_dict(self):
        return collections.OrderedDict(zip(self._layer_names, self.layers))

    @property
    def inputs(self):
        return [self._blob_names[i] for i in self.input_blob_indices]

    @property
    def outputs(self):
        return [self._blob_names[i] for i in self.output_blob_indices]

    def forward(self, blobs=None, start=None, end=None, **kwargs):
        """pycaffe's Net.forward: set inputs from kwargs, run, return outputs."""
        blobs = list(blobs or [])
        start_ind = self.layer_index(start) if start is not None else 0
        if end is not None:
            # pycaffe's: the end layer's tops (whatever the layer is named)
            end_ind = self.layer_index(end)
            outputs = unique_names(self.top_names[end] + blobs)
        else:
            end_ind = len(self.layers) - 1
            outputs = unique_names(self.outputs + blobs)
        if kwargs:
            if set(kwargs) != set(self.inputs):
                raise CaffeplusError('Input blob arguments do not match net inputs.')
            for name, value in kwargs.items():
                if numpy.shape(value)[0] != self.blobs[name].shape[0]:
                    raise CaffeplusError('Input is not batch sized')
                self.blobs[name].data = value
        self.forward_from_to(start_ind, end_ind)
        return {name: self.blobs[name].data for name in outputs}

    def backward(self, diffs=None, start=None, end=None, **kwargs):
        """pycaffe's Net.backward: set top diffs from kwargs, run, return diffs."""
        diffs = list(diffs or [])
        start_ind = self.layer_index(start) if start is not None else len(self.layers) - 1
        if end is not None:
            # pycaffe's: the diffs of the end layer's bottoms, where backward ends
            end_ind = self.layer_index(end)
            outputs = unique_names(self.bottom_names[end] + diffs)
        else:
            end_ind = 0
            outputs = unique_names(self.inputs + diffs)
        if kwargs:
            if set(kwargs) != set(self.outputs):
                raise CaffeplusError('Top diff arguments do not match net outputs.')
            for name, value in kwargs.items():
                if numpy.shape(value)[0] != self.blobs[name].shape[0]:
                    raise CaffeplusError('Diff is not batch sized')
                self.blobs[name].diff = value
        self.backward_from_to(start_ind, end_ind)
        return {name: self.blobs[name].diff for name in outputs}

    # -- weights -------------------------------------------------------------
    def copy_from(self, weights):
        """Copy weights by layer name from .caffemodel/.h5 file(s) or a
        NetParameter. Several files may be given as a list or 'a,b'."""
        from caffeplus.io import weights as weights_io
        if isinstance(weights, caffe_pb2.NetParameter):
            weights_io.copy_from_net_param(self, weights)
            return
        names = weights.split(',') if isinstance(weights, str) else list(weights)
        for name in names:
            weights_io.copy_trained_layers_from(self, os.fspath(name))

    def to_proto(self, write_diff=False):
        param = caffe_pb2.NetParameter()
        param.CopyFrom(self.net_param)
        del param.layer[:]
        for layer in self.layers:
            param.layer.add().CopyFrom(layer.to_proto(write_diff))
        return param

    def save(self, filename, write_diff=False):
        from caffeplus.io import weights as weights_io
        weights_io.write_caffemodel(self, filename, write_diff)

    def save_hdf5(self, filename, write_diff=False):
        from caffeplus.io import weights as weights_io
        weights_io.write_hdf5(self, filename, write_diff)

    def load_hdf5(self, filename):
        from caffeplus.io import weights as weights_io
        weights_io.copy_from_hdf5(self, filename)

    def share_with(self, other):
        """Share the learnable parameters of `other` (a net of the same
        architecture) by layer name, as Caffe's ShareTrainedLayersWith."""
        for layer_name, src in zip(other._layer_names, other.layers):
            if layer_name not in self._layer_names:
                log.info('Ignoring source layer %s', layer_name)
                continue
            dst = self.layers[self._layer_names.index(layer_name)]
            if len(dst.blobs) != len(src.blobs):
                raise NetError('Incompatible number of blobs for layer %s' % layer_name)
            for j, (d, s) in enumerate(zip(dst.blobs, src.blobs)):
                if d.shape != s.shape:
                    raise NetError("Cannot share param %d weights from layer '%s'; shape "
                                   "mismatch.  Source param shape is %s; target param shape is %s"
                                   % (j, layer_name, s.shape_string(), d.shape_string()))
                d.share_data(s)

    # -- debug_info ----------------------------------------------------------
    def _forward_debug_info(self, layer_id):
        name = self._layer_names[layer_id]
        for top, blob_id in zip(self.top_vecs[layer_id], self.top_id_vecs[layer_id]):
            log.info('    [Forward] Layer %s, top blob %s data: %g', name,
                     self._blob_names[blob_id], _abs_mean(top.data))
        for param_id, net_param_id in enumerate(self.param_id_vecs[layer_id]):
            log.info('    [Forward] Layer %s, param blob %s data: %g', name,
                     self.param_display_names[net_param_id],
                     _abs_mean(self.layers[layer_id].blobs[param_id].data))

    def _backward_debug_info(self, layer_id):
        name = self._layer_names[layer_id]
        for bottom_id, blob in enumerate(self.bottom_vecs[layer_id]):
            if not self.bottom_need_backward[layer_id][bottom_id]:
                continue
            log.info('    [Backward] Layer %s, bottom blob %s diff: %g', name,
                     self._blob_names[self.bottom_id_vecs[layer_id][bottom_id]],
                     _abs_mean(blob.diff))
        layer = self.layers[layer_id]
        for param_id, blob in enumerate(layer.blobs):
            if not layer.param_needs_backward(param_id):
                continue
            log.info('    [Backward] Layer %s, param blob %d diff: %g', name, param_id,
                     _abs_mean(blob.diff))

    def update_debug_info(self, param_id):
        layer_id = self.param_layer_indices[param_id][0]
        name = self._layer_names[layer_id]
        blob = self.param_blobs[param_id]
        owner = self.param_owners[param_id]
        if owner < 0:
            log.info('    [Update] Layer %s, param %s data: %g; diff: %g', name,
                     self.param_display_names[param_id], _abs_mean(blob.data),
                     _abs_mean(blob.diff))
        else:
            owner_layer = self._layer_names[self.param_layer_indices[owner][0]]
            log.info('    [Update] Layer %s, param blob %s (owned by layer %s, param %s) '
                     'diff: %g', name, self.param_display_names[param_id], owner_layer,
                     self.param_display_names[owner], _abs_mean(blob.diff))

    def __repr__(self):
        return '<Net %s: %d layers>' % (self.name, len(self.layers))


@contextlib.contextmanager
def _out_of_memory_as_error(lp, doing):
    """A layer whose blobs do not fit in memory is the user's problem to
    solve (a smaller batch, a typo in a shape): say so, not a traceback."""
    try:
        yield
    except MemoryError as exc:
        raise NetError('layer %s (%s): not enough memory to %s (%s); check the shapes and '
                       'sizes in its definition and the batch size'
                       % (lp.name, lp.type, doing, exc or 'MemoryError'))


def _abs_mean(arr):
    a = backend.to_numpy(arr)
    return float(numpy.abs(a).sum(dtype=numpy.float64) / max(a.size, 1))


def _text(param):
    """Text as Caffe prints a message (`lr_mult: 1`, not `1.0`)."""
    from caffeplus.io.upgrade import message_to_text
    return message_to_text(param)
