"""SoftmaxWithLoss through the fused kernels, its loss and label check read
back from pinned memory when the loss is read.
"""
import numpy

from caffeplus import kernels as _kernels
from caffeplus.layer import register_engine
from caffeplus.layers.cudnn_common import _fused
from caffeplus.layers.loss import SoftmaxWithLossLayer


_NOT_QUEUED = object()      # GPUSoftmaxWithLossLayer: its forward's report is checked at once


@register_engine('CUDNN')
class GPUSoftmaxWithLossLayer(SoftmaxWithLossLayer):
    """SoftmaxWithLoss (one top) through caffeplus.kernels on the GPU: three
    kernels forward (the last writes the loss's normalizer, the label check,
    and the loss and its weight for Layer.forward's weighted loss into pinned
    host memory) and one synchronisation, when the loss is read (the
    solver's, after the update is queued: forward_deferred), one kernel
    backward; the generic code makes two host synchronisations and about
    twenty CuPy operations each way."""
    engine = 'FUSED'
    _bufs = None
    _fwd_key = None

    def forward(self, bottom, top):
        """Layer.forward, with the weighted loss from the fused forward's read-back."""
        loss = self.forward_deferred(bottom, top)
        return loss() if callable(loss) else loss

    def forward_deferred(self, bottom, top):
        """Layer.forward_deferred: the fused forward's report is read (and its
        label check raised) when the loss is."""
        if not _kernels.active():
            return self._run_forward(bottom, top, deferred=True)
        self._queued_report = None
        try:
            self._forward(bottom, top)
            report = self._queued_report
        except Exception as exc:        # out of GPU memory: name the layer
            from caffeplus.layer import _reraise_out_of_memory
            _reraise_out_of_memory(self, 'forward', exc)
            raise
        finally:
            del self._queued_report     # back to the class's: reports are checked at once
        if report is not None and len(self.loss_weights) == 1:
            return report.loss if self.loss_weights[0] else report.check
        if report is not None:
            report.check()
        return self.weighted_loss(top, deferred=True)

    def _fast_forward(self, bottom, top):
        K = _kernels
        if len(top) != 1:
            return False
        outer, classes, inner = self.outer_num, self.num_classes, self.inner_num
        rows = outer * inner
        if not (0 < bottom[0]._count <= K.MAX_COUNT and rows > 0 and classes > 0):
            return False
        # The scores may be a 16-bit map (the kernel's 16-bit build); the
        # labels and the loss are float32.
        scores, dtype = K.maps((bottom[0], False))
        lab, y = K.flat(bottom[1]), K.flat(top[0])
        if scores is None or lab is None or y is None:
            return False
        x = scores[0]
        b = self._bufs
        if b is None or b[0].size < rows or not K.is_device(b[0]):
            b = self._bufs = (K.empty(rows), K.empty(rows), K.empty(2), K.empty(5))
            b[2][:] = 0
        rowloss, rowvalid, err, info = b
        ign = self.ignore_label
        args = (K.u32(outer), K.u32(classes), K.u32(inner), K.i32(ign is not None),
                K.i32(ign if ign is not None else 0))
        K.kernel('cp_softmax_loss_rows', dtype)((rows,), (_row_block(classes),),
                                         (x, lab, rowloss, rowvalid, err) + args)
        K.kernel('cp_softmax_loss_total')((1,), (256,), (
            rowloss, rowvalid, err, y, info, K.u32(rows), K.i32(self.normalization),
            K.u32(outer), K.u32(inner)))
        self._args = args
        self._fwd_key = (bottom[0]._shape, bottom[1]._shape)
        dtop = K.flat(top[0], diff=True)
        report = self._launch_report(info, y, dtop)
        if self._queued_report is _NOT_QUEUED:
            report.check()          # a synchronous forward: the label check now
        else:
            self._queued_report = report
        return True

    _pinned = None
    _queued_report = _NOT_QUEUED    # forward_deferred sets None: queue the report
    _outstanding = None             # the report in the pinned buffer, not read yet

    def _launch_report(self, info, y, dtop):
        """[normalizer, label error flag, its value, loss, loss weight],
        written by cp_loss_report straight into pinned memory (no copy on the
        copy engines: behind offload's copies there it waited for
        milliseconds); the _LossReport reads it with one synchronisation."""
        K = _kernels
        if self._outstanding is not None:
            self._outstanding.read()        # the buffer is about to be written again
        if K.emulating():
            out = numpy.zeros(5, numpy.float32)
            K.kernel('cp_loss_report')((1,), (32,), (info, y, dtop if dtop is not None else y,
                                                     out, K.i32(dtop is not None)))
            return _LossReport(self, out, None, dtop is not None)
        import cupy
        if self._pinned is None:
            mem = cupy.cuda.alloc_pinned_memory(5 * 4)
            self._pinned = (mem, numpy.frombuffer(mem, numpy.float32, 5))
        out = self._pinned[1]
        K.kernel('cp_loss_report')((1,), (32,), (
            info, y, dtop if dtop is not None else y, numpy.uint64(out.ctypes.data),
            K.i32(dtop is not None)))
        done = None
        if not _capturing(cupy):
            # (In a CUDA graph's capture the replay records its own: caffeplus.pass_graph.)
            done = cupy.cuda.Event(disable_timing=True)
            done.record()
        self._outstanding = _LossReport(self, out, done, dtop is not None)
        return self._outstanding

    def _label_error(self, value):
        self._fwd_key = None
        ign = self.ignore_label
        self._fail('label value %g is out of range: labels must be integers in '
                   '[0, %d)%s' % (value, self.num_classes, '' if ign is None else
                                  ' or loss_param.ignore_label (%d)' % ign))

    def _forward(self, bottom, top):
        self._fwd_key = None
        if not (_kernels.active() and
                _fused('SoftmaxWithLoss forward', self._fast_forward, bottom, top)):
            super()._forward(bottom, top)

    def _fast_backward(self, top, propagate_down, bottom):
        K = _kernels
        if self._fwd_key != (bottom[0]._shape, bottom[1]._shape) or self._bufs is None:
            return False            # the normalizer comes from a fused forward
        arrays, dtype = K.maps((bottom[0], False), (bottom[0], True))
        lab, dtop = K.flat(bottom[1]), K.flat(top[0], diff=True)
        if arrays is None or lab is None or dtop is None:
            return False
        x, dx = arrays
        K.kernel('cp_softmax_loss_bwd', dtype)((self.outer_num * self.inner_num,),
                                        (_row_block(self.num_classes),),
                                        (x, lab, dtop, self._bufs[3], dx) + self._args)
        return True

    def _backward(self, top, propagate_down, bottom):
        self._check_propagate(propagate_down)
        if not propagate_down[0]:
            return
        if not (_kernels.active() and _fused('SoftmaxWithLoss backward', self._fast_backward, top,
                                            propagate_down, bottom)):
            super()._backward(top, propagate_down, bottom)


def _capturing(cupy):
    """Whether the current stream is capturing a CUDA graph."""
    try:
        return cupy.cuda.get_current_stream().is_capturing()
    except Exception:   # noqa: BLE001 -- the legacy stream while another captures: it is not
        return False


def _row_block(classes):
    return 32 if classes <= 64 else 128 if classes <= 512 else 256


class _LossReport:
    """A fused SoftmaxWithLoss forward's report in pinned memory, read once
    (after its event): the label check, then the weighted loss."""

    def __init__(self, layer, out, event, has_dtop):
        self.layer, self._out, self._event, self._has_dtop = layer, out, event, has_dtop
        self._host = None

    def renewed(self, event):
        """The report of the same buffer written again by work that `event`
        follows (a replay of the pass that wrote this one:
        caffeplus.pass_graph); the layer reads it before its next write."""
        again = _LossReport(self.layer, self._out, event, self._has_dtop)
        self.layer._outstanding = again
        return again

    def read(self):
        if self._host is None:
            if self._event is not None:
                self._event.synchronize()
            self._host = self._out.copy()
            if self.layer._outstanding is self:
                self.layer._outstanding = None
        return self._host

    def check(self):
        """Raise the label check's error, if any; the weighted loss is 0.0
        (a loss weight of 0)."""
        host = self.read()
        if float(host[1]):
            self.layer._label_error(float(host[2]))
        return 0.0

    def loss(self):
        self.check()
        host = self.read()
        if not self._has_dtop:
            return 0.0
        # Layer.forward's float(dot(top, top diff)) of one float32 value each
        return float(numpy.float32(host[3]) * numpy.float32(host[4]))
