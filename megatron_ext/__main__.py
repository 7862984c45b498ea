"""``python -m megatron_ext``: what the package's command-line entry points are."""

from __future__ import annotations

import sys

ENTRY_POINTS = (
    (
        "python -m megatron_ext.train SCRIPT [ARGS...]",
        "run a Megatron-LM training script (e.g. pretrain_gpt.py) with --per-dtype-grad-buffers "
        "and the other flags; --help lists them",
    ),
    (
        "python -m megatron_ext.mixed_list_demo",
        "the norm of a mixed bf16/fp32 gradient list from stock megatron-core, ours and fp64",
    ),
    (
        "python -m buffers.demo [--help]",
        "a small mixed bf16/fp32 model trained with FlatGradBuffers (CPU or GPU)",
    ),
)


def help_text() -> str:
    """The entry points, one per line, each with what it does."""
    width = max(len(command) for command, _ in ENTRY_POINTS)
    lines = [
        "usage: python -m megatron_ext [--help]",
        "",
        "megatron_ext is a library (import megatron_ext); its command-line entry points are:",
        *(f"  {command:<{width}}  {what}" for command, what in ENTRY_POINTS),
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Print :func:`help_text`; any argument other than ``-h``/``--help`` is an error."""
    argv = list(sys.argv[1:] if argv is None else argv)
    unknown = [a for a in argv if a not in ("-h", "--help")]
    if unknown:
        print(help_text(), file=sys.stderr)
        print(
            f"python -m megatron_ext: error: unrecognized arguments: {' '.join(unknown)}; "
            "to train, run python -m megatron_ext.train SCRIPT ARGS...",
            file=sys.stderr,
        )
        return 2
    print(help_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
