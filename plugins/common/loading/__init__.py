"""Reading checkpoints: Hugging Face directories and GGUF files into one state dict and config."""
