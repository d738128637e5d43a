"""NVRTC, the compiler CuPy builds caffeplus's CUDA sources with, called
through ctypes so that those sources can be compiled on a machine with no
GPU and no CuPy.

The library and CUDA's headers (cuda_fp16.h, cuda_bf16.h) are looked for in
NVIDIA's wheels (nvidia-cuda-nvrtc, nvidia-cuda-runtime: the test extras
install them on Linux x86_64), then under CUDA_PATH and /usr/local/cuda.
CAFFEPLUS_NVRTC names the library's file directly.
"""
import ctypes
import glob
import os
import re
import shutil

_LIBRARY_NAMES = ('libnvrtc.so.13', 'libnvrtc.so.12', 'libnvrtc.so')


def _wheel_roots():
    """The folders NVIDIA's wheels install into (nvidia/cu13, nvidia/cuda_nvrtc, ...)."""
    try:
        import nvidia
    except ImportError:
        return []
    roots = []
    for base in nvidia.__path__:
        roots.extend(sorted(glob.glob(os.path.join(base, '*'))))
    return roots


def _toolkit_roots():
    return [p for p in (os.environ.get('CUDA_PATH'), '/usr/local/cuda') if p]


def nvidia_tool(name):
    """The path of one of CUDA's programs (cuobjdump, ...) on PATH, in NVIDIA's
    wheels or in the toolkit; None if it is nowhere."""
    found = shutil.which(name)
    if found:
        return found
    for root in _wheel_roots() + _toolkit_roots():
        path = os.path.join(root, 'bin', name)
        if os.path.exists(path):
            return path
    return None


def library_path():
    """The NVRTC library's file, or None."""
    named = os.environ.get('CAFFEPLUS_NVRTC')
    if named:
        return named if os.path.exists(named) else None
    for root in _wheel_roots() + _toolkit_roots():
        for sub in ('lib', 'lib64'):
            for name in _LIBRARY_NAMES:
                path = os.path.join(root, sub, name)
                if os.path.exists(path):
                    return path
    return None


def include_dir():
    """A folder holding cuda_fp16.h and cuda_bf16.h, or None."""
    for root in _wheel_roots() + _toolkit_roots():
        path = os.path.join(root, 'include')
        if all(os.path.exists(os.path.join(path, h)) for h in ('cuda_fp16.h', 'cuda_bf16.h')):
            return path
    return None


class CompileError(Exception):
    pass


class Compiler:
    """NVRTC loaded from `path`: compile(source, options) -> CUBIN bytes."""

    def __init__(self, path):
        # NVRTC opens its builtins library by name at the first compile;
        # loaded globally first, it is found beside a wheel's copy too.
        folder = os.path.dirname(path)
        for builtins in sorted(glob.glob(os.path.join(folder, 'libnvrtc-builtins.so*'))):
            if '.alt.' not in builtins:
                ctypes.CDLL(builtins, mode=ctypes.RTLD_GLOBAL)
                break
        self.lib = ctypes.CDLL(path)

    def version(self):
        major, minor = ctypes.c_int(), ctypes.c_int()
        self.lib.nvrtcVersion(ctypes.byref(major), ctypes.byref(minor))
        return major.value, minor.value

    def compile(self, source, options, name='kernel.cu'):
        """The CUBIN (with an sm_ architecture in `options`), or CompileError."""
        return self.compile_with_log(source, options, name)[0]

    def compile_with_log(self, source, options, name='kernel.cu'):
        """(CUBIN, NVRTC's log): with --ptxas-options=-v the log holds each
        kernel's registers (registers())."""
        lib = self.lib
        prog = ctypes.c_void_p()
        status = lib.nvrtcCreateProgram(ctypes.byref(prog), source.encode(), name.encode(),
                                        0, None, None)
        if status != 0:
            raise CompileError('nvrtcCreateProgram failed (%d)' % status)
        try:
            args = (ctypes.c_char_p * len(options))(*[o.encode() for o in options])
            status = lib.nvrtcCompileProgram(prog, len(options), args)
            size = ctypes.c_size_t()
            lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
            text = ctypes.create_string_buffer(size.value)
            lib.nvrtcGetProgramLog(prog, text)
            log = text.value.decode(errors='replace')
            if status != 0:
                raise CompileError(log)
            lib.nvrtcGetCUBINSize(prog, ctypes.byref(size))
            cubin = ctypes.create_string_buffer(size.value)
            lib.nvrtcGetCUBIN(prog, cubin)
            return cubin.raw, log
        finally:
            lib.nvrtcDestroyProgram(ctypes.byref(prog))


_ENTRY = re.compile(r"Compiling entry function '(\w+)'")
_USED = re.compile(r'Used (\d+) registers')


def registers(log):
    """{kernel: registers a thread} from a log of --ptxas-options=-v."""
    found, name = {}, None
    for line in log.splitlines():
        m = _ENTRY.search(line)
        if m:
            name = m.group(1)
            continue
        m = _USED.search(line)
        if m and name:
            found[name] = int(m.group(1))
            name = None
    return found


def fits(registers_a_thread, threads):
    """Whether a block of `threads` can launch with that many registers a
    thread on sm_90 (65,536 a multiprocessor, given to warps 256 at a time)."""
    per_warp = -(-registers_a_thread * 32 // 256) * 256
    return per_warp * (-(-threads // 32)) <= 65536


# The bench GPU (H200). A CUBIN for it also runs ptxas, as the driver does
# when it loads the PTX CuPy hands it.
ARCH = 'sm_90'


def package_units():
    """(label, CUDA source, NVRTC options) of every source caffeplus builds
    at run time, with the options its code passes."""
    from caffeplus import kernels
    from caffeplus.io import device_transform
    from caffeplus.solver import gpu_kernels
    if not hasattr(kernels, 'compile_units'):
        return _older_units(kernels, gpu_kernels, device_transform)
    return kernels.compile_units() + gpu_kernels.compile_units() + device_transform.compile_units()


def _older_units(kernels, gpu_kernels, device_transform):
    """The same for a tree from before compile_units() (dev/kernel_sass.py
    --against an older commit), with -default-device, without which NVRTC 13
    refuses their lambdas."""
    import numpy
    units = [('kernels.' + group, source, ('--std=c++14', '-default-device'))
             for group, source in kernels.SOURCES.items()]
    index = gpu_kernels._INDEX_SOURCE
    units += [('solver.caffeplus_solver_update', gpu_kernels._SOURCE, ()),
              ('solver.caffeplus_gradient_check', index + gpu_kernels._CHECK_SOURCE, ()),
              ('solver.caffeplus_gradient_unscale', index + gpu_kernels._UNSCALE_SOURCE, ())]
    from caffeplus.precision import bfloat16_dtype
    outs = [o for o in (numpy.dtype(numpy.float32), numpy.dtype(numpy.float16), bfloat16_dtype())
            if o is not None]
    for pixels in (numpy.uint8, numpy.float32):
        for out in outs:
            units.append(('device_transform.%s_to_%s' % (numpy.dtype(pixels).name,
                                                         numpy.dtype(out).name),
                          device_transform.kernel_source(pixels, out), ('--fmad=false',)))
    return units


def open_compiler():
    """(Compiler, include folder), or None where NVRTC or the headers are missing."""
    path, include = library_path(), include_dir()
    if path is None or include is None:
        return None
    return Compiler(path), include


def build(compiler, source, options, arch=ARCH, verbose=False):
    """CUBIN of `source` as CuPy builds it (it adds -ftz=true to every build);
    with `verbose`, (CUBIN, log with each kernel's registers)."""
    nv, include = compiler
    flags = ['--gpu-architecture=' + arch, '-ftz=true', '-I' + include] + list(options)
    if verbose:
        return nv.compile_with_log(source, flags + ['--ptxas-options=-v'])
    return nv.compile(source, flags)
