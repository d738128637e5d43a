"""Net construction does no work whose result nobody reads."""
import logging

import caffeplus
from caffeplus import log
from caffeplus.io import upgrade
from caffeplus.proto import caffe_pb2
from google.protobuf import text_format

NET = ('input: "x" input_shape { dim: 2 dim: 3 } '
       'layer { name: "ip" type: "InnerProduct" bottom: "x" top: "y" '
       'inner_product_param { num_output: 4 weight_filler { type: "xavier" } } }')


def _count_net_printing(monkeypatch):
    printed = []
    real = upgrade.message_to_text

    def counting(message, *args, **kwargs):
        printed.append(message.name)
        return real(message, *args, **kwargs)
    monkeypatch.setattr(upgrade, 'message_to_text', counting)
    return printed


def test_the_net_is_printed_only_when_info_is_logged(monkeypatch):
    printed = _count_net_printing(monkeypatch)
    param = text_format.Parse('name: "quiet" ' + NET, caffe_pb2.NetParameter())
    level = log.logger.level
    log.logger.setLevel(logging.WARNING)
    try:
        caffeplus.Net(param, caffeplus.TEST)
    finally:
        log.logger.setLevel(level)
    assert printed == []


def test_the_net_is_printed_at_info(monkeypatch, caplog_caffeplus):
    printed = _count_net_printing(monkeypatch)
    param = text_format.Parse('name: "loud" ' + NET, caffe_pb2.NetParameter())
    caffeplus.Net(param, caffeplus.TEST)
    assert printed == ['loud']
    assert any(m.startswith('Initializing net from parameters: \nname: "loud"')
               for m in caplog_caffeplus)
