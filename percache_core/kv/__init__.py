"""KV-state reuse: the chunk-state tree, its storage and the llama.cpp engine."""
