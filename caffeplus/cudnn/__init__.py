"""cuDNN through ctypes: library discovery, checked calls, self-freeing
descriptors, handles bound to streams, and the legacy convolution API.

Only this package touches libcudnn; layers call its small typed wrappers.
"""
from caffeplus.cudnn.lib import CudnnError, available, library, version  # noqa: F401
