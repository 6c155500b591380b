"""A model's chat template rendered in the router, as the nodes render it, so chat requests get
token ids for exact cache-aware routing (router/prompt_key.py).

The nodes render with transformers (``common/tokenizer/hf.py``); the router must not import it
(it pulls torch), so this reproduces what transformers' renderer gives a template: Jinja's
immutable sandbox with ``trim_blocks`` and ``lstrip_blocks``, the ``loopcontrols`` extension and a
``{% generation %}`` block that renders its body, a ``tojson`` that does not escape HTML,
``raise_exception`` and ``strftime_now``, and the tokenizer's special tokens (``bos_token``,
``eos_token``, ...) as variables; the messages get the nodes' flattening of OpenAI content parts
(text parts joined by newlines). The node renders with ``add_generation_prompt=True`` and nothing
else (no tools), and so does this.

What it does not reproduce (transformers' finer conversions: reasoning-field aliases, its
namespace and dict guards) can only make a rendering differ, which costs a prediction
(``pdc_router_kv_predictions_total{outcome}``), never an answer: a template that fails here, or
anything it raises, gives the request no token ids, and it is routed by load.
"""
from __future__ import annotations

import json
import os
from collections.abc import Mapping
from datetime import datetime
from typing import Any

_SPECIAL = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


def _token(value: Any) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or an AddedToken dict."""
    if isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        return value["content"]
    return None


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


class ChatTemplate:
    def __init__(self, source: str, special: dict[str, str]) -> None:
        import jinja2
        from jinja2.ext import Extension, loopcontrols
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        class Generation(Extension):
            """``{% generation %}...{% endgeneration %}``: transformers tracks assistant spans with
            it; rendering only needs the body."""

            tags = {"generation"}

            def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
                lineno = next(parser.stream).lineno
                body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
                return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

            def _body(self, caller: Any) -> str:
                return caller()

        def raise_exception(message: str) -> None:
            raise jinja2.exceptions.TemplateError(message)

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[Generation, loopcontrols])
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        self._template = env.from_string(source)
        self._special = special

    @classmethod
    def load(cls, directory: str) -> ChatTemplate | None:
        """The template of a tokenizer directory (``chat_template.jinja``, else tokenizer_config.json's
        ``chat_template``), or None: no template, or jinja2 missing."""
        try:
            import jinja2  # noqa: F401  (only routers that render chat templates need it)
        except ImportError:
            return None
        try:
            with open(os.path.join(directory, "tokenizer_config.json"), encoding="utf-8") as f:
                config = json.load(f)
        except (OSError, ValueError):
            config = {}
        source = None
        path = os.path.join(directory, "chat_template.jinja")
        if os.path.isfile(path):
            with open(path, encoding="utf-8") as f:
                source = f.read()
        elif isinstance(config.get("chat_template"), str):
            source = config["chat_template"]
        elif isinstance(config.get("chat_template"), list):  # named templates: the node uses "default"
            named = {t.get("name"): t.get("template") for t in config["chat_template"] if isinstance(t, dict)}
            source = named.get("default")
        if not isinstance(source, str):
            return None
        special = {k: tok for k in _SPECIAL if (tok := _token(config.get(k))) is not None}
        return cls(source, special)

    def render(self, messages: Any) -> str | None:
        """The prompt text of ``messages`` (OpenAI chat messages), or None where the node would
        refuse them or the template fails."""
        if not isinstance(messages, list):
            return None
        conv = []
        for m in messages:
            if not isinstance(m, Mapping):
                return None
            msg = dict(m)
            content = msg.get("content")
            if isinstance(content, list):
                texts = [p.get("text") for p in content if isinstance(p, Mapping) and p.get("type") == "text"]
                if len(texts) != len(content) or not all(isinstance(t, str) for t in texts):
                    return None  # the node refuses non-text parts
                msg["content"] = "\n".join(texts)  # type: ignore[arg-type]
            conv.append(msg)
        try:
            text = self._template.render(messages=conv, add_generation_prompt=True, **self._special)
        except Exception:  # a template's own error, or one the sandbox raised: no prediction
            return None
        return text if isinstance(text, str) else None
