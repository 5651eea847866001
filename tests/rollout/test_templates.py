"""Chat-template rendering for multi-turn episodes (services/rollout/templates.py) on the tiny model's
real tokenizer, with its own ChatML template, SmolLM2-135M-Instruct's and Qwen2.5's (which renders
tools itself).

The bridge property: a conversation rendered up to a model turn, plus the tokens the model sampled,
plus the bridge of the environment's messages, is token for token the render of the whole
conversation with the generation prompt.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from services.common.errors import FailedPrecondition, InvalidArgument
from services.rollout.templates import MessageInput, TemplateRenderer, ToolCallInput, sampled_close

# SmolLM2-135M-Instruct's chat template (tokenizer_config.json of HuggingFaceTB/SmolLM2-135M-Instruct):
# ChatML, a default system message, no tools.
SMOLLM2_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
    "<|im_end|>\n' }}"
    "{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# Qwen2.5-Instruct's chat template (hermes-style tools), as released.
QWEN2_5_TEMPLATE = """{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] }}
    {%- else %}
        {{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}
    {%- endif %}
    {{- "\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\nYou are provided with function signatures within <tools></tools> XML tags:\\n<tools>" }}
    {%- for tool in tools %}
        {{- "\\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": <function-name>, \\"arguments\\": <args-json-object>}\\n</tool_call><|im_end|>\\n" }}
{%- else %}
    {%- if messages[0]['role'] == 'system' %}
        {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}
    {%- else %}
        {{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\\n' }}
    {%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content %}
            {{- '\\n' + message.content }}
        {%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {{- '\\n<tool_call>\\n{"name": "' }}
            {{- tool_call.name }}
            {{- '", "arguments": ' }}
            {{- tool_call.arguments | tojson }}
            {{- '}\\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == "tool" %}
        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' }}
        {{- message.content }}
        {{- '\\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""  # noqa: E501

# Re-renders earlier assistant turns depending on what follows (Qwen3-style reasoning stripping, in
# small): not prefix-preserving.
NOT_PREFIX_PRESERVING = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['role'] == 'assistant' and not loop.last %}(earlier){% else %}{{ m['content'] }}{% endif %}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "add",
            "description": "Add two integers.",
            "parameters": {
                "type": "object",
                "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                "required": ["a", "b"],
            },
        },
    }
]
TOOLS_JSON = json.dumps(TOOLS)


def _tokenizer(model_dir: Path, template: str | None):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    if template is not None:
        tokenizer.chat_template = template
    return tokenizer


@pytest.fixture(scope="module", params=["tiny", "smollm2", "qwen2.5"])
def renderer(request, tiny_model_dir: Path) -> TemplateRenderer:
    template = {"tiny": None, "smollm2": SMOLLM2_TEMPLATE, "qwen2.5": QWEN2_5_TEMPLATE}[request.param]
    return TemplateRenderer(_tokenizer(tiny_model_dir, template))


def _ids(renderer: TemplateRenderer, text: str) -> list[int]:
    return renderer._tokenizer(text, add_special_tokens=False)["input_ids"]


def _token(renderer: TemplateRenderer, token: str) -> int:
    return renderer._tokenizer.convert_tokens_to_ids(token)


PROMPT = [MessageInput("system", "You add numbers."), MessageInput("user", "What is 123456+654321?")]
CALL_TEXT = '<tool_call>\n{"name": "add", "arguments": {"a": 123456, "b": 654321}}\n</tool_call>'
CALL = ToolCallInput("call_0_0", "add", '{"a": 123456, "b": 654321}')
# environment turns after a model turn: tool results, a user message, both
ENV_TURNS = [
    [MessageInput("tool", "777777", tool_call_id="call_0_0", name="add")],
    [MessageInput("tool", "777777", tool_call_id="call_0_0"), MessageInput("tool", "error: no b")],
    [MessageInput("user", "Now double it.")],
    [MessageInput("tool", "777777", tool_call_id="call_0_0"), MessageInput("user", "And?")],
]


@pytest.mark.parametrize("env_turn", range(len(ENV_TURNS)))
@pytest.mark.parametrize("ending", ["end_of_turn", "truncated"])
def test_prompt_plus_sampled_turn_plus_bridge_is_the_full_render(
    renderer: TemplateRenderer, env_turn: int, ending: str
) -> None:
    """Two model turns: each time the tokens so far + what the model sampled + the bridge equal the
    render of the whole conversation with the generation prompt, token for token; whether the model
    ended its turn with <|im_end|> or was cut off (then the bridge closes the turn itself)."""
    im_end = _token(renderer, "<|im_end|>")
    messages = list(PROMPT)
    tokens = renderer.conversation(messages, TOOLS_JSON, add_generation_prompt=True)
    for reply in (CALL_TEXT, "The sum is 777777."):
        sampled = _ids(renderer, reply) + ([im_end] if ending == "end_of_turn" else [])
        new = ENV_TURNS[env_turn]
        bridge = renderer.bridge(new, sampled[-4:], TOOLS_JSON, add_generation_prompt=True)
        messages += [MessageInput("assistant", reply), *new]
        tokens = tokens + sampled + bridge
        assert tokens == renderer.conversation(messages, TOOLS_JSON, add_generation_prompt=True)
    # the bridge does not depend on the tools (they live in the system message, never re-rendered)
    assert renderer.bridge(new, [im_end], "", True) == renderer.bridge(new, [im_end], TOOLS_JSON, True)


def test_bridge_adds_only_the_close_the_model_did_not_sample(tiny_model_dir: Path) -> None:
    renderer = TemplateRenderer(_tokenizer(tiny_model_dir, None))
    im_end, newline = _token(renderer, "<|im_end|>"), _ids(renderer, "\n")
    user = [MessageInput("user", "hi")]
    after = _ids(renderer, "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
    assert renderer.bridge(user, [5, im_end], "", True) == newline + after
    assert renderer.bridge(user, [5, 6], "", True) == [im_end, *newline, *after]
    assert renderer.bridge(user, [], "", True) == [im_end, *newline, *after]
    eos = renderer._tokenizer.eos_token_id  # <|endoftext|>: not part of the template's close
    assert renderer.bridge(user, [5, eos], "", True) == [im_end, *newline, *after]
    no_prompt = renderer.bridge(user, [im_end], "", False)
    assert no_prompt == newline + _ids(renderer, "<|im_start|>user\nhi<|im_end|>\n")
    assert sampled_close([1, 2, 3], [3, 4]) == 1
    assert sampled_close([1, 3, 4], [3, 4]) == 2
    assert sampled_close([4], [3, 4]) == 0


def test_templates_that_ignore_tools_render_what_qwen2_5_renders(tiny_model_dir: Path) -> None:
    """The tiny model's and SmolLM2's templates know no tools: with a system message the rollout's
    hermes rendering is token for token Qwen2.5's (tools block, tool calls, tool responses)."""
    qwen = TemplateRenderer(_tokenizer(tiny_model_dir, QWEN2_5_TEMPLATE))
    assert qwen.support() == (True, True)
    conversation = [
        *PROMPT,
        MessageInput("assistant", "", tool_calls=(CALL,)),  # as an OpenAI client sends it back
        MessageInput("tool", "777777", tool_call_id="call_0_0", name="add"),
        MessageInput("tool", "done"),
        MessageInput("assistant", "Let me check.", tool_calls=(CALL,)),
        MessageInput("tool", "777777"),
    ]
    for template in (None, SMOLLM2_TEMPLATE):
        renderer = TemplateRenderer(_tokenizer(tiny_model_dir, template))
        assert renderer.support() == (False, False)
        for add_generation_prompt in (True, False):
            expected = qwen.conversation(conversation, TOOLS_JSON, add_generation_prompt)
            assert renderer.conversation(conversation, TOOLS_JSON, add_generation_prompt) == expected
        text = renderer.decode(renderer.conversation(PROMPT[1:], TOOLS_JSON))
        # no system message: one holding only the tools block is prepended (SmolLM2's default goes)
        assert text.startswith("<|im_start|>system\n# Tools\n\nYou may call one or more functions")
        assert '<tools>\n{"type": "function", "function": {"name": "add"' in text
        assert '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>' in text
        # a model's own turn keeps its tool calls in its text: they are not added twice
        own = [*PROMPT, MessageInput("assistant", CALL_TEXT, tool_calls=(CALL,))]
        rendered = renderer.decode(renderer.conversation(own, TOOLS_JSON, False))
        assert rendered.count('<tool_call>\n{"name": "add"') == 1
        # without tools: the template's own rendering, untouched
        plain = renderer.conversation(PROMPT, "", True)
        hf = [{"role": m.role, "content": m.content} for m in PROMPT]
        own_text = renderer._tokenizer.apply_chat_template(hf, tokenize=False, add_generation_prompt=True)
        assert plain == _ids(renderer, own_text)


def test_a_template_that_rewrites_earlier_turns_has_no_bridge(tiny_model_dir: Path) -> None:
    renderer = TemplateRenderer(_tokenizer(tiny_model_dir, NOT_PREFIX_PRESERVING))
    with pytest.raises(FailedPrecondition, match="not prefix-preserving"):
        renderer.bridge([MessageInput("user", "next")], [], "", True)


def test_a_tokenizer_without_a_chat_template_renders_only_text(tiny_model_dir: Path) -> None:
    tokenizer = _tokenizer(tiny_model_dir, None)
    tokenizer.chat_template = None
    renderer = TemplateRenderer(tokenizer)
    with pytest.raises(FailedPrecondition, match="no chat template"):
        renderer.conversation([MessageInput("user", "hi")])
    assert renderer.text("12+34=") == _ids(renderer, "12+34=")


@pytest.mark.parametrize(
    ("messages", "tools_json", "needle"),
    [
        ([MessageInput("robot", "hi")], "", "messages[0].role must be one of"),
        ([MessageInput("user", "hi")], "[{", "tools_json is not valid JSON"),
        ([MessageInput("user", "hi")], '{"a": 1}', "tools_json must be a JSON array"),
        (
            [MessageInput("assistant", "", tool_calls=(ToolCallInput("c", "add", "{nope"),))],
            "",
            "messages[0].tool_calls[0].arguments_json is not valid JSON",
        ),
        (
            [MessageInput("user", "q"), MessageInput("assistant", "", (ToolCallInput("c", "add", "[1]"),))],
            "",
            "messages[1].tool_calls[0].arguments_json must be a JSON object",
        ),
        (
            [MessageInput("assistant", "", tool_calls=(ToolCallInput("c", "", "{}"),))],
            "",
            "messages[0].tool_calls[0].name is empty",
        ),
    ],
)
def test_bad_messages_are_invalid_arguments(
    tiny_model_dir: Path, messages: list[MessageInput], tools_json: str, needle: str
) -> None:
    renderer = TemplateRenderer(_tokenizer(tiny_model_dir, None))
    for render in (
        lambda: renderer.conversation(messages, tools_json),
        lambda: renderer.bridge(messages, [], tools_json),
    ):
        with pytest.raises(InvalidArgument) as info:
            render()
        assert needle in str(info.value)
