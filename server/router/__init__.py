"""`jaxserve router`: the public server (`server/`) over remote workers (`server/worker_api`).

`remote_engine.py` gives the server the API of `AsyncEngine` over worker processes;
`worker_client.py` is one worker's connection and health; `prefix_tree.py` the approximate
prefix cache the router keeps for each worker; `cli.py` the command.
"""
