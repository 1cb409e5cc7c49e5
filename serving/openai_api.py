"""The requests and errors of OpenAI's completions and chat completions API, as serve.py takes them:
pydantic models, strict (a field of the wrong type or an unknown one is an error; fields this
server cannot honour are accepted only at their defaults), and OpenAI's {"error": {...}} body.
"""

from typing import Literal, Optional, Union

from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ConfigDict, Field


class APIError(Exception):
    """An error the client sees as OpenAI's {"error": {...}} body with this HTTP status."""

    def __init__(
        self,
        status: int,
        message: str,
        kind: str = "invalid_request_error",
        param: Optional[str] = None,
        code: Optional[str] = None,
    ):
        super().__init__(message)
        self.status, self.body = (
            status,
            {"error": {"message": message, "type": kind, "param": param, "code": code}},
        )


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    include_usage: bool = False


class Sampling(BaseModel):
    """The fields both endpoints take. Strict: a number sent as a string is an error, as is a field
    this server does not know; OpenAI fields it cannot honour are accepted only at their
    defaults."""

    model_config = ConfigDict(extra="forbid", strict=True)
    model: str
    max_tokens: Optional[int] = Field(None, gt=0)
    temperature: float = Field(1.0, ge=0, le=2)
    top_p: float = Field(1.0, ge=1, le=1, description="not supported: only 1")
    top_k: Optional[int] = Field(None, gt=0)
    stop: Optional[Union[str, list[str]]] = None
    seed: Optional[int] = None
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    n: int = Field(1, ge=1, le=1, description="one choice per request")
    user: Optional[str] = None
    presence_penalty: float = Field(0.0, ge=0, le=0, description="not supported")
    frequency_penalty: float = Field(0.0, ge=0, le=0, description="not supported")


class CompletionRequest(Sampling):
    prompt: Union[str, list[str]]


class TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    type: Literal["text"]
    text: str


class Message(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    role: Literal["system", "user", "assistant"]
    content: Union[str, list[TextPart]]
    name: Optional[str] = None

    def text(self) -> str:
        return (
            self.content
            if isinstance(self.content, str)
            else "".join(part.text for part in self.content)
        )


class ChatRequest(Sampling):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: Optional[int] = Field(None, gt=0)


def validation_message(error: RequestValidationError) -> tuple[str, Optional[str]]:
    """One line for the first problem pydantic found, and the parameter it concerns."""
    first = error.errors()[0]
    where = [str(x) for x in first.get("loc", ()) if x != "body"]
    if first.get("type") == "json_invalid":
        return "the request body is not valid JSON", None
    if first.get("type") == "extra_forbidden":
        return f"unrecognized request argument supplied: {'.'.join(where)}", ".".join(where)
    return f"{'.'.join(where) or 'body'}: {first.get('msg')}", ".".join(where) or None
