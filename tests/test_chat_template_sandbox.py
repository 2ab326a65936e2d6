"""Chat templates come from model files: templates reaching for Python internals, or trying to run forever or
allocate without bound, end in ChatTemplateError (a MoerunError) without executing anything. No test here
times a render: the step tests run with no wall-clock limit (the step count alone must stop them) and the one
deadline test sets a limit that any machine, however loaded, goes past."""

from __future__ import annotations

import resource
import sys
import tracemalloc
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from moerun.errors import MoerunError
from moerun.text.chat import CHATML_TEMPLATE, ChatTemplate, ChatTemplateError
from moerun.text.template_limits import Limits

MESSAGES = [{"role": "user", "content": "hi"}]
NO_DEADLINE = float("inf")  # max_seconds for the step tests: only the step count may stop the template


@pytest.fixture(autouse=True, scope="module")
def _address_space_cap():
    """A template that gets past the limits fails with MemoryError here instead of exhausting the machine."""
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    vm = next(int(line.split()[1]) * 1024 for line in Path("/proc/self/status").read_text().splitlines()
              if line.startswith("VmSize:"))
    resource.setrlimit(resource.RLIMIT_AS, (vm + 2 * 2**30, hard))
    yield
    resource.setrlimit(resource.RLIMIT_AS, (soft, hard))


def _fails(source: str, phrase: str, limits: Limits | None = None) -> str:
    tracemalloc.start()
    try:
        with pytest.raises(ChatTemplateError) as info:
            ChatTemplate(source, limits=limits).render(MESSAGES)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    msg = str(info.value)
    assert isinstance(info.value, MoerunError) and "\n" not in msg
    assert phrase in msg, msg
    assert peak < 256 * 2**20, f"peak {peak >> 20} MiB"
    return msg


@pytest.mark.parametrize("source", [
    "{{ ''.__class__.__mro__ }}",
    "{{ ''.__class__.__mro__[1].__subclasses__() }}",
    "{{ cycler.__init__.__globals__ }}",
    "{{ cycler.__init__.__globals__.os.system('true') }}",
    "{{ joiner.__init__.__globals__ }}",
    "{{ lipsum.__globals__['os'] }}",
    "{{ namespace.__init__.__globals__ }}",
    "{{ raise_exception.__globals__ }}",
    "{{ strftime_now.__globals__ }}",
    "{{ self._TemplateReference__context }}",
    "{{ self._TemplateReference__context.environment }}",
    "{{ dict.__class__.__subclasses__() }}",
    "{{ ''|attr('__class__') }}",
    "{{ ''['__class__'] }}",
    "{{ '{0.__class__}'.format('') }}",
    "{{ '{x.__class__.__mro__}'.format_map({'x': ''}) }}",
    "{{ messages|map(attribute='__class__')|list }}",
    "{{ messages|sort(attribute='__class__.__subclasses__') }}",
    "{% for m in messages %}{{ loop.__class__ }}{% endfor %}",
    "{{ (messages|first).__class__.__subclasses__() }}",
    "{{ messages.append(1) }}",
    "{{ (messages|first).update({'role': 'system'}) }}",
    "{% set ns = namespace() %}{% set ns._secret = 1 %}",
])
def test_python_internals_are_out_of_reach(source):
    _fails(source, "sandbox forbids")


def test_a_sandbox_escape_runs_nothing(tmp_path):
    marker = tmp_path / "pwned"
    source = "{{ cycler.__init__.__globals__.os.system('touch " + str(marker) + "') }}"
    _fails(source, "sandbox forbids")
    assert not marker.exists()


@pytest.mark.parametrize("source", ["{% include '/etc/passwd' %}", "{% import 'os' as os %}{{ os }}",
                                    "{% extends '/etc/passwd' %}", "{% from 'x' import y %}"])
def test_no_file_access(source):
    msg = _fails(source, "the chat template failed")
    assert "root:" not in msg


@pytest.mark.parametrize("source, phrase", [
    ("{% for i in range(10**9) %}{% endfor %}", "Range too big"),
    ("{% for i in range(1000) %}{% for j in range(1000) %}{% endfor %}{% endfor %}", "steps"),
    ("{% for i in range(1000) %}{% for j in range(1000) %}{{ j }}{% endfor %}{% endfor %}", "steps"),
    (("{% set ns = namespace(n=0) %}{% for i in range(999) %}{% for j in range(999) %}"
      "{% set ns.n = ns.n + 1 %}{% endfor %}{% endfor %}"), "steps"),
])
def test_long_loops_stop(source, phrase):
    # 3 to 5 million template lines each, over 15 times the limit, and no deadline: the step count alone
    # stops them, however slow the machine (and without it they would end, unstopped, in a few seconds)
    msg = _fails(source, phrase, Limits(max_steps=200_000, max_seconds=NO_DEADLINE))
    if phrase == "steps":
        assert "more than 200000 steps" in msg, msg


def test_long_loops_stop_by_default():
    # the default limits: 5 million steps or 5 s, whichever comes first on this machine ("the template ran
    # more than ... steps" or "the template ran longer than ... s"); either way it stops
    _fails("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
           "the template ran")


def test_deadline():
    # the wall-clock limit alone (steps unbounded): 1 ms against 3 million template lines, which no
    # machine runs in 1 ms, so the deadline fires; were it ignored, the loop would end and nothing be raised
    _fails("{% for i in range(1000) %}{% for j in range(1000) %}{% endfor %}{% endfor %}",
           "longer than 0.001 s", Limits(max_steps=10**12, max_seconds=0.001))


@pytest.mark.parametrize("source", [
    "{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}",
    "{% macro f(n) %}{% for m in [n] recursive %}{{ loop([m]) }}{% endfor %}{% endmacro %}{{ f(0) }}",
    "{% for m in [1] recursive %}{{ loop([m]) }}{% endfor %}",
])
def test_recursion_stops(source):
    _fails(source, "recursed too deeply")


@pytest.mark.parametrize("source", [
    "{{ 'a' * 10**10 }}",
    "{{ 10**10 * 'a' }}",
    "{{ ([1] * 10**10)|length }}",
    "{{ 9 ** 999999999 }}",
    "{% set ns = namespace(x=10) %}{% for i in range(40) %}{% set ns.x = ns.x * ns.x %}{% endfor %}",
    "{% set ns = namespace(s='ab') %}{% for i in range(60) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}",
    "{% set ns = namespace(s='ab') %}{% for i in range(60) %}{% set ns.s = ns.s + ns.s %}{% endfor %}",
    "{% set ns = namespace(l=[1]) %}{% for i in range(60) %}{% set ns.l = ns.l + ns.l %}{% endfor %}",
    "{% set s = 'x' * 1000000 %}{{ ''.join([s] * 1000) }}",
    "{% set s = ['x'] * 1000000 %}{{ ([s] * 1000)|sum(start=[])|length }}",
    "{% set s = 'x' * 1000000 %}{{ ([s] * 1000)|join }}",
    "{% set s = 'x' * 1000000 %}{% for i in range(1000) %}{{ s }}{% endfor %}",
    "{% macro m() %}{% for i in range(100) %}{{ 'x' * 1000000 }}{% endfor %}{% endmacro %}{{ m()|length }}",
    "{{ ('a' * 100000).replace('a', 'a' * 100000) }}",
    "{{ ''.ljust(10**10) }}",
    "{{ ''.center(10**10) }}",
    "{{ ''.zfill(10**10) }}",
    "{{ '\t'.expandtabs(10**10) }}",
    "{{ '%10000000000d' % 1 }}",
    "{{ '%*d' % (10**10, 1) }}",
    "{{ '{:10000000000}'.format(1) }}",
    "{{ '{x:>10000000000}'.format_map({'x': 1}) }}",
    "{{ ''|center(10**10) }}",
    "{{ 'a\nb'|indent(10**10) }}",
    "{{ '%10000000000d'|format(1) }}",
    "{{ [1]|batch(10**10, 0)|list }}",
    "{{ messages|tojson(indent=10**10) }}",
])
def test_allocations_are_bounded(source):
    _fails(source, "resource limit")


def test_limits_leave_real_templates_alone():
    chat = [{"role": "user" if i % 2 == 0 else "assistant", "content": f"message {i} " * 50} for i in range(2000)]
    text = ChatTemplate(CHATML_TEMPLATE).render(chat, add_generation_prompt=True)
    assert text.count("<|im_start|>") == 2001 and text.endswith("<|im_start|>assistant\n")


def test_limits_apply_per_render_and_restore_the_tracer():
    before = sys.gettrace()
    tmpl = ChatTemplate("{% for i in range(1000) %}{{ i }}{% endfor %}",
                        limits=Limits(max_steps=20_000, max_seconds=NO_DEADLINE))
    for _ in range(50):
        assert tmpl.render(MESSAGES).endswith("999")
    assert sys.gettrace() is before


def test_limits_hold_in_worker_threads():
    source = "{% for i in range(1000) %}{% for j in range(1000) %}{% endfor %}{% endfor %}"  # 3 million steps
    tmpl = ChatTemplate(source, limits=Limits(max_steps=100_000, max_seconds=NO_DEADLINE))
    with ThreadPoolExecutor(2) as pool:
        futures = [pool.submit(tmpl.render, MESSAGES) for _ in range(2)]
        for f in futures:
            with pytest.raises(ChatTemplateError, match="steps"):
                f.result(timeout=300)  # a hang guard only
