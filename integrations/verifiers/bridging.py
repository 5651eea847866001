"""A renderer that bridges turns for any chat template, so multi-turn verifiers rollouts stay token-exact.

verifiers' train client builds a later turn's prompt with `renderer.bridge_to_next_turn(prev_prompt,
prev_completion, new_messages)`: the earlier prompt and the sampled completion verbatim, then the tokens
the new messages add. renderers ships hand-written bridges only for the model families it knows; its
`default` renderer (any other model: the tiny test model, SmolLM2) returns None, verifiers re-renders
the whole history, the sampled completion tokenizes differently, and the runner must refuse the
rollout (`sequences.py`: `not_token_exact`).

`BridgingRenderer` is renderers' `DefaultRenderer` (full renders from the model's own chat template,
or `chat_template` from the config) plus a bridge derived from that template, registered through
renderers' own extension point (`CustomRendererConfig`, `import_path`):

- render a probe conversation [user, assistant "<marker>"] and read what the template writes after the
  assistant's content: when it starts with a special token (ChatML's `<|im_end|>`), that token is the
  turn's close, which the model itself samples to end its turn;
- render the probe + `new_messages` (with the generation prompt) and take the text after the close,
  message by message (each must extend the previous render, else None: the template is not
  prefix-stable there and verifiers falls back to a full render);
- the bridge is prev_prompt + prev_completion (verbatim) + the close (only when the completion does not
  already end with it: a reply cut at max_tokens or ended by another stop token) + those tokens;
- a template that raises on the probe (or on the new messages after it) gets no bridge: None, as
  from DefaultRenderer.

The close is also a stop token (`get_stop_token_ids`), so a chat-template turn ends where the template
ends it. New assistant messages are refused (they would re-tokenize sampled content), as renderers'
own bridges do.
"""

from __future__ import annotations

import itertools
from typing import Any

from renderers.base import RenderedTokens, extract_message_tool_names
from renderers.configs import DefaultRendererConfig
from renderers.default import DefaultRenderer

_USER = "\u2063bridge-probe-user\u2063"
_ASSISTANT = "\u2063bridge-probe-assistant\u2063"


class BridgingRendererConfig(DefaultRendererConfig):
    """DefaultRenderer's config (Jinja kwargs such as `chat_template` pass through to the template)."""


class BridgingRenderer(DefaultRenderer):
    """DefaultRenderer whose turns bridge: see the module docstring."""

    config_class = BridgingRendererConfig

    def __init__(self, tokenizer: Any, config: BridgingRendererConfig | None = None) -> None:
        super().__init__(tokenizer, config or BridgingRendererConfig())
        self.close_ids: list[int] = []
        self.close_text = ""
        try:
            after = self._after_probe([], add_generation_prompt=False)
        except Exception:  # a template that refuses the probe: full renders only, as DefaultRenderer
            self.bridges = False
            return
        self.bridges = True
        first = self._encode(after)[:1]
        special = set(getattr(tokenizer, "all_special_ids", []) or []) | set(
            getattr(tokenizer, "added_tokens_decoder", {}) or {}
        )
        self.close_ids = first if first and first[0] in special else []
        self.close_text = tokenizer.decode(self.close_ids) if self.close_ids else ""
        if not after.startswith(self.close_text):
            self.close_ids, self.close_text = [], ""  # a close that is not a text prefix: no close

    def get_stop_token_ids(self) -> list[int]:
        stops = super().get_stop_token_ids()
        return stops + [t for t in self.close_ids if t not in stops]

    def bridge_to_next_turn(
        self,
        previous_prompt_ids: list[int],
        previous_completion_ids: list[int],
        new_messages: list[Any],
        *,
        tools: list[Any] | None = None,
        **_: Any,
    ) -> RenderedTokens | None:
        if not self.bridges or not new_messages or any(m.get("role") == "assistant" for m in new_messages):
            return None
        try:
            texts = [self._after_probe(new_messages[:k], add_generation_prompt=False, tools=tools)
                     for k in range(len(new_messages) + 1)]  # fmt: skip
            texts.append(self._after_probe(new_messages, add_generation_prompt=True, tools=tools))
        except Exception:  # the template refuses these messages after the probe: verifiers re-renders
            return None
        if not all(text.startswith(self.close_text) for text in texts):
            return None
        texts = [text[len(self.close_text) :] for text in texts]
        if any(not later.startswith(earlier) for earlier, later in itertools.pairwise(texts)):
            return None
        prior = list(previous_prompt_ids) + list(previous_completion_ids)
        n = len(self.close_ids)
        if n and list(previous_completion_ids[-n:]) != self.close_ids:
            prior += self.close_ids  # the turn was cut short: close it as the template does
        token_ids, indices = list(prior), [-1] * len(prior)
        # texts[0]: what follows the close before the first new message (scaffold); then one piece per
        # new message; the last piece is the generation prompt (scaffold)
        pieces = [texts[0]] + [later[len(earlier) :] for earlier, later in itertools.pairwise(texts)]
        owners = [-1, *range(len(new_messages)), -1]
        for piece, owner in zip(pieces, owners, strict=True):
            ids = self._encode(piece)
            token_ids += ids
            indices += [owner] * len(ids)
        return RenderedTokens(
            token_ids=token_ids,
            message_indices=indices,
            sampled_mask=[False] * len(token_ids),
            message_roles=[m.get("role") or "" for m in new_messages],
            message_tool_names=extract_message_tool_names(new_messages),
        )

    def _after_probe(self, messages: list[Any], *, add_generation_prompt: bool, tools: Any = None) -> str:
        """The template's text after the probe assistant's content, for the probe + `messages`."""
        probe = [{"role": "user", "content": _USER}, {"role": "assistant", "content": _ASSISTANT}]
        kwargs = dict(self.config.model_extra or {})
        if tools is not None:
            kwargs["tools"] = tools
        text = self._tokenizer.apply_chat_template(
            probe + list(messages), tokenize=False, add_generation_prompt=add_generation_prompt, **kwargs
        )
        return text[text.index(_ASSISTANT) + len(_ASSISTANT) :]

    def _encode(self, text: str) -> list[int]:
        return list(self._tokenizer.encode(text, add_special_tokens=False)) if text else []
