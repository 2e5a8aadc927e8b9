"""The GPUs' dense bf16 tensor-core peaks, the one table the profile tools read (TFLOP/s, no sparsity).

Source: NVIDIA's data sheets, which quote bf16 "with sparsity" (2:4 structured); dense is half of that:
- H100 SXM5: 1,979 with sparsity -> 989 dense; H100 PCIe: 1,513 -> 756; H100 NVL: 1,671 -> 835
  (NVIDIA H100 Tensor Core GPU data sheet)
- H200 SXM: 1,979 -> 989; H200 NVL: 1,671 -> 835 (NVIDIA H200 Tensor Core GPU product page / data sheet)
- A100 (SXM and PCIe): 312 dense, 624 with sparsity (NVIDIA A100 Tensor Core GPU data sheet)
These are boost-clock figures; a long GEMM runs at a lower clock, so cuBLAS itself reaches ~70-80% of them.
"""
from __future__ import annotations

# (a substring of torch.cuda.get_device_name(), dense bf16 TFLOP/s), most specific first: the SXM H100
# reports itself as e.g. "NVIDIA H100 80GB HBM3", the SXM H200 as "NVIDIA H200"
DENSE_BF16_TFLOPS: tuple[tuple[str, float], ...] = (
    ("H200 NVL", 835.0),
    ("H200", 989.0),
    ("H100 NVL", 835.0),
    ("H100 PCIe", 756.0),
    ("H100", 989.0),
    ("A100", 312.0),
)


def dense_bf16_peak(device_name: str) -> float | None:
    """The GPU's dense bf16 peak in TFLOP/s, or None for a GPU the table does not list."""
    for key, tflops in DENSE_BF16_TFLOPS:
        if key in device_name:
            return tflops
    return None
