"""The codec: gradients to wire bytes and back, on any device, with per-layer scales.

Four operations, each writing into a caller's buffer:

- :func:`encode`: ``x * 2**e`` per segment (layer), saturated and rounded to
  nearest even, as the format's codes.
- :func:`decode`: codes to float32, times a per-segment factor.
- :func:`owner_reduce`: the shard owner's step of two_phase: decode N
  shards, sum them in float32 in rank order, divide by N, re-encode.
- :func:`owner_reduce_blocks`: the same step with block scaling, each
  block of the mean given its own extra exponent (the owner's exponents).

Scales are float32 tensors with one entry per segment, on the data's device;
segments are described by a :class:`Layout`, built once per bucket. A
:class:`Codec` resolves a format and backend once (per plan); the module's
functions take a format and a backend per call and use a cached
:class:`Codec`. Backends (``backend="auto"`` picks one):

- ``"kernels"``: compiled numba kernels (CPU; formats up to 16 bits);
- ``"cast"``: torch's native casts (``float8_e4m3fn``, ``float8_e5m2``,
  ``float16``, ``bfloat16``) after a clamp, for formats that have a dtype
  (the choice on CUDA, where no step reads a device value on the host);
- ``"bits"``: the reference bit path of :mod:`aps_comm.formats` (custom
  formats of at most 16 bits off the CPU, or without numba);
- ``"triton"``: the fused kernels of :mod:`aps_comm.triton_codec` (CUDA,
  formats up to 16 bits; the choice there where Triton is installed): one
  pass over memory per call instead of a chain of torch ops. Under Triton's
  interpreter (``TRITON_INTERPRET=1`` when it is first used) they run on CPU
  tensors instead, for tests.

Payloads may start at any byte of a larger buffer (a bucket or unit that
mixes formats packs them end to end): ``cast`` then goes through an aligned
scratch tensor where a 2- or 4-byte view is not allowed.

Every backend writes the same bytes for finite inputs; NaN inputs may differ
in the NaN code's sign bit, never in decoding to NaN.

Example:
    >>> x = torch.tensor([0.5, 3.0, 1e-3, -2.0])
    >>> layout = Layout.from_numels([2, 2], x.device)
    >>> scale = torch.tensor([64.0, 128.0])  # each layer's largest value near e4m3's 448
    >>> payload = encode(x, "e4m3", scale=scale, layout=layout)
    >>> decode(payload, "e4m3", 4, scale=1 / scale, layout=layout)
    tensor([ 5.0000e-01,  3.0000e+00,  9.7656e-04, -2.0000e+00])
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import types
from collections.abc import Callable, Sequence
from typing import Literal

import numpy as np
import torch

from aps_comm import cpu_kernels
from aps_comm.config import BLOCK_SIZES, Scaling
from aps_comm.formats import (
    FloatFormat,
    cast_into,
    decode_into,
    device_code_tables,
    encode_into,
    get_format,
    payload_nbytes,
    pow2,
    uncast_into,
)
from aps_comm.layout import AMAX_BLOCK, BlockGrid, Blocks, Layout
from aps_comm.scaling import (
    EXPONENT_LIMIT,
    Factors,
    bad_layers,
    block_keys_into,
    blocks_amax,
    factors_from_keys,
    key_exponents,
    key_factors,
    layer_amax,
    mean_exponents,
)
from aps_comm.scaling import factors as scale_factors
from aps_comm.telemetry import block_rows

__all__ = [
    "AMAX_BLOCK",
    "BACKENDS",
    "AgreedMaxima",
    "Backend",
    "BlockChunk",
    "Blocks",
    "Codec",
    "Layout",
    "NodeBlockChunk",
    "backend_for",
    "codec_for",
    "decode",
    "encode",
    "factors_into",
    "in_order",
    "owner_reduce",
    "owner_reduce_blocks",
    "segment_amax",
    "shard_mean",
]

_log = logging.getLogger(__name__)

Backend = Literal["auto", "kernels", "cast", "bits", "triton"]
BACKENDS: tuple[str, ...] = ("auto", "kernels", "cast", "bits", "triton")


def backend_for(fmt: FloatFormat | str, device: torch.device) -> str:
    """The backend ``"auto"`` resolves to for ``fmt`` on ``device``.

    Example:
        >>> backend_for("e4m3", torch.device("cpu"))
        'kernels'
        >>> backend_for("e4m3", torch.device("cuda"))  # 'cast' without Triton  # doctest: +SKIP
        'triton'
    """
    fmt = get_format(fmt)
    device = torch.device(device)
    if device.type == "cpu" and cpu_kernels.supports(fmt):
        return "kernels"
    if device.type == "cuda" and _triton_runs(fmt, device):
        return "triton"
    if fmt.torch_dtype is not None:
        return "cast"
    return "bits"


def _triton() -> types.ModuleType:
    """:mod:`aps_comm.triton_codec`, imported on first use: ``import aps_comm`` neither
    needs Triton nor pays for importing it, and a test can set ``TRITON_INTERPRET``
    before the kernels are built."""
    from aps_comm import triton_codec

    return triton_codec


def _triton_runs(fmt: FloatFormat, device: torch.device) -> bool:
    """Whether the Triton codec runs ``fmt`` on ``device``."""
    return _triton().supports(fmt) and _triton().runs_on(device)


def _resolve(backend: str, fmt: FloatFormat, device: torch.device) -> str:
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "auto":
        backend = backend_for(fmt, device)
    if backend == "kernels" and not (device.type == "cpu" and cpu_kernels.supports(fmt)):
        raise ValueError(
            f"backend='kernels' needs CPU tensors, numba and a format of at most 16 bits "
            f"with bias <= 127; got {fmt.name} on {device.type}"
        )
    if backend == "triton" and not _triton_runs(fmt, device):
        problem = _triton().launch_problem(device)
        raise ValueError(
            "backend='triton' needs triton installed, CUDA tensors (CPU ones under "
            "TRITON_INTERPRET=1) and a format of at most 16 bits with bias <= 127; "
            f"got {fmt.name} on {device.type}" + (f" ({problem})" if problem else "")
        )
    if backend == "cast" and fmt.torch_dtype is None:
        raise ValueError(f"backend='cast' needs a format with a torch dtype, got {fmt.name}")
    if backend == "bits" and fmt.torch_dtype is None and fmt.wire_bits > 16:
        raise ValueError(
            f"{fmt.name} has {fmt.bits} bits and no torch dtype: no backend encodes it "
            "(custom formats go up to 16 bits)"
        )
    return backend


def _factors(scale: torch.Tensor, layout: Layout | None, numel: int) -> torch.Tensor:
    """One factor per element (for the torch backends): no host read, the size is known."""
    if layout is None:
        return scale.reshape(-1)[:1].expand(numel) if scale.numel() == 1 else scale
    return torch.repeat_interleave(scale, layout.lengths, output_size=numel)


def _host_offsets(layout: Layout | None, numel: int) -> np.ndarray | BlockGrid:
    # A CPU block grid as it is: the kernels derive its offsets per call, so a bound
    # call keeps nothing per block.
    if layout is None:
        return np.array([0, numel], np.int64)
    return layout.cells if layout.cells is not None else layout.offsets.numpy()


def _host_runs(layout: Layout | None) -> tuple[int | None, np.ndarray | None]:
    """A block layout's size and runs of whole blocks, for the CPU kernels."""
    if layout is None or layout.block_size is None:
        return None, None
    return layout.block_size, layout.block_runs


def _check_scaled(scale: torch.Tensor | None, layout: Layout | None, numel: int) -> None:
    if scale is None:
        if layout is not None:
            raise ValueError("a layout needs a scale")
        return
    if scale.dtype != torch.float32 or scale.dim() != 1:
        raise ValueError(
            f"scale must be a 1-D torch.float32 tensor, got {scale.dtype} {scale.shape}"
        )
    if layout is None:
        if scale.numel() != 1:
            raise ValueError(f"scale has {scale.numel()} entries but no layout was given")
        return
    segments = layout.n_segments if layout.parent is None else layout.parent
    if layout.numel != numel or segments != scale.numel():
        raise ValueError(
            f"layout covers {layout.numel} elements in {segments} segments; "
            f"the data has {numel} elements and the scale {scale.numel()} entries"
        )


def _check_bytes(out: torch.Tensor, need: int, device: torch.device) -> None:
    """An output of codes must be ``need`` uint8 bytes on the data's ``device``."""
    if out.dtype != torch.uint8 or out.numel() != need or out.device != device:
        raise ValueError(
            f"out must hold {need} uint8 bytes on {device}, got {out.numel()} "
            f"{out.dtype} on {out.device}"
        )


def _window_scale(scale: torch.Tensor | None, layout: Layout | None) -> torch.Tensor | None:
    """The scales of a window's segments, out of its whole layout's (no copy)."""
    if scale is None or layout is None or layout.parent is None:
        return scale
    return scale[layout.first : layout.first + layout.n_segments]


_TRITON_FAILED: dict[tuple, str] = {}
_TRITON_RAN: set[tuple] = set()


@functools.lru_cache(maxsize=2)
def _key_table(unscale: bool) -> np.ndarray:
    """:func:`aps_comm.scaling.key_factors` of every key, for the CPU kernels' lookups."""
    keys = torch.arange(256, dtype=torch.int64).to(torch.uint8)
    return key_factors(keys, unscale=unscale).numpy().copy()


def _coded_kernels(
    kernel: str,
    tail: np.ndarray | None,
    src: torch.Tensor,
    out: torch.Tensor,
    fmt: FloatFormat,
    offsets: np.ndarray | BlockGrid,
    factors: np.ndarray | AgreedMaxima | None,
    *runs: object,
) -> None:
    """A bound CPU ``kernel`` ("encode" or "decode"): agreed maxima's factors (the decode's
    unscale) derived from their values now, an encode's padding ``tail`` zeroed (code 0
    is +0), then the kernel."""
    if isinstance(factors, AgreedMaxima):
        factors = factors.host_factors(fmt, unscale=kernel == "decode")
    if tail is not None:
        tail.fill(0)
    cpu_kernels.call(kernel, src, out, fmt, offsets, factors, *runs)


def _decode_agreed_kernels(
    fmt: FloatFormat,
    gathered: np.ndarray,
    n: int,
    offsets: np.ndarray | BlockGrid,
    firsts: np.ndarray,
    keys: np.ndarray,
    layer_ends: np.ndarray,
    *rest: object,
) -> None:
    """A bound CPU decode of agreed blocks: each block's layer derived for the call from
    the layers' ends (a binding keeps nothing per block), then the kernel."""
    layer_of = _layer_of(layer_ends)
    cpu_kernels.call(
        "decode_agreed_blocks", fmt, gathered, n, offsets, firsts, keys, layer_of, *rest
    )


def _layer_of(layer_ends: np.ndarray) -> np.ndarray:
    """Each block's layer from the layers' ends in the blocks (what the Triton decode
    indexes with; made while binding, its device copy is the binding's)."""
    return _block_layers(np.diff(layer_ends, prepend=0), np.int32)


def _block_layers(counts: np.ndarray, dtype: type = np.int64) -> np.ndarray:
    """Each block's layer from the layers' block counts (host work, while binding)."""
    return np.repeat(np.arange(counts.size, dtype=dtype), counts)


def _piece(offsets: np.ndarray, firsts: np.ndarray, j: int) -> slice:
    """Elements of piece ``j`` (blocks ``firsts[j]`` to ``firsts[j + 1]`` of ``offsets``)."""
    return slice(int(offsets[firsts[j]]), int(offsets[firsts[j + 1]]))


def _longest(offsets: np.ndarray | BlockGrid) -> int:
    """The longest block's elements (0 for none)."""
    offsets = _grid_array(offsets)
    return int(np.diff(offsets).max()) if offsets.size > 1 else 0


def _grid_array(offsets: np.ndarray | BlockGrid) -> np.ndarray:
    """Block offsets as an array: a CPU plan's grid derived (at bind time, for what
    reads offsets on the host or copies them to a device: the Triton binders)."""
    return offsets if isinstance(offsets, np.ndarray) else offsets.offsets()


def _triton_tile(offsets: np.ndarray, counts: torch.Tensor) -> tuple[int, int, np.ndarray] | None:
    """What a Triton block kernel of blocks ``offsets`` is probed and bound with: a probe's
    one block's elements, the tile width its variants compile per, and each block's layer
    (int64, from ``counts``, the plan's host copy: no device read); None where a block
    is longer than the kernels' tile."""
    longest = _longest(offsets)
    if longest > _triton().MAX_SEGMENT:
        return None
    layer_of = _block_layers(counts.cpu().numpy())
    return max(longest, 1), max(2, 1 << max(longest - 1, 0).bit_length()), layer_of


def _mean_of_rows(
    decode_rows: Sequence[Callable[[], object]], rows: torch.Tensor, mean: torch.Tensor
) -> None:
    """The mean of the L ``rows`` (decoded first where they came encoded: a node's on the
    Triton backend, an owner's chain): summed in float32 in rank order and divided by L,
    as the CPU kernels do."""
    for decode in decode_rows:
        decode()
    mean.copy_(rows[0])
    for r in range(1, rows.shape[0]):
        mean.add_(rows[r])
    mean.div_(rows.shape[0])


def _one_call(calls: Sequence[Callable[[], object]]) -> Callable[[], object]:
    """Bound ``calls`` as one call: the only one as it is, several :func:`in_order`."""
    return calls[0] if len(calls) == 1 else functools.partial(in_order, calls)


def in_order(calls: Sequence[Callable[[], object]]) -> None:
    """Run bound ``calls`` one after the other (several bound calls as one)."""
    for call in calls:
        call()


def _triton_ran(variant: tuple, launch: Callable[[], None]) -> bool:
    """Launch a Triton kernel variant; False where it cannot compile or launch here.

    A variant is the kernel and what makes it compile differently (format,
    scaling, agreed maxima, padding). Its first failure is logged once and sends it
    to the torch ops from then on, so training never fails for a kernel:
    the first-use probe launches one variant only. Argument errors
    (``ValueError``) are the caller's and propagate, and so does a failure
    of a variant that has run before (that is not a compiler's problem).
    """
    if variant in _TRITON_FAILED:
        return False
    try:
        launch()
    except ValueError:
        raise
    except Exception as exc:
        if variant in _TRITON_RAN:
            raise
        _TRITON_FAILED[variant] = f"{type(exc).__name__}: {exc}"
        _log.warning(
            "aps_comm: the Triton kernel %s failed (%s); that variant uses torch ops from now on",
            variant,
            _TRITON_FAILED[variant],
        )
        return False
    _TRITON_RAN.add(variant)
    return True


def _run_bound(
    variant: tuple, launch: Callable[[], object], fallback: Callable[[], object]
) -> None:
    """A bound Triton launch, or its torch-op fallback where the variant cannot run here."""
    if not _triton_ran(variant, launch):
        fallback()


def _after(
    first: Callable[[], object], then: Callable[[torch.Tensor], None], out: torch.Tensor
) -> None:
    """``first``, then ``then`` into ``out``: a bound records call with its inputs' call."""
    first()
    then(out)


def _like(t: torch.Tensor, numel: int) -> torch.Tensor:
    """Zeros of ``t``'s dtype and device, ``numel`` of them, at ``t``'s address modulo 16
    (Triton compiles a variant per pointer alignment): a probe's private buffer."""
    size = t.element_size()
    shift = (t.data_ptr() % 16) // size
    return torch.zeros(numel + 16 // size, dtype=t.dtype, device=t.device)[shift : shift + numel]


def _probed(variant: tuple, probe: Callable[[], object]) -> bool:
    """Whether a fused Triton variant runs here: launched once (on a probe's private
    buffers) through :func:`_triton_ran`, which logs a failure once and remembers it."""
    return variant in _TRITON_RAN or _triton_ran(variant, probe)


def _owner_then_chunk(
    launch: Callable[[], object], host: np.ndarray | None, at: int, piece: int
) -> int:
    """A bound Triton owner step; then the ranks' largest preferred chunk (log2) where
    ``host`` (the received pieces, a CPU tensor's memory) is given, else 0.

    Chunks sized by measured timings happen on CPU buckets only (the engine's
    ``measured``), where the interpreter runs the kernels on CPU tensors and the
    bytes are host memory. On a GPU the bucket's chunk is the model's, the value
    is never used, and reading it would be a device-to-host copy that waits for
    the stream: 0 instead.
    """
    launch()
    if host is None:
        return 0
    return int(host[at::piece].max())


def _block_keys_ops(
    x: torch.Tensor,
    layout: Layout,
    counts: torch.Tensor,
    maxima: torch.Tensor,
    keys: torch.Tensor,
    flags: torch.Tensor,
    fmt: FloatFormat,
    world_size: int,
) -> None:
    """:meth:`Codec.bind_block_keys`' call as torch ops (no host read): every block's max
    |x|, its two_phase key over ``world_size`` ranks, every layer's non-finite flag."""
    block_keys_into(x, layout, fmt, "two_phase", world_size, (maxima, keys))
    flags.copy_(bad_layers(keys, counts))


def _keep_lost_torch(x: torch.Tensor, sent: torch.Tensor, residual: torch.Tensor) -> None:
    residual.copy_(torch.where(torch.isfinite(sent), x - sent, 0.0))


def _block_rows(
    x: torch.Tensor,
    blocks: Blocks,
    keys: torch.Tensor,
    maxima: torch.Tensor,
    fmt: FloatFormat,
    out: torch.Tensor,
) -> None:
    """:meth:`Codec.bind_block_records` by tensor ops: the records under the keys' exponents."""
    block_rows(x, blocks, key_exponents(keys), maxima, fmt, out)


def factors_into(
    made: Callable[[], Factors],
    out: Sequence[torch.Tensor],
    fields: Sequence[str] = ("scale", "unscale"),
) -> None:
    """Factors made by tensor ops (the backends without kernels), copied into the bound
    ``out`` (the bound calls read them in place), one per name in ``fields``: a
    :class:`~aps_comm.scaling.Factors` attribute, "finite" (whether a segment's unscale
    is finite: two_phase's agreed block exponents) or "inverse" (``2**-e``, NaN where
    not finite: the native sum's, which error feedback keeps its residuals under)."""
    f = made()
    for o, field in zip(out, fields, strict=True):
        if field == "finite":
            o.copy_(torch.isfinite(f.unscale))
        elif field == "inverse":
            o.copy_(torch.where(torch.isfinite(f.unscale), pow2(-f.exponents), float("nan")))
        else:
            o.copy_(getattr(f, field))


def _copy_made(made: Callable[[], torch.Tensor], out: torch.Tensor) -> None:
    out.copy_(made())


def _stack_factors(made: Callable[[], object], out: torch.Tensor) -> None:
    """A staged route's factors made by tensor ops, stacked into the bound rows."""
    f = made()
    rows = [f.scale, f.shift, f.unscale]  # type: ignore[attr-defined]
    if f.first is not None:  # type: ignore[attr-defined]
        rows.append(f.first)  # type: ignore[attr-defined]
    torch.stack(rows, out=out[: len(rows)])


def _owner_feedback_ops(
    c: Codec,
    recv: torch.Tensor,
    n: int,
    out: torch.Tensor,
    layout: Layout,
    factors: tuple[torch.Tensor, torch.Tensor],
    span: tuple[int, int],
    residual: torch.Tensor,
) -> None:
    """:meth:`Codec.bind_owner_feedback`'s call on the torch backends: the mean of the N
    received shards re-encoded as it is (the ranks' agreed factors), and what that loses,
    unscaled and times N, added to the residuals of the elements this rank owns
    (``span``): next step they are sent again and averaged, so the mean gets the loss
    back."""
    (lo, hi), (scale, unscale) = span, factors
    acc = c.shard_mean(recv, n)
    c.encode(acc, out=out)
    part = c.decode(out, acc.numel())
    if hi <= lo:
        return
    if c.backend == "triton":  # one launch, the torch ops' bits
        lost = _triton().bind_owner_lost(
            acc, part, layout.device_offsets, factors, span, n, residual
        )
        if _triton_ran(("owner_lost",), lost):
            return
    mine = torch.where(torch.isfinite(unscale), scale, 0.0)
    mine = torch.repeat_interleave(mine, layout.lengths, output_size=layout.numel)[lo:hi]
    lost = torch.where(mine > 0, (acc[: hi - lo] - part[: hi - lo]) / mine, 0.0)
    residual[lo:hi] += lost * n


@dataclasses.dataclass(frozen=True)
class AgreedMaxima:
    """The layers' agreed maxima standing in for their factors: the kernels derive them.

    Pass it as ``scale`` to :meth:`Codec.encode` (each segment times ``2**e``)
    or :meth:`Codec.decode` (times the unscale: ``2**-e``, divided by N for a
    native sum, NaN for a non-finite maximum): the factors of
    :func:`aps_comm.scaling.factors` of the same maxima, with no per-layer
    factor tensors built first.

    Attributes:
        maxima: float32, one per segment (:meth:`Codec.layer_maxima`, all-reduced).
        world_size: N, the ranks whose values are summed.
        native: the sum happens in the wire format (route "allreduce"), else
            two_phase's FP32 sum.
        none: ``scaling="none"``: every exponent 0 (the layer rule clamped to
            0), a non-finite maximum still unscaling to NaN: the naive cast.

    Example:
        >>> c = Codec("e4m3", torch.device("cpu"))
        >>> agreed = AgreedMaxima(torch.tensor([3.0]), world_size=1)  # e = 7
        >>> c.decode(c.encode(torch.tensor([1.0]), scale=agreed), 1, scale=agreed)
        tensor([1.])
    """

    maxima: torch.Tensor
    world_size: int
    native: bool = False
    none: bool = False

    @property
    def limit(self) -> int:
        """The exponents' clamp: 0 under ``none`` (the layer rule then gives 0 everywhere)."""
        return 0 if self.none else EXPONENT_LIMIT

    def window(self, layout: Layout | None) -> AgreedMaxima:
        """The maxima of a window's segments (no copy)."""
        if layout is None or layout.parent is None:
            return self
        return dataclasses.replace(self, maxima=_window_scale(self.maxima, layout))

    def factors(self, fmt: FloatFormat, unscale: bool) -> torch.Tensor:
        """The float32 factors the maxima stand for (the backends without kernels)."""
        route = "allreduce" if self.native else "two_phase"
        scaling = Scaling.NONE if self.none else Scaling.LAYER
        f = scale_factors(self.maxima, fmt, route, world_size=self.world_size, scaling=scaling)
        return f.unscale if unscale else f.scale

    def host_factors(self, fmt: FloatFormat, unscale: bool) -> np.ndarray:
        """The same factors for the CPU kernels, in one numba pass."""
        return cpu_kernels.maxima_factors(
            self.maxima.numpy(), fmt, self.world_size, self.native, self.limit, unscale
        )

    def host_factors_into(
        self,
        fmt: FloatFormat,
        scale: np.ndarray,
        unscale: np.ndarray,
        keys: np.ndarray,
        pick: tuple[np.ndarray, np.ndarray, bool] | None = None,
    ) -> None:
        """:meth:`host_factors` of both kinds, written into float32 ``scale`` and ``unscale``
        (int32 ``keys``: scratch) with no allocation: a settled bucket's bound kernels
        read those arrays. ``pick``: (a bucket's agreed maxima, this group's layers'
        positions in them, ``scaling="bucket"``): these maxima are picked from those
        first and the factors are of their spread, in the same call
        (:func:`aps_comm.cpu_kernels.maxima_factors_into`)."""
        cpu_kernels.maxima_factors_into(
            self.maxima.numpy(),
            fmt,
            self.world_size,
            self.native,
            self.limit,
            scale,
            unscale,
            keys,
            pick,
        )

    def rule(self) -> object:
        """The Triton kernels' rule for these maxima (:class:`aps_comm.triton_codec.Rule`)."""
        return _triton().Rule(self.world_size, self.native, self.limit)

    def spread(self) -> None:
        """Every finite, nonzero maximum replaced by the largest of them, in place.

        ``scaling="bucket"``'s rule (:func:`aps_comm.scaling.exponents`) is the
        layer rule of these maxima: one exponent for every layer with values,
        zero and non-finite layers left as they are. Done once on the whole
        bucket's agreed maxima, before any window of them is taken.

        Example:
            >>> agreed = AgreedMaxima(torch.tensor([3.0, 0.0, 5.0, float("inf")]), world_size=2)
            >>> agreed.spread()
            >>> agreed.maxima
            tensor([5., 0., 5., inf])
        """
        m = self.maxima
        if not m.numel():
            return
        if m.device.type == "cpu" and cpu_kernels.AVAILABLE:
            cpu_kernels.spread_maximum(m.numpy())
            return
        usable = torch.isfinite(m) & (m > 0)
        torch.where(usable, torch.where(usable, m, 0.0).amax(), m, out=m)


@dataclasses.dataclass(frozen=True, kw_only=True)
class BlockChunk:
    """One chunk of two_phase with block exponents, agreed or every rank's own: the
    group's buffers and the chunk's blocks and buffers, made once by the binders
    (:func:`aps_comm.transports.bind_blocks`,
    ``bind_node_blocks``) for :meth:`Codec.bind_blocks` and ``bind_node_blocks``.

    Attributes:
        x: the group's float32 values (read, then overwritten by the decode).
        keys: the key of every block of the group (uint8), written each step: this
            rank's own, or the agreed ones.
        flags: this rank's non-finite flag of every layer (uint8), written each step
            (agreed: ``union``).
        union: per layer, scratch: every rank's flags OR-ed (agreed: whether any of
            its agreed keys is non-finite), written by the first chunk, read by every
            decode.
        offsets: the group's block boundaries (elements; int32 or int64), or on the CPU
            kernels its grid (:class:`aps_comm.layout.BlockGrid`: nothing kept per block).
        firsts: the chunk's N shards' first blocks, and the end (int64).
        shard: this rank's shard's block boundaries, from 0 (as ``offsets``).
        send: the chunk's exchange, N equal pieces.
        recv: what the exchange brings, N equal pieces.
        out: this rank's gathered shard (codes, then a key or a byte ``d`` per block).
        gathered: the chunk's N gathered shards, N equal rows.
        shard_bytes: payload bytes every shard is padded to.
        layer_ends: the cumulative blocks per layer (walked: no index per block).
        at: the first chunk: where the layer flags and the chunk's log2 lie in a piece
            (agreed: 0, nothing but codes on the wire); -1 for the later chunks.
        first_block: agreed exponents: this rank's shard's first block in the group;
            None for every rank's own.
    """

    x: torch.Tensor
    keys: torch.Tensor
    flags: torch.Tensor
    union: torch.Tensor
    offsets: np.ndarray | BlockGrid
    firsts: np.ndarray
    shard: np.ndarray | BlockGrid
    send: torch.Tensor
    recv: torch.Tensor
    out: torch.Tensor
    gathered: torch.Tensor
    shard_bytes: int
    layer_ends: np.ndarray
    at: int
    first_block: int | None = None


@dataclasses.dataclass(frozen=True, kw_only=True)
class NodeBlockChunk(BlockChunk):
    """:class:`BlockChunk` for hierarchical (or grid) with every owner's own block
    exponents: the blocks and buffers at both levels (:meth:`Codec.bind_node_blocks`).
    Its ``firsts``, ``shard``, ``out`` and ``gathered`` are the chunk's N shards', its
    ``send`` and ``recv`` the exchange across nodes (M equal pieces), its ``at`` where the
    layer flags lie in a piece and a row.

    Attributes:
        ranks_per_node: L.
        first: grid: the first exchange's send region (L equal pieces), the
            L slices' first blocks and the end, and the bytes every slice's
            payload is padded to; None for hierarchical.
        received: what the first exchange brings: L float32 rows of this
            rank's slice (hierarchical) or L pieces (grid).
        slice_offsets: the slice's block boundaries, from 0 (int64).
        piece_firsts: the slice's M shards' first blocks (of the slice), and the end.
        own_rows: this rank's local rank and node: the row of the first
            exchange and the piece across nodes that are its own. Owners add
            their own values there (grid: its slice of ``x``; across nodes:
            the node's mean of its shard), not the rounded copy they sent themselves.
    """

    ranks_per_node: int
    first: tuple[torch.Tensor, np.ndarray, int] | None
    received: torch.Tensor
    slice_offsets: np.ndarray
    piece_firsts: np.ndarray
    own_rows: tuple[int, int]


@dataclasses.dataclass(frozen=True)
class Codec:
    """One wire format on one device, its backend resolved once.

    Build one per plan (a group of layers sharing a format) and call its
    methods per chunk: the format's name, the backend choice and the
    backend's tables (copied to the device here, without blocking the host)
    are settled at construction.

    Args:
        fmt: the wire format (a :class:`~aps_comm.formats.FloatFormat` or a
            name); stored resolved.
        device: the data's device.
        backend: "auto", "kernels", "cast", "bits" or "triton" (see the
            module doc); stored resolved ("auto" becomes the backend it picks).

    Raises:
        ValueError: the backend cannot run ``fmt`` on ``device``.

    Example:
        >>> c = Codec("e4m3", torch.device("cpu"))
        >>> c.backend
        'kernels'
        >>> c.decode(c.encode(torch.tensor([1.0, -2.0])), 2)
        tensor([ 1., -2.])
    """

    fmt: FloatFormat
    device: torch.device
    backend: str = "auto"

    def __post_init__(self) -> None:
        fmt = get_format(self.fmt)
        device = torch.device(self.device)
        object.__setattr__(self, "fmt", fmt)
        object.__setattr__(self, "device", device)
        object.__setattr__(self, "backend", _resolve(self.backend, fmt, device))
        if self.backend == "bits" and fmt.wire_bits <= 16:
            device_code_tables(fmt, device)  # copied to the device now, not at the first chunk

    def encode(
        self,
        x: torch.Tensor,
        *,
        out: torch.Tensor | None = None,
        scale: torch.Tensor | AgreedMaxima | None = None,
        layout: Layout | None = None,
        pad: int = 0,
    ) -> torch.Tensor:
        """Encode ``x`` (times ``scale`` per segment): see :func:`encode`.

        ``scale`` may be :class:`AgreedMaxima` (factors derived from them);
        ``pad`` zero codes follow the elements (a shard's padding) in ``out``.
        The call is :meth:`bind_encode`'s, run once.

        Example:
            >>> Codec("e4m3", torch.device("cpu")).encode(torch.tensor([1.0, -2.0]))
            tensor([ 56, 192], dtype=torch.uint8)
        """
        if out is None:
            need = payload_nbytes(x.numel() + pad, self.fmt)
            out = torch.empty(need, dtype=torch.uint8, device=x.device)
        self.bind_encode(x, out, scale, layout, pad, once=True)()
        return out

    def decode(
        self,
        payload: torch.Tensor,
        numel: int,
        *,
        out: torch.Tensor | None = None,
        scale: torch.Tensor | AgreedMaxima | None = None,
        layout: Layout | None = None,
    ) -> torch.Tensor:
        """Decode ``numel`` elements into float32 (times ``scale``): see :func:`decode`.

        ``scale`` may be :class:`AgreedMaxima`: each segment times their unscale.
        The call is :meth:`bind_decode`'s, run once.

        Example:
            >>> Codec("e4m3", torch.device("cpu")).decode(
            ...     torch.tensor([56, 192], dtype=torch.uint8), 2)
            tensor([ 1., -2.])
        """
        if out is None:
            if isinstance(scale, AgreedMaxima):
                # Into a new tensor the factors are the torch ops' on every backend.
                _check_scaled(scale.maxima, layout, numel)
                scale = scale.factors(self.fmt, unscale=True)
            out = torch.empty(numel, dtype=torch.float32, device=payload.device)
        self.bind_decode(payload, out, scale, layout, numel, once=True)()
        return out

    def _scaled(
        self, scale: torch.Tensor | AgreedMaxima | None, layout: Layout | None, numel: int
    ) -> tuple[torch.Tensor | AgreedMaxima | None, AgreedMaxima | None]:
        """``scale`` checked against ``layout`` and windowed: (the factors, or agreed maxima
        for the torch ops to derive them from per call; the agreed maxima where the
        kernels derive the factors themselves, else None)."""
        if not isinstance(scale, AgreedMaxima):
            _check_scaled(scale, layout, numel)
            return _window_scale(scale, layout), None
        _check_scaled(scale.maxima, layout, numel)
        if self.backend in ("triton", "kernels"):
            return None, scale.window(layout)
        return scale, None

    def bind_encode(
        self,
        x: torch.Tensor,
        out: torch.Tensor,
        scale: torch.Tensor | AgreedMaxima | None,
        layout: Layout | None,
        pad: int = 0,
        once: bool = False,
    ) -> Callable[[], object]:
        """:meth:`encode` into ``out`` checked once; the returned call repeats it.

        A settled bucket encodes the same buffers every step: the call reads
        their values (``x``, the factors or agreed maxima, refilled in place)
        when it runs, with no checks, windows or lookups on the host; on
        "triton" each program's segments are found here, not searched per run.
        ``once``: the call runs once (:meth:`encode`), so nothing is found ahead.
        """
        _check_bytes(out, payload_nbytes(x.numel() + pad, self.fmt), x.device)
        return self._bind_coded("encode", x, out, scale, layout, (x.numel(), pad, once))

    def bind_decode(
        self,
        payload: torch.Tensor,
        out: torch.Tensor,
        scale: torch.Tensor | AgreedMaxima | None,
        layout: Layout | None,
        numel: int | None = None,
        once: bool = False,
    ) -> Callable[[], object]:
        """:meth:`decode` into ``out`` checked once; the returned call repeats it.

        ``numel``: the elements to decode, ``out``'s where None (checked against it);
        ``once``: as :meth:`bind_encode`'s.
        """
        fmt = self.fmt
        numel = out.numel() if numel is None else numel
        need = payload_nbytes(numel, fmt)
        if payload.dtype != torch.uint8 or payload.numel() < need:
            raise ValueError(
                f"payload must hold {need} uint8 bytes for {numel} elements of {fmt.name}, "
                f"got {payload.numel()} {payload.dtype}"
            )
        if out.dtype != torch.float32 or out.numel() != numel or not out.is_contiguous():
            raise ValueError(
                f"out must be a contiguous float32 tensor of {numel} elements, "
                f"got {out.dtype} of shape {tuple(out.shape)}"
            )
        return self._bind_coded("decode", payload[:need], out, scale, layout, (numel, 0, once))

    def _bind_coded(
        self,
        kernel: str,
        src: torch.Tensor,
        out: torch.Tensor,
        scale: torch.Tensor | AgreedMaxima | None,
        layout: Layout | None,
        sizes: tuple[int, int, bool],
    ) -> Callable[[], object]:
        """:meth:`bind_encode`'s or :meth:`bind_decode`'s (``kernel``) call, its buffers
        checked: ``sizes`` (numel, pad, once): ``numel`` elements of ``src`` into ``out``,
        then an encode's ``pad`` zero codes, for one run or many. One kernel call on
        "kernels" and "triton" (a variant that cannot run here falls back to the torch
        ops), the torch ops elsewhere."""
        fmt, (numel, pad, once) = self.fmt, sizes
        factors, agreed = self._scaled(scale, layout, numel)
        if self.backend == "triton":
            block = layout.block_size if layout is not None else None
            native = None if agreed is None else agreed.native
            variant = (kernel, fmt.name, factors is not None, native, block, pad > 0, once)
            launch = getattr(_triton(), f"bind_{kernel}")(
                *(src, out, fmt, None if layout is None else layout.device_offsets, factors),
                maxima=agreed.maxima if agreed else None,
                rule=agreed.rule() if agreed else None,
                **({"pad": pad} if pad else {}),
                table=not once,
            )
            fallback = self._torch()._bind_coded(kernel, src, out, scale, layout, sizes)
            return functools.partial(_run_bound, variant, launch, fallback)
        head = payload_nbytes(numel, fmt)
        body = out[:head] if pad else out
        if self.backend == "kernels":
            # The factors as a view: a bound call reads them as refilled.
            host = agreed if agreed is not None else None if factors is None else factors.numpy()
            offsets, runs = _host_offsets(layout, numel), _host_runs(layout)
            tail = out.numpy()[head:] if pad else None
            args = (kernel, tail, src, body, fmt, offsets, host, *runs)
            return functools.partial(_coded_kernels, *args)
        tail = out[head:] if pad else None
        return functools.partial(self._coded_ops, kernel, src, body, tail, factors, layout)

    def _coded_ops(
        self,
        kernel: str,
        src: torch.Tensor,
        out: torch.Tensor,
        tail: torch.Tensor | None,
        scale: torch.Tensor | AgreedMaxima | None,
        layout: Layout | None,
    ) -> None:
        """The torch backends' encode or decode (``kernel``), bound: agreed maxima's factors
        (the decode's unscale) derived from their values now, then an encode's padding
        ``tail`` zeroed and ``src`` times the factors encoded into ``out``, or a decode of
        ``src`` into ``out`` times the factors."""
        fmt, cast = self.fmt, self.backend == "cast"
        if isinstance(scale, AgreedMaxima):
            scale = _window_scale(scale.factors(fmt, unscale=kernel == "decode"), layout)
        if kernel == "decode":
            (uncast_into if cast else decode_into)(src, fmt, out)
            if scale is not None:
                out.mul_(_factors(scale, layout, out.numel()))
            return
        if tail is not None:
            tail.zero_()  # code 0 is +0 in every format
        v = src.float() if scale is None else src * _factors(scale, layout, src.numel())
        if cast:
            cast_into(v, fmt, out)
            return
        if not fmt.has_nan:
            v = torch.nan_to_num(v, nan=0.0, posinf=fmt.max, neginf=-fmt.max)
        encode_into(v, fmt, out)

    def bind_owner_reduce(
        self, recv: torch.Tensor, n_ranks: int, out: torch.Tensor
    ) -> Callable[[], object]:
        """:meth:`owner_reduce` into ``out`` checked once; the returned call repeats it."""
        _check_bytes(out, self._shard_bytes(recv, n_ranks), recv.device)
        if self.backend == "kernels":
            return functools.partial(
                cpu_kernels.call, "reduce_shards", recv, n_ranks, self.fmt, out
            )
        if self.backend != "triton":
            return functools.partial(self._owner_reduce_ops, recv, n_ranks, out)
        launch = _triton().bind_reduce_shards(recv, n_ranks, self.fmt, out)
        fallback = functools.partial(self._torch().owner_reduce, recv, n_ranks, out=out)
        return functools.partial(_run_bound, ("owner_reduce", self.fmt.name), launch, fallback)

    def _owner_reduce_ops(self, recv: torch.Tensor, n_ranks: int, out: torch.Tensor) -> None:
        """The torch backends' owner step: the shards' mean, encoded into ``out``."""
        self.encode(self.shard_mean(recv, n_ranks), out=out)

    def bind_feedback_factors(
        self,
        agreed: torch.Tensor,
        world_size: int,
        scale: torch.Tensor,
        unscale: torch.Tensor,
        counts: torch.Tensor | None = None,
        keys: np.ndarray | None = None,
        pick: tuple[np.ndarray, np.ndarray, bool] | None = None,
        scaling: Scaling | str = Scaling.LAYER,
    ) -> Callable[[], None]:
        """Two_phase's factors of the agreed maxima or block keys, written into ``scale``
        and ``unscale`` in place: error feedback's settled bucket binds its calls to those.

        Args:
            agreed: float32 maxima, one per layer; or with ``counts`` uint8 block
                keys (:func:`aps_comm.scaling.exponent_keys`), both MAX-all-reduced.
            world_size: N.
            scale: float32, one per segment: ``2**e``.
            unscale: float32, one per segment: ``2**-e``, NaN for a non-finite layer.
            counts: blocks per layer (int64), with block keys.
            keys: with maxima on the CPU kernels, int32 scratch the layers' exponent keys
                are left in (:meth:`layer_records` reads them); None: the call's own.
            pick: with maxima on the CPU kernels, (a bucket's agreed maxima, these
                layers' positions in them, whether ``scaling`` is "bucket"): ``agreed``
                is picked from those in the same call, the factors of their spread where
                "bucket" (:meth:`AgreedMaxima.host_factors_into`); None: as it is.
            scaling: with maxima, the rule: "layer", "bucket" (the factors of the
                maxima's spread, ``agreed`` left as it is: the records keep it) or
                "none" (every exponent 0).

        Example:
            >>> c = Codec("e4m3", torch.device("cpu"))
            >>> s, u = torch.empty(1), torch.empty(1)
            >>> c.bind_feedback_factors(torch.tensor([3.0]), 2, s, u)()
            >>> s, u
            (tensor([128.]), tensor([0.0078]))
        """
        fmt, kernels = self.fmt, self.backend == "kernels" and scale.device.type == "cpu"
        if counts is None:
            scaling = Scaling(scaling)
            agreed_maxima = AgreedMaxima(agreed, world_size, none=scaling == Scaling.NONE)
            if kernels:
                keys = np.empty(agreed.numel(), np.int32) if keys is None else keys
                if scaling == Scaling.BUCKET and pick is None:
                    # Picked into scratch of its own and spread there, in the same call.
                    agreed_maxima = AgreedMaxima(torch.empty_like(agreed), world_size)
                    pick = agreed.numpy(), np.arange(agreed.numel(), dtype=np.int64), True
                return functools.partial(
                    agreed_maxima.host_factors_into,
                    fmt,
                    scale.numpy(),
                    unscale.numpy(),
                    keys,
                    pick,
                )
            if pick is not None:
                raise ValueError("pick needs the CPU kernels and maxima")
            made = functools.partial(
                scale_factors, agreed, fmt, "two_phase", world_size=world_size, scaling=scaling
            )
            if scaling != Scaling.BUCKET:
                ops = functools.partial(factors_into, made, (scale, unscale))
                return self.bind_agreed_factors(agreed_maxima, (scale, None, unscale), ops)
        else:
            if kernels:
                return functools.partial(
                    cpu_kernels.call,
                    "block_factors_into",
                    agreed,
                    counts.cpu().numpy(),
                    scale.numpy(),
                    unscale.numpy(),
                )
            made = functools.partial(
                factors_from_keys,
                agreed[None],
                fmt,
                "two_phase",
                world_size=world_size,
                counts=counts,
            )
        return functools.partial(factors_into, made, (scale, unscale))

    def bind_agreed_factors(
        self,
        agreed: AgreedMaxima,
        out: tuple[torch.Tensor, torch.Tensor | None, torch.Tensor],
        ops: Callable[[], object],
    ) -> Callable[[], object]:
        """The factors of ``agreed`` written into ``out`` (scale, the undivided ``2**-e`` or
        None, unscale), bound: one launch on "triton"
        (:func:`aps_comm.triton_codec.bind_maxima_factors`), else (or where that variant
        cannot run here) ``ops``, the same factors by other calls."""
        if self.backend != "triton":
            return ops
        launch = _triton().bind_maxima_factors(self.fmt, agreed.maxima, agreed.rule(), out)
        variant = ("maxima_factors", self.fmt.name, agreed.native, out[1] is not None)
        return functools.partial(_run_bound, variant, launch, ops)

    def bind_key_factors(
        self,
        keys: torch.Tensor,
        counts: torch.Tensor,
        out: tuple[torch.Tensor, torch.Tensor | None, torch.Tensor],
        divisor: int,
        ops: Callable[[], object],
    ) -> Callable[[], object]:
        """Agreed block ``keys``' factors written into ``out`` (scale, the undivided
        ``2**-e`` or None, unscale ``2**-e / divisor``; ``counts``: blocks per layer, an
        int64 CPU tensor), bound: one launch on "triton"
        (:func:`aps_comm.triton_codec.bind_block_factors`), else (or where that variant
        cannot run here) ``ops``, the same factors by other calls."""
        if self.backend != "triton":
            return ops
        launch = _triton().bind_block_factors(keys, counts.numpy(), out, divisor)
        kind = 0 if divisor == 1 else 1 if divisor & (divisor - 1) == 0 else 2
        variant = ("block_factors", kind, out[1] is not None)
        return functools.partial(_run_bound, variant, launch, ops)

    def bind_keep_lost(
        self,
        payload: torch.Tensor,
        x: torch.Tensor,
        sent: torch.Tensor,
        unscale: torch.Tensor,
        layout: Layout,
        residual: torch.Tensor,
    ) -> Callable[[], None]:
        """What this rank's encoding lost, bound: error feedback's residual, whole-bucket.

        The returned call decodes ``payload`` (``x`` encoded) times ``unscale``
        into float32 scratch ``sent``, then writes ``residual = x - sent``
        where ``sent`` is finite, else 0 (a non-finite layer, NaN ``unscale``,
        keeps nothing): two kernel calls on "kernels", a fixed handful of
        tensor ops elsewhere, whatever the number of layers.

        Example:
            >>> call = codec.bind_keep_lost(payload, x, sent, unscale, layout, res)  # doctest: +SKIP
        """
        decode = self.bind_decode(payload, sent, unscale, layout)
        if self.backend == "kernels" and x.device.type == "cpu":
            lost = functools.partial(cpu_kernels.call, "keep_lost", x, sent, residual)
        else:
            lost = functools.partial(_keep_lost_torch, x, sent, residual)
            if self.backend == "triton":
                launch = _triton().bind_keep_lost(x, sent, residual)
                lost = functools.partial(_run_bound, ("keep_lost",), launch, lost)
        return functools.partial(in_order, [decode, lost])

    def bind_encode_keep(
        self,
        x: torch.Tensor,
        send: torch.Tensor,
        factors: tuple[torch.Tensor, torch.Tensor],
        layout: Layout,
        sent: torch.Tensor,
        residual: torch.Tensor,
    ) -> Callable[[], None] | None:
        """:meth:`bind_encode` (with the shards' padding, the rest of ``send``) and
        :meth:`bind_keep_lost` as one bound call on the CPU kernels
        (:func:`aps_comm.cpu_kernels.encode_keep`, the same bits); None elsewhere, or
        where either would not bind its kernel.

        Example:
            >>> call = codec.bind_encode_keep(x, send, (s, u), layout, sent, res)  # doctest: +SKIP
        """
        numel, fmt, (scale, unscale) = x.numel(), self.fmt, factors
        tensors = (x, sent, residual, scale, unscale)
        if (
            self.backend != "kernels"
            or x.device.type != "cpu"
            or any(t.dtype != torch.float32 or not t.is_contiguous() for t in tensors)
            or send.numel() < payload_nbytes(numel, fmt)
            or sent.numel() != numel
            or residual.numel() != numel
        ):
            return None
        _check_scaled(scale, layout, numel)
        _check_scaled(unscale, layout, numel)
        return functools.partial(
            cpu_kernels.call,
            "encode_keep",
            fmt,
            x.numpy(),
            send.numpy(),
            payload_nbytes(numel, fmt),
            (_host_offsets(layout, 0), *_host_runs(layout)),
            (scale.numpy(), unscale.numpy()),
            sent.numpy(),
            residual.numpy(),
        )

    def bind_owner_feedback(
        self,
        recv: torch.Tensor,
        n_ranks: int,
        out: torch.Tensor,
        layout: Layout,
        factors: tuple[torch.Tensor, torch.Tensor],
        rank: int,
        residual: torch.Tensor,
        scratch: torch.Tensor | None = None,
        mean: torch.Tensor | None = None,
        fused: bool = False,
    ) -> Callable[[], None]:
        """Two_phase's owner step with error feedback (one chunk: the whole bucket), bound.

        The call decodes the N shards of ``recv``, averages them in float32
        in rank order, encodes the mean into ``out`` as it is and adds what
        that lost, divided by the segment's scale and times N, to this rank's
        elements of ``residual``: :func:`aps_comm.simulate.allreduce_feedback`'s
        arithmetic and bits, in five kernel calls on "kernels" (into
        ``scratch`` and a shard's mean kept here), a fixed handful of tensor
        ops elsewhere.

        Args:
            recv: the N encoded shards.
            n_ranks: N.
            out: this rank's shard of the encoded mean.
            layout: the segments (layers or blocks) of the whole bucket.
            factors: (scale, unscale), one per segment, refilled in place per step.
            rank: this rank: it owns shard ``rank``.
            residual: the bucket's float32 residuals.
            scratch: float32 of at least N shards' elements, free during the call
                (the bucket's other scratch), with one shard's more for their
                mean if it has room and ``mean`` is None; None: made here.
            mean: float32 of at least one shard's elements, free during the call,
                for the shards' mean (the bucket's own values, written by the
                decode after: no scratch of its own); None: after the shards.
            fused: on "kernels", the five calls as one
                (:func:`aps_comm.cpu_kernels.owner_feedback`, the same bits).

        Example:
            >>> call = codec.bind_owner_feedback(recv, 2, out, layout, (s, u), 0, res)  # doctest: +SKIP
        """
        fmt, (scale, unscale) = self.fmt, factors
        per = self._shard_bytes(recv, n_ranks) * 8 // fmt.wire_bits
        _check_bytes(out, payload_nbytes(per, fmt), recv.device)
        lo = rank * per
        hi = max(lo, min(lo + per, layout.numel))
        if self.backend != "kernels" or recv.device.type != "cpu":
            args = (self, recv, n_ranks, out, layout, factors, (lo, hi), residual)
            return functools.partial(_owner_feedback_ops, *args)
        if scratch is None:
            scratch = torch.empty(n_ranks * per)
        elif scratch.dtype != torch.float32 or scratch.numel() < n_ranks * per:
            raise ValueError(f"scratch must hold {n_ranks * per} float32, got {scratch.numel()}")
        values = scratch[: n_ranks * per]
        # The mean where the caller has room for it, else after the shards, else its own.
        if mean is not None:
            if mean.dtype != torch.float32 or mean.numel() < per:
                raise ValueError(f"mean must hold {per} float32, got {mean.numel()}")
            acc = mean[:per]
        else:
            acc = scratch[n_ranks * per : (n_ranks + 1) * per]
        if acc.numel() < per:
            acc = torch.empty(per)
        host = (_host_offsets(layout, 0), scale.numpy(), unscale.numpy())
        if fused:
            return functools.partial(
                cpu_kernels.call,
                "owner_feedback",
                *(fmt, recv.numpy(), (values.numpy(), acc.numpy()), out.numpy(), host),
                *((lo, hi, n_ranks), residual.numpy()),
            )
        # simulate.allreduce_feedback's owner step, into scratch kept for the bucket; the
        # mean re-decoded goes where the shards were: they are summed by then.
        part = values[:per]
        calls = [
            functools.partial(cpu_kernels.call, "decode", recv, values, fmt),
            functools.partial(
                cpu_kernels.call, "mean_rows", values.numpy().reshape(n_ranks, -1), acc.numpy()
            ),
            functools.partial(cpu_kernels.call, "encode", acc, out, fmt),
            functools.partial(cpu_kernels.call, "decode", out, part, fmt),
        ]
        if hi > lo:
            args = (acc, part, *host, lo, hi, n_ranks, residual)
            calls.append(functools.partial(cpu_kernels.call, "owner_lost", *args))
        return functools.partial(in_order, calls)

    def bind_layer_maxima(
        self, x: torch.Tensor, layout: Layout, out: torch.Tensor, once: bool = False
    ) -> Callable[[], object]:
        """:meth:`layer_maxima` into ``out`` checked once; the returned call repeats it: one
        kernel call on "kernels" and "triton" (a variant that cannot run here falls back),
        :func:`segment_amax` elsewhere. ``once``: as :meth:`bind_encode`'s."""
        if out.dtype != torch.float32 or out.numel() != layout.n_segments:
            raise ValueError(
                f"out must hold {layout.n_segments} float32 maxima, got {out.numel()} {out.dtype}"
            )
        ops = functools.partial(_copy_made, functools.partial(segment_amax, x, layout), out)
        if x.dtype != torch.float32:
            return ops
        if self.backend == "kernels" and x.is_contiguous():
            return functools.partial(
                cpu_kernels.call, "block_amax", x, _host_offsets(layout, 0), out
            )
        if self.backend != "triton":
            return ops
        if once:  # the module's run-once launch, not a binding: nothing kept for one call
            launch = functools.partial(_triton().layer_maxima, x, out, layout.device_offsets)
        else:
            launch = _triton().bind_layer_maxima(x, out, layout.device_offsets, table=True)
        bound = functools.partial(in_order, [out.zero_, launch])
        return functools.partial(_run_bound, ("layer_maxima",), bound, ops)

    def bind_reduce_encode(
        self,
        source: torch.Tensor,
        n_rows: int,
        acc: torch.Tensor,
        divisor: int,
        out: torch.Tensor,
        scale: torch.Tensor,
        layout: Layout | None,
        pad: int = 0,
        valid: int | None = None,
        rows: torch.Tensor | None = None,
    ) -> Callable[[], object]:
        """The staged routes' sum then encode, bound: float32 ``source`` (``n_rows`` rows)
        summed into ``acc`` (the node's sum), or uint8 ``source`` through
        :meth:`shard_mean` (divided by ``divisor``), then ``acc[:valid]`` (all of it
        where None) encoded into ``out`` as :meth:`bind_encode` does.

        One kernel call on "kernels" (:func:`aps_comm.cpu_kernels.reduce_encode`), the two
        calls in turn elsewhere: the same bits. ``acc`` may be the first row (of
        ``source``, or of ``rows``): each element's sum is written after its rows are read.
        ``rows``: float32 scratch of a uint8 ``source``'s decoded rows on "kernels"
        (``n_rows`` times ``acc``'s elements; made here where None).
        """
        x = acc if valid is None else acc[:valid]
        numel = x.numel()
        fused = (
            self.backend == "kernels"
            and source.device.type == "cpu"
            and isinstance(scale, torch.Tensor)
            and out.numel() == payload_nbytes(numel + pad, self.fmt)
        )
        wide = source.dtype != torch.float32
        per_row = self._shard_bytes(source, n_rows) * 8 // self.fmt.wire_bits if wide else 0
        if (per_row if wide else source.numel() // max(n_rows, 1)) != acc.numel():
            raise ValueError(f"{n_rows} rows of {acc.numel()} elements, got {source.numel()}")
        if not fused:
            if not wide:
                rows = source.view(n_rows, acc.numel())
                reduce: Callable[[], object] = functools.partial(self.sum_rows, rows, acc)
            else:
                args = (source, n_rows)
                reduce = functools.partial(self.shard_mean, *args, divisor=divisor, out=acc)
            encode = self.bind_encode(x, out, scale, layout, pad)
            return functools.partial(in_order, [reduce, encode])
        _check_scaled(scale, layout, numel)
        factors = _window_scale(scale, layout)
        assert factors is not None
        scratch = None
        if wide:
            scratch = np.empty(n_rows * acc.numel(), np.float32) if rows is None else rows.numpy()
        return functools.partial(
            cpu_kernels.call,
            "reduce_encode",
            *(source, n_rows, acc, divisor, numel, out, self.fmt),
            *(_host_offsets(layout, numel), factors.numpy(), *_host_runs(layout), scratch),
        )

    def bind_staged_factors(
        self,
        maxima: torch.Tensor,
        world_size: int,
        ranks_per_node: int,
        grid: bool,
        out: torch.Tensor,
        none: bool = False,
        pick: tuple[np.ndarray, np.ndarray, bool] | None = None,
    ) -> Callable[[], None]:
        """Hierarchical's (or with ``grid`` the grid's) factors of the agreed maxima, written
        into the rows of float32 ``out`` (4 x segments: scale, shift, unscale, first) in
        place: a settled staged bucket binds its calls to those rows (``none``:
        ``scaling="none"``'s, every exponent 0). ``pick`` (the CPU kernels only): the
        maxima picked first from a bucket's, as :meth:`AgreedMaxima.host_factors_into`'s.

        One kernel call on "kernels" (:func:`aps_comm.cpu_kernels.staged_factors_into`), one
        launch on "triton" (:func:`aps_comm.triton_codec.bind_staged_factors`),
        :func:`aps_comm.scaling.factors` and one stack elsewhere, whatever the number of
        layers; the same bits. ``first`` is 1 for hierarchical.

        Example:
            >>> c = Codec("e4m3", torch.device("cpu"))
            >>> out = torch.empty(4, 1)
            >>> c.bind_staged_factors(torch.tensor([3.0]), 4, 2, False, out)()
            >>> out[:, 0]
            tensor([6.4000e+01, 2.0000e+00, 7.8125e-03, 1.0000e+00])
        """
        if (
            out.dtype != torch.float32
            or out.shape != (4, maxima.numel())
            or not out.is_contiguous()
        ):
            raise ValueError(
                f"out must be contiguous float32 of shape (4, {maxima.numel()}), got "
                f"{out.dtype} {tuple(out.shape)}"
            )
        if self.backend == "kernels" and maxima.device.type == "cpu":
            return functools.partial(
                cpu_kernels.call,
                "staged_factors_into",
                maxima.numpy(),
                self.fmt,
                world_size,
                ranks_per_node,
                grid,
                0 if none else EXPONENT_LIMIT,
                out.numpy(),
                pick,
            )
        if pick is not None:
            raise ValueError("picked maxima need the CPU kernels")
        if not grid:
            out[3].fill_(1.0)  # hierarchical has no first level of its own: never read
        route = "grid" if grid else "hierarchical"
        made = functools.partial(
            scale_factors,
            maxima,
            self.fmt,
            route,
            world_size=world_size,
            scaling=Scaling.NONE if none else Scaling.LAYER,
            ranks_per_node=ranks_per_node,
        )
        ops = functools.partial(_stack_factors, made, out)
        if self.backend != "triton":
            return ops
        limit = 0 if none else EXPONENT_LIMIT
        args = (self.fmt, maxima, world_size, ranks_per_node, grid, out, limit)
        launch = _triton().bind_staged_factors(*args)
        return functools.partial(_run_bound, ("staged_factors", grid, none), launch, ops)

    def bind_block_keys(
        self,
        x: torch.Tensor,
        layout: Layout,
        counts: torch.Tensor,
        maxima: torch.Tensor,
        keys: torch.Tensor,
        flags: torch.Tensor,
        world_size: int,
        agreed: bool = False,
        device_counts: torch.Tensor | None = None,
        gather: tuple[torch.Tensor, np.ndarray, torch.Tensor, int] | None = None,
    ) -> Callable[[], None] | None:
        """This rank's two_phase key of every block and non-finite flag of every layer, bound.

        The returned call writes every block's max |x| into ``maxima``, its
        key (:func:`aps_comm.scaling.exponent_keys`, route two_phase) into
        ``keys`` and each layer's flag (:func:`aps_comm.scaling.bad_layers`)
        into ``flags``: one kernel call on the "kernels" backend, two
        launches on "triton" (the flags zeroed, one kernel), whatever the
        number of blocks. On the other backends, or where a Triton variant
        cannot compile here (launched once at bind time on private buffers,
        the failure logged once), the same values from a few torch ops
        (:func:`aps_comm.scaling.exponent_keys`, :func:`aps_comm.scaling.bad_layers`)
        where ``device_counts`` is given, else None. Where ``fmt.max`` times N
        passes float32's max (bf16), the keys' rule takes the FP32 sum's bound
        too, on every backend.

        Args:
            x: the group's float32 values.
            layout: its blocks.
            counts: blocks per layer (int64; on "cast" and "bits" on ``x``'s device).
            maxima: float32 scratch, one per block.
            keys: uint8, one per block.
            flags: uint8, one per layer.
            world_size: N.
            agreed: agreed block exponents, where nothing reads this rank's own flags:
                ``flags`` is the union of :meth:`bind_blocks` (agreed), which its first
                chunk's owner step writes from the agreed keys. On "triton" the keys'
                kernel zeroes it for that step instead of flagging (one launch, no
                zeroing: the owner sets, never clears); the "kernels" owner writes
                every layer's flag over what the keys' call wrote.
            device_counts: ``counts`` on ``x``'s device, for the torch ops (not with
                ``agreed``); None: no torch ops.
            gather: "kernels" only: the layers gathered into the values first, in the
                same call (:func:`aps_comm.cpu_kernels.block_keys`' ``gather``).

        Example:
            >>> call = codec.bind_block_keys(x, blocks, counts, maxima, keys, flags, 2)  # doctest: +SKIP
            >>> call()  # doctest: +SKIP
        """
        ops = None
        if device_counts is not None:
            args = (x, layout, device_counts, maxima, keys, flags, self.fmt, world_size)
            ops = functools.partial(_block_keys_ops, *args)
        if self.backend not in ("kernels", "triton") or x.dtype != torch.float32:
            return ops
        if self.backend == "kernels":
            grid = _host_offsets(layout, 0)  # a CPU grid as it is: the kernel derives offsets
            return functools.partial(
                cpu_kernels.call,
                "block_keys",
                *(self.fmt, x, grid, counts, maxima, keys, flags, EXPONENT_LIMIT, world_size),
                gather=gather,
            )
        offsets = layout.offsets.numpy()
        bound = self.fmt.max * world_size > torch.finfo(torch.float32).max
        tile = _triton_tile(offsets, counts)
        if tile is None:
            return ops
        one, width, layer_of = tile
        probe = _triton().bind_block_keys(
            *(self.fmt, _like(x, one), np.array([0, one], np.int64), np.zeros(1, np.int64)),
            *(_like(maxima, 1), _like(keys, 1), _like(flags, 1), world_size, agreed),
        )
        if not _probed(("block_keys", self.fmt.name, width, bound, agreed), probe):
            return ops
        return _triton().bind_block_keys(
            self.fmt, x, offsets, layer_of, maxima, keys, flags, world_size, agreed
        )

    def bind_native_block_keys(
        self,
        x: torch.Tensor,
        layout: Layout,
        agreed: tuple[torch.Tensor, torch.Tensor],
        world_size: int,
        ops: Callable[[], object],
    ) -> Callable[[], object]:
        """This rank's native-sum key of every block of ``layout`` (its blocks), bound:
        every block's max |x| and key into ``agreed`` (float32 maxima, uint8 keys). One
        launch on "triton" (:func:`aps_comm.triton_codec.bind_native_block_keys`), else
        (or where that variant cannot run here) ``ops``, the same values by other calls."""
        offsets = layout.offsets.numpy()
        if (
            self.backend != "triton"
            or x.dtype != torch.float32
            or _longest(offsets) > _triton().MAX_SEGMENT
        ):
            return ops
        launch = _triton().bind_native_block_keys(self.fmt, x, offsets, *agreed, world_size)
        variant = ("native_block_keys", self.fmt.name)
        return functools.partial(_run_bound, variant, launch, ops)

    def bind_blocks(
        self, chunk: BlockChunk
    ) -> tuple[Callable[..., object], Callable[[], object], Callable[[], object]] | None:
        """Bind one chunk's three steps of two_phase with block exponents, every rank's own
        or agreed (``chunk.first_block`` set): ``send`` encodes every shard with the block
        keys (every rank's own: ``send(log2)``, this rank's preferred chunk, sent with its
        layer flags where ``chunk.at >= 0``; agreed: ``send()``, the codes only),
        ``owner()`` is this rank's owner step (every rank's own: it returns the ranks'
        largest preferred chunk (log2) for the first chunk, else 0), ``decode()`` decodes
        every gathered shard with its owner's keys (agreed: the agreed keys and the
        owner's extra exponents).

        The fused form of what :func:`aps_comm.transports.bind_blocks`' torch-op fallback
        does shard by shard (every rank's own keys, or agreed ones); the same bytes. None where this backend
        has no fused kernels ("kernels" and "triton" have them for 4-, 8- and 16-bit
        formats), or where a Triton variant cannot compile here (each launched once at
        bind time on private buffers, a failure logged once): the bucket then binds the
        codec's own calls (:func:`aps_comm.transports.bind_blocks`' fallback). On "triton" every index array goes to the device here, once, the
        owner step returns 0 on CUDA (see :func:`_owner_then_chunk`), and with agreed
        keys ``chunk.union`` is zeroed before the first chunk's owner step (which sets
        it, never clears) by the keys' call (:meth:`bind_block_keys` with ``agreed``).

        Example:
            >>> send, owner, decode = codec.bind_blocks(chunk)  # doctest: +SKIP
            >>> send(0); owner(); decode()  # doctest: +SKIP
        """
        c, n = chunk, chunk.firsts.size - 1
        if not self._fused_run(c, {n}):
            return None
        owner = self._bind_owner(c)
        if self.backend == "triton" and c.first_block is None:
            host = c.recv.numpy() if c.at >= 0 and c.recv.device.type == "cpu" else None
            at, piece = c.at + c.union.numel(), c.recv.numel() // n
            owner = functools.partial(_owner_then_chunk, owner, host, at, piece)
        return self._bind_send(c), owner, self._bind_decode(c)

    def _fused_run(self, c: BlockChunk, ranks: set[int]) -> bool:
        """Whether this backend's fused block kernels bind ``c`` (float32 values; 4-, 8- and
        16-bit formats): "kernels" on CPU tensors; on "triton" where the send, owner and
        decode variants (agreed or not as ``c``) for each count of ``ranks`` and blocks as
        long as ``c``'s shard's run here: each launched once on a tiny chunk of private
        buffers (N shards of one one-element block; piece: code, key, flag, log2)."""
        if c.x.dtype != torch.float32 or self.fmt.wire_bits not in (4, 8, 16):
            return False
        if self.backend != "triton":
            return self.backend == "kernels" and c.x.device.type == "cpu"
        t, fmt, agreed = _triton(), self.fmt, c.first_block is not None
        longest = _longest(c.shard)
        if longest > t.MAX_SEGMENT:
            return False
        lead, rows, width = t.tile_shape(longest, fmt.wire_bits)
        kind = "agreed" if agreed else "rank"
        for n in sorted(ranks):
            one, layer_of = np.arange(n + 1, dtype=np.int64), np.zeros(n, np.int64)
            px, pkeys = _like(c.x, n), _like(c.keys, n)
            pflags, punion = _like(c.flags, 1), _like(c.union, 1)
            psend, pout = _like(c.send, 5 * n), _like(c.out, 5)
            d = torch.zeros(1, dtype=torch.int32, device=c.x.device)
            divide = 0 if n == 1 else 1 if n & (n - 1) == 0 else 2
            if agreed:
                owner = t.bind_owner_agreed_blocks(
                    fmt, psend, n, one[:2], pkeys, 0, pout, punion, d, 2, max(longest, 1), layer_of
                )
            else:
                owner = t.bind_owner_rank_blocks(
                    fmt, psend, n, one[:2], pout, punion, d, 2, 3, max(longest, 1)
                )
            probes = [
                (
                    ("send_rank_blocks", fmt.name),
                    functools.partial(
                        t.bind_send_rank_blocks(fmt, px, pkeys, one, one, pflags, psend, 2, 3), 0
                    ),
                ),
                ((f"owner_{kind}_blocks", fmt.name, divide, lead, rows, width), owner),
                (
                    (f"decode_{kind}_blocks", fmt.name),
                    t.bind_decode_rank_blocks(
                        fmt, psend, n, one, one, layer_of, punion, px, 2, pkeys if agreed else None
                    ),
                ),
            ]
            if not all(_probed(variant, probe) for variant, probe in probes):
                return False
        return True

    def _bind_send(self, c: BlockChunk) -> Callable[..., object]:
        """``c.x``'s pieces encoded with ``c.keys`` into ``c.send``, the layer flags and the
        chunk's log2 (the call's argument) at ``c.at``; agreed: the codes only (the padding
        runs to the piece's end) and no argument. One bound kernel call on either backend."""
        n, agreed = c.firsts.size - 1, c.first_block is not None
        piece = c.send.numel() // n
        if self.backend == "triton":
            sb, at = (piece, -1) if agreed else (c.shard_bytes, c.at)
            send = _triton().bind_send_rank_blocks(
                self.fmt, c.x, c.keys, _grid_array(c.offsets), c.firsts, c.flags, c.send, sb, at
            )
            return functools.partial(send, -1) if agreed else send
        table = _key_table(unscale=False)
        head = (self.fmt, c.x.numpy(), c.keys.numpy(), table, c.offsets, c.firsts, c.send.numpy())
        if agreed:
            return functools.partial(cpu_kernels.call, "send_agreed_blocks", *head, piece)
        return functools.partial(
            cpu_kernels.call,
            "send_rank_blocks",
            *(*head, piece, c.shard_bytes, c.flags.numpy(), c.at),
        )

    def _bind_owner(
        self, c: BlockChunk, own: tuple[torch.Tensor, int] | None = None
    ) -> Callable[[], object]:
        """The owner step over ``c.recv``'s pieces into ``c.out``, the first chunk's layer
        flags into ``c.union`` (where ``c.at >= 0``: every rank's OR-ed, agreed: from the
        agreed keys); ``own``: the owner's own values and their piece
        (:func:`aps_comm.cpu_kernels.owner_rank_blocks`). One bound call."""
        n, longest, agreed = c.firsts.size - 1, _longest(c.shard), c.first_block is not None
        if self.backend == "triton":
            t, shard = _triton(), _grid_array(c.shard)
            d = torch.empty(max(shard.size - 1, 1), dtype=torch.int32, device=c.out.device)
            if agreed:  # c.union: zeroed by the keys' kernel
                return t.bind_owner_agreed_launch(
                    *(self.fmt, c.recv, n, shard, c.keys, c.first_block, c.out, c.union, d),
                    *(c.shard_bytes, longest, _layer_of(c.layer_ends) if c.at >= 0 else None),
                )
            mine, row = own if own is not None else (None, -1)
            return t.bind_owner_rank_blocks(
                *(self.fmt, c.recv, n, shard, c.out, c.union, d, c.shard_bytes, c.at, longest),
                own=mine,
                own_row=row,
            )
        if agreed:
            counts = np.diff(c.layer_ends, prepend=0) if c.at >= 0 else np.zeros(0)
            return functools.partial(
                cpu_kernels.call,
                "owner_agreed_blocks",
                *(self.fmt, EXPONENT_LIMIT, c.recv.numpy(), n, c.shard, c.keys.numpy()),
                *(c.first_block, c.out.numpy(), c.shard_bytes),
                None,  # the owner's scratch: the call's own, nothing kept per block
                (counts.astype(np.int64), c.union.numpy()),
                longest,
            )
        return functools.partial(
            cpu_kernels.call,
            "owner_rank_blocks",
            self.fmt,
            EXPONENT_LIMIT,
            c.recv.numpy().reshape(n, -1),
            c.shard,
            _key_table(unscale=True),
            c.out.numpy(),
            c.shard_bytes,
            c.at,
            c.union.numpy(),
            None,  # the mean's exponents: scratch of the call's own, nothing kept per block
            longest,
            None if own is None else (own[0].numpy(), own[1]),
        )

    def _bind_decode(
        self, c: BlockChunk, flag_rows: torch.Tensor | None = None
    ) -> Callable[[], object]:
        """The chunk's N gathered shards decoded into ``c.x`` with their owners' keys (agreed:
        the agreed keys and the owners' bytes d; the layers ``c.union`` flags made NaN): one
        bound call; where ``flag_rows`` (every rank's layer flags) are given, their OR into
        ``c.union`` first (in the same call on the CPU kernels)."""
        n, agreed = c.firsts.size - 1, c.first_block is not None
        if self.backend == "triton":
            decode = _triton().bind_decode_rank_blocks(
                *(self.fmt, c.gathered, n, _grid_array(c.offsets), c.firsts),
                *(_layer_of(c.layer_ends), c.union, c.x, c.shard_bytes),
                c.keys if agreed else None,
            )
            if flag_rows is None:
                return decode
            return functools.partial(in_order, [self._bind_or(flag_rows, c.union), decode])
        head = (self.fmt, c.gathered.numpy(), n, c.offsets, c.firsts)
        tail = (c.layer_ends, c.union.numpy(), c.x.numpy(), c.shard_bytes)
        if agreed:
            return functools.partial(_decode_agreed_kernels, *head, c.keys.numpy(), *tail)
        rows = () if flag_rows is None else (flag_rows.numpy(),)
        return functools.partial(
            cpu_kernels.call, "decode_rank_blocks", *head, _key_table(unscale=True), *tail, *rows
        )

    def bind_node_blocks(
        self, chunk: NodeBlockChunk
    ) -> (
        tuple[
            Callable[[], object] | None,
            Callable[[], object],
            Callable[[], object],
            Callable[[], object],
        ]
        | None
    ):
        """Bind one chunk of hierarchical (or grid) with every owner's own block exponents:
        (first, across, owner, decode). ``first``: grid's encode of this rank's L slices of
        the chunk with its own block keys into the first exchange (None for hierarchical,
        FP32); ``across``: the node's mean of this rank's slice, its blocks' own keys and
        its M pieces encoded with them (the first chunk's with this rank's layer flags);
        ``owner``: this rank's owner step across nodes (the first chunk's flags OR-ed into
        its shard); ``decode``: the N gathered shards decoded with their owners' keys (the
        first chunk's gathered flags OR-ed first). Each a fixed handful of kernel calls,
        whatever the number of ranks, layers or blocks.

        The fused form of what :func:`aps_comm.transports.bind_node_blocks`' torch-op
        fallback does slice by slice and shard by shard; the same bytes. Across nodes it
        is two_phase's :meth:`bind_blocks` applied to the node's mean of
        this rank's slice among the M ranks of its local rank. None where this
        backend has no fused kernels ("kernels" and "triton" have them, for 4-,
        8- and 16-bit formats; on "triton" the node's mean and the flags' ORs are
        a few torch ops over the L or N rows, in the same order): the bucket then
        binds the codec's own calls (:func:`aps_comm.transports.bind_node_blocks`' fallback).
        ``chunk.union`` is written by the first chunk's decode.

        Example:
            >>> first, across, owner, decode = codec.bind_node_blocks(chunk)  # doctest: +SKIP
            >>> across(); owner(); decode()  # doctest: +SKIP
        """
        c, n, nodes = chunk, chunk.firsts.size - 1, chunk.piece_firsts.size - 1
        if not self._fused_run(c, {n, nodes}):
            return None
        blocks, node, device = c.slice_offsets.size - 1, c.own_rows[1], c.x.device
        mean = torch.empty(int(c.slice_offsets[-1]), dtype=torch.float32, device=device)
        maxima = torch.empty(blocks, dtype=torch.float32, device=device)
        # Across nodes: two_phase's chunk of the node's mean of this rank's slice, sent with
        # its blocks' own keys.
        own = torch.empty(blocks, dtype=torch.uint8, device=device)
        across = dataclasses.replace(
            c, x=mean, keys=own, offsets=c.slice_offsets, firsts=c.piece_firsts
        )
        if self.backend == "triton":
            # The node's mean's blocks' own keys (two_phase's rule over the M nodes): the
            # block keys' kernel over the slice as one layer.
            slice_blocks = Layout.from_numels(np.diff(c.slice_offsets).tolist(), device)
            one_layer = torch.tensor([blocks], dtype=torch.int64)
            no_flag = torch.zeros(1, dtype=torch.uint8, device=device)
            mean_keys = self.bind_block_keys(
                mean, slice_blocks, one_layer, maxima, own, no_flag, nodes
            )
            if mean_keys is None:
                return None
            # No chunk byte: hierarchical agrees no chunk size on the wire.
            sends = [self._bind_node_mean(c, mean), mean_keys]
            sends.append(functools.partial(self._bind_send(across), -1))
        else:
            # The node's mean (hierarchical's; grid's decodes first), its keys and send: one
            # call (no chunk byte: hierarchical agrees no chunk size on the wire).
            rows = np.empty((0, 0), np.float32)
            sends = [] if c.first is None else [self._bind_node_mean(c, mean)]
            if c.first is None:
                rows = c.received.numpy().reshape(c.ranks_per_node, -1)
            sends.append(
                functools.partial(
                    cpu_kernels.call,
                    "node_send",
                    *(self.fmt, rows, mean.numpy(), (c.slice_offsets, c.piece_firsts)),
                    *(maxima.numpy(), own.numpy(), (EXPONENT_LIMIT, nodes)),
                    *(_key_table(unscale=False), c.send.numpy(), c.shard_bytes),
                    (c.flags.numpy(), c.at),
                )
            )
        send_first = None
        if c.first is not None:
            first_send, slice_firsts, slice_bytes = c.first
            # This rank's L slices with its own keys, no flags: a chunk of L shards.
            view = dataclasses.replace(
                c,
                firsts=slice_firsts,
                flags=c.flags[:0],
                send=first_send,
                shard_bytes=slice_bytes,
                at=-1,
            )
            send_first = functools.partial(self._bind_send(view), -1)
        own_mean = mean[_piece(c.slice_offsets, c.piece_firsts, node)], node
        owner = [self._bind_owner(dataclasses.replace(across, at=-1), own_mean)]
        flag_rows = None
        if c.at >= 0:  # the first chunk's flags, OR-ed after the owner step, before the decode
            k = slice(c.at, c.at + c.flags.numel())
            owner.append(self._bind_or(c.recv.view(nodes, -1)[:, k], c.out[k]))
            flag_rows = c.gathered.view(n, -1)[:, k]
        return send_first, _one_call(sends), _one_call(owner), self._bind_decode(c, flag_rows)

    def _bind_node_mean(self, c: NodeBlockChunk, mean: torch.Tensor) -> Callable[[], object]:
        """The node's mean of this rank's slice from what the first exchange brought,
        bound: the L received rows (hierarchical: float32, on Triton only: the CPU
        kernels' is :func:`cpu_kernels.node_send`'s; grid: encoded, each decoded with its
        sender's keys, this rank's own row its values) summed in rank order and divided
        by L."""
        t = _triton() if self.backend == "triton" else None
        per, numel = c.ranks_per_node, mean.numel()
        if c.first is None:  # hierarchical: FP32 rows of the slice
            return functools.partial(_mean_of_rows, [], c.received.view(per, numel), mean)
        _, slice_firsts, slice_bytes = c.first
        local = c.own_rows[0]
        mine = c.x[_piece(c.offsets, slice_firsts, local)]
        if t is None:
            return functools.partial(
                cpu_kernels.call,
                "mean_rank_blocks",
                self.fmt,
                c.received.numpy(),
                per,
                c.slice_offsets,
                _key_table(unscale=True),
                mean.numpy(),
                slice_bytes,
                _longest(c.slice_offsets),
                mine.numpy(),
                local,
            )
        rows = torch.empty(per, numel, dtype=torch.float32, device=c.x.device)
        pieces = c.received.view(per, -1)
        blocks = c.slice_offsets.size - 1
        whole, zero_layers = np.array([0, blocks], np.int64), np.zeros(blocks, np.int64)
        clean = torch.zeros(1, dtype=torch.uint8, device=c.x.device)
        decode_rows = [
            functools.partial(rows[r].copy_, mine)
            if r == local  # its own slice: the values, not their rounded copy
            else t.bind_decode_rank_blocks(
                self.fmt,
                pieces[r],
                1,
                c.slice_offsets,
                whole,
                zero_layers,
                clean,
                rows[r],
                slice_bytes,
            )
            for r in range(per)
        ]
        return functools.partial(_mean_of_rows, decode_rows, rows, mean)

    def _bind_or(self, rows: torch.Tensor, out: torch.Tensor) -> Callable[[], object]:
        """The OR of rows of 0/1 flag bytes into ``out`` (their maximum), bound."""
        if self.backend == "triton":
            return functools.partial(torch.amax, rows, dim=0, out=out)
        return functools.partial(cpu_kernels.call, "or_rows", rows.numpy(), out.numpy())

    def _torch(self) -> Codec:
        """This format's codec with torch ops on the same device (a Triton variant's fallback)."""
        return codec_for(self.fmt, self.device, "cast" if self.fmt.torch_dtype else "bits")

    def layer_maxima(self, x: torch.Tensor, layout: Layout, out: torch.Tensor) -> torch.Tensor:
        """Each segment's max |x| into float32 ``out`` in one pass: :func:`segment_amax`.

        What one MAX all-reduce agrees on, and what :class:`AgreedMaxima`
        turns into factors (on CPU the numba kernel, on CUDA one Triton
        kernel that meets its programs' pieces in atomic maxima).

        Example:
            >>> c = Codec("e4m3", torch.device("cpu"))
            >>> out = torch.empty(2)
            >>> layout = Layout.from_numels([2, 1], torch.device("cpu"))
            >>> c.layer_maxima(torch.tensor([3.0, -4.0, float("nan")]), layout, out)
            tensor([4., inf])
        """
        self.bind_layer_maxima(x, layout, out, once=True)()
        return out

    def sum_rows(self, rows: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """The sum of float32 ``rows`` (N, S) into ``out`` (S), in float32 in row order.

        The same bits as ``out = rows[0]; out += rows[r]`` row by row (an FSDP
        unit's reduce-scatter sum): one kernel call on "kernels", N torch ops
        elsewhere.

        Example:
            >>> c = Codec("e4m3", torch.device("cpu"))
            >>> c.sum_rows(torch.tensor([[1.0, 2.0], [2.0, 3.0]]), torch.empty(2))
            tensor([3., 5.])
        """
        if rows.dim() != 2 or out.shape != rows.shape[1:] or rows.dtype != torch.float32:
            raise ValueError(
                f"rows must be 2-D float32 and out one row, got {rows.dtype} "
                f"{tuple(rows.shape)} and {tuple(out.shape)}"
            )
        if self.backend == "kernels" and rows.is_contiguous() and out.is_contiguous():
            cpu_kernels.sum_rows(rows.numpy(), out.numpy())
            return out
        out.copy_(rows[0])
        for r in range(1, rows.shape[0]):
            out += rows[r]  # FP32, in rank order
        return out

    def layer_records(
        self,
        x: torch.Tensor,
        layout: Layout,
        maxima: torch.Tensor,
        keys: np.ndarray,
        out: torch.Tensor,
        rates: torch.Tensor | None = None,
        at: np.ndarray | None = None,
    ) -> None:
        """Each segment's statistics row into float64 ``out`` (L, 5) in one kernel call.

        Row s: the exponent behind int32 exponent key ``keys[s]`` (what
        :meth:`AgreedMaxima.host_factors_into` left in its scratch), the
        agreed maximum ``maxima[s]``, and the counts of
        :func:`aps_comm.telemetry.layer_counts` over float32 ``x`` (nonzero,
        underflowing and saturating elements once scaled): a settled bucket's
        records with no per-layer work on the host. CPU kernels only. With
        float32 ``rates``, :meth:`underflow_rates` under the same exponents too,
        in the same call (``stats=True`` under Promote), at ``at`` as there.

        Raises:
            ValueError: the codec's backend is not "kernels", or ``x`` is not
                contiguous float32 of ``layout.numel`` elements.

        Example:
            >>> c = Codec("e4m3", torch.device("cpu"), backend="kernels")
            >>> out = torch.empty(1, 5, dtype=torch.float64)
            >>> layout = Layout.from_numels([3], torch.device("cpu"))
            >>> c.layer_records(torch.tensor([1.0, 1e-9, 0.0]), layout, torch.tensor([1.0]),
            ...                 np.array([127], np.int32), out)
            >>> out.tolist()
            [[0.0, 1.0, 2.0, 1.0, 0.0]]
        """
        self._check_records(x, layout)
        offsets = layout.offsets.numpy()
        cpu_kernels.call("layer_records", x, offsets, maxima, keys, self.fmt, out, rates, at)

    def bind_block_records(
        self, x: torch.Tensor, blocks: Blocks, keys: torch.Tensor, maxima: torch.Tensor
    ) -> Callable[[torch.Tensor], None] | None:
        """:meth:`layer_records` of block scaling, bound: the returned call writes each layer's
        row into float64 ``out`` (layers, 5): the smallest exponent of its blocks (uint8
        ``keys``), the largest of their float32 ``maxima`` and their summed counts
        (:func:`aps_comm.telemetry.per_layer`). One kernel call on the "kernels" backend, two
        launches on "triton" (:func:`aps_comm.triton_codec.bind_block_records`), the general
        path's tensor ops on "cast" and "bits" (:func:`aps_comm.telemetry.block_rows`),
        whatever the number of layers or blocks; None where a Triton variant cannot compile
        here (launched once at bind time on private buffers, the failure logged once).

        Raises:
            ValueError: on "kernels", ``x`` is not contiguous float32 of the blocks' elements.

        Example:
            >>> c = Codec("e4m3", torch.device("cpu"), backend="kernels")
            >>> out = torch.empty(1, 5, dtype=torch.float64)
            >>> b = Layout.from_numels([10], torch.device("cpu")).grid(8)  # blocks of 8 and 2
            >>> x = torch.tensor([1.0, 1e-9, 0, 0, 0, 0, 0, 0, 0, 0])
            >>> keys = torch.tensor([127, 0], dtype=torch.uint8)
            >>> c.bind_block_records(x, b, keys, torch.tensor([1.0, 0.0]))(out)
            >>> out.tolist()
            [[0.0, 1.0, 2.0, 1.0, 0.0]]
        """
        offsets = blocks.layout.offsets.numpy()
        if self.backend == "kernels":
            self._check_records(x, blocks.layout)
            counts = blocks.counts.numpy()
            args = (x, offsets, counts, keys, maxima, self.fmt)
            return functools.partial(cpu_kernels.call, "block_records", *args)
        if self.backend in ("cast", "bits"):
            return functools.partial(_block_rows, x, blocks, keys, maxima, self.fmt)
        if x.dtype != torch.float32:  # "triton" from here
            return None
        tile = _triton_tile(offsets, blocks.counts)
        if tile is None:
            return None
        one, width, layer_of = tile
        probe = _triton().bind_block_records(
            *(self.fmt, _like(x, one), np.array([0, one], np.int64), np.zeros(1, np.int64)),
            *(_like(keys, 1), _like(maxima, 1), 1),
        )
        out = torch.empty(1, 5, dtype=torch.float64, device=x.device)
        if not _probed(("block_records", self.fmt.name, width), lambda: probe(out)):
            return None
        n_layers = len(blocks.counts)
        return _triton().bind_block_records(self.fmt, x, offsets, layer_of, keys, maxima, n_layers)

    def bind_layer_records(
        self, x: torch.Tensor, layout: Layout, agreed: AgreedMaxima, shown: torch.Tensor
    ) -> Callable[[torch.Tensor], None] | None:
        """:meth:`layer_records` of ``x`` bound for Triton: the returned call takes float64
        ``out`` (layers, 5) and writes each layer's exponent of its ``agreed`` maximum,
        its maximum in ``shown`` (``agreed``'s, or before bucket scaling's spread) and
        its counts (:func:`aps_comm.telemetry.layer_counts`). Three launches whatever the
        number of layers: the keys of the layers' pieces of at most the largest block size
        (:func:`aps_comm.triton_codec.bind_cell_keys`), then :meth:`bind_block_records`
        of those pieces. None off Triton, or where a variant cannot compile here.

        Example:
            >>> call = codec.bind_layer_records(x, layout, agreed, agreed.maxima)  # doctest: +SKIP
            >>> call(torch.empty(layout.n_segments, 5, dtype=torch.float64))  # doctest: +SKIP
        """
        fmt, rule = self.fmt, agreed.rule()
        return self._bind_cell_records(
            x,
            layout,
            lambda layer_of, out: _triton().bind_cell_keys(
                fmt, agreed.maxima, shown, layer_of, rule, out
            ),
        )

    def bind_staged_records(
        self, x: torch.Tensor, layout: Layout, rows: torch.Tensor, shown: torch.Tensor
    ) -> Callable[[torch.Tensor], None] | None:
        """:meth:`bind_layer_records` of a staged bucket (one exponent per layer): each
        layer's records under its first-level exponent, read from the bound factor rows
        (float32, 4 x layers, :meth:`bind_staged_factors`'), with its ``shown`` maximum.
        Three launches whatever the number of layers
        (:func:`aps_comm.triton_codec.bind_row_cell_keys`, then :meth:`bind_block_records`);
        None off Triton, or where a variant cannot compile here."""
        return self._bind_cell_records(
            x,
            layout,
            lambda layer_of, out: _triton().bind_row_cell_keys(rows, shown, layer_of, out),
        )

    def _bind_cell_records(
        self,
        x: torch.Tensor,
        layout: Layout,
        bind_keys: Callable[[np.ndarray, tuple[torch.Tensor, torch.Tensor]], Callable],
    ) -> Callable[[torch.Tensor], None] | None:
        """Layer records on Triton through cells (pieces of layers of at most the largest
        block size, a tile's rows): ``bind_keys(layer_of, (keys, top))`` binds the launch
        writing every cell's key and maximum, then the block records run on the cells."""
        if self.backend != "triton" or x.dtype != torch.float32:
            return None
        cells = layout.grid(BLOCK_SIZES[-1])
        n = cells.layout.n_segments
        keys = torch.empty(n, dtype=torch.uint8, device=x.device)
        top = torch.empty(n, dtype=torch.float32, device=x.device)
        records = self.bind_block_records(x, cells, keys, top)
        if records is None:
            return None
        keyed = bind_keys(_block_layers(cells.counts.numpy()), (keys, top))
        return functools.partial(_after, keyed, records)

    def bind_staged_blocks(
        self,
        x: torch.Tensor,
        blocks: Blocks,
        local: torch.Tensor,
        keys: torch.Tensor,
        ranks: tuple[int, int],
        grid: bool,
        out: torch.Tensor,
    ) -> tuple[Callable[[], object], Callable[[], object]] | None:
        """A settled staged bucket's agreed block keys, bound: the call that writes this
        rank's max |x| of every block into float32 ``local`` and its hierarchical (with
        ``grid`` the grid's) keys into uint8 ``keys`` (2 x blocks: inner, then outer;
        :func:`aps_comm.cpu_kernels.staged_keys`), and the call that writes the agreed
        keys' factors into the rows of float32 ``out`` (4 x blocks: scale, shift, unscale,
        first; :func:`~aps_comm.cpu_kernels.staged_key_factors`). One kernel call each on
        "kernels", one launch each on "triton" (each variant probed once here); elsewhere,
        or where a Triton variant cannot compile, a few torch ops each
        (:func:`aps_comm.scaling.exponent_keys`, :func:`~aps_comm.scaling.factors_from_keys`,
        no host read); None for values that are not float32. ``ranks``: N and the ranks of
        the first level's sum.

        Example:
            >>> keys_call, factors_call = codec.bind_staged_blocks(  # doctest: +SKIP
            ...     x, blocks, local, keys, (4, 2), False, out)
        """
        n, per = ranks
        if self.backend == "kernels":
            cells = _host_offsets(blocks.layout, 0)
            return (
                functools.partial(
                    cpu_kernels.call,
                    "staged_keys",
                    *(self.fmt, x, cells, local, keys, n, per, EXPONENT_LIMIT),
                ),
                functools.partial(
                    cpu_kernels.call, "staged_key_factors", keys, blocks.counts, grid, out
                ),
            )
        if x.dtype != torch.float32:
            return None
        offsets = blocks.layout.offsets.numpy()
        tile = _triton_tile(offsets, blocks.counts) if self.backend == "triton" else None
        if tile is not None:
            one, width, _ = tile
            bounds = np.array([0, one], np.int64)
            probe_keys = _triton().bind_staged_keys(
                self.fmt, _like(x, one), bounds, _like(local, 1), _like(keys, 2), n, per
            )
            probe_factors = _triton().bind_staged_key_factors(
                _like(keys, 2), np.ones(1, np.int64), grid, torch.empty(4, 1, device=out.device)
            )
            if _probed(("staged_keys", self.fmt.name, width), probe_keys) and _probed(
                ("staged_key_factors", grid), probe_factors
            ):
                return (
                    _triton().bind_staged_keys(self.fmt, x, offsets, local, keys, n, per),
                    _triton().bind_staged_key_factors(keys, blocks.counts.cpu().numpy(), grid, out),
                )
        route = "grid" if grid else "hierarchical"
        if not grid:
            out[3].fill_(1.0)  # hierarchical has no first level of its own: never read
        made = functools.partial(
            factors_from_keys,
            keys.view(2, -1),
            self.fmt,
            route,
            world_size=n,
            counts=blocks.device_counts,
        )
        return (
            functools.partial(
                block_keys_into, x, blocks.layout, self.fmt, route, n, (local, keys), per
            ),
            functools.partial(_stack_factors, made, out),
        )

    def unit_records(
        self,
        x: torch.Tensor,
        layout: Layout,
        counts: np.ndarray,
        keys: torch.Tensor | np.ndarray,
        maxima: torch.Tensor,
        n_rows: int,
        out: torch.Tensor,
        limits: tuple[np.ndarray, np.ndarray] | None = None,
    ) -> None:
        """:meth:`bind_block_records`' records of an FSDP unit's N rows, one row of float64
        ``out`` (P, 5) per parameter over every row's chunk, in one kernel call: a settled
        unit's records.

        Args:
            x: the N rows, contiguous float32, row r every parameter's r-th chunk.
            layout: its segments: ``counts[p]`` per chunk (one with layer scaling,
                its blocks with block scaling), row after row.
            counts: int64, segments per chunk (P).
            keys: one exponent key per segment: int32 (:meth:`AgreedMaxima.host_factors_into`'s
                scratch) or uint8 block keys.
            maxima: float32, one per segment.
            n_rows: N.
            out: float64 (P, 5): the smallest exponent, the largest maximum and the
                summed counts of each parameter's segments.
            limits: a unit of several formats: each parameter's underflow and saturation
                bounds (:func:`aps_comm.cpu_kernels.record_limits`); default the codec's.

        Raises:
            ValueError: the codec's backend is not "kernels", or ``x`` is not
                contiguous float32 of ``layout.numel`` elements.

        Example:
            >>> c = Codec("e4m3", torch.device("cpu"), backend="kernels")
            >>> out = torch.empty(1, 5, dtype=torch.float64)
            >>> layout = Layout.from_numels([2, 2], torch.device("cpu"))  # 2 rows of 1 chunk
            >>> c.unit_records(torch.tensor([1.0, 1e-9, 0.0, 500.0]), layout, np.array([1]),
            ...                np.array([127, 127], np.int32), torch.tensor([500.0, 500.0]), 2, out)
            >>> out.tolist()
            [[0.0, 500.0, 3.0, 1.0, 1.0]]
        """
        self._check_records(x, layout)
        cpu_kernels.call(
            "unit_records",
            x,
            layout.offsets.numpy(),
            counts,
            keys,
            maxima,
            n_rows,
            self.fmt if limits is None else limits,
            out,
        )

    def copy_spans(self, src: torch.Tensor, dst: torch.Tensor, spans: np.ndarray) -> None:
        """Byte spans of contiguous ``src`` copied into ``dst`` in one kernel call
        (int64 ``spans`` (K, 3): source offset, destination offset, length, in bytes):
        a settled FSDP unit of several formats gathers and scatters its runs' rows so.
        On the torch backends one copy per span (the spans are host numbers: no read).

        Raises:
            ValueError: a tensor is not contiguous.

        Example:
            >>> c = Codec("e4m3", torch.device("cpu"), backend="kernels")
            >>> dst = torch.zeros(2, dtype=torch.uint8)
            >>> c.copy_spans(torch.tensor([5, 6, 7], dtype=torch.uint8), dst, np.array([[2, 0, 1]]))
            >>> dst.tolist()
            [7, 0]
        """
        if not (src.is_contiguous() and dst.is_contiguous()):
            raise ValueError("copy_spans copies between contiguous tensors")
        if self.backend == "kernels":
            cpu_kernels.call("copy_spans", src, dst, spans)
            return
        src, dst = src.reshape(-1).view(torch.uint8), dst.reshape(-1).view(torch.uint8)
        for a, b, m in spans.tolist():
            dst[b : b + m].copy_(src[a : a + m])

    def sum_runs(
        self,
        values: torch.Tensor,
        out: torch.Tensor,
        runs: np.ndarray,
        n_rows: int,
        offsets: np.ndarray,
        maxima: torch.Tensor,
        lengths: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """An FSDP unit's N decoded rows summed run by run into ``out``, in one kernel call:
        the bits of :meth:`sum_rows`, and each FP32 run's parameters NaN where their agreed
        maximum is not (:func:`aps_comm.cpu_kernels.sum_runs` says how ``runs`` lays them out).
        On the torch backends :meth:`sum_rows` per run, and ``lengths`` (each parameter's
        chunk, int64 on the device) spreads an FP32 run's maxima over its elements.

        Raises:
            ValueError: the torch backends without ``lengths``.

        Example:
            >>> c = Codec("e4m3", torch.device("cpu"), backend="kernels")
            >>> c.sum_runs(torch.tensor([1.0, 2.0]), torch.empty(1), np.array([[0, 0, 1, 0, 1, 1, 1]]),
            ...            2, np.array([0, 1]), torch.tensor([2.0]))
            tensor([3.])
        """
        if self.backend == "kernels":
            cpu_kernels.call("sum_runs", values, out, runs, n_rows, offsets, maxima)
            return out
        if lengths is None:
            raise ValueError(f"sum_runs on {self.backend!r} needs the chunks' lengths")
        for start, lo, hi, first, last, exact, stride in runs.tolist():
            rows = values[start : start + n_rows * stride].view(n_rows, stride)
            self.sum_rows(rows[:, : hi - lo], out[lo:hi])
            if exact:  # 1 where the maximum is finite, else NaN (inf * 0): x * 1 is x
                keep = maxima[first:last].mul(0).add_(1)
                spread = torch.repeat_interleave(keep, lengths[first:last], output_size=hi - lo)
                out[lo:hi].mul_(spread)
        return out

    def _check_records(self, x: torch.Tensor, layout: Layout) -> None:
        if self.backend != "kernels":
            raise ValueError(f"the records' kernels run on 'kernels', not {self.backend!r}")
        if x.dtype != torch.float32 or not x.is_contiguous() or x.numel() != layout.numel:
            raise ValueError(
                f"x must be contiguous float32 of {layout.numel} elements, got "
                f"{tuple(x.shape)} {x.dtype}"
            )

    def underflow_rates(
        self,
        x: torch.Tensor,
        layout: Layout,
        scale: np.ndarray,
        out: torch.Tensor,
        at: np.ndarray | None = None,
    ) -> None:
        """Each segment's underflow rate under the host factors ``scale``, into float32
        ``out`` in one pass (the CPU kernels only): what :class:`aps_comm.policy.Promote`
        all-reduces, the bits of :func:`aps_comm.telemetry.layer_counts`' rate. With
        int64 ``at``, segment s's into ``out[at[s]]`` (a bucket's order).

        Example:
            >>> c = Codec("e4m3", torch.device("cpu"))
            >>> out = torch.empty(1)
            >>> layout = Layout.from_numels([2], torch.device("cpu"))
            >>> c.underflow_rates(torch.tensor([1.0, 1e-9]), layout, np.ones(1, np.float32), out)
            >>> out
            tensor([0.5000])
        """
        if self.backend != "kernels" or x.dtype != torch.float32:
            raise ValueError(
                f"underflow_rates runs the CPU kernels on float32, got backend "
                f"{self.backend!r} and {x.dtype}"
            )
        half = self.fmt.min_subnormal / 2
        cpu_kernels.underflow_rates(x, layout.offsets.numpy(), scale, half, out.numpy(), at)

    def owner_reduce(
        self, recv: torch.Tensor, n_ranks: int, *, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        """The shard owner's step of two_phase: see :func:`owner_reduce`.

        Example:
            >>> c = Codec("e4m3", torch.device("cpu"))
            >>> shards = torch.cat([c.encode(torch.tensor([1.0])), c.encode(torch.tensor([2.0]))])
            >>> c.decode(c.owner_reduce(shards, 2), 1)
            tensor([1.5000])
        """
        if out is None:
            shard_bytes = self._shard_bytes(recv, n_ranks)
            out = torch.empty(shard_bytes, dtype=torch.uint8, device=recv.device)
        self.bind_owner_reduce(recv, n_ranks, out)()
        return out

    def owner_reduce_blocks(
        self,
        recv: torch.Tensor,
        n_ranks: int,
        layout: Layout,
        exponents: torch.Tensor,
        *,
        out: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The shard owner's step of two_phase with block scaling: see :func:`owner_reduce_blocks`.

        Example:
            >>> c = Codec("e2m1", torch.device("cpu"))
            >>> blocks = Layout.from_numels([2], torch.device("cpu"))
            >>> shards = torch.cat([c.encode(torch.tensor([1.0, 0.5])),
            ...                     c.encode(torch.tensor([-1.0, 0.5]))])
            >>> e = torch.zeros(1, dtype=torch.int32)
            >>> payload, d = c.owner_reduce_blocks(shards, 2, blocks, e)
            >>> d, c.decode(payload, 2, scale=pow2(-d), layout=blocks)
            (tensor([3], dtype=torch.int32), tensor([0.0000, 0.5000]))
        """
        out = self._owner_blocks_out(recv, n_ranks, layout, out)
        n_blocks = layout.n_segments
        if (
            exponents.dtype != torch.int32
            or exponents.dim() != 1
            or exponents.numel() != n_blocks
            or exponents.device != recv.device
        ):
            raise ValueError(
                f"exponents must be an int32 vector of the layout's {n_blocks} blocks on "
                f"{recv.device}, got {exponents.dtype} of shape {tuple(exponents.shape)} "
                f"on {exponents.device}"
            )
        d = self._owner_pass("reduce_blocks", recv, n_ranks, layout, exponents, out)
        if d is not None:
            return out, d
        return self._owner_chain(recv, n_ranks, layout, None, (None, -1), exponents, out)

    def owner_reduce_rank_blocks(
        self,
        recv: torch.Tensor,
        n_ranks: int,
        layout: Layout,
        rank_scales: torch.Tensor,
        *,
        out: torch.Tensor | None = None,
        own: torch.Tensor | None = None,
        own_row: int = -1,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`owner_reduce_blocks` where every rank encoded with its own block exponents.

        Rank r's shard (row r of ``recv``: N equal rows, the shard at each
        row's start) is decoded times ``rank_scales[r]`` (float32, shape
        (N, blocks): its sender's ``2**-e``), the N values summed in float32
        in rank order and divided by N; each block of the mean gets its own
        exponent ``d`` (:func:`aps_comm.scaling.mean_exponents` with agreed
        exponents 0) and is encoded times ``2**d``; receivers decode with
        ``2**-d``. One pass on the "kernels" and "triton" backends, the chain
        of calls elsewhere, with the same bytes. With ``own`` (float32, the
        layout's elements), row ``own_row`` is not decoded: the owner adds its
        own values in its place.

        Example:
            >>> c = Codec("e2m1", torch.device("cpu"))
            >>> blocks = Layout.from_numels([2], torch.device("cpu"))
            >>> rows = torch.cat([c.encode(torch.tensor([4.0, 2.0])),
            ...                   c.encode(torch.tensor([-2.0, 1.0]))])
            >>> scales = torch.tensor([[0.25], [0.5]])  # the senders' own 2**-e
            >>> payload, d = c.owner_reduce_rank_blocks(rows, 2, blocks, scales)
            >>> d, c.decode(payload, 2, scale=pow2(-d), layout=blocks)
            (tensor([3], dtype=torch.int32), tensor([0.0000, 0.5000]))
        """
        out = self._owner_blocks_out(recv, n_ranks, layout, out)
        numel, n_blocks = layout.numel, layout.n_segments
        if (
            rank_scales.dtype != torch.float32
            or rank_scales.shape != (n_ranks, n_blocks)
            or rank_scales.device != recv.device
        ):
            raise ValueError(
                f"rank_scales must be float32 of shape ({n_ranks}, {n_blocks}) on "
                f"{recv.device}, got {rank_scales.dtype} of shape {tuple(rank_scales.shape)} "
                f"on {rank_scales.device}"
            )
        if own is not None and (
            own.dtype != torch.float32
            or own.numel() != numel
            or own.device != recv.device
            or not 0 <= own_row < n_ranks
        ):
            raise ValueError(
                f"own must be float32 with the layout's {numel} elements on {recv.device} and "
                f"own_row a row of {n_ranks}, got {own.dtype} of {own.numel()} on "
                f"{own.device} and own_row={own_row}"
            )
        mine = own, (-1 if own is None else own_row)
        d = self._owner_pass("reduce_rank_blocks", recv, n_ranks, layout, rank_scales, out, mine)
        if d is not None:
            return out, d
        zero = torch.zeros(n_blocks, dtype=torch.int32, device=recv.device)
        return self._owner_chain(recv, n_ranks, layout, rank_scales, mine, zero, out)

    def _owner_pass(
        self,
        kernel: str,
        recv: torch.Tensor,
        n_ranks: int,
        layout: Layout,
        given: torch.Tensor,
        out: torch.Tensor,
        own: tuple[torch.Tensor | None, int] | None = None,
    ) -> torch.Tensor | None:
        """The owner's step over blocks in one pass: the ``kernel`` of the CPU kernels or
        of Triton (``reduce_blocks``: ``given`` the agreed exponents; ``reduce_rank_blocks``:
        the senders' scales and ``own``, the owner's values and row) writing ``out``;
        returns the int32 extra exponents ``d``, or None where neither runs (the chain)."""
        args = (EXPONENT_LIMIT, layout.longest)
        if self.backend == "kernels":
            d = torch.empty(layout.n_segments, dtype=torch.int32)
            if layout.n_segments:
                if own is not None:
                    args += (None if own[0] is None else own[0].contiguous().numpy(), own[1])
                offsets, factors = layout.offsets.numpy(), given.contiguous().numpy()
                getattr(cpu_kernels, kernel)(
                    recv, n_ranks, self.fmt, offsets, factors, out, d.numpy(), *args
                )
            return d
        if self.backend != "triton" or layout.longest > _triton().MAX_SEGMENT:
            return None
        d = torch.empty(layout.n_segments, dtype=torch.int32, device=recv.device)
        extra = {} if own is None else {"own": own[0], "own_row": own[1]}
        offsets, factors = layout.device_offsets, given.contiguous()
        getattr(_triton(), kernel)(
            recv, n_ranks, self.fmt, offsets, factors, out, d, *args, **extra
        )
        return d

    def _owner_chain(
        self,
        recv: torch.Tensor,
        n_ranks: int,
        layout: Layout,
        rank_scales: torch.Tensor | None,
        own: tuple[torch.Tensor | None, int],
        exponents: torch.Tensor,
        out: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The owner's step over blocks as the chain of calls the kernels fuse (and Triton's,
        for segments longer than its tile): each row's shard decoded (times its sender's
        ``rank_scales`` row where given; row ``own[1]`` is ``own[0]``, the owner's values),
        the rows summed in float32 in rank order and divided by N, each block's extra
        exponent ``d`` over ``exponents`` for the mean (:func:`aps_comm.scaling.mean_exponents`),
        the mean encoded times ``2**d`` into ``out``."""
        numel, rows = layout.numel, recv.view(n_ranks, -1)
        used, (mine, own_row) = payload_nbytes(numel, self.fmt), own
        values = torch.empty(n_ranks, numel, dtype=torch.float32, device=recv.device)
        decode_rows = [
            functools.partial(values[r].copy_, mine)
            if r == own_row
            else self.bind_decode(
                rows[r, :used],
                values[r],
                None if rank_scales is None else rank_scales[r],
                None if rank_scales is None else layout,
                once=True,
            )
            for r in range(n_ranks)
        ]
        mean = torch.empty(numel, dtype=torch.float32, device=recv.device)
        _mean_of_rows(decode_rows, values, mean)
        d = mean_exponents(blocks_amax(mean, layout), exponents, self.fmt)
        self.encode(mean, out=out, scale=pow2(d), layout=layout)
        return out, d

    def _owner_blocks_out(
        self, recv: torch.Tensor, n_ranks: int, layout: Layout, out: torch.Tensor | None
    ) -> torch.Tensor:
        """Check the owner's inputs (whole elements per shard, a whole layout) and give
        the output bytes (``out``, checked, or new)."""
        numel = layout.numel
        shard_bytes = self._shard_bytes(recv, n_ranks)
        if shard_bytes * 8 % self.fmt.wire_bits or numel > shard_bytes * 8 // self.fmt.wire_bits:
            raise ValueError(
                f"each shard must hold whole elements, at least the layout's {numel}: got "
                f"{shard_bytes} bytes of {self.fmt.name} ({self.fmt.wire_bits} bits each)"
            )
        if layout.parent is not None:
            raise ValueError(
                "the owner's step needs a whole layout of the shard's blocks, got a window "
                "(build one with Layout.from_numels(window.sizes, device))"
            )
        need = payload_nbytes(numel, self.fmt)
        if out is None:
            return torch.empty(need, dtype=torch.uint8, device=recv.device)
        _check_bytes(out, need, recv.device)
        return out

    def shard_mean(
        self,
        recv: torch.Tensor,
        n_ranks: int,
        *,
        divisor: int | None = None,
        scale: torch.Tensor | None = None,
        layout: Layout | None = None,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """float32 mean of N encoded shards laid end to end: see :func:`shard_mean`.

        All N shards are decoded in one call (times ``scale`` per segment of
        ``layout``, which covers the N shards end to end, padding included:
        each rank's own block exponents), then added in rank order
        (r0 + r1 + ... in float32, one in-place add per rank): the order that
        makes every backend give the same bits. ``out``: float32 of one shard's elements
        the mean is written into (Triton's kernel writes it there); None: a new tensor.

        Example:
            >>> c = Codec("e4m3", torch.device("cpu"))
            >>> c.shard_mean(c.encode(torch.tensor([1.0, 2.0])), 2)
            tensor([1.5000])
        """
        shard_bytes = self._shard_bytes(recv, n_ranks)
        numel = shard_bytes * 8 // self.fmt.wire_bits
        divisor = n_ranks if divisor is None else divisor
        if self.backend == "triton" and scale is None:
            if out is None:
                out = torch.empty(numel, dtype=torch.float32, device=recv.device)
            _triton().shard_mean(recv, n_ranks, self.fmt, out, divisor)
            return out
        values = self.decode(recv, n_ranks * numel, scale=scale, layout=layout)
        acc = values[:numel]
        for r in range(1, n_ranks):
            acc += values[r * numel : (r + 1) * numel]
        acc = acc if divisor == 1 else acc.div_(divisor)
        return acc if out is None else out.copy_(acc)

    def _shard_bytes(self, recv: torch.Tensor, n_ranks: int) -> int:
        if n_ranks < 1 or recv.dtype != torch.uint8 or recv.numel() % n_ranks:
            raise ValueError(
                f"recv must be uint8 of N={n_ranks} equal shards, got {recv.numel()} {recv.dtype}"
            )
        return recv.numel() // n_ranks


@functools.lru_cache(maxsize=256)
def codec_for(fmt: FloatFormat | str, device: torch.device, backend: str = "auto") -> Codec:
    """The :class:`Codec` of ``fmt`` on ``device`` (cached: one per format, device, backend).

    Example:
        >>> codec_for("e4m3", torch.device("cpu")) is codec_for("e4m3", torch.device("cpu"))
        True
    """
    return Codec(fmt, device, backend)  # type: ignore[arg-type]


def encode(
    x: torch.Tensor,
    fmt: FloatFormat | str,
    *,
    out: torch.Tensor | None = None,
    scale: torch.Tensor | None = None,
    layout: Layout | None = None,
    backend: Backend = "auto",
) -> torch.Tensor:
    """Encode ``x`` (times ``scale`` per segment) into ``fmt``'s wire bytes.

    Values are multiplied by their segment's scale in float32, saturated to
    ``+-fmt.max`` and rounded to nearest even; inf becomes inf (or NaN where
    the format has no inf), NaN stays NaN.

    Args:
        x: contiguous 1-D floating-point tensor.
        fmt: the wire format.
        out: uint8 tensor of :func:`~aps_comm.formats.payload_nbytes` bytes on
            ``x``'s device to write into (at any byte offset); allocated when None.
        scale: float32 factors, one per segment of ``layout`` (one in all
            without a layout); powers of two keep the scaling exact.
        layout: the segments of ``x``.
        backend: "auto", "kernels", "cast", "bits" or "triton" (see the module doc).

    Returns:
        ``out``.

    Example:
        >>> encode(torch.tensor([1.0, -2.0]), "e4m3")
        tensor([ 56, 192], dtype=torch.uint8)
    """
    return codec_for(fmt, x.device, backend).encode(x, out=out, scale=scale, layout=layout)


def decode(
    payload: torch.Tensor,
    fmt: FloatFormat | str,
    numel: int,
    *,
    out: torch.Tensor | None = None,
    scale: torch.Tensor | None = None,
    layout: Layout | None = None,
    backend: Backend = "auto",
) -> torch.Tensor:
    """Decode ``numel`` elements of ``fmt`` into float32 (times ``scale`` per segment).

    Args:
        payload: uint8 tensor holding at least the elements' bytes (at any byte offset).
        fmt: the wire format.
        numel: elements to decode.
        out: contiguous float32 tensor of ``numel`` elements to write into.
        scale: float32 factors, one per segment of ``layout``.
        layout: the segments of the output.
        backend: "auto", "kernels", "cast", "bits" or "triton".

    Returns:
        ``out``.

    Example:
        >>> decode(torch.tensor([56, 192], dtype=torch.uint8), "e4m3", 2)
        tensor([ 1., -2.])
    """
    return codec_for(fmt, payload.device, backend).decode(
        payload, numel, out=out, scale=scale, layout=layout
    )


def owner_reduce(
    recv: torch.Tensor,
    fmt: FloatFormat | str,
    n_ranks: int,
    *,
    out: torch.Tensor | None = None,
    backend: Backend = "auto",
) -> torch.Tensor:
    """The shard owner's step of two_phase: mean of N encoded shards, re-encoded.

    ``recv`` holds N equal shards end to end, rank 0 first. They are decoded,
    summed in float32 in rank order, divided by N and encoded again: the same
    arithmetic on every owner, on every backend, and in :mod:`aps_comm.simulate`.

    Args:
        recv: uint8 tensor of N equal shards.
        fmt: the wire format.
        n_ranks: N.
        out: uint8 tensor of one shard's bytes to write into.
        backend: "auto", "kernels", "cast", "bits" or "triton".

    Returns:
        ``out``.

    Example:
        >>> shards = torch.cat([encode(torch.tensor([1.0]), "e4m3"),
        ...                     encode(torch.tensor([2.0]), "e4m3")])
        >>> decode(owner_reduce(shards, "e4m3", 2), "e4m3", 1)
        tensor([1.5000])
    """
    return codec_for(fmt, recv.device, backend).owner_reduce(recv, n_ranks, out=out)


def owner_reduce_blocks(
    recv: torch.Tensor,
    fmt: FloatFormat | str,
    n_ranks: int,
    layout: Layout,
    exponents: torch.Tensor,
    *,
    out: torch.Tensor | None = None,
    backend: Backend = "auto",
) -> tuple[torch.Tensor, torch.Tensor]:
    """The shard owner's step of two_phase with block scaling, in one pass where it can.

    The mean of N encoded shards (as :func:`shard_mean`: decoded, summed in
    float32 in rank order, divided by N) is cut into the blocks of
    ``layout``; each block gets the extra exponent ``d`` of
    :func:`aps_comm.scaling.mean_exponents` (its largest ``|mean| * 2**d``
    fills the format) and is encoded times ``2**d``. The receivers decode it
    with ``2**-(e + d)``. The "kernels" and "triton" backends do it in one
    pass (the mean never stored), the others as that chain of calls, with
    the same bytes and exponents.

    Args:
        recv: uint8 tensor of N equal shards, rank 0 first (each may end in padding).
        fmt: the wire format.
        n_ranks: N.
        layout: the blocks of the shard's first ``layout.numel`` elements,
            one segment each (a layer's last block may be short); a whole
            layout, not a window.
        exponents: int32, the blocks' agreed exponents ``e`` (what the shards
            were encoded with; in [-126, 126]).
        out: uint8 tensor of :func:`~aps_comm.formats.payload_nbytes` bytes of
            ``layout.numel`` elements to write into.
        backend: "auto", "kernels", "cast", "bits" or "triton".

    Returns:
        (``out``, ``d``): the encoded mean and the int32 extra exponents, one
        per block.

    Example:
        >>> blocks = Layout.from_numels([2], torch.device("cpu"))
        >>> shards = torch.cat([encode(torch.tensor([1.0, 0.5]), "e2m1"),
        ...                     encode(torch.tensor([-1.0, 0.5]), "e2m1")])
        >>> e = torch.zeros(1, dtype=torch.int32)
        >>> payload, d = owner_reduce_blocks(shards, "e2m1", 2, blocks, e)
        >>> d, decode(payload, "e2m1", 2, scale=pow2(-d), layout=blocks)
        (tensor([3], dtype=torch.int32), tensor([0.0000, 0.5000]))
    """
    return codec_for(fmt, recv.device, backend).owner_reduce_blocks(
        recv, n_ranks, layout, exponents, out=out
    )


def shard_mean(
    recv: torch.Tensor,
    fmt: FloatFormat | str,
    n_ranks: int,
    *,
    divisor: int | None = None,
    scale: torch.Tensor | None = None,
    layout: Layout | None = None,
    backend: Backend = "auto",
) -> torch.Tensor:
    """float32 mean of N encoded shards laid end to end: summed in rank order, then / N.

    The arithmetic of :func:`owner_reduce` before its re-encoding. ``divisor``
    replaces N where each shard is already a sum (hierarchical two_phase's
    node sums divide by the world size, not by the number of nodes).
    ``scale`` and ``layout`` (covering all N shards, padding included) unscale
    each shard as it is decoded: shards encoded with each rank's own block
    exponents.

    Example:
        >>> shards = encode(torch.tensor([1.0, 2.0]), "e4m3")
        >>> shard_mean(shards, "e4m3", 2)
        tensor([1.5000])
    """
    return codec_for(fmt, recv.device, backend).shard_mean(
        recv, n_ranks, divisor=divisor, scale=scale, layout=layout
    )


def segment_amax(x: torch.Tensor, layout: Layout, *, blocked: bool | None = None) -> torch.Tensor:
    """max |x| of every segment in one pass: float32, NaN mapped to +inf, empty to 0.

    NaN becomes inf because MAX reductions may drop NaN; inf survives every MAX.

    Args:
        x: 1-D tensor of ``layout.numel`` elements.
        layout: its segments.
        blocked: reduce :attr:`Layout.blocks` (fixed-size pieces of every
            segment, then a max per segment over its pieces: the whole device
            works whatever the segment sizes) rather than one layer at a time;
            None: blocked everywhere but on the CPU. Both give the same values.

    Example:
        >>> x = torch.tensor([1.0, -3.0, float("nan"), 2.0])
        >>> segment_amax(x, Layout.from_numels([2, 0, 2], x.device))
        tensor([3., 0., inf])
    """
    if x.numel() != layout.numel:
        raise ValueError(f"layout covers {layout.numel} elements, x has {x.numel()}")
    if blocked is None:
        blocked = x.device.type != "cpu"
    if not blocked:
        # aminmax per layer reads each once in vectorised ATen code: 5x faster on
        # CPU than torch.segment_reduce or a numba loop (which does not vectorise
        # a NaN-aware max), at a few microseconds of Python per layer.
        return layer_amax(torch.split(x, layout.sizes))
    lengths, segment = layout.blocks
    out = torch.zeros(layout.n_segments, dtype=torch.float32, device=x.device)
    if not segment.numel():
        return out
    a = torch.abs(x.detach().float())
    # One block of threads per piece (cub's segmented reduce on CUDA); max keeps NaN.
    part = torch.segment_reduce(a, "max", lengths=lengths, unsafe=True, initial=0.0)
    # NaN to inf before the scatter: atomic maxima need not keep NaN.
    part = torch.nan_to_num(part, nan=float("inf"), posinf=float("inf"))
    return out.scatter_reduce_(0, segment, part, "amax")
