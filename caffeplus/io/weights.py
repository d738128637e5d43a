"""Net weights: .caffemodel (binary NetParameter) and Caffe's HDF5 layout.

HDF5 layout, as Caffe writes it: group `data` with one group per layer
(named as the layer) holding datasets `0`, `1`, ... (float32, the blob
shape); `diff` likewise when diffs are written. Shared parameters are
stored only under their owner.
"""
import os

import numpy

from caffeplus import backend, log
from caffeplus.blob import shape_string, proto_shape
from caffeplus.errors import FormatError, NetError
from caffeplus.io.atomic import atomic_path, atomic_write
from caffeplus.io.prototxt import read_net_param_binary


def copy_trained_layers_from(net, filename):
    if filename.endswith('.h5'):
        copy_from_hdf5(net, filename)
    else:
        copy_from_net_param(net, read_net_param_binary(filename), filename)


def copy_from_net_param(net, param, source='weights'):
    layer_names = net._layer_names
    for src in param.layer:
        if src.name not in layer_names:
            log.info('Ignoring source layer %s', src.name)
            continue
        target = net.layers[layer_names.index(src.name)].blobs
        if len(target) != len(src.blobs):
            raise NetError('%s: Incompatible number of blobs for layer %s (the net has %d, '
                           'the file %d)' % (source, src.name, len(target), len(src.blobs)))
        for j, (blob, proto) in enumerate(zip(target, src.blobs)):
            if not blob.shape_equals(proto):
                raise _shape_mismatch(source, j, src.name, proto_shape(proto), blob)
            try:
                blob.from_proto(proto, reshape=False)
            except FormatError as exc:
                raise FormatError('%s: layer %s param %d: %s' % (source, src.name, j, exc))


def _shape_mismatch(source, index, layer_name, source_shape, blob):
    """Caffe's message for weights whose shape differs from the net's."""
    return NetError("%s: Cannot copy param %d weights from layer '%s'; shape mismatch.  "
                    "Source param shape is %s; target param shape is %s. To learn this "
                    "layer's parameters from scratch rather than copying from a saved net, "
                    "rename the layer." % (source, index, layer_name, shape_string(source_shape),
                                           blob.shape_string()))


def write_caffemodel(net, filename, write_diff=False):
    data = net.to_proto(write_diff).SerializeToString()
    with atomic_write(filename, 'wb') as f:
        f.write(data)


def _h5py():
    try:
        import h5py
    except ImportError:
        raise FormatError('HDF5 files need the h5py package: pip install h5py')
    return h5py


def write_hdf5(net, filename, write_diff=False):
    h5py = _h5py()
    with atomic_path(filename) as tmp:
        with h5py.File(tmp, 'w') as f:
            data = f.create_group('data')
            diff = f.create_group('diff') if write_diff else None
            for layer_id, (name, layer) in enumerate(zip(net._layer_names, net.layers)):
                g_data = data.create_group(name)
                g_diff = diff.create_group(name) if diff is not None else None
                for j, net_param_id in enumerate(net.param_id_vecs[layer_id]):
                    if net.param_owners[net_param_id] != -1:
                        continue
                    blob = layer.blobs[j]
                    g_data.create_dataset(str(j), data=backend.to_numpy(blob.data).astype(numpy.float32))
                    if g_diff is not None:
                        g_diff.create_dataset(str(j), data=backend.to_numpy(blob.diff).astype(numpy.float32))


# What h5py raises on a damaged file (bad signatures, truncated objects,
# unreadable chunks): the HDF5 library's errors come out as these.
_H5_ERRORS = (OSError, RuntimeError, KeyError, ValueError, TypeError)


def _h5_read(filename, what, func):
    try:
        return func()
    except _H5_ERRORS as exc:
        raise FormatError('%s: cannot read %s: the HDF5 file is damaged or not what Caffe '
                          'writes (%s: %s)' % (filename, what, type(exc).__name__, exc))


def copy_from_hdf5(net, filename):
    h5py = _h5py()
    if not os.path.exists(filename):
        raise FormatError('weights file not found: %s' % filename)
    try:
        f = h5py.File(filename, 'r')
    except _H5_ERRORS as exc:
        raise FormatError('%s: not a readable HDF5 file (%s)' % (filename, exc))
    with f:
        _copy_from_hdf5_file(h5py, net, f, filename)


def _copy_from_hdf5_file(h5py, net, f, filename):
    if not _h5_read(filename, "the 'data' group", lambda: 'data' in f):
        raise FormatError("%s: no 'data' group: not a Caffe HDF5 weights file" % filename)
    data = _h5_read(filename, "the 'data' group", lambda: f['data'])
    if not isinstance(data, h5py.Group):
        raise FormatError("%s: 'data' is a dataset, not a group of layers: not a Caffe HDF5 "
                          "weights file" % filename)
    layer_names = _h5_read(filename, "the layer names in 'data'", lambda: list(data))
    for layer_name in layer_names:
        if layer_name not in net._layer_names:
            log.info('Ignoring source layer %s', layer_name)
            continue
        where = 'data/%s' % layer_name
        layer_id = net._layer_names.index(layer_name)
        target = net.layers[layer_id].blobs
        group = _h5_read(filename, where, lambda: data[layer_name])
        if not isinstance(group, h5py.Group):
            raise FormatError('%s: %s is a dataset, not a group of parameter blobs'
                              % (filename, where))
        num_source = _h5_read(filename, where, lambda: len(group))
        if num_source > len(target):
            raise NetError('%s: Incompatible number of blobs for layer %s (the net has %d, '
                           'the file %d)' % (filename, layer_name, len(target), num_source))
        for j, blob in enumerate(target):
            key = str(j)
            if not _h5_read(filename, where, lambda: key in group):
                if net.param_owners[net.param_id_vecs[layer_id][j]] != -1:
                    continue  # shared: the owner carries it
                raise NetError('%s: Incompatible number of blobs for layer %s (no dataset '
                               '%s/%s)' % (filename, layer_name, where, key))
            ds = _h5_read(filename, '%s/%s' % (where, key), lambda: group[key])
            if not isinstance(ds, h5py.Dataset):
                raise FormatError('%s: %s/%s is a group, not a dataset' % (filename, where, key))
            # Caffe reads float and integer datasets; anything else (strings,
            # compound or variable-length types) is refused before reading
            # (libhdf5 can loop forever on a damaged variable-length heap).
            if ds.dtype.kind not in 'fiu':
                raise FormatError('%s: dataset %s/%s has type %s; expected float (or integer) '
                                  'values' % (filename, where, key, ds.dtype))
            if tuple(ds.shape) != blob.shape:
                raise _shape_mismatch(filename, j, layer_name, ds.shape, blob)
            values = _h5_read(filename, '%s/%s' % (where, key), lambda: ds[...])
            blob.data = numpy.asarray(values, dtype=numpy.float32)
