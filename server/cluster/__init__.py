"""The cluster: engines in other processes behind the public server.

`router/` is `jaxserve router`: the public server (`server/`) over worker processes, through
`RemoteEngine`, which implements the same `jaxserve.engine_client.EngineClient` as the engine of
one process. `worker/` is `jaxserve worker`: one engine behind the internal `Worker` gRPC service,
and the KV handoff of prefill/decode disaggregation. `launch/` is `jaxserve launch`: a router and
its workers placed on a Ray cluster. Like the server, this package uses only the engine interface
and its public types, and the placement it shares with the in-process data-parallel engine
(`jaxserve.placement`; tests/test_layering.py).
"""
