"""Which of a net's maps are stored channels-last (NHWC).

cuDNN's 16-bit convolutions run about twice as fast on channels-last maps
(VGG-16's convolutions: 10.0 ms against 17.8 on the H200, docs/precision.md).
A blob stored so keeps its logical shape (N, C, H, W): its shape, the
log, the memory plans and pycaffe's host views (caffeplus.blob.HostBlob)
see Caffe's blob; only the order of the values in memory changes.

A blob can be stored channels-last only where every layer that touches it
reads and writes it so. Pointwise layers (ReLU, Dropout, Split, Eltwise)
do whatever the layout, and per-channel ones (BatchNorm, a per-channel
Scale, a max pooling on caffeplus's kernels) and a Concat along the
channels read either order; each ties its bottoms' and tops' layouts
together. A layer that can read or write
channels-last maps on either side (cuDNN's convolution and pooling,
`channels_last_ok`) lets the layout change across it. Blobs tied together are stored channels-last when all
are 4-D, every layer touching them can, a convolution reads or writes one
of them, every convolution touching them has both sides channels-last (an
image input aside), and some convolution or pooling touching them has; the
net's own inputs and outputs stay in Caffe's order.
"""
from caffeplus import backend, config

NCHW, NHWC = 'NCHW', 'NHWC'
# BatchNorm and Scale over channels-last maps (ResNet's), so that a residual
# net's convolutions run channels-last too: ResNet-50 b256 in FP16 took 54.7
# ms an iteration against 68.1 in Caffe's order on the H200, b64 29.4
# against 27.0, within the spread of runs of that host-bound batch
# (benchmarks/gpu_16bit_nhwc_3578769.json). Off: a net with BatchNorm keeps
# Caffe's order around it.
CHANNELS_LAST_BATCHNORM = True
# A convolution's bottom of at most this many channels (an image) is cheap to
# transpose: the first convolution of a net may change the layout.
IMAGE_CHANNELS = 4


def layout_role(layer, modelled=False):
    """'pointwise' or 'tied' (the layer reads and writes either order, its
    bottoms and tops alike), 'channels_last' (either order on each side),
    or None (Caffe's order only). A layer whose reading depends on its
    configuration says so in channels_last_ok(). `modelled`: the role the
    layer has on a GPU, for a net built anywhere (what the estimate models:
    gpu_layout_role and gpu_channels_last_ok where a layer's role depends on
    the device)."""
    role = getattr(layer, 'gpu_layout_role', None) if modelled else None
    if callable(role):
        return role()
    role = getattr(layer, 'layout_role', None)
    if callable(role):
        role = role()
    ok = (modelled and getattr(layer, 'gpu_channels_last_ok', None)) or \
        getattr(layer, 'channels_last_ok', None)
    if role is not None and ok is not None and not ok():
        return None
    return role


TIED = ('pointwise', 'tied')


def channels_last_blobs(layers, bottom_ids, top_ids, shapes, fixed=(), roles=None):
    """The ids of the blobs to store channels-last.

    layers: the net's layers; bottom_ids, top_ids: per layer, its blob ids;
    shapes: blob id -> shape; fixed: blob ids that stay in Caffe's order
    (the net's inputs and outputs); roles: layer -> role (layout_role)."""
    roles = roles or {}
    parent = {}

    def find(b):
        while parent.get(b, b) != b:
            parent[b] = parent.get(parent[b], parent[b])
            b = parent[b]
        return b

    def join(a, b):
        ra, rb = find(a), find(b)
        if ra != rb:
            parent[rb] = ra

    role_of = [roles.get(i, layout_role(layer)) for i, layer in enumerate(layers)]
    for i, role in enumerate(role_of):
        if role in TIED:
            ids = list(bottom_ids[i]) + list(top_ids[i])
            for b in ids[1:]:
                join(ids[0], b)
    convs = [i for i, role in enumerate(role_of) if role == 'channels_last' and
             getattr(layers[i], 'type', '') == 'Convolution']
    able = {}
    for i, role in enumerate(role_of):
        for b in set(bottom_ids[i]) | set(top_ids[i]):
            group = find(b)
            ok = role is not None and len(shapes[b]) == 4 and b not in fixed
            able[group] = able.get(group, True) and ok
    has_conv = {find(b) for i in convs for b in list(bottom_ids[i]) + list(top_ids[i])}
    chosen = {g for g, ok in able.items() if ok and g in has_conv}
    # Worth it only where convolutions read and write channels-last maps. A
    # convolution between two layouts transposes its bottom in forward and
    # backward, so both its sides go one way (unless its bottom has a few
    # channels: an image, cheap to transpose); a group then needs a
    # convolution or pooling with channels-last maps on both sides. Each
    # drop can strand another group: repeat until none changes.
    sides = [({find(b) for b in bottom_ids[i]}, {find(b) for b in top_ids[i]})
             for i in range(len(layers))]
    images = {i for i in convs if all(shapes[b][1] <= IMAGE_CHANNELS for b in bottom_ids[i])}
    changed = True
    while changed:
        before = set(chosen)
        for i in convs:
            xs, ys = sides[i]
            if i not in images and bool(xs & chosen) != bool(ys & chosen):
                chosen -= xs | ys
        for g in list(chosen):
            if not any(role_of[i] == 'channels_last' and i not in images and
                       g in xs | ys and xs <= chosen and ys <= chosen
                       for i, (xs, ys) in enumerate(sides)):
                chosen.discard(g)
        changed = chosen != before
    return {b for b in shapes if find(b) in chosen}


def modelled_blobs(net):
    """The ids of the blobs `apply` would store channels-last on a GPU
    (the `layout` setting 'nhwc'), for a net built anywhere."""
    if config.get('layout') != 'nhwc':
        return set()
    shapes = {i: b.shape for i, b in enumerate(net._blobs)}
    fixed = set(net.input_blob_indices) | set(net.output_blob_indices)
    roles = {i: layout_role(layer, modelled=True) for i, layer in enumerate(net.layers)}
    return channels_last_blobs(net.layers, net.bottom_id_vecs, net.top_id_vecs, shapes, fixed,
                               roles)


def gpu_blobs(net):
    """The ids of the blobs stored channels-last on the GPU: a GPU's net's
    as stored; a net built elsewhere stores every map in Caffe's order, so
    as `apply` would store them there (modelled_blobs)."""
    return {i for i, b in enumerate(net._blobs) if b.layout == NHWC} or modelled_blobs(net)


def apply(net):
    """Store the net's maps as the `layout` setting says ('nchw': Caffe's
    order everywhere; 'nhwc': channels-last where channels_last_blobs
    allows); the layers touching a moved blob reshape again, so that their
    descriptors describe the new order. Returns the ids moved. Only the
    GPU's layers read channels-last maps: on the CPU nothing is looked at."""
    if config.get('layout') != 'nhwc' or backend.mode() != backend.GPU:
        return set()
    shapes = {i: b.shape for i, b in enumerate(net._blobs)}
    fixed = set(net.input_blob_indices) | set(net.output_blob_indices)
    moved = channels_last_blobs(net.layers, net.bottom_id_vecs, net.top_id_vecs, shapes, fixed)
    for b in moved:
        net._blobs[b].layout = NHWC
    if moved:
        for i, layer in enumerate(net.layers):
            if moved & (set(net.bottom_id_vecs[i]) | set(net.top_id_vecs[i])):
                layer.reshape(net.bottom_vecs[i], net.top_vecs[i])
    return moved
