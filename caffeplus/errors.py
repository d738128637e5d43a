"""caffeplus's own error type: every user-facing failure is one of these.

The CLI prints the message and exits non-zero without a traceback (unless
--debug); library users can catch CaffeplusError.
"""


class CaffeplusError(Exception):
    """A problem with the user's input, files or environment."""


class FormatError(CaffeplusError):
    """A file that cannot be read as what it claims to be."""


class ValueCountError(FormatError, ValueError):
    """A blob whose values do not fill its shape (a ValueError too, as
    NumPy's reshape raises it in pycaffe's caffe.io.blobproto_to_array)."""


class NetError(CaffeplusError):
    """A net definition that cannot be built."""


class UnknownLayerError(NetError):
    """A layer type no registry entry provides."""
