"""A local stand-in for the Hugging Face Hub, for tests: repositories served in the hub's URL layout to a real
huggingface_hub client pointed at it through HF_ENDPOINT.

The routes huggingface_hub (2.x) calls to resolve and download a model, answered as the hub answers them:

- `GET /api/models/{repo}` and `/api/models/{repo}/revision/{rev}`: the model's info (`sha`, `siblings`);
- `GET /api/models/{repo}/tree/{rev}?recursive=...`: the file listing (`lfs` for the large files);
- `HEAD` and `GET /{repo}/resolve/{rev}/{path}`: a file, with `X-Repo-Commit`, `ETag`, `X-Linked-Etag` and
  `X-Linked-Size` (large files), `Content-Length`, and `Range` requests (206 with `Content-Range`).

No `X-Xet-Hash` header is ever sent, so the client takes the plain HTTP path. Errors carry the hub's
`X-Error-Code` (RepoNotFound, RevisionNotFound, EntryNotFound, GatedRepo). A private repository is served only
with `Authorization: Bearer <token>`; a gated one lists its files but refuses to send them.

`cut[path] = n` cuts the first GET of that file after n bytes (headers announce the whole file), as a dropped
connection does. `log` holds (method, path, Range header) for every request.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlsplit

import gguf

LFS_SUFFIXES = (".gguf", ".safetensors", ".bin")


@dataclass
class Repo:
    """A repository: its files (path -> bytes) at one commit, and who may read them."""

    files: dict[str, bytes]
    sha: str = ""
    private: bool = False
    gated: bool = False

    def __post_init__(self):
        if not self.sha:
            self.sha = hashlib.sha1(json.dumps(sorted(self.files)).encode()).hexdigest()


@dataclass
class HubServer:
    """The served repositories (id -> Repo), on 127.0.0.1 at a free port, in a background thread."""

    repos: dict[str, Repo]
    token: str = "hf_moerun_test"
    cut: dict[str, int] = field(default_factory=dict)
    log: list[tuple[str, str, str | None]] = field(default_factory=list)

    def __enter__(self):
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(self))
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, args=(0.05,), daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def stop(self) -> None:
        """Stop serving and free the port (a client then finds nothing listening there)."""
        self._server.shutdown()
        self._server.server_close()

    @property
    def url(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}"

    def gets(self) -> list[str]:
        """The paths of the files fetched with GET (resolve URLs only), in order."""
        return [p.split("/resolve/", 1)[1].split("/", 1)[1] for m, p, _ in self.log
                if m == "GET" and "/resolve/" in p]


def _entry(path: str, data: bytes) -> dict:
    blob = hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()
    out = {"type": "file", "oid": blob, "size": len(data), "path": path}
    if path.endswith(LFS_SUFFIXES):
        out["lfs"] = {"oid": hashlib.sha256(data).hexdigest(), "size": len(data), "pointerSize": 134}
    return out


def _handler(hub: HubServer) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        """One request to the stand-in hub."""

        def log_message(self, *args) -> None:
            pass

        def do_HEAD(self) -> None:
            self._route(body=False)

        def do_GET(self) -> None:
            self._route(body=True)

        def _route(self, body: bool) -> None:
            path = unquote(urlsplit(self.path).path)
            hub.log.append((self.command, path, self.headers.get("Range")))
            parts = path.strip("/").split("/")
            if parts[:2] == ["api", "models"] and len(parts) >= 4:
                self._api("/".join(parts[2:4]), parts[4:], body)
            elif len(parts) >= 5 and parts[2] == "resolve":
                self._file("/".join(parts[:2]), parts[3], "/".join(parts[4:]), body)
            else:
                self._error(404, None, "Not found", body)

        def _repo(self, repo_id: str, body: bool) -> Repo | None:
            repo = hub.repos.get(repo_id)
            if repo is None:
                self._error(404, "RepoNotFound", "Repository not found", body)
            elif repo.private and self.headers.get("Authorization") != f"Bearer {hub.token}":
                self._error(401, "RepoNotFound", "Repository not found", body)
            else:
                return repo
            return None

        def _revision(self, repo: Repo, rev: str, body: bool) -> bool:
            if rev in ("main", repo.sha):
                return True
            self._error(404, "RevisionNotFound", "Invalid rev id", body)
            return False

        def _api(self, repo_id: str, rest: list[str], body: bool) -> None:
            repo = self._repo(repo_id, body)
            if repo is None:
                return
            if not rest or rest[0] == "revision":
                if rest and not self._revision(repo, "/".join(rest[1:]), body):
                    return
                info = {"_id": repo.sha[:24], "id": repo_id, "sha": repo.sha, "private": repo.private,
                        "gated": "manual" if repo.gated else False, "disabled": False, "tags": [],
                        "siblings": [{"rfilename": p} for p in sorted(repo.files)]}
                self._json(info, body)
            elif rest[0] == "tree" and len(rest) >= 2 and self._revision(repo, rest[1], body):
                under = "/".join(rest[2:])
                self._json([_entry(p, d) for p, d in sorted(repo.files.items()) if p.startswith(under)], body)
            elif rest[0] != "tree":
                self._error(404, None, "Not found", body)

        def _file(self, repo_id: str, rev: str, path: str, body: bool) -> None:
            repo = self._repo(repo_id, body)
            if repo is None or not self._revision(repo, rev, body):
                return
            if repo.gated:
                self._error(403, "GatedRepo", "Access to model is restricted", body)
                return
            data = repo.files.get(path)
            if data is None:
                self._error(404, "EntryNotFound", "Entry not found", body, {"X-Repo-Commit": repo.sha})
                return
            start = 0
            rng = self.headers.get("Range")
            if rng and rng.startswith("bytes=") and body:
                start = int(rng[len("bytes="):].split("-")[0])
            self.send_response(206 if start else 200)
            etag = _entry(path, data).get("lfs", {}).get("oid") or _entry(path, data)["oid"]
            self.send_header("X-Repo-Commit", repo.sha)
            self.send_header("ETag", f'"{etag}"')
            if path.endswith(LFS_SUFFIXES):
                self.send_header("X-Linked-Etag", f'"{etag}"')
                self.send_header("X-Linked-Size", str(len(data)))
            self.send_header("Accept-Ranges", "bytes")
            self.send_header("Content-Length", str(len(data) - start))
            if start:
                self.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
            self.end_headers()
            if not body:
                return
            cut = hub.cut.pop(path, None) if not start else None
            self.wfile.write(data[start:] if cut is None else data[:cut])
            self.wfile.flush()
            if cut is not None:
                self.close_connection = True

        def _json(self, obj, body: bool) -> None:
            data = json.dumps(obj).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            if body:
                self.wfile.write(data)

        def _error(self, status: int, code: str | None, message: str, body: bool, headers: dict | None = None):
            data = json.dumps({"error": message}).encode()
            self.send_response(status)
            if code:
                self.send_header("X-Error-Code", code)
            self.send_header("X-Error-Message", message)
            for k, v in (headers or {}).items():
                self.send_header(k, v)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            if body:
                self.wfile.write(data)

    return Handler


# ------------------------------------------------------------------------------------------ models to serve


def write_split(src: Path, prefix: Path, parts: int = 2) -> list[Path]:
    """Split a GGUF file as llama.cpp's gguf-split does (split.no / split.count / split.tensors.count in every
    part, tensors spread over the parts): `prefix`-0000i-of-0000n.gguf, the paths written."""
    prefix.parent.mkdir(parents=True, exist_ok=True)
    reader = gguf.GGUFReader(src)
    arch = reader.fields["general.architecture"].contents()
    writer = gguf.GGUFWriter(f"{prefix}.gguf", arch, split_max_tensors=-(-len(reader.tensors) // parts))
    for f in reader.fields.values():
        if f.name.startswith("GGUF.") or f.name == "general.architecture":
            continue
        vtype = f.types[0]
        writer.add_key_value(f.name, f.contents(), vtype,
                             sub_type=f.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None)
    for t in reader.tensors:
        writer.add_tensor(t.name, t.data, raw_dtype=t.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return [Path(f"{prefix}-{i:05d}-of-{parts:05d}.gguf") for i in range(1, parts + 1)]


def write_shards(folder: Path) -> None:
    """Rewrite a Hugging Face folder's model.safetensors as two shards and model.safetensors.index.json."""
    from safetensors.torch import load_file, save_file

    tensors = load_file(folder / "model.safetensors")
    names = sorted(tensors)
    halves = [names[: len(names) // 2], names[len(names) // 2:]]
    weight_map = {}
    for i, half in enumerate(halves, 1):
        shard = f"model-{i:05d}-of-00002.safetensors"
        save_file({n: tensors[n] for n in half}, folder / shard, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(half, shard))
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (folder / "model.safetensors").unlink()


def read_folder(folder: Path) -> dict[str, bytes]:
    """path ('/'-separated, relative to the folder) -> bytes, for every file under it."""
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


# ------------------------------------------------------------------------------------------ the client

_CLIENT = """
import json, sys
from moerun.errors import MoerunError
from moerun.hub import resolve
out = []
for call in json.loads(sys.argv[1]):
    try:
        out.append(["ok", resolve(*call["args"], progress=call.get("progress", False))])
    except MoerunError as e:
        out.append(["error", str(e)])
print(json.dumps(out))
"""


def hub_env(home: Path, endpoint: str, **extra: str) -> dict[str, str]:
    """The environment of a client of the stand-in: this one without HF_* settings, HF_HOME=home, HF_ENDPOINT."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGINGFACE_"))}
    env.update(HF_HOME=str(home), HF_ENDPOINT=endpoint, HF_HUB_DISABLE_TELEMETRY="1", **extra)
    return env


def run_resolve(env: dict[str, str], *calls: dict, timeout: float = 60) -> tuple[list[list[str]], str]:
    """moerun.hub.resolve(*call["args"], progress=call.get("progress", False)) for each call, in one fresh
    Python process with `env` (huggingface_hub reads HF_ENDPOINT and HF_HUB_OFFLINE when imported):
    (["ok", path] or ["error", message] per call, the process's stderr)."""
    p = subprocess.run([sys.executable, "-c", _CLIENT, json.dumps(list(calls))], env=env, check=False,
                       capture_output=True, text=True, timeout=timeout)
    assert p.returncode == 0, p.stderr
    return json.loads(p.stdout), p.stderr
