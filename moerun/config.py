"""Frozen configuration objects, each validated in one place (`__post_init__` raises ValueError).

SamplingParams carries llama.cpp's defaults and meanings, so a llama.cpp command line or an OpenAI
request maps onto it field by field. RuntimeConfig: devices, budgets, cache. ServerConfig: how `moerun serve`
listens and admits requests.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from pathlib import Path

from moerun.experts.policy import POLICIES

_MAX_SEED = 2**64  # torch.Generator.manual_seed takes an unsigned 64-bit seed


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_number(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


@dataclass(frozen=True)
class SamplingParams:
    """How one request picks its tokens. Defaults are llama.cpp's.

    temperature        <= 0 means greedy (argmax after the penalties); otherwise logits are divided by it
                       after truncation (llama.cpp's order: penalties, top-k, top-p, min-p, temperature).
    top_k              keep the k most likely tokens; <= 0 disables.
    top_p              keep the smallest most-likely set whose probability sums to >= top_p; 1 disables.
    min_p              drop tokens whose probability is below min_p * p(most likely); 0 disables.
    repeat_penalty     for tokens seen in the last `repeat_last_n` tokens: positive logits are divided by
                       it, others multiplied; 1 disables.
    repeat_last_n      penalty window over prompt + generated tokens; 0 disables, -1 means all of them.
    presence_penalty   OpenAI's: logit -= presence_penalty if the token occurs in the window.
    frequency_penalty  OpenAI's: logit -= frequency_penalty * (times the token occurs in the window).
    seed               same seed, same tokens; None draws a random seed (the Sampler reports it).
    max_tokens         most tokens to generate.
    stop               strings that end generation; the stop string itself is not returned.
    ignore_eos         keep generating past end-of-sequence tokens.
    """

    temperature: float = 0.8
    top_k: int = 40
    top_p: float = 0.95
    min_p: float = 0.05
    repeat_penalty: float = 1.0
    repeat_last_n: int = 64
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    max_tokens: int = 128
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        problems: list[str] = []
        for name in ("temperature", "top_p", "min_p", "repeat_penalty", "presence_penalty",
                     "frequency_penalty"):
            value = getattr(self, name)
            if not _is_number(value) or not math.isfinite(value):
                problems.append(f"{name} must be a finite number, got {value!r}")
            else:
                object.__setattr__(self, name, float(value))
        for name in ("top_k", "repeat_last_n", "max_tokens"):
            if not _is_int(getattr(self, name)):
                problems.append(f"{name} must be an integer, got {getattr(self, name)!r}")
        if problems:  # the range checks below assume the types are right
            raise ValueError("invalid sampling parameters: " + "; ".join(problems))

        if not 0.0 <= self.top_p <= 1.0:
            problems.append(f"top_p must be in [0, 1] (1 disables), got {self.top_p}")
        if not 0.0 <= self.min_p <= 1.0:
            problems.append(f"min_p must be in [0, 1] (0 disables), got {self.min_p}")
        if self.repeat_penalty <= 0.0:
            problems.append(f"repeat_penalty must be > 0 (1 disables), got {self.repeat_penalty}")
        if self.repeat_last_n < -1:
            problems.append(f"repeat_last_n must be >= -1 (0 disables, -1 = whole history), "
                            f"got {self.repeat_last_n}")
        if self.max_tokens < 1:
            problems.append(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.seed is not None and not (_is_int(self.seed) and 0 <= self.seed < _MAX_SEED):
            problems.append(f"seed must be None (random) or an integer in [0, 2**64), got {self.seed!r}")
        if not isinstance(self.ignore_eos, bool):
            problems.append(f"ignore_eos must be a bool, got {self.ignore_eos!r}")

        stop = self.stop
        if isinstance(stop, str):  # OpenAI accepts a single string
            stop = (stop,)
        if isinstance(stop, (list, tuple)) and all(isinstance(s, str) and s for s in stop):
            object.__setattr__(self, "stop", tuple(stop))
        else:
            problems.append(f"stop must be a string or a sequence of non-empty strings, got {self.stop!r}")
        if problems:
            raise ValueError("invalid sampling parameters: " + "; ".join(problems))

    @classmethod
    def greedy(cls, **overrides) -> SamplingParams:
        """Deterministic argmax decoding (after the penalties); other fields as given."""
        return cls(**{"temperature": 0.0, **overrides})

    @property
    def is_greedy(self) -> bool:
        return self.temperature <= 0.0

    def replace(self, **changes) -> SamplingParams:
        """A copy with some fields changed, validated again."""
        return dataclasses.replace(self, **changes)


DRAFT_ROWS_MAX = 15  # drafts per verify step at most: with the token before them, the fused decode path's 16 rows


@dataclass(frozen=True)
class DraftParams:
    """Speculative decoding (moerun.engine.speculative), llama.cpp's names and defaults.

    draft_max    tokens drafted per step at most (llama.cpp's --draft-max; moerun verifies at most
                 DRAFT_ROWS_MAX, which with the token before them fill the fused decode path's 16 rows).
    draft_min    a draft shorter than this is not verified (the step decodes one token); 0: any draft.
    draft_p_min  a draft model stops drafting where its most likely token is less likely than this.
    lookup_ngram prompt lookup: the longest n-gram matched against the prompt and the text so far; 0: off.
    adaptive     choose each step's draft length from the acceptance so far and the measured cost of a
                 verify step of each length, up to draft_max (False: always up to draft_max).
    """

    draft_max: int = 16
    draft_min: int = 0
    draft_p_min: float = 0.75
    lookup_ngram: int = 0
    adaptive: bool = True

    def __post_init__(self) -> None:
        problems = []
        if not (_is_int(self.draft_max) and self.draft_max >= 0):
            problems.append(f"draft_max must be an integer >= 0, got {self.draft_max!r}")
        if not (_is_int(self.draft_min) and self.draft_min >= 0):
            problems.append(f"draft_min must be an integer >= 0, got {self.draft_min!r}")
        elif _is_int(self.draft_max) and self.draft_min > self.draft_max:
            problems.append(f"draft_min ({self.draft_min}) must not exceed draft_max ({self.draft_max})")
        if not (_is_number(self.draft_p_min) and 0.0 <= self.draft_p_min <= 1.0):
            problems.append(f"draft_p_min must be a probability in [0, 1], got {self.draft_p_min!r}")
        if not (_is_int(self.lookup_ngram) and self.lookup_ngram >= 0):
            problems.append(f"lookup_ngram must be an integer >= 0 (0: off), got {self.lookup_ngram!r}")
        if not isinstance(self.adaptive, bool):
            problems.append(f"adaptive must be a bool, got {self.adaptive!r}")
        if problems:
            raise ValueError("invalid draft parameters: " + "; ".join(problems))

    @property
    def rows(self) -> int:
        """Drafts a verify step takes at most."""
        return min(self.draft_max, DRAFT_ROWS_MAX)

    def replace(self, **changes) -> DraftParams:
        return dataclasses.replace(self, **changes)


CACHE_POLICIES = POLICIES
KV_CACHE_TYPES = ("f32", "f16", "bf16", "q8_0", "q4_0")  # moerun.engine.kv_types (llama.cpp's -ctk / -ctv)
# LFRU, by the routing bench model's held-out traces: +6 points over LRU at 25% residency (bench/RESULTS.md).
DEFAULT_CACHE_POLICY = "lfru"
MISS_PATHS = ("auto", "fetch", "home")


@dataclass(frozen=True)
class RuntimeConfig:
    """Where and how a model runs: devices, budgets, expert cache, threads. Validated in one place.

    mmap: True keeps routed experts in the file's memory map (read on demand), False copies them to RAM
    (llama.cpp's --no-mmap), None lets the planner decide (RAM when the model fits the RAM budget).

    Stages: `devices` splits the layers over several devices in this process (('cpu', 'cpu') is how a split
    is tested without GPUs); `pipeline_world_size` > 1 puts one stage in each of that many processes joined
    by torch.distributed (this one is `pipeline_rank`; rank 0 owns sampling). `tensor_split`: one proportion
    per stage (llama.cpp's --tensor-split); None: equal on CPUs, by free memory on GPUs. Devices are 'cpu',
    GPUs 'cuda:N', or the CPU standing in for a GPU, 'standin:N' (moerun.device), all of one kind.

    miss_path: on a device stage, whether a cache miss is paged in ("fetch"), computed by the CPU where it
    lives ("home"), or whichever the cost model says is faster ("auto"). h2d_gbps / vram_gbps: given figures
    for the cost model (else measured on a GPU, or NVML's, or defaults). kv_contexts: how many contexts of
    `ctx_size` the KV pool will hold (serve's -np), which a GPU's plan must find room for.
    """

    model: str | None = None  # GGUF file or HF folder; None: the built-in default model
    device: str = "cpu"
    ctx_size: int | None = None  # None: the model's context, at most 4096
    ubatch: int = 512
    threads: int | None = None  # None: physical cores
    dtype: str = "float32"
    ram_budget: int | None = None  # bytes; None: the available RAM
    vram_budget: tuple[int, ...] | None = None  # bytes per GPU (one figure for all, or one per GPU); None: free memory
    expert_cache_mib: float | None = None
    expert_cache_slots: int | None = None
    expert_cache_plan: str | None = None  # a file of slots per layer (moerun.experts.allocate), instead of either
    expert_cache_trace: str | None = None  # a routing trace: the slots of mib/slots re-shared by its per-layer curves
    cache_policy: str = DEFAULT_CACHE_POLICY
    cache_prefill: str = "bypass"
    prefetch: bool = False  # decode steps guess the next MoE layer's experts and page them in ahead (needs a cache)
    mmap: bool | None = None
    mlock: bool = False  # lock the process's memory, the loaded weights with it, in RAM (llama.cpp's --mlock)
    repack: bool = True  # the CPU kernels' interleaved layouts (Q4_K, Q6_K, Q8_0, MXFP4, IQ4_XS) for weights in owned RAM (llama.cpp's repack)
    n_cpu_moe: int = 0
    override_tensor: tuple[tuple[str, str], ...] = ()
    devices: tuple[str, ...] = ()  # (): one stage on `device`
    tensor_split: tuple[float, ...] | None = None
    pipeline_rank: int = 0
    pipeline_world_size: int = 1
    master_addr: str = "127.0.0.1"
    master_port: int = 29500
    pipeline_timeout: float = 120.0  # seconds: joining the group, and waiting on another rank during a step
    expert_parallel: int = 1  # ranks sharing each MoE layer's routed experts (expert parallelism)
    ep_world_size: int = 1  # > 1: the ranks are that many processes, this one `ep_rank`; else devices of this one
    ep_rank: int = 0
    ep_timeout: float = 120.0  # seconds: joining the group, and waiting on another rank during a step
    expert_split: str | None = None  # which rank owns which expert (moerun.placement.expert_split); None: ranges
    miss_path: str = "auto"
    h2d_gbps: float | None = None
    vram_gbps: float | None = None
    kv_contexts: int = 1  # contexts of KV a GPU stage's plan reserves (serve's -np)
    model_draft: str | None = None  # a draft model for speculative decoding (same vocabulary), run on the CPU
    cache_type_k: str | None = None  # KV cache types (moerun.engine.kv_types.KV_TYPES); None: the compute dtype
    cache_type_v: str | None = None
    draft: DraftParams = DraftParams()
    progress: bool = False  # bars on stderr while the model loads (the CLI: on a terminal, without --no-progress)

    def __post_init__(self) -> None:
        from moerun.device import canonical

        problems = []
        if not isinstance(self.devices, tuple):
            problems.append(f"devices must be a tuple, got {self.devices!r}")
        else:
            try:
                object.__setattr__(self, "device", canonical(self.device))
                object.__setattr__(self, "devices", tuple(canonical(d) for d in self.devices))
            except (ValueError, TypeError) as e:
                problems.append(str(e))
            kinds = {d.split(":")[0] for d in self.devices or (self.device,)}
            if len(kinds) > 1:
                problems.append(f"the stages' devices must be of one kind (all cpu, all cuda or all standin), got "
                                f"{list(self.devices)}")
            elif kinds != {"cpu"} and self.pipeline_world_size > 1:
                problems.append("a pipeline over processes runs on the CPU only")
        if self.miss_path not in MISS_PATHS:
            problems.append(f"miss_path must be one of {', '.join(MISS_PATHS)}, got {self.miss_path!r}")
        if not (_is_int(self.kv_contexts) and self.kv_contexts >= 1):
            problems.append(f"kv_contexts must be a positive integer, got {self.kv_contexts!r}")
        for name in ("h2d_gbps", "vram_gbps"):
            v = getattr(self, name)
            if v is not None and not (_is_number(v) and v > 0):
                problems.append(f"{name} must be a positive number of GB/s, got {v!r}")
        w, r = self.pipeline_world_size, self.pipeline_rank
        if not (_is_int(w) and w >= 1 and _is_int(r) and 0 <= r < w):
            problems.append(f"pipeline rank {r!r} must be in 0..world size - 1 (world size {w!r}, at least 1)")
        elif w > 1 and len(self.devices) > 1:
            problems.append("a pipeline over processes runs one stage per process: give --device, not --devices")
        if self.tensor_split is not None and _is_int(w) and w >= 1:
            ts = self.tensor_split
            if not (isinstance(ts, tuple) and all(_is_number(x) and x >= 0 for x in ts) and sum(ts) > 0
                    and len(ts) == len(self.stage_devices)):
                problems.append(f"tensor_split needs {len(self.stage_devices)} non-negative proportions (one per "
                                f"stage), got {ts!r}")
        if not (isinstance(self.master_addr, str) and self.master_addr):
            problems.append(f"master_addr must be a host name or address, got {self.master_addr!r}")
        if not (_is_int(self.master_port) and 1 <= self.master_port <= 65535):
            problems.append(f"master_port must be in 1..65535, got {self.master_port!r}")
        if not (_is_number(self.pipeline_timeout) and self.pipeline_timeout > 0):
            problems.append(f"pipeline_timeout must be > 0 seconds, got {self.pipeline_timeout!r}")
        problems += self._expert_parallel_problems()
        vb = self.vram_budget
        if vb is not None and not (isinstance(vb, tuple) and vb and all(_is_int(v) and v > 0 for v in vb)):
            problems.append(f"vram_budget must be a non-empty tuple of positive byte counts, got {vb!r}")
        for name in ("ctx_size", "threads", "ram_budget"):
            v = getattr(self, name)
            if v is not None and not (_is_int(v) and v > 0):
                problems.append(f"{name} must be a positive integer, got {v!r}")
        if not (_is_int(self.ubatch) and self.ubatch > 0):
            problems.append(f"ubatch must be a positive integer, got {self.ubatch!r}")
        if self.dtype not in ("float32", "bfloat16"):
            problems.append(f"dtype must be float32 or bfloat16, got {self.dtype!r}")
        if sum(x is not None for x in (self.expert_cache_mib, self.expert_cache_slots, self.expert_cache_plan)) > 1:
            problems.append("give one of expert_cache_mib, expert_cache_slots and expert_cache_plan")
        if self.expert_cache_trace is not None and self.expert_cache_mib is None and self.expert_cache_slots is None:
            problems.append("expert_cache_trace shares out the slots of expert_cache_mib or expert_cache_slots: "
                            "give one of them")
        if self.expert_cache_mib is not None and not (_is_number(self.expert_cache_mib) and self.expert_cache_mib >= 0):
            problems.append(f"expert_cache_mib must be >= 0, got {self.expert_cache_mib!r}")
        if self.expert_cache_slots is not None and not (_is_int(self.expert_cache_slots) and self.expert_cache_slots >= 0):
            problems.append(f"expert_cache_slots must be >= 0, got {self.expert_cache_slots!r}")
        if self.cache_policy not in CACHE_POLICIES:
            problems.append(f"cache_policy must be one of {', '.join(CACHE_POLICIES)}, got {self.cache_policy!r}")
        if self.cache_prefill not in ("bypass", "cache"):
            problems.append(f"cache_prefill must be bypass or cache, got {self.cache_prefill!r}")
        if not isinstance(self.prefetch, bool):
            problems.append(f"prefetch must be a bool, got {self.prefetch!r}")
        if not (_is_int(self.n_cpu_moe) and self.n_cpu_moe >= 0):
            problems.append(f"n_cpu_moe must be >= 0, got {self.n_cpu_moe!r}")
        for name in ("cache_type_k", "cache_type_v"):
            t = getattr(self, name)
            if t is not None and t not in KV_CACHE_TYPES:
                problems.append(f"{name} must be one of {', '.join(KV_CACHE_TYPES)}, got {t!r}")
            elif t is not None and self.pipeline_world_size > 1:
                problems.append(f"{name}: a pipeline over processes keeps its KV cache in the compute dtype")
        if not isinstance(self.draft, DraftParams):
            problems.append(f"draft must be DraftParams, got {type(self.draft).__name__}")
        if self.model_draft is not None and self.pipeline_world_size > 1:
            problems.append("a draft model runs with a single-process model only (not a pipeline over processes)")
        if problems:
            raise ValueError("invalid runtime configuration: " + "; ".join(problems))

    @property
    def cache_requested(self) -> bool:
        return (self.expert_cache_mib is not None or self.expert_cache_slots is not None
                or self.expert_cache_plan is not None)

    @property
    def copies_whole_model(self) -> bool:
        """Whether, as far as the options say, this process copies the whole model into RAM: one process, on the CPU,
        with no expert cache, --mmap or --ram-budget (the plan still keeps a model that does not fit in its map)."""
        return (self.pipeline_world_size == 1 and self.expert_parallel == 1 and self.mmap is not True
                and not self.cache_requested and self.ram_budget is None
                and all(d == "cpu" for d in self.stage_devices))

    def _expert_parallel_problems(self) -> list[str]:
        n, w, r = self.expert_parallel, self.ep_world_size, self.ep_rank
        if not (_is_int(n) and n >= 1 and _is_int(w) and w >= 1 and _is_int(r) and 0 <= r < w):
            return [(f"expert_parallel ({n!r}) and ep_world_size ({w!r}) must be >= 1 and ep_rank ({r!r}) in "
                     "0..ep_world_size - 1")]
        if w > 1 and n == 1:
            object.__setattr__(self, "expert_parallel", n := w)
        problems = []
        if w > 1 and n != w:
            problems.append(f"expert_parallel {n} over {w} processes: one rank per process (give the same number)")
        if n > 1 and self.pipeline_world_size > 1:
            problems.append("expert parallelism does not combine with a pipeline over processes yet")
        if n > 1 and w == 1 and len(self.devices) not in (0, 1, n):
            problems.append(f"expert parallelism over {n} ranks in this process takes one device per rank, got "
                            f"{list(self.devices)}")
        if w > 1 and len(self.devices) > 1:
            problems.append("expert parallelism over processes runs one rank per process: give --device, not "
                            "--devices")
        if not (_is_number(self.ep_timeout) and self.ep_timeout > 0):
            problems.append(f"ep_timeout must be > 0 seconds, got {self.ep_timeout!r}")
        if self.expert_split is not None and not (isinstance(self.expert_split, str) and self.expert_split):
            problems.append(f"expert_split must be a file's path, got {self.expert_split!r}")
        if w > 1 and (self.cache_type_k is not None or self.cache_type_v is not None):
            problems.append("expert parallelism over processes keeps its KV cache in the compute dtype")
        return problems

    @property
    def ep_devices(self) -> tuple[str, ...]:
        """Under expert parallelism in this process, each rank's device, in rank order (one per process: its own)."""
        if self.ep_world_size > 1:
            return (self.device,)
        return self.devices if len(self.devices) == self.expert_parallel else (self.devices or (self.device,)) * \
            self.expert_parallel

    @property
    def stage_devices(self) -> tuple[str, ...]:
        """The device of every stage of the pipeline, in layer order (all processes' when distributed); under
        expert parallelism the one stage, on rank 0's device (the dense part's; the ranks' are ep_devices)."""
        if self.pipeline_world_size > 1:
            return (self.device,) * self.pipeline_world_size
        if self.expert_parallel > 1:
            return self.ep_devices[:1]
        return self.devices or (self.device,)


_MAX_BODY_DEFAULT = 16 * 2**20
# llama-server's --reasoning-format choices: "none" leaves a chat model's reasoning in the content; "auto" and
# "deepseek" return it as reasoning_content (moerun.text.reasoning)
REASONING_FORMATS = ("none", "auto", "deepseek")


@dataclass(frozen=True)
class ServerConfig:
    """How `moerun serve` listens and admits requests. Validated in one place.

    model_names   the ids a request may name in "model"; the first is the one /v1/models lists.
    parallel      requests decoding together (llama-server's slots); each may use the whole context.
    max_queue     requests waiting for a slot beyond those; one more gets 503.
    n_predict     max_tokens for a request that sets none; None: until end of sequence or a full context.
    defaults      sampling for the fields a request leaves out (llama-server's command-line defaults).
    cache_prompt  a finished request's KV stays in its slot, so a request sharing its prefix skips it.
    log_interval  seconds between throughput lines while busy; 0 turns them off.
    reasoning_format  REASONING_FORMATS: where chat completions put the model's reasoning (a request may
                  name another in "reasoning_format").
    slot_save_path  the folder /slots/{id}?action=save|restore read and write slot files in (None: no files).
    strict_model_name  a request naming another model is 404 (else, as llama-server, the one model answers it).
    model_path    the served file, as /props reports it.
    chat_template  a chat template to use instead of the model's (--chat-template, --chat-template-file); None:
                  the model's own.
    responses_max  responses /v1/responses keeps for previous_response_id (the most recently used; 0: none).
    load_form     /get_load's shape without ?form=: "object" (vllm-router's) or "array" (sglang-router's).
    webui         GET / serves the web page (chat and the live view; moerun.server.routes.webui).
    """

    model_names: tuple[str, ...]
    host: str = "127.0.0.1"
    port: int = 8080
    api_key: str | None = None
    parallel: int = 4
    max_queue: int = 64
    max_body_bytes: int = _MAX_BODY_DEFAULT
    n_predict: int | None = None
    defaults: SamplingParams = SamplingParams()
    cache_prompt: bool = True
    log_interval: float = 5.0
    reasoning_format: str = "auto"
    slot_save_path: Path | None = None
    strict_model_name: bool = False
    model_path: str | None = None
    chat_template: str | None = None
    responses_max: int = 1000
    load_form: str = "object"
    webui: bool = True

    def __post_init__(self) -> None:
        problems = []
        if not (isinstance(self.model_names, tuple) and self.model_names
                and all(isinstance(n, str) and n for n in self.model_names)):
            problems.append(f"model_names must be a non-empty tuple of names, got {self.model_names!r}")
        if self.slot_save_path is not None and not Path(self.slot_save_path).is_dir():
            problems.append(f"slot_save_path {self.slot_save_path} is not a folder")
        if not (isinstance(self.host, str) and self.host):
            problems.append(f"host must be a non-empty string, got {self.host!r}")
        if not (_is_int(self.port) and 1 <= self.port <= 65535):
            problems.append(f"port must be in 1..65535, got {self.port!r}")
        if self.api_key is not None and not (isinstance(self.api_key, str) and self.api_key):
            problems.append("api_key must be a non-empty string when given")
        for name, low in (("parallel", 1), ("max_queue", 0), ("max_body_bytes", 1), ("responses_max", 0)):
            v = getattr(self, name)
            if not (_is_int(v) and v >= low):
                problems.append(f"{name} must be an integer >= {low}, got {v!r}")
        if self.n_predict is not None and not (_is_int(self.n_predict) and self.n_predict >= 1):
            problems.append(f"n_predict must be None (until the context is full) or >= 1, got {self.n_predict!r}")
        if not isinstance(self.defaults, SamplingParams):
            problems.append(f"defaults must be SamplingParams, got {type(self.defaults).__name__}")
        if not isinstance(self.cache_prompt, bool):
            problems.append(f"cache_prompt must be a bool, got {self.cache_prompt!r}")
        if not (_is_number(self.log_interval) and self.log_interval >= 0):
            problems.append(f"log_interval must be >= 0 seconds, got {self.log_interval!r}")
        if self.chat_template is not None and not (isinstance(self.chat_template, str) and self.chat_template):
            problems.append("chat_template must be None or a template's text")
        if self.load_form not in ("object", "array"):
            problems.append(f"load_form must be 'object' or 'array', got {self.load_form!r}")
        if self.reasoning_format not in REASONING_FORMATS:
            problems.append(f"reasoning_format must be one of {', '.join(REASONING_FORMATS)}, got "
                            f"{self.reasoning_format!r}")
        if problems:
            raise ValueError("invalid server configuration: " + "; ".join(problems))

    @property
    def loopback(self) -> bool:
        return self.host in ("127.0.0.1", "localhost", "::1") or self.host.startswith("127.")
