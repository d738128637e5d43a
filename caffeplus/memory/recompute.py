"""Feature maps a cheap layer makes again in backward instead of keeping them.

On the GPU, cuDNN's LRN and pooling backward read their input and their
output, so an LRN's or a pooling layer's output stays on the device from
its forward to its backward even though forward read it only once, at the
next layer. Its input stays there anyway (the same backward reads it), so
the reusing plans (`shared`, `offload`, `auto`) let the output's memory go
after its last forward use and run the producing layer's forward again just
before the first backward step that reads the output: the same
deterministic call on the same input gives the same bits, and one
memory-bound forward (AlexNet's norm1: a fraction of a millisecond) buys the
map's bytes back for most of the iteration (checkpointing, for the layers
where it is cheap).

A map is made again only when
  * one layer writes it (no layer works on it in place; a Split's tops
    share it), a layer of RECOMPUTE_TYPES that draws no random numbers;
    or, where the caller asks for convolutions too (`convs`: plan `auto`
    weighs their time against the bytes), a Convolution followed only by
    layers of IN_PLACE_AFTER working on it in place (VGG-16's conv1_1 and
    relu1_1: 0.7 ms at batch 256 for 3.3 GB that would otherwise cross
    the host link twice, 66 ms each way);
  * it is read in backward, after an idle gap;
  * every input of its producer is a single device life that is written by
    no later layer and still live at that first backward read, and is not
    itself made again (of a map and its producer's input, the larger is);
  * it holds at least MIN_SHARE of the bytes live at the iteration's
    busiest step (data and diffs): a forward per small map would cost more
    time than its bytes are worth (GoogLeNet's auxiliary average pools).
Under plan `offload` the maps its policy offloads are chosen first: they
are neither made again nor inputs to what is.

Normalized chains. In a residual net a convolution's top is normalized,
scaled and rectified in place (BatchNorm -> Scale -> ReLU) and read in
backward by the next convolution's filter call; BatchNorm keeps its
normalized copy for its own backward anyway, and the top is
relu(copy * scale + bias) of it. Such a top (writers ending in a
BatchNorm that keeps its copy, then at most a per-channel Scale and a
ReLU, each in place) is made again from that copy with one elementwise
pass (REMAKE, caffeplus.memory.apply): no input but what backward keeps,
the same arithmetic as the forward that wrote it, so the same bits.
ResNet-50 at batch 256 in FLOAT16 gives back 1.7 GB this way.

Residual sums. An Eltwise SUM of two maps, then a ReLU in place on its
top (a residual block's output), is read again in backward by the next
block's first convolutions and its own ReLU. Its top is made again
(REMAKE_SUM) by the Eltwise's and the ReLU's own forwards from its two
bottoms, each of which is then either
  * a normalized chain's top that backward does not read (the branch's
    BatchNorm -> Scale), made again from its copy just before, for that
    step alone;
  * another residual sum made again, made again first (so a stage's sums
    come back together, when backward reaches its last block);
  * a map still kept at that step.
ResNet-50 at batch 256 in FLOAT16 gives back another 1.7 GB at the peak,
for about three elementwise passes over each block's output.

Which plans: `offload` and `auto`; in `shared` only the normalized chains
and residual sums, and of those only the ones that lower its peak (prune).
`shared` promises `arena`'s iteration time, and a forward run again is time
(AlexNet's norm1 and norm2: 2.6%); a chain's pass is one read of the copy
and one write of the top. The recompute setting (caffeplus.config:
--recompute, caffeplus_param.recompute, CAFFEPLUS_RECOMPUTE) 'on' makes
every map again in `shared` too, 'off' none in any plan; 'convs' runs
convolutions again in every reusing plan, not only where `auto`'s search
finds it pays.

A convolution run again needs its forward workspace at that backward step:
workspace_buffers gives it a buffer of its own there ('again'), which the
placed workspace (caffeplus.memory.workspace) lends to that call, so the
same algorithm runs and gives the same bits.
"""

from caffeplus.memory.liveness import FILTER_FIRST, Buffer, live_bytes_by_step
from caffeplus.memory.offload import _uses
from caffeplus.proto import caffe_pb2

_ELTWISE_SUM = caffe_pb2.EltwiseParameter.SUM

RECOMPUTE_TYPES = ('LRN', 'Pooling')
CONV_TYPES = ('Convolution',)
# In-place layers after a convolution whose forward is a function of the
# map alone (no state, no random numbers; BatchNorm's running averages
# would move twice).
IN_PLACE_AFTER = ('ReLU',)
MIN_SHARE = 0.02
# A normalized chain's pass costs its bytes' time and one launch: a tenth
# of MIN_SHARE (ResNet-50's stage-5 tops at batch 64, 3 MB each, qualify).
REMAKE_SHARE = 0.1
# Pooling methods whose forward is a function of its input (STOCHASTIC draws).
_POOL_METHODS = (0, 1)          # PoolingParameter.MAX, AVE


def _setting():
    from caffeplus import config
    return config.get('recompute')


def enabled(plan_name=None):
    """Whether plan `plan_name` makes maps again (None: any plan may)."""
    setting = _setting()
    if setting == 'off':
        return False
    return plan_name != 'shared' or setting != 'plan'


def remakes_enabled():
    """Whether the reusing plans make normalized chains' tops again (every
    setting but 'off')."""
    return _setting() != 'off'


def prunes():
    """Whether `shared` keeps the maps whose making again would not lower its
    peak (the default 'plan'; 'on' makes every map it can again)."""
    return _setting() == 'plan'


def convs_always():
    """recompute 'convs': convolutions run again in every reusing plan
    ('split': and their maps leave between backward uses, again_lives)."""
    return _setting() in ('convs', 'split')


def split_always():
    return _setting() == 'split'


def _cheap(layer):
    kind = layer.layer_param.type
    if kind == 'Pooling':
        return layer.layer_param.pooling_param.pool in _POOL_METHODS
    return kind in RECOMPUTE_TYPES


def _writers_by_blob(net):
    """{blob name: indices of the layers with it as a top} (a Split's tops
    share their bottom's memory and write nothing)."""
    out = {}
    for i, layer in enumerate(net.layers):
        if layer.layer_param.type != 'Split':
            for b in net.top_id_vecs[i]:
                out.setdefault(net._blob_names[b], []).append(i)
    return out


def _producer(net, writers, blobs, convs):
    """The layers that make a map (its writers, in order), as a tuple, if
    they may run again: one layer of RECOMPUTE_TYPES, or a convolution that
    `convs` allows (True: any; else the layer indices in it) and the
    in-place layers after it; else None."""
    if not writers:
        return None
    head = net.layers[writers[0]]
    if len(net.top_id_vecs[writers[0]]) != 1 or \
            {net._blob_names[b] for b in net.bottom_id_vecs[writers[0]]} & set(blobs):
        return None
    if len(writers) == 1 and _cheap(head):
        return tuple(writers)
    if not convs or head.layer_param.type not in CONV_TYPES or \
            (convs is not True and writers[0] not in convs):
        return None
    for i in writers[1:]:
        names = [net._blob_names[b] for b in net.bottom_id_vecs[i] + net.top_id_vecs[i]]
        if net.layers[i].layer_param.type not in IN_PLACE_AFTER or \
                len(names) != 2 or not set(names) <= set(blobs):
            return None
    return tuple(writers)


# The markers heading the producers made by elementwise passes: a normalized
# chain's (REMAKE, BatchNorm, Scale?, ReLU?), a residual sum's (REMAKE_SUM,
# Eltwise, ReLU?).
REMAKE = 'remake'
REMAKE_SUM = 'remake-sum'


def is_remake(chain):
    """Whether a producer is an elementwise pass from kept values: a
    normalized chain made again from its copy, or a residual sum."""
    return bool(chain) and chain[0] in (REMAKE, REMAKE_SUM)


def is_sum(chain):
    return bool(chain) and chain[0] == REMAKE_SUM


def layers_of(chain):
    """A producer's layer indices, in forward order."""
    return tuple(chain[1:]) if is_remake(chain) else tuple(chain)


def _normalized_chain(net, writers, blobs):
    """The layer indices (BatchNorm, Scale?, ReLU?) whose last forward leaves
    the map as relu(scale * normalized + bias) of the BatchNorm's kept copy
    (the module docstring), or None."""
    names = set(blobs)
    layers = net.layers
    at = [k for k, i in enumerate(writers) if layers[i].layer_param.type == 'BatchNorm']
    if not at:
        return None
    chain = tuple(writers[at[-1]:])
    bn = layers[chain[0]]
    if bn.scale_bias or not bn.keeps_normalized or len(net.top_id_vecs[chain[0]]) != 1 or \
            net._blob_names[net.top_id_vecs[chain[0]][0]] not in names:
        return None
    kinds = [layers[i].layer_param.type for i in chain[1:]]
    if kinds not in ([], ['Scale'], ['ReLU'], ['Scale', 'ReLU']):
        return None
    for i in chain[1:]:
        ids = net.bottom_id_vecs[i]
        if len(ids) != 1 or list(net.top_id_vecs[i]) != list(ids) or \
                net._blob_names[ids[0]] not in names:
            return None
        layer = layers[i]
        if layer.layer_param.type == 'Scale' and not (
                getattr(layer, '_per_channel', False) and
                (layer.bias_param_id is None or layer.bias_dims == layer.dims)):
            return None
    return chain


def _sum_chain(net, writers, blobs):
    """The layer indices (Eltwise, ReLU?) whose forward wrote the map: an
    Eltwise SUM of two other maps into it, then at most a ReLU in place; or None."""
    if not writers:
        return None
    names = set(blobs)
    e = writers[0]
    layer = net.layers[e]
    if layer.layer_param.type != 'Eltwise' or \
            layer.layer_param.eltwise_param.operation != _ELTWISE_SUM or \
            len(net.bottom_id_vecs[e]) != 2 or len(net.top_id_vecs[e]) != 1 or \
            {net._blob_names[b] for b in net.bottom_id_vecs[e]} & names:
        return None
    for i in writers[1:]:
        ids = net.bottom_id_vecs[i]
        if net.layers[i].layer_param.type != 'ReLU' or len(writers) > 2 or len(ids) != 1 or \
                list(net.top_id_vecs[i]) != list(ids) or net._blob_names[ids[0]] not in names:
            return None
    return tuple(writers)


def _choose_sums(net, data, writers, chosen, inputs, gone, least):
    """Add the residual sums made again (the module docstring) and the
    branch tops they make again for their step to `chosen`."""
    L = len(net.layers)
    by_blob = {n: b for b in data.values() for n in b.blobs}
    picked = {}         # sum key -> its chain (Eltwise, ReLU?)
    branch_of = {}      # branch key -> its normalized chain
    for key in sorted(data, key=lambda k: data[k].start):
        buf = data[key]
        if key in chosen or key in gone or buf.nbytes < least or \
                set(buf.blobs) & inputs or (buf.start <= 0 and buf.end >= 2 * L):
            continue
        chain = _sum_chain(net, writers(buf.blobs), buf.blobs)
        if chain is None:
            continue
        fwd, bwd = _uses(net, buf)
        if not bwd or max(fwd) + 1 >= min(bwd):
            continue
        e = chain[0]
        branches = {}
        for b in net.bottom_id_vecs[e]:
            src = by_blob.get(net._blob_names[b])
            if src is None or src.key in gone or any(w > e for w in writers(src.blobs)):
                break
            if src.key in picked:
                continue            # a sum made again first
            normalized = _normalized_chain(net, writers(src.blobs), src.blobs)
            if normalized is not None and src.key not in chosen and src.key not in branch_of \
                    and not _uses(net, src)[1] and src.end <= e:
                branches[src.key] = normalized
                continue
            if src.key not in chosen and src.end >= min(bwd) - FILTER_FIRST:
                continue            # still kept at that step
            break
        else:
            picked[key] = chain
            branch_of.update(branches)
    for key, chain in picked.items():
        chosen[key] = (REMAKE_SUM,) + chain
    for key, normalized in branch_of.items():
        chosen[key] = (REMAKE,) + normalized


def sum_lives(net, bufs, chosen):
    """{key: (start, end)} of the device life in backward of each residual
    sum made again and each branch top made again for one: a sum from half
    a step before its first backward use, or before the sum that reads it
    if that comes first, to its last use; a branch top at its sum's start alone."""
    sums = [b for b in bufs if is_sum(chosen.get(b.key))]
    if not sums:
        return {}
    by_blob = {n: b for b in bufs if b.kind == 'data' for n in b.blobs}
    start = {b.key: min(_uses(net, b)[1]) - FILTER_FIRST for b in sums}
    out = {}
    # Latest first: a sum's start is known before the sums it reads.
    for b in sorted(sums, key=lambda b: -chosen[b.key][1]):
        e = chosen[b.key][1]
        out[b.key] = (start[b.key], b.end)
        for blob_id in net.bottom_id_vecs[e]:
            src = by_blob[net._blob_names[blob_id]]
            if src.key in start:
                start[src.key] = min(start[src.key], start[b.key])
            elif is_remake(chosen.get(src.key)):
                out[src.key] = (start[b.key], start[b.key])
    return out


def choose(net, bufs, training=True, offloaded=(), convs=False, remakes_only=False):
    """{buffer key: producer layer indices} for the data buffers of `bufs`
    (liveness.buffers; what must stay readable there, `keep` included, lives
    the whole iteration) that are made again in backward (the module
    docstring's rules); empty when disabled or for forward-only plans.
    `offloaded`: keys of the buffers an offload plan moves to the host,
    which are neither made again nor inputs to what is. `convs`:
    convolutions (and their in-place ReLUs) may run again too (True: any;
    a collection of layer indices: those). `remakes_only`: only normalized
    chains' tops (plan `shared`)."""
    if not training or not (remakes_enabled() if remakes_only else enabled()):
        return {}
    if convs_always() and not remakes_only:
        convs = True
    gone = set(offloaded)
    gone_blobs = {n for b in bufs if b.key in gone for n in b.blobs}
    L = len(net.layers)
    least = MIN_SHARE * max(live_bytes_by_step(bufs, 2 * L))
    data = {b.key: b for b in bufs if b.kind == 'data'}
    by_blob = {n: b for b in data.values() for n in b.blobs}
    writers_of = _writers_by_blob(net)

    def writers(names):
        return sorted({i for n in names for i in writers_of.get(n, ())})
    producers = {}
    for key, buf in data.items():
        if key in gone or (buf.start <= 0 and buf.end >= 2 * L):
            continue        # offloaded, or kept readable the whole iteration
        normalized = _normalized_chain(net, writers(buf.blobs), buf.blobs)
        if buf.nbytes < (least * REMAKE_SHARE if normalized is not None else least):
            continue        # small
        if normalized is not None:
            fwd, bwd = _uses(net, buf)
            if bwd and max(fwd) + 1 < min(bwd):
                # (Its one input, the kept copy, lives to BatchNorm's backward,
                # after every reader of the top.)
                producers[key] = ((REMAKE,) + normalized, ())
            continue
        chain = None if remakes_only else _producer(net, writers(buf.blobs), buf.blobs, convs)
        if chain is None:
            continue
        p = chain[0]
        bottoms = [net._blob_names[b] for b in net.bottom_id_vecs[p]]
        fwd, bwd = _uses(net, buf)
        if not bwd or max(fwd) + 1 >= min(bwd):
            continue
        first_back = min(bwd)
        ok = True
        for name in bottoms:
            src = by_blob.get(name)
            if src is None or name in gone_blobs or \
                    not (src.start <= p and src.end >= first_back) or \
                    any(w > p for w in writers(src.blobs)):
                ok = False
                break
        if ok:
            producers[key] = (chain, tuple(bottoms))
    # A producer's input must hold its values when the producer runs again,
    # so of a map and its producer's input (LRN -> pooling) only one is made
    # again: the larger first.
    chosen, taken, inputs = {}, set(), set()
    for key in sorted(producers, key=lambda k: (-data[k].nbytes, k)):
        chain, bottoms = producers[key]
        if set(bottoms) & taken or set(data[key].blobs) & inputs:
            continue
        chosen[key] = chain
        taken.update(data[key].blobs)
        inputs.update(bottoms)
    _choose_sums(net, data, writers, chosen, inputs, gone, least * REMAKE_SHARE)
    return chosen


def groups(net, bufs, chosen):
    """The maps of `chosen` that stay or go together, largest bytes first:
    a residual sum with the branch tops made again for its step alone
    (they are made only for it), every other map alone."""
    data = {b.key: b for b in bufs if b.kind == 'data'}
    by_blob = {n: b for b in data.values() for n in b.blobs}
    out, served = [], set()
    for key, chain in chosen.items():
        if is_sum(chain):
            group = {key}
            for blob_id in net.bottom_id_vecs[chain[1]]:
                src = by_blob[net._blob_names[blob_id]]
                if is_remake(chosen.get(src.key)) and not is_sum(chosen[src.key]) and \
                        not _uses(net, src)[1]:
                    group.add(src.key)
            served |= group
            out.append(group)
    out += [{key} for key in chosen if key not in served]
    return sorted(out, key=lambda g: (-sum(data[k].nbytes for k in g), sorted(g)))


def prune(net, bufs, chosen, peak_of):
    """`chosen` less the maps whose making again does not lower the peak:
    each group (groups(), largest first) stays kept instead wherever
    `peak_of(chosen)` (the plan's bytes live at its busiest moment) is no
    higher without it. Making maps again lowers the peak only where they
    are live at the busiest moment; elsewhere it is time spent for nothing
    (ResNet-50's stage-5 maps), and a stage's sums made again together can
    even raise it (ResNet-50's stage 4 at batch 256: 380 MB above keeping some)."""
    if not chosen:
        return chosen
    best = peak_of(chosen)
    # Again while a pass keeps more: a map kept can leave room for another
    # (ResNet-50 FLOAT16 b256: 20 kept in the first pass, 3 in the second).
    while True:
        before = len(chosen)
        for group in groups(net, bufs, chosen):
            trial = {k: v for k, v in chosen.items() if k not in group}
            peak = peak_of(trial)
            if peak <= best:
                chosen, best = trial, peak
        if len(chosen) == before:
            return chosen


def _filter_only(net, buf, step):
    """Whether backward step `step` reads the map only in a convolution's
    filter-gradient call: one Convolution, its single bottom, in no fused
    chain. That call runs before the layer writes its bottom's diff
    (liveness.FILTER_FIRST), so the map may be gone during the rest of the
    step and come back for the next reader."""
    from caffeplus import kernels
    L = len(net.layers)
    i = 2 * L - 1 - step
    if not 0 <= i < L or i in set(kernels.chain_heads(net).values()):
        return False
    layer = net.layers[i]
    bottoms = [net._blob_names[b] for b in net.bottom_id_vecs[i]]
    tops = {net._blob_names[b] for b in net.top_id_vecs[i]}
    return layer.layer_param.type in CONV_TYPES and len(bottoms) == 1 and \
        bottoms[0] in buf.blobs and not tops & set(buf.blobs)


def again_lives(net, buf, chain, split=False):
    """(start, end) of each backward life of a map made again by `chain`:
    from half a step before its first backward use. `split`: a convolution
    chain's map leaves again after a use by a filter call alone
    (_filter_only) and comes back for the next use (VGG-16's conv1_1: gone
    while conv1_2's data call writes conv1_1's diff, back for relu1_1's
    backward; one more forward of conv1_1 and relu1_1 for 3.3 GB of room
    at b256)."""
    bwd = sorted(set(_uses(net, buf)[1]))
    split = split and not is_remake(chain) and \
        (len(chain) > 1 or net.layers[chain[0]].layer_param.type in CONV_TYPES)
    lives, start = [], bwd[0] - FILTER_FIRST
    for u, nxt in zip(bwd, bwd[1:] + [None]):
        if nxt is not None and split and _filter_only(net, buf, u):
            lives.append((start, u - FILTER_FIRST))
            start = nxt - FILTER_FIRST
    lives.append((start, buf.end))
    return lives


def splittable(net, bufs, chosen):
    """Keys of `chosen` whose maps could leave again between backward uses
    (again_lives with split), largest first."""
    out = [b for b in bufs if b.key in chosen and not is_remake(chosen[b.key]) and
           len(again_lives(net, b, chosen[b.key], split=True)) > 1]
    return [b.key for b in sorted(out, key=lambda b: (-b.nbytes, b.key))]


def shorten(bufs, chosen, net, split=()):
    """Replace each buffer made again by its device lives: until its last
    forward use, then again_lives (the first from half a step before its
    first backward use, where a filter call's workspace lies; keys in
    `split` split); keys end in 'forward', 'again', 'again2', ..."""
    if not chosen:
        return list(bufs)
    split = set(split)
    fixed = sum_lives(net, bufs, chosen)
    out = []
    for buf in bufs:
        if buf.key not in chosen:
            out.append(buf)
            continue
        fwd, bwd = _uses(net, buf)
        out.append(Buffer(buf.key + ('forward',), buf.kind, buf.blobs, buf.nbytes,
                          buf.start, max(fwd)))
        lives = [fixed[buf.key]] if buf.key in fixed else \
            again_lives(net, buf, chosen[buf.key], buf.key in split)
        for k, (start, end) in enumerate(lives):
            out.append(Buffer(buf.key + ('again' + (str(k + 1) if k else ''),), buf.kind,
                              buf.blobs, buf.nbytes, start, end))
    return out


def extra_seconds(net, bufs, chosen, step_seconds, split=()):
    """The time the producers' second (and later) forwards add to an iteration."""
    out = 0.0
    split = set(split)
    for buf in bufs:
        chain = chosen.get(buf.key)
        if chain is not None and not is_remake(chain):     # (remakes: remake_passes)
            runs = len(again_lives(net, buf, chain, buf.key in split))
            out += runs * sum(step_seconds[p] for p in chain)
    return out


def remake(net, chain):
    """Write a normalized chain's top (`chain`: BatchNorm, Scale?, ReLU?)
    from BatchNorm's kept copy as its forward did: the GPU's fused pass
    where forward ran the chain fused, else the copy as BatchNorm's top and
    the other layers' own forwards in place (their 16-bit rounding
    emulated on the CPU as after each layer's forward)."""
    bn = net.layers[chain[0]]
    fused = getattr(bn, 'remake_chain_top', None)
    if fused is not None and fused():
        return
    top = net.top_vecs[chain[0]][0]
    top.data[...] = bn._x_norm.reshape(top.data.shape)
    _forwards(net, chain[1:])


def _forwards(net, layers):
    """Run the layers' forwards again, in place, each followed by its
    emulated 16-bit rounding on the CPU (what the net's hooks do in a pass)."""
    precision = getattr(net, 'precision', None)
    for i in layers:
        net.layers[i].forward(net.bottom_vecs[i], net.top_vecs[i])
        if precision is not None:
            precision.round_forward(i)


def remake_sum(net, chain, branches=()):
    """Write a residual sum's top (`chain`: Eltwise, ReLU?) again from its
    bottoms, first making the branch tops among them again (`branches`:
    their normalized chains): on the GPU, where the forward ran so, the
    paired branch's normalize pass with the sum and its ReLU in one
    (fused_chain's remake_with_branch); else by the layers' own forwards (a
    fused Eltwise -> ReLU chain takes its one pass again), with their
    16-bit rounding emulated on the CPU."""
    eltwise = net.layers[chain[0]]
    paired = getattr(eltwise, 'paired_branch', lambda: None)()
    fusable = [b for b in branches if net.layers[b[0]] is paired]
    for b in branches:
        if b not in fusable:
            remake(net, b)
    if fusable and eltwise.remake_with_branch():
        return
    for b in fusable:
        remake(net, b)
    _forwards(net, chain)


def remake_passes(bufs, chosen):
    """(bytes moved, launches) of the elementwise passes that make maps
    again: a normalized chain's top written from its copy (two passes over
    the map), a residual sum's from its bottoms (three)."""
    moved = launches = 0
    for buf in bufs:
        chain = chosen.get(buf.key)
        if is_remake(chain):
            moved += buf.nbytes * (3 if is_sum(chain) else 2)
            launches += 1
    return moved, launches


def make_again(net, todo, workspace=None):
    """Before a backward step: write the maps first read there again into
    their lives (`todo`: [(planned storage, life)], producers in forward
    order). Branch tops that live for this step alone are made by the sum
    that reads them; a convolution's call takes its own 'again@step'
    view of the placed `workspace`."""
    branches = {id(e.storage): layers_of(e.producer) for e, life in todo
                if is_remake(e.producer) and not is_sum(e.producer) and life.end <= life.start}
    for e, life in todo:
        e.storage.array = life.view
        e.storage.released_reason = None
        if id(e.storage) in branches:
            continue
        if workspace is not None:
            workspace.again = again_view(life.start)
        try:
            _run_again(net, e.producer, branches)
        finally:
            if workspace is not None:
                workspace.again = None


def _run_again(net, producer, branches):
    chain = list(layers_of(producer))
    if is_sum(producer):
        bottoms = net.bottom_vecs[chain[0]]
        remake_sum(net, chain, [branches[id(b.data_storage)] for b in bottoms
                                if id(b.data_storage) in branches])
        return
    if is_remake(producer):
        remake(net, chain)
        return
    if bias_relu_pair(net, chain) and net.layers[chain[0]].forward_then_relu(
            net.bottom_vecs[chain[0]], net.top_vecs[chain[0]]):
        chain = chain[2:]       # the convolution and its ReLU, in one pass
    for p in chain:
        net.layers[p].forward(net.bottom_vecs[p], net.top_vecs[p])


def bias_relu_pair(net, chain):
    """Whether a chain run again starts with a cuDNN convolution and a ReLU
    (negative slope 0) in place on its top: one pass for the bias and the
    ReLU (layers/cudnn_conv.py forward_then_relu)."""
    if len(chain) < 2 or not hasattr(net.layers[chain[0]], 'forward_then_relu'):
        return False
    relu = net.layers[chain[1]]
    return relu.layer_param.type == 'ReLU' and \
        relu.layer_param.relu_param.negative_slope == 0 and \
        net.top_id_vecs[chain[1]] == net.bottom_id_vecs[chain[1]] == net.top_id_vecs[chain[0]]


def workspace_buffers(net, lives, chosen, sizes):
    """Workspace for the convolutions run again: each run gets its forward
    call's bytes (`sizes`: {layer index: (forward bytes, ...)}) at the step
    its map comes back, half a step early like that map's second life
    (`lives`: shorten's buffers), apart from everything live then."""
    out = []
    for p, b in reruns(net, lives, chosen):
        nbytes = int(sizes.get(p, (0,))[0] or 0)
        if nbytes:
            out.append(Buffer(('workspace', net._layer_names[p], again_view(b.start)),
                              'workspace', (), nbytes, b.start, b.start))
    return out


def reruns(net, lives, chosen):
    """(layer index, life) of every convolution forward run again: each
    convolution of a chosen chain, at the start of each of its map's
    backward lives (`lives`: shorten's buffers)."""
    for b in lives:
        if str(b.key[-1]).startswith('again') and b.key[:-1] in chosen and \
                not is_remake(chosen[b.key[:-1]]):
            for p in chosen[b.key[:-1]]:
                if net.layers[p].layer_param.type in CONV_TYPES:
                    yield p, b


def again_view(start):
    """The placed workspace's view name of a convolution run again for a
    life starting at `start` (caffeplus.memory.workspace.PlacedWorkspace)."""
    import math
    return 'again@%d' % int(math.ceil(start))
