"""caffeplus's layer implementations, one module per family.

Importing this package registers every layer type with caffeplus.layer.
"""
import importlib

_FAMILIES = ('data', 'common', 'neuron', 'vision', 'normalization', 'loss',
             'recurrent', 'python')

for _family in _FAMILIES:
    try:
        importlib.import_module(__name__ + '.' + _family)
    except ModuleNotFoundError as _exc:
        # A family module not written yet; anything else is a real error.
        if _exc.name != __name__ + '.' + _family:
            raise
