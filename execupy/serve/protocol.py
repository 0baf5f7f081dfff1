"""OpenAI's wire format: request fields checked into dataclasses, responses and errors shaped.

Requests are checked field by field; a bad one raises ApiError naming the field (its
`param`), which the app returns as OpenAI's error object with status 400. Fields this
server does not implement are refused by name when set to anything but their neutral
value (frequency_penalty, presence_penalty, n, logprobs, tools), rather than ignored.
Unknown fields are ignored, as other OpenAI-compatible servers do.
"""
from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Optional, Union


@dataclass
class ApiError(Exception):
    """An error response: HTTP status and OpenAI's {"error": {...}} object."""

    status: int
    message: str
    type: str = "invalid_request_error"
    param: Optional[str] = None
    code: Optional[str] = None

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad_field(name: str, message: str) -> ApiError:
    return ApiError(400, f"{name}: {message}", param=name, code="invalid_value")


@dataclass
class GenerationRequest:
    """What to generate, common to /v1/chat/completions and /v1/completions."""

    kind: str  # "chat" or "completion"
    model: Optional[str]
    messages: list[dict[str, str]] = field(default_factory=list)  # chat
    prompt: str = ""  # completion
    stream: bool = False
    include_usage: bool = False  # stream_options.include_usage: one more chunk, with usage only
    max_tokens: Optional[int] = None  # None: the server's default
    temperature: float = 1.0  # OpenAI's default
    top_p: float = 1.0
    seed: Optional[int] = None
    stop: list[str] = field(default_factory=list)


# ---------------------------------------------------------------------------- parsing


def parse_json_object(raw: bytes) -> dict:
    try:
        body = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ApiError(400, f"the request body is not valid JSON: {e}", code="invalid_json") from None
    if not isinstance(body, dict):
        raise ApiError(400, f"the request body must be a JSON object, got {type(body).__name__}", code="invalid_json")
    return body


def _number(body: dict, name: str, default: float, low: float, high: float, low_open: bool = False) -> float:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise bad_field(name, f"expected a number, got {json.dumps(value)}")
    if value > high or value < low or (low_open and value == low):
        bound = f"({low}, {high}]" if low_open else f"[{low}, {high}]"
        raise bad_field(name, f"{value} is outside {bound}")
    return float(value)


def _integer(body: dict, name: str, minimum: Optional[int] = None) -> Optional[int]:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise bad_field(name, f"expected an integer, got {json.dumps(value)}")
    if minimum is not None and value < minimum:
        raise bad_field(name, f"must be at least {minimum}, got {value}")
    return value


def _boolean(body: dict, name: str) -> bool:
    value = body.get(name, False)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise bad_field(name, f"expected true or false, got {json.dumps(value)}")
    return value


def _stop(body: dict) -> list[str]:
    value = body.get("stop")
    if value is None:
        return []
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops) or len(stops) > 4:
        raise bad_field("stop", "expected a non-empty string or a list of at most 4 of them")
    return stops


def _refuse_unsupported(body: dict) -> None:
    """Fields whose only supported value is the neutral one."""
    for name in ("frequency_penalty", "presence_penalty"):
        value = body.get(name)
        if value not in (None, 0, 0.0) or isinstance(value, bool):
            raise ApiError(400, f"{name} is not supported by this server (only 0); repetition is not penalized",
                           param=name, code="unsupported_parameter")
    if body.get("n") not in (None, 1):
        raise ApiError(400, "n: this server returns one choice per request (n must be 1)", param="n",
                       code="unsupported_parameter")
    for name in ("logprobs", "tools", "functions", "tool_choice"):
        if body.get(name) not in (None, False, [], "none"):
            raise ApiError(400, f"{name} is not supported by this server", param=name, code="unsupported_parameter")
    response_format = body.get("response_format")
    if response_format not in (None, {"type": "text"}):
        raise ApiError(400, "response_format: only {\"type\": \"text\"} is supported", param="response_format",
                       code="unsupported_parameter")


def _common(body: dict, kind: str) -> GenerationRequest:
    _refuse_unsupported(body)
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise bad_field("model", f"expected a string, got {json.dumps(model)}")
    max_tokens = _integer(body, "max_completion_tokens", 1)
    if max_tokens is None:
        max_tokens = _integer(body, "max_tokens", 1)
    seed = _integer(body, "seed", 0)
    options = body.get("stream_options") or {}
    if not isinstance(options, dict):
        raise bad_field("stream_options", f"expected an object, got {json.dumps(options)}")
    return GenerationRequest(kind=kind, model=model, stream=_boolean(body, "stream"),
                             include_usage=_boolean(options, "include_usage"), max_tokens=max_tokens,
                             temperature=_number(body, "temperature", 1.0, 0.0, 2.0),
                             top_p=_number(body, "top_p", 1.0, 0.0, 1.0, low_open=True),
                             seed=seed, stop=_stop(body))


def _message_text(content: Any, where: str) -> str:
    """A message's content: a string, or a list of {"type": "text", "text": ...} parts."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for k, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise bad_field(f"{where}.content[{k}]", "only text parts ({\"type\": \"text\", \"text\": ...}) "
                                "are supported")
            texts.append(part["text"])
        return "".join(texts)
    raise bad_field(f"{where}.content", f"expected a string or a list of text parts, got {json.dumps(content)}")


ROLES = ("system", "developer", "user", "assistant")


def parse_chat_request(body: dict) -> GenerationRequest:
    request = _common(body, "chat")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad_field("messages", "expected a non-empty list of {\"role\", \"content\"} objects")
    for k, message in enumerate(messages):
        where = f"messages[{k}]"
        if not isinstance(message, dict):
            raise bad_field(where, "expected an object with role and content")
        role = message.get("role")
        if role not in ROLES:
            raise bad_field(f"{where}.role", f"expected one of {', '.join(ROLES)}, got {json.dumps(role)}")
        # Templates written before "developer" existed know it as "system".
        request.messages.append({"role": "system" if role == "developer" else role,
                                 "content": _message_text(message.get("content"), where)})
    return request


def parse_completion_request(body: dict) -> GenerationRequest:
    request = _common(body, "completion")
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if not isinstance(prompt, str) or not prompt:
        raise bad_field("prompt", "expected a non-empty string (one prompt per request)")
    if body.get("echo") or body.get("suffix") or body.get("best_of") not in (None, 1):
        raise ApiError(400, "echo, suffix and best_of are not supported by this server", code="unsupported_parameter")
    request.prompt = prompt
    return request


# ---------------------------------------------------------------------------- responses


@dataclass
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int

    def to_dict(self) -> dict:
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
                "total_tokens": self.prompt_tokens + self.completion_tokens,
                "prompt_tokens_details": {"cached_tokens": self.cached_tokens}}


@dataclass
class ResponseShape:
    """Ids and envelope of one response (whole or streamed)."""

    kind: str
    model: str
    id: str = ""
    created: int = 0

    def __post_init__(self) -> None:
        prefix = "chatcmpl" if self.kind == "chat" else "cmpl"
        self.id = self.id or f"{prefix}-{uuid.uuid4().hex[:24]}"
        self.created = self.created or int(time.time())

    def _envelope(self, obj: str, choice: dict, usage: Optional[Usage]) -> dict:
        out: dict[str, Any] = {"id": self.id, "object": obj, "created": self.created, "model": self.model,
                               "system_fingerprint": None, "choices": [choice]}
        if usage is not None:
            out["usage"] = usage.to_dict()
        return out

    def whole(self, text: str, finish_reason: str, usage: Usage) -> dict:
        if self.kind == "chat":
            choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                      "finish_reason": finish_reason}
            return self._envelope("chat.completion", choice, usage)
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
        return self._envelope("text_completion", choice, usage)

    def usage_chunk(self, usage: Usage) -> dict:
        """The extra last chunk stream_options.include_usage asks for: no choices, the usage."""
        out = self._envelope("chat.completion.chunk" if self.kind == "chat" else "text_completion", {}, usage)
        out["choices"] = []
        return out

    def chunk(self, text: Optional[str], finish_reason: Optional[str] = None, usage: Optional[Usage] = None,
              first: bool = False) -> dict:
        """One streamed chunk; the last one has the finish_reason and the usage."""
        if self.kind == "chat":
            delta: dict[str, str] = {"role": "assistant"} if first else {}
            if text is not None:
                delta["content"] = text
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
            return self._envelope("chat.completion.chunk", choice, usage)
        choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish_reason}
        return self._envelope("text_completion", choice, usage)


def sse(data: Union[dict, str]) -> bytes:
    """One server-sent event."""
    payload = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)
    return f"data: {payload}\n\n".encode()
