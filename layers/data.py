"""Data layers: Input, DummyData, Data, ImageData, MemoryData (HDF5Data and
HDF5Output: layers/hdf5_data.py).

Data and ImageData load their batches ahead in a background thread, the
prefetch coordinator (Caffe's prefetch: data_param.prefetch batches, default
4). For each batch the coordinator picks the records in order (database
cursor, list position, shuffles, the rank's shard), hands their reading and
decoding to the layer's worker threads (caffeplus.io.workers: data_workers,
by default one per core), then draws the batch's random decisions (mirror,
crop offsets) image by image in record order, and transforms the whole
batch at once (caffeplus.io.batch_transform), again split over the workers.
The order is fixed by the seed, not by thread timing: every random decision
comes from generators that belong to the layer, seeded from caffeplus.rng at
setup, and only the coordinator draws from them, batch after batch; the
workers draw nothing, so any number of workers gives the same batches.
`get_state()` gives the position after the last batch a forward returned
(database cursor or list position, generator states) as plain Python values
(JSON-serialisable); `set_state()` restores it, so a resumed run reads on
exactly where the snapshot was taken. `set_shard(rank,
world)` (Data, ImageData, HDF5Data) makes a layer read one rank's share of the
records for data-parallel training (caffeplus.parallel).

WindowData (R-CNN window files) lives in layers/window_data.py.
"""
import copy
import os
import queue
import time
import weakref

import numpy

from caffeplus import backend, log, rng
from caffeplus.errors import CaffeplusError, NetError
from caffeplus.fillers import device_recipe, fill, fill_array, fill_device
from caffeplus.io import datum as datum_io
from caffeplus.io.prefetch import Batch, Prefetcher
from caffeplus.io import db as db_io
from caffeplus.io import workers as workers_io
from caffeplus.io.transformer import DataTransformer, from_layer_param
from caffeplus.memory import scratch
from caffeplus.layer import Layer, register
from caffeplus.proto import caffe_pb2


@register
class InputLayer(Layer):
    """Net inputs: tops of fixed shape that the user fills."""
    type = 'Input'
    exact_num_bottom = 0
    min_num_top = 1
    has_backward = False

    def layer_setup(self, bottom, top):
        shapes = self.layer_param.input_param.shape
        if len(shapes) not in (1, len(top)):
            raise NetError('layer %s: input_param must give one shape, or one per top '
                           '(%d shapes for %d tops)' % (self.name, len(shapes), len(top)))
        for i, t in enumerate(top):
            t.reshape(tuple(shapes[0 if len(shapes) == 1 else i].dim))

    def reshape(self, bottom, top):
        pass

    def _forward(self, bottom, top):
        pass

    def _backward(self, top, propagate_down, bottom):
        pass


# True: DummyData draws on the host in GPU mode too, as stock Caffe does (a
# GPU run then sees a CPU run's numbers; slower).
DUMMYDATA_ON_HOST = False


@register
class DummyDataLayer(Layer):
    """Tops filled by fillers; constant fillers are filled once (as Caffe).

    On the GPU the per-forward refill is drawn on the device, into each
    top's own array (caffeplus.fillers.fill_device: no host draw, no copy,
    no allocation); fillers without a device form, and the CPU, fill on the
    host with fill_array as before."""
    type = 'DummyData'
    exact_num_bottom = 0
    min_num_top = 1
    has_backward = False

    def layer_setup(self, bottom, top):
        p = self.layer_param.dummy_data_param
        num_top = len(top)
        legacy = len(p.num) or len(p.channels) or len(p.height) or len(p.width)
        if legacy:
            if len(p.shape):
                raise NetError('layer %s: both shape and num/channels/height/width given'
                               % self.name)
            for field in ('num', 'channels', 'height', 'width'):
                if len(getattr(p, field)) not in (1, num_top):
                    raise NetError('layer %s: dummy_data_param.%s must be given once or once '
                                   'per top' % (self.name, field))
            pick = lambda f, i: getattr(p, f)[0 if len(getattr(p, f)) == 1 else i]
            shapes = [(pick('num', i), pick('channels', i), pick('height', i), pick('width', i))
                      for i in range(num_top)]
        else:
            if len(p.shape) not in (1, num_top):
                raise NetError('layer %s: dummy_data_param.shape must be given once or once '
                               'per top (%d for %d tops)' % (self.name, len(p.shape), num_top))
            shapes = [tuple(p.shape[0 if len(p.shape) == 1 else i].dim) for i in range(num_top)]
        if len(p.data_filler) not in (0, 1, num_top):
            raise NetError('layer %s: dummy_data_param.data_filler must be given 0, 1 or once '
                           'per top times' % self.name)
        default = caffe_pb2.FillerParameter(type='constant', value=0)
        self.fillers = [p.data_filler[0 if len(p.data_filler) == 1 else i]
                        if len(p.data_filler) else default for i in range(num_top)]
        self.refill = [f.type != 'constant' for f in self.fillers]
        self._tops = list(top)
        for t, shape, f, refill in zip(top, shapes, self.fillers, self.refill):
            t.reshape(shape)
            # As Caffe: constants are written once, here; random tops are
            # drawn by every forward, so a draw now would be thrown away
            # (their storage is made now, as zeros: virtual in a shape-only
            # build, as every top there).
            if refill:
                t.data
            else:
                fill(t, f)

    def reshape(self, bottom, top):
        pass

    def _staged_count(self):
        """Values of the float32 draw a 16-bit top is rounded from on the
        device (caffeplus.fillers.fill_device), the largest such top's: one
        buffer serves the tops in turn."""
        return max([t.count for t, f, refill in zip(self._tops, self.fillers, self.refill)
                    if refill and t.data_storage.dtype.itemsize < 4 and
                    device_recipe(f, t.shape) is not None] + [0])

    def _draws_on_device(self):
        return backend.mode() == backend.GPU and not DUMMYDATA_ON_HOST

    def internal_buffers(self):
        """The float32 draw of 16-bit tops: needed during this forward alone
        (no backward), so a reusing plan lends its bytes to later buffers."""
        count = self._staged_count() if self._draws_on_device() else 0
        return {'fill staging': (count, numpy.float32)} if count else {}

    def gpu_internal_bytes(self):
        return 4 * self._staged_count()

    def _forward(self, bottom, top):
        on_device = self._draws_on_device()
        staged = self._staged_count() if on_device else 0
        staging = scratch.get(self, 'fill staging', staged, numpy.float32, backend.xp()) \
            if staged else None
        for t, f, refill in zip(top, self.fillers, self.refill):
            if not refill:
                continue
            if not (on_device and fill_device(device_recipe(f, t.shape), t.data, staging)):
                t.data = fill_array(f, t.shape)

    def _backward(self, top, propagate_down, bottom):
        pass


# -- prefetching machinery -----------------------------------------------------
def _seed_from_global():
    """A 32-bit seed drawn from caffeplus.rng (Caffe's caffe_rng_rand())."""
    return int(rng.get().integers(0, 2 ** 32, dtype=numpy.uint64))


def _generator(seed):
    return numpy.random.Generator(numpy.random.PCG64(seed))


# True: Data and ImageData transform on the host in GPU mode too (the
# float32 batch is then copied to the device), for comparison.
TRANSFORM_ON_HOST = False

# The net waiting for its data longer than this share of the time between
# two forward passes (an iteration, with iter_size 1) is worth a warning: the
# data layer, not the net, then sets the pace.
DATA_WAIT_WARN_FRACTION = 0.10
# Forwards over which that share is measured, so that single stalls (a pass
# wrapping around, a test run in between) average out.
DATA_WAIT_WINDOW = 50
# While the waiting persists the warning repeats, at most once in this many
# forwards.
DATA_WAIT_WARN_EVERY = 5000


class DataTiming:
    """A prefetching data layer's times: what its forwards waited for batches,
    and what the coordinator spent reading/decoding and transforming them.

    Totals (wait_s, read_s, transform_s over `forwards` forwards) feed
    `caffeplus time`; a window of recent forwards feeds the warning that the
    net waits for data (warn_if_starved)."""

    def __init__(self, layer):
        self.layer_name = layer.name
        self.workers = getattr(layer, 'data_workers', 1)
        self.reset()
        self._last_end = None
        self._window = [0, 0.0, 0.0, 0.0]     # forwards, waited, interval, batch load
        self._since_warning = None

    def reset(self):
        """Zero the totals (caffeplus time, after its warm-up pass)."""
        self.forwards = 0
        self.wait_s = self.read_s = self.transform_s = 0.0

    def record(self, started, waited, batch):
        ended = started + waited
        self.forwards += 1
        self.wait_s += waited
        load = getattr(batch, 'read_s', 0.0) + getattr(batch, 'transform_s', 0.0)
        self.read_s += getattr(batch, 'read_s', 0.0)
        self.transform_s += getattr(batch, 'transform_s', 0.0)
        if self._since_warning is not None:
            self._since_warning += 1
        if self._last_end is not None:
            # From the end of one forward's wait to the end of the next: one
            # iteration of the net, waiting included.
            w = self._window
            w[0] += 1
            w[1] += waited
            w[2] += ended - self._last_end
            w[3] += load
            if w[0] >= DATA_WAIT_WINDOW:
                self.warn_if_starved(*w)
                self._window = [0, 0.0, 0.0, 0.0]
        self._last_end = ended

    def warn_if_starved(self, forwards, waited, interval, load):
        if interval <= 0 or waited <= DATA_WAIT_WARN_FRACTION * interval:
            return False
        if self._since_warning is not None and self._since_warning < DATA_WAIT_WARN_EVERY:
            return False
        self._since_warning = 0
        log.warning('Data layer %s is slowing the net down: it waited %.1f ms for each '
                    'batch, %.0f%% of the %.1f ms between its forward passes (last %d '
                    'batches); a batch takes %.1f ms to read, decode and transform with %d '
                    'data worker%s. %s',
                    self.layer_name, 1e3 * waited / forwards, 100.0 * waited / interval,
                    1e3 * interval / forwards, forwards, 1e3 * load / forwards, self.workers,
                    '' if self.workers == 1 else 's', self._advice())
        return True

    def _advice(self):
        cores = workers_io.host_cores()
        if self.workers < cores:
            return ('More workers may help: --data_workers N or caffeplus_param '
                    '{ data_workers: N } (this host has %d cores).' % cores)
        return ('The workers already match this host\'s %d cores (--data_workers, '
                'caffeplus_param { data_workers: N }): the input is bound by the CPU here; '
                'raw Datums decode faster than encoded ones.' % cores)

    def summary_lines(self):
        """Lines for caffeplus time: mean times per forward, in ms."""
        n = max(self.forwards, 1)
        return ['%10s\tprefetch wait: %g ms.' % (self.layer_name, 1e3 * self.wait_s / n),
                '%10s\tread and decode: %g ms, transform: %g ms (a batch, in the prefetch '
                'thread, %d data worker%s).'
                % (self.layer_name, 1e3 * self.read_s / n, 1e3 * self.transform_s / n,
                   self.workers, '' if self.workers == 1 else 's')]


class BasePrefetchingDataLayer(Layer):
    """Shared by Data and ImageData: a transformer, a source, a prefetch thread
    and worker threads.

    Subclasses implement make_source(top), which opens the input, shapes the
    tops and returns an object with load_batch(), state(), restore(state) and
    close(). A source may spread its work over self.workers (a
    caffeplus.io.workers.WorkerPool of self.data_workers threads, made
    before make_source is called) and report its times in the Batch.
    """
    exact_num_bottom = 0
    min_num_top = 1
    max_num_top = 2
    has_backward = False
    backward_reads = frozenset()
    legacy_transform_field = None

    def layer_setup(self, bottom, top):
        self.output_labels = len(top) != 1
        legacy = getattr(self.layer_param, self.legacy_transform_field) \
            if self.legacy_transform_field else None
        self.transformer = DataTransformer(from_layer_param(self.layer_param, legacy),
                                           self.phase, self.name)
        self.transformer.init_rand()
        self.data_workers = workers_io.resolve()
        self.workers = workers_io.WorkerPool(self.data_workers, self.name)
        try:
            self.source = self.make_source(top)
        except BaseException:
            self.workers.close()
            raise
        self._consumed_state = self.source.state()
        self.stager = self._device_stager()
        self._prefetcher = Prefetcher(self.source, self.layer_param.data_param.prefetch,
                                       self.name, self.workers)
        self.timing = DataTiming(self)
        # Stop the threads when the layer goes away (they hold no reference
        # to the layer, only to its source and pool).
        self._finalizer = weakref.finalize(self, _close_source, self._prefetcher, self.source,
                                           self.workers)

    def net_ready(self):
        """Prefetching starts once the whole net is built (or at the first
        forward of a layer used alone): a thread started earlier would take
        the interpreter's lock from the layers still being set up."""
        self._prefetcher.start()

    def make_source(self, top):
        raise NotImplementedError

    def _device_stager(self):
        """In GPU mode, the stager that sends the source's uint8 batches to
        the device (None on the CPU, or for a source without fixed-shape
        batches). Each process (a data-parallel rank) stages for its own
        device."""
        buffers = getattr(self.source, 'buffers', None)
        if backend.mode() != backend.GPU or buffers is None:
            return None
        if TRANSFORM_ON_HOST:
            return None
        from caffeplus.io.device_transform import DeviceStager
        buffers.stager = DeviceStager(backend.device(), buffers.raw.shape)
        return buffers.stager

    def reshape(self, bottom, top):
        pass

    def _forward(self, bottom, top):
        started = time.perf_counter()
        batch = self._prefetcher.next()
        self.timing.record(started, time.perf_counter() - started, batch)
        top[0].reshape(batch.data.shape)
        if isinstance(batch.data, numpy.ndarray):
            top[0].data = batch.data
        elif backend.mode() == backend.GPU:
            self.stager.transform(batch.data, top[0].data)
        else:
            top[0].data = self.stager.to_host(batch.data)
        if self.output_labels:
            top[1].reshape(batch.label.shape)
            top[1].data = batch.label
        self._consumed_state = batch.state
        # The top holds its own copy now (Blob assignment copies): the
        # source may refill this batch's array.
        recycle = getattr(self.source, 'recycle', None)
        if recycle is not None:
            recycle(batch.data)

    def _backward(self, top, propagate_down, bottom):
        pass

    # -- resuming ----------------------------------------------------------
    def get_state(self):
        """Where the next forward reads from: plain values (JSON-serialisable)."""
        state = copy.deepcopy(self._consumed_state)
        state['type'] = self.type
        return state

    def set_state(self, state):
        """Continue from a state get_state() gave (drops batches loaded ahead)."""
        if state.get('type', self.type) != self.type:
            raise CaffeplusError('layer %s: cannot restore a %s layer state into a %s layer'
                                 % (self.name, state.get('type'), self.type))
        self._stop_prefetching()
        self.source.restore(state)
        self._consumed_state = copy.deepcopy(self.source.state())
        self._prefetcher.start()

    def _stop_prefetching(self):
        """Stop the prefetch thread; the device slots of the batches it
        loaded ahead (dropped) are free again."""
        self._prefetcher.stop()
        if self.stager is not None:
            self.stager.reclaim()

    # The solver's snapshot sidecar calls these.
    snapshot_state = get_state
    restore_state = set_state

    def set_shard(self, rank, world):
        """Read only rank `rank`'s share of the records (data-parallel
        training, caffeplus.parallel): as Caffe's DataLayer::Skip with
        solver_rank/solver_count, of every `world` consecutive records the
        rank-th goes to this rank, counted from the start of each batch; a
        batch ends past its `batch_size x world` records on every rank, so
        the ranks' positions (get_state) agree after each batch. Prefetching
        restarts from the position the last forward left."""
        rank, world = _check_shard(self, rank, world)
        self._stop_prefetching()
        self.source.restore(self._consumed_state)
        self.source.shard = (rank, world)
        self._prefetcher.start()

    def close(self):
        """Stop the prefetch thread and close the input."""
        finalizer = getattr(self, '_finalizer', None)
        if finalizer is not None:
            finalizer()


def _close_source(prefetcher, source, pool=None):
    def close():
        if pool is not None:
            pool.close()
        source.close()
    prefetcher.stop(then=close)


def _close_stager(buffers):
    stager = getattr(buffers, 'stager', None)
    if stager is not None:
        stager.close()


def _check_shard(layer, rank, world):
    rank, world = int(rank), int(world)
    if world < 1 or not 0 <= rank < world:
        raise CaffeplusError('layer %s: shard rank %d of %d is out of range'
                             % (layer.name, rank, world))
    return rank, world


# -- Data ----------------------------------------------------------------------
class _BatchBuffers:
    """A source's reusable batch memory: one uint8 N x C x H x W buffer the
    workers decode into (the coordinator builds one batch at a time), and
    float32 output arrays handed back once the layer has copied them into
    its top (Blob assignment copies, as Caffe's forward copies the prefetched
    batch). Reuse spares the page faults of fresh 40 MB arrays per batch.

    On the GPU a DeviceStager (caffeplus.io.device_transform) owns the
    uint8 buffers instead: pinned host memory, two in turn, so that a
    batch's copy to the device can run while the next one is decoded."""

    def __init__(self, batch_size, shape):
        self.raw = numpy.empty((batch_size,) + tuple(shape), dtype=numpy.uint8)
        self.stager = None
        self._free = queue.SimpleQueue()

    def begin(self):
        """The uint8 buffer the next batch is decoded into."""
        if self.stager is not None:
            self.raw = self.stager.host_buffer()
        return self.raw

    def output(self, shape):
        while True:
            try:
                out = self._free.get_nowait()
            except queue.Empty:
                return numpy.empty(shape, dtype=numpy.float32)
            if out.shape == tuple(shape):
                return out

    def recycle(self, array):
        self._free.put(array)


def _decode_batch(pool, decode, items, buffers):
    """Decode `items` on the workers, each image straight into its slot of
    buffers.raw when it has the batch's shape and is uint8. Returns (arrays,
    labels, whats) with arrays None when every image went into raw."""
    raw = buffers.begin()

    def into_slot(indexed):
        i, item = indexed
        pixels, label, what = decode(item)
        if pixels.shape == raw.shape[1:] and pixels.dtype == numpy.uint8:
            raw[i] = pixels
            return None, label, what
        return pixels, label, what
    decoded = pool.map_chunked(into_slot, enumerate(items))
    pixels, labels, whats = zip(*decoded)
    if all(p is None for p in pixels):
        return None, labels, whats
    return [raw[i] if p is None else p for i, p in enumerate(pixels)], labels, whats


def _transform_decoded(transformer, arrays, whats, buffers, pool, top_shape):
    """The float32 batch on the host; or, with a device stager, the batch's
    plan (drawn as the host path draws it) and the uint8 batch on their way
    to the device, where the layer's forward transforms them. Float pixels
    and images of differing shapes (arrays not None) keep the per-image
    host path."""
    if arrays is None:
        if buffers.stager is not None:
            plan = transformer.plan_stacked(buffers.raw.shape, whats[0])
            return buffers.stager.send(buffers.raw, plan)
        return transformer.transform_stacked(buffers.raw, buffers.output(top_shape), whats[0],
                                             pool)
    return transformer.transform_batch(arrays, whats=whats, pool=pool)


class _BatchSource:
    """What Data's and ImageData's sources share: the batch buffers and a
    batch's load (items read and decoded by the pool, then transformed).
    A source gives `_next_items()` (this rank's items of the next batch),
    `_decode_item(item)` -> (label, array, what) and `state()`."""
    output_labels = True

    def use_shape(self, shape, top_shape):
        """Items of C x H x W `shape` (the first one's) make top_shape batches."""
        self.buffers = _BatchBuffers(self.batch_size, shape)
        self.top_shape = top_shape

    def recycle(self, data):
        if isinstance(data, numpy.ndarray):
            self.buffers.recycle(data)

    def load_batch(self):
        started = time.perf_counter()
        arrays, labels, whats = _decode_batch(self.pool, self._decode_item, self._next_items(),
                                              self.buffers)
        read = time.perf_counter()
        data = _transform_decoded(self.transformer, arrays, whats, self.buffers, self.pool,
                                  self.top_shape)
        label = numpy.asarray(labels, dtype=numpy.float32) if self.output_labels else None
        return Batch(data, label, self.state(), read - started, time.perf_counter() - read)


class _DatabaseSource(_BatchSource):
    """Datum records in key order: the coordinator reads the records (and
    skips other ranks' shares), the workers parse and decode them."""

    def __init__(self, name, dparam, transformer, output_labels, batch_size, pool=None):
        self.name = name
        self.transformer = transformer
        self.output_labels = output_labels
        self.batch_size = batch_size
        self.pool = pool or workers_io.WorkerPool(1)
        self.path = dparam.source
        self.shard = (0, 1)     # (rank, world): see set_shard
        kind = db_io.backend_name(dparam.backend)
        self.reader = db_io.RecordReader(self.path, kind, in_place=True)
        if dparam.cache or dparam.shuffle:
            # NVCaffe's cache / shuffle; shuffling reads from the cache, so it
            # implies it.
            rng = _generator(_seed_from_global()) if dparam.shuffle else None
            self.reader = db_io.CachedRecordReader(self.reader, dparam.shuffle, rng)
        if dparam.rand_skip:
            skip = _seed_from_global() % dparam.rand_skip
            log.info('Skipping first %d data points.', skip)
            for _ in range(skip):
                self.reader.advance()

    def _what(self, key):
        return 'datum %s of %s' % (key.decode('utf-8', 'replace'), self.path)

    def decode(self, record):
        """(pixels C x H x W, label, description) of one (key, value) record."""
        key, value = record
        what = self._what(key)
        datum = datum_io.read_datum(value, key, self.path)
        # Not made contiguous: the workers copy the pixels into the batch.
        pixels = self.transformer.datum_array(datum, key, what=what, contiguous=False)
        return pixels, datum.label, what

    def peek_array(self):
        key, value = self.reader.current()
        datum = datum_io.read_datum(value, key, self.path)
        what = self._what(key)
        return datum, self.transformer.datum_array(datum, key, what=what), what

    def _skip(self, n):
        for _ in range(n):
            self.reader.advance()

    def _next_items(self):
        records = []
        rank, world = self.shard
        for i in range(self.batch_size):
            self._skip(rank if i == 0 else world - 1)
            records.append(self.reader.current())
            self.reader.advance()
        self._skip(world - 1 - rank)
        return records

    def _decode_item(self, record):
        return self.decode(record)

    def state(self):
        return {'reader': self.reader.state(), 'transformer': self.transformer.get_state()}

    def restore(self, state):
        self.reader.restore(state['reader'])
        self.transformer.set_state(state.get('transformer'))

    def close(self):
        _close_stager(getattr(self, 'buffers', None))
        self.reader.close()


def _positive_batch_size(layer, value, field):
    if value <= 0:
        raise NetError('layer %s (%s): %s must be positive (got %d)'
                       % (layer.name, layer.type, field, value))
    return int(value)


@register
class DataLayer(BasePrefetchingDataLayer):
    """Datum records from an LMDB or LevelDB (data_param), in key order."""
    type = 'Data'
    legacy_transform_field = 'data_param'

    def make_source(self, top):
        dp = self.layer_param.data_param
        batch_size = _positive_batch_size(self, dp.batch_size, 'data_param.batch_size')
        if not dp.source:
            raise NetError('layer %s (Data): data_param.source is not set' % self.name)
        try:
            source = _DatabaseSource(self.name, dp, self.transformer, self.output_labels,
                                     batch_size, self.workers)
        except CaffeplusError as exc:
            raise CaffeplusError('layer %s (Data): %s' % (self.name, exc)) from exc
        try:
            datum, arr, what = source.peek_array()
            if not datum.encoded and (self.transformer.param.force_color or
                                      self.transformer.param.force_gray):
                log.error('force_color and force_gray only for encoded datum')
            shape = self.transformer.infer_shape(arr.shape, what)
        except BaseException:
            source.close()
            raise
        top[0].reshape((batch_size,) + shape)
        log.info('output data size: %d,%d,%d,%d', batch_size, *shape)
        if self.output_labels:
            top[1].reshape((batch_size,))
        source.use_shape(arr.shape, (batch_size,) + shape)
        return source


# -- ImageData -----------------------------------------------------------------
def read_image_list(path, layer_name=''):
    """[(path, label, line number)] from a '<path> <label>' list file."""
    who = 'layer %s: ' % layer_name if layer_name else ''
    try:
        with open(path, 'r', encoding='utf-8', errors='surrogateescape') as f:
            text = f.read()
    except FileNotFoundError:
        raise CaffeplusError('%simage list file not found: %s' % (who, path))
    except OSError as exc:
        raise CaffeplusError('%scannot read image list file %s: %s'
                             % (who, path, exc.strerror or exc))
    lines = []
    for lineno, line in enumerate(text.splitlines(), 1):
        line = line.strip()
        if not line:
            continue
        parts = line.rsplit(None, 1)
        try:
            if len(parts) != 2:
                raise ValueError
            label = int(parts[1])
        except ValueError:
            raise CaffeplusError("%sline %d of image list %s: expected '<image path> <integer "
                                 "label>', got '%s'" % (who, lineno, path, line))
        lines.append((parts[0], label, lineno))
    if not lines:
        raise CaffeplusError('%simage list file %s is empty' % (who, path))
    return lines


class _ImageListSource(_BatchSource):
    """Images of a list file: the coordinator walks the (shuffled) list, the
    workers read, decode and resize the files."""

    def __init__(self, layer, p, transformer, batch_size, pool=None):
        self.name = layer.name
        self.transformer = transformer
        self.batch_size = batch_size
        self.pool = pool or workers_io.WorkerPool(1)
        self.list_path = p.source
        self.root = p.root_folder
        self.is_color = p.is_color
        self.new_height, self.new_width = int(p.new_height), int(p.new_width)
        log.info('Opening file %s', self.list_path)
        self.lines = read_image_list(self.list_path, layer.name)
        n = len(self.lines)
        self.order = numpy.arange(n)
        self.shuffle = p.shuffle
        self._shuffle_rng = None
        self._order_rng_state = None
        if self.shuffle:
            log.info('Shuffling data')
            self._shuffle_rng = _generator(_seed_from_global())
            self._reshuffle()
        log.info('A total of %d images.', n)
        self.lines_id = 0
        self.shard = (0, 1)     # (rank, world): see set_shard
        if p.rand_skip:
            skip = _seed_from_global() % p.rand_skip
            log.info('Skipping first %d data points.', skip)
            if skip >= n:
                raise CaffeplusError('layer %s: Not enough points to skip (%d of %d images in '
                                     '%s)' % (self.name, skip, n, self.list_path))
            self.lines_id = skip

    def _reshuffle(self):
        # The order is a fresh permutation drawn from the layer's generator;
        # remembering the generator state before the draw lets restore()
        # redraw the same order without storing it.
        self._order_rng_state = copy.deepcopy(self._shuffle_rng.bit_generator.state)
        self.order = self._shuffle_rng.permutation(len(self.lines))

    def image(self, index):
        return self.read(self.lines[self.order[index]])

    def read(self, line):
        """(pixels C x H x W, label, description) of one (path, label, line) entry."""
        path, label, lineno = line
        full = self.root + path
        what = "image '%s' (line %d of image list %s)" % (full, lineno, self.list_path)
        if not os.path.exists(full) and self.root and not self.root.endswith('/') and \
                os.path.exists(os.path.join(self.root, path)):
            what += " [root_folder '%s' is prepended as is, as Caffe does: end it with '/']" \
                % self.root
        arr = datum_io.read_image(full, self.is_color, self.new_height, self.new_width,
                                  what=what, contiguous=False)
        return arr, label, what

    def _advance(self, n=1):
        for _ in range(n):
            self.lines_id += 1
            if self.lines_id >= len(self.lines):
                self.lines_id = 0
                if self.shuffle:
                    self._reshuffle()

    def _next_items(self):
        # The entries are looked up as they are reached: a pass that ends
        # inside the batch reshuffles the order for the rest of it.
        lines = []
        rank, world = self.shard
        for i in range(self.batch_size):
            self._advance(rank if i == 0 else world - 1)
            lines.append(self.lines[self.order[self.lines_id]])
            self._advance()
        self._advance(world - 1 - rank)
        return lines

    def _decode_item(self, line):
        return self.read(line)

    def state(self):
        return {'lines_id': self.lines_id, 'num_lines': len(self.lines),
                'order_rng': copy.deepcopy(self._order_rng_state),
                'transformer': self.transformer.get_state()}

    def restore(self, state):
        if int(state.get('num_lines', len(self.lines))) != len(self.lines):
            raise CaffeplusError('layer %s: the saved state is for a list of %d images, %s '
                                 'has %d' % (self.name, state['num_lines'], self.list_path,
                                             len(self.lines)))
        if self.shuffle and state.get('order_rng') is not None:
            self._shuffle_rng.bit_generator.state = copy.deepcopy(state['order_rng'])
            self._reshuffle()
        self.lines_id = int(state['lines_id'])
        self.transformer.set_state(state.get('transformer'))

    def close(self):
        _close_stager(getattr(self, 'buffers', None))


@register
class ImageDataLayer(BasePrefetchingDataLayer):
    """Images named in a list file ('<path> <label>' lines), as BGR (or grey)."""
    type = 'ImageData'
    exact_num_top = 2
    min_num_top = -1
    max_num_top = -1
    legacy_transform_field = 'image_data_param'

    def make_source(self, top):
        p = self.layer_param.image_data_param
        if not ((p.new_height == 0 and p.new_width == 0) or
                (p.new_height > 0 and p.new_width > 0)):
            raise NetError('layer %s (ImageData): new_height and new_width must be set '
                           'together' % self.name)
        batch_size = _positive_batch_size(self, p.batch_size, 'image_data_param.batch_size')
        if not p.source:
            raise NetError('layer %s (ImageData): image_data_param.source is not set'
                           % self.name)
        source = _ImageListSource(self, p, self.transformer, batch_size, self.workers)
        arr, _, what = source.image(source.lines_id)
        shape = self.transformer.infer_shape(arr.shape, what)
        top[0].reshape((batch_size,) + shape)
        log.info('output data size: %d,%d,%d,%d', batch_size, *shape)
        top[1].reshape((batch_size,))
        source.use_shape(arr.shape, (batch_size,) + shape)
        return source


# -- MemoryData ----------------------------------------------------------------
@register
class MemoryDataLayer(Layer):
    """Batches from arrays the user hands over (pycaffe's set_input_arrays).

    reset(data, labels, n) uses the arrays as they are (no transformation,
    as Caffe); add_datum_vector / add_mat_vector transform with
    transform_param first.
    """
    type = 'MemoryData'
    exact_num_bottom = 0
    exact_num_top = 2
    has_backward = False
    backward_reads = frozenset()

    def layer_setup(self, bottom, top):
        p = self.layer_param.memory_data_param
        self.batch_size, self.channels = int(p.batch_size), int(p.channels)
        self.height, self.width = int(p.height), int(p.width)
        self.size = self.channels * self.height * self.width
        if self.batch_size * self.size <= 0:
            raise NetError('layer %s: batch_size, channels, height, and width must be specified '
                           'and positive in memory_data_param' % self.name)
        self.transformer = DataTransformer(self.layer_param.transform_param, self.phase,
                                           self.name)
        self.transformer.init_rand()
        self.data_workers = workers_io.resolve()
        self._pool = None
        self._data = self._labels = None
        self.n = self.pos = 0
        self.has_new_data = False
        top[0].reshape((self.batch_size, self.channels, self.height, self.width))
        top[1].reshape((self.batch_size,))

    def reshape(self, bottom, top):
        pass

    def reset(self, data, labels, n=None):
        """Serve `n` rows of `data` (n x C x H x W) and `labels` (n) in batches."""
        data = numpy.ascontiguousarray(backend.to_numpy(data), dtype=numpy.float32)
        labels = numpy.ascontiguousarray(backend.to_numpy(labels),
                                         dtype=numpy.float32).reshape(-1)
        n = data.shape[0] if n is None else int(n)
        if n <= 0 or n % self.batch_size:
            raise CaffeplusError('layer %s: n must be a positive multiple of batch size %d '
                                 '(got %d)' % (self.name, self.batch_size, n))
        if data.size < n * self.size or labels.size < n:
            raise CaffeplusError('layer %s: reset with %d rows but the arrays hold %d data '
                                 'values (need %d) and %d labels'
                                 % (self.name, n, data.size, n * self.size, labels.size))
        if self.layer_param.HasField('transform_param') and \
                self.layer_param.transform_param.ListFields():
            log.warning('%s does not transform array data on Reset()', self.type)
        self._data = data.reshape(-1)[:n * self.size].reshape(n, self.channels, self.height,
                                                               self.width)
        self._labels = labels[:n]
        self.n, self.pos = n, 0

    Reset = reset

    def set_input_arrays(self, data, labels):
        """pycaffe's Net.set_input_arrays for this layer: 4-D data, labels (N) or (N,1,1,1)."""
        data = numpy.asarray(backend.to_numpy(data))
        labels = numpy.asarray(backend.to_numpy(labels))
        if data.ndim != 4 or data.shape[1:] != (self.channels, self.height, self.width):
            raise CaffeplusError('layer %s: data array must have shape (N, %d, %d, %d), got %s'
                                 % (self.name, self.channels, self.height, self.width,
                                    data.shape))
        if labels.ndim not in (1, 4) or (labels.ndim == 4 and labels.shape[1:] != (1, 1, 1)):
            raise CaffeplusError('layer %s: labels array must have shape (N,) or (N, 1, 1, 1), '
                                 'got %s' % (self.name, labels.shape))
        if data.shape[0] != labels.shape[0]:
            raise CaffeplusError('layer %s: data and labels must have the same first dimension '
                                 '(%d vs %d)' % (self.name, data.shape[0], labels.shape[0]))
        if data.shape[0] % self.batch_size:
            raise CaffeplusError('layer %s: first dimensions of input arrays must be a multiple '
                                 'of batch size %d (got %d)'
                                 % (self.name, self.batch_size, data.shape[0]))
        self.reset(data, labels, data.shape[0])

    def set_batch_size(self, new_size):
        if self.has_new_data:
            raise CaffeplusError("layer %s: can't change batch_size until current data has "
                                 "been consumed" % self.name)
        if new_size <= 0:
            raise CaffeplusError('layer %s: batch_size must be positive' % self.name)
        self.batch_size = int(new_size)

    def add_datum_vector(self, datums):
        """Transform Datums (a multiple of batch_size of them) and serve them;
        encoded ones are decoded on data_workers threads."""
        arrays = self._workers().map(self.transformer.datum_array, datums)
        labels = [d.label for d in datums]
        self._add(arrays, labels)

    def _workers(self):
        """The worker threads that decode and transform added images (made
        at first use, with the count in force at setup)."""
        if getattr(self, '_pool', None) is None:
            self._pool = workers_io.WorkerPool(self.data_workers, self.name)
            weakref.finalize(self, self._pool.close)
        return self._pool

    def add_mat_vector(self, images, labels):
        """Transform H x W x C (BGR) uint8 images (OpenCV Mats) and serve them."""
        arrays = []
        for img in images:
            img = numpy.asarray(img)
            if img.ndim == 2:
                img = img[:, :, None]
            arrays.append(img.transpose(2, 0, 1))
        self._add(arrays, list(labels))

    def _add(self, arrays, labels):
        num = len(arrays)
        if num == 0 or num % self.batch_size:
            raise CaffeplusError('layer %s: The added data must be a multiple of the batch size '
                                 '%d (got %d)' % (self.name, self.batch_size, num))
        if len(labels) != num:
            raise CaffeplusError('layer %s: %d images but %d labels' % (self.name, num,
                                                                      len(labels)))
        for a in arrays:
            shape = self.transformer.infer_shape(numpy.shape(a))
            if shape != (self.channels, self.height, self.width):
                raise CaffeplusError('layer %s: an added image transforms to %s, the layer '
                                     'serves %s' % (self.name, shape,
                                                    (self.channels, self.height, self.width)))
        data = self.transformer.transform_batch(arrays, pool=self._workers())
        self._data = data
        self._labels = numpy.asarray(labels, dtype=numpy.float32)
        self.n, self.pos = num, 0
        self.has_new_data = True

    def _forward(self, bottom, top):
        if self._data is None:
            raise CaffeplusError('layer %s: MemoryDataLayer needs to be initialized by calling '
                                 'reset (or set_input_arrays) first' % self.name)
        b = self.batch_size
        top[0].reshape((b, self.channels, self.height, self.width))
        top[1].reshape((b,))
        top[0].data = self._data[self.pos:self.pos + b]
        top[1].data = self._labels[self.pos:self.pos + b]
        self.pos = (self.pos + b) % self.n
        if self.pos == 0:
            self.has_new_data = False

    def _backward(self, top, propagate_down, bottom):
        pass

    def get_state(self):
        return {'type': self.type, 'pos': self.pos,
                'transformer': self.transformer.get_state()}

    def set_state(self, state):
        self.pos = int(state.get('pos', 0)) % max(self.n, 1)
        self.transformer.set_state(state.get('transformer'))

    snapshot_state = get_state
    restore_state = set_state

