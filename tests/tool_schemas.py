"""Function `parameters` schemas for the tool-call tests: ones whose values are not all JSON objects
(refused at every entry: a call's arguments are an object) and ones that describe objects only."""

NOT_OBJECTS = [
    {"enum": [1, 2]}, {"const": "hello"}, {"anyOf": [{"type": "string"}, {"type": "integer"}]},
    {"$ref": "#/$defs/s", "$defs": {"s": {"type": "string"}}}, {"oneOf": [{"type": "object"}, {"type": "null"}]},
    {"type": ["string", "null"]}, {"type": ["object", "null"]}, {"type": "array", "items": {"type": "object"}},
    {"type": "integer"}, {"type": "number"}, {"type": "boolean"}, {"type": "null"}, {"type": "string"},
    {"properties": {"city": {"type": "string"}}, "required": ["city"]},  # no type: a scalar passes it too
    {"allOf": [{"type": "string"}, {"maxLength": 3}]}, {"anyOf": []}, {"$ref": "#"}, {"$ref": "#/$defs/gone"},
    {"$ref": "https://example.com/s.json"}, {"enum": [{"a": 1}, 2]}, {"const": [1]}, {"description": "args"},
    {"anyOf": [{"type": "object"}, {"$ref": "#/$defs/n"}], "$defs": {"n": {"type": "number"}}},
]
OBJECTS = [
    {"type": "object"}, {"type": ["object"], "properties": {"x": {"type": "integer"}}},
    {"$ref": "#/$defs/a", "$defs": {"a": {"type": "object", "properties": {"x": {"type": "integer"}}}}},
    {"allOf": [{"type": "object", "properties": {"x": {"type": "integer"}}}, {"required": ["x"]}]},
    {"anyOf": [{"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]},
               {"$ref": "#/$defs/b"}], "$defs": {"b": {"type": "object"}}},
    {"oneOf": [{"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"],
                "additionalProperties": False}, {"type": "object", "properties": {"b": {"type": "string"}},
                                                 "required": ["b"], "additionalProperties": False}]},
    {"const": {"a": 1}}, {"enum": [{"a": 1}, {"b": 2}]},
]

