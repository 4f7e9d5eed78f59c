"""GGUF blocks as they are stored: block linear layers, their integer reference and the native kernels."""
