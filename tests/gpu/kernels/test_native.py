"""One build per instruction set: the dispatcher's choice over fake CPU flag sets, the
ACTORLM_ISA cap, and each level this CPU runs actually building and loading."""

from __future__ import annotations

from pathlib import Path

import pytest
from actorlm.gpu.kernels import native

# /proc/cpuinfo flags of the CPUs CI meets, cut to what matters here
AVX2_EPYC = {"sse4_2", "avx", "avx2", "fma", "f16c", "bmi1", "bmi2", "abm", "movbe"}
AVX512 = AVX2_EPYC | {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"}
ZEN5 = AVX512 | {"avx512_bf16", "avx512_vnni", "avx512vbmi"}
SAPPHIRE_RAPIDS = ZEN5 | {"amx_tile", "amx_bf16", "amx_int8"}
COOPER_LAKE = AVX512 | {"avx512_bf16", "avx512_vnni"}  # bf16 without VBMI
ICE_LAKE = AVX512 | {"avx512_vnni", "avx512vbmi"}  # int8 dot products, no bf16


@pytest.mark.parametrize(
    ("flags", "x86", "want"),
    [
        (AVX2_EPYC, True, "avx2"),
        (ZEN5, True, "avx512bf16"),
        (SAPPHIRE_RAPIDS, True, "amx"),
        (SAPPHIRE_RAPIDS - {"amx_bf16"}, True, "avx512bf16"),  # AMX tiles without bf16
        (ICE_LAKE, True, "avx512vnni"),
        (ZEN5 - {"avx512_bf16", "avx512vbmi"}, True, "avx512"),  # Cascade Lake: no VBMI
        (AVX512, True, "avx512"),  # Skylake-X: no VNNI either
        (COOPER_LAKE, True, "avx512"),  # the bf16 levels' int8 kernels need VBMI too
        (ZEN5 - {"avx512vl"}, True, "avx2"),  # Knights Landing: F and CD, no VL/BW/DQ
        (AVX2_EPYC - {"fma"}, True, "generic"),
        (set(), True, "generic"),
        ({"fp", "asimd", "neon"}, False, "generic"),  # ARM
        (ZEN5, False, "generic"),  # x86 flag names mean nothing on another architecture
    ],
)
def test_the_highest_level_the_flags_allow(flags: set[str], x86: bool, want: str) -> None:
    assert native.pick_isa(flags, x86=x86).name == want
    assert native.supported_isas(flags, x86)[-1].name == "generic"  # always there


def test_a_cap_lowers_the_level_but_never_raises_it() -> None:
    assert native.pick_isa(ZEN5, cap="avx512").name == "avx512"
    assert native.pick_isa(ZEN5, cap="avx512vnni").name == "avx512vnni"
    assert native.pick_isa(SAPPHIRE_RAPIDS, cap="avx512bf16").name == "avx512bf16"
    assert native.pick_isa(ZEN5, cap="amx").name == "avx512bf16"
    assert native.pick_isa(ZEN5, cap="avx2").name == "avx2"
    assert native.pick_isa(ZEN5, cap="generic").name == "generic"
    assert native.pick_isa(AVX2_EPYC, cap="avx512").name == "avx2"
    with pytest.raises(
        ValueError, match="known: amx, avx512bf16, avx512vnni, avx512, avx2, generic"
    ):
        native.pick_isa(ZEN5, cap="sse9")


def test_best_isa_reads_this_cpu_and_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    here = native.pick_isa(native.cpu_flags(), x86=native._is_x86())
    monkeypatch.delenv("ACTORLM_ISA", raising=False)
    native.best_isa.cache_clear()
    try:
        assert native.best_isa() == here
        native.best_isa.cache_clear()
        monkeypatch.setenv("ACTORLM_ISA", "generic")
        assert native.best_isa().name == "generic"
    finally:
        native.best_isa.cache_clear()


@pytest.mark.parametrize("level", [i.name for i in native.ISAS])
def test_each_level_builds_its_own_library(level: str) -> None:
    if native.isa(level) not in native.supported_isas(native.cpu_flags(), native._is_x86()):
        pytest.skip(f"this CPU lacks {sorted(native.isa(level).needs - native.cpu_flags())}")
    source = Path(native.__file__).with_name("cpu_qgemm.c")
    lib = native.load(source, level)
    if lib is None:
        pytest.skip("no C compiler here")
    assert f"cpu_qgemm-{level}-" in Path(lib._name).name
    assert lib is not native.load(source, "generic") or level == "generic"
