"""Hugging Face tokenizer directory -> encode/decode/chat template, loaded from disk only.

``transformers.AutoTokenizer`` reads the directory (tokenizer.json, tokenizer_config.json with
its chat template and special tokens). Encode and decode then go straight to the Rust
``tokenizers`` object behind it: the same vocabulary and post-processor, without transformers'
per-call Python overhead (~5x slower decode), which matters because the incremental
detokenizer decodes twice per token per request.
"""
from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from typing import Any

from jinja2 import TemplateError

from common.request import InvalidRequest

# Texts longer than this are encoded with the GIL released (``Tokenizer.encode``); shorter ones
# take the plain call, which skips the batch path's thread-pool hand-off.
_GIL_FREE_CHARS = 16384


def _read_json(path: str) -> dict[str, Any]:
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except FileNotFoundError:
        return {}
    return data if isinstance(data, dict) else {}


def _as_id_list(value: Any) -> list[int]:
    if isinstance(value, bool):
        return []
    if isinstance(value, int):
        return [value]
    if isinstance(value, list):
        return [v for v in value if isinstance(v, int) and not isinstance(v, bool)]
    return []


def eos_ids_from_configs(path: str) -> list[int]:
    """eos_token_id of generation_config.json (int or list), else of config.json, as HF generate
    falls back."""
    gen = _read_json(os.path.join(path, "generation_config.json"))
    if "eos_token_id" in gen:
        return _as_id_list(gen["eos_token_id"])
    return _as_id_list(_read_json(os.path.join(path, "config.json")).get("eos_token_id"))


def _flatten_content(content: Any) -> Any:
    """OpenAI content parts -> one string (text parts joined by newlines, as vLLM does)."""
    if not isinstance(content, list):
        return content
    texts: list[str] = []
    for part in content:
        if not isinstance(part, Mapping) or part.get("type") != "text" or not isinstance(part.get("text"), str):
            kind = part.get("type") if isinstance(part, Mapping) else type(part).__name__
            raise InvalidRequest(f"only text content parts are supported, got {kind!r}")
        texts.append(part["text"])
    return "\n".join(texts)


class Tokenizer:
    """A model's tokenizer. Thread-compatible for reads (encode/decode hold no Python state)."""

    def __init__(self, path: str) -> None:
        # Imported here: transformers costs ~2 s to import and only processes that tokenize need it.
        from transformers import AutoTokenizer

        self.path = path
        self._hf = AutoTokenizer.from_pretrained(path, local_files_only=True, trust_remote_code=False)
        # The Rust tokenizer behind a fast tokenizer; None for a slow (pure Python) one.
        self._fast = getattr(self._hf, "backend_tokenizer", None)
        ids = set(eos_ids_from_configs(path))
        if self._hf.eos_token_id is not None:
            ids.add(int(self._hf.eos_token_id))
        self._eos = frozenset(ids)

    @property
    def eos_token_ids(self) -> frozenset[int]:
        """Every id that ends generation: generation_config.json's list plus the tokenizer's eos."""
        return self._eos

    @property
    def vocab_size(self) -> int:
        """Number of ids the tokenizer knows, added tokens included (the model's embedding may be
        larger: padded rows decode to nothing)."""
        return len(self._hf)

    @property
    def chat_template(self) -> str | None:
        return self._hf.chat_template

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``; ``add_special_tokens`` adds what the post-processor adds (BOS).

        A long text goes through ``encode_batch``, the same encoding, because only that binding
        releases the GIL while Rust works: ``encode`` of a 900 kB prompt, in the API process's
        worker thread, held it (and so the event loop: /health) for its whole second.
        """
        if self._fast is not None:
            if len(text) > _GIL_FREE_CHARS:
                return list(self._fast.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids)
            return list(self._fast.encode(text, add_special_tokens=add_special_tokens).ids)
        return list(self._hf.encode(text, add_special_tokens=add_special_tokens))

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of ``ids``; bytes that do not form complete UTF-8 come out as U+FFFD."""
        if self._fast is not None:
            return self._fast.decode(list(ids), skip_special_tokens=skip_special_tokens)
        return self._hf.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        """The id of vocabulary entry ``token`` (not of a text: see ``encode``); None if absent."""
        if self._fast is not None:
            return self._fast.token_to_id(token)
        tid = self._hf.convert_tokens_to_ids(token)
        return None if tid is None or tid == self._hf.unk_token_id else int(tid)

    def id_to_token(self, token_id: int) -> str | None:
        """The vocabulary entry (not the decoded text) of ``token_id``; None outside the vocabulary."""
        return self._hf.convert_ids_to_tokens(token_id)

    def backend_json(self) -> str:
        """The Rust tokenizer serialized (tokenizer.json's form, added tokens included): what a
        grammar backend builds its token trie from. Needs a fast tokenizer."""
        if self._fast is None:
            raise ValueError(f"the tokenizer at {self.path} is not a fast (Rust) tokenizer; structured outputs need one")
        return self._fast.to_str()

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        tokenize: bool = True,
        **template_kwargs: Any,
    ) -> list[int] | str:
        """Render ``messages`` with the model's chat template; token ids, or the text if
        ``tokenize`` is False. The rendered text already carries BOS/role tokens, so it is
        encoded without adding special tokens again (as HF does). Extra keyword arguments
        (``tools``, ``enable_thinking``, ...) reach the template. A template that rejects the
        conversation, or a model without a template, raises InvalidRequest."""
        if self._hf.chat_template is None:
            raise InvalidRequest(f"the model at {self.path} has no chat template; use /v1/completions")
        conv = []
        for m in messages:
            if not isinstance(m, Mapping):
                raise InvalidRequest(f"chat messages must be objects, got {type(m).__name__}")
            msg = dict(m)
            if "content" in msg:
                msg["content"] = _flatten_content(msg["content"])
            conv.append(msg)
        try:
            text = self._hf.apply_chat_template(
                conv, add_generation_prompt=add_generation_prompt, tokenize=False, **template_kwargs
            )
        except (TemplateError, TypeError, KeyError, ValueError) as exc:
            # TemplateError covers raise_exception(...) in templates and undefined variables;
            # the others come from templates indexing into malformed messages.
            raise InvalidRequest(f"chat template failed: {exc}") from exc
        if not isinstance(text, str):
            raise InvalidRequest("chat template did not render to a single string")
        return self.encode(text, add_special_tokens=False) if tokenize else text
