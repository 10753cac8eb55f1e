"""Triton kernels for CUDA, each with the signature and semantics of its torch reference in
`deltaspec.ops`. Importing `deltaspec.ops.triton.backend` registers them in the dispatch table."""
