"""Tokenizers: a GGUF's or tokenizer.json's vocabulary (tokenizer.py, byte_bpe.py, spm_tokenizer.py), the
test models' byte tokenizer, and streaming detokenisation (byte_stream.py, utf8_tail.py)."""
