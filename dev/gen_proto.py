#!/usr/bin/env python3
"""Regenerate caffeplus/proto/caffe_pb2.py from proto/caffe.proto.

protoc's Python output pins the protobuf runtime to at least the version of
the protoc that made it; we strip that pin so the module loads on any runtime
from 5.x to 7.x (the descriptor builder API it uses exists in all of them).

Usage: python dev/gen_proto.py [--check]
"""
import os
import re
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROTO = os.path.join(ROOT, 'proto', 'caffe.proto')
TARGET = os.path.join(ROOT, 'caffeplus', 'proto', 'caffe_pb2.py')


def generate():
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.check_call([sys.executable, '-m', 'grpc_tools.protoc',
                               '-I' + os.path.dirname(PROTO),
                               '--python_out=' + tmp, PROTO])
        with open(os.path.join(tmp, 'caffe_pb2.py')) as f:
            code = f.read()
    code = re.sub(r'from google\.protobuf import runtime_version as _runtime_version\n', '', code)
    code = re.sub(r'_runtime_version\.ValidateProtobufRuntimeVersion\([^)]*\)\n', '', code)
    code = re.sub(r'# Protobuf Python Version: .*\n', '', code)
    return code


def main():
    code = generate()
    if '--check' in sys.argv:
        with open(TARGET) as f:
            if f.read() != code:
                sys.exit('caffeplus/proto/caffe_pb2.py is out of date: run python dev/gen_proto.py')
        return
    with open(TARGET, 'w') as f:
        f.write(code)


if __name__ == '__main__':
    main()
