#!/usr/bin/env python3
"""Plot training logs as charts (Caffe's tools/extra/plot_training_log.py, with matplotlib).

    python tools/plot_training_log.py CHART_TYPE OUT.png LOG [LOG ...]

Chart types: 0 test accuracy vs iters, 1 test accuracy vs seconds, 2 test
loss vs iters, 3 test loss vs seconds, 4 train learning rate vs iters,
5 train learning rate vs seconds, 6 train loss vs iters, 7 train loss vs
seconds. See caffeplus/commands/plot_training_log.py.
"""
import os
import sys

try:
    import caffeplus  # noqa: F401
except ImportError:  # run from a source checkout that is not installed
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from caffeplus.commands.plot_training_log import (chart_data, get_supported_chart_types,  # noqa: E402,F401
                                                  main, plot_chart)

if __name__ == '__main__':
    sys.exit(main())
