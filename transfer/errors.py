"""The one exception type the transfer layer raises across its boundary."""
from __future__ import annotations


class TransferError(RuntimeError):
    """A transfer-layer failure; ``room`` names the request it concerns when there is one."""

    def __init__(self, message: str, room: int | None = None) -> None:
        super().__init__(message if room is None else f"room {room}: {message}")
        self.room = room


class RoomInUse(TransferError):
    """The room is another live request's on this rank: the new request is refused (HTTP 409)
    and the live one is left alone, so two requests that share a room can fail, never mix."""
