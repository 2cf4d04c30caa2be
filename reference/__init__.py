"""Executable specification of n-gram (prompt-lookup) self-speculative decoding.

Pure Python + NumPy, written to be read next to ``docs/`` and llama.cpp's lookup code
(see ``../shared/docs/llama-cpp-lookup-spec.md``, mirrored in ``docs/spec-map.md``).
"""
