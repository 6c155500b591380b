"""Between local plain data and the wire: registry records, KV-args messages, checks on a peer's data."""
from __future__ import annotations

from bootstrap_server.errors import LayoutMismatch
from bootstrap_server.schema import RankInfo, state_shapes

from transfer import messages as m
from transfer import staging
from transfer.args import KVArgs
from transfer.base import DataPlane


MAX_TP_SIZE = 1024  # far above any TP group a node runs; bounds what a peer's message makes us plan


def register_message(args: KVArgs, session_id: str, instance_id: str, status_endpoint: str,
                     staging_area: tuple[int, int] = (0, 0)) -> m.KVArgsRegister:
    """The decode's one-time description of its buffers for a prefill rank; ``staging_area``:
    (pointer, bytes) of its staging area, if it has one."""
    return m.KVArgsRegister(
        total_kv_heads=args.total_kv_heads or 0, staging_ptr=staging_area[0], staging_nbytes=staging_area[1],
        session_id=session_id, instance_id=instance_id, status_endpoint=status_endpoint,
        tp_rank=args.tp_rank, tp_size=args.tp_size, page_size=args.layout.page_size,
        kv_ptrs=list(args.kv.ptrs), kv_nbytes=list(args.kv.nbytes), kv_item_nbytes=list(args.kv.item_nbytes),
        aux_ptrs=list(args.aux.ptrs), aux_nbytes=list(args.aux.nbytes), aux_item_nbytes=list(args.aux.item_nbytes),
        state_ptrs=list(args.state.ptrs), state_nbytes=list(args.state.nbytes),
        state_item_nbytes=list(args.state.item_nbytes),
    )


def rank_info(args: KVArgs, port: int, instance_id: str, engine: DataPlane) -> RankInfo:
    lay = args.layout
    return RankInfo(
        rank_ip=args.host, rank_port=port, engine_rank=args.tp_rank, tp_size=args.tp_size, dp_size=args.dp_size,
        dp_group=args.dp_rank, pp_size=1, pp_rank=0, page_size=lay.page_size, kv_dtype=lay.dtype,  # type: ignore[arg-type]
        num_layers=lay.num_layers, num_kv_heads=lay.num_kv_heads, head_dim=lay.head_dim,
        transfer_backend=engine.name, session_id=engine.session_id, instance_id=instance_id,
        state_shapes=state_shapes(args.state_layout),
        state_dtype=None if args.state_layout is None else args.state_layout.dtype,  # type: ignore[arg-type]
        total_kv_heads=args.total_kv_heads, kv_head_start=None if args.heads is None else args.heads.first,
        kv_staging=args.can_stage,
    )


def peer_route(args: KVArgs, peer: m.KVArgsRegister) -> staging.Route | str:
    """What this prefill rank writes into the decode rank that sent ``peer``, or why it cannot."""
    if peer.page_size != args.layout.page_size:
        return f"page_size {peer.page_size} != {args.layout.page_size}"
    if list(peer.aux_item_nbytes) != list(args.aux.item_nbytes):
        return f"aux row bytes {peer.aux_item_nbytes} != {list(args.aux.item_nbytes)}"
    if list(peer.state_item_nbytes) != list(args.state.item_nbytes):
        return f"state item bytes {peer.state_item_nbytes} != {list(args.state.item_nbytes)}"
    if not 0 <= peer.tp_rank < peer.tp_size <= MAX_TP_SIZE:  # a garbage size must not cost a huge plan
        return f"tp_rank {peer.tp_rank} / tp_size {peer.tp_size} out of range (tp_size at most {MAX_TP_SIZE})"
    totals = (peer.total_kv_heads or None, args.total_kv_heads)  # None: a side that does not know it
    if None not in totals and totals[0] != totals[1]:
        return f"total_kv_heads {peer.total_kv_heads} != {args.total_kv_heads}"
    if peer.tp_size == args.tp_size:
        # Equal TP: rank r to rank r, all its heads, whatever the model's count (either side may not know it).
        if peer.tp_rank != args.tp_rank:
            return f"decode rank {peer.tp_rank} sent its KV args to prefill rank {args.tp_rank} at equal TP"
        if list(peer.kv_item_nbytes) != list(args.kv.item_nbytes):
            return f"KV page bytes per buffer {peer.kv_item_nbytes[:2]}.. != {list(args.kv.item_nbytes)[:2]}.."
        return staging.direct_route(args.tp_rank, args.layout.num_kv_heads)
    if None in totals:
        return (f"total_kv_heads: unknown on the {'decode' if totals[0] is None else 'prefill'} rank, so tp_size "
                f"{args.tp_size} cannot send to tp_size {peer.tp_size} (only equal TP sizes)")
    if len(args.state):
        return f"state_layout: per-rank recurrent state cannot be resharded from tp_size {args.tp_size} to {peer.tp_size}"
    try:
        r = staging.route(args.tp_size, args.tp_rank, peer.tp_size, peer.tp_rank, peer.total_kv_heads)
    except LayoutMismatch as exc:
        return str(exc)
    unit = args.kv.item_nbytes[0] // args.layout.num_kv_heads
    want = [unit * r.decode_heads] * len(args.kv)
    if list(peer.kv_item_nbytes) != want:
        return f"KV page bytes per buffer {peer.kv_item_nbytes[:2]}.. != {want[:2]}.. (decode rank {peer.tp_rank} of {peer.tp_size})"
    if not r.direct and not args.can_stage:
        return f"kv_staging: this prefill rank stages head slices for tp_size {peer.tp_size} but has no staging"
    if r.scatter and not peer.staging_nbytes:
        return f"kv_staging: decode rank {peer.tp_rank} receives head slices from tp_size {args.tp_size} but has no staging"
    return r


def bad_destination(peer: m.KVArgsRegister, info: m.TransferInfo, r: staging.Route) -> str | None:
    """Reject indices outside the decode's registered buffers, and a room this rank is not meant
    to hear from this decode rank about, before anything is written."""
    if not r.informs or info.required_dst_info_num != r.required_infos:
        return (f"decode rank {peer.tp_rank} of {peer.tp_size} sent a TransferInfo with required_dst_info_num "
                f"{info.required_dst_info_num}; the plan says {r.required_infos if r.informs else 'none from it'}")
    if r.scatter:
        page_nbytes = sum(peer.kv_item_nbytes)
        pages = peer.staging_nbytes // page_nbytes
        if sum(c for _, c in info.staging) != len(info.dst_pages):
            return f"staging extents cover {sum(c for _, c in info.staging)} pages for {len(info.dst_pages)} pages"
        if any(s < 0 or c < 1 or s + c > pages for s, c in info.staging):
            return f"staging extents outside the decode's {pages} staging pages"
    pages = min(b // i for b, i in zip(peer.kv_nbytes, peer.kv_item_nbytes))
    if any(p < 0 or p >= pages for p in info.dst_pages):
        return f"destination pages outside the decode's {pages} pages"
    if info.aux_slot is not None and peer.aux_ptrs:
        slots = peer.aux_nbytes[0] // peer.aux_item_nbytes[0]
        if not 0 <= info.aux_slot < slots:
            return f"aux slot {info.aux_slot} outside the decode's {slots} slots"
    if peer.state_ptrs:
        slots = min(b // i for b, i in zip(peer.state_nbytes, peer.state_item_nbytes))
        if any(s < 0 or s >= slots for s in info.state_slots):
            return f"state slots outside the decode's {slots} slots"
    return None


def bad_endpoint(endpoint: str) -> str | None:
    """Why a peer's ``tcp://host:port`` cannot be used as a status endpoint, or None.

    Checked when a message naming it arrives, so a malformed address is refused once, with a
    reason, instead of failing later inside a send on some other thread. ZMQ accepts more
    (wildcards, ``src;dst`` pairs, other transports) but none of that is a peer we can answer.
    """
    if not endpoint.startswith("tcp://"):
        return "not a tcp:// endpoint"
    host, sep, port = endpoint[len("tcp://"):].rpartition(":")
    if not sep or not host:
        return "expected tcp://host:port"
    if host.startswith("["):
        if not host.endswith("]") or len(host) < 3:
            return "bad IPv6 host"
    elif ":" in host:
        return "an IPv6 host must be written in brackets"
    if not endpoint.isascii() or any(c in host for c in "*;/ "):
        return "bad host"
    if not port.isdigit() or not 0 < int(port) < 65536:
        return "port must be in 1..65535"
    return None


def stub_info(msg: m.AbortRoom) -> m.TransferInfo:
    return m.TransferInfo(room=msg.room, session_id=msg.session_id, instance_id="", status_endpoint=msg.status_endpoint,
                          dst_pages=[], aux_slot=None)
