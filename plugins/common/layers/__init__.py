"""The decoder's building blocks: paged attention, rotary variants, mixture-of-experts, GPU kernels."""
