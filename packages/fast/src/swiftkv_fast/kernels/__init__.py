"""Triton kernels for the paged KV cache (the ``triton`` attention backend), and ``cpu_decode``: the
``torch`` backend's decode attention on CPU as a C kernel compiled at first use.

Nothing here imports triton at package import time: import the submodules
(``write_kv``, ``paged_prefill``, ``paged_decode``) only when the kernels are
needed, so the engine runs on machines without triton. On CPU the kernels run
under Triton's interpreter: set ``TRITON_INTERPRET=1`` before the first import.
"""
