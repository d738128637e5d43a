"""When each activation buffer is live during one training iteration.

Time runs over 2L steps for a net of L layers: forward of layer i is step i,
backward of layer i is step 2L-1-i. A buffer is a blob's data or diff
Storage; blobs that share one (in-place tops, Split outputs, Reshape) are one
buffer. Its interval runs from its first write to its last read, using each
layer's declared `backward_reads`; buffers a user must still read after the
iteration (net outputs, losses, inputs, `keep` names) live to the end.
"""
import collections
import math

Buffer = collections.namedtuple('Buffer', 'key kind blobs nbytes start end')

FLOAT_BYTES = 4


def _steps(net):
    L = len(net.layers)
    return L, (lambda i: i), (lambda i: 2 * L - 1 - i)


def written_once(net):
    """Tops a layer fills at setup and never again (DummyData's constant
    tops, such as labels): like inputs, their values must outlive the
    iteration, or a reused buffer hands the next iteration garbage."""
    names = set()
    for i, layer in enumerate(net.layers):
        refill = getattr(layer, 'refill', None)
        if layer.layer_param.type == 'DummyData' and refill is not None:
            names.update(net._blob_names[b] for b, again in zip(net.top_id_vecs[i], refill)
                         if not again)
    return names


def data_layer_tops(net):
    """Tops of layers without bottoms (Data, ImageData, DummyData, ...): the
    batch a user most often reads back (pycaffe's net.blobs['data'], or a
    forward(start=...) that skips the data layer); one batch is cheap."""
    names = set()
    for i, layer in enumerate(net.layers):
        if not net.bottom_id_vecs[i]:
            names.update(net._blob_names[b] for b in net.top_id_vecs[i])
    return names


def buffers(net, keep=(), training=True, overlay=True):
    """List of Buffer for every data and diff Storage the iteration touches;
    with `overlay` (the reusing plans), the diffs that diff_overlays puts
    in one region are one Buffer."""
    L, fwd, bwd = _steps(net)
    end_of_iteration = 2 * L if training else L
    keep = set(keep) | set(net.outputs) | set(net.inputs) | written_once(net) | \
        data_layer_tops(net)
    intervals = {}      # (kind, id(storage)) -> [start, end, set(blob names), nbytes]
    first_read = {}     # (kind, id(storage)) -> whether its earliest touch reads it

    def touch(kind, blob, name, step, read=False):
        storage = blob.data_storage if kind == 'data' else blob.diff_storage
        key = (kind, id(storage))
        # (2 a value for a 16-bit net's maps: on the GPU, and in the
        # shape-only builds that plan for it.)
        nbytes = blob.count * storage.dtype.itemsize
        entry = intervals.get(key)
        if entry is None:
            intervals[key] = [step, step, {name}, nbytes]
            first_read[key] = read
        else:
            if step < entry[0]:
                first_read[key] = read
            elif step == entry[0]:
                first_read[key] = first_read[key] or read
            entry[0] = min(entry[0], step)
            entry[1] = max(entry[1], step)
            entry[2].add(name)
            entry[3] = max(entry[3], nbytes)

    names = net._blob_names
    # Tops that alias parameters (the Parameter layer) are persistent params,
    # not activations.
    param_storages = {id(p.data_storage) for p in net.param_blobs} | \
        {id(p.diff_storage) for p in net.param_blobs}
    # A fused chain's backward (layers/fused_chain.py) runs at its last member's
    # step: its members read and write there too (e.g. an Eltwise->ReLU
    # chain writes the Eltwise's bottom diffs a step before the Eltwise's).
    from caffeplus import kernels
    heads = kernels.chain_heads(net)
    for i, layer in enumerate(net.layers):
        reads = layer.backward_reads
        does_backward = training and net.layer_need_backward[i]
        back = sorted({bwd(i), bwd(heads.get(i, i))})
        for blob, blob_id in zip(net.bottom_vecs[i], net.bottom_id_vecs[i]):
            touch('data', blob, names[blob_id], fwd(i))
            if does_backward and 'bottom_data' in reads:
                for s in back:
                    touch('data', blob, names[blob_id], s)
        for k, (blob, blob_id) in enumerate(zip(net.top_vecs[i], net.top_id_vecs[i])):
            touch('data', blob, names[blob_id], fwd(i))
            if does_backward and 'top_data' in reads:
                for s in back:
                    touch('data', blob, names[blob_id], s)
            if training and layer.loss(k):
                # The loss weight sits in the top's diff from setup on.
                touch('diff', blob, names[blob_id], 0)
                touch('diff', blob, names[blob_id], end_of_iteration)
        if not does_backward:
            continue
        # Backward reads the top diffs and writes the bottom diffs it propagates
        # to. (A chain member's read at its head's step is of a gradient the
        # chain makes in that step, as a Split head's sum; the head's own
        # reads tell a diff read before anything writes it.)
        for blob, blob_id in zip(net.top_vecs[i], net.top_id_vecs[i]):
            for s in back:
                touch('diff', blob, names[blob_id], s, read=s == bwd(i))
        for blob, blob_id, prop in zip(net.bottom_vecs[i], net.bottom_id_vecs[i],
                                       net.bottom_need_backward[i]):
            if prop:
                for s in back:
                    touch('diff', blob, names[blob_id], s)

    out = []
    for (kind, storage_id), (start, end, blob_names, nbytes) in intervals.items():
        if storage_id in param_storages:
            continue
        if kind == 'data' and blob_names & keep:
            start, end = min(start, 0), end_of_iteration
        if kind == 'diff' and (blob_names & keep or first_read[(kind, storage_id)]):
            # Kept blobs' diffs stay readable; a diff that backward reads
            # before any layer writes it (a Split top no backward layer
            # consumes, an output's diff set by the user) must keep its
            # value (zeros, as stock) across iterations.
            start, end = min(start, 0), end_of_iteration
        out.append(Buffer((kind, tuple(sorted(blob_names))), kind, tuple(sorted(blob_names)),
                          nbytes, start, end))
    if training and overlay:
        out = diff_overlays(net, out)
    out.sort(key=lambda b: (b.start, b.key))
    return out


def overlay_steps(net):
    """[(backward step, top diff name, bottom diff name)] of the layers whose
    backward may write its bottom's gradient over its top's
    (Layer.diff_over_top_diff: LRN), where both are one blob's whole diff."""
    from caffeplus import kernels
    L, _, bwd = _steps(net)
    heads = kernels.chain_heads(net)
    names = net._blob_names
    out = []
    for i, layer in enumerate(net.layers):
        if not (getattr(layer, 'diff_over_top_diff', False) and net.layer_need_backward[i]) \
                or heads.get(i, i) != i or len(net.top_vecs[i]) != 1 or \
                len(net.bottom_vecs[i]) != 1 or not net.bottom_need_backward[i][0]:
            continue
        top, bottom = net.top_vecs[i][0], net.bottom_vecs[i][0]
        if top.diff_storage is bottom.diff_storage or top.count != bottom.count:
            continue
        out.append((bwd(i), names[net.top_id_vecs[i][0]], names[net.bottom_id_vecs[i][0]]))
    return out


def buffer_storages(buf, blobs):
    """[(storage, [blob names])] behind a data or diff Buffer, in the order
    of its blobs (`blobs`: name -> Blob): one storage, or two where diffs
    overlay (diff_overlays)."""
    groups = collections.OrderedDict()
    for n in buf.blobs:
        blob = blobs[n]
        storage = blob.data_storage if buf.kind == 'data' else blob.diff_storage
        groups.setdefault(id(storage), (storage, []))[1].append(n)
    return list(groups.values())


def diff_overlays(net, bufs):
    """Merge each overlay layer's top-diff and bottom-diff buffers into one
    (overlay_steps): the top's gradient is dead once that backward has read
    it, the bottom's is first written there, so one region serves both
    (AlexNet's norm1 backward then holds three maps of 142 MiB, not four).
    Only where the top's diff ends and the bottom's starts at that step
    (neither kept, nor read before written)."""
    by_name = {}
    for b in bufs:
        if b.kind == 'diff':
            for n in b.blobs:
                by_name[n] = b
    for step, top, bottom in overlay_steps(net):
        t, u = by_name.get(top), by_name.get(bottom)
        if t is None or u is None or t is u or t.nbytes != u.nbytes or \
                t.end != step or u.start != step or \
                net._blob_dict[top].diff_storage.dtype != net._blob_dict[bottom].diff_storage.dtype:
            continue
        merged = Buffer(('diff', tuple(sorted(t.blobs + u.blobs))), 'diff',
                        tuple(sorted(t.blobs + u.blobs)), t.nbytes, t.start, u.end)
        bufs = [b for b in bufs if b is not t and b is not u] + [merged]
        for n in merged.blobs:
            by_name[n] = merged
    return bufs


# Each layer updated in backward costs a check and an update kernel launch
# (and their host time), which nets of many small layers feel: at this
# size the first measured version cost ResNet-50 33% and AlexNet 5%, so only
# the gradients whose bytes matter leave (AlexNet's and VGG-16's fc6-8:
# 224 and 472 MiB); the others are updated together at the end. (At 16 MiB
# fc8's 15.6 MiB stayed whole, on AlexNet beside the convolutions' peaks;
# the next below are VGG-16's and ResNet-50's 9.4 MiB 3x3 convolutions.)
MIN_APPLIED_GRADIENT_BYTES = 12 * 2 ** 20
# Beside those, the largest of the rest down to SMALL_APPLIED_GRADIENT_BYTES
# leave too, up to MAX_APPLIED_GRADIENTS gradients in all: a few launches
# more for what they hold at the peak (AlexNet's conv2-5, 8.7 MiB, held
# through its `free` peak at pool1's backward; ResNet-50's res5 and fc1000,
# GoogLeNet's auxiliary classifiers).
SMALL_APPLIED_GRADIENT_BYTES = 2 ** 20
MAX_APPLIED_GRADIENTS = 8


def param_diff_spans(net):
    """{learnable param index: (first, last) backward step} of the parameter
    gradients a solver may apply in backward (caffeplus.solver.
    update_in_backward): the gradient is written from the first backward step
    among the layers that own the parameter (a fused chain's backward runs at
    its head's step: kernels.chain_heads) and complete after the last one,
    where the update uses it. Left out (they keep their memory and are
    updated at the end, as Caffe): parameters no layer's backward writes,
    and gradients under MIN_APPLIED_GRADIENT_BYTES but for the largest ones
    down to SMALL_APPLIED_GRADIENT_BYTES while MAX_APPLIED_GRADIENTS allows."""
    from caffeplus import kernels
    L, _, bwd = _steps(net)
    heads = kernels.chain_heads(net)
    spans = {}
    for pid, (layer_id, _) in enumerate(net.param_layer_indices):
        if not net.layer_need_backward[layer_id]:
            continue
        k = net.learnable_param_ids[pid]
        first = min(bwd(layer_id), bwd(heads.get(layer_id, layer_id)))
        last = bwd(layer_id)
        lo, hi = spans.get(k, (first, last))
        spans[k] = (min(lo, first), max(hi, last))
    size = {k: net.learnable_params[k].count * FLOAT_BYTES for k in spans}
    big = [k for k in spans if size[k] >= MIN_APPLIED_GRADIENT_BYTES]
    rest = sorted((k for k in spans if SMALL_APPLIED_GRADIENT_BYTES <= size[k] <
                   MIN_APPLIED_GRADIENT_BYTES), key=lambda k: (-size[k], k))
    chosen = set(big) | set(rest[:max(MAX_APPLIED_GRADIENTS - len(big), 0)])
    return {k: v for k, v in spans.items() if k in chosen}


def param_diff_buffers(net):
    """Buffers for the parameter gradients applied in backward
    (param_diff_spans). A convolution's filter-gradient call writes its
    gradient: the life starts with that call, half a step early
    (FILTER_FIRST), so that call's workspace never shares its bytes."""
    return [Buffer(('param_diff', k), 'param_diff', (), net.learnable_params[k].count * FLOAT_BYTES,
                   first - FILTER_FIRST, last)
            for k, (first, last) in sorted(param_diff_spans(net).items())]


# A layer's backward runs its filter-gradient call before the call that
# writes its bottom's diff (layers/cudnn_conv.py); for a one-bottom layer the
# filter call's workspace lives half a step early, where that diff is not
# live yet and may share its bytes.
FILTER_FIRST = 0.5


def workspace_buffers(net, sizes, training=True):
    """Buffers for the convolution workspace: a layer's forward call needs
    its workspace at its forward step only, its backward calls at its
    backward step only, so the planner can put workspace where activations
    are dead (the forward of the first layers, the end of backward) instead
    of beside the peak. `sizes`: {layer index: (forward bytes, backward
    bytes[, backward filter-call bytes])}: with the third, the filter call
    gets a buffer of its own, half a step before the others (FILTER_FIRST)
    when the layer has one bottom."""
    L = len(net.layers)
    out = []
    for i, size in sorted(sizes.items()):
        fwd_bytes, bwd_bytes = size[0], size[1]
        filter_bytes = size[2] if len(size) > 2 else 0
        name = net._layer_names[i]
        if fwd_bytes:
            out.append(Buffer(('workspace', name, 'forward'), 'workspace', (), int(fwd_bytes),
                              i, i))
        if not (training and net.layer_need_backward[i]):
            continue
        t = 2 * L - 1 - i
        # The data-gradient call runs only for a bottom that takes a gradient
        # (conv1's input does not).
        if bwd_bytes and any(net.bottom_need_backward[i]):
            out.append(Buffer(('workspace', name, 'backward'), 'workspace', (), int(bwd_bytes),
                              t, t))
        if filter_bytes:
            early = t - FILTER_FIRST if len(net.bottom_vecs[i]) == 1 else t
            out.append(Buffer(('workspace', name, 'backward_filter'), 'workspace', (),
                              int(filter_bytes), early, early))
    return out


def takes_gemm_workspace(layer):
    """Whether the layer's calls are cuBLAS GEMMs that a placing plan gives
    workspace from its arena (caffeplus.memory.cublas_pool)."""
    return layer.layer_param.type == 'InnerProduct'


def gemm_workspace_buffers(net, nbytes, training=True):
    """Buffers for cuBLAS's workspace: `nbytes` for each InnerProduct at
    its forward step and at its backward step (its filter, bias and data
    GEMMs one after another on the same bytes)."""
    if not nbytes:
        return []
    L = len(net.layers)
    out = []
    for i, layer in enumerate(net.layers):
        if not takes_gemm_workspace(layer):
            continue
        name = net._layer_names[i]
        out.append(Buffer(('workspace', name, 'forward'), 'workspace', (), int(nbytes), i, i))
        if training and net.layer_need_backward[i]:
            t = 2 * L - 1 - i
            out.append(Buffer(('workspace', name, 'backward'), 'workspace', (), int(nbytes),
                              t, t))
    return out


def internal_buffers(net, sizes, training=True):
    """Buffers a layer keeps from its forward to its backward (max pooling's
    argmax, BatchNorm's normalised copy; caffeplus.memory.scratch): live
    from the layer's forward step to its backward step (to its forward step
    alone when it runs no backward). `sizes`: {layer index: {name: bytes}}."""
    L = len(net.layers)
    out = []
    for i, named in sorted(sizes.items()):
        end = 2 * L - 1 - i if training and net.layer_need_backward[i] else i
        for name, nbytes in sorted(named.items()):
            if nbytes:
                out.append(Buffer(('internal', net._layer_names[i], name), 'internal', (),
                                  int(nbytes), i, end))
    return out


def headroom(net, bufs, steps, training=True):
    """{(layer index, 'forward' | 'backward' | 'backward_filter'): bytes}
    the buffers `bufs` leave free below their own peak at each of a layer's
    workspace calls: a workspace that fits there does not raise the peak.
    Counted by half steps (live_bytes_by_half_step): a one-bottom layer's
    filter call runs half a step before its bottom's diff is written
    (FILTER_FIRST), and a map only that call reads may be gone during the
    data call (caffeplus.memory.recompute.again_lives)."""
    L = len(net.layers)
    live = live_bytes_by_half_step(bufs, steps)
    ceiling = max(live) if live else 0
    room = {}
    for i in range(L):
        room[(i, 'forward')] = ceiling - live[2 * i]
        t = 2 * L - 1 - i
        if training and t <= steps:
            room[(i, 'backward')] = ceiling - live[2 * t]
            h = 2 * t - 1 if len(net.bottom_vecs[i]) == 1 else 2 * t
            room[(i, 'backward_filter')] = ceiling - live[h]
    return room


def live_bytes_by_half_step(bufs, steps):
    """Bytes live at each half step 0, 0.5, 1, ..., steps (index 2t): a
    filter call's workspace and a map needed by that call alone
    (caffeplus.memory.recompute) live half a step before the diff the
    layer's step then writes, and do not count beside it."""
    live = [0] * (2 * steps + 1)
    for b in bufs:
        for h in range(max(int(math.ceil(2 * b.start)), 0),
                       min(int(math.floor(2 * b.end)), 2 * steps) + 1):
            live[h] += b.nbytes
    return live


def live_bytes_by_step(bufs, steps):
    """Bytes live at each step: the busier of its two half steps (a step's
    filter call half a step early, then its other calls), so a filter call's
    workspace and the data call's that reuses its bytes count once."""
    half = live_bytes_by_half_step(bufs, steps)
    return [max(half[2 * t], half[2 * t - 1] if t else 0) for t in range(steps + 1)]
