"""Llama-family models (Llama, Qwen2, Qwen3), LFM2 (hybrid: short convs + attention) and the safetensors loader.

    load_model(model_path, dtype, device, attn_backend) -> model
    model.arch: ModelArchConfig            (shapes, RoPE, EOS ids; .kv_layout(page_size, dtype))
    model.forward(batch) -> [B, hidden]    hidden state of each request's last new token
    model.compute_logits(hidden) -> [B, vocab] float32
"""
from common.models.arch import ModelArchConfig, ModelLoadError, RopeConfig
from common.models.loader import checkpoint_files, load_model
from common.models.registry import MODEL_REGISTRY, model_class

__all__ = [
    "MODEL_REGISTRY",
    "ModelArchConfig",
    "ModelLoadError",
    "RopeConfig",
    "checkpoint_files",
    "load_model",
    "model_class",
]
