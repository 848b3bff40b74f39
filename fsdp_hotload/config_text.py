"""How the text of a ``HOTLOAD_*`` variable or a ``--hotload-*`` flag becomes a config field's value.

Why a module of its own: the variables and the Megatron flags must read a value by one rule (a JSON list where a
field needs one, a plain word where it does not), and the rule needs only the field's type, not the config.

Example::

    parse_setting('["dep-a", "dep-b"]', str | list[str] | None)   # ['dep-a', 'dep-b']
    parse_setting("mtp.*", list[str])                              # ['mtp.*']
"""
from __future__ import annotations

import json
import types
from typing import Any, Union, get_args, get_origin


def _union_members(annotation: Any) -> tuple[Any, ...]:
    if get_origin(annotation) in (Union, types.UnionType):
        return get_args(annotation)
    return (annotation,)


def _no_json_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON value")


def parse_setting(text: str, annotation: Any) -> Any:
    """A field's value from the text of an environment variable or a ``--hotload-*`` flag (one rule for both).

    JSON is decoded only where the field's type needs it: for list and dict fields, and for text starting with
    ``[``, ``{`` or ``"`` (a list of deployments, a quoted string); one plain value (no comma, no space) of a
    field that takes only lists is the list of it. Other text stays the string it is, so an id
    such as ``12345`` or ``true`` reaches a string field unchanged; pydantic converts numbers and booleans when
    it validates. ``null`` is None where the field accepts None (``'"null"'`` is the text). Raises ValueError
    for bad JSON in a list or dict field, and for ``null`` where the field does not accept None: it would
    otherwise reach a text field as the word (a prefix ``null``) and other fields as a type error.
    """
    members = _union_members(annotation)
    kinds = kinds_of(members)
    stripped = text.strip()
    json_only = kinds <= {list, dict}
    if stripped == "null":
        if type(None) in members:
            return None
        raise ValueError("null is not a value of this field (it has no 'unset' value); leave it unset for its "
                         "default" + (", or quote the word (\"null\") to mean the text" if str in members else ""))
    if not json_only and stripped[:1] not in ("[", "{", '"'):
        return text
    if kinds == {list} and stripped and stripped[:1] not in "[{\"":
        if "," in stripped or len(stripped.split()) > 1:  # "a,b" would be one glob or key
            raise ValueError(f"{text!r} is not one plain value: write several as a JSON list, e.g. [\"a\", \"b\"]")
        return [stripped]  # one plain value of a list-only field: the list of it (carry_base_tensors=mtp.*)
    try:
        return json.loads(stripped, parse_constant=_no_json_constant)
    except ValueError as exc:
        if json_only:
            raise ValueError(f"not valid JSON ({exc}); it takes {json_hint(annotation)}") from None
        return text


def json_hint(annotation: Any) -> str:
    """How a list or dict field is written as text (a variable, a flag), or '' for other fields."""
    kinds = kinds_of(_union_members(annotation))
    if dict in kinds:
        return 'a JSON object, e.g. {"name": "value"}'
    if list in kinds:
        return 'a JSON list, e.g. ["a", "b"] (or one plain value)'
    return ""


def kinds_of(members: Any) -> set[Any]:
    """The container kinds (list, dict) or plain types of a field's union members, None left out."""
    return {get_origin(m) or m for m in members if m is not type(None)}


def merged_options(under: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    """``over``'s entries over ``under``'s, dicts in both merged the same way. Why all the way down: an endpoint
    given in code or as a flag (``client_kwargs``) replaced the variable's whole, and with it the credentials or
    SSE-C key the variable held there, leaving the provider's credential chain (another identity) in their place.
    """
    out = dict(under)
    for key, value in over.items():
        out[key] = merged_options(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) \
            else value
    return out
