"""Draft sources for speculative decoding: n-gram prompt lookup and a draft model."""
