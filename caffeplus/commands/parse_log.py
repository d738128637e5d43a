"""caffeplus parse_log: Caffe's tools/extra/parse_log.py, a training log to CSV.

    caffeplus parse_log LOGFILE OUTPUT_DIR [--delimiter ,] [--verbose]

Writes OUTPUT_DIR/<log name>.train and .test, one row per iteration that
logged net outputs: NumIters, Seconds (since the "Solving" line),
LearningRate, then one column per output ("loss", "accuracy", ...), in
Caffe's CSV layout. Reads stock Caffe logs and caffeplus's (the same glog
line format, with or without the year in the timestamp: I1122 or I20261122).

Differences from the stock script, where it is wrong:
  * LearningRate is the rate logged for the row's own iteration ("Iteration
    N, lr = X" comes after the outputs of iteration N, so the stock script
    gives each row the previous iteration's rate);
  * a run with a single test or train row keeps it, and a second test net
    in the same iteration starts a new row instead of overwriting the first.

Python API, as the stock script's:
    train_rows, test_rows = parse_log('train.log')
    save_csv_files('train.log', 'out/', train_rows, test_rows)
"""
import collections
import csv
import datetime
import os
import re
import sys

from caffeplus.errors import CaffeplusError

_NUMBER = r'([-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?|[-+]?nan|[-+]?inf)'
REGEX_ITERATION = re.compile(r'Iteration (\d+)')
REGEX_TRAIN_OUTPUT = re.compile(r'Train net output #(\d+): (\S+) = ' + _NUMBER)
REGEX_TEST_OUTPUT = re.compile(r'Test net output #(\d+): (\S+) = ' + _NUMBER)
REGEX_LEARNING_RATE = re.compile(r'Iteration (\d+), lr = ' + _NUMBER)
REGEX_LR_ANY = re.compile(r'\blr = ' + _NUMBER)
REGEX_TESTING = re.compile(r'Iteration (\d+), Testing net \(#(\d+)\)')
# glog: severity, [yyyy]mmdd, hh:mm:ss.micro
REGEX_TIME = re.compile(r'^[IWEF](\d{8}|\d{4}) +(\d{1,2}):(\d{2}):(\d{2})(?:\.(\d{1,6}))?')


def add_arguments(parser):
    parser.add_argument('logfile_path', help='path to the log file')
    parser.add_argument('output_dir', help='directory in which to place the output CSV files')
    parser.add_argument('--verbose', action='store_true',
                        help='print some extra info (e.g., output filenames)')
    parser.add_argument('--delimiter', default=',',
                        help='column delimiter in output files (default: \',\')')


def get_log_created_year(path):
    """The year the log was written, for timestamps without one (stock's guess)."""
    return datetime.datetime.fromtimestamp(os.path.getmtime(path)).year


def extract_datetime_from_line(line, year):
    """The datetime of a glog line; ValueError if it has no timestamp."""
    m = REGEX_TIME.match(line.strip())
    if not m:
        raise ValueError('no glog timestamp')
    date = m.group(1)
    if len(date) == 8:
        year, month, day = int(date[:4]), int(date[4:6]), int(date[6:])
    else:
        month, day = int(date[:2]), int(date[2:])
    micros = int((m.group(5) or '0').ljust(6, '0'))
    return datetime.datetime(year, month, day, int(m.group(2)), int(m.group(3)),
                             int(m.group(4)), micros)


def _float(text):
    return float(text)


class _Rows:
    """Rows of one kind (train or test): a new row per iteration, or when an
    output name repeats within the iteration (a second test net)."""

    def __init__(self):
        self.rows = []
        self.current = None

    def add(self, iteration, seconds, lr, name, value):
        row = self.current
        if row is None or row['NumIters'] != iteration or name in row:
            row = collections.OrderedDict([('NumIters', iteration), ('Seconds', seconds),
                                           ('LearningRate', lr)])
            self.rows.append(row)
            self.current = row
        row[name] = value


def parse_log(path_to_log):
    """(train_rows, test_rows): lists of OrderedDicts with NumIters, Seconds,
    LearningRate and one entry per net output."""
    try:
        f = open(path_to_log, encoding='utf-8', errors='replace')
    except FileNotFoundError:
        raise CaffeplusError('log file not found: %s' % path_to_log)
    except OSError as exc:
        raise CaffeplusError('cannot read %s: %s' % (path_to_log, exc.strerror or exc))
    year = get_log_created_year(path_to_log)
    with f:
        lines = f.read().splitlines()

    # The start: the "Solving" line, else the first timestamped line.
    start_time = None
    for line in lines:
        if 'Solving' in line:
            try:
                start_time = extract_datetime_from_line(line, year)
                break
            except ValueError:
                continue
    if start_time is None:
        for line in lines:
            try:
                start_time = extract_datetime_from_line(line, year)
                break
            except ValueError:
                continue
    if start_time is None:
        return [], []

    lr_by_iter = {}
    last_lr = float('nan')
    iteration = -1
    last_time = start_time
    train, test = _Rows(), _Rows()
    for line in lines:
        m = REGEX_ITERATION.search(line)
        if m:
            iteration = float(m.group(1))
        if iteration == -1:
            continue
        stamp = REGEX_TIME.match(line.strip())
        if not stamp:
            continue              # not a log line (a wrapped message, a traceback)
        try:
            when = extract_datetime_from_line(line, year)
            if len(stamp.group(1)) == 4 and when.month < last_time.month:
                year += 1         # a log without years running into January
                when = extract_datetime_from_line(line, year)
        except ValueError:
            continue
        last_time = when
        seconds = (when - start_time).total_seconds()
        m = REGEX_LEARNING_RATE.search(line)
        if m:
            last_lr = _float(m.group(2))
            lr_by_iter[float(m.group(1))] = last_lr
        elif REGEX_LR_ANY.search(line):
            last_lr = _float(REGEX_LR_ANY.search(line).group(1))
            lr_by_iter.setdefault(iteration, last_lr)
        for rows, regex in ((train, REGEX_TRAIN_OUTPUT), (test, REGEX_TEST_OUTPUT)):
            m = regex.search(line)
            if m:
                rows.add(iteration, seconds, last_lr, m.group(2), _float(m.group(3)))

    # Each row's rate: the one logged for its iteration, else the latest before it.
    known = sorted(lr_by_iter.items())

    def rate_for(it, fallback):
        if it in lr_by_iter:
            return lr_by_iter[it]
        before = [lr for i, lr in known if i <= it]
        if before:
            return before[-1]
        return known[0][1] if known else fallback
    for rows in (train.rows, test.rows):
        for row in rows:
            row['LearningRate'] = rate_for(row['NumIters'], row['LearningRate'])
    return train.rows, test.rows


class _Dialect(csv.excel):
    pass


def write_csv(output_filename, dict_list, delimiter=',', verbose=False):
    """Write rows as CSV (Caffe's layout: csv.excel with the given delimiter)."""
    if not dict_list:
        if verbose:
            print('Not writing %s; no lines to write' % output_filename)
        return
    fieldnames = []
    for row in dict_list:
        for key in row:
            if key not in fieldnames:
                fieldnames.append(key)
    dialect = type('CaffeDialect', (_Dialect,), {'delimiter': delimiter})
    with open(output_filename, 'w', newline='') as f:
        writer = csv.DictWriter(f, fieldnames=fieldnames, dialect=dialect, restval='')
        writer.writeheader()
        writer.writerows(dict_list)
    if verbose:
        print('Wrote %s' % output_filename)


def save_csv_files(logfile_path, output_dir, train_dict_list, test_dict_list,
                   delimiter=',', verbose=False):
    """Write <output_dir>/<log name>.train and .test."""
    base = os.path.basename(logfile_path)
    write_csv(os.path.join(output_dir, base + '.train'), train_dict_list, delimiter, verbose)
    write_csv(os.path.join(output_dir, base + '.test'), test_dict_list, delimiter, verbose)


def run(args):
    if not os.path.isdir(args.output_dir):
        raise CaffeplusError('output directory not found: %s' % args.output_dir)
    delimiter = args.delimiter
    if delimiter in ('\\t', 'tab'):
        delimiter = '\t'
    if len(delimiter) != 1:
        raise CaffeplusError('the delimiter must be one character, not %r' % args.delimiter)
    train_rows, test_rows = parse_log(args.logfile_path)
    save_csv_files(args.logfile_path, args.output_dir, train_rows, test_rows,
                   delimiter=delimiter, verbose=args.verbose)
    return 0


def main(argv=None):
    from caffeplus import cli
    return cli.main(['parse_log'] + list(sys.argv[1:] if argv is None else argv))
