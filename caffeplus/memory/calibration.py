"""Measured convolution algorithms for plan `auto`'s search.

The workspace model (caffeplus.memory.workspace_model) offers a handful of
generic candidates per convolution call; cuDNN's real ones differ a lot.
VGG-16 b256's conv1_2 backward-data runs 39.5 ms with no workspace, 20.4 ms
in 51 MiB and 16.4 ms in 289 MiB (H100, cuDNN 9.19), where the model knew
only "none" and "6.6 GB". Under a tight budget those few hundred MiB decide
where the bytes should go, so `auto` plans with measured candidates where
it has them:

* on the GPU, plan auto times every convolution the table lacks before it
  plans (measure_net; MEASURE_BEFORE_PLANNING = False turns that off), and every
  call site the runtime times (FindEx, caffeplus.memory.workspace) is
  recorded for the rest of the process;
* a table saved with `save` (tools/dump_algorithms.py --calibration FILE)
  can be loaded anywhere,
  including the CPU-only machine (the calibration setting, caffeplus.config:
  `--calibration FILE`, caffeplus_param.calibration or CAFFEPLUS_CALIBRATION).

A table is keyed by the call's geometry (batch, channels, map, filter,
stride, pad, dilation, groups) and kind (fwd, bwd_data, bwd_filter); each
entry is the (workspace bytes, seconds) pairs worth having: a candidate
needing more bytes than another is kept only if it is faster by more than
PRUNE_TOLERANCE.
"""
import contextlib
import json
import math
import os

from caffeplus.errors import CaffeplusError

KINDS = ('fwd', 'bwd_data', 'bwd_filter')
FORMAT = 'caffeplus-cudnn-calibration-1'
# A bigger workspace must buy at least this share of time to be weighed.
PRUNE_TOLERANCE = 0.02
# Plan auto times the convolutions the table lacks on the GPU before it
# plans; False plans with the model's candidates, or a loaded table's, alone.
MEASURE_BEFORE_PLANNING = True

_table = {}             # geometry key -> {kind: [(bytes, seconds), ...]}
_env_loaded = [None]    # the calibration setting's file already read
_in_use = [0]           # > 0 while the model consults the table (applied())


def geometry_key(layer):
    """The string that names one convolution's calls for the table."""
    g = layer.geom
    kind = 'deconv' if getattr(layer, 'reverse', False) else 'conv'
    return '%s n%d c%d in%s out%d k%s s%s p%s d%s g%d' % (
        kind, int(layer.num), int(layer.channels), 'x'.join(map(str, layer.in_spatial)),
        int(layer.num_output), 'x'.join(map(str, g.kernel)), 'x'.join(map(str, g.stride)),
        'x'.join(map(str, g.pad)), 'x'.join(map(str, g.dilation)), int(layer.group))


def prune(pairs):
    """The (bytes, seconds) pairs worth weighing, by bytes ascending: each
    faster than every smaller one by more than PRUNE_TOLERANCE."""
    out = []
    for nbytes, seconds in sorted(pairs, key=lambda p: (p[0], p[1])):
        if not out or seconds < out[-1][1] * (1 - PRUNE_TOLERANCE):
            out.append((int(nbytes), float(seconds)))
    return out


def add(key, kind, pairs):
    """Record measured (bytes, seconds) pairs of one call site (merged with
    what the table has: the faster time at each size)."""
    if kind not in KINDS:
        raise CaffeplusError('calibration: unknown call kind %r (one of %s)'
                             % (kind, ', '.join(KINDS)))
    pairs = [(int(b), float(t)) for b, t in pairs if t is not None and t > 0]
    if not pairs:
        return
    entry = _table.setdefault(key, {})
    entry[kind] = prune(list(entry.get(kind, ())) + pairs)


def record(layer, kind, choices):
    """Record cuDNN's timed candidates (caffeplus.cudnn.api.AlgoChoice:
    `memory` bytes, `time` ms) of one call site of `layer`. `kind` is
    cuDNN's; the table keeps the call's part in the layer (its forward,
    backward-data or backward-filter call), as the workspace model names
    them: a Deconvolution's forward runs cuDNN's backward-data."""
    from caffeplus.memory.call_sites import view_part
    add(geometry_key(layer), KINDS[view_part(layer, kind)],
        [(c.memory, None if c.time is None else c.time / 1e3) for c in choices])


def lookup(layer, kind):
    """The measured (bytes, seconds) pairs of `layer`'s `kind` call, or None
    (not measured, or the table not in use: applied())."""
    if not _in_use[0]:
        return None
    _load_env()
    entry = _table.get(geometry_key(layer))
    return entry.get(kind) if entry else None


def in_use():
    """Whether the model uses the table now (inside applied())."""
    return _in_use[0] > 0


def covers(layer):
    """Whether every call kind of `layer` is measured (and the table in use)."""
    return all(lookup(layer, k) for k in KINDS)


@contextlib.contextmanager
def applied():
    """Let the workspace model use the table inside this block (plan
    `auto`'s search); elsewhere the estimates stay the model's own."""
    _in_use[0] += 1
    try:
        yield
    finally:
        _in_use[0] -= 1


def clear():
    _table.clear()
    _env_loaded[0] = None


def entries():
    return len(_table)


def to_dict(device=None):
    return {'format': FORMAT, 'device': device,
            'sites': {key: {k: [list(p) for p in v] for k, v in sorted(entry.items())}
                      for key, entry in sorted(_table.items())}}


def save(path, device=None):
    """Write the table as JSON (a temporary file, then renamed)."""
    tmp = '%s.tmp%d' % (path, os.getpid())
    with open(tmp, 'w') as f:
        json.dump(to_dict(device), f, sort_keys=True)
        f.write('\n')
    os.replace(tmp, path)


def load(path):
    """Merge a saved table into this process's."""
    try:
        with open(path) as f:
            doc = json.load(f)
    except OSError as e:
        raise CaffeplusError('calibration file %s: %s' % (path, e.strerror or e))
    except ValueError as e:
        raise CaffeplusError('calibration file %s: not JSON (%s)' % (path, e))
    if not isinstance(doc, dict) or doc.get('format') != FORMAT or \
            not isinstance(doc.get('sites'), dict):
        raise CaffeplusError("calibration file %s: not a caffeplus calibration table "
                             "(expected {'format': '%s', 'sites': {...}})" % (path, FORMAT))
    for key, entry in doc['sites'].items():
        for kind, pairs in entry.items():
            if kind not in KINDS:
                raise CaffeplusError('calibration file %s: site %r: unknown call kind %r '
                                     '(one of %s)' % (path, key, kind, ', '.join(KINDS)))
            try:
                add(key, kind, [(b, t) for b, t in pairs])
            except (TypeError, ValueError):
                raise CaffeplusError('calibration file %s: site %r, %s: expected '
                                     '[[bytes, seconds], ...]' % (path, key, kind))
    return len(doc['sites'])


# Timing leaves this much of the device (and of a budget) free besides its
# scratch arrays and workspace: cuDNN's own allocations while it times.
MEASURE_MARGIN = 256 * 2 ** 20


def measuring():
    """Whether plan auto times the convolutions on the GPU before planning
    (MEASURE_BEFORE_PLANNING)."""
    return MEASURE_BEFORE_PLANNING


def trial_array_bytes(layer):
    """Device bytes of the arrays a timed search of `layer` makes beside its
    workspace (cudnn/algo_search.py _ConvDescs.timer: input, output and filter,
    and for the cuBLAS variant a filter gradient)."""
    maps = layer.num * (layer.channels * math.prod(layer.in_spatial) +
                        layer.num_output * math.prod(layer.out_spatial))
    return 4 * (maps + 2 * layer.blobs[0].count)


def process_device_bytes(pool):
    """This process's device memory now, as far as it can be told from
    inside it: CuPy's pool, and the device's other used memory up to the
    runtime's modelled fixed cost (CUDA context, cuDNN and cuBLAS; what
    is used beyond it belongs to other processes on the card)."""
    import cupy
    from caffeplus.memory import fixed_cost
    free, total = cupy.cuda.runtime.memGetInfo()
    held = pool.total_bytes()
    return held + min(max(total - free - held, 0), fixed_cost.RUNTIME_BYTES)


def trial_workspace_bytes(arrays, budget=None):
    """The workspace a timed search may take beside `arrays` bytes of trial
    arrays: what the device has free and, under `budget` (the process's
    whole device memory), what the budget leaves beside what the process
    holds now; both less MEASURE_MARGIN. None: the arrays alone would not
    fit (the call is not timed; the model's candidates stand)."""
    import cupy
    pool = cupy.get_default_memory_pool()
    pool.free_all_blocks()
    free = cupy.cuda.runtime.memGetInfo()[0]
    if pool.get_limit():            # a pool limited as a smaller card (tools)
        free = min(free, pool.get_limit() - pool.total_bytes())
    room = free
    if budget is not None:
        room = min(room, int(budget) - process_device_bytes(pool))
    room -= arrays + MEASURE_MARGIN
    return None if room < 0 else int(room)


def measure_net(net, limit=None):
    """On the GPU: time every cuDNN convolution of `net` whose geometry the
    table lacks (FindEx, as the timed search does) and record it, each in
    a workspace as large as the device spares beside the call's own
    arrays; `limit`: the process's memory budget, which the search, its
    arrays and what the process already holds stay within together
    (trial_workspace_bytes). A convolution whose arrays would not fit is
    left untimed. Returns the number of geometries timed. Plan auto calls
    it before planning (caffeplus.memory.apply)."""
    import cupy
    timed = 0
    pool = cupy.get_default_memory_pool()
    for layer in net.layers:
        if not layer.can_time_calls():
            continue
        key = geometry_key(layer)
        if key in _table and all(k in _table[key] for k in KINDS):
            continue
        nbytes = trial_workspace_bytes(trial_array_bytes(layer), limit)
        if nbytes is None:
            continue
        ws = cupy.empty(nbytes, dtype=cupy.uint8) if nbytes else None
        try:
            found = layer.time_calls(ws.data.ptr if ws is not None else 0, nbytes)
        finally:
            del ws
            pool.free_all_blocks()      # the pool keeps no trial block as reserved memory
        for kind, choices in found.items():
            record(layer, kind, choices or ())
        timed += 1
    return timed


def _load_env():
    """Load the calibration setting's file (once per file)."""
    from caffeplus import config
    path = config.get('calibration')
    if path and _env_loaded[0] != path:
        load(path)
        _env_loaded[0] = path
