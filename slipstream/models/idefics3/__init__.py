"""Idefics3 (SmolVLM): a SigLIP-style vision tower and a pixel-shuffle connector in front of the
Llama decoder of slipstream/models/llama/model.py (docs/images.md, "The model").

config.py reads an HF folder's config, processor.py turns images into tiles and the prompt's
`<image>` markers into placeholder tokens, vision.py encodes tiles into decoder-width embeddings,
loader.py maps the checkpoint's tensor names.
"""
