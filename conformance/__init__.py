"""The ngram-spec conformance suite: run it against any backend to know that it implements n-gram
speculative decoding correctly (``python -m conformance --backend NAME``, ``docs/conformance.md``).
"""
