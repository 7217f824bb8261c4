"""The GGUF's chat template renders like llama-cpp-python's formatter, and inside a sandbox."""
import pytest
from llama_cpp.llama_chat_format import Jinja2ChatFormatter

from core.chat_template import ChatTemplate
from models.errors import BadInputError
from models.gguf_file import open_model

MESSAGES = [
    {"role": "system", "content": "You are a terse assistant."},
    {"role": "user", "content": "What is 2+2?"},
    {"role": "assistant", "content": "4"},
    {"role": "user", "content": "Привет! And in Russian?"},
]


def test_real_template_matches_llama_cpp_python(qwen_path):
    source = open_model(qwen_path).chat_template
    ours = ChatTemplate(source, "", "<|im_end|>").render(MESSAGES)
    theirs = Jinja2ChatFormatter(source, eos_token="<|im_end|>", bos_token="").__call__(messages=MESSAGES).prompt
    assert ours == theirs
    assert ours.endswith("<|im_start|>assistant\n")


def test_default_system_prompt_without_one(qwen_path):
    source = open_model(qwen_path).chat_template
    text = ChatTemplate(source).render([{"role": "user", "content": "hi"}])
    assert text.startswith("<|im_start|>system\n") and "<|im_start|>user\nhi<|im_end|>" in text


@pytest.mark.parametrize("evil", [
    "{{ ''.__class__.__mro__ }}",
    "{{ ''.__class__.__mro__[1].__subclasses__() }}",
    "{{ messages.__class__.__init__.__globals__ }}",
    "{% for c in ().__class__.__base__.__subclasses__() %}{{ c }}{% endfor %}",
    "{{ cycler.__init__.__globals__.os.popen('echo pwned').read() }}",
])
def test_sandbox_stops_reaching_into_python(evil):
    with pytest.raises(BadInputError, match="unsafe|failed"):
        ChatTemplate(evil).render([{"role": "user", "content": "x"}])


def test_template_cannot_mutate_messages():
    template = ChatTemplate("{% set _ = messages.append({'role': 'x'}) %}{{ messages|length }}")
    with pytest.raises(BadInputError):
        template.render([{"role": "user", "content": "x"}])


def test_raise_exception_is_a_clear_error():
    template = ChatTemplate("{{ raise_exception('roles must alternate') }}")
    with pytest.raises(BadInputError, match="roles must alternate"):
        template.render([{"role": "user", "content": "x"}])


def test_broken_template_is_bad_input():
    with pytest.raises(BadInputError, match="does not parse"):
        ChatTemplate("{% for %}")


# Gemma 2's template, as its GGUF files carry it: a system message raises.
GEMMA2_TEMPLATE = (
    "{{ bos_token }}{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}{% endif %}"
    "{% for message in messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if (message['role'] == 'assistant') %}{% set role = 'model' %}{% else %}{% set role = message['role'] %}{% endif %}"
    "{{ '<start_of_turn>' + role + '\\n' + message['content'] | trim + '<end_of_turn>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{'<start_of_turn>model\\n'}}{% endif %}")


def test_a_system_message_the_template_refuses_joins_the_first_user_message():
    """As llama.cpp's chat code does for a template that cannot show a system message (Gemma 2's
    raises on one): its text goes in front of the next message's, joined by a newline."""
    template = ChatTemplate(GEMMA2_TEMPLATE, "<bos>")
    assert not template.supports_system_role
    assert template.render(MESSAGES) == (
        "<bos><start_of_turn>user\nYou are a terse assistant.\nWhat is 2+2?<end_of_turn>\n"
        "<start_of_turn>model\n4<end_of_turn>\n<start_of_turn>user\nПривет! And in Russian?<end_of_turn>\n"
        "<start_of_turn>model\n")
    assert template.render(MESSAGES[1:]) == template.render(MESSAGES).replace("You are a terse assistant.\n", "")


def test_a_template_that_shows_system_messages_gets_them_as_they_are(qwen_path):
    template = ChatTemplate(open_model(qwen_path).chat_template, "", "<|im_end|>")
    assert template.supports_system_role
    assert template.render(MESSAGES).startswith("<|im_start|>system\nYou are a terse assistant.<|im_end|>\n")


def test_a_template_that_drops_system_messages_gets_the_text_in_the_user_message():
    """A template that skips system messages (no error) cannot show one either; a system message
    alone is dropped, as llama.cpp drops it."""
    template = ChatTemplate("{% for m in messages %}{% if m.role != 'system' %}[{{ m.role }}] {{ m.content }}\n"
                            "{% endif %}{% endfor %}{% if add_generation_prompt %}[assistant] {% endif %}")
    assert not template.supports_system_role
    assert template.render(MESSAGES[:2]) == "[user] You are a terse assistant.\nWhat is 2+2?\n[assistant] "
    assert template.render(MESSAGES[:1]) == "[assistant] "
