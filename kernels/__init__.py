"""CUDA sources of onebit, installed as the package ``onebit._cuda_src`` (see pyproject.toml).

``onebit.kernels.cuda`` reads ``onebit_kernels.cu`` from here with importlib.resources.
"""
