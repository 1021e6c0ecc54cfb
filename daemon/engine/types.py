"""The engine's public data types: what goes in (SamplingParams) and what comes out (RequestOutput)."""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass, field

from ..errors import InvalidRequest

MAX_STOP_STRINGS = 16
MAX_STOP_STRING_LEN = 256
MAX_LOGPROBS = 20


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
        return [b - a for a, b in zip(t, t[1:])]

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
