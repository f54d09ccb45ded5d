"""The gRPC API (`jaxserve.proto`), served next to the HTTP app on its event loop.

`jaxserve_pb2.py`, `jaxserve_pb2.pyi` and `jaxserve_pb2_grpc.py` are generated from `jaxserve.proto`
and committed; the command that regenerates them is at the top of the proto. The grpcio-tools
version that generates them sets the grpcio and protobuf floors in pyproject.toml.
"""
