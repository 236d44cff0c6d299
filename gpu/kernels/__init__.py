"""Native CPU kernels (C, built with the system compiler on first use by ``native``) and
their Python bindings: fused elementwise ops (``ops``), the GGUF block GEMM (``qgemm``)
and the decode-attention kernel over KV pages (``cpu_decode.c``, bound by the ``cpu``
attention backend). The Triton kernels (CUDA) are in ``triton/``."""
