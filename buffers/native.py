"""The CPU norm's compiled kernel: one pass over bf16/fp16/fp32, accumulated in fp64.

torch's ops reach fp32 accuracy on a bf16 sum of squares only through an upcast copy, a
square and a sum (three passes, about twice the time of torch's own bf16 norm, whose
result is bf16). ``cpu_sums.c`` widens, squares and adds in one pass at the speed
memory delivers the elements (AVX2 on x86-64, the vector units on aarch64). It is plain C
with no Python or torch headers: compiled by the system's C compiler (``$CC``, else ``cc``)
in well under a second the first time a process needs it, kept in a cache directory
(``$BUFFERS_CACHE_DIR``, else ``$XDG_CACHE_HOME/megatron-dtype-buffers``, else
``~/.cache/megatron-dtype-buffers``) under a name made from the source's hash and the
machine's architecture, and loaded with ctypes (which lets other threads run during a
call). Without a compiler the norm runs on torch's ops, as fast as before, and one
:class:`NativeKernelWarning` says so.

``BUFFERS_CPU_KERNEL``: ``1`` or ``auto`` (default) uses the kernel where it is fast on this
CPU; ``0`` or ``off`` never builds or uses it (torch's ops, no warning). ``0``/``1`` as the
other switches (``BUFFERS_CUDA_GRAPHS``, ...) take them; the words remain.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import threading
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

SOURCE = Path(__file__).with_name("cpu_sums.c")
KINDS = {torch.bfloat16: 0, torch.float16: 1, torch.float32: 2}
PIECE = 1 << 18  # elements per partial sum: the partition, so the bits, never change
TASK_PIECES = 4  # pieces per task handed to a thread (about 1M elements)
CHOICES = ("auto", "off")


class NativeKernelWarning(UserWarning):
    """The CPU norm's compiled kernel could not be built or loaded (torch's ops run)."""


def cache_dir() -> Path:
    """Where the compiled kernel is kept between processes."""
    if explicit := os.environ.get("BUFFERS_CACHE_DIR"):
        return Path(explicit)
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "megatron-dtype-buffers"


SWITCH = {"1": "auto", "0": "off"}  # the spelling of the other switches


def choice() -> str:
    """``BUFFERS_CPU_KERNEL``, checked: ``auto`` or ``off``."""
    value = os.environ.get("BUFFERS_CPU_KERNEL", "auto").strip().lower() or "auto"
    value = SWITCH.get(value, value)
    if value not in CHOICES:
        raise ValueError(
            f"BUFFERS_CPU_KERNEL={value!r}; expected one of 1, 0, {', '.join(CHOICES)} "
            "(1 or auto: use the CPU norm's compiled kernel where it is fast; 0 or off: "
            "torch's ops)"
        )
    return value


class CpuSums:
    """The loaded kernel: sums of |x|^p (p = 1, 2) in fp64 over contiguous CPU tensors."""

    def __init__(self, path: Path) -> None:
        lib = ctypes.CDLL(str(path))
        self.path = path
        self._piece_sums = lib.buffers_piece_sums
        self._piece_sums.restype = None
        self._piece_sums.argtypes = [
            ctypes.c_int,
            ctypes.c_int,
            ctypes.c_void_p,
            ctypes.c_void_p,
            ctypes.c_int64,
            ctypes.c_int64,
            ctypes.c_int64,
            ctypes.c_int64,
            ctypes.c_void_p,
            ctypes.c_int,
        ]
        lib.buffers_sums_fast.argtypes = [ctypes.c_int]
        self.vectorized = bool(lib.buffers_sums_vectorized())
        self.fast = {dt: bool(lib.buffers_sums_fast(k)) for dt, k in KINDS.items()}

    def handles(self, views: Sequence[torch.Tensor], p: float) -> bool:
        """Whether :meth:`power_sum` takes these views (else torch's ops must)."""
        return (
            p in (1.0, 2.0)
            and bool(views)
            and self.fast.get(views[0].dtype, False)
            and all(v.device.type == "cpu" and v.is_contiguous() for v in views)
        )

    def power_sum(
        self,
        views: Sequence[torch.Tensor],
        p: float,
        run: Callable[[list[Callable[[], None]]], object],
    ) -> float:
        """Sum of |x|^p over ``views`` (all of one dtype, :meth:`handles` true), in fp64.

        The views, in order, are cut into pieces of :data:`PIECE` elements, one fp64 partial
        sum each, added in piece order: the same bits whatever the thread count. ``run``
        runs a list of tasks (:func:`buffers.ops.run_pieces`); at one thread there is one.
        """
        call = self._call(views, p, PIECE)
        if call is None:
            return 0.0
        pieces, out, fn = call
        step = pieces if torch.get_num_threads() == 1 else TASK_PIECES

        def task(first: int) -> Callable[[], None]:
            return lambda: fn(first, min(first + step, pieces))

        run([task(q) for q in range(0, pieces, step)])
        result = 0.0
        for part in out:
            result += part
        return result

    def piece_sums(
        self, views: Sequence[torch.Tensor], p: float, piece: int, vectorized: bool | None = None
    ) -> torch.Tensor:
        """The fp64 sum of |x|^p over each ``piece`` elements of ``views`` taken in order
        (the last piece may be short), in one call, on the AVX2 path or (``vectorized``
        False) the portable one: what :meth:`power_sum` adds up, for tests."""
        if vectorized and not self.vectorized:
            raise ValueError("this CPU has no AVX2 path")
        call = self._call(views, p, piece, self.vectorized if vectorized is None else vectorized)
        if call is None:
            return torch.zeros(0, dtype=torch.float64)
        pieces, out, fn = call
        fn(0, pieces)
        return torch.tensor(list(out), dtype=torch.float64)

    def _call(self, views, p: float, piece: int, vectorized: bool | None = None):
        """(number of pieces, the output array, fn(first, last) filling it), or None when
        the views hold no element."""
        views = [v for v in views if v.numel()]
        total = sum(v.numel() for v in views)
        if not total:
            return None
        count = len(views)
        ptrs = (ctypes.c_uint64 * count)(*(v.data_ptr() for v in views))
        lens = (ctypes.c_int64 * count)(*(v.numel() for v in views))
        pieces = -(-total // piece)
        out = (ctypes.c_double * pieces)()
        kind, power = KINDS[views[0].dtype], int(p)
        vec = int(self.vectorized if vectorized is None else vectorized)
        sums = self._piece_sums

        def fn(first: int, last: int) -> None:
            sums(kind, power, ptrs, lens, count, piece, first, last, out, vec)

        return pieces, out, fn


_LOCK = threading.RLock()
_LOADED: dict[str, object] = {}  # "kernel": CpuSums | None, "reason": str


def load_once(
    loaded: dict[str, object],
    make: Callable[[], object],
    errors: tuple[type[BaseException], ...],
    message: Callable[[str], str],
    category: type[Warning],
) -> object | None:
    """A compiled kernel, made on the first call of the process and kept in ``loaded``
    (``"kernel"``, and ``"reason"`` when there is none); None when ``BUFFERS_CPU_KERNEL``
    is off (nothing built, no warning) or ``make`` raised one of ``errors``: then one
    warning of ``category``, ``message(reason)``, and the same None on every later call."""
    if choice() == "off":
        return None
    with _LOCK:
        if "kernel" not in loaded:
            try:
                loaded["kernel"] = make()
            except errors as e:
                loaded["kernel"], loaded["reason"] = None, str(e)
                warnings.warn(message(str(e)), category, stacklevel=4)
        return loaded["kernel"]


def kernel() -> CpuSums | None:
    """The kernel, built and loaded on the first call of the process; None when it is off
    (``BUFFERS_CPU_KERNEL=off``) or could not be built (one :class:`NativeKernelWarning`
    says why)."""
    return load_once(  # type: ignore[return-value]
        _LOADED,
        lambda: CpuSums(_build()),
        (OSError, RuntimeError, subprocess.SubprocessError),
        lambda reason: (
            f"buffers: the CPU norm's compiled kernel is not available ({reason}); norms "
            "of CPU tensors use torch's ops, about 2x slower at one thread. Install "
            "a C compiler (cc, or set CC), or set BUFFERS_CPU_KERNEL=off to use "
            "torch's ops without this warning"
        ),
        NativeKernelWarning,
    )


def describe() -> str:
    """One line: which CPU path norms take in this process (loads the kernel if needed)."""
    if choice() == "off":
        return "torch's ops (BUFFERS_CPU_KERNEL=off)"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", NativeKernelWarning)
        k = kernel()
    if k is None:
        return f"torch's ops (no compiled kernel: {_LOADED.get('reason')})"
    fast = ", ".join(str(dt).removeprefix("torch.") for dt, ok in k.fast.items() if ok)
    return f"compiled kernel ({'AVX2' if k.vectorized else 'portable'}; {fast}): {k.path}"


def _build() -> Path:
    return build_library(SOURCE, "cpu_sums")


def build_library(
    source: Path, stem: str, flags: Sequence[str] = (), libs: Sequence[str] = ()
) -> Path:
    """``source`` (plain C) compiled into a shared library kept in :func:`cache_dir` under a
    name made from ``stem``, the source's hash, the compiler, the flags and the machine's
    architecture; built once (atomically: a process loading it never sees half a file),
    in a temporary folder where the cache is not writable. Raises RuntimeError (no
    compiler, or it failed: its last line of output)."""
    text = source.read_bytes()
    compiler = os.environ.get("CC") or "cc"
    extra = " ".join([*flags, "|", *libs])
    digest = hashlib.sha256(text + compiler.encode() + extra.encode() + platform.machine().encode())
    name = f"{stem}-{platform.machine()}-{digest.hexdigest()[:16]}.so"
    for folder in (cache_dir(), None):
        if folder is not None and (folder / name).is_file():
            return folder / name
        try:
            return _compile(compiler, source, folder, name, flags, libs)
        except PermissionError:
            continue  # an unwritable cache: build in a temporary folder instead
    raise RuntimeError("no writable folder to build it in")


def _compile(
    compiler: str,
    source: Path,
    folder: Path | None,
    name: str,
    flags: Sequence[str],
    libs: Sequence[str],
) -> Path:
    exe = shutil.which(compiler)
    if exe is None:
        raise RuntimeError(f"no C compiler: {compiler!r} is not on PATH")
    if folder is None:
        folder = Path(tempfile.mkdtemp(prefix="buffers-native-"))
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise PermissionError(f"cannot create {folder}: {e}") from e
    if not os.access(folder, os.W_OK):
        raise PermissionError(f"{folder} is not writable")
    final = folder / name
    partial = folder / f"{name}.{os.getpid()}.{threading.get_ident()}.tmp"
    cmd = [exe, "-O3", "-shared", "-fPIC", "-std=gnu11", *flags, str(source)]
    cmd += ["-o", str(partial), *libs]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    if done.returncode != 0:
        partial.unlink(missing_ok=True)
        last = (done.stderr.strip().splitlines() or ["no output"])[-1]
        raise RuntimeError(f"{Path(exe).name} failed with exit code {done.returncode}: {last}")
    os.replace(partial, final)  # atomic: a process loading it never sees half a file
    return final
