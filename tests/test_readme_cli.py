"""README.md against the command line: every flag README names exists on the `moerun` command it is used
with, and every list of a flag's values README gives is that flag's choices.

Where README names a flag:

- command lines, in shell code blocks and in inline code (`moerun bench -m MODEL ...`, `estimate --trace`,
  `python -m moerun ...`, `torchrun ... -m moerun ...`): each flag must be an option of the command the line
  runs (walking moerun.cli's click group: `moerun trace simulate` is the group `trace`'s `simulate`). A
  command line of another program (pip, pytest, curl, llama-cli, `python bench/x.py`, `python -m
  moerun.tools.x`...) is left out, flags and all, because of the program it runs, not because of its flags.
- prose and tables (`--flag`, `-x/--long`, and flags written out of code, as an error message's "a smaller
  -ub, -c or -np"): the flag must be an option of one of the commands its context names: the clause's own
  (`run` also takes ...), the paragraph's lead ("Expert cache (`run`, `chat`):") or the table row's command,
  the section heading's ("Speculative decoding (`run`, `chat`, `serve`)", or a section that opens with
  `moerun serve`); of any moerun command where none is named.

Values written `a|b|c` after a flag, or listed after it (`-ctk/--cache-type-k` ...: `f32`, `f16`, ... /
`q4_0`), must equal the flag's click.Choice (or argparse choices). The quantization types README and --help
give for --repack must be the ones the loader interleaves, and README and -ctk's --help must name the same
KV cache types for the fused C decode path.

make-model and convert hand their arguments to argparse parsers (moerun.tools); their options are read from
the parser itself.
"""

from __future__ import annotations

import argparse
import itertools
import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path

import click
import pytest

from moerun.cli import main

README = Path(__file__).resolve().parents[1] / "README.md"

FLAG = re.compile(r"-{1,2}[A-Za-z][\w-]*")  # -x, --long-name (not -1, not --)
SHELL_BLOCKS = {"", "bash", "sh", "shell", "console"}
SEPARATORS = {"&&", "||", ";", "|", "&"}


# -- the command line -------------------------------------------------------------------------------------


@dataclass
class Command:
    path: tuple[str, ...]  # () is `moerun` itself
    flags: set[str] = field(default_factory=set)
    choices: dict[str, tuple[str, ...]] = field(default_factory=dict)  # flag -> its choices
    helps: dict[str, str] = field(default_factory=dict)  # flag -> its help text
    subcommands: set[str] = field(default_factory=set)

    @property
    def name(self) -> str:
        return " ".join(("moerun", *self.path))


class _Parser(Exception):
    def __init__(self, parser: argparse.ArgumentParser):
        self.parser = parser


def _passthrough(cmd: click.Command) -> bool:
    """A command that hands its raw arguments to another parser (make-model, convert)."""
    return bool(cmd.context_settings.get("ignore_unknown_options")) and any(
        isinstance(p, click.Argument) and p.nargs == -1 and p.type is click.UNPROCESSED for p in cmd.params)


def _argparse_parser(cmd: click.Command, name: str) -> argparse.ArgumentParser:
    """The argparse parser a passthrough command builds: caught as it parses `--help`."""

    def catch(self, *args, **kwargs):
        raise _Parser(self)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(argparse.ArgumentParser, "parse_known_args", catch)
        try:
            cmd.invoke(cmd.make_context(name, ["--help"]))
        except _Parser as e:
            return e.parser
    raise AssertionError(f"moerun {name} built no argparse parser")


def _walk(cmd: click.Command, path: tuple[str, ...], out: dict[tuple[str, ...], Command]) -> None:
    c = out[path] = Command(path)
    if _passthrough(cmd):
        for action in _argparse_parser(cmd, path[-1])._actions:
            for opt in action.option_strings:
                c.flags.add(opt)
                c.helps[opt] = action.help or ""
                if action.choices is not None:
                    c.choices[opt] = tuple(map(str, action.choices))
        return
    for p in cmd.get_params(click.Context(cmd, info_name=path[-1] if path else "moerun")):
        if not isinstance(p, click.Option):
            continue
        for opt in (*p.opts, *p.secondary_opts):
            c.flags.add(opt)
            c.helps[opt] = p.help or ""
            if isinstance(p.type, click.Choice):
                c.choices[opt] = tuple(map(str, p.type.choices))
    if isinstance(cmd, click.Group):
        for name, sub in cmd.commands.items():
            c.subcommands.add(name)
            _walk(sub, (*path, name), out)


@pytest.fixture(scope="module")
def commands() -> dict[tuple[str, ...], Command]:
    out: dict[tuple[str, ...], Command] = {}
    _walk(main, (), out)
    return out


# -- README -----------------------------------------------------------------------------------------------


@dataclass
class Place:
    line: int  # README's line (1-based) where the code block line or paragraph starts

    def __str__(self) -> str:
        return f"README.md:{self.line}"


@dataclass
class CodeLine:
    place: Place
    text: str


@dataclass
class Paragraph:
    place: Place
    text: str  # its lines joined with spaces
    heading: frozenset[tuple[str, ...]]  # commands the section's heading names
    lead: frozenset[tuple[str, ...]]  # commands a table row's first cell or "Lead (`run`, `chat`):" names


def _cells(row: str) -> list[str]:
    """A table row's cells (`\\|` is a | inside a cell)."""
    return [c.strip().replace("\\|", "|") for c in re.split(r"(?<!\\)\|", row.strip().strip("|"))]


def _span_commands(text: str, top: set[str]) -> frozenset[tuple[str, ...]]:
    """Commands named as bare code spans: `run`, `chat`'s."""
    return frozenset((s,) for s in re.findall(r"`([\w-]+)`", text) if s in top)


def _opening_command(text: str, commands) -> frozenset[tuple[str, ...]]:
    """The command of a `moerun ...` code span that text opens with (`moerun trace simulate FILE ...`)."""
    m = re.match(r"`(moerun [^`]+)`", text)
    if not m:
        return frozenset()
    path: tuple[str, ...] = ()
    for word in m.group(1).split()[1:]:
        if word not in commands[path].subcommands:
            break
        path = (*path, word)
    return frozenset({path}) if path else frozenset()


def read_readme(commands) -> tuple[list[CodeLine], list[Paragraph]]:
    top = commands[()].subcommands
    lines = README.read_text().splitlines()
    code: list[CodeLine] = []
    paragraphs: list[Paragraph] = []
    headings: list[tuple[int, frozenset[tuple[str, ...]]]] = []  # (level, commands) of the open headings
    fence: str | None = None  # the open code block's language
    para: list[str] = []
    start = 0
    fresh = False  # the next paragraph opens a section: `moerun X` there names its command

    def heading_scope() -> frozenset[tuple[str, ...]]:
        return next((cmds for _, cmds in reversed(headings) if cmds), frozenset())

    def flush() -> None:
        nonlocal para, fresh
        if para:
            text = " ".join(s.strip() for s in para)
            opening = _opening_command(text, commands)
            if fresh and opening and headings and not headings[-1][1]:
                headings[-1] = (headings[-1][0], opening)
            lead = re.match(r"[^`:.]{0,40}\(((?:`[\w-]+`(?:, )?)+)\):", text)
            paragraphs.append(Paragraph(Place(start), text, heading_scope(),
                                        _span_commands(lead.group(1), top) if lead else frozenset()))
            fresh = False
        para = []

    for i, line in enumerate(lines, 1):
        if fence is not None:
            if line.strip().startswith("```"):
                fence = None
            elif fence in SHELL_BLOCKS:
                if code and code[-1].text.endswith("\\"):
                    code[-1].text = code[-1].text[:-1] + " " + line.strip()
                else:
                    code.append(CodeLine(Place(i), line.strip()))
            continue
        if line.strip().startswith("```"):
            flush()
            fence = line.strip()[3:].strip()
            continue
        h = re.match(r"(#+)\s+(.*)", line)
        if h:
            flush()
            level = len(h.group(1))
            headings = [x for x in headings if x[0] < level] + [(level, _span_commands(h.group(2), top))]
            fresh = True
            continue
        if line.lstrip().startswith("|"):
            flush()
            cells = _cells(line)
            if all(re.fullmatch(r":?-+:?", c) for c in cells):
                continue
            paragraphs.append(Paragraph(Place(i), " | ".join(cells), heading_scope(),
                                        _opening_command(cells[0], commands)))
            continue
        if not line.strip():
            flush()
            continue
        if not para:
            start = i
        para.append(line)
    flush()
    return code, paragraphs


# -- flags in a piece of text ----------------------------------------------------------------------------


@dataclass
class Use:
    """A flag as README uses it: where, on which commands (a command line's, or the candidates of prose),
    and the values it lists, if any."""

    place: Place
    flag: str
    commands: tuple[tuple[str, ...], ...]
    exact: bool  # a command line: the flag must be on that command; prose: on one of the candidates
    listed: tuple[str, ...] | None = None
    text: str = ""


def _flag_tokens(token: str) -> list[str]:
    """The flags in one token: `[--a`, `-n/--n-predict`, `FILE]|--b`, `--c=3`."""
    out = []
    for part in token.strip("[]()").split("|"):
        part = part.strip("[]()").split("=", 1)[0]
        if all(FLAG.fullmatch(p) for p in part.split("/")):
            out += part.split("/")
    return out


def _alternatives(token: str | None) -> tuple[str, ...] | None:
    """`md|json|csv` -> its values; None for anything else (a value, a flag, FILE]|--flag)."""
    if token is None or "|" not in token:
        return None
    parts = token.strip("[]").split("|")
    if any(not re.fullmatch(r"[\w.:-]+", p) or p.startswith("-") for p in parts):
        return None
    return tuple(parts)


def _token_flags(tokens: list[str], i: int) -> list[tuple[str, tuple[str, ...] | None]]:
    """(flag, the values listed after it as a|b|c, or None) for each flag in tokens[i]."""
    flags = _flag_tokens(tokens[i])
    nxt = tokens[i + 1] if i + 1 < len(tokens) and "=" not in tokens[i] else None
    return [(f, _alternatives(nxt) if f == flags[-1] else None) for f in flags]


def _flags_in(tokens: list[str]) -> list[tuple[str, tuple[str, ...] | None]]:
    return [x for i in range(len(tokens)) for x in _token_flags(tokens, i)]


def _split(text: str, punctuation: bool) -> list[str]:
    lex = shlex.shlex(text, posix=True, punctuation_chars=";&|" if punctuation else False)
    lex.whitespace_split = True
    lex.commenters = "#" if punctuation else ""
    return list(lex)


def _moerun_argv(tokens: list[str], top: set[str]) -> list[str] | None:
    """The arguments after `moerun` if these tokens run moerun (`moerun ...`, `python -m moerun ...`,
    `torchrun ... -m moerun ...`, or a bare subcommand `estimate --trace`); None for another program."""
    while tokens and re.fullmatch(r"[A-Za-z_]\w*=\S*", tokens[0]):  # VAR=value before the program
        tokens = tokens[1:]
    if not tokens:
        return None
    if tokens[0] == "moerun":
        return tokens[1:]
    if tokens[0] in top:
        return tokens
    if Path(tokens[0]).name in ("python", "python3", "torchrun"):
        for i in range(1, len(tokens) - 1):
            if tokens[i] == "-m":
                return tokens[i + 2:] if tokens[i + 1] == "moerun" else None
    return None


def _command_uses(place: Place, argv: list[str], commands, text: str) -> list[Use]:
    """A moerun command line's flags, each on the (sub)command it follows."""

    def on(path: tuple[str, ...], at: list[int]) -> list[Use]:
        return [Use(place, f, (path,), True, listed, text) for j in at for f, listed in _token_flags(argv, j)]

    path: tuple[str, ...] = ()
    uses, pending = [], []
    for i, tok in enumerate(argv):
        if _flag_tokens(tok):
            pending.append(i)
            continue
        cmd = commands[path]
        if cmd.subcommands:
            word = tok.strip("[]")
            assert word in cmd.subcommands, f"{place}: `{cmd.name}` has no command {word!r} ({text})"
            uses += on(path, pending)
            pending, path = [], (*path, word)
    return uses + on(path, pending)


def _masked(text: str) -> str:
    """text with its code spans blanked out (NULs), positions kept."""
    return re.sub(r"`[^`]+`", lambda m: "\0" * len(m.group()), text)


def _clauses(masked: str, cut: str = ".;") -> list[tuple[int, int]]:
    """(start, end) of each clause: cut after '.' and ';' (or `cut`) and a space, outside code spans."""
    cuts = [m.end() for m in re.finditer(rf"[{cut}](?=\s)", masked)]
    bounds = [0, *cuts, len(masked)]
    return list(itertools.pairwise(bounds))


LISTED = re.compile(r"((?:`-[^`]+`(?:,? and |, | or )?)+)\s*(?:\([^)]*\))?:\s*"
                    r"((?:`[\w.-]+`(?:,? or |, | / |,? and ))+`[\w.-]+`)")


def _prose_uses(p: Paragraph, commands, top: set[str]) -> list[Use]:
    text = p.text
    spans = [(m.start(), m.end(), m.group(1)) for m in re.finditer(r"`([^`]+)`", text)]
    masked = _masked(text)
    clauses = _clauses(masked)

    def scope(pos: int) -> tuple[tuple[str, ...], ...]:
        s, e = next((s, e) for s, e in clauses if s <= pos < e)
        named = _span_commands(text[s:e], top) | p.lead | p.heading
        return tuple(sorted(named)) if named else tuple(commands)

    uses = []
    for s, e, body in spans:
        try:
            tokens = _split(body, punctuation=False)
        except ValueError:
            tokens = body.split()
        if not tokens or not any(_flag_tokens(t) for t in tokens):
            continue
        first = tokens[0]
        if not _flag_tokens(first) and re.fullmatch(r"[\w./][\w.+/-]*", first):  # a command line
            argv = _moerun_argv(tokens, top)
            if argv is not None:
                uses += _command_uses(p.place, argv, commands, body)
            continue  # another program's
        uses += [Use(p.place, f, scope(s), False, listed, body) for f, listed in _flags_in(tokens)]
    for m in re.finditer(r"(?<![\w/.\0-])(--[a-z][\w-]*|-[a-z]{1,3}(?=[\s,;:)\"']))", masked):  # out of code
        uses.append(Use(p.place, m.group(1), scope(m.start()), False, None, m.group(0)))
    for m in LISTED.finditer(text):
        values = tuple(re.findall(r"`([\w.-]+)`", m.group(2)))
        for body in re.findall(r"`(-[^`]+)`", m.group(1)):
            for f in _flag_tokens(body):
                uses.append(Use(p.place, f, scope(m.start()), False, values, m.group(0)))
    return uses


@pytest.fixture(scope="module")
def uses(commands) -> list[Use]:
    top = commands[()].subcommands
    code, paragraphs = read_readme(commands)
    out = []
    for line in code:
        try:
            tokens = _split(line.text, punctuation=True)
        except ValueError:  # output or code with an odd quote: fine unless it runs moerun
            assert _moerun_argv(line.text.split(), top) is None, f"{line.place}: cannot parse {line.text!r}"
            continue
        simple: list[list[str]] = [[]]
        for tok in tokens:
            if tok in SEPARATORS:
                simple.append([])
            else:
                simple[-1].append(tok)
        for argv in filter(None, (_moerun_argv(s, top) for s in simple)):
            out += _command_uses(line.place, argv, commands, line.text)
    for p in paragraphs:
        out += _prose_uses(p, commands, top)
    return out


# -- the tests --------------------------------------------------------------------------------------------


def test_readme_names_flags(uses):
    """The parser finds what README names, command lines and prose alike (a guard against a parser that
    quietly finds nothing)."""
    exact = {(u.commands[0], u.flag) for u in uses if u.exact}
    prose = {u.flag for u in uses if not u.exact}
    assert (("run",), "-p") in exact and (("serve",), "--api-key") in exact
    assert (("trace", "simulate"), "--slots") in exact and (("make-model",), "--ftype") in exact
    assert {"--repack", "--no-repack", "-ctk", "--cache-type-k", "--draft-adaptive", "-np"} <= prose
    assert len(uses) > 150
    others = ("--index-url", "--llama-bin", "--nproc-per-node", "-q")  # -ngl, -ot: moerun's too (LLAMA_FLAGS)
    assert not any(u.flag in others for u in uses), \
        "flags of other programs (llama-cli, pip, bench scripts, torchrun, pytest) are left out"


def test_every_readme_flag_exists(uses, commands):
    missing = []
    for u in uses:
        where = [commands[c] for c in u.commands]
        if not any(u.flag in c.flags for c in where):
            names = where[0].name if u.exact else " or ".join(c.name for c in where)
            missing.append(f"{u.place}: {u.flag} is not an option of {names}  ({u.text})")
    assert not missing, "README names flags the command line does not have:\n" + "\n".join(missing)


def test_readme_value_lists_are_the_choices(uses, commands):
    wrong = []
    for u in uses:
        if u.listed is None:
            continue
        have = [commands[c] for c in u.commands if u.flag in commands[c].flags]
        for c in have:
            choices = c.choices.get(u.flag)
            if choices is None:
                wrong.append(f"{u.place}: README lists values {u.listed} for {u.flag}, which takes any value "
                             f"on {c.name}")
            elif sorted(u.listed) != sorted(choices):
                wrong.append(f"{u.place}: README lists {'|'.join(u.listed)} for {u.flag}; {c.name} takes "
                             f"{'|'.join(choices)}")
    assert not wrong, "\n".join(wrong)


def test_value_lists_found(uses):
    listed = {(u.flag, u.listed) for u in uses if u.listed}
    assert ("-ctk", ("f32", "f16", "bf16", "q8_0", "q4_0")) in listed
    assert ("--miss-path", ("auto", "fetch", "home")) in listed
    assert ("-o", ("md", "json", "jsonl", "csv")) in listed


QTYPE = re.compile(r"\b(?:I?Q\d_(?:K|\d|NL|XS|XXS|S|M)|MXFP4|BF16|F16|F32|TQ\d_\d)\b")


def test_repack_qtypes(commands):
    """The types --repack rewrites, as README's sentences about it and every command's --help give them,
    are the loader's (moerun.quant.qtypes.INTERLEAVABLE)."""
    from moerun.quant.qtypes import INTERLEAVABLE

    want = {q.name for q in INTERLEAVABLE}
    sentences = []
    for p in read_readme(commands)[1]:
        masked = _masked(p.text)
        sentences += [p.text[s:e] for s, e in _clauses(masked, ".")
                      if re.search(r"`--(no-)?repack", p.text[s:e])]
    said = [set(QTYPE.findall(s)) for s in sentences]
    assert sum(map(bool, said)) >= 2, sentences
    wrong = [f"README: {sorted(s)} in {sent[:120]!r}..."
             for s, sent in zip(said, sentences) if s and s != want]
    helps = [(c.name, c.helps["--repack"]) for c in commands.values() if "--repack" in c.flags]
    assert len(helps) >= 4  # run, chat, serve, bench
    wrong += [f"{name} --help: {sorted(set(QTYPE.findall(h)))}"
              for name, h in helps if set(QTYPE.findall(h)) != want]
    assert not wrong, f"--repack interleaves {sorted(want)}, but:\n" + "\n".join(wrong)


def test_fused_kv_types_agree(commands):
    """The KV cache types README and -ctk's --help say the fused C decode path reads are the same."""
    claim = re.compile(r"fused C decode path reads(?: and writes)? ([\w ,]+?) \(")
    text = " ".join(README.read_text().split())
    said = {frozenset(re.findall(r"\w+", m.group(1))) - {"and"} for m in claim.finditer(text)}
    helps = {name: " ".join(c.helps["-ctk"].split()) for name, c in
             ((c.name, c) for c in commands.values()) if "-ctk" in c.flags and "fused" in c.helps["-ctk"]}
    assert said and helps
    for name, h in helps.items():
        m = claim.search(h)
        assert m, f"{name} -ctk --help: {h!r}"
        assert {frozenset(re.findall(r"\w+", m.group(1))) - {"and"}} == said, (name, h, said)
