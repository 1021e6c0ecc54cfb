"""The engine's public data types and vocabulary, torch-free: what goes in (SamplingParams), what comes out
(RequestOutput), what the engine reports (EngineStats), and the names of its modes (SpecMode, KvCacheDtype,
QuantMethod, DTYPE_NAMES) that the settings, the engine and the model all validate against."""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass, field
from typing import Any

from ..errors import InvalidRequest

MAX_STOP_STRINGS = 16
MAX_STOP_STRING_LEN = 256
MAX_LOGPROBS = 20


# ---- vocabulary ---------------------------------------------------------------------------------------------------

class SpecMode(str, enum.Enum):
    """Speculative decoding (llmd.engine.speculative)."""

    OFF = "off"
    NGRAM = "ngram"  # prompt lookup: no second model
    DRAFT = "draft"  # a draft model proposes
    AUTO = "auto"  # adaptive to load and acceptance


class KvCacheDtype(str, enum.Enum):
    """What the KV pool holds. AUTO: the device's default (CUDA: the model's dtype; CPU: EngineConfig's
    CPU_KV_CACHE_DTYPE); INT8: per-token, per-head scales (llmd.model.kv_int8)."""

    AUTO = "auto"
    FP32 = "fp32"
    FP16 = "fp16"
    BF16 = "bf16"
    INT8 = "int8"


class QuantMethod(str, enum.Enum):
    """The weight formats `--quant` accepts (llmd.model.quant.modes.parse_quant implements them)."""

    AUTO = "auto"  # a GGUF keeps its packing where a kernel runs it, else unquantized
    NONE = "none"
    GGUF = "gguf"
    INT8 = "int8"
    INT4 = "int4"
    INT4_G32 = "int4-g32"
    INT4_G64 = "int4-g64"
    INT4_G128 = "int4-g128"
    BNB_INT8 = "bnb-int8"
    BNB_NF4 = "bnb-nf4"


def choices(kind: type[enum.Enum]) -> tuple[str, ...]:
    """An enum's values, in order: what a setting of that kind accepts."""
    return tuple(str(member.value) for member in kind)


# The one table of dtype names: each name a setting accepts (--dtype; the float KV dtypes use the short ones) and
# torch's name for it.
DTYPE_NAMES = {"float32": "float32", "fp32": "float32", "bfloat16": "bfloat16", "bf16": "bfloat16",
               "float16": "float16", "fp16": "float16"}
# torch's name -> the short name stats and KV settings use
SHORT_DTYPE_NAMES = {"float32": "fp32", "float16": "fp16", "bfloat16": "bf16", "int8": "int8"}


CONSTRAINT_KINDS = ("json_schema", "json_object", "lark", "regex", "gbnf")


@dataclass(frozen=True)
class Constraint:
    """A grammar the output must follow; the engine compiles it (engine/grammar.py) and masks the logits by it."""

    kind: str  # "json_schema" | "json_object" | "lark" | "regex" | "gbnf"
    text: str  # the JSON schema as JSON text, or the grammar / regex text ("" for json_object)


class ConstraintError(InvalidRequest, ValueError):
    """A constraint is invalid, unsatisfiable, or past a bound: the server answers 400 (field: the request field)."""

    def __init__(self, message: str, field: str | None = None):
        super().__init__(message, field=field)


class Priority(enum.IntEnum):
    """Lower value is served first."""

    INTERACTIVE = 0
    BATCH = 1


@dataclass
class SamplingParams:
    max_tokens: int = 256
    temperature: float = 1.0  # 0 means greedy
    top_k: int = 0  # 0 = off
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0  # 1 = off (multiplicative, HF/llama.cpp style)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None  # None = off; n >= 0: chosen token's logprob plus the top n
    constraint: Constraint | None = None  # grammar-constrained output (compiled off the engine thread)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def validate(self) -> "SamplingParams":
        """Raise InvalidRequest naming the first bad field; return self when all are valid."""

        def bad(name: str, why: str):
            raise InvalidRequest(f"{name} {why}", field=name)

        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            bad("max_tokens", "must be a positive integer")
        if self.temperature < 0 or self.temperature > 100:
            bad("temperature", "must be between 0 and 100")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            bad("top_k", "must be a non-negative integer (0 disables it)")
        if not 0.0 < self.top_p <= 1.0:
            bad("top_p", "must be in (0, 1]")
        if not 0.0 <= self.min_p <= 1.0:
            bad("min_p", "must be in [0, 1]")
        if not 0.0 < self.repetition_penalty <= 10.0:
            bad("repetition_penalty", "must be in (0, 10]")
        if not -2.0 <= self.presence_penalty <= 2.0:
            bad("presence_penalty", "must be in [-2, 2]")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            bad("frequency_penalty", "must be in [-2, 2]")
        if self.seed is not None and not isinstance(self.seed, int):
            bad("seed", "must be an integer")
        if len(self.stop) > MAX_STOP_STRINGS:
            bad("stop", f"may hold at most {MAX_STOP_STRINGS} strings")
        if any(not isinstance(s, str) or not s or len(s) > MAX_STOP_STRING_LEN for s in self.stop):
            bad("stop", f"strings must be non-empty and at most {MAX_STOP_STRING_LEN} characters")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            bad("logprobs", f"must be between 0 and {MAX_LOGPROBS}")
        if self.constraint is not None and self.constraint.kind not in CONSTRAINT_KINDS:
            raise ConstraintError(f"constraint kind must be one of {', '.join(CONSTRAINT_KINDS)}", field="constraint")
        return self


POOLING_KINDS = ("mean", "last", "cls")


@dataclass(frozen=True)
class EmbedParams:
    """An embedding request: a prefill-only sequence whose final hidden states are pooled into one vector.

    pooling: mean over the positions, the last position's state (decoder embedding models such as Qwen3-Embedding)
    or the first one's; dimensions: keep the first n components (Matryoshka models) before normalizing."""

    pooling: str = "mean"
    normalize: bool = True
    dimensions: int | None = None

    def validate(self) -> "EmbedParams":
        if self.pooling not in POOLING_KINDS:
            raise InvalidRequest(f"pooling must be one of {', '.join(POOLING_KINDS)}", field="pooling")
        if self.dimensions is not None and (not isinstance(self.dimensions, int) or self.dimensions < 1):
            raise InvalidRequest("dimensions must be a positive integer", field="dimensions")
        return self


class FinishReason(str, enum.Enum):
    STOP = "stop"  # EOS, a stop token id or a stop string
    LENGTH = "length"  # max_tokens or max_model_len reached
    ABORT = "abort"  # aborted by the client or the server


@dataclass
class RequestTimings:
    """Wall-clock instants (time.monotonic seconds) and the durations derived from them."""

    arrival: float
    first_scheduled: float | None = None
    first_token: float | None = None
    token_times: list[float] = field(default_factory=list)
    finished: float | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    num_generated_tokens: int = 0
    num_preemptions: int = 0
    spec_proposed: int = 0
    spec_accepted: int = 0

    @property
    def queue_time(self) -> float | None:
        return None if self.first_scheduled is None else self.first_scheduled - self.arrival

    @property
    def ttft(self) -> float | None:
        return None if self.first_token is None else self.first_token - self.arrival

    @property
    def prefill_time(self) -> float | None:
        if self.first_token is None or self.first_scheduled is None:
            return None
        return self.first_token - self.first_scheduled

    @property
    def decode_time(self) -> float | None:
        if self.first_token is None or not self.token_times:
            return None
        return self.token_times[-1] - self.first_token

    @property
    def tpot(self) -> float | None:
        """Mean time per output token after the first."""
        if len(self.token_times) < 2:
            return None
        return (self.token_times[-1] - self.token_times[0]) / (len(self.token_times) - 1)

    @property
    def inter_token_latencies(self) -> list[float]:
        t = self.token_times
        return [b - a for a, b in zip(t, t[1:], strict=False)]

    @property
    def e2e(self) -> float | None:
        return None if self.finished is None else self.finished - self.arrival

    def to_dict(self) -> dict:
        """Durations in seconds, for APIs and logs."""
        return {
            "queue_s": self.queue_time,
            "prefill_s": self.prefill_time,
            "ttft_s": self.ttft,
            "decode_s": self.decode_time,
            "tpot_s": self.tpot,
            "e2e_s": self.e2e,
            "prompt_tokens": self.num_prompt_tokens,
            "cached_prompt_tokens": self.num_cached_tokens,
            "generated_tokens": self.num_generated_tokens,
            "preemptions": self.num_preemptions,
            "spec_proposed": self.spec_proposed,
            "spec_accepted": self.spec_accepted,
        }


@dataclass(frozen=True)
class PromptProgress:
    """How far a request's prefill has come: `computed` of its `total` prompt tokens have K/V, `cached` of them read
    from the prefix cache; `elapsed_s` since its prefill began (0 while it waits)."""

    total: int
    cached: int
    computed: int
    elapsed_s: float


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]]  # (token_id, logprob), best first


@dataclass
class RequestOutput:
    """One increment of a request's output. The last one has finished=True and a finish_reason."""

    request_id: str
    new_token_ids: list[int]
    text_delta: str
    finished: bool = False
    finish_reason: FinishReason | None = None
    logprobs: list[TokenLogprob] | None = None
    timings: RequestTimings | None = None
    error: str | None = None  # set when the request failed inside the engine
    stop_reason: str | int | None = None  # on STOP: the stop string or stop token id that ended it (None: EOS)
    embedding: list[float] | None = None  # an embedding request's vector (its one, final output)

    def merge(self, later: "RequestOutput") -> "RequestOutput":
        """One output equivalent to this one followed by `later` (the same request's next increment): tokens,
        text and logprobs concatenated; whatever describes the end (finished, reasons, timings, error) from later."""
        logprobs = None
        if self.logprobs is not None or later.logprobs is not None:
            logprobs = (self.logprobs or []) + (later.logprobs or [])
        return dataclasses.replace(
            later, new_token_ids=self.new_token_ids + later.new_token_ids,
            text_delta=self.text_delta + later.text_delta, logprobs=logprobs,
            timings=later.timings or self.timings, error=later.error or self.error)


# ---- what the engine reports --------------------------------------------------------------------------------------
# Engine.stats() returns an EngineStats; /v1/llmd/stats serves dataclasses.asdict of it per model (the JSON schema
# that `llmd top` reads is written out in tui/top_app.py); `from_dict` turns that JSON back into these types.


def _known(cls, data: dict) -> dict:
    """The keys of `data` that are fields of `cls` (a newer or older daemon may send more or fewer)."""
    names = {f.name for f in dataclasses.fields(cls)}
    return {k: v for k, v in data.items() if k in names}


@dataclass
class Percentiles:
    p50: float | None = None
    p90: float | None = None
    p99: float | None = None


@dataclass
class LatencyStats:
    """Per-stage percentiles in milliseconds over the engine's last finished requests (Engine.LATENCY_WINDOW)."""

    queue_ms: Percentiles = field(default_factory=Percentiles)
    prefill_ms: Percentiles = field(default_factory=Percentiles)
    ttft_ms: Percentiles = field(default_factory=Percentiles)
    decode_ms: Percentiles = field(default_factory=Percentiles)
    tpot_ms: Percentiles = field(default_factory=Percentiles)
    e2e_ms: Percentiles = field(default_factory=Percentiles)

    @classmethod
    def from_dict(cls, data: dict) -> "LatencyStats":
        return cls(**{k: Percentiles(**_known(Percentiles, v or {})) for k, v in _known(cls, data).items()})


@dataclass
class KvStats:
    """The KV pool and its prefix cache. Blocks: used (held by requests) + cached (evictable prefix blocks, free for
    new work) + free (empty) = total."""

    dtype: str  # what the pool holds: fp32 | fp16 | bf16 | int8 (a KvCacheDtype, never auto)
    block_size: int  # tokens per block
    bytes_per_token: int  # one token's K and V over all layers (int8: with its scales)
    cache_bytes: int  # the pool's bytes
    blocks_total: int
    blocks_used: int
    blocks_cached: int
    blocks_free: int
    # for this pool's bytes: how many 8,192-token sequences fit with each KV dtype (long contexts vs batch size)
    seqs_8k_by_dtype: dict[str, int] = field(default_factory=dict)
    prefix_queries_tokens: int = 0  # prompt tokens looked up in the prefix cache
    prefix_hits_tokens: int = 0  # ... and found there
    prefix_hit_rate: float = 0.0
    prefix_evictions: int = 0
    # a model mixing sliding-window and global layers keeps the window layers' KV in a second group of blocks (the
    # blocks_* above are the global layers'); None for other models
    window_blocks_total: int | None = None
    window_blocks_used: int | None = None
    window_blocks_cached: int | None = None
    # where layers share K/V (Gemma 4): what bytes_per_token would be if every layer stored its own; else None
    bytes_per_token_unshared: int | None = None
    # a hybrid model's recurrent layers keep a fixed-size state per sequence instead (llmd.engine.state_pool);
    # 0 / None for other models
    state_bytes_per_seq: int = 0  # one sequence's state over every recurrent layer
    state_cache_bytes: int = 0  # the state pool's bytes (sequence slots, checkpoints, scratch)
    state_slots: int | None = None  # sequences that can run at once
    state_slots_used: int | None = None
    state_checkpoints: int | None = None  # prefix checkpoints the pool holds at most ...
    state_checkpoints_cached: int | None = None  # ... and holds now
    state_checkpoint_hits: int | None = None  # prefix hits that restored a checkpoint

    @property
    def tokens_total(self) -> int:
        return self.blocks_total * self.block_size

    @property
    def seqs_8k(self) -> int | None:
        """8,192-token sequences this pool holds in its own dtype."""
        return self.seqs_8k_by_dtype.get(self.dtype)


@dataclass
class SpecStats:
    """Speculative decoding, when a mode other than off is configured."""

    mode: str  # a SpecMode
    proposed_total: int = 0  # draft tokens proposed
    accepted_total: int = 0  # ... and accepted by the target's verification
    drafts_total: int = 0  # verify runs (one per sequence and step)
    acceptance_rate: float = 0.0  # accepted / proposed
    mean_accepted_length: float = 0.0  # accepted per verify run


@dataclass
class EngineStats:
    """One model's engine: counters since it started, the last step, the KV pool, speculation and latency."""

    requests_running: int = 0
    requests_waiting: int = 0
    requests_finished_total: int = 0
    prompt_tokens_total: int = 0
    generation_tokens_total: int = 0
    num_preemptions: int = 0  # recomputations after a request lost its KV blocks
    steps_total: int = 0
    last_batch_size: int = 0  # sequences in the last step
    last_step_tokens: int = 0  # tokens in the last step's forward
    tokens_per_second: float = 0.0  # generated, over the last few seconds
    kv: KvStats | None = None  # None: a remote model (its KV lives on the other server)
    spec: SpecStats | None = None  # None: speculation off
    latency: LatencyStats = field(default_factory=LatencyStats)
    engine_alive: bool = True  # False once the engine thread died (engine_error says why)
    engine_error: str | None = None
    remote_url: str | None = None  # a remote model's upstream server
    threads: int | None = None  # CPU threads the model's steps compute with (None: on a GPU, remote, or not yet known)
    # a mixture of experts: tokens routed to each expert, per MoE layer, since the model loaded (where to place
    # experts); None for a dense model
    expert_hits: list[list[int]] | None = None

    @classmethod
    def from_dict(cls, data: dict) -> "EngineStats":
        """The inverse of dataclasses.asdict (unknown keys are ignored, missing ones take their defaults)."""
        values = _known(cls, data)
        if values.get("kv") is not None:
            values["kv"] = KvStats(**_known(KvStats, values["kv"]))
        if values.get("spec") is not None:
            values["spec"] = SpecStats(**_known(SpecStats, values["spec"]))
        values["latency"] = LatencyStats.from_dict(values.get("latency") or {})
        return cls(**values)


@dataclass(frozen=True)
class ImageSpan:
    """One image in a prompt (llmd.model.vision): its placeholder tokens at positions [start, start + length), the
    embeddings [length, hidden] the model reads there instead of the tokens' own (Qwen3-VL: [length, hidden * (1 +
    its DeepStack layers)], the features its first layers add there after them), and `digest`, a hash of its pixels
    that keys those positions in the prefix cache (two different images never share blocks). `bidirectional`: the
    image's tokens attend to each other both ways (Gemma), so a prefill chunk never splits them. `grid`: (rows,
    columns) of the image's tokens, row-major, for a model with multimodal RoPE (Qwen3.5), which gives them 2-D
    positions (llmd.engine.sequence.rope_positions); None: the tokens' positions are their indices, like text's."""

    start: int
    length: int
    digest: bytes
    embeds: "Any" = dataclasses.field(repr=False, compare=False)  # torch.Tensor [length, hidden]
    bidirectional: bool = False
    grid: tuple[int, int] | None = None

    @property
    def end(self) -> int:
        return self.start + self.length
