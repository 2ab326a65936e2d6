"""Chat templates out of the box and on the command line (issue 38, item 1): the built-in model and every made
model carry their family's published, tool-capable template; `moerun serve` with no -m answers forced and
automatic tool calls from the `openai` client; `--chat-template NAME|TEMPLATE` and `--chat-template-file FILE`
(`run`, `chat`, `serve`) replace a model's template, and a bad one is a one-line error."""

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import gguf
import jsonschema
import openai
import pytest
from test_server import KEY, MODEL, Server
from transformers.utils.chat_template_utils import render_jinja_template

from moerun.arch import FAMILIES
from moerun.builtin import default_model_path
from moerun.errors import MoerunError
from moerun.formats import open_model
from moerun.server.chat import usable_syntax
from moerun.text import CHATML_TEMPLATE, ChatTemplate, Tokenizer
from moerun.text.templates import TEMPLATES, builtin_template, chat_template_override
from moerun.text.toolcalls import syntax_for
from moerun.tools.make_model import make_model
from moerun.tools.presets import preset
from moerun.tools.tokenizer import FAMILY_TEMPLATES

TESTS_TEMPLATES = Path(__file__).parent / "data" / "templates"
SHIPPED = Path(__file__).resolve().parents[1] / "moerun" / "data" / "templates"
TENSOR_BYTES_SHA256 = "f555231d28a416edd142076e259d12f2dc8479e4e0810361f2ced0b171dca13f"  # moerun/data/README.md
WEATHER = {"type": "object", "additionalProperties": False, "required": ["city", "days"],
           "properties": {"city": {"type": "string", "maxLength": 16},
                          "days": {"type": "integer", "minimum": 1, "maximum": 7}}}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                           "parameters": WEATHER}}]
ASK = [{"role": "user", "content": "What is the weather in Paris for three days?"}]
CHAT = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "name a prime"},
        {"role": "assistant", "content": "7"}, {"role": "user", "content": "another"}]
SPECIALS = {"bos_token": "<|endoftext|>", "eos_token": "<|im_end|>"}  # the built-in model's


# -- the names, the override, the shipped files ------------------------------------------------------------

def test_every_name_is_a_shipped_template_that_compiles_and_is_named_in_the_readme():
    readme = (SHIPPED / "README.md").read_text()
    for name, file in TEMPLATES.items():
        assert (SHIPPED / file).is_file() and f"`{file}`" in readme and f"`{name}`" in readme
        ChatTemplate(builtin_template(name), SPECIALS).render(CHAT, add_generation_prompt=True)
        assert (syntax_for(builtin_template(name)) is None) == (name == "chatml"), name
    assert builtin_template("chatml") == CHATML_TEMPLATE
    assert builtin_template("qwen3") == (TESTS_TEMPLATES / "Qwen-Qwen3-0.6B.jinja").read_text()
    assert builtin_template("glm4") == builtin_template("glm-4.6") == (TESTS_TEMPLATES / "GLM-4.6.jinja").read_text()


def test_override_takes_a_name_a_template_text_or_a_file(tmp_path):
    assert chat_template_override(None, None) is None
    assert chat_template_override("qwen3.5", None) == builtin_template("qwen3.5")
    assert chat_template_override("{{ messages[0].content }}", None) == "{{ messages[0].content }}"
    path = TESTS_TEMPLATES / "deepseek-ai-DeepSeek-V3.1.jinja"
    assert chat_template_override(None, path) == path.read_text()
    (tmp_path / "bad.jinja").write_text("{% for m in messages %}")
    for args, phrase in [
        (("qwen4", None), "'qwen4' is not a built-in template name (known: chatml, qwen3,"),
        (("x.jinja", None), "--chat-template-file FILE reads a template from a file"),
        (("{% if %}", None), "--chat-template: the chat template does not compile (line 1)"),
        ((None, tmp_path / "nothing.jinja"), "nothing.jinja: no such file"),
        ((None, tmp_path / "bad.jinja"), "bad.jinja: the chat template does not compile"),
        ((None, tmp_path), "cannot read it"),
        (("qwen3", path), "give --chat-template or --chat-template-file, not both"),
    ]:
        with pytest.raises(MoerunError) as e:
            chat_template_override(*args)
        assert phrase in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_the_built_in_model_carries_qwen3s_template_and_the_same_tensors():
    """Only tokenizer.chat_template changed in the shipped file: its tensors are byte for byte the trained ones,
    and the tool-call and reasoning syntaxes of the new template are found and usable with its vocabulary."""
    reader = gguf.GGUFReader(str(default_model_path()))
    h = hashlib.sha256()
    for t in reader.tensors:
        h.update(t.data.tobytes())
    assert h.hexdigest() == TENSOR_BYTES_SHA256
    assert reader.fields["tokenizer.chat_template"].contents() == builtin_template("qwen3")
    with open_model(default_model_path()) as mf:
        tok = Tokenizer.from_model_file(mf)
    template = ChatTemplate.for_tokenizer(tok)
    tools = syntax_for(template.source)
    assert tools is not None and tools.name == "hermes" and all(map(tok.renders, tools.markers))
    assert usable_syntax(template, tok, "auto").name == "think" and usable_syntax(template, tok, "none") is None
    assert not usable_syntax(ChatTemplate.for_tokenizer(tok, source=CHATML_TEMPLATE), tok, "auto")


def test_every_family_has_a_template_and_made_models_carry_it(tmp_path):
    assert set(FAMILY_TEMPLATES) == set(FAMILIES) and set(FAMILY_TEMPLATES.values()) <= set(TEMPLATES)
    for name in ("tiny-qwen3moe", "tiny-mixtral", "tiny-olmoe", "tiny-glm4moe", "tiny-deepseek3", "tiny-gptoss",
                 "tiny-qwen35moe"):
        with open_model(make_model(name, tmp_path / f"{name}.gguf", progress=False, threads=1)) as mf:
            tok = Tokenizer.from_model_file(mf)
        assert tok.chat_template == builtin_template(FAMILY_TEMPLATES[preset(name).family]), name
        assert syntax_for(tok.chat_template) is not None
        ChatTemplate.for_tokenizer(tok).render(ASK, add_generation_prompt=True, tools=TOOLS)


# -- the command line ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("args,phrase", [
    (("serve", "--chat-template", "no-such-template"), "'no-such-template' is not a built-in template name"),
    (("run", "-p", "x", "--chat-template-file", "/no/such/template.jinja"), "no such file"),
    (("chat", "--chat-template", "{% for %}"), "the chat template does not compile"),
    (("serve", "--chat-template", "qwen3", "--chat-template-file", str(TESTS_TEMPLATES / "GLM-4.6.jinja")),
     "not both"),
])
def test_a_bad_template_is_a_one_line_error(args, phrase):
    r = subprocess.run([sys.executable, "-m", "moerun", *args], capture_output=True, text=True, timeout=120,
                       check=False, stdin=subprocess.DEVNULL)
    assert r.returncode == 1 and "Traceback" not in r.stderr and phrase in r.stderr, r.stderr
    assert r.stderr.startswith("error: ") and len(r.stderr.strip().splitlines()) == 1


def test_run_with_a_template_completes_the_prompt_as_one_user_turn():
    r = subprocess.run([sys.executable, "-m", "moerun", "run", "-p", "write a loop", "-n", "2", "--temp", "0",
                        "--json", "--jinja", "--chat-template", "chatml"], capture_output=True, text=True,
                       timeout=120, check=True)
    assert json.loads(r.stdout)["prompt"] == "<|im_start|>user\nwrite a loop<|im_end|>\n<|im_start|>assistant\n"


# -- serve ------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def server(tmp_path_factory):
    s = Server(tmp_path_factory.mktemp("serve-templates"), "-c", "2048")  # no -m: the built-in model
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=120)


def test_the_built_in_model_answers_a_forced_tool_call(client):
    named = {"type": "function", "function": {"name": "get_weather"}}
    for seed, choice in enumerate([named, "required"]):
        r = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice=choice, seed=seed,
                                           temperature=1.0, max_tokens=80, parallel_tool_calls=False)
        c = r.choices[0]
        assert c.finish_reason == "tool_calls" and len(c.message.tool_calls) == 1, c
        call = c.message.tool_calls[0].function
        assert call.name == "get_weather"
        jsonschema.validate(json.loads(call.arguments), WEATHER)


def test_tool_choice_auto_gives_text_or_a_valid_call(client):
    for seed in range(3):
        r = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="auto", seed=seed,
                                           temperature=1.0, max_tokens=40)
        c = r.choices[0]
        if c.message.tool_calls:
            assert c.finish_reason == "tool_calls"
            for t in c.message.tool_calls:
                assert t.function.name == "get_weather" and isinstance(json.loads(t.function.arguments), dict)
        else:
            assert c.finish_reason in ("stop", "length") and c.message.content is not None


def _apply(server, messages=CHAT) -> str:
    r = server.http("POST", "/apply-template", {"messages": messages})
    assert r.status_code == 200, r.text
    return r.json()["prompt"]


def test_template_flags_change_the_prompt_apply_template_returns(server, tmp_path):
    """The default is Qwen3's template; --chat-template-file with GLM-4.6's published template gives GLM's prompt,
    as transformers renders it; --chat-template chatml gives ChatML's, and with it tools are refused."""
    default = _apply(server)
    ref = render_jinja_template(conversations=[CHAT], chat_template=builtin_template("qwen3"),
                                add_generation_prompt=True)[0][0]
    assert default == ref and default.endswith("<|im_start|>assistant\n")
    glm_file = TESTS_TEMPLATES / "GLM-4.6.jinja"
    (tmp_path / "glm").mkdir()
    (tmp_path / "chatml").mkdir()
    glm = Server(tmp_path / "glm", "--chat-template-file", glm_file)
    try:
        prompt = _apply(glm)
        assert prompt != default and prompt.startswith("[gMASK]<sop>") and prompt.endswith("<|assistant|>")
        assert prompt == render_jinja_template(conversations=[CHAT], chat_template=glm_file.read_text(),
                                               add_generation_prompt=True)[0][0]
        assert glm.http("GET", "/props").json()["chat_template"] == glm_file.read_text()
    finally:
        glm.stop()
    chatml = Server(tmp_path / "chatml", "--chat-template", "chatml", "--jinja")
    try:
        assert _apply(chatml) == ChatTemplate(CHATML_TEMPLATE).render(CHAT, add_generation_prompt=True)
        r = chatml.http("POST", "/v1/chat/completions", {"model": MODEL, "messages": ASK, "tools": TOOLS,
                                                          "max_tokens": 4})
        assert r.status_code == 400 and "renders no tool calls" in r.json()["error"]["message"]
    finally:
        chatml.stop()
