"""Executable specification of n-gram (prompt-lookup) self-speculative decoding.

Pure Python + NumPy, written to be read next to ``docs/`` and llama.cpp's lookup code
(``docs/spec-map.md`` maps each rule to the llama.cpp lines it restates).
"""
