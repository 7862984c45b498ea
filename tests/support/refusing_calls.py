"""Every call of a ``FlatGradBuffers`` that must refuse once the model changed under it
(test support for ``tests/test_bindings.py`` and ``tests/test_registrations.py``).
"""

import pytest

from buffers import GradientOutsideBufferError


def every_call(fgb):
    """Each call that must refuse, as a zero-argument function."""
    return {
        "grad_norm": fgb.grad_norm,
        "clip_grad_norm_": lambda: fgb.clip_grad_norm_(1.0),
        "count_zeros": fgb.count_zeros,
        "zero_": fgb.zero_,
        "per_param": lambda: fgb.grad_norm(per_param=True),
        "check_bindings": fgb.check_bindings,
    }


def assert_every_call_raises(fgb, match):
    for name, call in every_call(fgb).items():
        with pytest.raises(GradientOutsideBufferError, match=match):
            call()
            pytest.fail(f"{name} did not raise")
