"""${fast_precision:...}: bf16-mixed only where the hardware multiplies in bf16."""

import platform
from pathlib import Path

import pytest
import torch

import train  # noqa: F401 (registers the resolvers the configs use)
from helpers import composed
from training.precision import cpu_has_bf16_units, fast_precision, multiplies_bf16

CPUINFO = Path("/proc/cpuinfo")


def cpuinfo_flags() -> set[str]:
    """The kernel's own list of this CPU's features: a source independent of torch's."""
    line = next(line for line in CPUINFO.read_text().splitlines() if line.startswith("flags"))
    return set(line.split(":", 1)[1].split())


# The kinds of CPU that CI machines have, by the features torch reports, and the precision each
# gets: the tests below check every kind's on whichever CPU they run on.
CPU_KINDS = {
    "epyc_avx2": ({"avx2", "fma3"}, "32-true"),
    "epyc_avx512_bf16": ({"avx2", "avx512_f", "avx512_vnni", "avx512_bf16"}, "bf16-mixed"),
    "xeon_amx": ({"avx2", "avx512_f", "avx512_bf16", "amx_tile", "amx_bf16"}, "bf16-mixed"),
}


@pytest.mark.parametrize(
    "flags, native",
    [
        ({"avx2", "fma3"}, False),  # an AMD EPYC of the Zen 3 generation
        ({"avx2", "avx512_f", "avx512_vnni"}, False),  # AVX-512 without its bf16 extension
        ({"avx2", "avx512_f", "avx512_bf16"}, True),
        ({"avx2", "amx_tile", "amx_bf16"}, True),
    ],
)
def test_only_cpus_with_bf16_units_count(flags, native):
    assert cpu_has_bf16_units({flag: True for flag in flags}) is native
    assert cpu_has_bf16_units({flag: False for flag in flags}) is False


@pytest.mark.skipif(
    platform.machine() != "x86_64" or not CPUINFO.exists(), reason="reads x86 Linux CPU flags"
)
def test_this_cpu_gets_bf16_exactly_when_the_kernel_lists_a_bf16_unit():
    expected = "bf16-mixed" if cpuinfo_flags() & {"amx_bf16", "avx512_bf16"} else "32-true"
    assert fast_precision("cpu") == expected


@pytest.mark.parametrize("flags, precision", CPU_KINDS.values(), ids=CPU_KINDS.keys())
def test_each_kind_of_cpu_gets_its_precision_and_the_cpu_recipe_with_it(
    cpu_flags, flags, precision
):
    cpu_flags(flags)
    assert fast_precision("cpu") == precision
    assert multiplies_bf16("cpu") is (precision == "bf16-mixed")
    assert composed("experiment=cpu_fast", "trainer=cpu").trainer.precision == precision


@pytest.mark.skipif(torch.cuda.is_available(), reason="auto is the GPU there")
def test_auto_is_the_cpu_without_a_gpu():
    assert fast_precision("auto") == fast_precision("cpu")


@pytest.mark.parametrize(
    "overrides",
    [["experiment=cpu_fast"], ["experiment=gpu_fast"], ["trainer=gpu"], ["trainer=ddp"]],
)
def test_recipes_resolve_to_a_precision_lightning_takes(overrides):
    cfg = composed(*overrides)
    accelerator = cfg.trainer.accelerator
    assert cfg.trainer.precision == fast_precision(accelerator)
    assert cfg.trainer.precision in ("bf16-mixed", "32-true")
