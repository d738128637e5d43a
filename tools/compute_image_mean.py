#!/usr/bin/env python3
"""Compute the mean image of a Datum database (Caffe's compute_image_mean).

    python tools/compute_image_mean.py [--backend lmdb] INPUT_DB [OUTPUT_FILE]

Same as `caffeplus compute_image_mean`; see caffeplus/commands/compute_image_mean.py.
"""
import os
import sys

try:
    import caffeplus  # noqa: F401
except ImportError:  # run from a source checkout that is not installed
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from caffeplus.commands.compute_image_mean import main  # noqa: E402

if __name__ == '__main__':
    sys.exit(main())
