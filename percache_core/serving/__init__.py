"""Serving an answer: the request path, prompt layout, running a prompt through the
chunk-state tree (generation), draft decoding, stop strings, streams and adaptive context."""
