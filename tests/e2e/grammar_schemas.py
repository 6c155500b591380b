"""JSON schemas for the structured-output tests: nested objects, arrays, enums, bounded numbers,
required and optional properties, ``$ref``, ``anyOf``, patterns. Every string and array is
bounded: a random-weight model fills whatever room a schema leaves, and an unbounded string
would run into ``max_tokens`` (finish_reason length, JSON cut short) rather than complete."""
from __future__ import annotations

from typing import Any

NAME = {"type": "string", "maxLength": 6}

SCHEMAS: dict[str, dict[str, Any]] = {
    "flat": {"type": "object", "properties": {"name": NAME, "age": {"type": "integer", "minimum": 0, "maximum": 120}},
             "required": ["name", "age"], "additionalProperties": False},
    "nested": {"type": "object", "properties": {
        "user": {"type": "object", "properties": {"id": {"type": "integer", "minimum": 1, "maximum": 999}, "name": NAME},
                 "required": ["id", "name"], "additionalProperties": False},
        "active": {"type": "boolean"}}, "required": ["user", "active"], "additionalProperties": False},
    "array_of_enums": {"type": "object", "properties": {
        "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "minItems": 1, "maxItems": 4}},
        "required": ["tags"], "additionalProperties": False},
    "bounded_numbers": {"type": "object", "properties": {
        "x": {"type": "integer", "minimum": -5, "maximum": 5},
        "p": {"type": "number", "minimum": 0, "maximum": 1, "multipleOf": 0.25}},
        "required": ["x", "p"], "additionalProperties": False},
    "ref": {"$defs": {"point": {"type": "object", "properties": {"x": {"type": "integer", "minimum": 0, "maximum": 9},
                                                                 "y": {"type": "integer", "minimum": 0, "maximum": 9}},
                                "required": ["x", "y"], "additionalProperties": False}},
            "type": "object", "properties": {"a": {"$ref": "#/$defs/point"}, "b": {"$ref": "#/$defs/point"}},
            "required": ["a", "b"], "additionalProperties": False},
    "optional": {"type": "object", "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 99},
                                                  "note": NAME, "flag": {"type": "boolean"}},
                 "required": ["id"], "additionalProperties": False},
    "any_of": {"type": "object", "properties": {"v": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 9},
                                                               {"enum": ["none", "many"]}]}},
               "required": ["v"], "additionalProperties": False},
    "array_of_objects": {"type": "object", "properties": {"items": {"type": "array", "maxItems": 3, "items": {
        "type": "object", "properties": {"k": {"enum": ["a", "b"]}, "n": {"type": "integer", "minimum": 0, "maximum": 3}},
        "required": ["k", "n"], "additionalProperties": False}}}, "required": ["items"], "additionalProperties": False},
    "pattern": {"type": "object", "properties": {"code": {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{3}$"}},
                "required": ["code"], "additionalProperties": False},
    "top_level_enum": {"enum": ["alpha", "beta", 7, True]},
    "deep": {"type": "object", "properties": {"a": {"type": "object", "properties": {"b": {"type": "object", "properties": {
        "c": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "maxItems": 3}},
        "required": ["c"], "additionalProperties": False}}, "required": ["b"], "additionalProperties": False}},
        "required": ["a"], "additionalProperties": False},
    "const_and_null": {"type": "object", "properties": {"kind": {"const": "event"}, "at": {"type": ["integer", "null"],
                                                                                           "minimum": 0, "maximum": 60}},
                       "required": ["kind", "at"], "additionalProperties": False},
}
