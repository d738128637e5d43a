"""Reading and writing Caffe's file formats.

The package also is pycaffe's `caffe.io`: Transformer, load_image,
resize_image, oversample, array_to_blobproto, blobproto_to_array,
arraylist_to_blobprotovector_str, blobprotovector_str_to_arraylist,
array_to_datum, datum_to_array (from caffeplus.io.pycaffe_io, loaded on
first use so that importing a format module stays light).
"""
import importlib

_PYCAFFE_NAMES = ('Transformer', 'load_image', 'resize_image', 'oversample',
                  'array_to_blobproto', 'blobproto_to_array',
                  'arraylist_to_blobprotovector_str', 'blobprotovector_str_to_arraylist',
                  'array_to_datum', 'datum_to_array', 'caffe_pb2')


def __getattr__(name):
    if name in _PYCAFFE_NAMES:
        module = importlib.import_module('caffeplus.io.pycaffe_io')
        value = getattr(module, name)
        globals()[name] = value
        return value
    raise AttributeError("module 'caffeplus.io' has no attribute '%s'" % name)


def __dir__():
    return sorted(set(globals()) | set(_PYCAFFE_NAMES))
