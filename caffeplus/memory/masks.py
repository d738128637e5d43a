"""Masks instead of maps: max pooling and ReLU whose backward reads a few
bits their forward kept, not the maps around them.

cuDNN's max-pooling backward reads the pooling's input and output, and a
ReLU's backward reads its output, so a plan keeps VGG-16's conv1_2 map (12.85
MB an image) from forward to backward although no convolution needs it.
Masked, a max pooling keeps a one-byte argmax (a quarter of its output) and
a ReLU one bit a value; when every later reader of a ReLU's map is a masked
pooling, the map dies after the pooling's forward.

    from caffeplus.memory import masks
    masks.apply(net, masks.choose(net))      # before the plan is made

Which plans mask what. `stock` and `arena` never do: they are stock Caffe's
layers. `auto` masks every layer it can. `shared` and `offload` mask only
where the results stay bit for bit those of `stock`: the masked pooling
routes each gradient to the first maximum of its window and sums a value's
gradients in window order, as Caffe's own pooling; cuDNN's gives the same
bits where windows do not overlap (dev/compare_pooling.py, on the H100),
not where they do; where cuDNN does not run (Caffe's ceil rule) the kernels'
int32 argmax computes what the masked one does. The masks setting
(caffeplus.config: --masks, caffeplus_param.masks, CAFFEPLUS_MASKS) 'on'
masks every layer in `shared` and `offload` too; 'off' masks nothing.
"""


def _setting():
    from caffeplus import config
    return config.get('masks')


ALL, SAME_BITS = 'all', 'same bits'


def wanted(plan_name):
    """What plan `plan_name` masks: ALL it can, SAME_BITS (only where the
    results stay those of stock), or None."""
    s = _setting()
    if s == 'off':
        return None
    if plan_name == 'auto':
        return ALL
    if plan_name in ('shared', 'offload'):
        return ALL if s == 'on' else SAME_BITS
    return None


def _maskable(layer):
    return callable(getattr(layer, 'set_masked', None)) and layer.can_mask()


def _one_type(net, i):
    """Layer i's bottoms and tops, data and diff, share one storage type (the
    mask kernels take one map type a launch)."""
    blobs = [net._blobs[k] for k in list(net.bottom_id_vecs[i]) + list(net.top_id_vecs[i])]
    return len({s.dtype for b in blobs for s in (b.data_storage, b.diff_storage)}) == 1


def _one_order(net, i, nhwc):
    """Layer i reads and writes one order (the masked pooling's kernels
    take one order both sides; a GPU's layer says so itself, a net built
    elsewhere stores every map in Caffe's order): VGG-16's pool5 in 16 bits
    reads channels-last maps and writes Caffe's order for fc6."""
    ids = list(net.bottom_id_vecs[i]) + list(net.top_id_vecs[i])
    return len({k in nhwc for k in ids}) == 1


def _orders(net, i, nhwc):
    """(bottom, top) orders of layer i's first maps as a GPU stores them:
    a host-built net's 16-bit max poolings between channels-last maps run
    the GPU's argmax kernels, which masking leaves bit for bit, so the
    estimate masks them as the GPU's plan does (torchvision's AlexNet:
    relu1, pool1, relu2 and pool2, 76 MiB of its BFLOAT16 arena)."""
    return tuple('NHWC' if ids[0] in nhwc else 'NCHW'
                 for ids in (net.bottom_id_vecs[i], net.top_id_vecs[i]))


def _writer(net, i, blob_id):
    """The layer before i that last wrote blob `blob_id`, or None."""
    for j in range(i - 1, -1, -1):
        if blob_id in net.top_id_vecs[j]:
            return j
    return None


def _reads(layer):
    """What the layer's backward reads unmasked (choose may run on a net
    already masked)."""
    return layer.unmasked_backward_reads()


def _backward_readers(net, blob_id, but):
    """Layers other than `but` whose backward reads blob `blob_id`'s data,
    or a blob's that shares it (a Split's tops, its bottom)."""
    storage = net._blobs[blob_id].data_storage
    same = {k for k, b in enumerate(net._blobs) if b.data_storage is storage}
    out = []
    for j, layer in enumerate(net.layers):
        if j == but or not net.layer_need_backward[j]:
            continue
        reads = _reads(layer)
        if (same & set(net.bottom_id_vecs[j]) and 'bottom_data' in reads) or \
                (same & set(net.top_id_vecs[j]) and 'top_data' in reads):
            out.append(j)
    return out


def choose(net, same_bits=False):
    """Names of the layers to mask: the ReLUs in place on a convolution's
    output whose later readers are all maskable max poolings, and the max
    poolings whose input then has no other reader in backward (masking a
    pooling whose input a convolution or an LRN reads again would keep a
    mask for nothing). `same_bits`: only poolings whose results masking
    leaves bit for bit. Empty when the fused kernels are off
    (CAFFEPLUS_FUSED=0), the masked layers' kernels (float32 and FLOAT16
    builds)."""
    from caffeplus import kernels
    if not kernels.enabled():
        return ()
    from caffeplus import layout
    nhwc = layout.gpu_blobs(net)
    maskable = {i for i, l in enumerate(net.layers)
                if l.layer_param.type == 'Pooling' and _maskable(l) and _one_type(net, i) and
                _one_order(net, i, nhwc) and
                (not same_bits or l.masked_bits_unchanged(_orders(net, i, nhwc)))}
    relus = set()
    for i, layer in enumerate(net.layers):
        if layer.layer_param.type != 'ReLU' or not _maskable(layer) or not _one_type(net, i):
            continue
        tops, bottoms = net.top_id_vecs[i], net.bottom_id_vecs[i]
        if len(tops) != 1 or tops != bottoms:
            continue
        w = _writer(net, i, tops[0])
        if w is None or net.layers[w].layer_param.type not in ('Convolution', 'Deconvolution'):
            continue
        readers = [j for j in range(i + 1, len(net.layers)) if tops[0] in net.bottom_id_vecs[j]]
        if readers and all(j in maskable and tops[0] not in net.top_id_vecs[j] for j in readers):
            relus.add(i)
    pools = {p for p in maskable
             if all(j in relus for j in _backward_readers(net, net.bottom_id_vecs[p][0], p))}
    relus = {i for i in relus
             if all(j in pools for j in range(i + 1, len(net.layers))
                    if net.top_id_vecs[i][0] in net.bottom_id_vecs[j])}
    return tuple(net.layers[i].name for i in sorted(pools | relus))


def apply(net, names):
    """Mask exactly the layers named (unmask the others); returns the names
    of the layers now masked."""
    names = set(names or ())
    done = []
    for layer in net.layers:
        if callable(getattr(layer, 'set_masked', None)):
            if layer.set_masked(layer.name in names):
                done.append(layer.name)
    return tuple(done)


def for_plan(net, plan_name):
    """Mask what plan `plan_name` masks on `net`; returns the names."""
    mode = wanted(plan_name)
    return apply(net, choose(net, same_bits=mode == SAME_BITS) if mode else ())


def applied(net):
    """Names of the net's masked layers."""
    return tuple(l.name for l in net.layers if getattr(l, 'masked', False))
