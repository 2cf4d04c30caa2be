"""Models: GGUF files and their tokenizer, tiny random models, the architecture compatibility matrix."""
