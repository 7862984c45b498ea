"""Megatron-LM's training loop with per-dtype gradient buffers: three flags and an entry point.

Run Megatron-LM's own launch script through this module and add the flags::

    torchrun --nproc_per_node 8 -m megatron_ext.train pretrain_gpt.py ARGS... \\
        --per-dtype-grad-buffers --keep-in-fp32-params 'layernorm\\.weight$,router'

- ``--per-dtype-grad-buffers``: ``megatron.training`` builds megatron_ext's DDP config, DDP
  and optimizers (flat, dtype-safe norm, clip and zero count; fp32 islands).
- ``--keep-in-fp32-params PATTERN[,PATTERN...]``: parameters whose name (in each model
  chunk's ``named_parameters()``, e.g. ``decoder.layers.0.input_layernorm.weight``) matches
  one of these regular expressions (``re.search``) stay fp32 when the rest of the model is
  cast to bf16/fp16. It works with or without the first flag (without it, megatron-core's
  own DDP and optimizer get the fp32 parameters).
- ``--log-per-layer-grad-norm`` (needs the first): per-layer gradient norms every
  ``--log-interval``, from the step's own norm pass.

``python -m megatron_ext.train --help`` lists our flags, one line each (``--help-megatron``
lists Megatron-LM's arguments; ``SCRIPT --help`` both, ours first). Before the script
runs, a bad value of one of our flags is one error line, and flags ``--per-dtype-grad-buffers``
does not support are refused in one line (:func:`refuse_unsupported`); where torch sees no
GPU, the script is refused in one line when it parses Megatron-LM's training arguments,
before Megatron-LM prints them.

The flags are added to the script's parser through Megatron's ``extra_args_provider``.
With none of them, nothing of megatron-core or ``megatron.training`` is replaced: the run is
stock. The one exception, flags or not: megatron-core's wheel ships the compiled dataset
helpers but not their Makefile, and ``megatron.training`` runs ``make`` on rank 0 at
start-up and exits when it fails; the entry point skips that build when the Makefile is
absent and the compiled helpers import.

What is replaced, and where, is in :mod:`megatron_ext.seam` (entries ``training args``,
``training DDP config``, ``training DDP``, ``training optimizer``, ``training fp32
islands``, ``dataset helpers build``); every replacement is undone when the script returns.
A launcher of your own can call :func:`install` before it imports
``parse_and_validate_args``, or pass :func:`add_arguments` as ``extra_args_provider`` and run
``pretrain`` inside ``with enable(args):``.
"""

from __future__ import annotations

import argparse
import contextlib
import inspect
import os
import re
import runpy
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from . import seam, wgrad_fusion
from .config import DistributedDataParallelConfig
from .ddp import DistributedDataParallel
from .fp32 import Float16Module, mark_keep_in_fp32
from .megatron_options import DEFAULT_DELAY_WARMUP, flag_spelling, offload_conflict
from .offload_drain import drain_offload
from .optimizer import get_megatron_optimizer

FIRST_VERSION = (0, 19)  # pretrain(cfg_container, ...): the loop these entries patch
# Set on our parse_and_validate_args, so that a second install() does not wrap it twice.
_WRAPPED_MARK = "__wrapped_by_megatron_ext__"


class UnsupportedTrainingOptionError(ValueError):
    """A flag of ours combined with a Megatron-LM feature that the option does not support."""


@dataclass(frozen=True)
class TrainOptions:
    """Our flags (:data:`FLAGS`), read from Megatron's parsed arguments. An offload flag
    not given is None (or False): :class:`~megatron_ext.MegatronOptions` holds the defaults."""

    per_dtype_grad_buffers: bool = False
    keep_in_fp32_params: tuple[str, ...] = ()
    log_per_layer_grad_norm: bool = False
    offload_step: str | None = None
    offload_threads: int | None = None
    offload_convert: str | None = None
    offload_delayed_update: bool = False
    offload_delay_warmup: int | None = None
    offload_pin_threads: bool = False
    offload_overlap_forward: bool = False
    offload_fraction: str | None = None
    offload_gpu_headroom: int | None = None
    offload_host_bytes: int | None = None

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> TrainOptions:
        return cls(
            per_dtype_grad_buffers=bool(getattr(args, "per_dtype_grad_buffers", False)),
            keep_in_fp32_params=tuple(getattr(args, "keep_in_fp32_params", None) or ()),
            log_per_layer_grad_norm=bool(getattr(args, "log_per_layer_grad_norm", False)),
            offload_step=getattr(args, "offload_step", None),
            offload_threads=getattr(args, "offload_threads", None),
            offload_convert=getattr(args, "offload_convert", None),
            offload_delayed_update=bool(getattr(args, "offload_delayed_update", False)),
            offload_delay_warmup=getattr(args, "offload_delay_warmup", None),
            offload_pin_threads=bool(getattr(args, "offload_pin_threads", False)),
            offload_overlap_forward=bool(getattr(args, "offload_overlap_forward", False)),
            offload_fraction=getattr(args, "offload_fraction", None),
            offload_gpu_headroom=getattr(args, "offload_gpu_headroom", None),
            offload_host_bytes=getattr(args, "offload_host_bytes", None),
        )

    def _offload_given(self) -> dict[str, Any]:
        """Our offload flags that were given, by MegatronOptions field name."""
        return {
            name: getattr(self, name)
            for name in OFFLOAD_FIELDS
            if getattr(self, name) is not None and getattr(self, name) is not False
        }

    @property
    def offload_flags(self) -> list[str]:
        """Our offload flags that were given, as typed (they need --per-dtype-grad-buffers
        and --optimizer-cpu-offload)."""
        return [flag_spelling(k, v) for k, v in self._offload_given().items()]

    def offload_conflict(self) -> str | None:
        """Why the offload flags given cannot go together, naming them as flags."""
        from .megatron_options import MegatronOptions

        values = {name: getattr(MegatronOptions, name) for name in OFFLOAD_FIELDS}
        values.update(self._offload_given())
        values["offload_step"] = values["offload_step"] or "chunked"  # with host mirrors
        return offload_conflict(values, flag_spelling)

    @property
    def on(self) -> bool:
        return (
            self.per_dtype_grad_buffers
            or bool(self.keep_in_fp32_params)
            or self.log_per_layer_grad_norm
            or bool(self.offload_flags)
        )

    def megatron_options(self):
        """The :class:`megatron_ext.MegatronOptions` our optimizer is built with."""
        from .megatron_options import MegatronOptions

        return MegatronOptions(**self._offload_given())


# our offload flags, by the MegatronOptions field each sets
OFFLOAD_FIELDS = (
    "offload_step",
    "offload_threads",
    "offload_convert",
    "offload_delayed_update",
    "offload_delay_warmup",
    "offload_pin_threads",
    "offload_overlap_forward",
    "offload_fraction",
    "offload_gpu_headroom",
    "offload_host_bytes",
)


def split_patterns(text: str) -> list[str]:
    """``"a,b{1,2}"`` -> ``["a", "b{1,2}"]``: split at commas outside ``()``, ``[]``, ``{}``.

    Each pattern must compile as a Python regular expression; otherwise
    ``argparse.ArgumentTypeError`` names it (argparse reports it as a usage error).
    """
    patterns, depth, start, i = [], 0, 0, 0
    while i < len(text):
        c = text[i]
        if c == "\\":
            i += 2
            continue
        if c in "([{":
            depth += 1
        elif c in ")]}":
            depth = max(depth - 1, 0)
        elif c == "," and depth == 0:
            patterns.append(text[start:i])
            start = i + 1
        i += 1
    patterns.append(text[start:])
    for p in patterns:
        if not p:
            raise argparse.ArgumentTypeError(f"empty pattern in {text!r}")
        try:
            re.compile(p)
        except re.error as e:
            raise argparse.ArgumentTypeError(f"{p!r} is not a regular expression: {e}") from None
    return patterns


def positive_int(text: str) -> int:
    """argparse type: an int above 0."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{value} is not positive")
    return value


def non_negative_int(text: str) -> int:
    """An argparse type: an int >= 0."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an int >= 0, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected an int >= 0, got {value}")
    return value


_BYTE_UNITS = {"": 1, "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40}


def byte_size(text: str) -> int:
    """argparse type: bytes, as a count or with a binary unit (``512MiB``, ``10G``, ``1.5GiB``)."""
    match = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([kKmMgGtT]?)(?:i?[bB])?\s*", text)
    if match is None:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a size (bytes, or a number with K, M, G or T, e.g. 10GiB)"
        )
    number, unit = match.groups()
    return int(float(number) * _BYTE_UNITS[unit.lower()])


def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add our flags (:data:`FLAGS`) as the parser's first group; an extra_args_provider.

    First, so that the script's ``--help`` lists them before Megatron-LM's hundreds.
    """
    group = parser.add_argument_group(GROUP_TITLE)
    for flags, kwargs in FLAGS:
        group.add_argument(*flags, **kwargs)
    # argparse prints groups in the order of this list; ours was appended last
    parser._action_groups.remove(group)
    parser._action_groups.insert(0, group)
    escape_unformattable_help(parser)
    return parser


def escape_unformattable_help(parser: argparse.ArgumentParser) -> None:
    """Escape a bare ``%`` in any option's help, so that ``--help`` prints instead of raising.

    megatron-core 0.19.2's ``--moe-paged-stash-buffer-size-factor-cuda`` help says "10%)",
    which argparse reads as a format directive: its ``--help`` raises ``ValueError``.
    """
    formatter = parser._get_formatter()
    for action in parser._actions:
        if not action.help or action.help is argparse.SUPPRESS:
            continue
        try:
            formatter._expand_help(action)
        except (ValueError, TypeError, KeyError):
            action.help = action.help.replace("%", "%%")


GROUP_TITLE = "per-dtype gradient buffers (megatron_ext)"
# Our flags: (option strings, add_argument keywords); each help is one line of --help.
FLAGS: tuple[tuple[tuple[str, ...], dict], ...] = (
    (
        ("--per-dtype-grad-buffers",),
        dict(
            action="store_true",
            help="one flat gradient buffer per dtype (fp32 islands); fused, dtype-safe norm/clip",
        ),
    ),
    (
        ("--keep-in-fp32-params",),
        dict(
            type=split_patterns,
            action="extend",
            default=[],
            metavar="PATTERN[,PATTERN...]",
            help="keep parameters whose name matches (re.search) in fp32; repeatable",
        ),
    ),
    (
        ("--log-per-layer-grad-norm",),
        dict(
            action="store_true",
            help="log each layer's grad norm every --log-interval; needs the flag above",
        ),
    ),
    (
        ("--offload-step",),
        dict(
            choices=("per_parameter", "chunked"),
            default=None,
            help="with --optimizer-cpu-offload: CPU update chunked over the host mirrors "
            "(default), or per parameter",
        ),
    ),
    (
        ("--offload-delayed-update",),
        dict(
            action="store_true",
            help="with --optimizer-cpu-offload: host update beside the next step (one late)",
        ),
    ),
    (
        ("--offload-delay-warmup",),
        dict(
            type=non_negative_int,
            default=None,
            metavar="N",
            help="with --offload-delayed-update: exact steps first "
            f"(default: {DEFAULT_DELAY_WARMUP})",
        ),
    ),
    (
        ("--offload-pin-threads",),
        dict(
            action="store_true",
            help="with --offload-delayed-update: host update threads off one core per rank, "
            "left to the thread launching GPU work (Linux)",
        ),
    ),
    (
        ("--offload-overlap-forward",),
        dict(
            action="store_true",
            help="with --use-precision-aware-optimizer: exact host update beside the next "
            "forward, which waits per layer",
        ),
    ),
    (
        ("--offload-threads",),
        dict(
            type=positive_int,
            default=None,
            metavar="N",
            help="torch threads for the offloaded CPU optimizer step (default: torch's; with "
            "--offload-delayed-update, adapted as updates land)",
        ),
    ),
    (
        ("--offload-convert",),
        dict(
            choices=("host", "device"),
            default=None,
            help="with --optimizer-cpu-offload: convert bf16<->fp32 on the host, or on the "
            "GPU so fp32 crosses and the host only steps (opt-in)",
        ),
    ),
    (
        ("--offload-fraction",),
        dict(
            choices=("auto",),
            default=None,
            help="with --optimizer-cpu-offload: the smallest offload fraction whose GPU part "
            "fits (in place of --optimizer-offload-fraction); needs --offload-gpu-headroom",
        ),
    ),
    (
        ("--offload-gpu-headroom",),
        dict(
            type=byte_size,
            default=None,
            metavar="SIZE",
            help="with --offload-fraction auto: GPU memory kept for activations (e.g. 10GiB)",
        ),
    ),
    (
        ("--offload-host-bytes",),
        dict(
            type=byte_size,
            default=None,
            metavar="SIZE",
            help="with --optimizer-cpu-offload: host memory the offloaded state may take per "
            "rank (default: what the host has, shared by its ranks)",
        ),
    ),
)


OUR_OPTION_STRINGS = frozenset(s for flags, _ in FLAGS for s in flags)


def mark_matching(module: torch.nn.Module, patterns: Iterable[str]) -> list[str]:
    """Mark every parameter of ``module`` whose name matches a pattern; return their names."""
    compiled = [re.compile(p) for p in patterns]
    names = []
    for name, param in module.named_parameters():
        if any(c.search(name) for c in compiled):
            mark_keep_in_fp32(param)
            names.append(name)
    return names


def check_supported(args: argparse.Namespace) -> None:
    """Refuse, before anything is built, what ``--per-dtype-grad-buffers`` does not support."""
    problems = []
    if getattr(args, "use_torch_fsdp2", False):
        problems.append("--use-torch-fsdp2 (torch FSDP2)")
    if getattr(args, "use_megatron_fsdp", False) or getattr(args, "use_custom_fsdp", False):
        problems.append("--use-megatron-fsdp (Megatron-FSDP)")
    instances = getattr(args, "num_distributed_optimizer_instances", 1)
    if instances != 1:
        problems.append(f"--num-distributed-optimizer-instances {instances}")
    optimizer = getattr(args, "optimizer", "adam")
    if optimizer not in ("adam", "sgd") or getattr(
        args, "use_layer_wise_distributed_optimizer", False
    ):
        problems.append(f"--optimizer {optimizer} (layer-wise / emerging optimizers)")
    if problems:
        raise UnsupportedTrainingOptionError(
            "--per-dtype-grad-buffers does not support " + "; ".join(problems) + ". It works "
            "with megatron-core's DDP and its distributed (or Float16/FP32) optimizer with "
            "adam or sgd, precision-aware or not, with or without CPU offload. Drop "
            "--per-dtype-grad-buffers or the options named here."
        )


class TrainingPatches:
    """The seam entries one run has replaced; :meth:`remove` (or the with-block) restores them."""

    def __init__(self) -> None:
        self._saved: list[tuple[str, object, str, object]] = []
        self.optimizers: list = []  # the optimizers the replaced builder made

    def drain(self, *, quiet: bool = False) -> None:
        """Land every delayed offloaded update in flight (:func:`megatron_ext.drain_offload`);
        ``quiet``: an error is printed, not raised (the loop is already leaving by one)."""
        for optimizer in self.optimizers:
            try:
                drain_offload(optimizer)
            except Exception as error:
                if not quiet:
                    raise
                print(f"megatron_ext.train: draining the offloaded update failed: {error}")

    @property
    def applied(self) -> tuple[str, ...]:
        """Names of the seam entries replaced, in the order they were."""
        return tuple(name for name, *_ in self._saved)

    def replace(self, name: str, new: object) -> None:
        """Point entry ``name``'s binding at ``new`` (:func:`megatron_ext.seam.owner`)."""
        owner, attr = seam.owner(name)
        self._saved.append((name, owner, attr, getattr(owner, attr)))
        setattr(owner, attr, new)

    def adopt(self, other: TrainingPatches) -> None:
        """Take over ``other``'s replacements: :meth:`remove` undoes them too (first)."""
        self._saved += other._saved
        other._saved = []
        self.optimizers = other.optimizers

    def remove(self) -> None:
        """Restore every binding, last replaced first."""
        while self._saved:
            _name, owner, attr, old = self._saved.pop()
            setattr(owner, attr, old)

    def __enter__(self) -> TrainingPatches:
        return self

    def __exit__(self, *exc) -> None:
        self.remove()


def enable(args: argparse.Namespace) -> TrainingPatches:
    """Make ``megatron.training`` build what the parsed flags ask for; nothing when both are off.

    Call it after Megatron has parsed ``args`` (with :func:`add_arguments`) and before the
    script builds its config container (``pretrain_cfg_container_from_args``), which builds
    the DDP config. With ``--per-dtype-grad-buffers``: the DDP config class, the DDP class
    and ``get_megatron_optimizer`` of ``megatron.training`` become megatron_ext's. With
    ``--keep-in-fp32-params``: matching parameters are marked when the model chunks are
    wrapped for mixed precision, and megatron_ext's ``Float16Module`` keeps them fp32.

    Raises:
        UnsupportedTrainingOptionError: a combination the option does not support.
        MegatronCoreMismatchError: megatron-core's training loop is not one we patch.
    """
    options = TrainOptions.from_args(args)
    patches = TrainingPatches()
    if not options.on:
        return patches
    _check_needs_buffers(options)
    if options.offload_overlap_forward:
        _check_overlap_forward(args)
    _check_training_loop()
    if options.per_dtype_grad_buffers:
        check_supported(args)
    built = _BuildRecord()
    if options.per_dtype_grad_buffers:
        patches.replace("training DDP config", DistributedDataParallelConfig)
        patches.replace("training DDP", DistributedDataParallel)
    if options.keep_in_fp32_params:
        original = seam.target("training fp32 islands")
        patches.replace(
            "training fp32 islands", _keeping_fp32(original, options.keep_in_fp32_params, built)
        )
    patches.replace("training optimizer", _checked_optimizer(options, built, patches.optimizers))
    if options.log_per_layer_grad_norm:
        patches.replace("training step", _logging_per_layer(seam.target("training step"), args))
    _print_rank_0(
        f"> megatron_ext.train: {_describe(options)}; replaced {', '.join(patches.applied)} "
        "(megatron_ext.seam)"
    )
    return patches


def install() -> TrainingPatches:
    """What the entry point does before it runs the script: flags in the parser, helpers build.

    Wraps ``megatron.training.arguments.parse_and_validate_args`` so the script's parser
    knows our flags and, once it has parsed them, :func:`enable` applies what they ask for;
    skips the dataset helpers' ``make`` where megatron-core has no Makefile but the compiled
    helpers import. Call it before the script imports ``parse_and_validate_args``;
    ``remove()`` the result (it also undoes what :func:`enable` applied).
    """
    _check_training_loop()
    parse = seam.target("training args")
    if getattr(parse, _WRAPPED_MARK, False):
        raise RuntimeError("megatron_ext.train.install() is already in effect")
    patches = TrainingPatches()
    patches.replace("dataset helpers build", _unless_prebuilt(seam.target("dataset helpers build")))
    patches.replace("training args", _parse_then_enable(parse, patches))
    return patches


def main(argv: list[str] | None = None) -> None:
    """``python -m megatron_ext.train SCRIPT ARGS...``: run SCRIPT as ``__main__``, installed.

    ``--help`` lists our flags; ``--help-megatron`` Megatron-LM's arguments; ``SCRIPT
    --help`` both, ours first (without running SCRIPT). Exits 2 with a usage line and one
    error line without SCRIPT, and with one error line for a bad value of one of our flags;
    1 with one line for a refusal (:func:`refuse_unsupported`, no GPU).
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv:
        print(USAGE, file=sys.stderr)
        print(f"megatron_ext.train: error: no SCRIPT given; {MORE_HELP}", file=sys.stderr)
        raise SystemExit(2)
    if argv[0] in ("-h", "--help"):
        print(help_text())
        raise SystemExit(0)
    if argv[0] == HELP_MEGATRON:
        print(megatron_help())
        raise SystemExit(0)
    script = find_script(argv[0])
    if {"-h", "--help"} & set(argv[1:]):
        # not the script's own --help: at core_v0.19.0 pretrain_gpt.py parses its arguments
        # first through megatron.training's parse_args, whose help raises on a bare "%"
        print(help_text(megatron=True))
        raise SystemExit(0)
    try:
        refuse_unsupported(argv[1:])
    except argparse.ArgumentError as e:  # one of our flags: one line, not Megatron's usage
        print(f"megatron_ext.train: error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    except UnsupportedTrainingOptionError as e:
        raise SystemExit(f"megatron_ext.train: error: {e}") from None
    sys.argv = [str(script), *argv[1:]]
    sys.path.insert(0, str(script.parent))  # as `python SCRIPT` does: its sibling modules
    patches = install()
    # outermost, so that it runs before Megatron-LM parses (and prints) its arguments
    patches.replace("training args", _refusing_without_cuda(seam.target("training args")))
    try:
        runpy.run_path(str(script), run_name="__main__")
    except AssertionError as e:
        patches.drain(quiet=True)  # no host update left running when the loop fails
        # a script that calls initialize_megatron without parsing Megatron-LM's arguments
        # first: its assert ("Megatron requires CUDA.") in one line instead of a traceback
        if "requires CUDA" in str(e) and not torch.cuda.is_available():
            raise SystemExit(f"megatron_ext.train: error: {NEEDS_CUDA}") from None
        raise
    except BaseException:
        patches.drain(quiet=True)
        raise
    else:
        patches.drain()
    finally:
        patches.remove()


def _refusing_without_cuda(parse: Callable) -> Callable:
    """``parse_and_validate_args`` that first refuses, where torch sees no GPU, a script
    that parses Megatron-LM's training arguments: what comes next in every such script is
    ``pretrain``, whose ``initialize_megatron`` asserts CUDA, after Megatron-LM printed
    every argument (~850 lines). A script that never parses them still runs without a GPU."""

    def parse_and_validate_args(*args, **kwargs):
        if not torch.cuda.is_available():
            raise SystemExit(f"megatron_ext.train: error: {NEEDS_CUDA}")
        return parse(*args, **kwargs)

    return parse_and_validate_args


NEEDS_CUDA = (
    "Megatron-LM's training loop needs a CUDA GPU (its initialize_megatron asserts one) and "
    "torch sees none; on the CPU, use buffers.FlatGradBuffers (python -m buffers.demo shows it)"
)
HELP_MEGATRON = "--help-megatron"
USAGE = f"usage: python -m megatron_ext.train [--help | {HELP_MEGATRON}] SCRIPT [ARGS...]"
MORE_HELP = (
    f"--help lists our flags, {HELP_MEGATRON} Megatron-LM's, SCRIPT --help both (ours first)"
)


def help_text(*, megatron: bool = False) -> str:
    """What ``python -m megatron_ext.train --help`` prints: the usage and our flags, one
    line each, then where Megatron-LM's arguments are listed (``megatron``: those
    arguments, as ``SCRIPT --help`` prints them)."""
    labels = [" ".join(flags) + _values(kwargs) for flags, kwargs in FLAGS]
    width = max(map(len, labels))
    lines = [
        USAGE,
        "",
        "Runs SCRIPT, a Megatron-LM launch script (e.g. pretrain_gpt.py; also looked up",
        "under $MEGATRON_LM_PATH), with these flags added:",
        "",
        *(
            f"  {label:<{width}}  {kwargs['help']}"
            for label, (_, kwargs) in zip(labels, FLAGS, strict=True)
        ),
        "",
    ]
    if megatron:
        return "\n".join([*lines, megatron_help()])
    return "\n".join(
        [
            *lines,
            f"Megatron-LM's own arguments: python -m megatron_ext.train {HELP_MEGATRON} lists",
            "them; python -m megatron_ext.train SCRIPT --help lists ours, then them.",
        ]
    )


def _values(kwargs: dict) -> str:
    """What a flag takes, as argparse shows it: ``{a,b}`` for choices, else its metavar."""
    if "choices" in kwargs:
        return " {" + ",".join(kwargs["choices"]) + "}"
    return f" {kwargs['metavar']}" if "metavar" in kwargs else ""


def megatron_help() -> str:
    """Megatron-LM's own arguments, as its parser lists them (without its usage line)."""
    import warnings

    try:
        with warnings.catch_warnings():  # megatron-core's import-time notices
            warnings.simplefilter("ignore")
            seam.check_deferred()
            add_megatron_arguments = seam.optional("training arguments")
        if add_megatron_arguments is None:
            raise ImportError("no megatron.training.arguments.add_megatron_arguments")
    except Exception as e:  # any failure to import it only shortens the help
        return (
            "Megatron-LM's arguments: not listed, megatron.training does not import here "
            f"({type(e).__name__}: {e}); SCRIPT --help lists them where it does"
        )
    parser = argparse.ArgumentParser(usage=argparse.SUPPRESS, add_help=False, allow_abbrev=False)
    parser = add_megatron_arguments(parser)
    escape_unformattable_help(parser)
    return "Megatron-LM's arguments (megatron.training):\n" + parser.format_help().lstrip("\n")


def refuse_unsupported(argv: list[str]) -> None:
    """Refuse, from the command line alone, what our flags do not support, and gradient
    accumulation fusion (Megatron-LM's default) where apex's kernel for it is absent.

    Runs before the script, so the refusal comes before Megatron-LM's own argument checks
    (whose asserts on, e.g., ``--use-torch-fsdp2`` would otherwise come first, as a
    traceback) and before megatron-core's output layer raises at construction. A command
    line this cannot read for one of Megatron-LM's flags is left to Megatron-LM's parser.

    Raises:
        UnsupportedTrainingOptionError: names the flags and what to do.
        argparse.ArgumentError: a bad value of one of our flags (argparse's message).
    """
    pre = argparse.ArgumentParser(add_help=False, allow_abbrev=False, exit_on_error=False)
    add_arguments(pre)
    for flag in SCREENED_FLAGS:
        pre.add_argument(flag, action="store_true")
    pre.add_argument("--num-distributed-optimizer-instances", type=int, default=1)
    pre.add_argument("--optimizer", default="adam")
    pre.add_argument("--log-params-norm", action="store_true")
    pre.add_argument("--optimizer-cpu-offload", action="store_true")
    pre.add_argument("--optimizer-offload-fraction", default=None)
    pre.add_argument("--check-weight-hash-across-dp-replicas-interval", type=int, default=None)
    pre.add_argument(NO_FUSION, action="store_false", dest="gradient_accumulation_fusion")
    try:
        args, _ = pre.parse_known_args(argv)
    except argparse.ArgumentError as e:
        if e.argument_name in OUR_OPTION_STRINGS:
            raise
        return  # one of Megatron-LM's flags: its own parser reports it
    if args.gradient_accumulation_fusion and not wgrad_fusion.fusion_kernel_available():
        # both sides of a comparison: stock fails too, inside megatron-core's output layer
        raise UnsupportedTrainingOptionError(
            wgrad_fusion.message(f"add {NO_FUSION} (Megatron-LM turns the fusion on by default)")
        )
    options = TrainOptions.from_args(args)
    _check_needs_buffers(options)
    _check_offload_flags(options, args)
    if options.offload_overlap_forward:
        _check_overlap_forward(args)
    if options.per_dtype_grad_buffers:
        check_supported(args)


def _check_needs_buffers(options: TrainOptions) -> None:
    if options.per_dtype_grad_buffers:
        return
    if options.log_per_layer_grad_norm:
        raise UnsupportedTrainingOptionError(NEEDS_BUFFERS)
    if options.offload_flags:
        raise UnsupportedTrainingOptionError(
            f"{' '.join(options.offload_flags)} needs --per-dtype-grad-buffers (they set how "
            "megatron_ext's host mirrors step); add it, or drop them"
        )


def _check_offload_flags(options: TrainOptions, args: argparse.Namespace) -> None:
    """Refuse offload flags without CPU offload (they would do nothing) and offload flags
    that cannot go together, naming them as typed."""
    if options.offload_flags and not getattr(args, "optimizer_cpu_offload", False):
        raise UnsupportedTrainingOptionError(
            f"{' '.join(options.offload_flags)} sets how the CPU-offloaded optimizer steps, "
            "and without --optimizer-cpu-offload nothing is offloaded; add "
            "--optimizer-cpu-offload, or drop them"
        )
    conflict = options.offload_conflict()
    if conflict is not None:
        raise UnsupportedTrainingOptionError(conflict)
    fraction = getattr(args, "optimizer_offload_fraction", None)
    if options.offload_fraction == "auto" and fraction is not None:
        raise UnsupportedTrainingOptionError(
            f"--offload-fraction auto chooses the fraction that --optimizer-offload-fraction "
            f"{fraction} sets; give one of them"
        )


def _check_overlap_forward(args: argparse.Namespace) -> None:
    """Refuse what reads every parameter right after the step, before the overlapped host
    update has sent them back (only the forward pass waits for it)."""
    readers = []
    if getattr(args, "log_params_norm", False):
        readers.append("--log-params-norm")
    interval = getattr(args, "check_weight_hash_across_dp_replicas_interval", None)
    if interval:
        readers.append(f"--check-weight-hash-across-dp-replicas-interval {interval}")
    if readers:
        raise UnsupportedTrainingOptionError(
            f"--offload-overlap-forward with {' and '.join(readers)}: they read every "
            "parameter right after the optimizer step, while its host update is still "
            "sending them back (only the next forward pass waits for it); drop them, or "
            "--offload-overlap-forward"
        )


NO_FUSION = "--no-gradient-accumulation-fusion"
# Megatron-LM's on/off flags that check_supported reads
SCREENED_FLAGS = (
    "--use-torch-fsdp2",
    "--use-megatron-fsdp",
    "--use-custom-fsdp",
    "--use-layer-wise-distributed-optimizer",
)
NEEDS_BUFFERS = (
    "--log-per-layer-grad-norm needs --per-dtype-grad-buffers (the per-layer norms come from "
    "the flat buffers' norm pass); add it, or drop --log-per-layer-grad-norm"
)


def find_script(name: str) -> Path:
    """``name`` as given, else under ``$MEGATRON_LM_PATH``; a clear error when neither exists."""
    candidates = [Path(name)]
    root = os.environ.get("MEGATRON_LM_PATH")
    if root:
        candidates.append(Path(root) / name)
    for path in candidates:
        if path.is_file():
            return path.resolve()
    where = f" nor under MEGATRON_LM_PATH={root}" if root else " (MEGATRON_LM_PATH is not set)"
    raise SystemExit(
        f"megatron_ext.train: {name} not found{where}. Megatron-LM's launch scripts are not in "
        "the megatron-core wheel: take them from a Megatron-LM checkout at the tag matching "
        "your megatron-core (scripts/fetch_megatron_lm.sh) and set MEGATRON_LM_PATH."
    )


# -- the replacements ---------------------------------------------------------------------


class _BuildRecord:
    """What the replaced build steps saw, so the optimizer step can tell whether they ran."""

    def __init__(self) -> None:
        self.wrapped_chunks = 0
        self.marked: list[str] = []


def _keeping_fp32(original: Callable, patterns: tuple[str, ...], built: _BuildRecord):
    stock_wrapper = seam.target("Float16Module")

    # megatron-core's default wrapper is its Float16Module: a caller that leaves it out
    # gets ours in its place, as one that passes it does
    def wrap_with_mp_wrapper(model_list, transformer_config, mixed_precision_wrapper=stock_wrapper):
        marked = [name for chunk in model_list for name in mark_matching(chunk, patterns)]
        if mixed_precision_wrapper is stock_wrapper:
            mixed_precision_wrapper = Float16Module
        elif mixed_precision_wrapper is not None and marked:
            raise UnsupportedTrainingOptionError(
                "--keep-in-fp32-params needs megatron-core's Float16Module as the mixed-"
                f"precision wrapper; this model uses {mixed_precision_wrapper!r}"
            )
        built.wrapped_chunks += len(model_list)
        built.marked += marked
        _check_every_pattern_matched(patterns, marked, model_list, transformer_config)
        _print_rank_0(
            f"> megatron_ext.train: keeping {len(marked)} parameters in fp32 "
            f"(--keep-in-fp32-params): {', '.join(marked)}"
        )
        return original(model_list, transformer_config, mixed_precision_wrapper)

    return wrap_with_mp_wrapper


def _check_every_pattern_matched(patterns, marked, model_list, transformer_config) -> None:
    # With pipeline parallelism a stage may hold none of a pattern's parameters (e.g. the
    # final layernorm), so only a single-stage model can tell a pattern that matches nothing.
    if getattr(transformer_config, "pipeline_model_parallel_size", 1) != 1:
        return
    unmatched = [p for p in patterns if not any(re.search(p, n) for n in marked)]
    if unmatched:
        example = next((n for chunk in model_list for n, _ in chunk.named_parameters()), "")
        raise UnsupportedTrainingOptionError(
            f"--keep-in-fp32-params: {', '.join(map(repr, unmatched))} matches no parameter; "
            f"names look like {example!r} (re.search on named_parameters())"
        )


def _checked_optimizer(options: TrainOptions, built: _BuildRecord, made: list | None = None):
    stock = seam.target("training optimizer")

    def build_optimizer(config, model_chunks, *args, **kwargs):
        if options.keep_in_fp32_params and built.wrapped_chunks == 0:
            raise UnsupportedTrainingOptionError(
                "--keep-in-fp32-params: the model was not built through megatron.training's "
                "model builders (a ModelConfig, as pretrain_gpt.py passes at core_v0.19), so "
                "no parameter was marked; megatron_ext.train does not patch the model_provider "
                "path (megatron.training.get_model)"
            )
        if not options.per_dtype_grad_buffers:
            return stock(config, model_chunks, *args, **kwargs)
        others = sorted({type(m).__name__ for m in model_chunks if not _has_option_on(m)})
        if others:
            raise UnsupportedTrainingOptionError(
                f"--per-dtype-grad-buffers: model chunks of type {', '.join(others)} were not "
                "wrapped in megatron_ext.DistributedDataParallel (megatron_ext.train patches "
                "megatron.training's model builders, not the model_provider path)"
            )
        optimizer = get_megatron_optimizer(
            config, model_chunks, *args, options=options.megatron_options(), **kwargs
        )
        if options.log_per_layer_grad_norm and not hasattr(
            optimizer, "request_per_param_grad_norms"
        ):
            raise UnsupportedTrainingOptionError(
                f"--log-per-layer-grad-norm: megatron-core returned a {type(optimizer).__name__}"
                ", not a ChainedOptimizer, so its step cannot compute per-parameter norms; "
                "drop --log-per-layer-grad-norm"
            )
        if made is not None:
            made.append(optimizer)
        return optimizer

    return build_optimizer


def _has_option_on(chunk) -> bool:
    return bool(getattr(chunk, "per_dtype_grad_buffers", False))


def _parse_then_enable(parse: Callable, patches: TrainingPatches):
    def parse_and_validate_args(extra_args_provider=None, ignore_unknown_args=False,
                                args_defaults=None):  # fmt: skip
        def provider(parser):
            if extra_args_provider is not None:
                parser = extra_args_provider(parser)
            return add_arguments(parser)

        if not {"-h", "--help"} & set(sys.argv[1:]):
            # a bad value of one of our flags is left to Megatron-LM's parser to report
            with contextlib.suppress(argparse.ArgumentError):
                refuse_unsupported(sys.argv[1:])  # before Megatron-LM's own checks assert
        args = parse(
            extra_args_provider=provider,
            ignore_unknown_args=ignore_unknown_args,
            args_defaults={} if args_defaults is None else args_defaults,
        )
        if not enabled:  # a second parse (none in Megatron-LM's scripts) changes nothing
            enabled.append(True)
            patches.adopt(enable(args))
        return args

    enabled: list[bool] = []
    setattr(parse_and_validate_args, _WRAPPED_MARK, True)
    return parse_and_validate_args


def _unless_prebuilt(original: Callable):
    datasets = Path(inspect.getfile(original)).parent

    def compile_helpers():
        if not (datasets / "Makefile").exists() and seam.optional("dataset helpers") is not None:
            print(
                "> megatron_ext.train: megatron-core has no dataset Makefile (a wheel) and its "
                "compiled helpers import: skipping `make`",
                flush=True,
            )
            return None
        return original()

    return compile_helpers


def _check_training_loop() -> None:
    version = seam.check_deferred()
    if version[:2] < FIRST_VERSION:
        raise seam.MegatronCoreMismatchError(
            "megatron_ext.train patches the training loop of megatron-core >= "
            f"{'.'.join(map(str, FIRST_VERSION))} (pretrain(cfg_container, ...)); the "
            f"installed one is {'.'.join(map(str, version[:3]))}"
        )


def _describe(options: TrainOptions) -> str:
    parts = []
    if options.per_dtype_grad_buffers:
        parts.append("--per-dtype-grad-buffers")
    if options.keep_in_fp32_params:
        parts.append(f"--keep-in-fp32-params {','.join(options.keep_in_fp32_params)}")
    if options.log_per_layer_grad_norm:
        parts.append("--log-per-layer-grad-norm")
    parts += options.offload_flags
    return " ".join(parts)


_LAYER_PREFIX = re.compile(r"^(.*?\blayers\.\d+)\.")
PER_LAYER_TAG = "per-layer grad norm"  # console line prefix and TensorBoard/W&B namespace


def layer_of(name: str) -> str:
    """The group a parameter's norm is logged under: its layer (``decoder.layers.3``, a
    global index) inside the layer stack, else the module that owns it
    (``embedding.word_embeddings``, ``output_layer``); wrapper prefixes dropped."""
    while name.startswith("module."):
        name = name[len("module.") :]
    m = _LAYER_PREFIX.match(name)
    if m:
        return m.group(1)
    return name.rsplit(".", 1)[0] if "." in name else name


def _logging_per_layer(original: Callable, args: argparse.Namespace):
    """``train_step`` that, on iterations Megatron-LM logs, asks the optimizer for
    per-parameter norms in that step's norm pass and logs them per layer."""
    indices: dict[tuple[str, ...], object] = {}

    def train_step(forward_step_func, data_iterator, model, optimizer, *rest, **kwargs):
        iteration: int | None = kwargs.get("iteration")
        if iteration is None:
            iteration = getattr(args, "curr_iteration", 0)
        logged = optimizer is not None and (iteration + 1) % args.log_interval == 0
        if logged:
            optimizer.request_per_param_grad_norms()
        out = original(forward_step_func, data_iterator, model, optimizer, *rest, **kwargs)
        if logged:
            norms = optimizer.take_per_param_grad_norms()  # None: the step was skipped
            if norms is not None:
                log_per_layer(norms, iteration + 1, indices)
        return out

    return train_step


def log_per_layer(norms, iteration: int, indices: dict) -> dict[str, float]:
    """Fold per-parameter norms into layers (on the device; one copy to the host) and log
    them: one console line on the last rank (where Megatron-LM prints its own), a scalar
    per layer to TensorBoard and W&B where their writers exist. Returns what was logged."""
    from buffers.param_norms import GroupIndex

    if norms.names not in indices:
        indices[norms.names] = GroupIndex(norms.names, layer_of)
    values = dict(norms.by_group(indices[norms.names]).items())
    tensorboard = seam.target("training tensorboard")()
    wandb = seam.target("training wandb")()
    for layer, value in values.items():
        if tensorboard is not None:
            tensorboard.add_scalar(f"{PER_LAYER_TAG}/{layer}", value, iteration)
    if wandb is not None:
        wandb.log({f"{PER_LAYER_TAG}/{k}": v for k, v in values.items()}, iteration)
    rank, world = 0, 1
    if torch.distributed.is_initialized():
        rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    if rank == world - 1:
        cells = " | ".join(f"{k}: {v:.6E}" for k, v in values.items())
        print(f" {PER_LAYER_TAG} | iteration {iteration:8d} | {cells}", flush=True)
    return values


def _print_rank_0(text: str) -> None:
    if torch.distributed.is_initialized():
        rank = torch.distributed.get_rank()
    else:
        rank = int(os.environ.get("RANK", "0"))
    if rank == 0:
        print(text, flush=True)


if __name__ == "__main__":
    from megatron_ext.train import main as _main  # one copy of this module's state

    _main()
