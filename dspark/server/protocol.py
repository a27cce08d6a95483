"""Parse and validate OpenAI request bodies into a GenerationRequest (before tokenization).

Wrong JSON types are 422 (the body does not fit the schema); valid types with unusable values or
unsupported features are 400, each naming the parameter."""
from __future__ import annotations

import re
from dataclasses import dataclass, field

from dspark.sampling_params import SamplingParams
from dspark.server.errors import APIError, bad_request, wrong_type

ROLES = ("system", "developer", "user", "assistant", "tool")
MAX_STOP = 16
# sampling extensions other servers take; accepted only at the value that changes nothing
NEUTRAL = (("presence_penalty", 0), ("frequency_penalty", 0), ("repetition_penalty", 1), ("min_p", 0),
           ("min_tokens", 0))

_KINDS = {
    "int": (lambda v: isinstance(v, int) and not isinstance(v, bool), "an integer"),
    "number": (lambda v: isinstance(v, (int, float)) and not isinstance(v, bool), "a number"),
    "bool": (lambda v: isinstance(v, bool), "a boolean"),
    "str": (lambda v: isinstance(v, str), "a string"),
    "list": (lambda v: isinstance(v, list), "an array"),
    "dict": (lambda v: isinstance(v, dict), "an object"),
}


@dataclass(frozen=True)
class GenerationRequest:
    """A validated chat or completion request: what to generate and how, not yet tokenized."""

    kind: str  # "chat" | "completion"
    model: str | None
    messages: list[dict] | None  # chat: [{"role", "content": str}]
    prompt: str | list[int] | None  # completion: text or token ids
    sampling: dict = field(default_factory=dict)  # SamplingParams keyword arguments but max_tokens
    max_tokens: int | None = None  # None: the rest of the context
    stream: bool = False
    include_usage: bool = False

    def sampling_params(self, max_tokens: int) -> SamplingParams:
        """SamplingParams for this request (its values were checked when it was parsed)."""
        return _sampling_params(self.sampling, max_tokens)


def _sampling_params(sampling: dict, max_tokens: int) -> SamplingParams:
    """SamplingParams(**sampling); a bad value becomes a 400 naming the parameter."""
    try:
        return SamplingParams(max_tokens=max_tokens, **sampling)
    except ValueError as e:
        m = re.match(r"SamplingParams\.(\w+) (.*)", str(e))
        name, why = (m.group(1), m.group(2)) if m else (None, str(e))
        raise bad_request(f"Invalid '{name}': {why}" if name else why, param=name) from None


def parse_chat(body: dict) -> GenerationRequest:
    """Validate a /v1/chat/completions body."""
    if "messages" not in body or body["messages"] is None:
        raise bad_request("Missing required parameter: 'messages'.", "messages", "missing_required_parameter")
    messages = _field(body, "messages", "list")
    if not messages:
        raise bad_request("'messages' must contain at least one message.", "messages")
    if _field(body, "logprobs", "bool", False) or _field(body, "top_logprobs", "int") is not None:
        raise bad_request("logprobs are not supported by this server; omit 'logprobs' and 'top_logprobs'.",
                          "logprobs", "unsupported_parameter")
    _reject_tool_calling(body)
    fmt = _field(body, "response_format", "dict")
    if fmt is not None and fmt.get("type", "text") != "text":
        raise bad_request("only response_format {'type': 'text'} is supported.", "response_format",
                          "unsupported_parameter")
    max_tokens = _field(body, "max_completion_tokens", "int")
    name = "max_completion_tokens"
    if max_tokens is None:
        max_tokens, name = _field(body, "max_tokens", "int"), "max_tokens"
    return _request(body, "chat", messages=[_message(m, i) for i, m in enumerate(messages)],
                    max_tokens=_positive(max_tokens, name))


def _reject_tool_calling(body: dict) -> None:
    """Tool and function calling, current and legacy: a 400, never silently ignored."""
    for name in ("tools", "functions"):
        if _field(body, name, "list"):
            raise bad_request(f"tool calling is not supported by this server; omit '{name}'.", name,
                              "unsupported_parameter")
    for name in ("tool_choice", "function_call"):
        if body.get(name) not in (None, "none"):
            raise bad_request(f"'{name}' asks for tool calling, which this server does not support; omit it.",
                              name, "unsupported_parameter")


def parse_completion(body: dict) -> GenerationRequest:
    """Validate a /v1/completions body (OpenAI's default max_tokens for it is 16)."""
    if "prompt" not in body or body["prompt"] is None:
        raise bad_request("Missing required parameter: 'prompt'.", "prompt", "missing_required_parameter")
    if _field(body, "logprobs", "int") is not None:
        raise bad_request("logprobs are not supported by this server; omit 'logprobs'.", "logprobs",
                          "unsupported_parameter")
    if _field(body, "echo", "bool", False):
        raise bad_request("echo is not supported by this server.", "echo", "unsupported_parameter")
    if _field(body, "suffix", "str") is not None:
        raise bad_request("suffix is not supported by this server.", "suffix", "unsupported_parameter")
    if _field(body, "best_of", "int", 1) != 1:
        raise bad_request("best_of other than 1 is not supported by this server.", "best_of", "unsupported_parameter")
    max_tokens = _positive(_field(body, "max_tokens", "int", 16), "max_tokens")
    return _request(body, "completion", prompt=_prompt(body["prompt"]), max_tokens=max_tokens)


def _request(body: dict, kind: str, *, messages=None, prompt=None, max_tokens: int | None) -> GenerationRequest:
    n = _field(body, "n", "int", 1)
    if n != 1:
        raise bad_request(f"n={n} is not supported: this server returns one choice per request; "
                          "send n separate requests (with different seeds when sampling).", "n",
                          "unsupported_parameter")
    for name, neutral in NEUTRAL:
        if _field(body, name, "number", neutral) != neutral:
            raise bad_request(f"'{name}' is not supported by this server; omit it or pass {neutral}.", name,
                              "unsupported_parameter")
    if _field(body, "logit_bias", "dict"):
        raise bad_request("logit_bias is not supported by this server.", "logit_bias", "unsupported_parameter")
    stream = _field(body, "stream", "bool", False)
    options = _field(body, "stream_options", "dict")
    if options is not None and not stream:
        raise bad_request("'stream_options' is only allowed when 'stream' is true.", "stream_options")
    include_usage = bool(options and _field(options, "include_usage", "bool", False, prefix="stream_options."))
    # ranges are SamplingParams' (GenerationRequest.sampling_params turns its ValueError into a 400)
    sampling = dict(temperature=_field(body, "temperature", "number", 1.0),
                    top_p=_field(body, "top_p", "number", 1.0), top_k=_field(body, "top_k", "int", -1),
                    seed=_field(body, "seed", "int"), stop=_stop(body.get("stop")),
                    stop_token_ids=_int_list(body, "stop_token_ids"),
                    ignore_eos=_field(body, "ignore_eos", "bool", False))
    _sampling_params(sampling, max_tokens or 1)  # reject bad values before the prompt is tokenized
    _field(body, "user", "str")
    model = _field(body, "model", "str")
    return GenerationRequest(kind=kind, model=model, messages=messages, prompt=prompt, sampling=sampling,
                             max_tokens=max_tokens, stream=stream, include_usage=include_usage)


def _field(body: dict, name: str, kind: str, default=None, *, prefix: str = ""):
    value = body.get(name)
    if value is None:
        return default
    ok, expected = _KINDS[kind]
    if not ok(value):
        raise wrong_type(prefix + name, expected, value)
    return value


def _positive(value: int | None, name: str) -> int | None:
    if value is not None and value < 1:
        raise bad_request(f"'{name}' must be at least 1, got {value}", name)
    return value


def _message(m: object, i: int) -> dict:
    where = f"messages[{i}]"
    if not isinstance(m, dict):
        raise wrong_type(where, "an object", m)
    role = m.get("role")
    if role is None:
        raise bad_request(f"Missing required parameter: '{where}.role'.", f"{where}.role", "missing_required_parameter")
    if not isinstance(role, str):
        raise wrong_type(f"{where}.role", "a string", role)
    if role not in ROLES:
        raise bad_request(f"'{where}.role' must be one of {', '.join(ROLES)}, got {role!r}", f"{where}.role")
    for name in ("tool_calls", "function_call"):  # the chat template would drop them from the prompt
        if m.get(name):
            raise bad_request(f"'{where}.{name}': tool calls in the conversation are not supported by this "
                              "server.", f"{where}.{name}", "unsupported_parameter")
    content = m.get("content")
    if content is None:
        if role != "assistant":
            raise bad_request(f"Missing required parameter: '{where}.content'.", f"{where}.content",
                              "missing_required_parameter")
        content = ""
    elif isinstance(content, list):
        content = "".join(_text_part(p, f"{where}.content[{j}]") for j, p in enumerate(content))
    elif not isinstance(content, str):
        raise wrong_type(f"{where}.content", "a string or an array of text parts", content)
    return {"role": role, "content": content}


def _text_part(part: object, where: str) -> str:
    if not isinstance(part, dict):
        raise wrong_type(where, "an object", part)
    if part.get("type") != "text":
        raise bad_request(f"'{where}': only text content parts are supported, got type {part.get('type')!r}",
                          where, "unsupported_parameter")
    text = part.get("text")
    if not isinstance(text, str):
        raise wrong_type(f"{where}.text", "a string", text)
    return text


def _prompt(prompt: object) -> str | list[int]:
    is_int = _KINDS["int"][0]
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        if not prompt:
            raise bad_request("'prompt' is empty.", "prompt")
        return prompt
    if isinstance(prompt, list) and prompt and all(is_int(t) for t in prompt):
        return list(prompt)
    if isinstance(prompt, list) and len(prompt) > 1 and all(isinstance(p, (str, list)) for p in prompt):
        raise bad_request("batched prompts are not supported: send one prompt per request.", "prompt",
                          "unsupported_parameter")
    if isinstance(prompt, list) and not prompt:
        raise bad_request("'prompt' is empty.", "prompt")
    raise wrong_type("prompt", "a string or an array of token ids", prompt)


def _stop(stop: object) -> list[str]:
    if stop is None:
        return []
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
        raise wrong_type("stop", "a string or an array of strings", stop)
    if len(stop) > MAX_STOP or not all(stop):
        raise bad_request(f"'stop' takes at most {MAX_STOP} non-empty strings.", "stop")
    return stop


def _int_list(body: dict, name: str) -> list[int]:
    value = _field(body, name, "list", [])
    if not all(_KINDS["int"][0](t) for t in value):
        raise wrong_type(name, "an array of integers", value)
    return value


def check_model(requested: str | None, served: tuple[str, ...]) -> None:
    """404 for a model this server does not serve (None: the default)."""
    if requested is not None and requested not in served:
        raise APIError(404, f"The model '{requested}' does not exist; this server serves '{served[0]}'.",
                       param="model", code="model_not_found")
