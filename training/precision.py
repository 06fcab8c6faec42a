"""`${fast_precision:ACCELERATOR}` in a config: bf16-mixed where the hardware multiplies in
bf16, 32-true where torch would emulate bf16. On a CPU without bf16 units (an AMD EPYC with
AVX2, say) a bf16 matmul of a small model's shape is over 10x slower than fp32, so a recipe that
asked for bf16 everywhere would be fastest on one kind of CPU and slowest on the others."""

import functools
from collections.abc import Mapping
from typing import Any

import torch

# x86 instruction sets that multiply bf16 directly (oneDNN uses them for bf16 matmuls)
CPU_BF16_UNITS = ("amx_bf16", "avx512_bf16")


def cpu_capabilities() -> Mapping[str, Any]:
    """torch's CPU feature flags (torch.cpu.get_capabilities); in the torch versions without
    it, the two flags CPU_BF16_UNITS names, from the private checks those versions have."""
    if hasattr(torch.cpu, "get_capabilities"):
        return torch.cpu.get_capabilities()
    return {
        "amx_bf16": torch.cpu._is_amx_tile_supported(),
        "avx512_bf16": torch.cpu._is_avx512_bf16_supported(),
    }


def cpu_has_bf16_units(capabilities: Mapping[str, Any]) -> bool:
    return any(capabilities.get(unit, False) for unit in CPU_BF16_UNITS)


@functools.cache
def multiplies_bf16(device_type: str) -> bool:
    """Whether a device of this type ("cpu", "cuda", ...) multiplies bf16 in hardware: a GPU
    from Ampere on, a CPU with CPU_BF16_UNITS; other accelerators are taken to."""
    if device_type == "cuda":
        return torch.cuda.is_bf16_supported(including_emulation=False)
    if device_type == "cpu":
        return cpu_has_bf16_units(cpu_capabilities())
    return True


def fast_precision(accelerator: str = "auto") -> str:
    """The Trainer precision for ACCELERATOR (a Trainer's `accelerator`: auto, cpu, gpu, cuda):
    bf16-mixed where it multiplies in bf16 (a GPU from Ampere on, a CPU with AMX or AVX512-BF16
    units), else 32-true. "auto" is the GPU when torch sees one, as for the Trainer."""
    gpu = torch.cuda.is_available()
    if accelerator in ("gpu", "cuda") or (accelerator == "auto" and gpu):
        native = gpu and multiplies_bf16("cuda")
    else:
        native = multiplies_bf16("cpu")
    return "bf16-mixed" if native else "32-true"
