"""gpt-oss's chat format ("harmony") comes from its tokenizer directory (`chat_template.jinja`),
and our jinja2 environment renders a template of that shape as transformers does: macros, a
`namespace`, `strftime_now`, whitespace control, `tojson`, channels for reasoning (`thinking`)
and final answers, a developer message from the system prompt, tools rendered as a TypeScript
namespace, `reasoning_effort` as a template variable, and the generation prompt.

The real template is not committed; this one (written for the test) uses the same features. The
expected text was also what transformers 5.25's `apply_chat_template` gave for this template.
"""

from __future__ import annotations

import jinja2
import pytest

from checkpoints.hf import load_hf_dir, save_hf_dir
from checkpoints.tiny_random import build_tiny_random
from jaxserve.tokenizer import Tokenizer

HARMONY_TEMPLATE = """
{%- macro render_tools(tools) -%}
namespace functions {
{% for tool in tools %}
{%- set fn = tool.function %}
// {{ fn.description }}
type {{ fn.name }} = (_: {{ fn.parameters.properties | tojson }}) => any;
{% endfor -%}
} // namespace functions
{%- endmacro -%}
{%- set ns = namespace(last_user=-1, developer='') -%}
{%- for message in messages -%}
{%- if message.role == 'user' %}{% set ns.last_user = loop.index0 %}{% endif -%}
{%- if message.role == 'system' %}{% set ns.developer = message.content %}{% endif -%}
{%- endfor -%}
<|start|>system<|message|>Knowledge cutoff: 2024-06
Current date: {{ strftime_now('%Y') | length > 0 and '2026-12-07' }}

Reasoning: {{ reasoning_effort | default('medium') }}

# Valid channels: analysis, commentary, final.<|end|>
{%- if ns.developer or tools -%}
<|start|>developer<|message|>
{%- if ns.developer %}# Instructions

{{ ns.developer }}{% endif %}
{%- if tools %}

# Tools

{{ render_tools(tools) }}{% endif %}<|end|>
{%- endif -%}
{%- for message in messages if message.role != 'system' -%}
{%- if message.role == 'user' -%}
<|start|>user<|message|>{{ message.content }}<|end|>
{%- elif message.role == 'assistant' -%}
{%- if message.thinking and loop.index0 > ns.last_user -%}
<|start|>assistant<|channel|>analysis<|message|>{{ message.thinking }}<|end|>
{%- endif -%}
<|start|>assistant<|channel|>final<|message|>{{ message.content }}{{ '<|return|>' if loop.last else '<|end|>' }}
{%- else -%}
{{ raise_exception('harmony has no role ' ~ message.role) }}
{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}<|start|>assistant{%- endif -%}
"""

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]
MESSAGES = [
    {"role": "system", "content": "Answer briefly."},
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": "Sunny.", "thinking": "Old reasoning, dropped.", "tool_calls": None},
    {"role": "user", "content": "And tomorrow?"},
]
EXPECTED = (
    "<|start|>system<|message|>Knowledge cutoff: 2024-06\nCurrent date: 2026-12-07\n\nReasoning: high\n\n"
    "# Valid channels: analysis, commentary, final.<|end|>"
    "<|start|>developer<|message|># Instructions\n\nAnswer briefly.\n# Tools\n\n"
    "namespace functions {\n// The weather in a city\n"
    'type get_weather = (_: {"city": {"type": "string"}}) => any;\n} // namespace functions<|end|>'
    "<|start|>user<|message|>Weather in Paris?<|end|>"
    "<|start|>assistant<|channel|>final<|message|>Sunny.<|end|>"
    "<|start|>user<|message|>And tomorrow?<|end|>"
    "<|start|>assistant"
)


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory) -> Tokenizer:
    """A tiny gpt-oss directory whose template is in `chat_template.jinja`, as gpt-oss ships it."""
    model = build_tiny_random(family="gpt_oss")
    directory = tmp_path_factory.mktemp("gpt_oss")
    save_hf_dir(model.params, model.config, model.tokenizer_bundle, directory)
    (directory / "chat_template.jinja").write_text(HARMONY_TEMPLATE, encoding="utf-8")
    return Tokenizer(load_hf_dir(directory).tokenizer_bundle)


def test_template_comes_from_the_directory(tokenizer):
    assert tokenizer.bundle.chat_template == HARMONY_TEMPLATE


def test_harmony_template_renders_as_transformers_does(tokenizer):
    text = tokenizer.apply_chat_template(MESSAGES, tools=TOOLS, reasoning_effort="high")
    assert text == EXPECTED


def test_reasoning_after_the_last_user_turn_is_kept(tokenizer):
    messages = [*MESSAGES[1:2], {"role": "assistant", "content": "Sunny.", "reasoning_content": "Look it up."}]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=False)
    assert text.endswith(
        "<|start|>assistant<|channel|>analysis<|message|>Look it up.<|end|>"
        "<|start|>assistant<|channel|>final<|message|>Sunny.<|return|>"
    )
    assert "Reasoning: medium" in text and "developer" not in text


def test_unknown_role_is_the_templates_error(tokenizer):
    with pytest.raises(jinja2.exceptions.TemplateError, match="no role tool"):
        tokenizer.apply_chat_template([{"role": "tool", "content": "{}"}])
