"""Chat messages -> prompt text, exactly as the model expects.

The tokenizer's own chat template (``tokenizer_config.json``; for GGUF models
``tokenizer.chat_template``) is rendered in a jinja2 sandbox the way transformers'
``apply_chat_template(..., add_generation_prompt=True)`` renders it. A model without a template
(the bundled ``tiny``) gets a documented plain one: '### <Role>:\\n<content>\\n' per message, then
'### Assistant:\\n'.
"""

from __future__ import annotations

from functools import lru_cache


@lru_cache(maxsize=8)
def _compile(template: str):
    from jinja2.exceptions import TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str):
        raise TemplateError(message)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = raise_exception
    return env.from_string(template)


def render_chat(tokenizer, messages: list[dict], add_generation_prompt: bool = True) -> str:
    """The prompt for ``messages`` ([{"role": ..., "content": ...}]) under ``tokenizer``'s template."""
    template = getattr(tokenizer, "chat_template", None)
    if template:
        return _compile(template).render(messages=messages, add_generation_prompt=add_generation_prompt,
                                         **getattr(tokenizer, "special", {}))
    parts = [f"### {m['role'].capitalize()}:\n{m['content']}\n" for m in messages]
    return "".join(parts) + ("### Assistant:\n" if add_generation_prompt else "")
