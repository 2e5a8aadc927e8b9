"""Helpers of the LoRA tests: random PEFT adapters of the tiny random Llama ("tiny-random") and the
transformers + peft oracle of their greedy outputs."""
import copy

import torch

from hf_oracle import hf_llama_from_weights
from slipstream.models.config import tiny_config
from slipstream.models.llama.build import random_weights

# name -> (rank, targets, alpha, rslora)
ADAPTERS = {
    "a": (4, ["q_proj", "v_proj", "down_proj"], 8, False),
    "b": (8, ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"], 16, True),
    "c": (2, ["k_proj", "o_proj", "gate_proj", "up_proj"], 4, False),
    "d": (16, ["q_proj", "k_proj", "v_proj", "o_proj"], 32, False),
}
PROMPTS = [[1, 5, 9, 33, 70, 100], [1, 44, 12, 8, 31], [1, 200, 3, 3, 3, 17, 250, 9, 81], [1, 7],
           [1, 301, 302, 303, 304, 305, 306, 307, 308, 309, 310, 311, 312, 313, 314, 315, 316, 317, 318]]
TOKENS = 6


def make_adapter(hf, folder, rank, targets, alpha, rslora, seed, std=0.3, **extra):
    """A peft LoRA of `hf` saved in `folder`, A and B random of deviation `std` (peft starts B at zero)."""
    import peft

    config = peft.LoraConfig(r=rank, lora_alpha=alpha, target_modules=targets, use_rslora=rslora,
                             lora_dropout=0.0, **extra)
    model = peft.get_peft_model(copy.deepcopy(hf), config)  # (the oracle's model stays as it is)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_A" in name or "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * std)
    model.save_pretrained(folder)
    return folder


def tiny_hf():
    """(config, transformers model) with the weights of model="tiny-random" (seed 0)."""
    cfg = tiny_config()
    return cfg, hf_llama_from_weights(cfg, random_weights(cfg, seed=0))


def make_adapters(hf, root) -> dict[str, str]:
    return {name: str(make_adapter(hf, root / name, *spec, seed=i)) for i, (name, spec) in enumerate(ADAPTERS.items())}


def peft_oracle(hf, adapters):
    """(prompt, adapter or None) -> (greedy tokens, log-softmax rows) by transformers + peft."""
    import peft

    names = list(adapters)
    model = peft.PeftModel.from_pretrained(hf, adapters[names[0]], adapter_name=names[0])
    for n in names[1:]:
        model.load_adapter(adapters[n], adapter_name=n)
    model.eval()
    cache = {}

    def run(prompt, lora):
        key = (tuple(prompt), lora)
        if key not in cache:
            ids, rows = list(prompt), []
            threads = torch.get_num_threads()
            torch.set_num_threads(1)  # (a shared, loaded machine: small forwards ran 30x slower on 2 threads)
            try:
                run_one(ids, rows, lora)
            finally:
                torch.set_num_threads(threads)
            cache[key] = ids[len(prompt):], rows
        return cache[key]

    def run_one(ids, rows, lora):
        with torch.no_grad():
            for _ in range(TOKENS):
                if lora is None:
                    with model.disable_adapter():
                        logits = model(torch.tensor([ids])).logits[0, -1]
                else:
                    model.set_adapter(lora)
                    logits = model(torch.tensor([ids])).logits[0, -1]
                rows.append(torch.log_softmax(logits.float(), -1))
                ids.append(int(logits.argmax()))

    return run


