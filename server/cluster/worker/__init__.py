"""The worker's internal gRPC service (`worker.proto`): an engine process behind token ids.

`worker_pb2.py`, `worker_pb2.pyi` and `worker_pb2_grpc.py` are generated from `worker.proto` and
committed; the command that regenerates them is at the top of the proto. `wire.py` converts
between the engine's types and the messages (used by both ends), `service.py` is the worker's
servicer, `kv_handoff.py` its side of prefill/decode disaggregation (through the engine's
`KVTransferEngine` methods) and `cli.py` the `jaxserve worker` command.
"""
