"""Request bodies of the OpenAI-compatible endpoints: values validated
strictly, fields we do not use accepted and ignored (as the reference APIs do:
a 400 on an unknown field breaks every new client release), fields whose
meaning we cannot honour and that would change the answer refused by name."""

from __future__ import annotations

import logging
from typing import Dict, List, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from .errors import APIError, bad_request

MAX_STOP = 16
MAX_TOP_LOGPROBS = 20
MIN_TEMPERATURE = 1e-6


log = logging.getLogger("mlx_dflash.server")
_IGNORED: set = set()  # (object, field) pairs already named in the log
MAX_IGNORED = 4096  # names remembered (clients choose them: bounded); past it nothing more is logged


def ignored(where: str, names) -> None:
    """Name, once per process and at debug level, request fields we accept and do not use."""
    new = sorted(n for n in names if (where, n) not in _IGNORED)
    if new and len(_IGNORED) < MAX_IGNORED:
        _IGNORED.update((where, n) for n in new)
        log.debug("ignored %s field(s): %s", where, ", ".join(new))


class Schema(BaseModel):
    """strict: "0.5" is not a number and true is not 1. Unknown fields are
    accepted, named in the debug log once and dropped."""

    model_config = ConfigDict(extra="allow", strict=True)

    @model_validator(mode="after")
    def _drop_unknown(self):
        extra = self.__pydantic_extra__
        if extra:
            ignored(type(self).__name__, extra)
            extra.clear()
        return self


class TextPart(Schema):
    type: Literal["text"]
    text: str


class FunctionCall(Schema):
    name: str
    arguments: str


class ToolCall(Schema):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class Message(Schema):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Union[str, List[TextPart], None] = None
    name: Optional[str] = None
    tool_calls: Optional[List[ToolCall]] = None  # assistant turns that called tools
    tool_call_id: Optional[str] = None  # a tool turn: the call it answers

    @model_validator(mode="after")
    def _check_msg(self):
        if self.content is None and not self.tool_calls:
            raise ValueError(f"a {self.role} message needs content")
        if self.tool_calls and self.role != "assistant":
            raise ValueError("only assistant messages carry tool_calls")
        if self.role == "tool" and not self.tool_call_id:
            raise ValueError("a tool message needs tool_call_id")
        return self

    def text(self) -> str:
        if self.content is None:
            return ""
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)

    def template(self) -> dict:
        """The dict the chat template takes (developer is the system role to templates)."""
        from .tools import arguments_dict

        m = {"role": "system" if self.role == "developer" else self.role, "content": self.text()}
        if self.name is not None:
            m["name"] = self.name
        if self.tool_calls:
            m["tool_calls"] = [{"id": c.id, "type": "function", "function": {
                "name": c.function.name, "arguments": arguments_dict(c.function.arguments)}}
                for c in self.tool_calls]
        if self.tool_call_id is not None:
            m["tool_call_id"] = self.tool_call_id
        return m


class FunctionDef(Schema):
    name: str = Field(min_length=1, max_length=128)
    description: Optional[str] = None
    parameters: Optional[dict] = None
    strict: Optional[bool] = None


class Tool(Schema):
    type: Literal["function"]
    function: FunctionDef

    def template(self) -> dict:
        return {"type": "function", "function": self.function.model_dump(exclude_none=True)}


class NamedFunction(Schema):
    name: str


class ToolChoiceFunction(Schema):
    type: Literal["function"]
    function: NamedFunction


class ResponseFormat(Schema):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: Optional[dict] = None


class StreamOptions(Schema):
    include_usage: bool = False


class _Common(Schema):
    model: Optional[str] = None
    max_tokens: Optional[int] = Field(None, ge=1)
    temperature: Optional[float] = Field(None, ge=0, le=100)
    top_p: Optional[float] = Field(None, gt=0, le=1)
    top_k: Optional[int] = Field(None, ge=0)
    min_p: Optional[float] = Field(None, ge=0, lt=1)
    seed: Optional[int] = Field(None, ge=0, lt=2**63)
    stop: Union[str, List[str], None] = None
    stream: bool = False
    stream_options: Optional[StreamOptions] = None  # applies to a stream; ignored otherwise
    n: int = Field(1, ge=1, le=1)  # one choice per request
    user: Optional[str] = None  # the caller's end-user id: metadata, nothing to apply
    frequency_penalty: Optional[float] = Field(None, ge=-2, le=2)
    presence_penalty: Optional[float] = Field(None, ge=-2, le=2)
    repetition_penalty: Optional[float] = Field(None, gt=0, le=10)
    logit_bias: Optional[Dict[str, float]] = None

    @model_validator(mode="after")
    def _check(self):
        if self.temperature is not None and 0 < self.temperature < MIN_TEMPERATURE:
            # logits / t overflows float32 below this: sampling would return garbage
            raise ValueError(f"temperature must be 0 (greedy) or at least {MIN_TEMPERATURE}")
        if isinstance(self.stop, list) and len(self.stop) > MAX_STOP:
            raise ValueError(f"at most {MAX_STOP} stop strings")
        for k, v in (self.logit_bias or {}).items():
            if not k.isdigit():
                raise ValueError(f"logit_bias keys must be token ids, got '{k}'")
            if not -100 <= v <= 100:
                raise ValueError(f"logit_bias values must be in [-100, 100], got {v}")
        return self

    def stops(self) -> List[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])


def unsupported(field: str, why: str) -> APIError:
    """A known field whose meaning this server cannot honour (it would change the answer)."""
    return APIError(400, f"{field}: {why}", field, "unsupported_parameter")


def thinking_kwargs(on: Optional[bool]) -> dict:
    """The chat template's switch for reasoning (mlx-lm maps it to the template's
    own name); nothing when the request does not say."""
    return {} if on is None else {"enable_thinking": on}


def effort_thinks(effort) -> Optional[bool]:
    """OpenAI's reasoning effort as the template's on/off switch: "none" and
    "minimal" turn reasoning off, any other level on."""
    if effort is None:
        return None
    return effort not in ("none", "minimal")


class ChatRequest(_Common):
    messages: List[Message] = Field(min_length=1)
    max_completion_tokens: Optional[int] = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: Optional[int] = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    tools: Optional[List[Tool]] = Field(None, min_length=1)
    tool_choice: Union[Literal["auto", "none", "required"], ToolChoiceFunction, None] = None
    parallel_tool_calls: Optional[bool] = None
    response_format: Optional[ResponseFormat] = None
    reasoning_effort: Optional[str] = None  # switches the template's enable_thinking (effort_thinks)
    modalities: Optional[List[str]] = None  # text only: audio output cannot be made here
    audio: Optional[dict] = None
    functions: Optional[list] = None  # the legacy form of tools: refused, not silently dropped

    @model_validator(mode="before")
    @classmethod
    def _drop_tools(cls, data):
        """Tool types other than function (custom, built-ins) are not offered to the model."""
        tools = data.get("tools") if isinstance(data, dict) else None
        if isinstance(tools, list):
            keep = [t for t in tools if not isinstance(t, dict) or t.get("type") == "function"]
            if len(keep) < len(tools):
                ignored("tools", {str(t.get("type")) for t in tools if t not in keep})
                data = {**data, "tools": keep or None}
        return data

    @model_validator(mode="after")
    def _check_output(self):
        if self.modalities is not None and any(m != "text" for m in self.modalities):
            raise unsupported("modalities", "only text output is supported")
        if self.audio is not None:
            raise unsupported("audio", "audio output is not supported")
        if self.functions:
            raise unsupported("functions", "the legacy functions field is not supported; send them as tools")
        return self

    def gen(self):
        """The request as the worker runs it (app.server.tools.GenRequest)."""
        from .structured import parse_format
        from .tools import GenRequest, check_tool_choice

        rf = self.response_format
        fmt = parse_format(rf.type if rf else None, (rf.json_schema or {}).get("schema") if rf else None,
                           "response_format")
        tools = [t.template() for t in self.tools] if self.tools else None
        choice = self.tool_choice
        if isinstance(choice, ToolChoiceFunction):
            choice = {"name": choice.function.name}
        check_tool_choice(tools, choice)
        return GenRequest(self.model, [m.template() for m in self.messages], tools, choice,
                          self.parallel_tool_calls is not False, self.limit(), self.temperature, self.top_p,
                          self.top_k, self.min_p, self.seed, self.stops(), self.stream, self.n_logprobs(),
                          self.frequency_penalty, self.presence_penalty, self.repetition_penalty, self.logit_bias,
                          template_kwargs=thinking_kwargs(effort_thinks(self.reasoning_effort)),
                          response_format=fmt)

    @model_validator(mode="after")
    def _check_lp(self):
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs requires logprobs: true")
        if self.max_tokens is not None and self.max_completion_tokens is not None:
            raise ValueError("give max_tokens or max_completion_tokens, not both")
        return self

    def limit(self):
        return self.max_completion_tokens or self.max_tokens

    def n_logprobs(self) -> Optional[int]:
        return (self.top_logprobs or 0) if self.logprobs else None


class CompletionRequest(_Common):
    prompt: Union[str, List[int], List[str], List[List[int]]]
    logprobs: Optional[int] = Field(None, ge=0, le=5)
    echo: bool = Field(False, strict=True)
    best_of: int = Field(1, ge=1, le=1)

    @model_validator(mode="after")
    def _check_prompt(self):
        p = self.prompt
        if isinstance(p, list) and p and isinstance(p[0], (str, list)):
            if len(p) != 1:
                raise ValueError("one prompt per request (batches are not supported)")
            self.prompt = p[0]
        if isinstance(self.prompt, list) and any(t < 0 for t in self.prompt):
            raise ValueError("token ids must be >= 0")
        if self.echo:
            raise ValueError("echo is not supported")
        return self

    def limit(self):
        return self.max_tokens

    def n_logprobs(self) -> Optional[int]:
        return self.logprobs


_TYPES = {"str", "int", "float", "bool", "list", "dict", "none"}


def validation_error(e: ValidationError) -> APIError:
    errs = e.errors()
    err = max(errs, key=lambda x: len(x.get("loc", ())))  # the most specific (unions report each branch)
    # drop pydantic's union-branch labels ("str", "list[TextPart]") from the path
    loc = ".".join(str(x) for x in err.get("loc", ()) if not (isinstance(x, str) and ("[" in x or x in _TYPES)))
    if err.get("type") == "missing":
        return bad_request(f"missing required field '{loc}'", loc)
    msg = err.get("msg", "invalid value").removeprefix("Value error, ")
    return bad_request(f"{loc}: {msg}" if loc else msg, loc or None)

