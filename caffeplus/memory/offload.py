"""Which feature maps go to host memory between forward and backward (vDNN).

A buffer is worth offloading when it is read again only in backward: after
its last forward use it can wait in pinned host memory and come back just
before the first backward step that reads it. On the device it is then two
short lives instead of one long one.

Policies: 'conv' (the inputs of convolution layers, vDNN's conv policy),
'all' (every such buffer), 'free' (those whose copies the measured step
times hide: caffeplus.memory.free_offload, chosen at run time), or a list
of blob names.
"""
from caffeplus.errors import CaffeplusError
from caffeplus.memory.liveness import FILTER_FIRST, Buffer

CONV_TYPES = ('Convolution', 'Deconvolution')


def _uses(net, buf):
    """Forward and backward steps at which a data buffer is used; a fused
    chain's members read at their head's step too (kernels.chain_heads, as
    liveness.buffers)."""
    from caffeplus import kernels
    heads = kernels.chain_heads(net)
    # Memoised per net: plan auto's search asks for every buffer thousands
    # of times (the answer changes only with the chains and what needs
    # backward).
    memo = net.__dict__.setdefault('_offload_uses_memo', {})
    key = (tuple(buf.blobs), tuple(sorted(heads.items())), tuple(net.layer_need_backward))
    if key in memo:
        fwd, bwd = memo[key]
        return list(fwd), list(bwd)
    fwd, bwd = _scan_uses(net, buf, heads)
    memo[key] = (tuple(fwd), tuple(bwd))
    return fwd, bwd


def _scan_uses(net, buf, heads):
    L = len(net.layers)
    names = set(buf.blobs)
    fwd, bwd = [], []
    for i, layer in enumerate(net.layers):
        bottoms = {net._blob_names[b] for b in net.bottom_id_vecs[i]}
        tops = {net._blob_names[b] for b in net.top_id_vecs[i]}
        if names & (bottoms | tops):
            fwd.append(i)
        if not net.layer_need_backward[i]:
            continue
        if ('bottom_data' in layer.backward_reads and names & bottoms) or \
                ('top_data' in layer.backward_reads and names & tops):
            bwd.extend(sorted({2 * L - 1 - i, 2 * L - 1 - heads.get(i, i)}))
    return fwd, bwd


def copy_out_step(net, buf):
    """The forward step after which a map's copy out is issued: its last
    forward use, or for a data layer's batch, which the layers after only
    read, the data layer's own step (the copy then runs beside conv1's
    forward instead of after it)."""
    from caffeplus.memory.liveness import data_layer_tops
    fwd, _ = _uses(net, buf)
    if fwd and set(buf.blobs) & data_layer_tops(net):
        writers = [i for i in fwd if set(buf.blobs) & {net._blob_names[b]
                                                       for b in net.top_id_vecs[i]}]
        if writers == [min(fwd)] and not net.bottom_id_vecs[min(fwd)]:
            return min(fwd)
    return max(fwd)


def choose(net, bufs, policy, keep=()):
    """Keys of the data buffers to offload under `policy`."""
    from caffeplus.memory.liveness import data_layer_tops, written_once
    # Values that must outlive the iteration (DummyData's constant tops) stay put.
    keep = set(keep) | set(net.outputs) | set(net.inputs) | written_once(net)
    batches = set()
    if policy == 'free':
        policy = 'all'          # the candidates; free_offload picks among them
        # The data layers' batch too (AlexNet's 75 MiB, read again only by
        # conv1's filter gradient at the end of backward): it comes back for
        # that read and stays, readable after the iteration as in every plan.
        batches = data_layer_tops(net)
    if isinstance(policy, str) and policy not in ('conv', 'all'):
        policy = [n for n in policy.split(',') if n]
    if not isinstance(policy, str):
        known = set(net._blob_names)
        missing = [n for n in policy if n not in known]
        if missing:
            raise CaffeplusError('offload: no blob named %s in net %s'
                                 % (', '.join(repr(n) for n in missing), net.name))
    conv_inputs = set()
    for i, layer in enumerate(net.layers):
        if layer.layer_param.type in CONV_TYPES:
            conv_inputs.update(net._blob_names[b] for b in net.bottom_id_vecs[i])
    chosen = []
    for buf in bufs:
        batch = bool(set(buf.blobs) & batches)
        if buf.kind != 'data' or set(buf.blobs) & keep or \
                (buf.start <= 0 and buf.end >= 2 * len(net.layers) and not batch):
            continue        # kept, or live for the whole iteration
        fwd, bwd = _uses(net, buf)
        if not bwd or not fwd or max(fwd) + 1 >= min(bwd):
            continue   # not needed by backward, or no idle gap to save
        if policy == 'conv' and not set(buf.blobs) & conv_inputs:
            continue
        if not isinstance(policy, str) and not set(buf.blobs) & set(policy):
            continue
        chosen.append(buf.key)
    return tuple(chosen)


def shorten(bufs, offloaded, net, lookahead=1, hidden=None):
    """Replace each offloaded buffer by its two device lives: until its last
    forward use, and from `lookahead` layers before its first backward use.
    `hidden`: {key: free_offload.Hidden} for maps chosen by policy 'free'
    or held by plan `auto` (offload_timing): the first life lasts until the
    step before `release` (its copy out has ended by then), the second
    starts at `prefetch`."""
    offloaded = set(offloaded)
    hidden = hidden or {}
    out = []
    for buf in bufs:
        if buf.key not in offloaded:
            out.append(buf)
            continue
        fwd, bwd = _uses(net, buf)
        first_back = min(bwd)
        h = hidden.get(buf.key)
        if h is not None:
            out.append(Buffer(buf.key + ('forward',), buf.kind, buf.blobs, buf.nbytes,
                              buf.start, h.release - 1))
            out.append(Buffer(buf.key + ('backward',), buf.kind, buf.blobs, buf.nbytes,
                              h.prefetch - FILTER_FIRST, buf.end))
            continue
        out.append(Buffer(buf.key + ('forward',), buf.kind, buf.blobs, buf.nbytes,
                          buf.start, max(fwd)))
        # (Half a step early: the copy back is issued before that step's
        # layer runs; see liveness.FILTER_FIRST.)
        out.append(Buffer(buf.key + ('backward',), buf.kind, buf.blobs, buf.nbytes,
                          max(first_back - lookahead, max(fwd) + 1) - FILTER_FIRST, buf.end))
    return out


def host_bytes(bufs, offloaded):
    offloaded = set(offloaded)
    return sum(b.nbytes for b in bufs if b.key in offloaded)
