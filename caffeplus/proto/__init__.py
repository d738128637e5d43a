"""Caffe's schema as Python classes (generated from proto/caffe.proto)."""
from caffeplus.proto import caffe_pb2  # noqa: F401
