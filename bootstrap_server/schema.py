"""Wire types of the bootstrap registry and the decode-side compatibility check.

A prefill *rank* is addressed by ``(dp_group, engine_rank, pp_rank)`` where ``engine_rank`` is its
tensor-parallel rank inside its data-parallel group. Every rank of one prefill node registers a
``RankInfo``; all of them must agree on the *node layout* (``LAYOUT_FIELDS``). The decode side asks
for that layout once (``PrefillLayout``) and runs ``check_receivable`` on it, so a prefill it cannot
receive from fails at lookup time with a message naming the fields, instead of hanging per request.

``num_kv_heads`` and ``head_dim`` are what one rank holds (after TP sharding), i.e. the shape of its
KV pool rows ``[num_pages * page_size, num_kv_heads, head_dim]``. ``total_kv_heads`` is the model's
KV head count and ``kv_head_start`` the rank's first head, both registered as they are (never
back-computed from ``num_kv_heads x tp_size``, which is wrong under GQA replication); the registry
checks them against the pool contract (``bootstrap_server.heads``). A decode of another TP size
receives head slices (docs/TRANSFER.md §11); ``kv_staging`` says whether the rank can gather a
head slice into a registered staging buffer, which that needs. ``num_layers`` is the number of
layers in the model; pipeline stages split them the same way on both sides, which is why
``check_receivable`` requires equal ``pp_size``.

Hybrid models also move per-request recurrent state: ``state_shapes`` lists the shape of one
request's state in each state buffer (one per convolution layer) and ``state_dtype`` its dtype;
both empty/None for attention-only models. A decode receives the state bytes as they are, so
both must be equal too.
"""
from __future__ import annotations

import ipaddress
import re
from typing import Annotated, Literal, Protocol

import msgspec

from bootstrap_server.errors import LayoutMismatch
from bootstrap_server.heads import check_tp_pair, rank_heads

# Upper bounds only catch garbage (a pointer sent as a page size); no real model is near them.
Port = Annotated[int, msgspec.Meta(ge=1, le=65535)]
Rank = Annotated[int, msgspec.Meta(ge=0, le=65535)]
Size = Annotated[int, msgspec.Meta(ge=1, le=65536)]
Dim = Annotated[int, msgspec.Meta(ge=1, le=1 << 20)]
Name = Annotated[str, msgspec.Meta(min_length=1, max_length=255)]
KVDtype = Literal["float32", "float16", "bfloat16", "float8_e4m3fn", "float8_e5m2"]
StateShape = Annotated[tuple[Dim, ...], msgspec.Meta(min_length=1, max_length=8)]
StateShapes = Annotated[tuple[StateShape, ...], msgspec.Meta(max_length=1024)]

# Fields every rank of one prefill node must agree on, and that a decode must match.
LAYOUT_FIELDS: tuple[str, ...] = (
    "tp_size",
    "dp_size",
    "pp_size",
    "page_size",
    "kv_dtype",
    "num_layers",
    "num_kv_heads",
    "total_kv_heads",
    "head_dim",
    "transfer_backend",
    "kv_staging",
    "state_shapes",
    "state_dtype",
)

# RFC 1123 host name: dot-separated labels of letters, digits and inner hyphens.
_HOSTNAME = re.compile(r"^(?=.{1,253}$)([A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?)(\.[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?)*$")

RankKey = tuple[int, int, int]  # (dp_group, engine_rank, pp_rank)


def _check_rank_ip(rank_ip: str) -> None:
    try:
        addr = ipaddress.ip_address(rank_ip)
    except ValueError:
        if not _HOSTNAME.match(rank_ip):
            raise ValueError(f"rank_ip {rank_ip!r} is neither an IP address nor a host name") from None
        return
    # A wildcard address works by accident on one host and nowhere else: refuse it at the source.
    if addr.is_unspecified:
        raise ValueError(f"rank_ip {rank_ip!r} is a wildcard; register an address the decode can connect to")


class RankInfo(msgspec.Struct, kw_only=True, frozen=True, forbid_unknown_fields=True):
    """Body of ``PUT /route`` and answer of ``GET /route``: where one prefill rank listens.

    ``rank_ip:rank_port`` is the rank's ZMQ PULL socket (control plane). ``session_id`` is its
    transfer-engine session (Mooncake ``host:rpc_port``) when the backend has one. ``instance_id``
    changes on every process start, so a decode can tell a restarted rank from the one it cached,
    and a late ``DELETE`` from a dead incarnation cannot remove its successor.
    """

    role: Literal["prefill"] = "prefill"
    rank_ip: Name
    rank_port: Port
    engine_rank: Rank  # tensor-parallel rank inside the dp group
    tp_size: Size
    dp_size: Size
    dp_group: Rank
    pp_size: Size
    pp_rank: Rank
    page_size: Dim
    kv_dtype: KVDtype
    num_layers: Dim
    num_kv_heads: Dim  # per rank, after TP sharding
    head_dim: Dim
    transfer_backend: Name | None = None  # "mooncake", "fake", ...; None: not checked
    state_shapes: StateShapes = ()  # per state buffer: one request's state shape (hybrid models)
    state_dtype: KVDtype | None = None
    session_id: Name | None = None
    instance_id: Name | None = None
    # The model's KV heads and this rank's first one (None: an older rank that did not say; only
    # a decode of the same TP size and per-rank shape can receive from it).
    total_kv_heads: Dim | None = None
    kv_head_start: Annotated[int, msgspec.Meta(ge=0, le=1 << 20)] | None = None
    kv_staging: bool = False  # can gather head slices (serves a decode of another TP size)

    def __post_init__(self) -> None:
        # Cross-field rules; msgspec turns these into ValidationError when decoding a body.
        if self.engine_rank >= self.tp_size:
            raise ValueError(f"engine_rank {self.engine_rank} must be < tp_size {self.tp_size}")
        if self.dp_group >= self.dp_size:
            raise ValueError(f"dp_group {self.dp_group} must be < dp_size {self.dp_size}")
        if self.pp_rank >= self.pp_size:
            raise ValueError(f"pp_rank {self.pp_rank} must be < pp_size {self.pp_size}")
        if self.page_size & (self.page_size - 1):
            raise ValueError(f"page_size {self.page_size} must be a power of two")
        if bool(self.state_shapes) != (self.state_dtype is not None):
            raise ValueError("state_shapes and state_dtype come together (a hybrid model) or not at all")
        if (self.total_kv_heads is None) != (self.kv_head_start is None):
            raise ValueError("total_kv_heads and kv_head_start come together or not at all")
        if self.total_kv_heads is not None:
            try:
                heads = rank_heads(self.tp_size, self.total_kv_heads, self.engine_rank)
            except LayoutMismatch as exc:
                raise ValueError(str(exc)) from None
            if (heads.first, heads.count) != (self.kv_head_start, self.num_kv_heads):
                raise ValueError(
                    f"kv_head_start {self.kv_head_start} / num_kv_heads {self.num_kv_heads}: rank {self.engine_rank} "
                    f"of tp_size {self.tp_size} with total_kv_heads {self.total_kv_heads} holds heads "
                    f"{heads.first}..{heads.first + heads.count - 1}")
        _check_rank_ip(self.rank_ip)

    @property
    def key(self) -> RankKey:
        return (self.dp_group, self.engine_rank, self.pp_rank)

    @property
    def endpoint(self) -> str:
        """ZMQ endpoint of the rank's PULL socket (IPv6 literals bracketed)."""
        host = f"[{self.rank_ip}]" if ":" in self.rank_ip else self.rank_ip
        return f"tcp://{host}:{self.rank_port}"


class PrefillLayout(msgspec.Struct, kw_only=True, frozen=True):
    """Answer of ``GET /route?engine_rank=-1&target_dp_group=-1``: the prefill node's layout.

    Unknown fields are ignored when decoding so an older client can read a newer server.
    """

    tp_size: int
    dp_size: int
    pp_size: int
    page_size: int
    kv_dtype: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    transfer_backend: str | None = None
    state_shapes: tuple[tuple[int, ...], ...] = ()
    state_dtype: str | None = None
    registered_ranks: int = 0
    total_kv_heads: int | None = None  # None: an older prefill that did not register it
    kv_staging: bool = False

    @property
    def expected_ranks(self) -> int:
        return self.tp_size * self.dp_size * self.pp_size

    @property
    def complete(self) -> bool:
        """Whether every rank of the node has registered."""
        return self.registered_ranks >= self.expected_ranks

    @classmethod
    def of(cls, info: RankInfo, registered_ranks: int) -> PrefillLayout:
        return cls(**{f: getattr(info, f) for f in LAYOUT_FIELDS}, registered_ranks=registered_ranks)


class _KVLayoutLike(Protocol):
    """Structural view of ``common.kvcache.pool.KVLayout`` (not imported: it pulls in torch)."""

    @property
    def num_layers(self) -> int: ...
    @property
    def num_kv_heads(self) -> int: ...
    @property
    def head_dim(self) -> int: ...
    @property
    def page_size(self) -> int: ...
    @property
    def dtype(self) -> str: ...


class _StateLayoutLike(Protocol):
    """Structural view of ``common.kvcache.state_pool.StateLayout``."""

    @property
    def num_layers(self) -> int: ...
    @property
    def shape(self) -> tuple[int, ...]: ...
    @property
    def dtype(self) -> str: ...


class DecodeLayout(msgspec.Struct, kw_only=True, frozen=True):
    """What a decode rank can receive: its parallel layout and its KV pool layout."""

    tp_size: int
    pp_size: int
    page_size: int
    kv_dtype: str
    num_layers: int
    num_kv_heads: int  # per rank, after TP sharding
    head_dim: int
    transfer_backend: str | None = None
    state_shapes: tuple[tuple[int, ...], ...] = ()
    state_dtype: str | None = None
    total_kv_heads: int | None = None  # None: unknown (at tp_size 1 it is num_kv_heads)
    kv_staging: bool = False  # can scatter head slices from a registered staging area

    @property
    def model_kv_heads(self) -> int | None:
        """The model's KV heads, None when unknown."""
        if self.total_kv_heads is None and self.tp_size == 1:
            return self.num_kv_heads
        return self.total_kv_heads

    @classmethod
    def from_kv_layout(
        cls, layout: _KVLayoutLike, *, tp_size: int, pp_size: int = 1, transfer_backend: str | None = None,
        state: _StateLayoutLike | None = None, total_kv_heads: int | None = None, kv_staging: bool = False,
    ) -> DecodeLayout:
        return cls(
            total_kv_heads=total_kv_heads,
            kv_staging=kv_staging,
            tp_size=tp_size,
            pp_size=pp_size,
            page_size=layout.page_size,
            kv_dtype=layout.dtype,
            num_layers=layout.num_layers,
            num_kv_heads=layout.num_kv_heads,
            head_dim=layout.head_dim,
            transfer_backend=transfer_backend,
            state_shapes=state_shapes(state),
            state_dtype=None if state is None else state.dtype,
        )


def state_shapes(state: _StateLayoutLike | None) -> tuple[tuple[int, ...], ...]:
    """The wire form of a state layout: one item shape per state buffer."""
    return () if state is None else (tuple(state.shape),) * state.num_layers


def check_receivable(prefill: PrefillLayout, decode: DecodeLayout) -> None:
    """Raise ``LayoutMismatch`` naming every field that stops ``decode`` receiving ``prefill``'s KV.

    Supported: equal PP sizes; TP sizes equal, or one a multiple of the other (decode rank ``d``
    then receives each of its heads from one prefill rank that holds it, ``transfer.tp_map``);
    any prefill ``dp_size`` (one dp group serves a request). Bytes are copied as they are, so page
    size, dtype, layer count and head_dim must be equal, and both sides must count the same
    model KV heads. Unequal TP moves head slices through staging buffers (the prefill always
    gathers; the decode scatters when it holds more heads than one source sends): the side that
    must do so needs ``kv_staging``. Per-request recurrent state is
    per rank and sent whole, so it crosses only equal TP sizes. Backends must be equal when both
    sides name one.
    """
    problems: list[str] = []

    def differ(name: str, p: object, d: object, why: str = "") -> None:
        problems.append(f"{name}: prefill {p}, decode {d}" + (f" ({why})" if why else ""))

    if prefill.pp_size != decode.pp_size:
        differ("pp_size", prefill.pp_size, decode.pp_size, "only equal PP sizes are supported")
    if prefill.page_size != decode.page_size:
        differ("page_size", prefill.page_size, decode.page_size)
    if prefill.kv_dtype != decode.kv_dtype:
        differ("kv_dtype", prefill.kv_dtype, decode.kv_dtype)
    if prefill.num_layers != decode.num_layers:
        differ("num_layers", prefill.num_layers, decode.num_layers)
    if prefill.head_dim != decode.head_dim:
        differ("head_dim", prefill.head_dim, decode.head_dim)
    if prefill.tp_size == decode.tp_size:
        if prefill.num_kv_heads != decode.num_kv_heads:
            differ("num_kv_heads x head_dim per rank", f"{prefill.num_kv_heads}x{prefill.head_dim}",
                   f"{decode.num_kv_heads}x{decode.head_dim}")
        if None not in (prefill.total_kv_heads, decode.model_kv_heads) and prefill.total_kv_heads != decode.model_kv_heads:
            differ("total_kv_heads", prefill.total_kv_heads, decode.model_kv_heads)
    else:
        problems.extend(_tp_problems(prefill, decode))
    if tuple(map(tuple, prefill.state_shapes)) != tuple(map(tuple, decode.state_shapes)):
        differ("state_shapes (per-request recurrent state)", _shapes(prefill.state_shapes), _shapes(decode.state_shapes))
    if prefill.state_dtype != decode.state_dtype:
        differ("state_dtype", prefill.state_dtype, decode.state_dtype)
    if None not in (prefill.transfer_backend, decode.transfer_backend) and prefill.transfer_backend != decode.transfer_backend:
        differ("transfer_backend", prefill.transfer_backend, decode.transfer_backend)
    if problems:
        raise LayoutMismatch("decode cannot receive this prefill's KV cache: " + "; ".join(problems))


def _tp_problems(prefill: PrefillLayout, decode: DecodeLayout) -> list[str]:
    """Why unequal TP sizes cannot be served (empty: they can)."""
    pt, dt = prefill.tp_size, decode.tp_size
    if prefill.total_kv_heads is None:
        return [f"total_kv_heads: the prefill did not register it (tp_size {pt}), so a decode of tp_size {dt} "
                "cannot tell which heads each rank holds"]
    if decode.model_kv_heads is None:
        return [f"total_kv_heads: the decode does not know it (tp_size {dt}), so it cannot receive from tp_size {pt}"]
    if prefill.total_kv_heads != decode.model_kv_heads:
        return [f"total_kv_heads: prefill {prefill.total_kv_heads}, decode {decode.model_kv_heads}"]
    total = prefill.total_kv_heads
    try:
        check_tp_pair(pt, dt)
        p_heads = rank_heads(pt, total, 0, side="prefill ").count
        d_heads = rank_heads(dt, total, 0, side="decode ").count
    except LayoutMismatch as exc:
        return [str(exc)]
    problems = []
    if prefill.state_shapes:
        problems.append(f"state_shapes: per-rank recurrent state cannot be resharded from tp_size {pt} to {dt}")
    # Each source slice has min(p_heads, d_heads) heads; the prefill stages every slice (gathers
    # it), and the decode scatters when it holds more heads than one source sends.
    if not prefill.kv_staging:
        problems.append(f"kv_staging: prefill ranks send head slices to tp_size {dt}, which needs a staging buffer; "
                        "the prefill has none")
    if d_heads > p_heads and not decode.kv_staging:
        problems.append(f"kv_staging: decode ranks hold {d_heads} heads and receive {p_heads} per source, which needs a "
                        "staging area; the decode has none")
    return problems


def _shapes(shapes: tuple[tuple[int, ...], ...]) -> str:
    if not shapes:
        return "none"
    return ", ".join("x".join(map(str, sh)) for sh in shapes)
