"""megatron-core's import-time notices, hidden while ``import megatron_ext`` imports it.

Importing megatron-core on a machine without transformer-engine, Apex or absl prints four
``UserWarning`` "Transformer Engine and Apex are not installed. Falling back to ..." notices,
one "absl.logging is not installed", and (through ``torch.utils.cpp_extension``, without a
CUDA runtime) torch's log line "No CUDA runtime is found, using CUDA_HOME=...". None of them
is about this package: they describe megatron-core's own fallbacks, and the norm and clip
they concern are what the per-dtype option replaces. So ``import megatron_ext`` hides
exactly these, and only while it imports megatron-core: every other warning shows, and
code that imports megatron-core before ``megatron_ext`` sees megatron-core's notices as
before. ``docs/megatron-core.md`` ("Notices at import") says what they mean.
"""

from __future__ import annotations

import contextlib
import logging
import warnings
from collections.abc import Iterator

# (category, regular expression matched at the start of the message), as megatron-core words them
IMPORT_NOTICES = (
    (UserWarning, r"Transformer Engine and Apex are not installed\. Falling back to "),
    (UserWarning, r"absl\.logging is not installed\. Using logging\.getLogger"),
)
# torch logs "No CUDA runtime is found, using CUDA_HOME=..." when this module is imported
QUIET_LOGGERS = ("torch.utils.cpp_extension",)


@contextlib.contextmanager
def import_notices_hidden() -> Iterator[None]:
    """Hide :data:`IMPORT_NOTICES` and :data:`QUIET_LOGGERS`' warnings inside the block."""
    loggers = [logging.getLogger(name) for name in QUIET_LOGGERS]
    levels = [logger.level for logger in loggers]
    with warnings.catch_warnings():
        for category, message in IMPORT_NOTICES:
            warnings.filterwarnings("ignore", message=message, category=category)
        for logger in loggers:
            logger.setLevel(logging.ERROR)
        try:
            yield
        finally:
            for logger, level in zip(loggers, levels, strict=True):
                logger.setLevel(level)
