#!/usr/bin/env python3
"""Extract features of net blobs into databases (Caffe's extract_features).

    python tools/extract_features.py WEIGHTS MODEL BLOB[,BLOB...] DB[,DB...] NUM_MINI_BATCHES lmdb|leveldb [CPU|GPU] [DEVICE_ID]

Same as `caffeplus extract_features`; see caffeplus/commands/extract_features.py.
"""
import os
import sys

try:
    import caffeplus  # noqa: F401
except ImportError:  # run from a source checkout that is not installed
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from caffeplus.commands.extract_features import main  # noqa: E402

if __name__ == '__main__':
    sys.exit(main())
