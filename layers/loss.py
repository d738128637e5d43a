"""Loss layers: SoftmaxWithLoss, SigmoidCrossEntropyLoss, EuclideanLoss,
HingeLoss, ContrastiveLoss, InfogainLoss and MultinomialLogisticLoss.

Every layer reproduces stock Caffe's arithmetic (its clamps, normalizers and
float32 constants) and its construction rules. Deliberate differences:

* none of them keeps an internal copy of an intermediate (Caffe's prob,
  sigmoid output, difference or margin buffers): backward recomputes it from
  the bottom data, which it must keep anyway for the labels. That spends no
  memory between forward and backward beyond what the memory planner sees.
  (For HingeLoss this also means no reliance on bottom[0].diff holding the
  margins between forward and backward, README quirk 3.)
* an out-of-range label raises NetError naming the layer and the value where
  Caffe would read outside its arrays (it checks labels in debug builds only).
* InfogainLoss declares its H bottom (bottom 2) as taking no gradient, so
  force_backward leaves it alone where Caffe aborts (README quirk 11).

The gradient of each loss is scaled by its top's diff, which the net (or a
caller) has filled with the loss weight, as Caffe does.
"""
import numpy

from caffeplus import backend
from caffeplus.errors import CaffeplusError, NetError
from caffeplus.functions import softmax
from caffeplus.layer import LossLayer, register
from caffeplus.proto import caffe_pb2

_LP = caffe_pb2.LossParameter
FULL, VALID, BATCH_SIZE, NONE = _LP.FULL, _LP.VALID, _LP.BATCH_SIZE, _LP.NONE
# log() clamps: SoftmaxWithLoss uses FLT_MIN; InfogainLoss and
# MultinomialLogisticLoss use Caffe's kLOG_THRESHOLD, 1e-20 as a float.
FLT_MIN = numpy.float32(numpy.finfo(numpy.float32).tiny)
LOG_THRESHOLD = numpy.float32(1e-20)


def normalization_mode(layer_param, default):
    """loss_param.normalization if set, else the legacy `normalize` bool
    (true: VALID, false: BATCH_SIZE), else `default`."""
    lp = layer_param.loss_param
    if lp.HasField('normalization'):
        return lp.normalization
    if lp.HasField('normalize'):
        return VALID if lp.normalize else BATCH_SIZE
    return default


def normalizer(mode, outer_num, inner_num, valid_count):
    """Caffe's LossLayer::GetNormalizer: the divisor, at least 1, as a float32."""
    if mode == FULL:
        n = outer_num * inner_num
    elif mode == VALID:
        n = outer_num * inner_num if valid_count < 0 else valid_count
    elif mode == BATCH_SIZE:
        n = outer_num
    elif mode == NONE:
        n = 1
    else:
        raise NetError('unknown loss_param.normalization mode %r' % (mode,))
    return numpy.float32(max(1.0, float(n)))


def _top_weight(top):
    """top[0].diff's first value (the loss weight during a net's backward), as
    a 0-d float32 array on the top's device: no host synchronisation."""
    return top[0].diff.reshape(-1)[0:1].reshape(())


class _Loss(LossLayer):
    backward_reads = frozenset(('bottom_data',))
    # Bottoms that never take a gradient (Caffe aborts if asked to).
    no_gradient_bottoms = (1,)
    no_gradient_names = {1: 'label'}

    def _fail(self, what):
        raise NetError('layer %s (%s): %s' % (self.layer_param.name, self.layer_param.type, what))

    def allow_force_backward(self, bottom_index):
        return bottom_index not in self.no_gradient_bottoms

    def _check_propagate(self, propagate_down):
        for i in self.no_gradient_bottoms:
            if i < len(propagate_down) and propagate_down[i]:
                self._fail('cannot back-propagate to %s inputs (bottom %d)'
                           % (self.no_gradient_names.get(i, 'these'), i))

    def _canonical_axis(self, blob, axis, field):
        try:
            return blob.canonical_axis_index(axis)
        except CaffeplusError:
            self._fail('%s %d is out of range for bottom %s of shape %s'
                       % (field, axis, blob.name, blob.shape_string()))

    def _legacy(self, blob, what):
        """Caffe's num/channels/height/width accessors refuse > 4 axes."""
        if blob.num_axes > 4:
            self._fail('%s %s has %d axes; this layer reads it through Caffe\'s 4-D '
                       'num/channels/height/width accessors, which allow at most 4'
                       % (what, blob.shape_string(), blob.num_axes))
        return blob

    def _normalizer(self, valid):
        """The divisor for self.normalization; `valid` is the mask of counted
        positions (None: all of outer_num x inner_num)."""
        count = self.outer_num * self.inner_num if valid is None else int(valid.sum())
        return normalizer(self.normalization, self.outer_num, self.inner_num, count)

    def _int_labels(self, label, num_classes, ignore_label=None):
        """Labels cast to int as C++'s static_cast does (toward zero), with the
        mask of the ones that count (None: all). Non-ignored labels outside
        [0, num_classes) are an error. Ignored positions read label 0."""
        xp = backend.get_array_module(label)
        with numpy.errstate(invalid='ignore'):
            lab = label.astype(xp.int64)
        valid = None if ignore_label is None else lab != ignore_label
        bad = (lab < 0) | (lab >= num_classes)
        if valid is not None:
            bad &= valid
        if bool(bad.any()):
            value = float(backend.to_numpy(label[bad].ravel()[:1])[0])
            self._fail('label value %g is out of range: labels must be integers in '
                       '[0, %d)%s' % (value, num_classes,
                                      '' if ignore_label is None else
                                      ' or loss_param.ignore_label (%d)' % ignore_label))
        if valid is not None:
            lab = xp.where(valid, lab, 0)
        return lab, valid


class _SoftmaxLoss(_Loss):
    """Shared by SoftmaxWithLoss and InfogainLoss: softmax along an axis of
    bottom 0, labels of shape outer x inner, ignore_label, normalization."""

    def _read_loss_param(self):
        lp = self.layer_param.loss_param
        self.ignore_label = lp.ignore_label if lp.HasField('ignore_label') else None
        self.normalization = normalization_mode(self.layer_param, VALID)

    def _reshape_softmax(self, bottom, top, axis, field):
        super().reshape(bottom, top)
        self.axis = self._canonical_axis(bottom[0], axis, field)
        self.outer_num = bottom[0].count_axes(0, self.axis)
        self.inner_num = bottom[0].count_axes(self.axis + 1)
        self.num_classes = bottom[0].shape[self.axis]
        if self.num_classes == 0:
            self._fail('the softmax axis (%s %d) of the prediction shape %s is empty: there '
                       'are no classes to normalize over or to pick a label from'
                       % (field, axis, bottom[0].shape_string()))
        if self.outer_num * self.inner_num != bottom[1].count:
            self._fail('number of labels must match number of predictions: with %s %d and '
                       'prediction shape %s the label count must be %d, with integer values '
                       'in [0, %d); the label shape is %s'
                       % (field, axis, bottom[0].shape_string(),
                          self.outer_num * self.inner_num, self.num_classes,
                          bottom[1].shape_string()))
        if len(top) >= 2:
            top[1].reshape(bottom[0].shape)

    def _prob_labels(self, bottom):
        x = bottom[0].data
        if x.dtype != numpy.float32:
            x = x.astype(numpy.float32)     # 16-bit scores: the softmax's sums in float32
        prob = softmax(x, self.axis).reshape(self.outer_num, self.num_classes, self.inner_num)
        label = bottom[1].data.reshape(self.outer_num, self.inner_num)
        lab, valid = self._int_labels(label, self.num_classes, self.ignore_label)
        return prob, lab, valid


@register
class SoftmaxWithLossLayer(_SoftmaxLoss):
    """Multinomial logistic loss of the softmax of bottom 0 (scores) for the
    integer labels of bottom 1, softmax along softmax_param.axis."""
    type = 'SoftmaxWithLoss'
    exact_num_top = -1
    min_num_top = 1
    max_num_top = 2

    def layer_setup(self, bottom, top):
        # Caffe builds an internal Softmax layer from a copy of this layer's
        # parameters, loss weights included (the default weight 1 is already
        # there): that single-top layer accepts exactly one loss_weight. With
        # a second top the outer check (one weight per top) then fails, so a
        # two-top SoftmaxWithLoss never builds in stock Caffe (README quirk 1).
        n = len(self.layer_param.loss_weight)
        if n != 1:
            self._fail('loss_weight must be unspecified or specified once per top blob '
                       '(the internal Softmax layer has 1 top, %d loss_weight given)' % n)
        self._read_loss_param()

    def reshape(self, bottom, top):
        self._reshape_softmax(bottom, top, self.layer_param.softmax_param.axis,
                              'softmax_param.axis')

    def _forward(self, bottom, top):
        xp = backend.get_array_module(bottom[0].data)
        prob, lab, valid = self._prob_labels(bottom)
        picked = xp.take_along_axis(prob, lab[:, None, :], axis=1)[:, 0, :]
        logp = xp.log(xp.maximum(picked, FLT_MIN))
        if valid is not None:
            logp = xp.where(valid, logp, 0)
        loss = -logp.sum(dtype=numpy.float64)
        top[0].data[...] = loss / self._normalizer(valid)
        if len(top) >= 2:
            top[1].data[...] = prob.reshape(top[1].shape)

    def _backward(self, top, propagate_down, bottom):
        self._check_propagate(propagate_down)
        if not propagate_down[0]:
            return
        xp = backend.get_array_module(bottom[0].data)
        prob, lab, valid = self._prob_labels(bottom)
        stored = bottom[0].diff.reshape(prob.shape)
        # A 16-bit gradient is computed in float32 and rounded once.
        diff = stored if stored.dtype == numpy.float32 else prob
        if diff is not prob:
            diff[...] = prob
        classes = xp.arange(self.num_classes).reshape(1, -1, 1)
        diff -= (classes == lab[:, None, :])
        if valid is not None:
            diff *= valid[:, None, :]
        diff *= _top_weight(top) / self._normalizer(valid)
        if diff is not stored:
            stored[...] = diff


@register
class SigmoidCrossEntropyLossLayer(_Loss):
    """Cross-entropy of sigmoid(bottom 0) against targets in [0, 1] (bottom 1),
    normalized by the batch size unless loss_param says otherwise (quirk 6)."""
    type = 'SigmoidCrossEntropyLoss'

    def layer_setup(self, bottom, top):
        lp = self.layer_param.loss_param
        self.ignore_label = lp.ignore_label if lp.HasField('ignore_label') else None
        self.normalization = normalization_mode(self.layer_param, BATCH_SIZE)

    def reshape(self, bottom, top):
        super().reshape(bottom, top)
        if bottom[0].count != bottom[1].count:
            self._fail('inputs must have the same count (%s vs %s)'
                       % (bottom[0].shape_string(), bottom[1].shape_string()))
        self.outer_num = bottom[0].shape[0] if bottom[0].num_axes else 1
        self.inner_num = bottom[0].count_axes(1)

    def _valid(self, target):
        if self.ignore_label is None:
            return None
        xp = backend.get_array_module(target)
        with numpy.errstate(invalid='ignore'):
            return target.astype(xp.int64) != self.ignore_label

    def _forward(self, bottom, top):
        x, t = bottom[0].data, bottom[1].data
        xp = backend.get_array_module(x)
        pos = (x >= 0).astype(x.dtype)
        term = x * (t - pos) - xp.log(1 + xp.exp(x - 2 * x * pos))
        valid = self._valid(t)
        if valid is not None:
            term = xp.where(valid, term, 0)
        top[0].data[...] = -term.sum(dtype=numpy.float64) / self._normalizer(valid)

    def _backward(self, top, propagate_down, bottom):
        self._check_propagate(propagate_down)
        if not propagate_down[0]:
            return
        x, t = bottom[0].data, bottom[1].data
        xp = backend.get_array_module(x)
        diff = bottom[0].diff
        # Caffe's Sigmoid layer: 0.5 * tanh(0.5 x) + 0.5
        diff[...] = 0.5 * xp.tanh(0.5 * x) + 0.5
        diff -= t
        valid = self._valid(t)
        if valid is not None:
            diff *= valid
        diff *= _top_weight(top) / self._normalizer(valid)


@register
class EuclideanLossLayer(_Loss):
    """sum((bottom0 - bottom1)^2) / num / 2; gradients to both bottoms."""
    type = 'EuclideanLoss'
    no_gradient_bottoms = ()

    def reshape(self, bottom, top):
        super().reshape(bottom, top)
        if bottom[0].count_axes(1) != bottom[1].count_axes(1):
            self._fail('inputs must have the same dimension (%s vs %s)'
                       % (bottom[0].shape_string(), bottom[1].shape_string()))
        self.num = self._legacy(bottom[0], 'bottom 0').num

    def _forward(self, bottom, top):
        d = bottom[0].data - bottom[1].data.reshape(bottom[0].shape)
        top[0].data[...] = (d * d).sum(dtype=numpy.float64) / self.num / 2

    def _backward(self, top, propagate_down, bottom):
        if not any(propagate_down[:2]):
            return
        d = bottom[0].data - bottom[1].data.reshape(bottom[0].shape)
        w = _top_weight(top) / numpy.float32(self.num)
        if propagate_down[0]:
            bottom[0].diff[...] = w * d
        if propagate_down[1]:
            bottom[1].diff[...] = (-w * d).reshape(bottom[1].shape)


@register
class HingeLossLayer(_Loss):
    """One-vs-all hinge loss: sum over j of max(0, 1 - s_j x_j)^p / num, with
    s_j = 1 for the label, -1 otherwise, p = 1 (L1) or 2 (L2)."""
    type = 'HingeLoss'

    def layer_setup(self, bottom, top):
        self.norm = self.layer_param.hinge_loss_param.norm
        if self.norm not in (caffe_pb2.HingeLossParameter.L1, caffe_pb2.HingeLossParameter.L2):
            self._fail('unknown hinge_loss_param.norm %r' % (self.norm,))

    def reshape(self, bottom, top):
        super().reshape(bottom, top)
        self.num = self._legacy(bottom[0], 'bottom 0').num
        self.dim = bottom[0].count // self.num if self.num else 0
        if bottom[1].count < self.num:
            self._fail('needs %d labels, bottom 1 %s holds %d'
                       % (self.num, bottom[1].shape_string(), bottom[1].count))

    def _signed_margins(self, bottom):
        """(sign, max(0, 1 + sign * x)) with sign -1 at the label, +1 elsewhere."""
        xp = backend.get_array_module(bottom[0].data)
        x = bottom[0].data.reshape(self.num, self.dim)
        lab, _ = self._int_labels(bottom[1].data.reshape(-1)[:self.num], self.dim)
        at_label = xp.arange(self.dim)[None, :] == lab[:, None]
        sign = xp.where(at_label, numpy.float32(-1), numpy.float32(1))
        return sign, xp.maximum(0, 1 + sign * x)

    def _forward(self, bottom, top):
        _, m = self._signed_margins(bottom)
        if self.norm == caffe_pb2.HingeLossParameter.L1:
            loss = m.sum(dtype=numpy.float64)
        else:
            loss = (m * m).sum(dtype=numpy.float64)
        top[0].data[...] = loss / self.num

    def _backward(self, top, propagate_down, bottom):
        self._check_propagate(propagate_down)
        if not propagate_down[0]:
            return
        xp = backend.get_array_module(bottom[0].data)
        sign, m = self._signed_margins(bottom)
        d = sign * m
        w = _top_weight(top)
        if self.norm == caffe_pb2.HingeLossParameter.L1:
            g = xp.sign(d) * (w / numpy.float32(self.num))
        else:
            g = d * (w * 2 / numpy.float32(self.num))
        bottom[0].diff[...] = g.reshape(bottom[0].shape)


@register
class ContrastiveLossLayer(_Loss):
    """Contrastive loss of feature pairs (bottoms 0, 1) with a similarity flag
    (bottom 2): d^2 for similar pairs, max(margin - d, 0)^2 for dissimilar ones
    (legacy_version: max(margin - d^2, 0)), summed and divided by 2 num."""
    type = 'ContrastiveLoss'
    exact_num_bottom = 3
    no_gradient_bottoms = (2,)
    no_gradient_names = {2: 'similarity'}

    def layer_setup(self, bottom, top):
        p = self.layer_param.contrastive_loss_param
        self.margin = numpy.float32(p.margin)
        self.legacy = p.legacy_version

    def reshape(self, bottom, top):
        super().reshape(bottom, top)
        a = self._legacy(bottom[0], 'bottom 0')
        b = self._legacy(bottom[1], 'bottom 1')
        y = self._legacy(bottom[2], 'bottom 2')
        if a.channels != b.channels:
            self._fail('bottoms 0 and 1 must have the same channels (%s vs %s)'
                       % (a.shape_string(), b.shape_string()))
        for what, blob in (('bottom 0', a), ('bottom 1', b)):
            if blob.height != 1 or blob.width != 1:
                self._fail('%s must have height and width 1, got %s'
                           % (what, blob.shape_string()))
        if y.channels != 1 or y.height != 1 or y.width != 1:
            self._fail('bottom 2 (the similarity flags) must be N x 1 x 1 x 1, got %s'
                       % y.shape_string())
        if y.num != a.num:
            self._fail('bottom 2 must hold one similarity flag per pair (%d), got %s'
                       % (a.num, y.shape_string()))
        self.num, self.channels = a.num, a.channels

    def _terms(self, bottom):
        xp = backend.get_array_module(bottom[0].data)
        d = (bottom[0].data.reshape(self.num, self.channels) -
             bottom[1].data.reshape(self.num, self.channels))
        dist_sq = (d * d).sum(axis=1)
        with numpy.errstate(invalid='ignore'):
            similar = bottom[2].data.reshape(self.num).astype(xp.int64) != 0
        return xp, d, dist_sq, similar

    def _forward(self, bottom, top):
        xp, d, dist_sq, similar = self._terms(bottom)
        if self.legacy:
            dissimilar = xp.maximum(self.margin - dist_sq, 0)
        else:
            dissimilar = xp.maximum(self.margin - xp.sqrt(dist_sq), 0) ** 2
        loss = xp.where(similar, dist_sq, dissimilar).sum(dtype=numpy.float64)
        top[0].data[...] = loss / self.num / 2

    def _backward(self, top, propagate_down, bottom):
        self._check_propagate(propagate_down)
        if not any(propagate_down[:2]):
            return
        xp, d, dist_sq, similar = self._terms(bottom)
        if self.legacy:
            mdist = self.margin - dist_sq
            dissimilar = -1                       # times alpha below
        else:
            dist = xp.sqrt(dist_sq)
            mdist = self.margin - dist
            dissimilar = -mdist / (dist + numpy.float32(1e-4))
        coef = xp.where(similar, numpy.float32(1),
                        xp.where(mdist > 0, dissimilar, numpy.float32(0)))
        coef = coef.astype(numpy.float32)[:, None]
        alpha = _top_weight(top) / numpy.float32(self.num)
        for i, sign in ((0, 1), (1, -1)):
            if propagate_down[i]:
                bottom[i].diff[...] = ((sign * alpha) * coef * d).reshape(bottom[i].shape)


@register
class InfogainLossLayer(_SoftmaxLoss):
    """Infogain loss: -sum_l H[label, l] log(softmax(bottom 0)_l), with H from
    infogain_loss_param.source or bottom 2 (README quirk 7: the softmax is
    applied here; bottom 0 holds scores)."""
    type = 'InfogainLoss'
    exact_num_bottom = -1
    min_num_bottom = 2
    max_num_bottom = 3
    exact_num_top = -1
    min_num_top = 1
    max_num_top = 2
    no_gradient_bottoms = (1, 2)
    no_gradient_names = {1: 'label', 2: 'infogain'}

    def layer_setup(self, bottom, top):
        self._read_loss_param()
        self._infogain = None
        self._infogain_xp = None
        if len(bottom) < 3:
            source = self.layer_param.infogain_loss_param.source
            if not self.layer_param.infogain_loss_param.HasField('source') or not source:
                self._fail('infogain matrix source must be specified '
                           '(infogain_loss_param.source, or a third bottom)')
            from caffeplus.io.blobproto import read_mean
            try:
                self._infogain = numpy.asarray(read_mean(source), dtype=numpy.float32)
            except CaffeplusError as exc:
                self._fail('cannot read infogain_loss_param.source: %s' % exc)

    def reshape(self, bottom, top):
        self._reshape_softmax(bottom, top, self.layer_param.infogain_loss_param.axis,
                              'infogain_loss_param.axis')
        count = bottom[2].count if len(bottom) >= 3 else self._infogain.size
        what = 'bottom 2 %s' % bottom[2].shape_string() if len(bottom) >= 3 else \
            'the matrix in infogain_loss_param.source (%d values)' % count
        if count != self.num_classes * self.num_classes:
            self._fail('the infogain matrix must be %d x %d (the size of axis %d of bottom 0), '
                       'got %s' % (self.num_classes, self.num_classes, self.axis, what))

    def _matrix(self, bottom):
        if len(bottom) >= 3:
            return bottom[2].data.reshape(self.num_classes, self.num_classes)
        xp = backend.get_array_module(bottom[0].data)
        if self._infogain_xp is None or backend.get_array_module(self._infogain_xp) is not xp:
            self._infogain_xp = xp.asarray(self._infogain)
        return self._infogain_xp.reshape(self.num_classes, self.num_classes)

    def _h_rows(self, bottom, lab):
        """H[label] laid out like the probabilities: outer x classes x inner."""
        xp = backend.get_array_module(lab)
        h = self._matrix(bottom)
        return xp.moveaxis(h[lab], 2, 1), h

    def _forward(self, bottom, top):
        xp = backend.get_array_module(bottom[0].data)
        prob, lab, valid = self._prob_labels(bottom)
        rows, _ = self._h_rows(bottom, lab)
        term = (rows * xp.log(xp.maximum(prob, LOG_THRESHOLD))).sum(axis=1)
        if valid is not None:
            term = xp.where(valid, term, 0)
        top[0].data[...] = -term.sum(dtype=numpy.float64) / self._normalizer(valid)
        if len(top) >= 2:
            top[1].data[...] = prob.reshape(top[1].shape)

    def _backward(self, top, propagate_down, bottom):
        self._check_propagate(propagate_down)
        if not propagate_down[0]:
            return
        prob, lab, valid = self._prob_labels(bottom)
        rows, h = self._h_rows(bottom, lab)
        row_sums = h.sum(axis=1)[lab]               # outer x inner
        diff = bottom[0].diff.reshape(prob.shape)
        diff[...] = prob * row_sums[:, None, :] - rows
        if valid is not None:
            diff *= valid[:, None, :]
        diff *= _top_weight(top) / self._normalizer(valid)


@register
class MultinomialLogisticLossLayer(_Loss):
    """-log(p[label]) / num for probabilities p (bottom 0), p clamped at 1e-20."""
    type = 'MultinomialLogisticLoss'

    def reshape(self, bottom, top):
        super().reshape(bottom, top)
        label = self._legacy(bottom[1], 'bottom 1 (labels)')
        if label.channels != 1 or label.height != 1 or label.width != 1:
            self._fail('labels must be N x 1 x 1 x 1, got %s' % label.shape_string())
        self.num = self._legacy(bottom[0], 'bottom 0').num
        self.dim = bottom[0].count // self.num if self.num else 0

    def _picked(self, bottom):
        xp = backend.get_array_module(bottom[0].data)
        p = bottom[0].data.reshape(self.num, self.dim)
        lab, _ = self._int_labels(bottom[1].data.reshape(self.num), self.dim)
        picked = xp.take_along_axis(p, lab[:, None], axis=1)[:, 0]
        return xp, lab, xp.maximum(picked, LOG_THRESHOLD)

    def _forward(self, bottom, top):
        xp, _, picked = self._picked(bottom)
        top[0].data[...] = -xp.log(picked).sum(dtype=numpy.float64) / self.num

    def _backward(self, top, propagate_down, bottom):
        self._check_propagate(propagate_down)
        if not propagate_down[0]:
            return
        xp, lab, picked = self._picked(bottom)
        scale = -_top_weight(top) / numpy.float32(self.num)
        diff = bottom[0].diff.reshape(self.num, self.dim)
        diff[...] = 0
        onehot = xp.arange(self.dim)[None, :] == lab[:, None]
        diff += onehot * (scale / picked)[:, None]
