"""Conversations → tokens + loss mask, for supervised fine-tuning (`sb-prep --chat`).

A conversation is rendered by the tokenizer's own chat template (`chat_template.jinja`
beside tokenizer.json, else `chat_template` in tokenizer_config.json), so the text is
the one the model was fine-tuned on: Qwen2.5-Instruct's default system prompt, Llama
3's header and date lines, Qwen3's think block. The template runs in a sandboxed Jinja
environment set up as transformers' `apply_chat_template` sets it up (trim_blocks,
lstrip_blocks, loop controls, its `tojson`, `raise_exception`, `strftime_now`; the
tokenizer's named special tokens as variables), and the whole text is tokenized once
without added special tokens, as `apply_chat_template(tokenize=True)` does.

Targets are what the model generates in each assistant turn: from where the rendered
conversation leaves the prompt that asks for the turn (the messages before it with the
generation prompt; their longest common prefix, as Qwen3 asks with a `<think>` it does
not keep in earlier turns) to the end of the first special token after it, its end of
turn (`<|im_end|>`, `<|eot_id|>`), so the model learns to stop. Everything else, the
prompt included, is context. The loss mask rides with the tokens to the loader, which
sets the other labels to IGNORE_INDEX: TorchTitan's cross-entropy skips them.
"""

from __future__ import annotations

import functools
import json
import os
import re
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer

SPECIAL_TOKEN_NAMES = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)
"""The named special tokens a template sees as variables (transformers' special_tokens_map)."""


class ChatTemplateError(ValueError):
    """No usable chat template; the message names the file."""


@dataclass(frozen=True)
class ChatTemplate:
    source: str
    """The template's text, as the tokenizer folder holds it."""
    variables: dict[str, str]
    end_of_turn: re.Pattern
    """Any special token of the tokenizer: the first after an answer ends it."""

    def render(self, messages: list[dict], add_generation_prompt: bool = False) -> str:
        import jinja2

        try:
            return _compile(self.source).render(
                messages=messages, add_generation_prompt=add_generation_prompt, **self.variables
            )
        except jinja2.TemplateError as e:  # the template's raise_exception, or a bad field
            raise ChatTemplateError(f"the chat template refuses this conversation: {e}") from None

    def target_spans(self, messages: list[dict], text: str) -> list[tuple[int, int]]:
        """Character spans of `text` (the rendered conversation) that are answers."""
        spans = []
        for i, m in enumerate(messages):
            if m["role"] != "assistant":
                continue
            start = _common_prefix(text, self.render(messages[:i], add_generation_prompt=True))
            end = self.end_of_turn.search(text, start)
            spans.append((start, len(text) if end is None else end.end()))
        return spans

    def encode(self, tok: Tokenizer, messages: list[dict]) -> tuple[np.ndarray, np.ndarray]:
        """(token ids, loss mask) of one conversation: a token is a target when it starts
        inside an answer's span."""
        text = self.render(messages)
        enc = tok.encode(text, add_special_tokens=False)
        starts = np.asarray([s for s, _ in enc.offsets], dtype=np.int64)
        mask = np.zeros(len(starts), dtype=bool)
        for a, b in self.target_spans(messages, text):
            mask |= (starts >= a) & (starts < b)
        return np.asarray(enc.ids, dtype=np.int64), mask


def load_chat_template(tokenizer_dir: str | Path, tok: Tokenizer) -> ChatTemplate:
    """The template of the tokenizer in `tokenizer_dir`; ChatTemplateError if it has none."""
    folder = Path(tokenizer_dir)
    config_path = folder / "tokenizer_config.json"
    config = json.loads(config_path.read_text()) if config_path.is_file() else {}
    jinja_file = folder / "chat_template.jinja"
    source = jinja_file.read_text() if jinja_file.is_file() else config.get("chat_template")
    if isinstance(source, list):  # named templates: [{"name": ..., "template": ...}]
        source = next((t["template"] for t in source if t.get("name") == "default"), None)
    if not isinstance(source, str) or not source.strip():
        raise ChatTemplateError(
            f"{config_path}: no chat_template (nor {jinja_file.name}): --chat renders "
            "conversations with the tokenizer's own chat template; use an Instruct model's "
            "tokenizer folder"
        )
    variables = {}
    for name in SPECIAL_TOKEN_NAMES:
        value = config.get(name)
        value = value.get("content") if isinstance(value, dict) else value
        if isinstance(value, str):
            variables[name] = value
    specials = [t.content for t in tok.get_added_tokens_decoder().values() if t.special]
    if not specials:
        raise ChatTemplateError(f"{folder / 'tokenizer.json'}: no special tokens to end a turn")
    pattern = "|".join(re.escape(s) for s in sorted(specials, key=len, reverse=True))
    try:
        _compile(source)
    except Exception as e:  # jinja2.TemplateSyntaxError and its kin
        raise ChatTemplateError(f"{config_path}: chat_template does not parse: {e}") from None
    return ChatTemplate(source, variables, re.compile(pattern))


def _common_prefix(a: str, b: str) -> int:
    return len(os.path.commonprefix([a, b]))


@functools.lru_cache(maxsize=8)
def _compile(source: str):
    """The template in transformers' environment (utils/chat_template_utils.py); compiled
    once per source. `{% generation %}` blocks (transformers' assistant tracker) render
    their body."""
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generation(jinja2.ext.Extension):
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.Scope(body).set_lineno(lineno)

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(
            x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
        )

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[Generation, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(source)
