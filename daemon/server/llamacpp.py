"""llama.cpp server dialect: /completion, /infill (what llama.vim and llama.vscode call), /tokenize, /detokenize,
/props. Responses carry llama.cpp's native `timings` plus the contract's object as `llmd_timings`. Streamed with
`return_progress`, the prefill's progress comes as `prompt_progress` chunks (`total`, `cache`, `processed`, which
counts the cached tokens too, and `time_ms` since the prefill began), as llama-server sends them."""

from __future__ import annotations

import json

from aiohttp import web

from ..engine.types import PromptProgress, RequestOutput, SamplingParams
from ..tools.parsers import Piece
from ..tools.spec import MAX_GRAMMAR_CHARS, AnswerFormat, check_schema
from .core import Generation, GenerationResult, Renderer, ServerState, encode_text, output_reason, run, state_of
from ..model.vision.images import InvalidImage, image_bytes
from .intake import MEDIA_MARKER, FimPrompt, Intake, Prompt, TextPrompt, TokenPrompt, checked_params, given_fields
from .responses import logprob_items, timings_dict
from .validation import (LOGPROBS_TOP, MAX_INPUT_EXTRA, MAX_NEW_TOKENS, MAX_PROMPT_TOKEN_IDS, MIN_P, PENALTY,
                         REPEAT_PENALTY, SEED, STOP, TEXT, TOP_K, TOP_P, ApiError, Field, bad_field, check_fields,
                         read_json, require)

DEFAULT_N_PREDICT = 2048
GEN_FIELDS = {
    "n_predict": Field("int", -1, MAX_NEW_TOKENS),
    "temperature": Field("number", 0, 100),
    "top_k": TOP_K,
    "top_p": TOP_P,
    "min_p": MIN_P,
    "repeat_penalty": REPEAT_PENALTY,
    "presence_penalty": PENALTY,
    "frequency_penalty": PENALTY,
    "stop": STOP,
    "seed": SEED,
    "stream": Field("bool"),
    "cache_prompt": Field("bool"),  # accepted; the prefix cache is always on
    "return_progress": Field("bool"),
    "n_probs": LOGPROBS_TOP,
    "t_max_predict_ms": Field("int", 0, 24 * 3600 * 1000),
    "model": Field("str", max_len=512),
}
COMPLETION_FIELDS = {**GEN_FIELDS, "prompt": Field("str|list|dict")}
INFILL_FIELDS = {**GEN_FIELDS, "input_prefix": TEXT, "input_suffix": TEXT, "prompt": TEXT,
                 "input_extra": Field("list", max_len=MAX_INPUT_EXTRA)}


# the request fields that set a SamplingParams field (a model's default options fill the others: intake.py)
GIVEN = {"n_predict": "max_tokens", "temperature": "temperature", "top_k": "top_k", "top_p": "top_p",
         "min_p": "min_p", "repeat_penalty": "repetition_penalty", "presence_penalty": "presence_penalty",
         "frequency_penalty": "frequency_penalty", "stop": "stop", "seed": "seed"}


def _params(f: dict) -> SamplingParams:
    n = f.get("n_predict", DEFAULT_N_PREDICT)
    return SamplingParams(
        max_tokens=MAX_NEW_TOKENS if n == -1 else max(n, 1),  # 0: one token to run the prefill, never sent
        temperature=float(f.get("temperature", 0.8)),
        top_k=max(f.get("top_k", 40), 0),
        top_p=float(f.get("top_p", 0.95)) or 1e-6,
        min_p=float(f.get("min_p", 0.05)),
        repetition_penalty=float(f.get("repeat_penalty", 1.0)) or 1.0,
        presence_penalty=float(f.get("presence_penalty", 0.0)),
        frequency_penalty=float(f.get("frequency_penalty", 0.0)),
        seed=None if f.get("seed", -1) == -1 else f.get("seed"),
        stop=f.get("stop", []),
        logprobs=f.get("n_probs") or None,
    )


def _native_timings(gen: Generation, n_pred: int) -> dict:
    t = gen.timings
    if t is None:
        return {}
    prompt_ms = (t.ttft or 0.0) * 1000
    predicted_ms = (t.decode_time or 0.0) * 1000 if n_pred else 0.0
    n_prompt = max(t.num_prompt_tokens - t.num_cached_tokens, 0)
    return {"prompt_n": n_prompt, "prompt_ms": prompt_ms,
            "prompt_per_token_ms": prompt_ms / n_prompt if n_prompt else 0.0,
            "prompt_per_second": 1000 * n_prompt / prompt_ms if prompt_ms else 0.0,
            "predicted_n": n_pred, "predicted_ms": predicted_ms,
            "predicted_per_token_ms": predicted_ms / (n_pred - 1) if n_pred > 1 else 0.0,
            "predicted_per_second": 1000 * (n_pred - 1) / predicted_ms if predicted_ms and n_pred > 1 else 0.0}


_STOP_TYPE = {"stop": "eos", "length": "limit", "abort": "none"}


def _stop_type(gen) -> str:
    """llama.cpp's stop_type: "word" for a stop string, "eos" for an end or stop token, "limit", "none"."""
    return "word" if isinstance(gen.stop_reason, str) else _STOP_TYPE.get(gen.finish_reason or "", "none")


class CompletionAnswer(Renderer):
    """llama.cpp's /completion and /infill answer. n_predict 0 (llama.vim's cache warm-up): the prompt is evaluated
    into the prefix cache and nothing is generated (the engine samples one token after the prefill; it is dropped)."""

    def __init__(self, intake: Intake, model: str, evaluate_only: bool, return_progress: bool = False):
        self.intake = intake
        self.model = model
        self.evaluate_only = evaluate_only
        self.return_progress = return_progress
        self.logprobs = bool(intake.params.logprobs)

    def final(self, gen: Generation, text: str) -> dict:
        predicted = 0 if self.evaluate_only or gen.timings is None else gen.timings.num_generated_tokens
        return {"content": text, "stop": True, "model": self.model,
                "stop_type": "limit" if self.evaluate_only else _stop_type(gen),
                "stopping_word": gen.stop_reason if isinstance(gen.stop_reason, str) else "",
                "tokens_predicted": predicted, "tokens_evaluated": len(gen.prompt_ids),
                "tokens_cached": gen.timings.num_cached_tokens if gen.timings else 0, "truncated": False,
                "timings": _native_timings(gen, predicted), "llmd_timings": timings_dict(gen.timings)}

    def whole(self, gen: Generation, res: GenerationResult) -> dict:
        body = self.final(gen, "" if self.evaluate_only else res.text)
        if self.logprobs and not self.evaluate_only:
            body["completion_probabilities"] = logprob_items(gen.engine.tokenizer, res.logprobs, "llamacpp")
        return body

    def progress(self, gen: Generation, p: PromptProgress) -> list:
        if not self.return_progress:
            return []
        return [{"content": "", "stop": False, "prompt_progress": {
            "total": p.total, "cache": p.cached, "processed": p.computed, "time_ms": round(p.elapsed_s * 1000.0)}}]

    def events(self, gen: Generation, out: RequestOutput, piece: Piece) -> list:
        events = []
        if (out.text_delta or out.logprobs) and not self.evaluate_only:
            ev = {"content": out.text_delta, "stop": False}
            if self.logprobs and out.logprobs:
                ev["completion_probabilities"] = logprob_items(gen.engine.tokenizer, out.logprobs, "llamacpp")
            events.append(ev)
        if output_reason(out) is not None:
            events.append(self.final(gen, ""))
        return events

    def error(self, exc: ApiError) -> dict:
        return {"error": {"code": 500, "message": exc.message, "type": "server_error"}}


def answer_format(body: dict) -> AnswerFormat | None:
    """llama.cpp's grammar (GBNF) or json_schema; not both."""
    grammar, schema = body.get("grammar"), body.get("json_schema")
    if grammar not in (None, "") and schema is not None:
        raise bad_field("grammar", "and json_schema cannot be used together")
    if schema is not None:
        return AnswerFormat("json_schema", json.dumps(check_schema(schema, "json_schema"), ensure_ascii=False),
                            "json_schema")
    if grammar in (None, ""):
        return None
    if not isinstance(grammar, str):
        raise bad_field("grammar", "must be a string (GBNF)")
    if len(grammar) > MAX_GRAMMAR_CHARS:
        raise bad_field("grammar", f"must be at most {MAX_GRAMMAR_CHARS} characters")
    return AnswerFormat("gbnf", grammar, "grammar")


def _intake(f: dict, prompt: Prompt, body: dict) -> Intake:
    limit = f.get("t_max_predict_ms")
    return Intake(f.get("model"), prompt, checked_params(_params(f)), bool(f.get("stream")),
                  answer=answer_format(body), time_limit_s=limit / 1000.0 if limit else None,
                  given=given_fields(f, GIVEN))


def parse_completion(body: dict, state: ServerState) -> Intake:
    require(body, "prompt")
    f = check_fields(body, COMPLETION_FIELDS)
    state.check_model(f.get("model"))
    prompt = f["prompt"]
    if isinstance(prompt, dict):  # {"prompt_string": text with <__media__> markers, "multimodal_data": [base64]}
        text, images = prompt.get("prompt_string"), prompt.get("multimodal_data") or []
        if not isinstance(text, str) or not isinstance(images, list):
            raise bad_field("prompt", "must be {prompt_string, multimodal_data}")
        prompt = text
    else:
        prompt, images = _image_data(prompt, body.get("image_data"))
    if isinstance(prompt, list):
        return _intake(f, TokenPrompt(prompt), body)
    if len(prompt) > TEXT.max_len:
        raise bad_field("prompt", f"must be at most {TEXT.max_len} characters")
    if prompt.count(MEDIA_MARKER) != len(images):
        raise bad_field("prompt", f"holds {prompt.count(MEDIA_MARKER)} image markers for {len(images)} images")
    return _intake(f, TextPrompt(prompt, images=tuple(_image(v, f"multimodal_data[{i}]")
                                                      for i, v in enumerate(images))), body)


def _image_data(prompt: object, image_data: object) -> tuple[object, list]:
    """llama.cpp's older form: image_data [{data: base64, id: N}] placed at "[img-N]" in the prompt, in the prompt's
    order: the prompt with media markers instead, and the images in that order."""
    if image_data is None:
        return prompt, []
    if not isinstance(image_data, list) or not isinstance(prompt, str) or not all(
            isinstance(d, dict) and isinstance(d.get("id"), int) for d in image_data):
        raise bad_field("image_data", "must be [{data, id}] with a text prompt holding [img-<id>]")
    by_id = {d["id"]: d.get("data") for d in image_data}
    found = [(prompt.find(f"[img-{i}]"), i) for i in by_id]
    if any(pos < 0 for pos, _ in found):
        raise bad_field("image_data", "every image's [img-<id>] must be in the prompt")
    for _, i in found:
        prompt = prompt.replace(f"[img-{i}]", MEDIA_MARKER, 1)
    return prompt, [by_id[i] for _, i in sorted(found)]


def _image(value: object, where: str) -> bytes:
    try:
        return image_bytes(value)
    except InvalidImage as exc:
        raise bad_field(where, str(exc)) from None


async def _serve(request: web.Request, state: ServerState, body: dict, intake: Intake) -> web.StreamResponse:
    answer = CompletionAnswer(intake, state.model_name, evaluate_only=body.get("n_predict") == 0,
                              return_progress=body.get("return_progress") is True)
    return await run(request, state, intake, answer)


async def completion(request: web.Request) -> web.StreamResponse:
    state = state_of(request)
    body = await read_json(request, state.max_body_bytes)
    return await _serve(request, state, body, parse_completion(body, state))


def _extra_context(chunks: list) -> str:
    """input_extra: [{filename, text}] from other files, placed before the prefix as repository context."""
    parts = []
    total = 0
    for i, chunk in enumerate(chunks):
        c = check_fields(chunk, {"filename": Field("str", max_len=4096), "text": TEXT}, prefix=f"input_extra[{i}].") \
            if isinstance(chunk, dict) else None
        if c is None:
            raise bad_field(f"input_extra[{i}]", "must be an object with filename and text")
        total += len(c.get("text", ""))
        if total > TEXT.max_len:
            raise bad_field("input_extra", f"texts must total at most {TEXT.max_len} characters")
        name = c.get("filename", "")
        parts.append((f"{name}\n" if name else "") + c.get("text", "") + "\n\n")
    return "".join(parts)


def parse_infill(body: dict, state: ServerState) -> Intake:
    f = check_fields(body, INFILL_FIELDS)
    if "input_prefix" not in f and "input_suffix" not in f:
        raise ApiError(400, "input_prefix or input_suffix is required", param="input_prefix")
    state.check_model(f.get("model"))
    extra = _extra_context(f.get("input_extra", []))
    return _intake(f, FimPrompt(f.get("input_prefix", ""), f.get("input_suffix", ""), extra, f.get("prompt", "")),
                   body)


async def infill(request: web.Request) -> web.StreamResponse:
    state = state_of(request)
    body = await read_json(request, state.max_body_bytes)
    return await _serve(request, state, body, parse_infill(body, state))


async def tokenize(request: web.Request) -> web.Response:
    state = state_of(request)
    body = await read_json(request, state.max_body_bytes)
    require(body, "content")
    f = check_fields(body, {"content": TEXT, "add_special": Field("bool"), "with_pieces": Field("bool")})
    tok = await state.engine_for(request, body.get("model"))  # llama.cpp's server has one model: the default
    tok = tok.tokenizer
    ids = await encode_text(tok, f["content"], f.get("add_special", False))
    if f.get("with_pieces"):
        return web.json_response({"tokens": [{"id": i, "piece": tok.decode([i], skip_special_tokens=False)}
                                             for i in ids]})
    return web.json_response({"tokens": ids})


async def detokenize(request: web.Request) -> web.Response:
    state = state_of(request)
    body = await read_json(request, state.max_body_bytes)
    require(body, "tokens")
    tokens = body["tokens"]
    if not isinstance(tokens, list) or len(tokens) > MAX_PROMPT_TOKEN_IDS:
        raise bad_field("tokens", f"must be an array of at most {MAX_PROMPT_TOKEN_IDS} token ids")
    state = await state.use_model(request, body.get("model"))
    tok = state.require_engine().tokenizer
    if any(isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < tok.vocab_size for t in tokens):
        raise bad_field("tokens", f"must hold integers in [0, {tok.vocab_size})")
    return web.json_response({"content": tok.decode(tokens, skip_special_tokens=False)})


async def props(request: web.Request) -> web.Response:
    state = await state_of(request).use_model(request, request.query.get("model"))
    engine = state.require_engine()
    stats = engine.stats()
    return web.json_response({
        "default_generation_settings": {"n_ctx": state.max_model_len(), "model": state.model_name,
                                        "params": {"n_predict": DEFAULT_N_PREDICT, "temperature": 0.8, "top_k": 40,
                                                   "top_p": 0.95, "min_p": 0.05}},
        "total_slots": getattr(getattr(getattr(engine, "engine", None), "config", None), "max_num_seqs", None),
        "model_path": state.model_name,
        "chat_template": engine.tokenizer.chat_template or "",
        "has_infill": bool(engine.tokenizer.fim_token_ids()),
        "kv_blocks_free": stats.kv.blocks_free if stats.kv is not None else None,
        "build_info": "llmd",
    })


def setup_routes(app: web.Application) -> None:
    app.router.add_post("/completion", completion)
    app.router.add_post("/completions", completion)
    app.router.add_post("/infill", infill)
    app.router.add_post("/tokenize", tokenize)
    app.router.add_post("/detokenize", detokenize)
    app.router.add_get("/props", props)
