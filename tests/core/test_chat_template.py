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
