"""The Llama family (Llama, Qwen2; Idefics3's decoder): the model (model.py) and its forwards on the
"triton" (forward_triton.py) and "cpu" (forward_cpu.py) kernel backends."""
