"""Request bodies of the OpenAI-compatible endpoints, validated strictly."""

from __future__ import annotations

from typing import Dict, List, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from .errors import APIError, _bad

MAX_STOP = 16
MAX_TOP_LOGPROBS = 20
MIN_TEMPERATURE = 1e-6


# strict: "0.5" is not a number and true is not 1; extra="forbid": an unknown
# field is an option we would otherwise silently ignore.

class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class FunctionCall(_Strict):
    name: str
    arguments: str


class ToolCall(_Strict):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class Message(_Strict):
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


class FunctionDef(_Strict):
    name: str = Field(min_length=1, max_length=128)
    description: Optional[str] = None
    parameters: Optional[dict] = None
    strict: Optional[bool] = None


class Tool(_Strict):
    type: Literal["function"]
    function: FunctionDef

    def template(self) -> dict:
        return {"type": "function", "function": self.function.model_dump(exclude_none=True)}


class NamedFunction(_Strict):
    name: str


class ToolChoiceFunction(_Strict):
    type: Literal["function"]
    function: NamedFunction


class ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: Optional[dict] = None




class StreamOptions(_Strict):
    include_usage: bool = False


class _Common(_Strict):
    model: Optional[str] = None
    max_tokens: Optional[int] = Field(None, ge=1)
    temperature: Optional[float] = Field(None, ge=0, le=100)
    top_p: Optional[float] = Field(None, gt=0, le=1)
    top_k: Optional[int] = Field(None, ge=0)
    min_p: Optional[float] = Field(None, ge=0, lt=1)
    seed: Optional[int] = Field(None, ge=0, lt=2**63)
    stop: Union[str, List[str], None] = None
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    n: int = Field(1, ge=1, le=1)
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
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed with stream: true")
        for k, v in (self.logit_bias or {}).items():
            if not k.isdigit():
                raise ValueError(f"logit_bias keys must be token ids, got '{k}'")
            if not -100 <= v <= 100:
                raise ValueError(f"logit_bias values must be in [-100, 100], got {v}")
        return self

    def stops(self) -> List[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])


class ChatRequest(_Common):
    messages: List[Message] = Field(min_length=1)
    max_completion_tokens: Optional[int] = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: Optional[int] = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    tools: Optional[List[Tool]] = Field(None, min_length=1)
    tool_choice: Union[Literal["auto", "none", "required"], ToolChoiceFunction, None] = None
    parallel_tool_calls: Optional[bool] = None
    response_format: Optional[ResponseFormat] = None

    def gen(self):
        """The request as the worker runs it (app.server.tools.GenRequest)."""
        from .tools import GenRequest, check_tool_choice

        from .structured import parse_format

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


def _validation_message(e: ValidationError) -> APIError:
    errs = e.errors()
    err = max(errs, key=lambda x: len(x.get("loc", ())))  # the most specific (unions report each branch)
    # drop pydantic's union-branch labels ("str", "list[TextPart]") from the path
    loc = ".".join(str(x) for x in err.get("loc", ()) if not (isinstance(x, str) and ("[" in x or x in _TYPES)))
    if err.get("type") == "extra_forbidden":
        return _bad(f"unsupported field '{loc}'", loc, "unsupported_parameter")
    if err.get("type") == "missing":
        return _bad(f"missing required field '{loc}'", loc)
    msg = err.get("msg", "invalid value").removeprefix("Value error, ")
    return _bad(f"{loc}: {msg}" if loc else msg, loc or None)

