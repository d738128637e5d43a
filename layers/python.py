"""The Python layer: `type: "Python"` runs a class written in Python.

    layer { type: "Python" name: "loss" bottom: "a" bottom: "b" top: "loss"
            python_param { module: "pyloss" layer: "EuclideanLossLayer"
                           param_str: "..." } loss_weight: 1 }

As Caffe does, the module is imported by name from the Python search path
(sys.path, which includes $PYTHONPATH) and the class is instantiated with the
LayerParameter; it should subclass caffeplus.Layer (pycaffe's caffe.Layer:
a module written for Caffe that says `import caffe` gets caffeplus, with no
edit and no extra step, from Python and from the command line alike) and
override setup/reshape/forward/backward. The net holds a wrapper that
speaks caffeplus's layer protocol and forwards any other attribute to the
Python object, so `net.layers[i].my_attribute` reaches the user's layer as
in pycaffe.

Python layers run arbitrary code named by the net file: they can be refused
with caffeplus.set_python_layers_allowed(False) or CAFFEPLUS_NO_PYTHON_LAYERS=1.
"""
import importlib
import os
import sys

from caffeplus.errors import CaffeplusError, NetError
from caffeplus.layer import Layer, register
from caffeplus.pycaffe import (CAFFE_SUBMODULES, BlobVec, HostBlobVec,
                               caffe_alias_for_python_layer, host_blobs,
                               python_layers_refusal)


class PythonLayerError(CaffeplusError):
    """A Python layer's own code raised an exception."""


# Its exception type -> the PythonLayerError that is also of that type.
_error_kinds = {}


def _search_path():
    entries = [p if p else '(current directory)' for p in sys.path]
    text = ', '.join(entries)
    env = os.environ.get('PYTHONPATH')
    return '%s (PYTHONPATH=%s)' % (text, env if env is not None else 'unset')


def _import_module(module, layer_name):
    try:
        # Layer modules written for Caffe say `import caffe`; they get caffeplus.
        with caffe_alias_for_python_layer():
            return importlib.import_module(module)
    except ModuleNotFoundError as exc:
        missing = exc.name or ''
        if missing and (module == missing or module.startswith(missing + '.')):
            raise NetError("Python layer '%s': cannot import module '%s': no module of that "
                           "name on the Python search path. Put its directory on PYTHONPATH "
                           "(or sys.path). Search path: %s" % (layer_name, module, _search_path()))
        hint = ''
        if missing.startswith('caffe.'):
            hint = (" (caffeplus, which a layer module gets as `caffe`, has no module '%s'; "
                    "it has caffe.%s)" % (missing, ', caffe.'.join(CAFFE_SUBMODULES)))
        raise NetError("Python layer '%s': importing module '%s' failed: %s%s. Search path: %s"
                       % (layer_name, module, exc, hint, _search_path()))
    except Exception as exc:
        raise NetError("Python layer '%s': importing module '%s' failed: %s: %s"
                       % (layer_name, module, type(exc).__name__, exc))


# The memory planner's hooks (caffeplus.layer.Layer) a user's class may
# define: where it does, its own answers for the layer.
PLANNER_HOOKS = ('gpu_backward_reads', 'unmasked_backward_reads', 'internal_buffers',
                 'forget_kept_buffers', 'internal_bytes', 'gpu_internal_bytes', 'can_mask',
                 'set_masked', 'workspace_manager', 'chosen_workspace_bytes', 'can_time_calls',
                 'auto_timed_search', 'gemm_rows')


@register
class PythonLayer(Layer):
    """Caffe's PythonLayer: the wrapper between a net and a user's class."""
    type = 'Python'

    _OWN = frozenset(('layer_param', 'phase', 'blobs', 'param_propagate_down',
                      'loss_weights', 'py', 'module_name', 'class_name', '_py_blobs'))

    def __init__(self, layer_param):
        super().__init__(layer_param)
        p = self.layer_param.python_param
        name = self.layer_param.name
        refusal = python_layers_refusal()
        if refusal is not None:
            raise NetError("layer '%s' is a Python layer (module '%s', class '%s'), and Python "
                           "layers are refused because %s. Python layers run code named by "
                           "the net file; allow them only for files you trust."
                           % (name, p.module, p.layer, refusal))
        if not p.module or not p.layer:
            raise NetError("Python layer '%s': python_param needs both module and layer "
                           "(got module '%s', layer '%s')" % (name, p.module, p.layer))
        self.module_name, self.class_name = p.module, p.layer
        module = _import_module(p.module, name)
        try:
            cls = getattr(module, p.layer)
        except AttributeError:
            raise NetError("Python layer '%s': module '%s' (%s) has no class '%s'"
                           % (name, p.module, getattr(module, '__file__', '?'), p.layer))
        self.blobs = BlobVec(self.blobs, owner=name)
        try:
            py = cls(self.layer_param)
        except TypeError as first:
            # A class whose __init__ takes no parameter.
            try:
                py = cls()
            except Exception:
                raise self._error('__init__', first) from first
        except Exception as exc:
            raise self._error('__init__', exc) from exc
        for method in ('setup', 'reshape', 'forward', 'backward'):
            if not callable(getattr(py, method, None)):
                raise NetError("Python layer '%s': class %s.%s has no %s() method (subclass "
                               "caffeplus.Layer)" % (name, p.module, p.layer, method))
        self.py = py
        for hook in PLANNER_HOOKS:
            own = getattr(type(py), hook, None)
            if own is not None and own is not getattr(Layer, hook):
                object.__setattr__(self, hook, getattr(py, hook))
        self._prepare()

    def _prepare(self):
        py = self.py
        self._py_blobs = HostBlobVec(self.blobs)
        param_str = self.layer_param.python_param.param_str
        # param_str_: the name before Caffe 1.0, which py-faster-rcnn's layers read.
        for attr, value in (('param_str', param_str), ('param_str_', param_str),
                            ('phase', self.phase), ('blobs', self._py_blobs),
                            ('layer_param', self.layer_param), ('type', 'Python')):
            try:
                setattr(py, attr, value)
            except AttributeError:  # a read-only property of the user's class
                pass

    # -- attribute forwarding -------------------------------------------------
    def __getattr__(self, name):
        py = self.__dict__.get('py')
        if py is None:
            raise AttributeError(name)
        return getattr(py, name)

    def __setattr__(self, name, value):
        d = self.__dict__
        if 'py' not in d or name in self._OWN or name in d or hasattr(type(self), name):
            object.__setattr__(self, name, value)
        else:
            setattr(d['py'], name, value)

    # -- the layer protocol -----------------------------------------------------
    def _error(self, what, exc):
        """The error naming the layer, of the layer's own exception type too:
        pycaffe lets a layer's exception through as it is, so scripts catch
        it by its type (`except RuntimeError`), while caffeplus's commands
        report a CaffeplusError in one line."""
        message = ("Python layer '%s' (%s.%s) raised an error in %s: %s: %s"
                   % (self.layer_param.name, self.module_name, self.class_name,
                      what, type(exc).__name__, exc))
        kind = _error_kinds.get(type(exc))
        if kind is None:
            try:
                kind = type('PythonLayerError', (PythonLayerError, type(exc)),
                            {'__module__': __name__, '__str__': Exception.__str__})
            except TypeError:       # a type that cannot be mixed in (its layout, final)
                kind = PythonLayerError
            _error_kinds[type(exc)] = kind
        try:
            return kind(message)
        except Exception:           # its constructor wants other arguments
            return PythonLayerError(message)

    def _call(self, what, *args):
        try:
            return getattr(self.py, what)(*args)
        except (KeyboardInterrupt, SystemExit):
            raise
        except PythonLayerError:
            raise
        except Exception as exc:
            raise self._error(what, exc) from exc

    def layer_setup(self, bottom, top):
        self._prepare()
        self._call('setup', host_blobs(bottom), host_blobs(top))
        blobs = getattr(self.py, 'blobs', self._py_blobs)
        if blobs is not self._py_blobs:
            # The layer replaced self.blobs with a list of its own.
            self.blobs = BlobVec([getattr(b, 'blob', b) for b in blobs],
                                 owner=self.layer_param.name)
            self._prepare()

    # bottom and top reach the Python code as pycaffe gives them: NumPy
    # data/diff, in GPU mode through host mirrors synced with the device.
    def reshape(self, bottom, top):
        self._call('reshape', host_blobs(bottom), host_blobs(top))

    def _forward(self, bottom, top):
        self._call('forward', host_blobs(bottom), host_blobs(top))

    def _backward(self, top, propagate_down, bottom):
        self._call('backward', host_blobs(top), list(propagate_down), host_blobs(bottom))

    def __repr__(self):
        return '<Python layer %s (%s.%s)>' % (self.layer_param.name, self.module_name,
                                              self.class_name)
