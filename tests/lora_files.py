"""Random PEFT LoRA folders for the LoRA kernel and bank tests (tests/test_lora_kernel.py,
tests/test_lora_triton.py, tests/test_lora_cuda.py)."""
import json

import torch

from slipstream.models.lora import target_shapes


def write_adapter(folder, config, rank, targets, seed):
    """A PEFT folder of random A and B (deviation 0.3) for `targets` in every layer."""
    from safetensors.torch import save_file

    folder.mkdir()
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(config.num_layers):
        for t in targets:
            n_in, n_out = target_shapes(config)[t]
            stem = f"base_model.model.model.layers.{layer}.{'self_attn' if t[0] in 'qkvo' else 'mlp'}.{t}"
            tensors[f"{stem}.lora_A.weight"] = torch.randn(rank, n_in, generator=g) * 0.3
            tensors[f"{stem}.lora_B.weight"] = torch.randn(n_out, rank, generator=g) * 0.3
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    (folder / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank,
                                                            "target_modules": list(targets)}))
    return str(folder)


ALL = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
MODEL_SPECS = {1: (4, ("q_proj", "v_proj", "down_proj")), 2: (8, ALL), 4: (2, ("k_proj", "o_proj", "gate_proj", "up_proj"))}

