#!/usr/bin/env python3
"""Convert a set of images to an LMDB/LevelDB of Datums (Caffe's convert_imageset).

    python tools/convert_imageset.py [FLAGS] ROOTFOLDER/ LISTFILE DB_NAME

Same as `caffeplus convert_imageset`; see caffeplus/commands/convert_imageset.py.
"""
import os
import sys

try:
    import caffeplus  # noqa: F401
except ImportError:  # run from a source checkout that is not installed
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from caffeplus.commands.convert_imageset import main  # noqa: E402

if __name__ == '__main__':
    sys.exit(main())
