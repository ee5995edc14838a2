"""Messages and gRPC stubs generated from published .proto files (see README.md here).

Regenerate with ``python scripts/gen_protos.py`` (grpcio-tools, the ``protos`` extra). The
generated modules register their files in protobuf's default descriptor pool under the
published names (``tensorflow/core/framework/tensor.proto``, Triton's ``grpc_service.proto``):
a process that also imports TensorFlow's or tritonclient's generated code for the same messages
gets a "duplicate symbol" error, so the server never imports those.
"""
