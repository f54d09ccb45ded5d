"""`python3 -m bench.gpu_check`: the kernels and the engine measured on one GPU (see __main__.py)."""
