"""Kernel marks for parametrized GPU tests: a parameter naming fa4, fa2 or flex carries that
kernel's marker, so `pytest -m fa4` selects its cases and tests/conftest.py skips them with the
kernel probe's reason where the kernel cannot run. Test ids stay those of the plain values."""
import pytest

KERNEL_MARKS = ("fa4", "fa2", "flex")


def kernel_marks(name, **spec):
    return [getattr(pytest.mark, name)(**spec)] if name in KERNEL_MARKS else []


def with_kernels(values, **spec):
    """parametrize values with each kernel's marker: a value is a kernel name, or a tuple whose
    first item is one (`("fa4", 2)`); `spec` goes to the marker (e.g. documents=True)."""
    out = []
    for v in values:
        name = v[0] if isinstance(v, tuple) else v
        args = v if isinstance(v, tuple) else (v,)
        out.append(pytest.param(*args, marks=kernel_marks(name, **spec)))
    return out
