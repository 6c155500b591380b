"""Bad configuration fails at start-up with a message that names the problem."""
from __future__ import annotations

import json
import os
import shutil

import pytest

from common import envs
from common.config import (
    AttentionConfig,
    CacheConfig,
    ConfigError,
    ModelConfig,
    NodeConfig,
    SchedulerConfig,
    TransferConfig,
    resolve,
)
from common.engine.model_runner import ModelRunner


def node(model_path: str, **parts: object) -> NodeConfig:
    return NodeConfig(role="prefill", model=ModelConfig(model_path=model_path, device="cpu"), **parts)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "parts,needle",
    [
        ({"cache": CacheConfig(page_size=12)}, "power of two"),
        ({"cache": CacheConfig(page_size=0)}, "power of two"),
        ({"cache": CacheConfig(mem_fraction_static=1.5)}, "mem-fraction-static"),
        ({"cache": CacheConfig(max_running_requests=0)}, "max-running-requests"),
        ({"sched": SchedulerConfig(schedule_policy="random")}, "schedule-policy"),  # type: ignore[arg-type]
        ({"attention": AttentionConfig(backend="magic")}, "attention-backend"),
        ({"sched": SchedulerConfig(reserved_decode_tokens=0)}, "num-reserved-decode-tokens"),
        ({"sched": SchedulerConfig(prealloc_rows=-1)}, "prealloc_rows"),
        ({"transfer": TransferConfig(aux_top_k=-1)}, "aux_top_k"),
    ],
)
def test_bad_values_are_named(tiny_qwen3: str, parts: dict, needle: str) -> None:
    with pytest.raises(ConfigError, match=needle):
        resolve(node(tiny_qwen3, **parts))


def test_missing_model_dir(tmp_path: os.PathLike) -> None:
    with pytest.raises(ConfigError, match="not a directory"):
        resolve(node(str(tmp_path / "nope")))
    with pytest.raises(ConfigError, match="no config.json"):
        resolve(node(str(tmp_path)))


def test_auto_values_resolve_on_cpu(tiny_qwen3: str) -> None:
    cfg = resolve(NodeConfig(role="decode", model=ModelConfig(model_path=tiny_qwen3)))
    assert (cfg.model.device, cfg.model.dtype, cfg.attention.backend) == ("cpu", "float32", "torch")


def test_flashinfer_on_cpu_fails_clearly(tiny_qwen3: str) -> None:
    cfg = resolve(node(tiny_qwen3, attention=AttentionConfig(backend="flashinfer"), cache=CacheConfig(max_total_tokens=256)))
    with pytest.raises(ConfigError, match="needs a CUDA device"):
        ModelRunner(cfg.model, cfg.cache, cfg.attention)


def _copy_model(src: str, dst: str) -> str:
    shutil.copytree(src, dst)
    return dst


def test_unknown_arch_and_missing_weights(tiny_qwen3: str, tmp_path: os.PathLike) -> None:
    bad_arch = _copy_model(tiny_qwen3, str(tmp_path / "arch"))
    with open(os.path.join(bad_arch, "config.json")) as f:
        conf = json.load(f)
    conf["architectures"] = ["MambaForCausalLM"]
    with open(os.path.join(bad_arch, "config.json"), "w") as f:
        json.dump(conf, f)
    cfg = resolve(node(bad_arch, cache=CacheConfig(max_total_tokens=256)))
    with pytest.raises(Exception, match="MambaForCausalLM"):
        ModelRunner(cfg.model, cfg.cache, cfg.attention)

    no_weights = _copy_model(tiny_qwen3, str(tmp_path / "noweights"))
    os.remove(os.path.join(no_weights, "model.safetensors"))
    cfg = resolve(node(no_weights, cache=CacheConfig(max_total_tokens=256)))
    with pytest.raises(Exception, match="safetensors"):
        ModelRunner(cfg.model, cfg.cache, cfg.attention)


def test_env_var_type_error_names_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PDC_HEARTBEAT_MAX_FAILURES", "three")
    with pytest.raises(ValueError, match="PDC_HEARTBEAT_MAX_FAILURES"):
        envs.HEARTBEAT_MAX_FAILURES.get()
    assert all(v.name.startswith("PDC_") for v in envs.all_vars())
