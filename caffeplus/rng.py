"""The one random stream behind fillers, dropout, shuffles and crops.

Caffe seeds a single generator with `random_seed` (or the clock); caffeplus
does the same so a seeded run repeats exactly. Its state can be saved and
restored so a resumed run continues the same stream.
"""
import os
import time

import numpy

_gen = {'rng': numpy.random.default_rng(), 'seed': None}


def set_random_seed(seed):
    seed = int(seed)
    if seed < 0:
        seed = (int(time.time() * 1e6) ^ os.getpid()) & 0xFFFFFFFF
    _gen['rng'] = numpy.random.default_rng(seed)
    _gen['seed'] = seed


def get():
    """The current numpy Generator."""
    return _gen['rng']


def get_state():
    return _gen['rng'].bit_generator.state


def set_state(state):
    _gen['rng'].bit_generator.state = state
