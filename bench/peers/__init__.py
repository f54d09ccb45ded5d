"""Peer engines measured in the same run on the same workload and weights (optional, never imported by jaxserve).

Each peer is a standalone script run in a chosen interpreter (`--peer-python`), so its heavy
dependencies (torch, transformers, llama-cpp-python) never have to be installed next to jaxserve.
"""
