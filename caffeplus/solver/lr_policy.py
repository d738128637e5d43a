"""Caffe's learning-rate policies (SGDSolver::GetLearningRate).

The rate is a float32 as in Caffe. Where Caffe's C++ raises a float to an
integer power (step, exp, multistep) the standard library promotes to double,
so we do the same; where both operands are float (inv, poly, sigmoid) the
arithmetic stays in float32.

    fixed      base_lr
    step       base_lr * gamma ^ floor(iter / stepsize)
    exp        base_lr * gamma ^ iter
    inv        base_lr * (1 + gamma * iter) ^ (-power)
    multistep  base_lr * gamma ^ current_step, current_step advancing past
               each stepvalue (one step per call, as Caffe)
    poly       base_lr * (1 - iter / max_iter) ^ power
    sigmoid    base_lr * 1 / (1 + exp(-gamma * (iter - stepsize)))

NVCaffe's `min_lr` (default 0) is a floor under every policy's rate: its
FP16 solvers give it as the rate a `poly` schedule ends at.
"""
import math

import numpy

from caffeplus import log
from caffeplus.errors import CaffeplusError

F32 = numpy.float32
POLICIES = ('fixed', 'step', 'exp', 'inv', 'multistep', 'poly', 'sigmoid')


def check_policy(param):
    """Raise CaffeplusError for settings Caffe would abort on."""
    policy = param.lr_policy
    if policy not in POLICIES:
        raise CaffeplusError("Unknown learning rate policy: '%s' (known: %s)"
                             % (policy, ', '.join(POLICIES)))
    if policy in ('step', 'sigmoid') and param.stepsize <= 0:
        raise CaffeplusError("lr_policy '%s' needs stepsize > 0 (got %d)"
                             % (policy, param.stepsize))
    if policy in ('step', 'exp', 'inv', 'sigmoid') and param.gamma < 0:
        raise CaffeplusError("lr_policy '%s' needs gamma >= 0 (got %g)" % (policy, param.gamma))
    if param.min_lr < 0:
        raise CaffeplusError('min_lr must be >= 0 (got %g)' % param.min_lr)


def learning_rate(param, it, current_step, announce=True):
    """(rate as numpy.float32, new current_step) for iteration `it`
    (`announce`: log multistep's move to the next step, as Caffe)."""
    policy = param.lr_policy
    base_lr = F32(param.base_lr)
    if policy == 'fixed':
        rate = base_lr
    elif policy == 'step':
        current_step = it // param.stepsize
        rate = F32(float(base_lr) * math.pow(float(F32(param.gamma)), current_step))
    elif policy == 'exp':
        rate = F32(float(base_lr) * math.pow(float(F32(param.gamma)), it))
    elif policy == 'inv':
        with numpy.errstate(all='ignore'):
            base = F32(1) + F32(param.gamma) * F32(it)
            rate = base_lr * numpy.power(base, -F32(param.power), dtype=F32)
    elif policy == 'multistep':
        if current_step < len(param.stepvalue) and it >= param.stepvalue[current_step]:
            current_step += 1
            if announce:
                log.info('MultiStep Status: Iteration %d, step = %d', it, current_step)
        rate = F32(float(base_lr) * math.pow(float(F32(param.gamma)), current_step))
    elif policy == 'poly':
        with numpy.errstate(all='ignore'):
            frac = F32(1) - F32(it) / F32(param.max_iter)
            rate = base_lr * numpy.power(frac, F32(param.power), dtype=F32)
    elif policy == 'sigmoid':
        with numpy.errstate(all='ignore'):
            z = -F32(param.gamma) * (F32(it) - F32(param.stepsize))
            rate = base_lr * (F32(1) / (F32(1) + numpy.exp(z, dtype=F32)))
    else:
        check_policy(param)
        raise AssertionError(policy)
    if param.min_lr > 0 and rate < F32(param.min_lr):
        rate = F32(param.min_lr)
    return F32(rate), current_step
