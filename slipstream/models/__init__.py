# EngineConfig.weights: what a GGUF's quantized matrices become at load (models/loading/loader.py). Here, in
# the package's torch-free root, so that the API's config can validate it without importing torch.
WEIGHT_MODES = ("quantized", "dequantized")
# EngineConfig.activations: how quantized matrices multiply on the CPU (LlamaForCausalLM.set_activations).
ACTIVATION_MODES = ("int8", "int16", "float")
