"""Suffix drafting, specified: copy what followed the latest earlier occurrence of the sequence's end
(:mod:`reference.suffix.drafter`), and the ``auto`` drafter that falls back to llama.cpp's lookup
(:mod:`reference.suffix.auto`)."""
