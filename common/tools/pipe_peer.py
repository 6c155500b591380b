"""A peer in a child process, driven over a multiprocessing pipe: the loop that answers it and
the parent's handle on it. The transfer bench's decode side (``common.tools.bench_transfer_peer``)
and the transfer tests' peers (``tests/integration/_transfer_peer.py``) are both this, with their
own commands.

Protocol: the child's first message is ``("ok", info)`` (or ``("err", text)`` if it could not
start); then every command, a tuple ``(op, *args)``, gets exactly one reply, ``("ok", value)`` or
``("err", "op: Type: message")``. ``("close",)`` ends the loop after its reply; so does the
parent's end of the pipe closing.
"""
from __future__ import annotations

import multiprocessing
import multiprocessing.connection
import os
import signal
from collections.abc import Callable, Mapping
from typing import Any

Handlers = Mapping[str, Callable[..., Any]]


def answer(conn: multiprocessing.connection.Connection, handlers: Handlers) -> None:
    """Answer commands with ``handlers[op](*args)`` until ``close`` or until the parent is gone.
    A handler that raises is reported to the parent (which decides what that means), never
    fatal here; an unknown op is such an error."""
    while True:
        try:
            cmd = conn.recv()
        except EOFError:  # the parent is gone
            return
        op = cmd[0]
        if op == "close":
            conn.send(("ok", None))
            return
        try:
            handler = handlers.get(op)
            if handler is None:
                raise ValueError(f"unknown command {op!r}")
            conn.send(("ok", handler(*cmd[1:])))
        except Exception as exc:
            conn.send(("err", f"{op}: {type(exc).__name__}: {exc}"))


class PeerProcess:
    """The parent's handle on ``target(conn, *args)`` spawned in a child process. Every call is
    bounded in time; ``stop`` asks the child to close, then kills it by PID; ``info`` is its first
    reply. Errors raise ``error`` (AssertionError in tests, RuntimeError in tools)."""

    def __init__(self, target: Callable[..., None], args: tuple[Any, ...] = (), *, name: str,
                 start_timeout_s: float = 120.0, error: type[Exception] = RuntimeError,
                 context: multiprocessing.context.BaseContext | None = None) -> None:
        ctx = context or multiprocessing.get_context("spawn")  # spawn: never fork torch or mooncake state
        self.name, self._error = name, error
        self.conn, child_conn = ctx.Pipe()
        self.proc = ctx.Process(target=target, args=(child_conn, *args), daemon=True, name=name)
        self.proc.start()
        child_conn.close()
        try:
            self.info: Any = self.reply(start_timeout_s)
        except BaseException:
            self.stop()
            raise

    def send(self, *cmd: Any) -> None:
        self.conn.send(cmd)

    def reply(self, timeout_s: float) -> Any:
        if not self.conn.poll(timeout_s):
            raise self._error(f"{self.name} did not answer within {timeout_s:g} s")
        try:
            kind, value = self.conn.recv()
        except EOFError:
            self.proc.join(5)
            raise self._error(f"{self.name} exited (exit code {self.proc.exitcode})") from None
        if kind != "ok":
            raise self._error(f"{self.name}: {value}")
        return value

    def call(self, *cmd: Any, timeout_s: float = 120.0) -> Any:
        self.send(*cmd)
        return self.reply(timeout_s)

    def kill(self) -> None:
        if self.proc.pid is not None and self.proc.is_alive():
            os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.join(10)

    def stop(self, grace_s: float = 15.0) -> None:
        try:
            if self.proc.is_alive():
                self.conn.send(("close",))
                self.conn.poll(grace_s)
        except (OSError, EOFError):
            pass
        finally:
            self.proc.join(grace_s)
            self.kill()
            self.conn.close()
