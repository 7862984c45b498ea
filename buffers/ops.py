"""Fused reductions and scaling over spans of flat, homogeneous-dtype buffers.

Every function here takes, per flat buffer, the list of views (spans) it must read. A list
never mixes dtypes: that is the invariant the flat buffers exist for. Each call issues one
fused launch per buffer (a single ``vector_norm`` for one span, a multi-tensor launch for
several) plus a handful of scalar ops on the results, and never syncs with the host.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import functools
import itertools
import math
import os
import threading
import weakref
from collections.abc import Sequence
from typing import Protocol

import torch

from . import native
from .options import DEFAULT, BufferOptions
from .segments import (
    SegmentTable,
    SpanSegments,
    add_sub_results_,
    chunk_numel,
    chunk_stats_,
    sub_results,
    torch_segment_stats_,
)

INF = math.inf


def as_float(value: object, what: str) -> float:
    """``float(value)``, or a ``TypeError`` naming the argument ``what``.

    Text is accepted (``"inf"``: torch's ``norm_type`` takes it); :func:`as_number` is the
    check of a value that must be a number.
    """
    try:
        return float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError, RuntimeError) as e:  # RuntimeError: a tensor of many
        raise TypeError(
            f"{what} must be a number (a float, an int or a one-element tensor), got "
            f"{type(value).__name__} {value!r}"
        ) from e


def as_number(value: object, what: str) -> float:
    """:func:`as_float` of a number: text (which ``float()`` would parse) is a ``TypeError``."""
    if isinstance(value, str | bytes | bytearray):
        raise TypeError(
            f"{what} must be a number (a float, an int or a one-element tensor), got "
            f"{type(value).__name__} {value!r}: convert it with float() first"
        )
    return as_float(value, what)


def check_norm_type(norm_type: float) -> float:
    """Return ``norm_type`` as a float, or raise: p > 0 or inf are accepted.

    For megatron-core's functions, whose own code takes nothing else;
    :func:`check_torch_norm_type` is the check of the torch-like calls.
    """
    p = as_float(norm_type, "norm_type")
    if not (p == INF or p > 0):
        raise ValueError(f"norm_type must be a positive number or inf, got {norm_type!r}")
    return p


def check_torch_norm_type(norm_type: float) -> float:
    """Return ``norm_type`` as a float, or raise: any number but NaN, as torch accepts.

    As in ``torch.nn.utils.get_total_norm`` (the norm of the per-tensor norms): 0 counts
    the tensors holding a nonzero element, ``-inf`` is the smallest ``|x|``, p < 0 is
    ``(sum |x|^p)^(1/p)`` (0 as soon as one element is 0).
    """
    p = as_float(norm_type, "norm_type")
    if math.isnan(p):
        raise ValueError("norm_type must be a number or +-inf, got nan")
    return p


def exact_norm(p: float) -> bool:
    """Whether a p-norm must read each tensor exactly, zero padding excluded.

    For p > 0 and inf zeros add nothing, so spans may run over the padding between
    parameters; 0 counts tensors, and p < 0 and -inf are decided by zeros.
    """
    return p <= 0


def check_max_norm(max_norm: float | torch.Tensor) -> float:
    """Return ``max_norm`` as a float, or raise: a clip needs 0 <= max_norm (inf: never clip).

    A tensor is read with ``float()`` (on CUDA that is one host sync), then checked the same
    way. torch accepts a negative or NaN ``max_norm`` and flips the sign of every gradient or
    makes them all NaN; here that is a ``ValueError``. Not a number: ``TypeError``.
    """
    value = as_number(max_norm, "max_norm")
    if not value >= 0:  # also catches NaN
        raise ValueError(
            f"max_norm must be a number >= 0 (inf never clips, 0 zeroes every gradient), got "
            f"{max_norm!r}: a negative max_norm would flip the sign of every gradient and NaN "
            "would make them all NaN"
        )
    return value


def check_flag(value: object, what: str) -> bool:
    """Return ``value`` if it is a bool, else a ``TypeError`` naming the argument ``what``."""
    if not isinstance(value, bool):
        hint = ""
        if _is_process_group(value):
            hint = " (a process group: pass it as group=..., which is keyword-only)"
        raise TypeError(f"{what} must be a bool, got {type(value).__name__}{hint}")
    return value


def check_foreach(foreach: object) -> None:
    """torch's ``foreach``: None or a bool (accepted for torch's positional order; unused)."""
    if foreach is not None:
        check_flag(foreach, "foreach")


def check_group(group: object) -> None:
    """``group`` must be None or a ``torch.distributed.ProcessGroup``, else ``TypeError``."""
    if group is not None and not _is_process_group(group):
        raise TypeError(
            f"group must be a torch.distributed.ProcessGroup or None, got "
            f"{type(group).__name__} {group!r}"
        )


def _is_process_group(value: object) -> bool:
    import torch.distributed as dist

    return dist.is_available() and isinstance(value, dist.ProcessGroup)


# Elements upcast at a time by the torch backend, per device type. On the CPU a piece is
# written into a scratch buffer of 2 MiB of fp32 (about one core's L2 cache) that is reused
# piece after piece while it sits in cache: a fresh multi-MiB temporary costs page faults,
# and a piece past the cache sends every pass to memory. On CUDA, bigger chunks mean fewer
# launches.
_CHUNK = {"cpu": 1 << 19}
_CHUNK_OTHER = 1 << 22


_CPU_SCRATCH = threading.local()  # per thread: two threads' norms must not share one


def _scratch(device: torch.device, dtype: torch.dtype, numel: int) -> torch.Tensor:
    """A scratch tensor of at least ``numel`` elements.

    On the CPU one per dtype and thread is kept between calls (at most one chunk):
    allocating and first-touching it each call cost about a fifth of a norm. Elsewhere a
    fresh one, so a CUDA graph capture owns its own.
    """
    if device.type != "cpu":
        return torch.empty(numel, dtype=dtype, device=device)
    held = getattr(_CPU_SCRATCH, "tensors", None)
    if held is None:
        held = _CPU_SCRATCH.tensors = {}
    t = held.get(dtype)
    if t is None or t.numel() < numel:
        t = held[dtype] = torch.empty(numel, dtype=dtype)
    return t[:numel]


def _power_sum_chunked(views: Sequence[torch.Tensor], p: float, acc: torch.dtype) -> torch.Tensor:
    """Sum of |x|^p over ``views``, accumulated in ``acc`` (0-dim ``acc`` tensor).

    Each chunk is written into one scratch buffer of ``acc`` (upcast, then |x|^p in place)
    and summed by ``torch.sum``, which adds pairwise on the CPU: fp32 stays accurate on long
    spans (``vector_norm``'s fp32 accumulation loses ~1e-4 over millions of elements), and a
    direct sum of squares has no sqrt-then-square rounding (exact cases stay exact).
    """
    device = views[0].device
    if device.type == "cpu":
        return _cpu_power_sum(views, p, acc)
    chunk = _CHUNK.get(device.type, _CHUNK_OTHER)
    longest = max(v.numel() for v in views)
    scratch = _scratch(device, acc, min(chunk, max(longest, 1)))
    parts = []
    for v in views:
        for c in v.reshape(-1).split(chunk):
            s = scratch[: c.numel()]
            if c.dtype != acc:
                s.copy_(c)
                c = s
            if p == 2.0:
                torch.square(c, out=s)
            else:
                torch.abs(c, out=s)
                if p != 1.0:
                    s.pow_(p)
            parts.append(s.sum())
    if not parts:
        return torch.zeros((), dtype=acc, device=device)
    return torch.stack(parts).sum()


def _pieces(
    views: Sequence[torch.Tensor], chunk: int, writable: bool = False
) -> list[list[torch.Tensor]]:
    """``views`` cut and packed into pieces of ``chunk`` elements (the last may be short):
    a long view gives several, many short ones share one. ``writable``: every tensor of a
    piece is a view of its input (a non-contiguous one, which ``reshape`` would copy, is a
    piece of its own, whole)."""
    pieces: list[list[torch.Tensor]] = []
    pending: list[torch.Tensor] = []
    filled = 0
    for v in views:
        if writable and not v.is_contiguous():
            pieces.append([v])
            continue
        flat = v.reshape(-1)
        n, at = flat.numel(), 0
        while at < n:
            take = min(chunk - filled, n - at)
            pending.append(flat[at : at + take])
            filled += take
            at += take
            if filled == chunk:
                pieces.append(pending)
                pending, filled = [], 0
    if pending:
        pieces.append(pending)
    return pieces


def _piece_power_sum(piece: list[torch.Tensor], p: float, acc: torch.dtype) -> torch.Tensor:
    """Sum of |x|^p over one piece, through this thread's scratch buffer (in cache)."""
    n = sum(t.numel() for t in piece)
    s = _scratch(piece[0].device, acc, _CHUNK["cpu"])[:n]
    if len(piece) > 1:
        torch.cat(piece, out=s)  # one op packs many short views, upcasting as it copies
    elif piece[0].dtype == acc and p in (1.0, 2.0):
        if p == 2.0:  # mul, not square: measured faster out of place from memory
            torch.mul(piece[0], piece[0], out=s)
        else:
            torch.abs(piece[0], out=s)
        return s.sum()
    else:
        s.copy_(piece[0])
    if p == 2.0:
        s.square_()
    else:
        s.abs_()
        if p != 1.0:
            s.pow_(p)
    return s.sum()


def _scale_piece(piece: list[torch.Tensor], coeff: torch.Tensor):
    def scale() -> None:
        for t in piece:
            t.mul_(coeff)

    return scale


def _cpu_power_sum(views: Sequence[torch.Tensor], p: float, acc: torch.dtype) -> torch.Tensor:
    """:func:`_power_sum_chunked` on the CPU: the compiled kernel (:mod:`buffers.native`:
    one pass, fp64 accumulation) for p = 1, 2 over contiguous bf16/fp16/fp32 views where it
    is fast; otherwise torch's ops in cache-sized pieces, few ops, no op-level threads.

    Views are cut and packed into pieces of ``_CHUNK["cpu"]`` elements (:func:`_pieces`),
    so a call makes about three ops per piece whatever the number of views. Each piece is
    upcast into a scratch buffer (or, already in ``acc``, squared straight into it), raised
    to p in place and summed by ``torch.sum`` (pairwise: fp32 stays accurate over millions
    of elements). The cast happens piece by piece in cache: ``vector_norm(x,
    dtype=float32)`` would first materialise an fp32 copy of the whole view. The pieces are
    shared out by :func:`run_pieces`; the per-piece sums are added in piece order, so the
    result has the same bits at any thread count.
    """
    if acc == torch.float32:
        kernel = native.kernel()
        if kernel is not None and kernel.handles(views, p):
            return torch.tensor(kernel.power_sum(views, p, run_pieces), dtype=acc)
    pieces = _pieces(views, _CHUNK["cpu"])
    if not pieces:
        return torch.zeros((), dtype=acc)
    parts = run_pieces([lambda piece=piece: _piece_power_sum(piece, p, acc) for piece in pieces])
    return parts[0] if len(parts) == 1 else torch.stack(parts).sum()


class _Workers:
    """Threads that help :func:`run_pieces`; rebuilt after a fork (threads do not survive
    one) and when torch's thread count changes."""

    def __init__(self) -> None:
        self.pid = -1
        self.count = 0
        self.pool: concurrent.futures.ThreadPoolExecutor | None = None
        self.lock = threading.Lock()

    def get(self, count: int) -> concurrent.futures.ThreadPoolExecutor:
        with self.lock:
            if self.pool is None or self.pid != os.getpid() or self.count != count:
                if self.pool is not None and self.pid == os.getpid():
                    self.pool.shutdown(wait=False)
                self.pool = concurrent.futures.ThreadPoolExecutor(
                    count, thread_name_prefix="buffers-cpu"
                )
                self.pid, self.count = os.getpid(), count
            return self.pool


_WORKERS = _Workers()


def run_pieces(tasks: Sequence) -> list:
    """Run ``tasks`` (callables of torch CPU ops) and return their results, in order.

    The calling thread and ``torch.get_num_threads() - 1`` helper threads take tasks one by
    one from a shared counter, every op on one thread (:func:`single_thread`). Torch's own
    multi-threaded ops wait for all their threads at every op: with the cores busy with
    other processes each can stall for a scheduler time slice (docs/RESULTS.md, "cpu_norm
    on the 2-core CPU dev machine", has the measurement). Here the caller never waits for
    a helper that has not started (it takes the tasks itself), only for tasks already
    running; idle, the helpers share the work as torch's threads would. With one thread,
    one task, or a torch built without OpenMP, the tasks run on the calling thread.
    """
    threads = torch.get_num_threads()
    if threads == 1 or len(tasks) == 1 or not _openmp():
        with single_thread():
            return [task() for task in tasks]
    results: list = [None] * len(tasks)
    errors: list[BaseException] = []
    claim = itertools.count()  # next() on it is atomic under the GIL
    done = threading.Semaphore(0)

    def work() -> None:
        with single_thread():
            while (i := next(claim)) < len(tasks):
                try:
                    results[i] = tasks[i]()
                except BaseException as e:  # noqa: BLE001 - re-raised by the caller
                    errors.append(e)
                finally:
                    done.release()

    pool = _WORKERS.get(threads - 1)
    for _ in range(threads - 1):
        pool.submit(work)
    work()
    for _ in range(len(tasks)):  # every task finished, whoever took it
        done.acquire()
    if errors:
        raise errors[0]
    return results


def _cpu_chunk_stats_(
    buf: torch.Tensor, table: SegmentTable, p: float, start: int, chunk: int, subs: torch.Tensor
) -> None:
    """:func:`buffers.segments.chunk_stats_` of the chunk at ``start``, through this thread's
    scratch."""
    scratch = _scratch(buf.device, subs.dtype, min(chunk, table.numel - start))
    chunk_stats_(buf, table, p, start, start + chunk, scratch, subs)


_OPENMP: bool | None = None


def _openmp() -> bool:
    """Whether torch runs its CPU ops on OpenMP (the thread count is then per thread)."""
    global _OPENMP
    if _OPENMP is None:
        _OPENMP = "parallel backend: OpenMP" in torch.__config__.parallel_info()
    return _OPENMP


@contextlib.contextmanager
def single_thread():
    """Run torch's CPU ops on the calling thread only, for the duration of the block.

    Every multi-threaded op waits for all its threads, which stall when other processes
    hold the cores (:func:`run_pieces` shares pieces between threads instead). Only with
    torch's OpenMP backend, where the thread count is the calling thread's own setting;
    elsewhere the block runs as it is.
    """
    n = torch.get_num_threads()
    if n == 1 or not _openmp():
        yield
        return
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(n)


class KernelBackend(Protocol):
    """The kernels one homogeneous list of views (one flat buffer's) goes through: norm
    statistic, scale, per-slot statistics, and what each caches at construction.

    :class:`TorchBackend` implements every method with torch's own kernels; the Triton and
    transformer-engine backends implement what they accelerate and hand the rest to it.
    """

    name: str

    def power_sum(self, views: Sequence[torch.Tensor], p: float) -> torch.Tensor:
        """Sum of |x|^p over ``views`` as :meth:`TorchBackend.power_sum` defines it."""
        ...

    def scale_(self, views: Sequence[torch.Tensor], coeff: torch.Tensor) -> None:
        """Multiply every element of ``views`` by the 0-dim ``coeff``, in place."""
        ...

    def prepare(self, views: Sequence[torch.Tensor]) -> None:
        """Build whatever per-span state the backend caches (called at construction)."""
        ...

    def segment_stats_(
        self,
        buf: torch.Tensor,
        table: SegmentTable,
        p: float,
        out: torch.Tensor,
        nan: torch.Tensor,
    ) -> None:
        """Add each parameter slot's sum of |x|^p (max |x| for inf) into ``out[id]``."""
        ...

    def prepare_segments(self, buf: torch.Tensor, table: SegmentTable) -> None:
        """Build whatever per-table state the backend caches (called at construction)."""
        ...


class TorchBackend:
    """torch's own kernels; CPU and CUDA. Every :class:`KernelBackend` method."""

    name = "torch"

    def power_sum(self, views: Sequence[torch.Tensor], p: float) -> torch.Tensor:
        """Sum of |x|^p over one homogeneous list, accumulated in fp32+: max |x| for inf,
        min |x| for -inf (inf when there is no element) and, for 0, how many views hold a
        nonzero element (torch's 0-norm of the per-tensor norms).

        Returns a 0-dim tensor: fp64 for fp64 views, fp32 for every narrower dtype.
        """
        acc = torch.promote_types(views[0].dtype, torch.float32)
        if p in (INF, -INF, 0.0):
            with single_thread() if views[0].device.type == "cpu" else contextlib.nullcontext():
                return self._extreme_or_count(views, p, acc)
        return _power_sum_chunked(views, p, acc)

    def _extreme_or_count(self, views, p: float, acc: torch.dtype) -> torch.Tensor:
        if p == 0.0:
            # One count per view, as torch's get_total_norm takes the 0-norm of the norms.
            return (self.norms(views, 0.0, acc) > 0).sum().to(acc)
        device = views[0].device
        views = [v for v in views if v.numel()]  # torch refuses an empty tensor's inf norm
        if not views:
            return torch.full((), INF if p < 0 else 0.0, dtype=acc, device=device)
        # max/min |x| is exact in the views' own dtype: no upcast copy.
        norms = self.norms(views, p, views[0].dtype)
        return (norms.max() if p > 0 else norms.min()).to(acc)

    def norms(self, views: Sequence[torch.Tensor], p: float, acc: torch.dtype) -> torch.Tensor:
        """Per-view p-norms (1-D tensor)."""
        if len(views) == 1:
            return torch.linalg.vector_norm(views[0], p, dtype=acc).reshape(1)
        return torch.stack(torch._foreach_norm(list(views), p, dtype=acc))

    def scale_(self, views: Sequence[torch.Tensor], coeff: torch.Tensor) -> None:
        if coeff.device.type == "cpu":
            if coeff.item() == 1.0:
                return  # reading a CPU scalar costs no sync; x * 1 == x, so skip the pass
            # Shared out as the norm's pieces are (run_pieces): no op waits for idle threads.
            pieces = _pieces(views, _CHUNK["cpu"], writable=True)
            run_pieces([_scale_piece(piece, coeff) for piece in pieces])
            return
        if len(views) == 1:
            views[0].mul_(coeff)
        else:
            torch._foreach_mul_(list(views), coeff)

    def prepare(self, views: Sequence[torch.Tensor]) -> None:
        """Build whatever per-span state the backend caches (called at construction): on
        the CPU, the compiled kernel (:mod:`buffers.native`), so the first norm does not
        wait for a compiler."""
        if views and views[0].device.type == "cpu" and views[0].dtype in native.KINDS:
            native.kernel()

    def segment_stats_(
        self,
        buf: torch.Tensor,
        table: SegmentTable,
        p: float,
        out: torch.Tensor,
        nan: torch.Tensor,
    ) -> None:
        """Add each parameter slot's sum of |x|^p (max |x| for inf) into ``out[id]``.

        One pass over ``buf`` (:func:`buffers.segments.torch_segment_stats_`); ``out`` and
        ``nan`` are fp64 vectors indexed by the table's segment ids. On the CPU the pass's
        chunks are shared out as the norm's pieces are (:func:`run_pieces`: every op on one
        thread) and the reductions of their results run on the calling thread alone: each
        of torch's multi-threaded ops waits for all its threads, which stall while other
        processes hold the cores (``benchmarks/cpu_norm.py``'s ``per_param`` rows).
        """
        if buf.device.type != "cpu":
            torch_segment_stats_(buf, table, p, out, nan)
            return
        subs = sub_results(buf, table)
        if subs.numel():
            chunk = chunk_numel(buf.device)
            tasks = range(0, table.numel, chunk)
            run_pieces(
                [functools.partial(_cpu_chunk_stats_, buf, table, p, s, chunk, subs) for s in tasks]
            )
        with single_thread():
            add_sub_results_(table, p, subs, out, nan)

    def prepare_segments(self, buf: torch.Tensor, table: SegmentTable) -> None:
        """Build whatever per-table state the backend caches (called at construction)."""


class TritonBackend:
    """Triton kernels for p = 2 and scaling, over all spans of one buffer in one launch.

    Used when every view of a list is a 1-D slice of the same contiguous 1-D buffer of
    bf16/fp16/fp32 (always true for flat buffers); anything else goes to torch.
    """

    name = "triton"

    def __init__(self) -> None:
        self._torch = TorchBackend()
        self._tables: dict[tuple, object] = {}
        self._segment_cache: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    def _table(self, views: Sequence[torch.Tensor]):
        from . import triton_kernels as tk

        root = views[0]._base if views[0]._base is not None else views[0]
        if root.dim() != 1 or not root.is_contiguous() or root.dtype not in tk.DTYPES:
            return None, None
        spans = []
        for v in views:
            vroot = v._base if v._base is not None else v
            if vroot.data_ptr() != root.data_ptr() or v.dim() != 1 or not v.is_contiguous():
                return None, None
            lo = int(v.storage_offset() - root.storage_offset())  # a SymInt only when traced
            spans.append((lo, lo + int(v.numel())))
        # The table depends only on offsets, so it is shared by buffers with the same spans.
        key = (root.device, tuple(spans))
        if key not in self._tables:
            self._tables[key] = tk.TileTable(root, spans)
        return root, self._tables[key]

    def power_sum(self, views: Sequence[torch.Tensor], p: float) -> torch.Tensor:
        if p == 2.0:
            root, table = self._table(views)
            if table is not None:
                return table.sumsq(root)
        return self._torch.power_sum(views, p)

    def scale_(self, views: Sequence[torch.Tensor], coeff: torch.Tensor) -> None:
        root, table = self._table(views)
        if table is None:
            return self._torch.scale_(views, coeff)
        table.scale_(root, coeff.float())

    def prepare(self, views: Sequence[torch.Tensor]) -> None:
        self._table(views)

    def _slot_spans(self, buf: torch.Tensor, table: SegmentTable) -> SpanSegments | None:
        """The slots of ``table`` as :class:`SpanSegments` with their tiles (cached)."""
        from . import triton_kernels as tk

        if buf.dim() != 1 or not buf.is_contiguous() or buf.dtype not in tk.DTYPES:
            return None
        if table not in self._segment_cache:
            spans = SpanSegments(buf, table.slots)
            spans.tiles()
            self._segment_cache[table] = spans
        return self._segment_cache[table]

    def segment_stats_(self, buf, table, p, out, nan) -> None:
        spans = self._slot_spans(buf, table) if p == 2.0 else None
        if spans is None:
            return self._torch.segment_stats_(buf, table, p, out, nan)
        # One launch over every slot's tiles (tiles never cross a slot), one more adding
        # each slot's tile partials in fp64; then one index_add_ of a value per slot (one
        # per parameter: no two atomics on one address in the usual one-slot case).
        spans.triton_sumsq_(out, buf)

    def prepare_segments(self, buf: torch.Tensor, table: SegmentTable) -> None:
        self._slot_spans(buf, table)


class TransformerEngineBackend:
    """transformer-engine's multi-tensor L2 norm for p = 2; torch for everything else.

    The kernel functions are injected (``applier``, ``l2norm``) so the logic around them is
    exercised by tests with a torch stand-in; TE itself is only loaded by :func:`backend_for`.
    TE's scale kernel takes a host float, which would need a sync, so scaling stays torch's.
    """

    name = "transformer_engine"

    def __init__(self, applier, l2norm, device: torch.device) -> None:
        self._torch = TorchBackend()
        self._applier = applier
        self._l2norm = l2norm
        self._overflow = torch.zeros(1, dtype=torch.int32, device=device)

    def power_sum(self, views: Sequence[torch.Tensor], p: float) -> torch.Tensor:
        if p != 2.0:
            return self._torch.power_sum(views, p)
        # TE reads every tensor of one launch with the first tensor's dtype: the list is
        # homogeneous by construction (one buffer), which is what makes this call safe.
        norm, _ = self._applier(self._l2norm, self._overflow, [list(views)], False)
        return norm.float().square().sum()

    def scale_(self, views: Sequence[torch.Tensor], coeff: torch.Tensor) -> None:
        self._torch.scale_(views, coeff)

    def prepare(self, views: Sequence[torch.Tensor]) -> None:
        self._torch.prepare(views)

    def segment_stats_(self, buf, table, p, out, nan) -> None:
        self._torch.segment_stats_(buf, table, p, out, nan)

    def prepare_segments(self, buf: torch.Tensor, table: SegmentTable) -> None:
        self._torch.prepare_segments(buf, table)


_TORCH = TorchBackend()
_CUDA_CACHE: dict[tuple[torch.device, str], KernelBackend] = {}


def _load_triton() -> KernelBackend | None:
    try:
        from . import triton_kernels  # noqa: F401
    except ImportError:
        return None
    return TritonBackend()


def _load_te(device: torch.device) -> KernelBackend | None:
    try:
        import transformer_engine_torch as tex
        from transformer_engine.pytorch.optimizers import multi_tensor_applier
    except ImportError:
        return None
    return TransformerEngineBackend(multi_tensor_applier, tex.multi_tensor_l2norm, device)


def backend_for(device: torch.device, options: BufferOptions = DEFAULT) -> KernelBackend:
    """The backend for tensors on ``device``, chosen by ``options.backend``
    (``BUFFERS_BACKEND`` overrides it).

    ``auto`` (default): on CUDA, Triton when it imports, else transformer-engine when it
    imports, else torch; on other devices torch. ``triton``/``te`` ask for one (falling back
    to torch if it does not import); ``torch`` forces torch's kernels.
    """
    choice = options.effective_backend  # checked on every device: a typo is an error here too
    if device.type != "cuda":
        return _TORCH
    if (device, choice) not in _CUDA_CACHE:
        loaders = {
            "auto": [_load_triton, lambda: _load_te(device)],
            "triton": [_load_triton],
            "te": [lambda: _load_te(device)],
            "torch": [],
        }[choice]
        found = (b for b in (load() for load in loaders) if b is not None)
        _CUDA_CACHE[device, choice] = next(found, _TORCH)
    return _CUDA_CACHE[device, choice]


def prepare_groups(
    groups: Sequence[Sequence[torch.Tensor]], options: BufferOptions = DEFAULT
) -> None:
    """Let each buffer's backend build its per-span state now, not inside the first step."""
    for views in groups:
        if views:
            backend_for(views[0].device, options).prepare(views)


def local_power_stat(
    groups: Sequence[Sequence[torch.Tensor]],
    p: float,
    device: torch.device,
    options: BufferOptions = DEFAULT,
) -> torch.Tensor:
    """This rank's contribution to a p-norm: sum of |x|^p (max |x| for inf, min |x| for
    -inf, for 0 the number of views holding a nonzero: :meth:`TorchBackend.power_sum`), 0-dim.

    ``groups`` holds one homogeneous list of views per flat buffer; empty lists are skipped
    and no views at all give 0 (inf for -inf, the identity of a minimum). The result is fp32,
    or fp64 when any non-empty group is fp64: fp64 gradients keep fp64's range and precision
    up to the norm (in fp32, the square of an element above ~1.8e19 is inf, and below
    ~1e-19 it loses bits, then becomes 0).
    """
    parts = [backend_for(v[0].device, options).power_sum(v, p) for v in groups if v]
    if not parts:
        return torch.full((), INF if p == -INF else 0.0, dtype=torch.float32, device=device)
    dtype = torch.float64 if any(t.dtype == torch.float64 for t in parts) else torch.float32
    stacked = torch.stack([t.to(device, dtype) for t in parts])
    if p == INF:
        return stacked.max()
    return stacked.min() if p == -INF else stacked.sum()


def all_reduce_stat(
    stat: torch.Tensor, p: float, group, wire_dtype: torch.dtype | None = None
) -> torch.Tensor:
    """Combine per-rank stats with exactly one all-reduce (SUM; MAX for inf; for -inf MAX
    of the negated stats, a MIN that carries NaN as the MAX does; 0's counts add up).

    Returns the reduced stat in ``stat``'s dtype (``stat`` itself, reduced in place, when
    the wire dtype is its own). The all-reduce's dtype must be the same on every rank,
    whichever buffers each holds (a rank without fp64 gradients has an fp32 stat): by
    default it is fp64 for CPU tensors (gloo), so fp64 gradients keep their range across
    ranks, and fp32 on other devices, as megatron-core reduces its norms. ``wire_dtype``:
    another dtype, when the caller knows every rank's stat has it (per-parameter stats:
    fp64 everywhere, reduced as they are, without two casts).
    """
    import torch.distributed as dist

    if wire_dtype is None:
        wire_dtype = torch.float64 if stat.device.type == "cpu" else torch.float32
    wire = stat.to(wire_dtype)
    if p == -INF:
        return all_reduce_stat(-wire, INF, group, wire_dtype).neg_().to(stat.dtype)
    if p != INF:
        dist.all_reduce(wire, op=dist.ReduceOp.SUM, group=group)
        return wire.to(stat.dtype)
    # MAX is not NaN-propagating on every backend: carry "some rank saw NaN" as a second
    # element of the same MAX all-reduce.
    nan = torch.isnan(wire)
    packed = torch.stack([torch.where(nan, torch.zeros_like(wire), wire), nan.to(wire.dtype)])
    dist.all_reduce(packed, op=dist.ReduceOp.MAX, group=group)
    reduced = torch.where(packed[1] > 0, torch.full_like(wire, math.nan), packed[0])
    return reduced.to(stat.dtype)


def finish_norm(stat: torch.Tensor, p: float) -> torch.Tensor:
    """Turn a (reduced) power stat into the norm."""
    if p in (INF, -INF, 0.0):
        return stat
    if p == 2.0:
        return stat.sqrt()
    return stat.pow(1.0 / p)


def clip_coefficient(total_norm: torch.Tensor, max_norm: float | torch.Tensor) -> torch.Tensor:
    """``max_norm / (norm + 1e-6)`` clamped to 1, as a device tensor (torch's convention).

    ``max_norm`` is a float or a 0-dim tensor on the norm's device (the latter keeps a
    captured CUDA graph valid for any value).
    """
    coeff = max_norm / (total_norm + 1e-6)
    # Clamping on device instead of `if coeff < 1` avoids a host sync.
    return torch.clamp(coeff, max=1.0)


def scale_groups_(
    groups: Sequence[Sequence[torch.Tensor]],
    coeff: torch.Tensor,
    options: BufferOptions = DEFAULT,
) -> None:
    """Multiply every view by the device scalar ``coeff``; one launch per buffer."""
    for views in groups:
        if views:
            backend_for(views[0].device, options).scale_(views, coeff.to(views[0].device))


def count_zeros_groups(
    groups: Sequence[Sequence[torch.Tensor]], padding: int, device: torch.device
) -> torch.Tensor:
    """Zero elements in all views minus ``padding`` known-zero padding elements (int64)."""
    total = torch.zeros((), dtype=torch.int64, device=device)
    numel = 0
    for views in groups:
        for v in views:
            total = total + torch.count_nonzero(v).to(device)
            numel += v.numel()
    return (numel - padding) - total
