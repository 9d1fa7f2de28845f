"""Chat conversations -> text, and which characters of it are the assistant's (the trained ones).

A conversation is a list of `{"role": ..., "content": ...}` messages. It is rendered with the
model's chat template (the Jinja template of `tokenizer_config.json` or `chat_template.jinja`,
run by `jinja2` in a sandbox, with the variables and helpers Hugging Face templates expect:
`messages`, `add_generation_prompt`, the special tokens, `raise_exception`, `tojson`,
`strftime_now`, `{% generation %}` blocks). Without a template, or without `jinja2`, the built-in
ChatML layout is used:

    <|im_start|>{role}\\n{content}<|im_end|>\\n      per message
    <|im_start|>assistant\\n                        the generation prompt

Assistant turns are found by rendering incrementally: for assistant message k, the text of
messages[:k] with the generation prompt is where its turn starts, and the text of messages[:k+1]
is where it ends; the span between (its content and the end-of-turn marker) is trained. A
template that does not render a conversation as a growing prefix is refused.
"""
from __future__ import annotations

import functools
import json
import logging
from datetime import datetime
from importlib.util import find_spec

from ..errors import TesseraError

log = logging.getLogger(__name__)

ROLES = ("system", "user", "assistant", "tool")


def check_messages(messages: object, where: str) -> list[dict]:
    """The messages of one sample, or a one-line TesseraError naming `where` (file:line)."""
    if not isinstance(messages, list) or not messages:
        raise TesseraError(f"{where}: \"messages\" must be a non-empty list of {{role, content}} objects")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise TesseraError(f"{where}: message {i} needs a string \"role\" and a string \"content\"")
        if m["role"] not in ROLES:
            raise TesseraError(f"{where}: message {i} has role {m['role']!r}; expected one of {', '.join(ROLES)}")
    if not any(m["role"] == "assistant" for m in messages):
        raise TesseraError(f"{where}: the conversation has no assistant turn, so it has nothing to train on")
    return messages


def render_chatml(messages: list[dict], add_generation_prompt: bool = False) -> str:
    text = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)
    return text + ("<|im_start|>assistant\n" if add_generation_prompt else "")


def jinja_available() -> bool:
    return find_spec("jinja2") is not None


@functools.lru_cache(maxsize=8)
def _compiled(template: str):
    import jinja2
    from jinja2.ext import Extension, loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generation(Extension):
        """`{% generation %}...{% endgeneration %}` marks assistant text in some templates: render the body."""

        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.Scope(body, lineno=lineno)

    def raise_exception(message):
        raise TesseraError(f"the chat template refused the conversation: {message}")

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[Generation, loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    try:
        return env.from_string(template)
    except jinja2.TemplateError as e:
        raise TesseraError(f"the chat template does not parse ({e})") from None


class ChatRenderer:
    """Renders conversations with a template (None: the built-in ChatML layout)."""

    def __init__(self, template: str | None, special_tokens: dict[str, str] | None = None):
        if template is not None and not jinja_available():
            log.warning("jinja2 is not installed: the model's chat template is replaced by the built-in ChatML layout")
            template = None
        self.template = template
        self.special_tokens = {k: v for k, v in (special_tokens or {}).items() if v is not None}

    def render(self, messages: list[dict], add_generation_prompt: bool = False) -> str:
        if self.template is None:
            return render_chatml(messages, add_generation_prompt)
        import jinja2

        try:
            return _compiled(self.template).render(messages=messages, add_generation_prompt=add_generation_prompt,
                                                   **self.special_tokens)
        except jinja2.TemplateError as e:
            raise TesseraError(f"the chat template failed ({e})") from None

    def render_with_spans(self, messages: list[dict], where: str = "conversation") -> tuple[str, list[tuple[int, int]]]:
        """(text, [(start, end) character span of each assistant turn])."""
        try:
            return self._render_with_spans(messages, where)
        except TesseraError as e:
            raise TesseraError(str(e) if str(e).startswith(where) else f"{where}: {e}") from None

    def _render_with_spans(self, messages: list[dict], where: str) -> tuple[str, list[tuple[int, int]]]:
        text = self.render(messages)
        spans = []
        for k, m in enumerate(messages):
            if m["role"] != "assistant":
                continue
            try:
                prefix = self.render(messages[:k], add_generation_prompt=True)
            except TesseraError:
                if k:
                    raise
                prefix = ""  # a conversation that opens with the assistant: some templates refuse []
            upto = self.render(messages[:k + 1])
            if not (upto.startswith(prefix) and text.startswith(upto)):
                raise TesseraError(f"{where}: the chat template does not render the conversation as a growing "
                                   "prefix, so its assistant turns cannot be located")
            if len(upto) > len(prefix):
                spans.append((len(prefix), len(upto)))
        return text, spans
