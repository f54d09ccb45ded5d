"""`jaxserve router`: the public server (`server/`) over remote workers (`server/cluster/worker`).

`remote_engine.py` implements `EngineClient` (jaxserve.engine_client) over worker processes;
`sequence_runner.py` runs one choice of a request to its end (retries, resumes, prefill/decode
halves); `worker_pool.py` holds the workers, their placement (`jaxserve.placement`, shared with the
in-process data-parallel engine) and health; `worker_client.py` is one worker's connection, health
and cache picture; `worker_calls.py` one call on a worker; `cli.py` the command.
"""
