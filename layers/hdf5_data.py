"""HDF5Data and HDF5Output: rows of HDF5 datasets named after the tops, and
the writer of two bottoms to an HDF5 file (h5py)."""
import copy
import os

import numpy

from caffeplus import backend, log
from caffeplus.errors import CaffeplusError, NetError
from caffeplus.layer import Layer, register
from caffeplus.layers.data import _check_shard, _generator, _positive_batch_size, \
    _seed_from_global


# -- HDF5Data ------------------------------------------------------------------
def _h5py():
    try:
        import h5py
    except ImportError:
        raise CaffeplusError("HDF5 layers need the 'h5py' package (pip install h5py)")
    return h5py


@register
class HDF5DataLayer(Layer):
    """Rows of HDF5 datasets named after the tops, from the files a list names.

    As Caffe: each file is loaded whole; with shuffle the file order is
    shuffled at setup and at each pass, and the rows of each file each time it
    is (re)used. The shuffles use the layer's own generator, seeded from
    caffeplus.rng at setup.
    """
    type = 'HDF5Data'
    exact_num_bottom = 0
    min_num_top = 1
    has_backward = False
    backward_reads = frozenset()
    MAX_ROW_VALUES = 2 ** 31 - 1

    def layer_setup(self, bottom, top):
        if self.layer_param.HasField('transform_param') and \
                self.layer_param.transform_param.ListFields():
            raise NetError('layer %s: HDF5Data does not transform data (remove transform_param)'
                           % self.name)
        p = self.layer_param.hdf5_data_param
        self.batch_size = _positive_batch_size(self, p.batch_size, 'hdf5_data_param.batch_size')
        self.shuffle = p.shuffle
        self.list_path = p.source
        self.top_names = list(self.layer_param.top)
        log.info('Loading list of HDF5 filenames from: %s', self.list_path)
        try:
            with open(self.list_path, 'r') as f:
                self.files = f.read().split()
        except FileNotFoundError:
            raise CaffeplusError('layer %s: HDF5 list file not found: %s'
                                 % (self.name, self.list_path))
        except OSError as exc:
            raise CaffeplusError('layer %s: cannot read HDF5 list file %s: %s'
                                 % (self.name, self.list_path, exc.strerror or exc))
        log.info('Number of HDF5 files: %d', len(self.files))
        if not self.files:
            raise CaffeplusError('layer %s: Must have at least 1 HDF5 filename listed in %s'
                                 % (self.name, self.list_path))
        self._rng = _generator(_seed_from_global()) if self.shuffle else None
        self.file_permutation = numpy.arange(len(self.files))
        if self.shuffle:
            self.file_permutation = self._rng.permutation(self.file_permutation)
        self.current_file = 0
        self._load(self.file_permutation[0])
        self.current_row = 0
        self.shard = (0, 1)     # (rank, world): see set_shard
        self.row_shapes = [b.shape[1:] for b in self.blobs_data]
        for t, b in zip(top, self.blobs_data):
            t.reshape((self.batch_size,) + b.shape[1:])

    def _load(self, index):
        h5py = _h5py()
        path = self.files[index]
        where = 'HDF5 file %s (listed in %s)' % (path, self.list_path)
        if not os.path.exists(path):
            raise CaffeplusError('layer %s: %s not found' % (self.name, where))
        try:
            f = h5py.File(path, 'r')
        except Exception as exc:
            raise CaffeplusError('layer %s: Failed opening %s: %s' % (self.name, where, exc))
        blobs = []
        with f:
            for name in self.top_names:
                if name not in f or not isinstance(f[name], h5py.Dataset):
                    have = ', '.join(sorted(k for k in f.keys())) or 'none'
                    raise CaffeplusError("layer %s: %s has no dataset '%s' (one dataset per top "
                                         "is needed; datasets in the file: %s)"
                                         % (self.name, where, name, have))
                ds = f[name]
                if ds.ndim < 1:
                    raise CaffeplusError("layer %s: dataset '%s' of %s must have at least 1 "
                                         "axis" % (self.name, name, where))
                if ds.dtype.kind not in 'fiub':
                    raise CaffeplusError("layer %s: dataset '%s' of %s has type %s; numbers "
                                         "are needed" % (self.name, name, where, ds.dtype))
                if int(numpy.prod(ds.shape[1:], dtype=numpy.float64)) > self.MAX_ROW_VALUES:
                    raise CaffeplusError("layer %s: dataset '%s' of %s is too large (%s)"
                                         % (self.name, name, where, ds.shape))
                blobs.append(numpy.asarray(ds[()], dtype=numpy.float32))
        num = blobs[0].shape[0]
        for name, b in zip(self.top_names, blobs):
            if b.shape[0] != num:
                raise CaffeplusError("layer %s: datasets of %s differ in their number of rows "
                                     "('%s' has %d, '%s' has %d)"
                                     % (self.name, where, self.top_names[0], num, name,
                                        b.shape[0]))
        if num == 0:
            raise CaffeplusError('layer %s: %s has no rows' % (self.name, where))
        if hasattr(self, 'row_shapes'):
            for name, b, shape in zip(self.top_names, blobs, self.row_shapes):
                if b.shape[1:] != shape:
                    raise CaffeplusError("layer %s: dataset '%s' of %s has rows of shape %s, "
                                         "the first file's have %s"
                                         % (self.name, name, where, b.shape[1:], shape))
        self.blobs_data = blobs
        self.loaded_file = int(index)
        self.data_permutation = numpy.arange(num)
        if self.shuffle:
            self.data_permutation = self._rng.permutation(num)

    def _next(self):
        self.current_row += 1
        if self.current_row == self.blobs_data[0].shape[0]:
            if len(self.files) > 1:
                self.current_file += 1
                if self.current_file == len(self.files):
                    self.current_file = 0
                    if self.shuffle:
                        self.file_permutation = self._rng.permutation(self.file_permutation)
                self._load(self.file_permutation[self.current_file])
            self.current_row = 0
            if self.shuffle:
                self.data_permutation = self._rng.permutation(self.data_permutation)

    def reshape(self, bottom, top):
        pass

    def _forward(self, bottom, top):
        # The rows are picked in order (a pass ending inside the batch may
        # load another file and reshuffle), then each file's rows are
        # gathered at once into the batch.
        picks = []                      # (file's rows, row index), in batch order
        rank, world = self.shard
        for i in range(self.batch_size):
            for _ in range(rank if i == 0 else world - 1):
                self._next()
            picks.append((self.blobs_data, self.data_permutation[self.current_row]))
            self._next()
        for _ in range(world - 1 - rank):
            self._next()
        outs = [numpy.empty((self.batch_size,) + s, dtype=numpy.float32)
                for s in self.row_shapes]
        start = 0
        while start < len(picks):
            blobs = picks[start][0]
            stop = start
            while stop < len(picks) and picks[stop][0] is blobs:
                stop += 1
            rows = numpy.asarray([row for _, row in picks[start:stop]], dtype=numpy.int64)
            for out, b in zip(outs, blobs):
                numpy.take(b, rows, axis=0, out=out[start:stop])
            start = stop
        for t, out in zip(top, outs):
            t.reshape(out.shape)
            t.data = out

    def _backward(self, top, propagate_down, bottom):
        pass

    def set_shard(self, rank, world):
        """Read only rank `rank`'s share of the rows (data-parallel training):
        as Caffe's HDF5DataLayer::Skip, of every `world` consecutive rows the
        rank-th, counted from the start of each batch (see
        BasePrefetchingDataLayer.set_shard)."""
        self.shard = _check_shard(self, rank, world)

    def get_state(self):
        return {'type': self.type, 'current_file': self.current_file,
                'current_row': self.current_row,
                'file_permutation': [int(i) for i in self.file_permutation],
                'data_permutation': [int(i) for i in self.data_permutation],
                'rng': None if self._rng is None else copy.deepcopy(self._rng.bit_generator.state)}

    def set_state(self, state):
        perm = [int(i) for i in state['file_permutation']]
        if sorted(perm) != list(range(len(self.files))):
            raise CaffeplusError('layer %s: the saved state is for %d HDF5 files, %s lists %d'
                                 % (self.name, len(perm), self.list_path, len(self.files)))
        self.file_permutation = numpy.asarray(perm)
        self.current_file = int(state['current_file'])
        if self.loaded_file != self.file_permutation[self.current_file]:
            self._load(self.file_permutation[self.current_file])
        rows = numpy.asarray(state['data_permutation'], dtype=numpy.int64)
        if rows.shape[0] != self.blobs_data[0].shape[0]:
            raise CaffeplusError('layer %s: the saved state does not match the rows of %s'
                                 % (self.name, self.files[self.loaded_file]))
        self.data_permutation = rows
        self.current_row = int(state['current_row'])
        if state.get('rng') is not None and self._rng is not None:
            self._rng.bit_generator.state = copy.deepcopy(state['rng'])

    snapshot_state = get_state
    restore_state = set_state


# -- HDF5Output ----------------------------------------------------------------
@register
class HDF5OutputLayer(Layer):
    """Writes its two bottoms to datasets 'data' and 'label' of an HDF5 file.

    Shapes are Caffe's 4-D (num, channels, height, width). Caffe can write one
    batch only; caffeplus appends the rows of every forward.
    """
    type = 'HDF5Output'
    exact_num_bottom = 2
    exact_num_top = 0
    has_backward = False
    backward_reads = frozenset()

    def layer_setup(self, bottom, top):
        h5py = _h5py()
        self.file_name = self.layer_param.hdf5_output_param.file_name
        if not self.file_name:
            raise NetError('layer %s: hdf5_output_param.file_name is not set' % self.name)
        try:
            with h5py.File(self.file_name, 'w'):
                pass
        except Exception as exc:
            raise CaffeplusError('layer %s: Failed to open %s for writing: %s'
                                 % (self.name, self.file_name, exc))
        self.rows = 0

    def reshape(self, bottom, top):
        if bottom[0].num != bottom[1].num:
            raise NetError('layer %s: data blob and label blob must have the same batch size '
                           '(%d vs %d)' % (self.name, bottom[0].num, bottom[1].num))

    def _forward(self, bottom, top):
        h5py = _h5py()
        log.info('Saving HDF5 file %s', self.file_name)
        arrays = []
        for b in bottom:
            shape = (b.num, b.channels, b.height, b.width)
            arrays.append(numpy.asarray(backend.to_numpy(b.data), dtype=numpy.float32)
                          .reshape(shape))
        with h5py.File(self.file_name, 'a') as f:
            for name, a in zip(('data', 'label'), arrays):
                if name not in f:
                    f.create_dataset(name, data=a, maxshape=(None,) + a.shape[1:],
                                     chunks=True)
                    continue
                ds = f[name]
                if ds.shape[1:] != a.shape[1:]:
                    raise CaffeplusError("layer %s: bottom shape %s does not match the rows "
                                         "already in dataset '%s' of %s (%s)"
                                         % (self.name, a.shape, name, self.file_name,
                                            ds.shape[1:]))
                n = ds.shape[0]
                ds.resize(n + a.shape[0], axis=0)
                ds[n:] = a
        self.rows += arrays[0].shape[0]
        log.info('Successfully saved %d rows', arrays[0].shape[0])

    def _backward(self, top, propagate_down, bottom):
        pass
