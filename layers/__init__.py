"""caffeplus's layer implementations, one module per family.

Importing this package registers every layer type with caffeplus.layer.
"""
import importlib

_FAMILIES = ('data', 'hdf5_data', 'window_data', 'common', 'neuron', 'vision', 'normalization', 'loss',
             'recurrent', 'python', 'cudnn_conv', 'cudnn_pooling', 'cudnn_lrn', 'cudnn_softmax',
             'cudnn_activations', 'fused_chain', 'fused_loss', 'fused_inner_product',
             'fused_concat')

for _family in _FAMILIES:
    try:
        importlib.import_module(__name__ + '.' + _family)
    except ModuleNotFoundError as _exc:
        # A family module not written yet; anything else is a real error.
        if _exc.name != __name__ + '.' + _family:
            raise


def __getattr__(name):
    # pycaffe's `from caffe import layers as L; L.Convolution(...)`: capitalised
    # names are NetSpec layer functions (the family modules are lowercase).
    if name[:1].isupper():
        from caffeplus import net_spec
        return getattr(net_spec.layers, name)
    raise AttributeError("module %r has no attribute %r" % (__name__, name))
