"""Moondream 2 (vision encoder, Phi-style decoder with a bidirectional image prefix, region heads);
see docs/moondream.md."""
