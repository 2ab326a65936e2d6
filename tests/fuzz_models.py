"""Model-file fuzzing: hypothesis strategies that mutate valid GGUF files and Hugging Face folders, and the
check every mutant must pass (what `moerun inspect` does ends in success or a MoerunError, without hanging or
allocating what a header claims). Used by tests/test_fuzz_formats.py (short, in CI) and
bench/fuzz_formats.py (long runs).

A case is a list of ops, plain tuples naming what they change (a KV key, a tensor name, a field label), so
a failing case reads as what it does and can be pinned with @example.
"""

from __future__ import annotations

import json
import re
import shutil
import signal
import struct
import tracemalloc
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from hypothesis import strategies as st

from moerun.arch import resolve
from moerun.arch.summary import summarize
from moerun.errors import MoerunError
from moerun.formats import open_model

GGUF_BASES = (("tiny-qwen3moe", "F32"), ("tiny-qwen2moe", "Q8_0"))
HF_BASES = ("tiny-mixtral", "tiny-qwen2moe")
TIME_LIMIT_S = 120.0  # a hang guard: a case runs in milliseconds, and no loaded machine comes near it
MEMORY_LIMIT = 64 * 2**20
DELETE = "<delete>"

# ---------------------------------------------------------------------------------------------- bases


def build_bases(root: Path) -> dict[str, Path]:
    """Valid tiny models: name -> GGUF file or Hugging Face folder (config.json + model.safetensors)."""
    from moerun.tools.make_model import make_model

    root.mkdir(parents=True, exist_ok=True)
    out = {}
    for preset, ftype in GGUF_BASES:
        path = root / f"{preset}-{ftype}.gguf"
        if not path.exists():
            make_model(preset, path, ftype=ftype, progress=False, threads=1)
        out[path.name] = path
    for preset in HF_BASES:
        folder = root / f"{preset}-hf"
        if not folder.exists():
            make_model(preset, folder, fmt="safetensors", progress=False, threads=1)
        out[folder.name] = folder
    return out


# ---------------------------------------------------------------------------------------------- GGUF layout

_SCALAR_FMT = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q",
               12: "<d"}
_STRING, _ARRAY = 8, 9


@dataclass(frozen=True)
class Field:
    pos: int
    width: int
    value: int


@dataclass(repr=False)
class GgufLayout:
    """Where every header field of a valid GGUF file is: labelled fields, KV spans, header end, data start."""

    blob: bytes
    fields: dict[str, Field]
    kv_spans: dict[str, tuple[int, int]]
    header_end: int
    data_start: int


class _Walker:
    def __init__(self, blob: bytes):
        self.blob, self.pos, self.fields = blob, 0, {}

    def num(self, label: str | None, fmt: str) -> int:
        width = struct.calcsize(fmt)
        (v,) = struct.unpack_from(fmt, self.blob, self.pos)
        if label is not None and fmt[1] in "IQ":
            self.fields[label] = Field(self.pos, width, v)
        self.pos += width
        return v

    def string(self, label: str | None) -> str:
        n = self.num(label and f"{label}.len", "<Q")
        self.pos += n
        return self.blob[self.pos - n:self.pos].decode()

    def value(self, vtype: int, label: str | None) -> None:
        if vtype in _SCALAR_FMT:
            self.num(label, _SCALAR_FMT[vtype])
        elif vtype == _STRING:
            self.string(label)
        else:
            itype = self.num(label and f"{label}.itype", "<I")
            n = self.num(label and f"{label}.count", "<Q")
            for i in range(n):
                self.value(itype, label and i < 3 and f"{label}[{i}]" or None)


def gguf_layout(blob: bytes) -> GgufLayout:
    w = _Walker(blob)
    w.pos = 4
    w.num("version", "<I")
    n_tensors, n_kv = w.num("n_tensors", "<Q"), w.num("n_kv", "<Q")
    spans = {}
    for _ in range(n_kv):
        start = w.pos
        key = w.string(None)
        w.fields[f"kv[{key}].len"] = Field(start, 8, len(key.encode()))
        vtype = w.num(f"kv[{key}].type", "<I")
        w.value(vtype, f"kv[{key}]")
        spans[key] = (start, w.pos)
    for _ in range(n_tensors):
        start = w.pos
        name = w.string(None)
        w.fields[f"tensor[{name}].name_len"] = Field(start, 8, len(name.encode()))
        n_dims = w.num(f"tensor[{name}].n_dims", "<I")
        for d in range(n_dims):
            w.num(f"tensor[{name}].ne{d}", "<Q")
        w.num(f"tensor[{name}].ggml_type", "<I")
        w.num(f"tensor[{name}].offset", "<Q")
    align = 32
    return GgufLayout(blob, w.fields, spans, w.pos, -(-w.pos // align) * align)


# ---------------------------------------------------------------------------------------------- GGUF values


def encode_value(vtype: int, value) -> bytes:
    """A GGUF value of type vtype (without the type id); arrays are (item type, [values])."""
    if vtype in _SCALAR_FMT:
        return struct.pack(_SCALAR_FMT[vtype], value)
    if vtype == _STRING:
        raw = value if isinstance(value, bytes) else value.encode("utf-8", "surrogatepass")
        return struct.pack("<Q", len(raw)) + raw
    itype, items = value
    return struct.pack("<IQ", itype, len(items)) + b"".join(encode_value(itype, v) for v in items)


def encode_kv(key: str, vtype: int, value) -> bytes:
    return encode_value(_STRING, key) + struct.pack("<I", vtype) + encode_value(vtype, value)


_INT_RANGES = {0: (0, 2**8 - 1), 1: (-(2**7), 2**7 - 1), 2: (0, 2**16 - 1), 3: (-(2**15), 2**15 - 1),
               4: (0, 2**32 - 1), 5: (-(2**31), 2**31 - 1), 10: (0, 2**64 - 1), 11: (-(2**63), 2**63 - 1)}
INTERESTING_INTS = (0, 1, 2, 3, 4, 7, 8, 16, 31, 32, 48, 64, 255, 256, 4095, 65535, 65536, 2**31 - 1, 2**31,
                    2**32 - 1, 2**32, 2**40, 2**60, 2**62, 2**63 - 1, 2**63, 2**64 - 1)


def _ints_for(lo: int, hi: int) -> st.SearchStrategy[int]:
    edges = [v for v in INTERESTING_INTS + tuple(-v for v in INTERESTING_INTS) if lo <= v <= hi]
    return st.one_of(st.sampled_from(edges), st.integers(lo, hi))


def _typed_scalar() -> st.SearchStrategy[tuple[int, object]]:
    ints = [st.tuples(st.just(t), _ints_for(lo, hi)) for t, (lo, hi) in _INT_RANGES.items()]
    floats = [st.tuples(st.just(6), st.floats(width=32)), st.tuples(st.just(12), st.floats())]
    return st.one_of(*ints, *floats, st.tuples(st.just(7), st.booleans()),
                     st.tuples(st.just(_STRING), st.text(max_size=40)))


def typed_values() -> st.SearchStrategy[tuple[int, object]]:
    """(GGUF value type, value): scalars of every type, strings, arrays of scalars, strings and arrays."""
    def arrays(inner):
        return inner.flatmap(lambda tv: st.lists(st.just(tv[1]), max_size=4).map(
            lambda items, t=tv[0]: (_ARRAY, (t, items))))
    return st.recursive(_typed_scalar(), arrays, max_leaves=6)


# ---------------------------------------------------------------------------------------------- GGUF ops


def cut_points(size: int, marks: list[int]) -> st.SearchStrategy[int]:
    """Where to truncate a file of `size` bytes: anywhere (uniformly, not hypothesis' small-number bias),
    or within a few bytes of a section or field boundary."""
    anywhere = st.randoms(use_true_random=False).map(lambda r: r.randrange(size))
    near = st.tuples(st.sampled_from(sorted(set(marks))), st.integers(-2, 9)).map(lambda m: max(0, m[0] + m[1]))
    return anywhere | near.map(lambda p: min(p, size - 1))


def _u(value: int, width: int) -> bytes:
    return (value % (1 << 8 * width)).to_bytes(width, "little")


def apply_gguf(layout: GgufLayout, ops: list[tuple]) -> bytes:
    """Apply ops in order: ("field", label, value), ("flip", pos, byte), ("set_kv", key, (vtype, value)),
    ("drop_kv", key), ("truncate", pos). Field and flip positions refer to the unmodified file; KV edits
    rebuild the header (n_kv fixed up, data re-padded to 32) and must come before byte edits."""
    blob = layout.blob
    for op in ops:
        kind = op[0]
        if kind in ("set_kv", "drop_kv"):
            blob = _edit_kv(layout, blob, op)
        elif kind == "field":
            f = layout.fields[op[1]]
            blob = blob[:f.pos] + _u(op[2], f.width) + blob[f.pos + f.width:]
        elif kind == "flip":
            pos = op[1] % len(blob)
            blob = blob[:pos] + bytes([op[2]]) + blob[pos + 1:]
        elif kind == "truncate":
            blob = blob[:op[1]]
        else:
            raise ValueError(kind)
    return blob


def _edit_kv(layout: GgufLayout, blob: bytes, op: tuple) -> bytes:
    if len(blob) != len(layout.blob):
        raise ValueError("KV edits come first")
    key = op[1]
    start, end = layout.kv_spans.get(key, (layout.fields["n_kv"].pos + 8,) * 2)
    n_kv = layout.fields["n_kv"].value
    if op[0] == "drop_kv":
        new, n_kv = b"", n_kv - (key in layout.kv_spans)
    else:
        new, n_kv = encode_kv(key, *op[2]), n_kv + (key not in layout.kv_spans)
    head = blob[:start] + new + blob[end:layout.header_end]
    head = head[:16] + struct.pack("<Q", n_kv) + head[24:]
    return head + b"\0" * (-len(head) % 32) + blob[layout.data_start:]


GGUF_KEYS = ("general.alignment", "general.architecture", "qwen3moe.block_count", "qwen2moe.block_count",
             "qwen3moe.attention.head_count", "qwen2moe.attention.head_count_kv", "llama.expert_count")


@st.composite
def gguf_cases(draw, layouts: dict[str, GgufLayout]) -> tuple[str, list[tuple]]:
    """(base name, ops): one KV edit, field edits or byte flips, then maybe a truncation."""
    name = draw(st.sampled_from(sorted(layouts)))
    layout = layouts[name]
    ops: list[tuple] = []
    kind = draw(st.sampled_from(["field", "field", "kv", "kv", "flip", "none"]))
    if kind == "kv":
        key = draw(st.sampled_from(sorted(layout.kv_spans)) | st.sampled_from(GGUF_KEYS) | st.text(max_size=20))
        drop = draw(st.booleans()) if key in layout.kv_spans else False
        ops.append(("drop_kv", key) if drop else ("set_kv", key, draw(typed_values())))
    elif kind == "field":
        for label in draw(st.lists(st.sampled_from(sorted(layout.fields)), min_size=1, max_size=3)):
            f = layout.fields[label]
            near = st.sampled_from([f.value - 1, f.value + 1, f.value * 2, f.value + 2**32])
            ops.append(("field", label, draw(near | _ints_for(0, 2**(8 * f.width) - 1))))
    elif kind == "flip":
        hi = layout.header_end if draw(st.booleans()) else len(layout.blob) - 1
        ops += [("flip", p, b) for p, b in draw(st.lists(st.tuples(st.integers(0, hi), st.integers(0, 255)),
                                                          min_size=1, max_size=8))]
    if kind == "none" or draw(st.integers(0, 3)) == 0:
        marks = [f.pos for f in layout.fields.values()] + [layout.header_end, layout.data_start]
        ops.append(("truncate", draw(cut_points(len(layout.blob), marks))))
    return name, ops


# ---------------------------------------------------------------------------------------------- safetensors


@dataclass
class HfBase:
    header: dict = field(repr=False)
    data: bytes = field(repr=False)
    config: dict = field(repr=False)


def hf_base(folder: Path) -> HfBase:
    blob = (folder / "model.safetensors").read_bytes()
    (n,) = struct.unpack_from("<Q", blob)
    config = json.loads((folder / "config.json").read_text())
    return HfBase(json.loads(blob[8:8 + n]), blob[8 + n:], config)


def json_values(ints: st.SearchStrategy[int] | None = None) -> st.SearchStrategy:
    ints = _ints_for(-(2**64), 2**64) if ints is None else ints
    leaves = st.none() | st.booleans() | ints | st.floats() | st.text(max_size=12) | st.integers(-(10**30), 10**30)
    return st.recursive(leaves, lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=8), c, max_size=3),
                        max_leaves=8)


_DTYPES = ("F32", "F16", "BF16", "I64", "F64", "U8", "BOOL", "F8_E4M3", "Q4", "", "f32")
_BIG = _ints_for(0, 2**64)


def _shapes() -> st.SearchStrategy:
    return st.lists(st.sampled_from([0, 1, 2, 8, 64, 2**31, 2**32, 2**60, 2**63, -1]) | _BIG, max_size=9)


def _offsets(data_len: int) -> st.SearchStrategy:
    near = st.sampled_from([0, 4, data_len - 4, data_len, data_len + 1, 2**63, 2**64, -8])
    return st.lists(near | _BIG, min_size=0, max_size=3)


def _hf_tensor_op(draw, base: HfBase) -> tuple:
    names = sorted(k for k in base.header if k != "__metadata__")
    name = draw(st.sampled_from(names))
    what = draw(st.sampled_from(["dtype", "shape", "data_offsets", "entry", "rename", "copy_offsets"]))
    if what == "rename":
        huge = st.sampled_from(["model.layers.0.mlp.experts.99999999999.gate_proj.weight",
                                "model.layers.99999999999.input_layernorm.weight",
                                "model.layers.0.block_sparse_moe.experts.4000000000.w1.weight"])
        return ("rename", name, draw(huge | st.text(max_size=60)))
    if what == "copy_offsets":
        return ("tensor", name, "data_offsets", base.header[draw(st.sampled_from(names))]["data_offsets"])
    values = {"dtype": st.sampled_from(_DTYPES) | json_values(), "shape": _shapes() | json_values(),
              "data_offsets": _offsets(len(base.data)) | json_values(), "entry": json_values()}[what]
    return ("tensor", name, what, draw(st.just(DELETE) | values))


def _hf_config_op(draw, base: HfBase) -> tuple:
    keys = sorted(base.config) + ["rope_scaling", "rope_parameters", "mlp_only_layers", "decoder_sparse_step",
                                  "use_sliding_window", "num_hidden_layers", "num_attention_heads", "head_dim"]
    key = draw(st.sampled_from(keys))
    value = draw(st.just(DELETE) | json_values(_ints_for(-(2**63), 2**64)))
    return ("config", key, value)


@st.composite
def hf_cases(draw, bases: dict[str, HfBase]) -> tuple[str, list[tuple]]:
    """(base name, ops): header JSON, header length, raw header, config.json edits; then maybe byte edits."""
    name = draw(st.sampled_from(sorted(bases)))
    base = bases[name]
    kind = draw(st.sampled_from(["tensor", "tensor", "tensor", "config", "config", "header_len", "raw_header",
                                 "config_raw", "metadata", "flip", "none"]))
    ops: list[tuple] = []
    if kind == "tensor":
        ops += [_hf_tensor_op(draw, base) for _ in range(draw(st.integers(1, 2)))]
    elif kind == "config":
        ops.append(_hf_config_op(draw, base))
    elif kind == "header_len":
        ops.append(("header_len", draw(_ints_for(0, 2**64 - 1))))
    elif kind in ("raw_header", "config_raw"):
        ops.append((kind, draw(st.binary(max_size=64) | st.text(max_size=64).map(str.encode))))
    elif kind == "metadata":
        ops.append(("tensor", "__metadata__", "entry", draw(json_values())))
    elif kind == "flip":
        hi = 8 + len(_header_bytes(base.header))
        ops += [("flip", p, b) for p, b in draw(st.lists(st.tuples(st.integers(0, hi), st.integers(0, 255)),
                                                          min_size=1, max_size=8))]
    if kind == "none" or draw(st.integers(0, 3)) == 0:
        head = 8 + len(_header_bytes(base.header))
        ops.append(("truncate", draw(cut_points(head + len(base.data), [0, 8, head]))))
    return name, ops


def _header_bytes(header: dict) -> bytes:
    raw = json.dumps(header, separators=(",", ":")).encode()
    return raw + b" " * (-len(raw) % 8)


def apply_hf(base: HfBase, ops: list[tuple]) -> tuple[bytes, bytes]:
    """(model.safetensors bytes, config.json bytes) after the ops. Structured ops (tensor, rename, config,
    header_len, raw_header, config_raw) are applied before byte ops (flip, truncate)."""
    header, config = json.loads(json.dumps(base.header)), dict(base.config)
    raw_header = length = raw_config = None
    for op in ops:
        kind = op[0]
        if kind == "tensor":
            _set_entry(header, *op[1:])
        elif kind == "rename" and op[1] in header:
            header[op[2]] = header.pop(op[1])
        elif kind == "config":
            _set(config, op[1], op[2])
        elif kind == "header_len":
            length = op[1]
        elif kind == "raw_header":
            raw_header = op[1]
        elif kind == "config_raw":
            raw_config = op[1]
    head = _header_bytes(header) if raw_header is None else raw_header
    blob = _u(len(head) if length is None else length, 8) + head + base.data
    for op in ops:
        if op[0] == "flip":
            pos = op[1] % len(blob)
            blob = blob[:pos] + bytes([op[2]]) + blob[pos + 1:]
        elif op[0] == "truncate":
            blob = blob[:op[1]]
    return blob, raw_config if raw_config is not None else json.dumps(config).encode()


def _set(d: dict, key: str, value) -> None:
    if value == DELETE:
        d.pop(key, None)
    else:
        d[key] = value


def _set_entry(header: dict, name: str, what: str, value) -> None:
    if what == "entry":
        _set(header, name, value)
    elif isinstance(header.get(name), dict):
        _set(header[name], what, value)


def write_hf(folder: Path, blob: bytes, config: bytes) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "model.safetensors").write_bytes(blob)
    (folder / "config.json").write_bytes(config)
    return folder


def copy_base(src: Path, dst: Path) -> Path:
    if src.is_dir():
        shutil.copytree(src, dst, dirs_exist_ok=True)
    else:
        shutil.copyfile(src, dst)
    return dst


# ---------------------------------------------------------------------------------------------- the check


class Hang(BaseException):
    """Raised by the alarm when one case runs past TIME_LIMIT_S (a BaseException: nothing may swallow it)."""


@contextmanager
def time_limit(seconds: float):
    def fire(*_):
        raise Hang(f"no result within {seconds} s")

    old = signal.signal(signal.SIGALRM, fire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def inspect_model(path: Path) -> dict:
    """What `moerun inspect` computes: open, resolve, summarize (the CLI adds only formatting)."""
    with open_model(path) as mf:
        arch = resolve(mf)
        info = summarize(arch).to_dict()
        info["qtypes"] = sorted({src.records[0].qtype.name for src in arch.sources.values()})
    json.dumps(info)
    return info


def message_class(e: BaseException) -> str:
    """An error message with names and numbers blanked, cut to its first words: groups like errors."""
    text = getattr(e, "problem", None) or str(e)
    text = re.sub(r"'(?:[^'\\]|\\.)*'|\"(?:[^\"\\]|\\.)*\"", "'X'", text)
    text = re.sub(r"-?\d+(?:\.\d+)?(?:e[-+]?\d+)?", "N", text)
    text = re.sub(r"\[[^\]]*\]", "[..]", text)
    return " ".join(text.split()[:7])


@dataclass
class Outcome:
    kind: str  # "ok", "error" (a MoerunError), "bug" (anything else, a hang, or too much memory)
    label: str
    peak_bytes: int
    exc: BaseException | None = None


def check(path: Path, run: Callable[[Path], object] = inspect_model, memory_limit: int = MEMORY_LIMIT) -> Outcome:
    """Run `run(path)` under the time limit, with tracemalloc's peak over the call recorded."""
    started = not tracemalloc.is_tracing()
    if started:
        tracemalloc.start()
    tracemalloc.reset_peak()
    base = tracemalloc.get_traced_memory()[0]
    try:
        with time_limit(TIME_LIMIT_S):
            run(path)
        outcome = Outcome("ok", "ok", 0)
    except MoerunError as e:
        bad = "\n" in str(e) or "MemoryError" in str(e) or "RecursionError" in str(e)
        outcome = Outcome("bug" if bad else "error", f"{type(e).__name__}: {message_class(e)}", 0, e)
    except (Exception, Hang) as e:  # noqa: BLE001 - whatever else escapes is the finding
        outcome = Outcome("bug", f"{type(e).__name__}: {str(e)[:120]}", 0, e)
    outcome.peak_bytes = tracemalloc.get_traced_memory()[1] - base
    if started:
        tracemalloc.stop()
    if outcome.kind != "bug" and outcome.peak_bytes > memory_limit:
        outcome = Outcome("bug", f"peak allocation {outcome.peak_bytes >> 20} MiB", outcome.peak_bytes)
    return outcome
