"""Models on the Hugging Face Hub: `-m hf://user/repo[:QUANT]`, `-m hf://user/repo/FILE.gguf`, `-hf REPO[:QUANT]`
and `-hf REPO --hf-file FILE`, downloaded through huggingface_hub into its cache.

The GGUF a reference names is chosen as llama.cpp chooses it (common/download.cpp, find_best_model): a quant tag
(case-insensitive) picks the first GGUF whose path holds the tag followed by `.` or `-`; with no tag, Q4_K_M, else
Q8_0, else the first GGUF. Projectors, imatrix files and draft heads (mmproj, imatrix, mtp-, eagle3-, dflash-,
dspark-) are never the model. A split model (`NAME-00001-of-00003.gguf`) counts as one file: its first part is
chosen and every part is downloaded beside it. One difference: the tag must not follow a letter, digit or `_`, so
`:Q2_K` does not pick an `IQ2_K` file. A repository without GGUF files but with config.json and safetensors
weights is a Hugging Face model: its config, tokenizer and weights (model.safetensors, or the index and the shards
it names) are downloaded, nothing else.

huggingface_hub does the downloading: its cache (HF_HOME, HF_HUB_CACHE), HF_TOKEN, HF_ENDPOINT, HF_HUB_OFFLINE,
its progress bars, and resuming a transfer whose connection drops (with a Range request from the last whole
10 MiB chunk it wrote; a run that is stopped starts that file over next time). It is imported only when a
reference is resolved. With HF_HUB_OFFLINE set, or when the hub cannot be reached, the choice is made among the
cached files.
"""

from __future__ import annotations

import contextlib
import glob
import json
import re
import sys
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

from moerun.errors import MoerunError

__all__ = ["SCHEME", "HubError", "HubRef", "Plan", "gguf_quants", "is_hub_reference", "parse", "plan", "resolve"]

SCHEME = "hf://"
DEFAULT_QUANTS = ("Q4_K_M", "Q8_0")
NOT_MODELS = ("mmproj", "imatrix", "mtp-", "eagle3-", "dflash-", "dspark-")
CONFIG_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                "tokenizer.model", "special_tokens_map.json", "added_tokens.json", "vocab.json", "merges.txt",
                "chat_template.jinja", "chat_template.json")
TEMPLATES_DIR = "additional_chat_templates/"
WEIGHTS = "model.safetensors"
INDEX = "model.safetensors.index.json"
REVISION = "main"

_REPO = re.compile(r"[A-Za-z0-9][\w.-]{0,95}/[A-Za-z0-9][\w.-]{0,95}")
_QUANT = re.compile(r"[A-Za-z0-9][\w.-]*")
_SPLIT = re.compile(r"(.+)-(\d{5})-of-(\d{5})", re.IGNORECASE)
_TAG = re.compile(r"[-.]([A-Z0-9_]+)$", re.IGNORECASE)
_FORMS = "hf://user/repo, hf://user/repo:QUANT or hf://user/repo/FILE.gguf"


class HubError(MoerunError):
    """A hub reference that cannot be resolved: malformed, unknown, not cached, unreachable, or without a model."""


@dataclass(frozen=True)
class HubRef:
    """A model on the hub: a repository, and in it a quant tag or one file (neither: llama.cpp's default choice)."""

    repo: str
    quant: str | None = None
    file: str | None = None

    def __str__(self) -> str:
        return f"{self.repo}/{self.file}" if self.file else f"{self.repo}:{self.quant}" if self.quant else self.repo


@dataclass(frozen=True)
class Plan:
    """What to fetch for a reference: the repository paths, and the one to load ("" for the folder itself).
    `index`: the weights are the shards model.safetensors.index.json names, found once the index is fetched."""

    files: tuple[str, ...]
    load: str
    index: bool = False


# ------------------------------------------------------------------------------------------ references


def is_hub_reference(model: str | None) -> bool:
    """Whether `-m MODEL` names a model on the hub (hf://...)."""
    return bool(model) and model.startswith(SCHEME)


def _repo_and_quant(text: str, what: str) -> tuple[str, str | None]:
    repo, colon, quant = text.partition(":")
    if not _REPO.fullmatch(repo):
        raise HubError(f"{what}: expected a repository user/repo[:QUANT]")
    if colon and not _QUANT.fullmatch(quant):
        raise HubError(f"{what}: the quant after ':' is empty or not a quant tag (e.g. Q4_K_M)")
    return repo, quant or None


def _checked_file(file: str, what: str) -> str:
    parts = file.split("/")
    if any(p in ("", ".", "..") for p in parts) or "\\" in file:
        raise HubError(f"{what}: {file!r} is not a file path in the repository")
    if not file.lower().endswith(".gguf"):
        raise HubError(f"{what}: a file on the hub must be a .gguf file (name a safetensors model by its "
                       "repository: hf://user/repo)")
    return file


def _parse_url(model: str, hf_file: str | None) -> HubRef:
    what = f"-m {model}"
    rest = model[len(SCHEME):]
    parts = rest.split("/", 2)
    if len(parts) < 2:
        raise HubError(f"{what}: expected {_FORMS}")
    if len(parts) == 3:
        if ":" in parts[1] or hf_file:
            raise HubError(f"{what}: expected {_FORMS}")
        repo, _ = _repo_and_quant("/".join(parts[:2]), what)
        return HubRef(repo, file=_checked_file(parts[2], what))
    repo, quant = _repo_and_quant(rest, what)
    if hf_file:
        return HubRef(repo, file=_checked_file(hf_file, f"--hf-file {hf_file}"))
    return HubRef(repo, quant)


def parse(model: str | None, hf_repo: str | None = None, hf_file: str | None = None) -> HubRef | None:
    """The hub reference `-m MODEL` / `-hf REPO[:QUANT]` / `--hf-file FILE` make, or None for a local model.
    A reference that is malformed or contradicts itself is a HubError."""
    if hf_repo:
        if model:
            raise HubError(f"-m {model} and -hf {hf_repo} both name a model: give one")
        repo, quant = _repo_and_quant(hf_repo, f"-hf {hf_repo}")
        if hf_file:
            return HubRef(repo, file=_checked_file(hf_file, f"--hf-file {hf_file}"))
        return HubRef(repo, quant)
    if is_hub_reference(model):
        return _parse_url(model, hf_file)
    if hf_file:
        raise HubError(f"--hf-file {hf_file} needs the repository it is in: -hf user/repo --hf-file {hf_file}")
    return None


# ------------------------------------------------------------------------------------------ which files


def split_info(path: str) -> tuple[str, int, int]:
    """(prefix, part, parts) of a GGUF path: `x/M-Q4_K_M-00002-of-00003.gguf` -> ("x/M-Q4_K_M", 2, 3); a file in
    one piece is part 1 of 1."""
    stem = path[:-len(".gguf")] if path.lower().endswith(".gguf") else path
    m = _SPLIT.fullmatch(stem)
    return (m.group(1), int(m.group(2)), int(m.group(3))) if m else (stem, 1, 1)


def _is_model_gguf(path: str) -> bool:
    name = path.rsplit("/", 1)[-1]
    return name.lower().endswith(".gguf") and not any(word in name for word in NOT_MODELS)


def _is_first_part(path: str) -> bool:
    _, part, parts = split_info(path)
    return parts <= 1 or part == 1


def gguf_quants(files: Iterable[str]) -> list[str]:
    """The quant tags of a repository's model GGUFs, upper case, in file order: `M-Q4_K_M.gguf` -> Q4_K_M."""
    tags: dict[str, None] = {}
    for f in files:
        m = _TAG.search(split_info(f)[0]) if _is_model_gguf(f) and _is_first_part(f) else None
        if m:
            tags[m.group(1).upper()] = None
    return list(tags)


def _with_tag(files: list[str], tag: str) -> str | None:
    pattern = re.compile(rf"(?<![A-Za-z0-9_]){re.escape(tag)}[.-]", re.IGNORECASE)
    return next((f for f in files if _is_model_gguf(f) and _is_first_part(f) and pattern.search(f)), None)


def choose_gguf(files: list[str], quant: str | None) -> str | None:
    """The GGUF llama.cpp loads for `-hf REPO[:QUANT]` (the first part of a split model), or None."""
    for tag in (quant,) if quant else DEFAULT_QUANTS:
        if found := _with_tag(files, tag):
            return found
    if quant:
        return None
    return next((f for f in files if _is_model_gguf(f) and _is_first_part(f)), None)


def gguf_parts(files: Iterable[str], first: str) -> tuple[str, ...]:
    """Every part of the model `first` begins: itself, or all NAME-0000i-of-0000n.gguf of a split model."""
    prefix, _, parts = split_info(first)
    if parts <= 1:
        return (first,)
    return tuple(f"{prefix}-{i:05d}-of-{parts:05d}.gguf" for i in range(1, parts + 1))


def _safetensors_plan(files: list[str]) -> Plan | None:
    top = set(files)
    if "config.json" not in top or not (WEIGHTS in top or INDEX in top):
        return None
    extra = [f for f in files if f.startswith(TEMPLATES_DIR) and f.endswith(".jinja")]
    weights = [WEIGHTS] if WEIGHTS in top else [INDEX]
    return Plan(tuple([f for f in CONFIG_FILES if f in top] + extra + weights), "", index=WEIGHTS not in top)


def _no_quant(files: list[str], ref: HubRef, where: str) -> HubError:
    quants = gguf_quants(files)
    if not any(_is_model_gguf(f) for f in files):
        return HubError(f"{where} has no GGUF file, so no quant {ref.quant}")
    listed = ", ".join(quants) if quants else "none tagged; files: " + ", ".join(
        f for f in files if _is_model_gguf(f) and _is_first_part(f))
    return HubError(f"{where} has no GGUF file for quant {ref.quant}; its quants: {listed} "
                    f"(pick one: -hf {ref.repo}:QUANT)")


def plan(files: Iterable[str], ref: HubRef, where: str | None = None) -> Plan:
    """What to fetch for `ref` from a repository holding `files` (paths, '/'-separated). `where` names the
    repository (or the cached copy) in the HubError raised when nothing there fits."""
    files = sorted(files)
    where = where or ref.repo
    if ref.file:
        if ref.file not in files:
            ggufs = [f for f in files if f.lower().endswith(".gguf")]
            raise HubError(f"{where} has no file {ref.file}; its GGUF files: {', '.join(ggufs) or 'none'}")
        return Plan(gguf_parts(files, ref.file), ref.file)
    first = choose_gguf(files, ref.quant)
    if first:
        return Plan(gguf_parts(files, first), first)
    if ref.quant:
        raise _no_quant(files, ref, where)
    if st := _safetensors_plan(files):
        return st
    raise HubError(f"{where} has no GGUF file and no safetensors model (config.json with {WEIGHTS} or {INDEX})")


def index_shards(index: Path) -> tuple[str, ...]:
    """The shard files a model.safetensors.index.json's weight_map names (a HubError if it is unreadable)."""
    try:
        weight_map = json.loads(index.read_text()).get("weight_map")
        shards = sorted(set(weight_map.values()))
    except (OSError, ValueError, AttributeError, TypeError) as e:
        raise HubError(f"{index}: not a safetensors index with a weight_map ({type(e).__name__})") from None
    if not all(isinstance(s, str) and s and "/" not in s and s not in (".", "..") for s in shards):
        raise HubError(f"{index}: its weight_map names a shard that is not a plain file name")
    return tuple(shards)


# ------------------------------------------------------------------------------------------ fetching


def _one_line(e: BaseException) -> str:
    text = " ".join(str(e).split())
    return (text[:300] + "...") if len(text) > 300 else text or type(e).__name__


def _is_network_error(e: BaseException) -> bool:
    names = {"ConnectError", "ConnectionError", "TimeoutException", "TransportError", "Timeout", "NetworkError"}
    return isinstance(e, (ConnectionError, TimeoutError)) or any(c.__name__ in names for c in type(e).__mro__)


def _is_server_error(e: Exception) -> bool:
    response = getattr(e, "response", None)
    return getattr(response, "status_code", 0) >= 500


def _hub_error(e: Exception, ref: HubRef) -> HubError | None:
    """The one-line HubError for an error huggingface_hub raised about `ref`; None for a network error or a
    server error (the caller falls back to the cache), and for errors of other kinds."""
    from huggingface_hub import constants, errors
    from huggingface_hub.utils import get_token

    if isinstance(e, errors.GatedRepoError):
        return HubError(f"{ref.repo} is gated: accept its conditions at {constants.ENDPOINT}/{ref.repo} "
                        "and set HF_TOKEN to a token of that account")
    if isinstance(e, errors.RepositoryNotFoundError):
        hint = "HF_TOKEN's account cannot read it" if get_token() else "it is private: set HF_TOKEN"
        return HubError(f"no repository {ref.repo} on the hub (or {hint})")
    if isinstance(e, errors.RevisionNotFoundError):
        return HubError(f"{ref.repo} has no revision {REVISION}")
    if isinstance(e, errors.HfHubHTTPError):
        status = e.response.status_code if e.response is not None else 0
        if status == 401:
            return HubError(f"the hub refused HF_TOKEN for {ref.repo} (401: invalid credentials)")
        if status < 500:
            return HubError(f"the hub answered {status} for {ref}: {_one_line(e)}")
    return None


def _storage(repo: str) -> Path:
    from huggingface_hub import constants
    from huggingface_hub.file_download import repo_folder_name

    return Path(constants.HF_HUB_CACHE).expanduser() / repo_folder_name(repo_id=repo, repo_type="model")


def _listing(ref: HubRef) -> list[str]:
    """The repository's file paths, as the hub lists them at REVISION."""
    from huggingface_hub import HfApi

    info = HfApi().model_info(ref.repo, revision=REVISION)
    return [s.rfilename for s in info.siblings or ()]


def _download(ref: HubRef, todo: Plan) -> Path:
    """Fetch the plan's files (and, for an index, its shards) into the cache; the snapshot folder."""
    from huggingface_hub import hf_hub_download, snapshot_download

    files = todo.files
    if todo.index:
        index = Path(hf_hub_download(ref.repo, INDEX, revision=REVISION))
        files = files + index_shards(index)
    folder = snapshot_download(ref.repo, revision=REVISION, allow_patterns=[glob.escape(f) for f in files])
    return _checked(Path(folder), files, ref, f"the download of {ref} is incomplete")


def _checked(folder: Path, files: Iterable[str], ref: HubRef, why: str) -> Path:
    missing = [f for f in files if not (folder / f).is_file()]
    if missing:
        raise HubError(f"{why}: {missing[0]} is missing from {folder}")
    return folder


def _from_cache(ref: HubRef, why: str) -> tuple[Path, Plan]:
    """The cached snapshot that holds everything `ref` needs, and the plan, found without the network (the choice
    is made among the cached files, as llama.cpp does); `why` says why the hub is not asked and begins each
    HubError."""
    storage = _storage(ref.repo)
    head = storage / "refs" / REVISION
    if not head.is_file():
        raise HubError(f"{why} and {ref.repo} is not in the cache at {storage.parent}")
    folder = storage / "snapshots" / head.read_text().strip()
    cached = [p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file()] if folder.is_dir() else []
    todo = plan(cached, ref, where=f"{why} and the cached copy of {ref.repo} ({folder})")
    files = todo.files
    if todo.index:
        files = files + index_shards(_checked(folder, [INDEX], ref, why) / INDEX)
    return _checked(folder, files, ref, f"{why} and the cached copy of {ref} is incomplete"), todo


def _offline() -> bool:
    from huggingface_hub import constants

    check = getattr(constants, "is_offline_mode", None)
    return check() if callable(check) else bool(constants.HF_HUB_OFFLINE)


def _fetch(ref: HubRef) -> tuple[Path, Plan]:
    """The snapshot folder holding `ref`'s files, downloaded or found in the cache, and the plan."""
    from huggingface_hub import constants

    if _offline():
        return _from_cache(ref, "HF_HUB_OFFLINE is set")
    try:
        todo = plan(_listing(ref), ref)
        return _download(ref, todo), todo
    except HubError:
        raise
    except Exception as e:  # noqa: BLE001 - huggingface_hub's and its HTTP client's errors, made one line here
        if (known := _hub_error(e, ref)) is not None:
            raise known from None
        if not (_is_network_error(e) or _is_server_error(e)):
            raise HubError(f"fetching {ref} failed: {_one_line(e)}") from None
        why = f"cannot reach the hub at {constants.ENDPOINT} ({_one_line(e)})"
    found = _from_cache(ref, why)
    print(f"note: {why}; using the cached copy of {ref} (HF_HUB_OFFLINE=1 skips the hub)", file=sys.stderr)
    return found


@contextlib.contextmanager
def _progress_bars(on: bool) -> Iterator[None]:
    from huggingface_hub.utils import are_progress_bars_disabled, disable_progress_bars, enable_progress_bars

    if on or are_progress_bars_disabled():
        yield
        return
    disable_progress_bars()
    try:
        yield
    finally:
        enable_progress_bars()


def resolve(model: str | None, hf_repo: str | None = None, hf_file: str | None = None, *,
            progress: bool = True) -> str | None:
    """The local path to load for `-m MODEL` / `-hf REPO[:QUANT]` / `--hf-file FILE`: a hub reference is
    downloaded (or found in the cache) and its local path returned (a GGUF file — the first part of a split
    model, its other parts downloaded beside it — or a folder with config.json, tokenizer files and
    *.safetensors); anything else (None, a local path, a built-in name) is returned unchanged."""
    ref = parse(model, hf_repo, hf_file)
    if ref is None:
        return model
    with _progress_bars(progress):
        folder, todo = _fetch(ref)
    return str(folder / todo.load) if todo.load else str(folder)
