"""Loading: a model spec resolved (a known name, a .gguf file, a HF folder or a hub id), its weights read
(gguf_loader.py, hf_loader.py, the converted-weights cache) and a ready model built through the registry
(build.py, models/registry.py)."""
