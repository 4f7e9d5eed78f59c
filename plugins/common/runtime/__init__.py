"""The paged-KV stepped runtime base the text-like plugins build on, and what it serves per request."""
