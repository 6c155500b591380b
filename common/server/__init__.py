"""FastAPI app factory shared by both node roles: OpenAI + /generate + ops endpoints.

Public API: ``create_app(cfg, scheduler, tokenizer)``, ``run_api_server(cfg, endpoints, ...)``,
``ApiConfig``, ``SchedulerClient``. The IPC messages it exchanges live in ``common.ipc.protocol``.
"""
from common.server.app import create_app
from common.server.config import ApiConfig
from common.server.launch import pid_alive, run_api_server
from common.ipc.scheduler_client import SchedulerClient

__all__ = ["ApiConfig", "SchedulerClient", "create_app", "pid_alive", "run_api_server"]
