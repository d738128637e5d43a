"""Common layers: Split, Silence (more join them here)."""
from caffeplus import backend
from caffeplus.layer import Layer, register


@register
class SplitLayer(Layer):
    """One bottom copied to several tops; backward sums their diffs.

    The tops share the bottom's data (no copy), as in Caffe."""
    type = 'Split'
    exact_num_bottom = 1
    min_num_top = 1
    backward_reads = frozenset()

    def reshape(self, bottom, top):
        for t in top:
            t.reshape(bottom[0].shape)
            t.share_data(bottom[0])

    def _forward(self, bottom, top):
        pass

    def _backward(self, top, propagate_down, bottom):
        if not propagate_down[0]:
            return
        diff = bottom[0].diff
        diff[...] = top[0].diff
        for t in top[1:]:
            diff += t.diff


@register
class SilenceLayer(Layer):
    """Consumes bottoms so they are not net outputs; no tops."""
    type = 'Silence'
    min_num_bottom = 1
    exact_num_top = 0
    backward_reads = frozenset()

    def reshape(self, bottom, top):
        pass

    def _forward(self, bottom, top):
        pass

    def _backward(self, top, propagate_down, bottom):
        for b, prop in zip(bottom, propagate_down):
            if prop:
                b.diff[...] = 0
