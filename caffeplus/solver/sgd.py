"""Caffe's six solvers: SGD and the five that share its ApplyUpdate.

ApplyUpdate, for every iteration:
    rate = learning rate of the policy (logged as "Iteration N, lr = X")
    clip gradients (global L2 norm over all learnable params)
    per param: normalize (1/iter_size), regularize (L2/L1 weight decay times
               decay_mult), compute the update value (the rules below, with
               local_rate = rate * lr_mult), written into the param's diff
    net.update(): data -= diff

Update rules (h, h2 history; g the gradient after regularization):
    SGD       h = local_rate*g + momentum*h;                 diff = h
    Nesterov  h' = local_rate*g + momentum*h;  diff = (1+momentum)*h' - momentum*h
    AdaGrad   h += g^2;               diff = local_rate * g / (sqrt(h) + delta)
    RMSProp   h = rms_decay*h + (1-rms_decay)*g^2;
                                      diff = local_rate * g / (sqrt(h) + delta)
    AdaDelta  h = m*h + (1-m)*g^2;  u = g * sqrt((h2 + delta) / (h + delta));
              h2 = m*h2 + (1-m)*u^2;  diff = local_rate * u
    Adam      m1 = b1*m1 + (1-b1)*g;  m2 = b2*m2 + (1-b2)*g^2;
              diff = local_rate * sqrt(1-b2^t)/(1-b1^t) * m1 / (sqrt(m2) + delta),
              t = iter + 1

Everything is float32 and in place on preallocated buffers (NumPy on the
CPU, CuPy on the GPU: the same code through the array module). On the GPU
the built-in rules instead run as one CUDA kernel over all parameters
(caffeplus.solver.gpu_kernels), data -= diff included. Unlike
Caffe, which keeps two scratch blobs (update_, temp_) per parameter, the
scratch space here is one or two flat buffers the size of the largest
parameter, shared by all parameters in turn: the solver's memory is its
history plus that, not three times the parameters.
"""
import math

import numpy

from caffeplus import backend, log
from caffeplus.blob import Blob
from caffeplus.errors import CaffeplusError
from caffeplus.solver import gpu_kernels, lr_policy
from caffeplus.solver.solver import Solver

F32 = numpy.float32


class SGDSolver(Solver):
    type = 'SGD'
    # History blobs per learnable param (AdaDelta and Adam keep two).
    history_per_param = 1
    # Shared scratch buffers the update rule needs (Nesterov, AdaDelta: two).
    scratch_buffers = 1
    # On the GPU, one kernel for all parameters (set False for the generic
    # array-module path, which the CPU always takes).
    use_fused_kernels = True

    def check_param(self, param):
        lr_policy.check_policy(param)
        if param.regularization_type not in ('L1', 'L2'):
            raise CaffeplusError('Unknown regularization type: %s (use L1 or L2)'
                                 % param.regularization_type)

    def pre_solve(self):
        params = self.net.learnable_params
        self.history = [Blob(p.shape, name='history_%d' % i)
                        for _ in range(self.history_per_param) for i, p in enumerate(params)]
        for b in self.history:
            b.data[...] = 0
        largest = max([p.count for p in params] or [1])
        # `temp` holds the shared scratch blobs (the memory tools count the
        # solver's arrays in history, update_buf and temp).
        self.temp = [Blob((largest,), name='solver_scratch_%d' % k)
                     for k in range(self.scratch_buffers)]
        self.update_buf = []

    def scratch(self, k, like):
        """Scratch buffer k as an array shaped like `like` (contents undefined)."""
        return self.temp[k].data[:like.size].reshape(like.shape)

    def history_arrays(self):
        return [b.data for b in self.history]

    # -- ApplyUpdate ---------------------------------------------------------
    def get_learning_rate(self):
        rate, self.current_step = lr_policy.learning_rate(self.param, self.iter,
                                                          self.current_step)
        return rate

    def peek_learning_rate(self):
        """This iteration's rate, with no log line and no step moved (an
        update in backward needs it before apply_update computes it)."""
        return lr_policy.learning_rate(self.param, self.iter, self.current_step, announce=False)[0]

    def applies_own_update(self):
        return type(self).apply_update is not SGDSolver.apply_update

    def apply_update(self):
        p = self.param
        rate = self.get_learning_rate()
        if p.display and self.iter % p.display == 0 and self.rank == 0:    # Caffe's root solver
            log.info('Iteration %d, lr = %g', self.iter, rate)
        in_backward = getattr(self, 'in_backward', None)
        if in_backward is not None and in_backward.pending:
            # Applied during backward (caffeplus.solver.update_in_backward);
            # what no backward wrote is updated now.
            in_backward.finish(rate)
            self.iter += 1
            return
        self.clip_gradients()
        self.update_params(range(len(self.net.learnable_params)), rate, self.update_guard)
        self.iter += 1

    def can_guard_update(self):
        # Clipping scales every gradient by their global norm before the
        # update: a check must see them before that.
        return self.param.clip_gradients < 0 and \
            type(self).apply_update is SGDSolver.apply_update and \
            type(self).update_params is SGDSolver.update_params

    def update_params(self, indices, rate, guard=None, flag=None):
        """ApplyUpdate's per-parameter part and Net::Update for the learnable
        params `indices`: normalize, regularize, the rule, data -= diff.
        `guard`: a float64 scalar (device or NumPy); nothing is updated while
        it is not finite (the NaN check of an update in backward). `flag`
        (an int32 scalar): first check these gradients; one not finite sets
        the guard to NaN and the flag to 1."""
        p = self.param
        net = self.net
        iter_norm = F32(1) / F32(p.iter_size) if p.iter_size > 1 else None
        weight_decay = F32(p.weight_decay)
        l1 = p.regularization_type == 'L1'
        params = net.learnable_params
        indices = list(indices)
        if not indices:
            return
        # On the GPU the built-in rules run as one kernel over the parameters
        # (data -= diff included); a subclass with its own
        # compute_update_value takes the generic path.
        if self.use_fused_kernels and _rule_class(self) in _FUSED and \
                backend.get_array_module(params[indices[0]].diff) is not numpy:
            self._fused_apply(indices, rate, F32(1) if iter_norm is None else iter_norm,
                              weight_decay, l1, guard, flag)
            return
        if flag is not None:
            xp = backend.get_array_module(params[indices[0]].diff)
            if not all(bool(xp.isfinite(params[i].diff).all()) for i in indices):
                guard[...] = numpy.nan
                flag[...] = 1
        if guard is not None and not numpy.isfinite(float(guard)):
            return
        for i in indices:
            param = params[i]
            data, diff = param.data, param.diff
            if iter_norm is not None:
                diff *= iter_norm
            local_decay = weight_decay * F32(net.params_weight_decay[i])
            if local_decay:
                tmp = self.scratch(0, data)
                xp = backend.get_array_module(data)
                if l1:
                    xp.sign(data, out=tmp)
                    tmp *= local_decay
                else:
                    xp.multiply(data, local_decay, out=tmp)
                diff += tmp
            local_rate = rate * F32(net.params_lr[i])
            self.compute_update_value(i, diff, local_rate)
        net.update(indices)

    def clip_gradients(self):
        clip = F32(self.param.clip_gradients)
        if clip < 0:
            return
        params = self.net.learnable_params
        sumsq = F32(0)
        on_device = None
        for param in params:
            g = param.diff.ravel()
            xp = backend.get_array_module(g)
            if xp is numpy:
                sumsq += F32(xp.dot(g, g))
            else:  # sum on the device, one transfer at the end
                d = xp.dot(g, g)
                on_device = d if on_device is None else on_device + d
        if on_device is not None:
            sumsq += F32(float(on_device))
        l2norm = F32(numpy.sqrt(sumsq))
        if l2norm > clip:
            scale = F32(clip / l2norm)
            log.info('Gradient clipping: scaling down gradients (L2 norm %g > %g) by scale '
                     'factor %g', l2norm, clip, scale)
            for param in params:
                param.diff[...] *= scale

    def _fused_apply(self, indices, rate, norm, weight_decay, l1, guard=None, flag=None):
        net = self.net
        n = len(net.learnable_params)
        key = tuple(indices)
        multi = getattr(self, '_multi', None)
        if multi is None:
            multi = self._multi = {}
        update = multi.get(key)
        if update is None:
            update = multi[key] = gpu_kernels.MultiTensorUpdate()
        params = [net.learnable_params[i] for i in key]
        h2 = [self.history[n + i] for i in key] if self.history_per_param == 2 else None
        update.prepare(params, [self.history[i] for i in key], h2,
                       [float(net.params_lr[i]) for i in key],
                       [float(net.params_weight_decay[i]) for i in key])
        if flag is not None:
            update.check(guard, flag)
        update.run(self.type, rate, norm, weight_decay, l1, *self.fused_scalars(), guard=guard)

    def fused_scalars(self):
        """The rule's constants for the GPU kernel (a, b, c, d)."""
        return (F32(self.param.momentum),)

    def compute_update_value(self, i, g, local_rate):
        h = self.history[i].data
        tmp = self.scratch(0, g)
        xp = backend.get_array_module(g)
        h *= F32(self.param.momentum)
        xp.multiply(g, local_rate, out=tmp)
        h += tmp
        g[...] = h


class NesterovSolver(SGDSolver):
    type = 'Nesterov'
    scratch_buffers = 2

    def compute_update_value(self, i, g, local_rate):
        momentum = F32(self.param.momentum)
        h = self.history[i].data
        old = self.scratch(1, g)
        tmp = self.scratch(0, g)
        xp = backend.get_array_module(g)
        old[...] = h
        h *= momentum
        xp.multiply(g, local_rate, out=tmp)
        h += tmp
        xp.multiply(h, F32(1) + momentum, out=g)
        old *= momentum
        g -= old


class AdaGradSolver(SGDSolver):
    type = 'AdaGrad'

    def check_param(self, param):
        super().check_param(param)
        if param.momentum != 0:
            raise CaffeplusError('Momentum cannot be used with AdaGrad (momentum is %g).'
                                 % param.momentum)

    def fused_scalars(self):
        return (F32(self.param.delta),)

    def compute_update_value(self, i, g, local_rate):
        h = self.history[i].data
        tmp = self.scratch(0, g)
        xp = backend.get_array_module(g)
        xp.multiply(g, g, out=tmp)
        h += tmp
        _rate_over_root(xp, g, h, tmp, F32(self.param.delta), local_rate)


def _rate_over_root(xp, g, h, tmp, delta, local_rate):
    """g = local_rate * g / (sqrt(h) + delta), in Caffe's order of float32
    operations (AdaGrad's and RMSProp's last step)."""
    xp.sqrt(h, out=tmp)
    tmp += delta
    xp.divide(g, tmp, out=tmp)
    xp.multiply(tmp, local_rate, out=g)


class RMSPropSolver(SGDSolver):
    type = 'RMSProp'

    def check_param(self, param):
        super().check_param(param)
        if param.momentum != 0:
            raise CaffeplusError('Momentum cannot be used with RMSProp (momentum is %g).'
                                 % param.momentum)
        if not 0 <= param.rms_decay < 1:
            raise CaffeplusError('rms_decay must be in [0, 1) (got %g).' % param.rms_decay)

    def fused_scalars(self):
        return (F32(self.param.delta), F32(self.param.rms_decay))

    def compute_update_value(self, i, g, local_rate):
        decay = F32(self.param.rms_decay)
        h = self.history[i].data
        tmp = self.scratch(0, g)
        xp = backend.get_array_module(g)
        xp.multiply(g, g, out=tmp)
        tmp *= F32(1) - decay
        h *= decay
        h += tmp
        _rate_over_root(xp, g, h, tmp, F32(self.param.delta), local_rate)


class AdaDeltaSolver(SGDSolver):
    type = 'AdaDelta'
    history_per_param = 2
    scratch_buffers = 2

    def fused_scalars(self):
        return (F32(self.param.delta), F32(self.param.momentum))

    def compute_update_value(self, i, g, local_rate):
        n = len(self.net.learnable_params)
        momentum = F32(self.param.momentum)
        delta = F32(self.param.delta)
        one_minus = F32(1) - momentum
        h_grad = self.history[i].data
        h_upd = self.history[n + i].data
        upd = self.scratch(1, g)
        tmp = self.scratch(0, g)
        xp = backend.get_array_module(g)
        xp.multiply(g, g, out=upd)
        upd *= one_minus
        h_grad *= momentum
        h_grad += upd
        xp.add(h_upd, delta, out=upd)
        xp.add(h_grad, delta, out=tmp)
        upd /= tmp
        xp.sqrt(upd, out=upd)
        g *= upd
        xp.multiply(g, g, out=upd)
        upd *= one_minus
        h_upd *= momentum
        h_upd += upd
        g *= local_rate


class AdamSolver(SGDSolver):
    type = 'Adam'
    history_per_param = 2

    def correction(self):
        """sqrt(1 - beta2^t) / (1 - beta1^t), t = iter + 1 (in double, as Caffe)."""
        t = self.iter + 1
        beta1 = float(F32(self.param.momentum))
        beta2 = float(F32(self.param.momentum2))
        return F32(math.sqrt(1.0 - math.pow(beta2, t)) / (1.0 - math.pow(beta1, t)))

    def fused_scalars(self):
        return (F32(self.param.delta), F32(self.param.momentum), F32(self.param.momentum2),
                self.correction())

    def compute_update_value(self, i, g, local_rate):
        n = len(self.net.learnable_params)
        beta1 = F32(self.param.momentum)
        beta2 = F32(self.param.momentum2)
        correction = self.correction()
        m = self.history[i].data
        v = self.history[n + i].data
        tmp = self.scratch(0, g)
        xp = backend.get_array_module(g)
        m *= beta1
        xp.multiply(g, F32(1) - beta1, out=tmp)
        m += tmp
        xp.multiply(g, g, out=tmp)
        tmp *= F32(1) - beta2
        v *= beta2
        v += tmp
        xp.sqrt(v, out=tmp)
        tmp += F32(self.param.delta)
        xp.divide(m, tmp, out=tmp)
        xp.multiply(tmp, F32(local_rate * correction), out=g)


SOLVERS = {cls.type: cls for cls in (SGDSolver, NesterovSolver, AdaGradSolver, RMSPropSolver,
                                     AdaDeltaSolver, AdamSolver)}
_FUSED = frozenset(SOLVERS.values())


def _rule_class(solver):
    """The class whose update rule `solver` runs: its own class, or for
    pycaffe's face of a built-in solver (caffeplus.pycaffe.pycaffe_solver_class,
    which changes nothing but the default memory plan) the built-in one."""
    cls = type(solver)
    return cls.__dict__.get('pycaffe_base', cls)
