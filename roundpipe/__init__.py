"""roundpipe."""
