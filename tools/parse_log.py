#!/usr/bin/env python3
"""Parse a Caffe/caffeplus training log into CSV files (Caffe's tools/extra/parse_log.py).

    python tools/parse_log.py LOGFILE OUTPUT_DIR [--delimiter ,] [--verbose]

Writes OUTPUT_DIR/<log name>.train and .test. As a module it offers the
stock script's functions: parse_log(path) -> (train_rows, test_rows),
save_csv_files(...), write_csv(...). See caffeplus/commands/parse_log.py.
"""
import os
import sys

try:
    import caffeplus  # noqa: F401
except ImportError:  # run from a source checkout that is not installed
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from caffeplus.commands.parse_log import (extract_datetime_from_line,  # noqa: E402,F401
                                          get_log_created_year, main, parse_log,
                                          save_csv_files, write_csv)

if __name__ == '__main__':
    sys.exit(main())
