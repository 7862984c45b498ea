"""What every benchmark script shares: options, timing, ceilings, progress and writers.

Timing: on CUDA, CUDA events around each call after a warm-up, median of many; on the CPU,
``time.perf_counter`` the same way. Repeats are interleaved (:func:`interleave`): every
variant of a comparison, and the copy its floor comes from, is timed once per round, in
turn, so a moment when the machine is slow lands on all of them instead of on one row; each
reports its fastest round, ratios are taken against the same run's fastest copy, and a
spread of more than :data:`SPREAD_WARNING` between rounds is reported
(:func:`spread_warning`).

Host time is measured separately: the wall time of issuing one call without synchronizing
(the device is drained before each one). The copy bandwidth ceiling counts read + write
bytes, so a pass that reads N bytes once has the floor ``N / bandwidth`` and a
read-modify-write pass ``2 N / bandwidth``.

Output folder: ``--out DIR`` when given, else ``$OUT`` when set, else ``bench-out`` (relative
to the current directory). Arguments are checked before anything is measured: every
script's parser (:func:`base_parser`) refuses a bad value in one line naming the option,
and an output folder it cannot write (:func:`unwritable`). Importing this module also
hides megatron-core's import-time notices that are known and harmless here
(:func:`quiet_known_notices`).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import logging
import math
import os
import statistics
import sys
import tempfile
import time
import traceback
import warnings
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

import torch

# Warm-up calls and timed calls per measurement (spread over its rounds), by device type,
# unless --warmup/--reps say.
DEFAULT_REPEATS = {"cpu": (1, 5), "cuda": (5, 50)}
# Interleaved rounds per measurement unless --rounds says; more on the (shared, noisy) CPU.
DEFAULT_ROUNDS = {"cpu": 5, "cuda": 5}
# Rounds of one measurement further apart than this ((slowest - fastest) / fastest): warn.
SPREAD_WARNING = 0.20
# Slow calls (e.g. a per-parameter loop over 10,000 parameters) get fewer timed calls, so one
# measurement takes about this long, but never fewer than MIN_REPS.
BUDGET_S = 3.0
MIN_REPS = 3


# megatron-core's import-time notices that say nothing about a benchmark run (docs/megatron-core.md,
# "Notices at import"): (category, message prefix) for warnings, and torch's logger that
# reports CUDA_HOME when no CUDA runtime is found.
KNOWN_NOTICES = (
    (UserWarning, "Transformer Engine and Apex are not installed"),
    (UserWarning, "absl.logging is not installed"),
)
QUIET_LOGGERS = ("torch.utils.cpp_extension",)


def quiet_known_notices() -> None:
    """Hide :data:`KNOWN_NOTICES` and :data:`QUIET_LOGGERS`' warnings; other warnings show."""
    for category, prefix in KNOWN_NOTICES:
        warnings.filterwarnings("ignore", message=prefix, category=category)
    for name in QUIET_LOGGERS:
        logging.getLogger(name).setLevel(logging.ERROR)


quiet_known_notices()


def default_out() -> Path:
    """Where outputs go without ``--out``: ``$OUT`` when set, else ``bench-out``."""
    return Path(os.environ.get("OUT") or "bench-out")


def int_at_least(minimum: int) -> Callable[[str], int]:
    """An argparse type: an int of at least ``minimum``."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"expected an integer >= {minimum}, got {value}")
        return value

    return parse


positive_int = int_at_least(1)
non_negative_int = int_at_least(0)


def ints_at_least(minimum: int) -> Callable[[str], list[int]]:
    """An argparse type: comma-separated ints, each at least ``minimum`` (``"1,2"``)."""
    one = int_at_least(minimum)

    def parse(text: str) -> list[int]:
        return [one(v.strip()) for v in text.split(",") if v.strip()]

    return parse


def fraction(text: str) -> float:
    """An argparse type: an offload fraction, a float in (0, 1]."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number in (0, 1], got {text!r}") from None
    if not 0.0 < value <= 1.0:  # NaN too
        raise argparse.ArgumentTypeError(f"expected a number in (0, 1], got {text}")
    return value


def float_above(minimum: float, *, or_equal: bool = False) -> Callable[[str], float]:
    """An argparse type: a finite float above ``minimum`` (or equal to it, ``or_equal``)."""
    bound = f"{'>=' if or_equal else '>'} {minimum:g}"

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number {bound}, got {text!r}") from None
        low_ok = value >= minimum if or_equal else value > minimum
        if not (low_ok and value < math.inf):  # NaN too
            raise argparse.ArgumentTypeError(f"expected a number {bound}, got {text}")
        return value

    return parse


positive_float = float_above(0.0)
non_negative_float = float_above(0.0, or_equal=True)


def unwritable(folder: Path) -> str | None:
    """Why the benchmark's files cannot be written to ``folder``; None when they can.

    Found without creating anything that stays: the deepest part of ``folder`` that exists
    must be a folder in which a file can be created (one is, then removed).
    """
    existing = folder
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        return f"{folder}: {existing} is not a folder"
    try:
        with tempfile.TemporaryFile(dir=existing):
            pass
    except OSError as e:
        return f"{folder}: cannot create a file in {existing} ({e.strerror or e})"
    return None


class BenchmarkParser(argparse.ArgumentParser):
    """argparse with a usage error in one line (what was wrong, naming the option) and the
    output folder checked once the arguments are parsed, before anything is measured."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (--help lists the options)\n")

    def parse_known_args(self, args=None, namespace=None):  # type: ignore[override]
        parsed, extra = super().parse_known_args(args, namespace)
        out = getattr(parsed, "out", None)
        if out is not None and (why := unwritable(out)) is not None:
            typed = sys.argv[1:] if args is None else list(args)
            flag = any(a == "--out" or a.startswith("--out=") for a in typed)
            given = "$OUT" if os.environ.get("OUT") and not flag else "--out"
            self.error(f"argument {given}: {why}; give a folder that can be written")
        return parsed, extra


def base_parser(description: str, timed: bool = True) -> argparse.ArgumentParser:
    """An argument parser with the options every benchmark script takes.

    Every option's help ends with its default.

    Args:
        description: the script's docstring (``--help`` shows its first paragraph) or a
            one-line description.
        timed: add ``--warmup`` and ``--reps`` (for scripts that time calls).

    Returns:
        The parser (a :class:`BenchmarkParser`): ``--device``, ``--out`` and, when timed,
        ``--warmup``, ``--reps``, ``--rounds``.
    """
    first_paragraph = " ".join(description.strip().split("\n\n")[0].split())
    ap = BenchmarkParser(description=first_paragraph)
    ap.add_argument(
        "--device",
        choices=("cpu", "cuda"),
        default="cuda" if torch.cuda.is_available() else "cpu",
        help="where to run (default: cuda when torch sees a GPU, else cpu; here %(default)s)",
    )
    ap.add_argument(
        "--out",
        type=Path,
        default=default_out(),
        help="output folder for the JSON and PNG files; --out wins over $OUT (default: $OUT "
        "when set, else bench-out; here %(default)s)",
    )
    if timed:
        cpu, cuda = DEFAULT_REPEATS["cpu"], DEFAULT_REPEATS["cuda"]
        ap.add_argument(
            "--warmup",
            type=non_negative_int,
            default=None,
            help=f"untimed calls before timing (default: {cpu[0]} on the CPU, {cuda[0]} on CUDA)",
        )
        ap.add_argument(
            "--reps",
            type=positive_int,
            default=None,
            help=f"timed calls per measurement, spread over its rounds (default: {cpu[1]} on "
            f"the CPU, {cuda[1]} on CUDA; fewer when one call takes long)",
        )
        ap.add_argument(
            "--rounds",
            type=positive_int,
            default=None,
            help="interleaved rounds: every variant and the floor's copy timed once per round, "
            "in turn; each reports its fastest round's median, and a spread over "
            f"{SPREAD_WARNING * 100:.0f}%% between rounds is warned about (default: "
            f"{DEFAULT_ROUNDS['cpu']} on the CPU, {DEFAULT_ROUNDS['cuda']} on CUDA)",
        )
    return ap


# The scripts of this directory; every other module in it is a helper of some of them.
SCRIPTS = (
    "norm_clip.py",
    "memory.py",
    "offload.py",
    "offload_step.py",
    "clip_step.py",
    "train_step.py",
    "cpu_norm.py",
    "offload_overlap.py",
    "offload_scale.py",
)


def not_a_script(path: str, scripts: Sequence[str] = SCRIPTS) -> str:
    """The message for running a helper module of the benchmark scripts directly."""
    names = ", ".join(f"benchmarks/{s}" for s in scripts)
    return (
        f"benchmarks/{Path(path).name} is a helper module of {names}, not a script; run "
        f"python benchmarks/{scripts[0]} --help"
    )


def resolve_device(name: str) -> torch.device:
    """The device named on the command line, or an error saying why it cannot be used.

    Args:
        name: ``"cpu"`` or ``"cuda"``.

    Returns:
        The device (``cuda`` means the current CUDA device).
    """
    if name == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda was given but torch sees no CUDA device; use --device cpu")
    return torch.device(name, torch.cuda.current_device()) if name == "cuda" else torch.device(name)


def repeats(args: argparse.Namespace, device: torch.device) -> tuple[int, int]:
    """``(warmup, reps)``: the command line's values, else the device type's defaults."""
    warmup, reps = DEFAULT_REPEATS[device.type]
    return (
        warmup if args.warmup is None else args.warmup,
        reps if args.reps is None else args.reps,
    )


def rounds(args: argparse.Namespace, device: torch.device) -> int:
    """Interleaved rounds: ``--rounds`` (1 or more: :func:`base_parser`), else the device
    type's default."""
    given = getattr(args, "rounds", None)
    return DEFAULT_ROUNDS[device.type] if given is None else given


def per_round(reps: int, rounds: int) -> int:
    """Timed calls in each of ``rounds`` rounds for ``reps`` in all (at least one)."""
    return max(1, -(-reps // rounds))


def interleave(measures: dict[Any, Callable[[int], Any]], rounds: int, desc: str | None = None):
    """Call every measure once per round, in turn: a slow moment lands on all of them.

    Args:
        measures: key -> measure; a measure gets the round's index (0 first: warm up there)
            and returns what it measured.
        rounds: how many rounds.
        desc: a :func:`progress` bar of this name that moves at every call (None: no bar).

    Returns:
        ``(results, errors)``: key -> one result per round, for the measures that never
        raised; key -> the exception, for those that did (not called again after it).
    """
    results: dict[Any, list] = {key: [] for key in measures}
    errors: dict[Any, BaseException] = {}
    calls = [(r, key) for r in range(rounds) for key in measures]
    for r, key in calls if desc is None else progress(calls, desc):
        if key in errors:
            continue
        try:
            results[key].append(measures[key](r))
        except Exception as exc:  # one failing row must not stop the others
            errors[key] = exc
    return {k: v for k, v in results.items() if k not in errors}, errors


def round_fields(prefix: str, per_round_s: Sequence[float]) -> dict[str, Any]:
    """``{prefix}_s``: the fastest round; ``{prefix}_spread``: (slowest - fastest) / fastest;
    ``{prefix}_rounds_s``: every round's value, in order."""
    return {
        f"{prefix}_s": min(per_round_s),
        f"{prefix}_spread": spread(per_round_s),
        f"{prefix}_rounds_s": list(per_round_s),
    }


def spread(values: Sequence[float]) -> float:
    """(largest - smallest) / smallest: how far apart repeats of one measurement are."""
    low = min(values)
    return (max(values) - low) / low if low > 0 else 0.0


def spread_warning(spreads: dict[str, float], rounds: int) -> str | None:
    """One line when any measurement's rounds spread more than :data:`SPREAD_WARNING`.

    Args:
        spreads: measurement label -> its spread (:func:`spread`).
        rounds: rounds per measurement (said in the line).

    Returns:
        ``"warning: ..."`` naming how many and the worst, or None when all are within.
    """
    over = {k: v for k, v in spreads.items() if v > SPREAD_WARNING}
    if not over:
        return None
    worst = max(over, key=over.get)
    return (
        f"warning: {len(over)} of {len(spreads)} measurements spread more than "
        f"{SPREAD_WARNING:.0%} over their {rounds} interleaved rounds (worst: {worst}, "
        f"{over[worst]:.0%}): the machine was busy or the timing is noisy; each reports its "
        "fastest round"
    )


def noise_band(median_spread: float) -> float:
    """The ratio under which two timings of this run cannot be told apart: each side's
    fastest round may be off by the typical spread, so ``(1 + median spread) ** 2``, at
    least 1.1."""
    return max(1.1, (1 + median_spread) ** 2)


def noise_line(spreads: dict[str, float], rounds: int, device: torch.device) -> str:
    """One line saying how noisy this run's timings were, from every measurement's spread.

    Args:
        spreads: measurement label -> its spread over its rounds (:func:`spread`).
        rounds: rounds per measurement.
        device: the CPU's timings are called a shared machine's.

    Returns:
        The median and worst spread and the ratio below which a comparison is noise
        (:func:`noise_band`); with one round, that no spread was measured.
    """
    where = "CPU timings on a shared machine" if device.type == "cpu" else "GPU timings"
    if rounds < 2 or not spreads:
        return f"{where}: one round per measurement, so no spread was measured"
    median, worst = statistics.median(spreads.values()), max(spreads.values())

    def shown(value: float) -> str:  # a stalled round: its digits say nothing more
        return f"{value:.0%}" if value < 10 else ">999%"

    band = noise_band(median)
    verdict = f"treat ratios under {band:.1f}x as noise" if band < 10 else "every ratio is noise"
    return f"{where}: median spread {shown(median)}, worst {shown(worst)}; {verdict}"


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work (a no-op on the CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def affordable_reps(fn: Callable[[], Any], device: torch.device, reps: int) -> int:
    """``reps``, or fewer when one call is slow: what fits in :data:`BUDGET_S` (>= MIN_REPS).

    Args:
        fn: the call; called once, synchronized, to see how long it takes.
        device: where it runs.
        reps: the most calls wanted.

    Returns:
        How many timed calls to make.
    """
    synchronize(device)
    t0 = time.perf_counter()
    fn()
    synchronize(device)
    per_call = max(time.perf_counter() - t0, 1e-9)
    return max(min(reps, MIN_REPS), min(reps, int(BUDGET_S / per_call)))


def device_time(fn: Callable[[], Any], device: torch.device, warmup: int, reps: int) -> float:
    """Median seconds per call of ``fn`` as the device sees it.

    Args:
        fn: the call to time; called ``warmup`` times, once more to size the run, then
            ``reps`` times (fewer when slow, see :func:`affordable_reps`).
        device: CUDA events bracket each call on CUDA; ``perf_counter`` on the CPU.
        warmup: untimed calls first.
        reps: timed calls.

    Returns:
        The median, in seconds.
    """
    for _ in range(warmup):
        fn()
    reps = affordable_reps(fn, device, reps)
    if device.type == "cuda":
        events = []
        for _ in range(reps):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            events.append((start, end))
        synchronize(device)
        return statistics.median(s.elapsed_time(e) / 1e3 for s, e in events)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def host_times(fn: Callable[[], Any], device: torch.device, reps: int) -> list[float]:
    """Wall seconds to issue each of ``reps`` calls of ``fn``, without synchronizing after.

    Args:
        fn: the call to measure.
        device: drained before each call, so a full launch queue never stalls the issue.
        reps: calls measured (fewer when slow, see :func:`affordable_reps`).

    Returns:
        One time per call, in call order.
    """
    reps = affordable_reps(fn, device, reps)
    times = []
    for _ in range(reps):
        synchronize(device)
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    synchronize(device)
    return times


def host_profile(
    fn: Callable[[], Any], device: torch.device, calls: int = 200, top: int = 12
) -> list[str]:
    """Where the host time of ``fn`` goes: cProfile over ``calls`` calls (the device drained
    before each, outside the profile), the ``top`` functions by own time.

    Returns:
        One line per function: own microseconds per call, calls per call, ``file:line(name)``.
    """
    import cProfile
    import pstats

    prof = cProfile.Profile()
    for _ in range(calls):
        synchronize(device)
        prof.enable()
        fn()
        prof.disable()
    synchronize(device)
    stats = pstats.Stats(prof).stats  # (file, line, name) -> (cc, nc, tt, ct, callers)
    rows = sorted(stats.items(), key=lambda kv: kv[1][2], reverse=True)[:top]
    return [
        f"{tt / calls * 1e6:7.2f} us {nc / calls:6.1f}x {Path(f).name}:{line}({name})"
        for (f, line, name), (_, nc, tt, _, _) in rows
    ]


def burst_host_times(
    fn: Callable[[], Any], device: torch.device, calls: int = 20, bursts: int = 15
) -> list[float]:
    """Host seconds per call when ``calls`` calls are issued back to back, once per burst.

    The device is drained before each burst, not between its calls: the host issues while
    the device is still busy with earlier calls, as in training. Only for calls that queue
    a few launches each (e.g. graph replays): many launches per call would fill CUDA's
    launch queue and then this would time the device.

    Returns:
        One mean per burst.
    """
    out = []
    for _ in range(bursts):
        synchronize(device)
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        out.append((time.perf_counter() - t0) / calls)
    synchronize(device)
    return out


def host_time(fn: Callable[[], Any], device: torch.device, reps: int) -> float:
    """The median of :func:`host_times`, in seconds."""
    return statistics.median(host_times(fn, device, reps))


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0-100) of ``values``, nearest rank."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))]


_SYNC_DEBUG_WARMED: set = set()


def count_host_syncs(fn: Callable[[], Any], device: torch.device) -> int | None:
    """How many times one call of ``fn`` makes the host wait for the GPU.

    Args:
        fn: the call to inspect.
        device: on CUDA, ``torch.cuda.set_sync_debug_mode("warn")`` flags each sync.

    Returns:
        The count on CUDA; None on the CPU, where there is nothing to wait for.
    """
    if device.type != "cuda":
        return None
    if device not in _SYNC_DEBUG_WARMED:
        # The first count in a process reported one sync more than later counts of the same
        # call (the first row of GPU runs 36-38, whichever variant it was): absorb whatever
        # the first use of the sync-debug mode emits with a trivial op, uncounted.
        _SYNC_DEBUG_WARMED.add(device)
        with warnings.catch_warnings(record=True):
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                torch.ones(1, device=device).add_(1)
            finally:
                torch.cuda.set_sync_debug_mode("default")
    synchronize(device)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    synchronize(device)
    return sum("synchroniz" in str(w.message) for w in caught)


class CopyFloor:
    """The copy a floor is measured with: ``nbytes`` read and written per call.

    Time it inside :func:`interleave` with :meth:`measure`; :meth:`bandwidth` turns its
    fastest round into bytes per second (read + write counted).
    """

    def __init__(self, nbytes: int, device: torch.device) -> None:
        self.src = torch.ones(max(nbytes, 1), dtype=torch.uint8, device=device)
        self.dst = self.src.clone()  # written once: no first-touch page faults in a round
        self.device = device

    def measure(self, warmup: int, reps: int) -> float:
        """Median seconds of one copy."""
        return device_time(lambda: self.dst.copy_(self.src), self.device, warmup, reps)

    def bandwidth(self, seconds: float) -> float:
        """``2 * nbytes / seconds``."""
        return 2 * self.src.numel() / seconds


def copy_bandwidth(nbytes: int, device: torch.device, warmup: int, reps: int) -> float:
    """Bytes moved per second by ``dst.copy_(src)`` of ``nbytes`` (read + write counted).

    Args:
        nbytes: size of the copy; use the benchmarked data's size so caches behave alike.
        device: where to copy.
        warmup: untimed copies first.
        reps: timed copies.

    Returns:
        ``2 * nbytes / median time``.
    """
    src = torch.ones(max(nbytes, 1), dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    seconds = device_time(lambda: dst.copy_(src), device, warmup, reps)
    return 2 * src.numel() / seconds


@contextlib.contextmanager
def single_rank_process_group(init_method: str, backend: str = "nccl"):
    """A one-rank default process group for the duration; an existing one is reused.

    Args:
        init_method: where the rank rendezvous, e.g. ``"tcp://127.0.0.1:29533"``.
        backend: the ``torch.distributed`` backend.
    """
    import torch.distributed as dist

    if dist.is_initialized():
        yield
        return
    dist.init_process_group(backend, init_method=init_method, world_size=1, rank=0)
    try:
        yield
    finally:
        dist.destroy_process_group()


def error_fields(exc: BaseException) -> dict[str, str]:
    """Record fields for a failed measurement: the exception and the line that raised it.

    Returns:
        ``{"error": "Type: message", "error_at": "file.py:line: source"}``.
    """
    where = traceback.extract_tb(exc.__traceback__)[-1]
    message = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
    return {
        "error": message,
        "error_at": f"{Path(where.filename).name}:{where.lineno}: {where.line}",
    }


# The [bench] extra's modules: without them a script still runs, with no progress bar and
# no PNG, and says so once (:func:`missing_extras`).
EXTRAS = {"tqdm": "no progress bar", "matplotlib": "no PNG"}
_told_missing = False


def missing_extras() -> list[str]:
    """The modules of :data:`EXTRAS` that do not import; the first call that finds any
    prints one line on stderr saying what is missing, what that costs and how to install it.
    """
    global _told_missing
    missing = []
    for name in EXTRAS:
        try:
            importlib.import_module(name)
        except ImportError:
            missing.append(name)
    if missing and not _told_missing:
        _told_missing = True
        names = " and ".join(missing)
        costs = ", ".join(EXTRAS[m] for m in missing)
        print(
            f"note: {names} not installed ({costs}); pip install -e '.[bench]' adds them",
            file=sys.stderr,
        )
    return missing


class _NoBar:
    """What :func:`progress` hands back without tqdm: the items, and a no-op postfix."""

    def __init__(self, items: Iterable) -> None:
        self._items = items

    def __iter__(self):
        return iter(self._items)

    def set_postfix_str(self, s: str = "", refresh: bool = True) -> None:
        pass


def progress(items: Sequence, desc: str):
    """``items`` wrapped in a tqdm progress bar on stderr.

    The bar is drawn only when stderr is a terminal (tqdm's ``disable=None``): in a log, a
    pipe or CI it would print fragments. Without tqdm the items come back unwrapped.
    """
    if "tqdm" in missing_extras():
        return _NoBar(items)
    from tqdm import tqdm

    return tqdm(items, desc=desc, file=sys.stderr, dynamic_ncols=True, disable=None)


def _json_safe(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, torch.dtype):
        return str(value).removeprefix("torch.")
    return value


def write_json(records: Iterable[dict], out_dir: Path, name: str) -> Path:
    """Write ``records`` as a JSON list to ``out_dir/name.json``; non-finite floats as null.

    Args:
        records: one flat dict per measured row.
        out_dir: created when missing.
        name: the file's stem (the script's name).

    Returns:
        The path written.
    """
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{name}.json"
    rows = [{k: _json_safe(v) for k, v in r.items()} for r in records]
    path.write_text(json.dumps(rows, indent=1, allow_nan=False) + "\n")
    return path


def write_text(text: str, out_dir: Path, name: str) -> Path:
    """Write ``text`` (a full table, say) to ``out_dir/name.txt``; returns the path."""
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{name}.txt"
    path.write_text(text.rstrip("\n") + "\n")
    return path


@dataclass(frozen=True)
class Column:
    """One column of a printed table: its header, the record key, how to show a value, and
    what it means (printed in the legend under the table; empty: self-explanatory)."""

    header: str
    key: str
    show: Callable[[Any], str] = str
    meaning: str = ""


def format_table(records: Sequence[dict], columns: Sequence[Column]) -> str:
    """Records as an aligned text table, then a legend of the columns that have a meaning.

    A missing or None value shows as ``-``.

    Args:
        records: the rows.
        columns: what to show, left to right.

    Returns:
        The table, header line first, then the legend.
    """
    cells = [[c.header for c in columns]]
    for r in records:
        cells.append([c.show(r[c.key]) if r.get(c.key) is not None else "-" for c in columns])
    widths = [max(len(row[i]) for row in cells) for i in range(len(columns))]
    lines = ["  ".join(v.rjust(w) for v, w in zip(row, widths, strict=True)) for row in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    legend = [f"  {c.header}: {c.meaning}" for c in columns if c.meaning]
    if legend:
        lines += ["columns:", *legend]
    return "\n".join(lines)


class _NoPlot:
    """A figure or axes without matplotlib: every method call is accepted and draws nothing,
    so a script's plotting code runs unchanged (:func:`save_figure` then writes no PNG)."""

    def __getattr__(self, name: str) -> _NoPlot:
        return self

    def __call__(self, *args: Any, **kwargs: Any) -> _NoPlot:
        return self

    def __iter__(self):
        return iter(())


NO_PNG = "no PNG (matplotlib is not installed)"


def new_figure(ncols: int, width: float = 6.0, height: float = 4.5):
    """A matplotlib figure (Agg backend, no display needed) with ``ncols`` axes side by side.

    Without matplotlib, stand-ins that draw nothing (:func:`missing_extras` says so once).

    Returns:
        ``(figure, list of axes)``.
    """
    if "matplotlib" in missing_extras():
        return _NoPlot(), [_NoPlot() for _ in range(ncols)]
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, ncols, figsize=(width * ncols, height), squeeze=False)
    return fig, list(axes[0])


def empty_panel(ax, why: str) -> None:
    """A panel that says why it has nothing to show (only when a figure has nothing else)."""
    ax.text(0.5, 0.5, why, ha="center", va="center", wrap=True)
    ax.set_axis_off()


def cpu_name() -> str:
    """The host CPU's model name (``/proc/cpuinfo``, else ``platform``) and logical CPUs."""
    import platform

    name = ""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                name = line.split(":", 1)[1].strip()
                break
    name = name or platform.processor() or platform.machine() or "unknown CPU"
    return f"{name}, {os.cpu_count()} CPUs"


def megatron_core_version() -> str:
    """The installed megatron-core's version, or ``"not installed"``."""
    from importlib import metadata

    try:
        return metadata.version("megatron-core")
    except metadata.PackageNotFoundError:
        return "not installed"


def run_title(device: torch.device, megatron: bool = False) -> str:
    """Where and with what a run measured: device (GPU name, and the host CPU), torch and,
    where the script uses it, megatron-core. Every PNG's title; printed by every script."""
    if device.type == "cuda":
        where = f"{torch.cuda.get_device_name(device)}, host {cpu_name()}"
    else:
        where = f"CPU: {cpu_name()}"
    parts = [where, f"torch {torch.__version__}"]
    if megatron:
        parts.append(f"megatron-core {megatron_core_version()}")
    return " | ".join(parts)


def save_figure(fig, out_dir: Path, name: str, title: str) -> Path | str:
    """Title ``fig`` (:func:`run_title`), save it to ``out_dir/name.png`` and close it.

    Returns:
        The path written; without matplotlib (``fig`` from :func:`new_figure`'s stand-in),
        :data:`NO_PNG`, which the scripts print where they name the files they wrote.
    """
    if isinstance(fig, _NoPlot):
        return NO_PNG
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{name}.png"
    fig.suptitle(wrap_title(title, fig.get_figwidth()), fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120, metadata={"Title": title})
    plt.close(fig)
    return path


def wrap_title(title: str, width_in: float, chars_per_in: float = 14.0) -> str:
    """``title`` broken into lines that fit a figure ``width_in`` inches wide at the titles'
    font size (9 points: about ``chars_per_in`` characters an inch), so a one-panel figure
    shows all of it; the PNG's metadata keeps it whole."""
    import textwrap

    return "\n".join(textwrap.wrap(title, max(20, int(width_in * chars_per_in)))) or title


def show_ms(seconds: float) -> str:
    """A table cell: seconds as milliseconds, 3 decimals."""
    return f"{seconds * 1e3:.3f}"


def show_mib(nbytes: float) -> str:
    """A table cell: bytes as MiB, 1 decimal."""
    return f"{nbytes / 2**20:.1f}"


def gib(nbytes: float) -> float:
    """Bytes in GiB."""
    return nbytes / 2**30


if __name__ == "__main__":
    sys.exit(not_a_script(__file__))
