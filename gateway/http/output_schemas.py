"""Request types for structured output and tools, as OpenAI and vLLM name them.

`gateway.http.schemas` adds these as optional fields of the chat and completion bodies; the semantic
checks (does the schema compile? does the named tool exist?) live in `gateway.prompt.structured` and
`gateway.prompt.tools`, which answer 400. Here only the shapes are checked (422 on a wrong type).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

FUNCTION_NAME = Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.\-]+$")]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True, populate_by_name=True)


class JsonSchemaFormat(_Strict):
    name: Annotated[str, Field(max_length=64)] = "response"
    description: str | None = None
    # "schema" would shadow pydantic's BaseModel.schema; the JSON key stays "schema".
    schema_: dict[str, Any] | bool | None = Field(default=None, alias="schema")
    strict: bool | None = None  # constrained either way: a schema is always enforced here


class ResponseFormat(_Strict):
    # gateway.prompt.structured answers 400 to a json_schema type without its json_schema.
    model_config = ConfigDict(json_schema_extra={"anyOf": [
        {"properties": {"type": {"enum": ["text", "json_object"]}}},
        {"required": ["json_schema"], "properties": {"json_schema": {"type": "object"}}}]})
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


def _one_of(fields: tuple[str, ...], flag: str) -> dict[str, Any]:
    """At most one of `fields` set (not null), or `flag` true and none of them."""
    unset = {f: {"type": "null"} for f in fields}
    off = {flag: {"const": False}}
    return {"anyOf": [{"properties": {**unset, **off}},
                      {"properties": {**unset, flag: {"const": True}}},
                      *({"properties": {**{g: v for g, v in unset.items() if g != f}, **off}}
                        for f in fields)]}


class StructuredOutputs(_Strict):
    """vLLM's `structured_outputs` (the newer spelling of its guided_* fields)."""

    # One of them at most: gateway.prompt.structured answers 400 to more.
    model_config = ConfigDict(json_schema_extra=_one_of(("json", "regex", "choice", "grammar"),
                                                        "json_object"))
    json_: dict[str, Any] | str | bool | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: Annotated[list[str] | None, Field(json_schema_extra={"minItems": 1})] = None
    grammar: str | None = None
    json_object: bool = False

    @property
    def json(self) -> Any:  # type: ignore[override]  # read as `json` by gateway.prompt.structured
        return self.json_


class FunctionDef(_Strict):
    name: FUNCTION_NAME
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(_Strict):
    type: Literal["function"] = "function"
    function: FunctionDef


class NamedFunction(_Strict):
    name: FUNCTION_NAME


class NamedToolChoice(_Strict):
    type: Literal["function"] = "function"
    function: NamedFunction


class CalledFunction(_Strict):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCall(_Strict):
    id: str
    type: Literal["function"] = "function"
    function: CalledFunction


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice
