"""Image and audio input: content parts, preprocessing as the models' processors do it, encoders."""
