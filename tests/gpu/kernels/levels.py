"""The kernels' ISA levels as pytest parameters: each level this CPU runs, the others
skipped with the flags they would need."""

from __future__ import annotations

from typing import Any

import pytest
from actorlm.gpu.kernels import native

_HERE = native.supported_isas(native.cpu_flags(), native._is_x86())


def _param(level: native.Isa) -> Any:
    missing = sorted(level.needs - native.cpu_flags())
    return pytest.param(
        level.name,
        marks=pytest.mark.skipif(level not in _HERE, reason=f"this CPU lacks {missing}"),
    )


# every level: the int8 rows' tests (the avx512vnni level differs from avx512 only in
# them, dpi8.h for dpi8_avx2.h)
INT8_LEVELS = [_param(i) for i in native.ISAS]
# the other paths' tests: avx512vnni builds them from avx512's code
LEVELS = [_param(i) for i in native.ISAS if i.name != "avx512vnni"]
