"""Typed reading of request bodies, and their sampling settings.

Request JSON is untrusted: every field is type-checked here so a wrong type is
a 400 naming the field, never a crash deeper down. Ranges are checked here,
where HTTP requests enter, by ``check_sampling`` (torch-free, beside the struct it
checks); logit processors check their parameters where they are built, in the worker.
"""

from __future__ import annotations

import builtins
import math
from dataclasses import dataclass
from typing import Any

import msgspec

from ..messages.generate import GenerateRequest
from ..messages.sampling import LogitProcessorSpec, SamplingParams, check_sampling
from .errors import ApiError

__all__ = [
    "Fields",
    "ModelLimits",
    "checked_sampling",
    "fan_out",
    "native_sampling",
    "openai_sampling",
]

_INT64 = 2**63  # everything crosses msgpack; a bigger int could not be encoded

# SGLang ``sampling_params`` names accepted by POST /generate.
NATIVE_SAMPLING_NAMES = (
    "max_new_tokens",
    "min_new_tokens",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "repetition_penalty",
    "frequency_penalty",
    "presence_penalty",
    "logit_bias",
    "seed",
    "sampling_seed",
    "stop",
    "stop_token_ids",
    "ignore_eos",
    "skip_special_tokens",
    "spaces_between_special_tokens",
    "n",
    "logit_processors",
    # Structured output, read by gateway.structured.native_constraint.
    "json_schema",
    "regex",
    "ebnf",
    "structural_tag",
)


@dataclass(frozen=True)
class ModelLimits:
    """What the served model allows: sampling is checked against it before any actor sees it."""

    vocab_size: int
    max_model_len: int


def _type_name(value: Any) -> str:
    return "null" if value is None else type(value).__name__


class Fields:
    """Typed getters over one JSON object; ``where`` prefixes names in error messages."""

    def __init__(self, body: Any, where: str = "") -> None:
        if not isinstance(body, dict):
            name = where or "the request body"
            raise ApiError(
                400, f"{name} must be a JSON object, got {_type_name(body)}", code="invalid_type"
            )
        self.body = body
        self.where = where

    def name(self, key: str) -> str:
        return f"{self.where}.{key}" if self.where else key

    def bad(self, key: str, expected: str, value: Any) -> ApiError:
        return ApiError(
            400,
            f"'{self.name(key)}' must be {expected}, got {_type_name(value)} ({value!r:.80})",
            code="invalid_type",
            param=self.name(key),
        )

    def present(self, key: str) -> bool:
        return self.body.get(key) is not None

    def raw(self, key: str) -> Any:
        return self.body.get(key)

    def int(self, key: str, default: int | None = None) -> int | None:
        value = self.body.get(key)
        if value is None:
            return default
        if isinstance(value, float) and value.is_integer():
            value = int(value)  # JSON writers in some languages emit 5.0 for 5
        if isinstance(value, bool) or not isinstance(value, int):
            raise self.bad(key, "an integer", value)
        if not -_INT64 <= value < _INT64:
            raise ApiError(
                400, f"'{self.name(key)}' is out of range: {value}", param=self.name(key)
            )
        return value

    def float(self, key: str, default: float | None = None) -> float | None:
        value = self.body.get(key)
        if value is None:
            return default
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise self.bad(key, "a number", value)
        if not math.isfinite(value):
            raise ApiError(400, f"'{self.name(key)}' must be a finite number", param=self.name(key))
        return float(value)

    def bool(self, key: str, default: bool | None = None) -> bool | None:
        value = self.body.get(key)
        if value is None:
            return default
        if not isinstance(value, bool):
            raise self.bad(key, "a boolean", value)
        return value

    def str(self, key: builtins.str, default: builtins.str | None = None) -> builtins.str | None:
        value = self.body.get(key)
        if value is None:
            return default
        if not isinstance(value, str):
            raise self.bad(key, "a string", value)
        return value

    def object(self, key: builtins.str) -> Fields | None:
        value = self.body.get(key)
        return None if value is None else Fields(value, self.name(key))

    def str_list(self, key: builtins.str) -> list[builtins.str]:
        """A string or a list of strings (``stop``)."""
        value = self.body.get(key)
        if value is None:
            return []
        if isinstance(value, str):
            return [value]
        if isinstance(value, list) and all(isinstance(v, str) for v in value):
            return list(value)
        raise self.bad(key, "a string or a list of strings", value)

    def int_list(self, key: builtins.str) -> list[builtins.int]:
        value = self.body.get(key)
        if value is None:
            return []
        if isinstance(value, list) and all(_is_int(v) for v in value):
            return list(value)
        raise self.bad(key, "a list of integers", value)

    def logit_bias(self, key: builtins.str) -> dict[builtins.int, builtins.float]:
        """OpenAI sends token ids as string keys; SGLang clients sometimes as ints."""
        value = self.body.get(key)
        if value is None:
            return {}
        if not isinstance(value, dict):
            raise self.bad(key, "an object mapping token ids to numbers", value)
        out: dict[builtins.int, builtins.float] = {}
        for tok, bias in value.items():
            try:
                tok_id = int(tok)
            except (TypeError, ValueError):
                raise ApiError(
                    400,
                    f"'{self.name(key)}' keys must be token ids, got {tok!r:.40}",
                    param=self.name(key),
                ) from None
            if (
                isinstance(bias, bool)
                or not isinstance(bias, (int, float))
                or not math.isfinite(bias)
            ):
                raise self.bad(f"{key}.{tok}", "a finite number", bias)
            out[tok_id] = float(bias)
        return out


def logit_processors(f: Fields, key: str = "logit_processors") -> list[LogitProcessorSpec]:
    """``[{"name": ..., "params": {...}}]`` (or bare names): registered processors only,
    never code; unknown names and bad params are caught by the sampling validation."""
    raw = f.raw(key)
    if raw is None:
        return []
    if not isinstance(raw, list):
        raise f.bad(key, "a list of {name, params} objects", raw)
    specs = []
    for item in raw:
        if isinstance(item, str):
            item = {"name": item}
        if not (isinstance(item, dict) and isinstance(item.get("name"), str)):
            raise f.bad(key, "a list of {name, params} objects", raw)
        params = item.get("params", {})
        if not isinstance(params, dict) or set(item) - {"name", "params"}:
            raise f.bad(key, "a list of {name, params} objects", raw)
        specs.append(LogitProcessorSpec(name=item["name"], params=params))
    return specs


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and -_INT64 <= value < _INT64


def _extras(f: Fields) -> dict[str, Any]:
    """Fields vLLM and SGLang accept beyond OpenAI's, under the same names in both APIs."""
    out: dict[str, Any] = {}
    for key, getter in (
        ("top_k", f.int),
        ("min_p", f.float),
        ("repetition_penalty", f.float),
        ("ignore_eos", f.bool),
        ("skip_special_tokens", f.bool),
        ("spaces_between_special_tokens", f.bool),
    ):
        value = getter(key)
        if value is not None:
            out[key] = value
    if f.present("min_tokens"):
        out["min_new_tokens"] = f.int("min_tokens")
    if f.present("stop_token_ids"):
        out["stop_token_ids"] = f.int_list("stop_token_ids")
    if f.present("logit_processors"):
        out["logit_processors"] = logit_processors(f)
    return out


def openai_sampling(
    f: Fields, *, max_tokens: int, logprobs: bool, top_logprobs: int
) -> SamplingParams:
    """SamplingParams for one choice of an OpenAI request (``n`` is fanned out by the caller)."""
    kwargs: dict[str, Any] = {
        "max_new_tokens": max_tokens,
        "temperature": f.float("temperature", 1.0),
        "top_p": f.float("top_p", 1.0),
        "presence_penalty": f.float("presence_penalty", 0.0),
        "frequency_penalty": f.float("frequency_penalty", 0.0),
        "logit_bias": f.logit_bias("logit_bias"),
        "seed": f.int("seed"),
        "stop": f.str_list("stop"),
        "logprobs": logprobs,
        "top_logprobs": top_logprobs,
    }
    kwargs.update(_extras(f))
    return SamplingParams(**kwargs)


def native_sampling(f: Fields | None) -> SamplingParams:
    """SamplingParams from SGLang's ``sampling_params`` dict; unknown names are an error."""
    if f is None:
        return SamplingParams(fit_context=True)
    unknown = sorted(set(f.body) - set(NATIVE_SAMPLING_NAMES))
    if unknown:
        raise ApiError(
            400,
            f"unsupported sampling_params: {', '.join(unknown)}; "
            f"supported: {', '.join(NATIVE_SAMPLING_NAMES)}",
            param="sampling_params",
        )
    kwargs: dict[str, Any] = {"fit_context": not f.present("max_new_tokens")}
    for key in ("max_new_tokens", "min_new_tokens", "top_k", "n"):
        if f.present(key):
            kwargs[key] = f.int(key)
    for key in (
        "temperature",
        "top_p",
        "min_p",
        "repetition_penalty",
        "frequency_penalty",
        "presence_penalty",
    ):
        if f.present(key):
            kwargs[key] = f.float(key)
    for key in ("ignore_eos", "skip_special_tokens", "spaces_between_special_tokens"):
        if f.present(key):
            kwargs[key] = f.bool(key)
    seed = f.int("seed", f.int("sampling_seed"))
    if seed is not None:
        kwargs["seed"] = seed
    kwargs["stop"] = f.str_list("stop")
    kwargs["stop_token_ids"] = f.int_list("stop_token_ids")
    kwargs["logit_bias"] = f.logit_bias("logit_bias")
    kwargs["logit_processors"] = logit_processors(f)
    return SamplingParams(**kwargs)


def checked_sampling(params: SamplingParams, limits: ModelLimits) -> SamplingParams:
    """400 unless ``params`` can be served by this model (ranges, vocabulary, context)."""
    if params.max_new_tokens > limits.max_model_len:
        raise ApiError(
            400,
            f"max_tokens={params.max_new_tokens} is more than this model's context of "
            f"{limits.max_model_len} tokens (prompt plus completion must fit in "
            f"{limits.max_model_len})",
            code="context_length_exceeded",
            param="max_tokens",
        )
    try:
        check_sampling(params, limits.vocab_size)
    except ValueError as exc:
        raise ApiError(400, str(exc), code="invalid_value") from None
    return params


def fan_out(
    rid: str,
    sampling: SamplingParams,
    prompts: list[dict[str, Any]],
    n: int,
    *,
    limit: int,
    bare_single: bool = False,
) -> list[GenerateRequest]:
    """One GenerateRequest per prompt and choice, ``{rid}-{index}`` in order (just ``rid``
    for a lone request when ``bare_single``); 400 past ``limit`` of them, before any is
    made. Choice ``i`` draws with ``seed + i``, so seeded choices differ from one
    another and each is reproducible."""
    if n * len(prompts) > limit:
        raise ApiError(
            400,
            f"this request asks for {n * len(prompts)} completions (n={n} for "
            f"{len(prompts)} prompt(s)); the server allows at most {limit} (--max-n)",
            param="n",
        )
    reqs = []
    for p, prompt in enumerate(prompts):
        for i in range(n):
            seed = None if sampling.seed is None else sampling.seed + i
            params = msgspec.structs.replace(sampling, n=1, seed=seed)
            one = bare_single and n * len(prompts) == 1
            reqs.append(
                GenerateRequest(rid=rid if one else f"{rid}-{p * n + i}", sampling=params, **prompt)
            )
    return reqs
