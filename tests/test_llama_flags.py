"""llama.cpp's flags (issue 39, item 1): each flag of moerun.cli_flags.LLAMA_FLAGS goes through the command
line parser and sets what the table says; multi-letter short flags are read whole (-ngl 99 is not -n gl); README's
table is the table; a llama.cpp command line for a MoE model runs here on the CPU with at most notes."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import click
import pytest
from click.testing import CliRunner

from moerun import cli_flags, cli_generate, cli_serve
from moerun.builtin import default_model_path
from moerun.cli import main
from moerun.cli_flags import ALL, LLAMA_FLAGS, UNTIL_END, readme_table

README = Path(__file__).resolve().parents[1] / "README.md"
MODEL = str(default_model_path())


class Stop(Exception):
    """Raised where the command would start loading the model: the settings are made by then."""


@dataclass
class Seen:
    """What a command line set: its parsed options, and for run, chat and serve the RuntimeConfig, the
    SamplingParams and serve's address, with the notes on stderr."""

    params: dict
    cfg: object = None
    sampling: object = None
    listen: tuple | None = None
    stderr: str = ""
    notes: list[str] = field(default_factory=list)


def parse(*argv: str) -> dict:
    """The options `moerun ARGV` parses into, through the group (which reads multi-letter flags whole)."""
    name, cmd, rest = main.resolve_command(click.Context(main, info_name="moerun"), list(argv))
    return cmd.make_context(name, rest, parent=click.Context(main, info_name="moerun")).params


@pytest.fixture
def settings(monkeypatch):
    """settings(*argv) -> Seen: the command run up to where it would load the model."""

    def run(*argv: str) -> Seen:
        seen = Seen(parse(*argv))
        real_rc, real_sp = cli_generate.runtime_config, cli_generate.sampling_params

        def rc(kw):
            out = real_rc(kw)
            seen.cfg = out[0]
            return out

        def sp(kw, *a, **k):
            seen.sampling = real_sp(kw, *a, **k)
            return seen.sampling

        def build(cfg, print_plan):
            seen.cfg = cfg
            raise Stop

        def listen(host, port):
            seen.listen = (host, port)
            raise Stop

        for mod in (cli_generate, cli_serve):
            monkeypatch.setattr(mod, "runtime_config", rc)
            monkeypatch.setattr(mod, "sampling_params", sp)
        monkeypatch.setattr(cli_generate, "_build", build)
        monkeypatch.setattr(cli_serve, "listen", listen)
        r = CliRunner().invoke(main, list(argv), input="")
        assert isinstance(r.exception, Stop), (argv, r.output)
        seen.stderr = r.stderr
        seen.notes = [line for line in r.stderr.splitlines() if line.startswith("note: ")]
        return seen

    return run


@pytest.fixture
def no_gpu(monkeypatch):
    monkeypatch.setattr(cli_flags, "find_gpus", lambda: ())


# -- each flag of the table, through the parser -----------------------------------------------------------


def check_help(settings):
    for name in ALL:
        for h in ("-h", "--help"):
            r = CliRunner().invoke(main, [name, h])
            assert r.exit_code == 0 and r.output.startswith("Usage: "), (name, h, r.output)


def check_model(settings):
    assert settings("run", "-m", MODEL, "-p", "x").cfg.model == MODEL
    assert settings("serve", "--model", MODEL).cfg.model == MODEL
    assert Path(parse("bench", "-m", MODEL)["models"][0]) == Path(MODEL)


def _fake_hub(monkeypatch) -> list[tuple]:
    """cli_flags.hub_model answering every hub reference with the built-in model; -> the references asked."""
    asked = []

    def hub_model(model, hf_repo=None, hf_file=None, progress=False):
        if hf_repo is None and hf_file is None and not str(model).startswith("hf://"):
            return model
        asked.append((model, hf_repo, hf_file))
        return MODEL

    monkeypatch.setattr(cli_flags, "hub_model", hub_model)
    return asked


def check_hf_repo(settings, monkeypatch):
    asked = _fake_hub(monkeypatch)
    assert settings("run", "-hf", "u/r:Q8_0", "-p", "x").cfg.model == MODEL
    assert settings("serve", "-hfr", "u/r").cfg.model == MODEL
    assert settings("chat", "--hf-repo", "u/r").cfg.model == MODEL
    assert settings("run", "-m", "hf://u/r:q4_k_m", "-p", "x").cfg.model == MODEL
    assert asked == [(None, "u/r:Q8_0", None), (None, "u/r", None), (None, "u/r", None), ("hf://u/r:q4_k_m", None, None)]
    for args in (("inspect", "-hf", "u/r"), ("estimate", "-hf", "u/r", "--no-measure"), ("bench", "-hf", "u/r")):
        assert parse(*args)["hf_repo"] == "u/r"


def check_hf_file(settings, monkeypatch):
    asked = _fake_hub(monkeypatch)
    assert settings("run", "-hf", "u/r", "-hff", "M-Q8_0.gguf", "-p", "x").cfg.model == MODEL
    assert settings("run", "-hf", "u/r", "--hf-file", "M.gguf", "-p", "x").cfg.model == MODEL
    assert asked == [(None, "u/r", "M-Q8_0.gguf"), (None, "u/r", "M.gguf")]


def check_ctx_size(settings):
    assert settings("run", "-c", "8192", "-p", "x").cfg.ctx_size == 8192
    assert settings("chat", "--ctx-size", "64").cfg.ctx_size == 64
    assert parse("estimate", MODEL, "-c", "1024")["ctx_size"] == 1024


def check_n_predict(settings):
    assert settings("run", "-n", "5", "-p", "x").sampling.max_tokens == 5
    assert settings("run", "--predict", "6", "-p", "x").sampling.max_tokens == 6
    assert settings("run", "--n-predict", "7", "-p", "x").sampling.max_tokens == 7
    for n in ("-1", "-2"):
        assert settings("run", "-n", n, "-p", "x").sampling.max_tokens == UNTIL_END
        assert settings("chat", "-n", n).sampling.max_tokens == UNTIL_END
    for n in ("-1", "-2"):  # serve: requests that set no max_tokens run until the text ends or the context is full
        assert settings("serve", "-n", n).params["max_tokens"] == UNTIL_END
    assert settings("serve").params["max_tokens"] == UNTIL_END
    r = CliRunner().invoke(main, ["run", "-n", "0", "-p", "x"])
    assert r.exit_code == 2 and "'-n'" in r.output and "0 generates nothing" in r.output


def check_batch_size(settings):
    assert settings("run", "-b", "64", "-p", "x").cfg.ubatch == 64  # caps -ub (512)
    assert settings("run", "--batch-size", "2048", "-ub", "128", "-p", "x").cfg.ubatch == 128


def check_ubatch_size(settings):
    assert settings("run", "-ub", "128", "-p", "x").cfg.ubatch == 128
    assert settings("serve", "--ubatch-size", "64").cfg.ubatch == 64
    assert parse("bench", "-m", MODEL, "--ubatch-size", "32")["ubatch"] == [32]


def check_threads(settings):
    assert settings("run", "-t", "1", "-p", "x").cfg.threads == 1
    assert parse("estimate", MODEL, "--threads", "3")["threads"] == 3


def check_gpu_layers(settings, monkeypatch):
    monkeypatch.setattr(cli_flags, "find_gpus", lambda: ())
    for args in (("-ngl", "99"), ("--n-gpu-layers", "999"), ("--gpu-layers", "all"), ("-ngl", "-1")):
        s = settings("run", *args, "-p", "x")
        assert s.cfg.device == "cpu" and s.cfg.devices == ()
        assert s.notes == [(f"note: -ngl {s.params['n_gpu_layers']}: no GPU here: every layer runs on the CPU, "
                            "as on a CPU build of llama.cpp")]
    s = settings("run", "-ngl", "0", "-p", "x")
    assert s.cfg.devices == () and s.notes == []
    monkeypatch.setattr(cli_flags, "find_gpus", lambda: ("standin:0", "standin:1"))  # two GPUs found
    s = settings("serve", "-ngl", "99")
    assert s.cfg.devices == ("standin:0", "standin:1") and s.notes == []
    s = settings("run", "-ngl", "2", "-p", "x")  # the built-in model has 4 layers
    assert s.cfg.devices == ("standin:0", "standin:1")
    assert len(s.notes) == 1 and s.notes[0].startswith("note: -ngl 2: a GPU stage holds the dense weights of "
                                                       "all its layers, so all 4 go to the GPU")
    s = settings("run", "-ngl", "99", "-dev", "none", "-p", "x")  # no devices: the CPU, as llama.cpp
    assert s.cfg.devices == () and s.cfg.device == "cpu"
    r = CliRunner().invoke(main, ["run", "-ngl", "0", "--devices", "standin:0", "-p", "x"])
    assert r.exit_code == 2 and "-ngl 0 keeps every layer on the CPU" in r.output


def check_device(settings):
    assert settings("run", "-dev", "none", "-p", "x").cfg.device == "cpu"
    assert settings("run", "-dev", "CPU", "-p", "x").cfg.device == "cpu"
    assert settings("run", "-dev", "CUDA0", "-p", "x").cfg.device == "cuda:0"
    assert settings("run", "--device", "standin:0", "-p", "x").cfg.device == "standin:0"
    assert settings("chat", "-dev", "CUDA0,CUDA1").cfg.devices == ("cuda:0", "cuda:1")


def check_tensor_split(settings):
    cfg = settings("run", "-dev", "standin:0,standin:1", "-ts", "3,1", "-p", "x").cfg
    assert cfg.tensor_split == (3.0, 1.0)
    assert settings("run", "--devices", "cpu,cpu", "--tensor-split", "1,2", "-p", "x").cfg.tensor_split == (1.0, 2.0)


def check_cpu_moe(settings):
    assert settings("run", "-cmoe", "-p", "x").cfg.n_cpu_moe == UNTIL_END
    assert settings("serve", "--cpu-moe").cfg.n_cpu_moe == UNTIL_END
    assert settings("run", "-p", "x").cfg.n_cpu_moe == 0


def check_n_cpu_moe(settings):
    assert settings("run", "-ncmoe", "20", "-p", "x").cfg.n_cpu_moe == 20
    assert settings("chat", "--n-cpu-moe", "3").cfg.n_cpu_moe == 3


def check_override_tensor(settings):
    assert settings("run", "-ot", "exps=CPU", "-p", "x").cfg.override_tensor == (("exps", "cpu"),)
    assert settings("serve", "--override-tensor", r"blk\.0\.=CUDA0").cfg.override_tensor == ((r"blk\.0\.", "cuda:0"),)


def check_flash_attn(settings):
    fused = "attention here is always fused (SDPA in prompts, fused kernels in decode steps); -fa changes nothing"
    for args, value in ((("-fa", "on"), "on"), (("--flash-attn", "off"), "off"), (("-fa",), "on")):
        s = settings("run", *args, "-p", "x")
        assert s.params["flash_attn"] == value and s.notes == [f"note: -fa {value}: {fused}"]
    assert settings("run", "-fa", "auto", "-p", "x").notes == []


def check_mlock(settings):
    assert settings("run", "--mlock", "-p", "x").cfg.mlock is True
    assert settings("run", "-p", "x").cfg.mlock is False


def check_mmap(settings):
    assert settings("run", "--mmap", "-p", "x").cfg.mmap is True
    assert settings("run", "--no-mmap", "-p", "x").cfg.mmap is False
    assert parse("bench", "-m", MODEL, "--no-mmap")["mmap"] is False


def check_warmup(settings):
    s = settings("run", "--warmup", "-p", "x")
    assert s.notes == [("note: --warmup: moerun runs no warm-up pass; the first request's timings include first "
                        "touches of the weights")]
    assert settings("run", "--no-warmup", "-p", "x").notes == []


def check_cache_type_k(settings):
    assert settings("run", "-ctk", "q8_0", "-p", "x").cfg.cache_type_k == "q8_0"
    assert parse("estimate", MODEL, "--cache-type-k", "f16")["cache_type_k"] == "f16"


def check_cache_type_v(settings):
    assert settings("serve", "-ctv", "f16").cfg.cache_type_v == "f16"


def check_model_draft(settings):
    assert settings("run", "-md", MODEL, "-p", "x").cfg.model_draft == MODEL


def check_draft_max(settings):
    assert settings("run", "--draft-max", "8", "-p", "x").cfg.draft.draft_max == 8
    assert settings("run", "--draft-n", "4", "-p", "x").cfg.draft.draft_max == 4
    assert settings("run", "--draft", "5", "-p", "x").cfg.draft.draft_max == 5


def check_draft_min(settings):
    assert settings("run", "--draft-min", "2", "-p", "x").cfg.draft.draft_min == 2
    assert settings("run", "--draft-n-min", "3", "-p", "x").cfg.draft.draft_min == 3


def check_draft_p_min(settings):
    assert settings("run", "--draft-p-min", "0.5", "-p", "x").cfg.draft.draft_p_min == 0.5


def _sampling(settings, flag, value, field_name, expected):
    assert getattr(settings("run", flag, value, "-p", "x").sampling, field_name) == expected


def check_seed(settings):
    _sampling(settings, "-s", "7", "seed", 7)
    _sampling(settings, "--seed", "-1", "seed", None)


def check_temp(settings):
    _sampling(settings, "--temp", "0", "temperature", 0.0)


def check_top_k(settings):
    _sampling(settings, "--top-k", "5", "top_k", 5)


def check_top_p(settings):
    _sampling(settings, "--top-p", "0.5", "top_p", 0.5)


def check_min_p(settings):
    _sampling(settings, "--min-p", "0.1", "min_p", 0.1)


def check_repeat_penalty(settings):
    _sampling(settings, "--repeat-penalty", "1.1", "repeat_penalty", 1.1)


def check_repeat_last_n(settings):
    _sampling(settings, "--repeat-last-n", "-1", "repeat_last_n", -1)


def check_presence_penalty(settings):
    _sampling(settings, "--presence-penalty", "0.5", "presence_penalty", 0.5)


def check_frequency_penalty(settings):
    _sampling(settings, "--frequency-penalty", "0.5", "frequency_penalty", 0.5)


def check_ignore_eos(settings):
    assert settings("run", "--ignore-eos", "-p", "x").sampling.ignore_eos is True


def check_prompt(settings):
    assert settings("run", "-p", "hi there").params["prompt"] == "hi there"
    assert parse("run", "--prompt", "-looks-like-a-flag")["prompt"] == "-looks-like-a-flag"


def check_file(settings, tmp_path):
    (tmp_path / "p.txt").write_text("from a file")
    assert settings("run", "-f", str(tmp_path / "p.txt")).params["prompt_file"].name == str(tmp_path / "p.txt")


def check_no_display_prompt(settings):
    assert settings("run", "--no-display-prompt", "-p", "x").params["no_display_prompt"] is True


def check_system_prompt(settings):
    assert settings("chat", "-sys", "hi").params["system"] == "hi"
    assert settings("chat", "--system-prompt", "be brief").params["system"] == "be brief"
    assert settings("run", "-sys", "hi", "-p", "x").params["system"] == "hi"


def check_jinja(settings):
    for cmd, extra in (("run", ("-p", "x")), ("chat", ()), ("serve", ())):
        assert settings(cmd, "--jinja", *extra).params["jinja"] is True


def check_chat_template(settings):
    assert settings("run", "--chat-template", "chatml", "-p", "x").params["chat_template"] == "chatml"


def check_chat_template_file(settings, tmp_path):
    (tmp_path / "t.jinja").write_text("{{ messages[0]['content'] }}")
    s = settings("run", "--chat-template-file", str(tmp_path / "t.jinja"), "-p", "x")
    assert s.params["chat_template_file"] == str(tmp_path / "t.jinja")


def check_reasoning_format(settings):
    assert settings("chat", "--reasoning-format", "none").params["reasoning_format"] == "none"
    assert settings("serve", "--reasoning-format", "deepseek").params["reasoning_format"] == "deepseek"


def check_host(settings):
    assert settings("serve", "--host", "0.0.0.0", "--api-key", "k").listen == ("0.0.0.0", 8080)


def check_port(settings):
    assert settings("serve", "--port", "9123").listen == ("127.0.0.1", 9123)


def check_parallel(settings):
    assert settings("serve", "-np", "2").params["parallel"] == 2


def check_alias(settings):
    assert settings("serve", "-a", "qwen").params["alias"] == ("qwen",)


def check_api_key(settings):
    assert settings("serve", "--api-key", "secret").params["api_key"] == "secret"


def check_slot_save_path(settings, tmp_path):
    assert settings("serve", "--slot-save-path", str(tmp_path)).params["slot_save_path"] == tmp_path


CHECK_NAMES = {"-h": "check_help", "-m": "check_model", "-hf": "check_hf_repo", "-hff": "check_hf_file", "-c": "check_ctx_size", "-n": "check_n_predict",
               "-b": "check_batch_size", "-ub": "check_ubatch_size", "-t": "check_threads",
               "-ngl": "check_gpu_layers", "-dev": "check_device", "-ts": "check_tensor_split",
               "-cmoe": "check_cpu_moe", "-ncmoe": "check_n_cpu_moe", "-ot": "check_override_tensor",
               "-fa": "check_flash_attn", "-ctk": "check_cache_type_k", "-ctv": "check_cache_type_v",
               "-md": "check_model_draft", "-s": "check_seed", "-p": "check_prompt", "-f": "check_file",
               "-sys": "check_system_prompt", "-np": "check_parallel", "-a": "check_alias"}


def _check(f):
    """The check of one table entry: CHECK_NAMES' or check_ and its first long name (--top-k: check_top_k)."""
    return globals()[CHECK_NAMES.get(f.names[0], "check_" + f.names[0].lstrip("-").replace("-", "_"))]


@pytest.mark.parametrize("f", LLAMA_FLAGS, ids=lambda f: f.names[0])
def test_each_flag_sets_what_the_table_says(f, settings, monkeypatch, tmp_path, no_gpu):
    check = _check(f)
    kwargs = {"settings": settings, "monkeypatch": monkeypatch, "tmp_path": tmp_path}
    check(**{k: v for k, v in kwargs.items() if k in check.__code__.co_varnames[:check.__code__.co_argcount]})


def test_every_spelling_is_an_option_of_its_commands():
    for f in LLAMA_FLAGS:
        for name in f.commands:
            cmd = main.commands[name]
            ctx = click.Context(cmd, info_name=name, parent=click.Context(main, info_name="moerun"))
            opts = {o for p in cmd.get_params(ctx) if isinstance(p, click.Option) for o in (*p.opts, *p.secondary_opts)}
            missing = set(f.names) - opts
            assert not missing, f"moerun {name} lacks {sorted(missing)} ({f.names[0]} in LLAMA_FLAGS)"


def test_run_with_a_system_prompt_sends_system_then_user_in_the_template():
    r = CliRunner().invoke(main, ["run", "-sys", "You answer in French.", "-p", "hello", "-n", "1", "--json"])
    assert r.exit_code == 0, r.output
    prompt = json.loads(r.stdout)["prompt"]  # the built-in model's (Qwen3's) template: system, then the user
    assert re.search(r"system\s+You answer in French\.<\|im_end\|>\s*<\|im_start\|>user\s+hello", prompt), prompt


# -- read whole, never as a cluster ------------------------------------------------------------------------


@pytest.mark.parametrize("argv,name,value", [
    (("run", "-ngl", "99"), "n_gpu_layers", 99),
    (("run", "-fa", "on"), "flash_attn", "on"),
    (("chat", "-sys", "hi"), "system", "hi"),
    (("run", "-sys", "hi"), "system", "hi"),
    (("serve", "-ncmoe", "20"), "n_cpu_moe", 20),
    (("run", "-ngl=12"), "n_gpu_layers", 12),
])
def test_multi_letter_flags_are_read_whole(argv, name, value):
    assert parse(*argv)[name] == value


@pytest.mark.parametrize("argv,flag", [
    (("run", "-tb", "2", "-p", "x"), "-tb"),  # llama.cpp's --threads-batch: not here
    (("bench", "-ngl", "99", "-m", MODEL), "-ngl"),  # read as -n gl before
    (("estimate", MODEL, "-fa", "1"), "-fa"),
    (("run", "-nkvo", "-p", "x"), "-nkvo"),
])
def test_an_undeclared_multi_letter_flag_is_refused_by_its_own_name(argv, flag):
    r = CliRunner().invoke(main, list(argv))
    assert r.exit_code == 2
    assert r.output.strip().splitlines()[-1] == f"Error: No such option '{flag}'.", r.output


def test_values_that_look_like_flags_and_one_letter_clusters_still_parse():
    assert parse("run", "-p", "-abc", "-n", "-1")["prompt"] == "-abc"
    assert parse("run", "-vp", "x")["verbose"] is True  # -v -p x, a cluster of one-letter flags
    assert parse("run", "-n12")["max_tokens"] == 12


# -- README --------------------------------------------------------------------------------------------------


def test_readme_table_is_the_flag_table():
    lines = README.read_text().splitlines()
    header = readme_table()[0]
    assert header in lines, "README.md has no table of llama.cpp's flags"
    start = lines.index(header)
    end = next(i for i in range(start, len(lines)) if not lines[i].startswith("|"))
    assert lines[start:end] == readme_table()


# -- a llama.cpp command line, end to end ----------------------------------------------------------------------


def test_a_llama_cpp_moe_command_line_runs_on_the_cpu_with_notes_only():
    argv = ["-m", MODEL, "-ngl", "99", "-ncmoe", "20", "-fa", "on", "-c", "8192", "--jinja", "-p", "hi", "-n", "4"]
    r = subprocess.run([sys.executable, "-m", "moerun", "run", *argv], capture_output=True, text=True, timeout=120,
                       check=False)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("hi") and r.stdout.endswith("\n")
    timing = re.compile(r"^ *(prompt eval|eval|total) time = ")
    other = [line for line in r.stderr.splitlines() if not timing.match(line)]
    assert other and all(line.startswith("note: ") for line in other), r.stderr
    assert any(line.startswith("note: -fa on: ") for line in other)
    if not cli_flags.find_gpus():
        assert any(line.startswith("note: -ngl 99: no GPU here") for line in other)
