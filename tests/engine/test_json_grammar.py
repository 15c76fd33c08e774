"""``guided_json`` through a grammar (engine/json_grammar.py): regexes translated to GBNF against ``re``; the grammar
against the regex DFA on the same strings for schemas a regex expresses; recursive schemas (trees, linked lists,
mutual and root recursion) against a JSON Schema checker written here on hypothesis-generated documents and their
corruptions; free values of any depth; the choice of engine; the errors; and generation on the real SmolLM2
weights."""

import json
import re

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from infercore import Engine, SamplingParams
from infercore.engine.fsm import _FORMATS, CharDFA, json_object_regex, json_schema_regex
from infercore.engine.grammar import Grammar
from infercore.engine.guided import GrammarGuide, TokenGuide
from infercore.engine.json_grammar import json_schema_grammar, json_schema_guide, regex_gbnf

FAST = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
SEPARATORS = [(",", ":"), (", ", ": ")]  # the whitespace both paths allow: one optional space


# ------------------------------------------------------------------------------------------------ a reference


def _resolve(root, ref):
    node = root
    for part in ref[2:].split("/") if ref != "#" else []:
        node = node[part.replace("~1", "/").replace("~0", "~")]
    return node


def valid(x, s, root) -> bool:
    """JSON Schema validity of the value ``x`` for the subset these tests use (written from the specification,
    not from the compilers)."""
    if s is True or s == {}:
        return True
    if "$ref" in s:
        return valid(x, _resolve(root, s["$ref"]), root)
    if s.get("nullable") and x is None:
        return True
    if "allOf" in s:
        return all(valid(x, sub, root) for sub in s["allOf"])
    if "anyOf" in s:
        return any(valid(x, sub, root) for sub in s["anyOf"])
    if "oneOf" in s:
        return sum(valid(x, sub, root) for sub in s["oneOf"]) == 1
    if "const" in s:
        return json.dumps(x) == json.dumps(s["const"])
    if "enum" in s:
        return any(json.dumps(x) == json.dumps(v) for v in s["enum"])
    t = s.get("type")
    if isinstance(t, list):
        return any(valid(x, {**s, "type": u}, root) for u in t)
    if t == "object" or (t is None and isinstance(x, dict) and ("properties" in s or "additionalProperties" in s)):
        if not isinstance(x, dict):
            return False
        props = s.get("properties", {})
        if any(k not in x for k in s.get("required", [])):
            return False
        extra = s.get("additionalProperties", True)
        return all(valid(v, props[k], root) if k in props else (extra is not False and valid(v, extra, root))
                   for k, v in x.items())
    if t == "array":
        return (isinstance(x, list) and s.get("minItems", 0) <= len(x) <= s.get("maxItems", len(x))
                and all(valid(v, s.get("items", True), root) for v in x))
    if t == "string":
        return (isinstance(x, str) and s.get("minLength", 0) <= len(x) <= s.get("maxLength", len(x))
                and ("pattern" not in s or re.search(s["pattern"], x) is not None))
    if t in ("integer", "number"):
        ok = isinstance(x, int) if t == "integer" else isinstance(x, (int, float))
        return (ok and not isinstance(x, bool) and s.get("minimum", x) <= x <= s.get("maximum", x))
    if t == "boolean":
        return isinstance(x, bool)
    if t == "null":
        return x is None
    return t is None


# text within the Basic Multilingual Plane: outside it, an ASCII-escaped character is two escapes, and a regex's
# maxLength counts escapes
_bmp = st.text(st.characters(max_codepoint=0xFFFF, exclude_categories=("Cs",)), max_size=5)


def json_values(max_leaves: int = 12):
    scalars = st.none() | st.booleans() | st.integers(-10**6, 10**6) | st.text(max_size=6) | st.floats(
        allow_nan=False, allow_infinity=False)
    return st.recursive(scalars, lambda kids: st.lists(kids, max_size=3) | st.dictionaries(
        st.text(max_size=4), kids, max_size=3), max_leaves=max_leaves)


def mutants(data, text: str, n: int = 6) -> list[str]:
    """Near misses of ``text``: a character deleted, inserted or replaced, or the text cut short."""
    out = []
    alphabet = '{}[]",: 0-1.eatrunlx\\'
    for _ in range(n):
        i = data.draw(st.integers(0, max(len(text) - 1, 0)))
        kind = data.draw(st.sampled_from(["del", "ins", "sub", "cut"]))
        c = data.draw(st.sampled_from(alphabet))
        out.append({"del": text[:i] + text[i + 1:], "ins": text[:i] + c + text[i:], "sub": text[:i] + c + text[i + 1:],
                    "cut": text[:i]}[kind])
    return out


# ------------------------------------------------------------------------------------------------ regex -> GBNF


@pytest.mark.parametrize("rx", [
    r"ab|a(b|c)*d?", r"[a-c]{2,3}x{0,2}", r"[^ab\n]+", r".\.", r"\d+-\D", r"[\w.]+@\S\s?", r"[^\W_]{1,3}",
    r"(?:0|[1-9][0-9]*)(?:\.[0-9]+)?", r"[a-]|[-z]|\]|\\", "caf\u00e9|\U0001f600+", r"a*?b+?c??",
    _FORMATS["date-time"], json_schema_regex({"type": "integer", "minimum": -13, "maximum": 250}),
    json_schema_regex({"type": "string", "maxLength": 3}),
])
def test_regex_gbnf_agrees_with_re(rx):
    g = Grammar(f"root ::= {regex_gbnf(rx)}")
    samples = ["", "a", "ab", "abd", "acbcd", "ad", "aab", "abcxx", "x", "9", "12", "0.5", "01", "-3", "250", "251",
               "-13", "-14", "a.", "..", "1-x", "1-2", "\u0661-x", "w@x", "w.@x ", "_", "a_", "\u00e9\u00e9",
               "caf\u00e9", "\U0001f600\U0001f600", "aab", "bc", "]", "\\", "-", "z", "ab\n", "\n.",
               "2024-02-29T12:30:00Z", "2024-02-29t23:59:60.5+01:00", "2024-13-29T12:30:00Z", '""', '"a\\n"',
               '"abcd"', '"\\u00e9x"', '"\\u00e"']
    for s in samples:
        assert g.fullmatch(s) == (re.fullmatch(rx, s) is not None), (rx, s)


_RX_GRAMMARS = [(rx, Grammar(f"root ::= {regex_gbnf(rx)}"))
                for rx in (r"(a|b\d)*x?", r"[^a\s]{1,2}\w*", r"\S+\.\W?", r"(ab?|_){2,}")]


@given(st.text(alphabet="ab\u0661_ .-x\n", max_size=6))
@settings(max_examples=200, deadline=None)
def test_regex_gbnf_random_strings(s):
    for rx, g in _RX_GRAMMARS:
        assert g.fullmatch(s) == (re.fullmatch(rx, s) is not None), (rx, s)



@pytest.mark.parametrize("rx, needle", [(r"(a)\1", "GROUPREF"), (r"a(?=b)", "ASSERT"), ("^a", "AT_BEGINNING"),
                                        ("a$", "AT_END"), ("(?i)a", "flags"), (r"\bx", "AT_BOUNDARY")])
def test_regex_gbnf_refusals(rx, needle):
    with pytest.raises(ValueError, match="^guided_json: ") as info:
        regex_gbnf(rx)
    assert needle in str(info.value)


# ------------------------------------------------------------------------------------------------ regular schemas


PERSON = {
    "$defs": {"Address": {"type": "object", "properties": {"street": {"type": "string", "maxLength": 12},
                                                          "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                          "required": ["street", "zip"]}},
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "score": {"type": "number"},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 3}, "minItems": 1, "maxItems": 3},
        "role": {"enum": ["admin", "user", None, 3]},
        "home": {"$ref": "#/$defs/Address"},
        "work": {"$ref": "#/$defs/Address"},
        "nick": {"anyOf": [{"type": "string", "maxLength": 4}, {"type": "null"}]},
        "id": {"type": ["integer", "string"], "maxLength": 3},
        "born": {"type": "string", "format": "date"},
        "gone": False,
    },
    "required": ["name", "age"],
}
REGULAR = [
    PERSON,
    {"type": "array", "items": {"type": "integer", "minimum": -5, "maximum": 5}, "minItems": 2, "maxItems": 4},
    {"type": "array", "items": {"type": "boolean"}},
    {"type": "array", "maxItems": 0},
    {"type": "object", "additionalProperties": {"type": "integer", "minimum": 0}},
    {"type": "object", "additionalProperties": False},
    {"const": {"a": [1, "x\u00e9"], "b": None}},
    {"oneOf": [{"type": "string", "pattern": "^[a-z]+\\d?$"}, {"type": "array", "items": {"enum": [1, 2]}}]},
    {"type": "string", "nullable": True, "minLength": 2, "maxLength": 3},
    {"type": "object", "properties": {"x": {"allOf": [{"type": "integer"}]}, "y": {"type": "object",
                                                                                   "properties": {}}}},
]


def _text(schema, root, seps):
    """Documents in the form both compilers write, as text (a pattern's strings are drawn from the pattern)."""
    comma, colon = seps
    if "$ref" in schema:
        return _text(_resolve(root, schema["$ref"]), root, seps)
    if "allOf" in schema:
        return _text(schema["allOf"][0], root, seps)
    if schema.get("nullable"):
        rest = {k: v for k, v in schema.items() if k != "nullable"}
        return st.just("null") | _text(rest, root, seps)
    if "const" in schema:
        return st.just(json.dumps(schema["const"], separators=seps))
    if "enum" in schema:
        return st.sampled_from([json.dumps(v, separators=seps) for v in schema["enum"]])
    for key in ("anyOf", "oneOf"):
        if key in schema:
            return st.one_of([_text(s, root, seps) for s in schema[key]])
    t = schema.get("type")
    if isinstance(t, list):
        return st.one_of([_text({**schema, "type": u}, root, seps) for u in t])
    if t == "object":
        if "properties" in schema:
            members = [(k, _text(s, root, seps)) for k, s in schema["properties"].items() if s is not False]
            return st.tuples(*[v for _, v in members]).map(
                lambda vs: "{" + comma.join(f"{json.dumps(k)}{colon}{v}" for (k, _), v in zip(members, vs)) + "}")
        extra = schema.get("additionalProperties", True)
        values = _text(extra, root, seps) if isinstance(extra, dict) else st.just("0")
        return st.dictionaries(st.text(max_size=3), values, max_size=0 if extra is False else 3).map(
            lambda d: "{" + comma.join(f"{json.dumps(k)}{colon}{v}" for k, v in d.items()) + "}")
    if t == "array":
        items = _text(schema.get("items", {"type": "null"}), root, seps)
        return st.lists(items, min_size=schema.get("minItems", 0), max_size=schema.get("maxItems", 4)).map(
            lambda vs: "[" + comma.join(vs) + "]")
    if t == "string":
        if "pattern" in schema:
            return st.from_regex(schema["pattern"].strip("^$"), fullmatch=True, alphabet="abcxyz0123456789").map(
                lambda s: f'"{s}"')
        if "format" in schema:
            return st.from_regex(_FORMATS[schema["format"]], fullmatch=True).map(lambda s: f'"{s}"')
        return st.text(min_size=schema.get("minLength", 0), max_size=schema.get("maxLength", 6)).map(
            lambda s: json.dumps(s, ensure_ascii=False))
    if t == "integer":
        return st.integers(schema.get("minimum", -10**9), schema.get("maximum", 10**9)).map(str)
    if t == "number":
        return (st.floats(allow_nan=False, allow_infinity=False) | st.integers()).map(json.dumps)
    if t == "boolean":
        return st.sampled_from(["true", "false"])
    return st.just("null")


_COMPILED: dict[int, tuple] = {}


def _both(i: int):
    if i not in _COMPILED:
        _COMPILED[i] = Grammar(json_schema_grammar(REGULAR[i])), CharDFA(json_schema_regex(REGULAR[i]))
    return _COMPILED[i]


@pytest.mark.parametrize("i", range(len(REGULAR)))
@given(data=st.data())
@FAST
def test_same_language_as_the_regex(i, data):
    """Where a regex expresses the schema, the grammar accepts exactly what the regex does: documents and near
    misses; what both accept parses and is valid."""
    schema = REGULAR[i]
    grammar, dfa = _both(i)
    text = data.draw(_text(schema, schema, data.draw(st.sampled_from(SEPARATORS))))
    assert dfa.fullmatch(text), text
    for s in [text, *mutants(data, text)]:
        ok = dfa.fullmatch(s)
        assert grammar.fullmatch(s) == ok, s
        if ok:
            assert valid(json.loads(s), schema, schema), s


_full_person = json.dumps({"name": "Ann", "age": 37, "score": -1.5, "tags": ["x"], "role": None,
                           "home": {"street": "Main 1", "zip": "01234"}, "work": {"street": "", "zip": "99999"},
                           "nick": None, "id": "7", "born": "2024-02-29"})


def test_regular_schemas_keep_the_regex():
    for schema in REGULAR:
        assert json_schema_guide(schema) == ("regex", json_schema_regex(schema))
    # optional properties are written all the same (the regex's restriction), in order
    grammar, dfa = _both(0)
    doc = json.loads(_full_person)
    for key in list(doc):
        less = json.dumps({k: v for k, v in doc.items() if k != key})
        assert not grammar.fullmatch(less) and not dfa.fullmatch(less), key
    assert grammar.fullmatch(_full_person) and dfa.fullmatch(_full_person)
    spaced = {"type": "array", "items": {"type": "integer"}}
    for ws in ("", r"[ \n]*"):
        grammar = Grammar(json_schema_grammar(spaced, whitespace=ws))
        dfa = CharDFA(json_schema_regex(spaced, whitespace=ws))
        for s in ["[1,2]", "[ 1 , 2 ]", "[\n  1,\n  2\n]", "[]", "[ ]", "[1 2]"]:
            assert grammar.fullmatch(s) == dfa.fullmatch(s), (ws, s)


# ------------------------------------------------------------------------------------------------ recursion


TREE = {"$defs": {"node": {"type": "object",
                           "properties": {"value": {"type": "integer", "minimum": 0, "maximum": 99},
                                          "children": {"type": "array", "items": {"$ref": "#/$defs/node"}}},
                           "required": ["value"]}},
        "$ref": "#/$defs/node"}
LIST = {"$defs": {"cell": {"type": "object", "properties": {"head": {"type": "string", "maxLength": 4},
                                                           "tail": {"anyOf": [{"$ref": "#/$defs/cell"},
                                                                              {"type": "null"}]}},
                           "required": ["head", "tail"]}},
        "$ref": "#/$defs/cell"}
# mutual recursion: an expression's arguments are terms, a term a number or an expression
EXPR = {"$defs": {"expr": {"type": "object", "properties": {"op": {"enum": ["+", "*"]},
                                                           "args": {"type": "array", "items": {"$ref": "#/$defs/term"},
                                                                    "minItems": 1, "maxItems": 3}},
                           "required": ["op", "args"]},
                  "term": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 9}, {"$ref": "#/$defs/expr"}]}},
        "$ref": "#/$defs/expr"}
# the root itself, and a free value inside
ROOT = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 5}, "meta": {},
                                        "sub": {"type": "array", "items": {"$ref": "#"}, "maxItems": 2}},
        "required": ["name", "meta", "sub"]}

_ints = st.integers(0, 99)
_leaves = st.builds(lambda v: {"value": v}, _ints) | st.builds(lambda v: {"value": v, "children": []}, _ints)
trees = st.recursive(_leaves, lambda kids: st.builds(lambda v, cs: {"value": v, "children": cs}, _ints,
                                                     st.lists(kids, max_size=3)), max_leaves=25)
lists = st.lists(_bmp.map(lambda s: s[:4]), min_size=1, max_size=30).map(lambda heads: _chain(heads))
terms = st.recursive(st.integers(0, 9), lambda kids: st.builds(
    lambda op, args: {"op": op, "args": args}, st.sampled_from("+*"), st.lists(kids, min_size=1, max_size=3)),
    max_leaves=20)
exprs = st.builds(lambda op, args: {"op": op, "args": args}, st.sampled_from("+*"),
                  st.lists(terms, min_size=1, max_size=3))
roots = st.recursive(st.builds(lambda n, m: {"name": n, "meta": m, "sub": []}, _bmp, json_values(4)),
                     lambda kids: st.builds(lambda n, m, s: {"name": n, "meta": m, "sub": s}, _bmp,
                                            json_values(4), st.lists(kids, max_size=2)), max_leaves=10)


def _chain(heads):
    cell = None
    for h in reversed(heads):
        cell = {"head": h, "tail": cell}
    return cell


def _depth(x) -> int:
    if isinstance(x, dict):
        return 1 + max(map(_depth, x.values()), default=0)
    if isinstance(x, list):
        return 1 + max(map(_depth, x), default=0)
    return 0


def _nodes(x, out):
    """Every object inside ``x`` (``x`` included) that the schema describes (not inside a free "meta")."""
    if isinstance(x, dict):
        out.append(x)
    for k, v in x.items() if isinstance(x, dict) else enumerate(x) if isinstance(x, list) else ():
        if k != "meta":
            _nodes(v, out)
    return out


RECURSIVE = {  # schema, documents, the required keys of its objects
    "tree": (TREE, trees, {"value"}), "list": (LIST, lists, {"head", "tail"}), "expr": (EXPR, exprs, {"op", "args"}),
    "root": (ROOT, roots, {"name", "meta", "sub"})}
_GRAMMARS = {name: Grammar(json_schema_grammar(schema)) for name, (schema, _, _) in RECURSIVE.items()}


@pytest.mark.parametrize("name", sorted(RECURSIVE))
@given(data=st.data())
@FAST
def test_recursive_documents(name, data):
    """Documents of any depth are accepted; a node corrupted at a random depth is not; anything accepted, near
    misses included, parses and is valid."""
    schema, docs, required = RECURSIVE[name]
    g = _GRAMMARS[name]
    doc = data.draw(docs)
    assert valid(doc, schema, schema)
    text = json.dumps(doc, separators=data.draw(st.sampled_from(SEPARATORS)), ensure_ascii=data.draw(st.booleans()))
    assert g.fullmatch(text), text
    for s in mutants(data, text):
        if g.fullmatch(s):
            assert valid(json.loads(s), schema, schema), s
    # corrupt one object at a random depth: each way makes it invalid for the schema
    bad = json.loads(text)
    node = data.draw(st.sampled_from(_nodes(bad, [])))
    key = data.draw(st.sampled_from(sorted(node)))
    how = data.draw(st.sampled_from(["type", "drop", "extra"]))
    if how == "drop" and key not in required:
        how = "type"
    if how == "type":
        if key == "meta":  # a free value: any type is valid
            return
        node[key] = "x" if not isinstance(node[key], str) else 7
    elif how == "drop":
        del node[key]
    else:
        node["zz"] = 1
    bad_text = json.dumps(bad)
    if how != "extra":  # an extra key is valid JSON Schema (additionalProperties), but never written
        assert not valid(bad, schema, schema), bad_text
    assert not g.fullmatch(bad_text), bad_text


def test_deep_recursion_and_the_regex_refusal():
    deep = {"value": 0}
    for i in range(200):
        deep = {"value": i % 100, "children": [deep, {"value": 1}]}
    g = _GRAMMARS["tree"]
    assert _depth(deep) > 400 and g.fullmatch(json.dumps(deep)) and g.fullmatch(json.dumps(deep, separators=(",", ":")))
    assert not g.fullmatch(json.dumps(deep)[:-1])
    assert _GRAMMARS["list"].fullmatch(json.dumps(_chain(["ab"] * 300)))
    with pytest.raises(ValueError, match="recursive"):
        json_schema_regex(TREE)  # the regex alone still cannot
    # an optional property that recurses may be left out, others are written as the regex writes them
    assert g.fullmatch('{"value": 3}') and g.fullmatch('{"value":3,"children":[{"value":4}]}')
    assert not g.fullmatch('{"children": []}')
    # ... also where a recursive $ref is met again, and a property that cannot recurse is still written
    labelled = {"$defs": {"node": {"type": "object", "properties": {
        "label": {"type": "string"}, "kids": {"type": "array", "items": {"$ref": "#/$defs/node"}}}}},
        "type": "object", "properties": {"a": {"$ref": "#/$defs/node"}, "b": {"$ref": "#/$defs/node"}}}
    lg = Grammar(json_schema_grammar(labelled))
    for s in ['{"a": {"label": "x"}}', '{"b": {"label": "x", "kids": [{"label": "y"}]}}', "{}",
              '{"a": {"label": "x"}, "b": {"label": "y"}}']:
        assert lg.fullmatch(s), s
    for s in ['{"a": {}}', '{"a": {"kids": []}}', '{"b": {"label": "x"}, "a": {"label": "y"}}']:
        assert not lg.fullmatch(s), s
    root = _GRAMMARS["root"]
    assert root.fullmatch('{"name": "a", "meta": [[[[{"k": [1]}]]]], "sub": []}')
    assert not root.fullmatch('{"name": "a", "sub": []}')
    # $refs that are each other, beside null: null alone (the least solution; not left recursion, which a schema
    # cannot spell: a rule refers to another first only as a whole alternative)
    loop = Grammar(json_schema_grammar({"$defs": {"a": {"anyOf": [{"$ref": "#/$defs/b"}, {"type": "null"}]},
                                                  "b": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}))
    assert loop.fullmatch("null") and not loop.fullmatch("1") and not loop.fullmatch("")


# ------------------------------------------------------------------------------------------------ free values


FREE = [True, {}, {"description": "anything"}, {"type": "array"}, {"type": "object"},
        {"type": "object", "additionalProperties": True}, {"type": "array", "items": True, "maxItems": 3},
        {"type": "object", "properties": {"a": {"type": "integer"}, "b": {}}}]


@pytest.mark.parametrize("i", range(len(FREE)))
@given(value=json_values(), seps=st.sampled_from(SEPARATORS))
@settings(max_examples=25, deadline=None)
def test_free_values_of_any_depth(i, value, seps):
    schema = FREE[i]
    kind, text = json_schema_guide(schema)
    assert kind == "grammar"
    g = _free(i)
    shaped = {3: [value], 4: {"k": value}, 5: {"k": value}, 6: [value], 7: {"a": 1, "b": value}}.get(i, value)
    for _ in range(3):  # deeper each time
        doc = json.dumps(shaped, separators=seps)
        assert g.fullmatch(doc), doc
        assert valid(shaped, schema if schema is not True else {}, schema)
        shaped = {3: [shaped], 4: {"k": shaped}, 5: {"k": shaped}, 6: [shaped], 7: {"a": 2, "b": shaped}}.get(
            i, [shaped, {"x": shaped}])


@pytest.mark.parametrize("i", range(len(FREE)))
def test_free_values_take_what_the_regex_took(i):
    """The bounded regex's language (two levels, scalars in a free object) is kept, and deeper ones are added."""
    rx, g = CharDFA(json_schema_regex(FREE[i])), _free(i)
    took = 0
    for s in ["[]", "{}", '{"a": 1, "b": [1, {"c": null}]}', "[1, [2, [3]]]", '{"k": {"j": [true]}}', "1.5e3",
              '"s"', "null", '{"a": 1, "b": {"c": [1]}}', '{"a":1,"b":"x"}', "[[1],[]]", '[{"a": []}]', '{"k": 1}']:
        if rx.fullmatch(s):
            took += 1
            assert g.fullmatch(s), s
    assert took >= 3
    assert g.fullmatch('{"a": 1, "b": [[[[[{"c": [[]]}]]]]]}' if i == 7 else "[[[[[1]]]]]" if i in (0, 1, 2, 3, 6)
                       else '{"k": [[[[{"j": [1]}]]]]}')


_FREE_GRAMMARS: dict[int, Grammar] = {}


def _free(i: int) -> Grammar:
    if i not in _FREE_GRAMMARS:
        _FREE_GRAMMARS[i] = Grammar(json_schema_guide(FREE[i])[1])
    return _FREE_GRAMMARS[i]


def test_free_object_and_guided_json_true():
    sp = SamplingParams(guided_json=True)
    kind, text = sp.guided_spec()
    g = Grammar(text)
    deep = {"a": [{"b": [{"c": [{"d": [1, {"e": None}]}]}]}]}
    assert kind == "grammar" and g.fullmatch(json.dumps(deep))
    assert sp.guided_pattern() == json_object_regex()  # a regex for callers that want one: the bounded one
    for s in ["[]", "1", '"x"', "{", '{"a":1,}']:
        assert not g.fullmatch(s), s
    # the regex for JSON Schema's any value stopped at two levels
    assert not CharDFA(json_schema_regex({})).fullmatch(json.dumps(deep))


# ------------------------------------------------------------------------------------------------ choice and errors


def test_the_engine_is_chosen_per_schema():
    assert SamplingParams(guided_json=REGULAR[0]).guided_spec() == ("regex", json_schema_regex(REGULAR[0]))
    sp = SamplingParams(guided_json=json.dumps(TREE))
    kind, text = sp.guided_spec()
    assert kind == "grammar"
    with pytest.raises(ValueError, match="recursive"):
        sp.guided_pattern()  # no regex can follow it
    low = sp.guided_lowered()
    assert (low.guided_grammar, low.guided_json, low.guided_regex) == (text, None, None) and low.guided
    assert SamplingParams(guided_json=REGULAR[1]).guided_lowered().guided_regex == json_schema_regex(REGULAR[1])
    assert SamplingParams(guided_regex="a").guided_spec() == ("regex", "a")
    assert SamplingParams(guided_grammar='root ::= "a"').guided_spec() == ("grammar", 'root ::= "a"')
    assert SamplingParams(guided_grammar='root ::= "a"').guided_pattern() is None
    assert SamplingParams().guided_spec() is None and SamplingParams().guided_lowered() == SamplingParams()


@pytest.mark.parametrize("schema, needle", [
    ({"$defs": {"n": {"type": "object", "properties": {"next": {"$ref": "#/$defs/n"}}, "required": ["next"]}},
      "$ref": "#/$defs/n"}, "no finite JSON document"),
    ({"type": "array", "items": {"$ref": "#"}, "minItems": 1}, "no finite JSON document"),
    ({"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}, "no finite JSON"),
    ({"type": "object", "properties": {"a": {"$ref": "#"}, "b": {"not": {}}}}, "'not'"),
    ({"$defs": {"n": {"type": "array", "items": {"$ref": "#/$defs/n"}, "uniqueItems": True}}, "$ref": "#/$defs/n"},
     "'uniqueItems'"),
    ({"type": "array", "items": {"$ref": "#/$defs/missing"}}, "does not resolve"),
    ({"type": "object", "properties": {"s": {"type": "string", "pattern": "a(?=b)"}, "t": {}}}, "ASSERT"),
    ({"type": "object", "additionalProperties": {"$ref": "#"}, "required": ["x"]}, "required"),
])
def test_errors_name_guided_json(schema, needle):
    for compile_ in (json_schema_guide, json_schema_grammar):
        with pytest.raises(ValueError, match="^guided_json: ") as info:
            compile_(schema)
        assert needle in str(info.value)
    with pytest.raises(ValueError, match="guided_json"):
        SamplingParams(guided_json=schema)


# ------------------------------------------------------------------------------------------------ the engine


@pytest.fixture(scope="module")
def engine():
    return Engine.from_pretrained(device="cpu", dtype=torch.float32, max_num_batched_tokens=128)


NAMED_TREE = {"$defs": {"node": {"type": "object",
                                 "properties": {"name": {"type": "string", "maxLength": 8},
                                                "children": {"type": "array", "items": {"$ref": "#/$defs/node"},
                                                             "maxItems": 3}},
                                 "required": ["name"]}},
              "$ref": "#/$defs/node"}


def test_generate_recursive_schema(engine):
    prompts = ['Write the tree {"name": "a", "children": [{"name": "b"}, {"name": "c"}]} again as JSON.',
               "Write a JSON tree: a root named top with two children named x and y, which have no children.",
               "Give a tiny tree as JSON, a root with one leaf child."]
    params = [SamplingParams(temperature=0, max_tokens=30, guided_json=NAMED_TREE),
              SamplingParams(temperature=0, max_tokens=30, guided_json=NAMED_TREE),
              SamplingParams(temperature=0.8, seed=1, max_tokens=30, guided_json=NAMED_TREE)]
    outs = engine.generate(prompts, params, chat=True)
    g = Grammar(json_schema_grammar(NAMED_TREE))
    stopped = 0
    for out in outs:
        state = g.walk(g.start, out.text)
        assert not g.dead(state), out.text
        if out.finish_reason == "stop":
            stopped += 1
            assert valid(json.loads(out.text), NAMED_TREE, NAMED_TREE) and g.accepting(state), out.text
        else:
            assert out.finish_reason == "length"
    assert stopped >= 2
    assert json.loads(outs[0].text) == {"name": "a", "children": [{"name": "b"}, {"name": "c"}]}
    # the engine's guide for it is the grammar's
    assert isinstance(engine._guides.guide_for(params[0]), GrammarGuide)
    assert isinstance(engine._guides.guide_for(SamplingParams(guided_json=REGULAR[1])), TokenGuide)
