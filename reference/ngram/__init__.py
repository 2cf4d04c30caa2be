"""llama.cpp's n-gram lookup, specified: the caches and their counts, drafting, the lookup-stats replay, token and cache files."""
