"""`jaxserve router`: the public server (`server/`) over remote workers (`server/cluster/worker`).

`remote_engine.py` implements `EngineClient` (jaxserve.engine_client) over worker processes;
`worker_client.py` is one worker's connection and health; `prefix_tree.py` the approximate
prefix cache the router keeps for each worker; `cli.py` the command.
"""
