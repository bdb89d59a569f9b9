"""Thin adapters between Triton's Python backend and the specserve core (docs/design.md, 'The shape').

Modules that import `triton_python_backend_utils` (pb.py) load only inside Triton's stub; the
rest (schema, render, launch, params, detokenize, service) are plain Python and unit-tested.
"""
