#!/usr/bin/env python3
"""Draw a net diagram (pycaffe's python/draw_net.py).

    python tools/draw_net.py [--rankdir LR|TB|BT|RL] [--phase TRAIN|TEST|ALL] [--display_lrm] NET.prototxt OUT.png

Same as `caffeplus draw_net`; see caffeplus/commands/draw_net.py.
"""
import os
import sys

try:
    import caffeplus  # noqa: F401
except ImportError:  # run from a source checkout that is not installed
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from caffeplus.commands.draw_net import main  # noqa: E402

if __name__ == '__main__':
    sys.exit(main())
