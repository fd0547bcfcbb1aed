"""Triton kernels of the fast GPU path, each with a plain torch reference and a sweep test.
Knows nothing of requests, scheduling or the service."""
