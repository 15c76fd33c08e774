"""Regex -> lazy character DFA (engine/fsm.py) against `re.fullmatch`, and the JSON schema / choice converters."""

from __future__ import annotations

import json
import random
import re
import time

import pytest

from infercore.engine import fsm
from infercore.engine.fsm import DEAD, CharDFA, choice_regex, json_object_regex, json_schema_regex

# (pattern, alphabet for random strings, strings that match)
PATTERNS = [
    ("abc", "abcx", ["abc"]),
    ("", "ab", [""]),
    ("a|bc|", "abc", ["a", "bc", ""]),
    ("[abc]+", "abcd", ["a", "cab"]),
    ("[^abc]*", "abcd\n", ["", "d", "d\nd"]),
    ("[a-f0-3]{2,4}", "af03g4-", ["af", "a0f3"]),
    (r"[^a-z\d]+", "az09AZ_ -", ["A", "_ -Z"]),
    (r"\d+", "0129a\u0660\u00b2", ["0", "0129", "\u0660"]),
    (r"\D\d", "a1\u0660 ", ["a1", " \u0660"]),
    (r"\w+\W", "a_1 -é\u4e2d", ["a_ ", "é\u4e2d-"]),
    (r"\s\S\s", " \ta\n\u3000\u2028b", [" a\t", "\u3000b\u2028"]),
    (r"[\w-]+@[\w.]+", "a_1@.-x", ["a@b.c", "x-1@y"]),
    ("(ab|cd)*e", "abcde", ["e", "abe", "cdabe"]),
    ("((a|b)c)+", "abcx", ["ac", "acbc"]),
    ("(?:x(?:y|z)?)+", "xyz", ["x", "xyxzx"]),
    ("a?b?c?", "abcd", ["", "ac", "abc"]),
    ("a*b+c?", "abc", ["b", "aabbc"]),
    ("(ab){3}", "ab", ["ababab"]),
    ("(ab){2,}", "abc", ["abab", "ababab"]),
    ("a{0,3}b{1,2}", "ab", ["b", "aaabb"]),
    ("a{2,3}?x", "ax", ["aax", "aaax"]),
    ("^ab$", "ab", ["ab"]),
    (r"\Afoo|bar\Z", "fobar", ["foo", "bar"]),
    ("a.c", "abc\n.", ["abc", "a.c", "acc"]),
    ("(a|)*b", "ab", ["b", "aab"]),
    ("(?P<w>é+)ß?\U0001f600", "éß\U0001f600a", ["é\U0001f600", "ééß\U0001f600"]),
    (r"[.*+?]\.\*", ".*+?", ["..*", "+.*"]),
    (r'"([^"\\]|\\.)*"', 'a"\\n', ['""', '"a\\"b"']),
]


@pytest.mark.parametrize("pattern,alphabet,good", PATTERNS, ids=[p for p, _, _ in PATTERNS])
def test_matches_like_re(pattern, alphabet, good):
    dfa = CharDFA(pattern)
    rx = re.compile(pattern)
    rng = random.Random(1234)
    strings = list(good) + ["".join(rng.choice(alphabet) for _ in range(rng.randint(0, 8))) for _ in range(400)]
    for g in good:
        assert rx.fullmatch(g), (pattern, g)
    for s in strings:
        assert dfa.fullmatch(s) == (rx.fullmatch(s) is not None), (pattern, s)
        # step-by-step agrees with walk, and DEAD exactly when no continuation can match
        st = dfa.start
        for ch in s:
            st = dfa.step(st, ch)
        assert st == dfa.walk(dfa.start, s)
    for g in good:  # every prefix of a match is alive
        st = dfa.start
        for i, ch in enumerate(g):
            assert st != DEAD and (dfa.can_continue(st) or dfa.accepting(st)), (pattern, g[:i])
            assert dfa.can_continue(st), (pattern, g[:i])
            st = dfa.step(st, ch)
        assert dfa.accepting(st)


def test_dead_and_can_continue():
    d = CharDFA("abc")
    st = d.walk(d.start, "ab")
    assert d.can_continue(st) and not d.accepting(st)
    st = d.step(st, "c")
    assert d.accepting(st) and not d.can_continue(st)
    assert d.step(st, "c") == DEAD and d.walk(d.start, "abx") == DEAD and d.walk(d.start, "x") == DEAD
    assert d.step(DEAD, "a") == DEAD and d.walk(DEAD, "") == DEAD
    assert not d.accepting(DEAD) and not d.can_continue(DEAD)

    d = CharDFA("(yes|no)")
    for word in ("yes", "no"):
        st = d.walk(d.start, word)
        assert d.accepting(st) and not d.can_continue(st)
        assert all(d.can_continue(d.walk(d.start, word[:i])) for i in range(len(word)))
    assert d.walk(d.start, "ye") != DEAD and d.walk(d.start, "yo") == DEAD

    d = CharDFA("a{2,3}")
    assert d.can_continue(d.walk(d.start, "aa")) and d.accepting(d.walk(d.start, "aa"))
    assert not d.can_continue(d.walk(d.start, "aaa"))
    d = CharDFA("a*")
    assert d.can_continue(d.walk(d.start, "aaaa"))
    d = CharDFA("[0-9]+(x|)")
    assert d.can_continue(d.walk(d.start, "12")) and not d.can_continue(d.walk(d.start, "12x"))


def test_dead_is_exact_with_unmatchable_parts():
    # an empty character class is never crossed: the branch through it is dead from the start
    d = CharDFA(r"a[^\d\D]|ab")
    st = d.step(d.start, "a")
    assert st != DEAD and d.can_continue(st)
    assert d.accepting(d.step(st, "b")) and not d.can_continue(d.step(st, "b"))
    assert d.step(st, "1") == DEAD
    e = CharDFA(r"[^\d\D]")
    assert not e.can_continue(e.start) and not e.accepting(e.start)
    assert e.step(e.start, "x") == DEAD and not e.fullmatch("")


def test_states_are_cached_and_numbered():
    d = CharDFA("(ab)*")
    assert d.start == 0
    s1 = d.step(0, "a")
    assert s1 == 1 and d.step(s1, "b") == d.step(s1, "b")
    assert d.walk(0, "abababab") == d.walk(0, "ab")
    assert d.num_states == 2
    with pytest.raises(ValueError):
        d.step(0, "ab")


def test_walk_speed():
    d = CharDFA(r"[a-z ]*\d?")
    text = "the quick brown fox jumps over the lazy dog " * 5000  # 220k characters
    d.walk(d.start, text)
    t0 = time.perf_counter()
    st = d.walk(d.start, text)
    assert time.perf_counter() - t0 < 1.0
    assert d.accepting(st)


@pytest.mark.parametrize("pattern,name", [
    (r"(a)\1", "GROUPREF"),
    ("(?=a)a", "ASSERT"),
    ("(?!b)a", "ASSERT_NOT"),
    ("(?<=a)b", "ASSERT"),
    ("a++", "POSSESSIVE_REPEAT"),
    ("(?>a)", "ATOMIC_GROUP"),
    ("(?i)a", "IGNORECASE"),
    ("a(?s:.)", "DOTALL"),
    (r"a\b", "AT_BOUNDARY"),
    ("a^b", "AT_BEGINNING"),
    ("a$b", "AT_END"),
    ("(^a)*", "AT_BEGINNING"),
    ("(a)(?(1)b|c)", "GROUPREF_EXISTS"),
])
def test_unsupported_constructs(pattern, name):
    re.compile(pattern)  # valid for re
    with pytest.raises(ValueError, match=f"guided_regex: unsupported regex construct '{name}'"):
        CharDFA(pattern)


def test_invalid_and_huge_patterns(monkeypatch):
    with pytest.raises(ValueError, match="guided_regex: invalid regex"):
        CharDFA("a(")
    big = CharDFA("(ab){5000}")
    assert big.fullmatch("ab" * 5000) and not big.fullmatch("ab" * 4999)
    monkeypatch.setattr(fsm, "MAX_NFA_STATES", 2000)
    with pytest.raises(ValueError, match="automaton states"):
        CharDFA("(a{100}){100}")
    assert CharDFA("(a{10}){10}").fullmatch("a" * 100)


def test_choice_regex():
    choices = ["a.b", "c|d", "(x)", "1+1=2", "[q]", "$^", "back\\slash", "", "é?"]
    rx = choice_regex(choices)
    dfa = CharDFA(rx)
    for c in choices:
        assert re.fullmatch(rx, c) and dfa.fullmatch(c)
    for c in ["aXb", "c", "d", "x", "11=2", "q", "back\\\\slash", "é", "a.bc|d"]:
        assert not re.fullmatch(rx, c) and not dfa.fullmatch(c), c
    for bad in ([], [1], "abc", None):
        with pytest.raises(ValueError, match="guided_choice:"):
            choice_regex(bad)


def _check(rx: str, good: list, bad_texts: list[str], bad_values: list = ()):
    dfa = CharDFA(rx)
    for v in good:
        for seps in ((",", ":"), (", ", ": ")):
            text = json.dumps(v, separators=seps)
            assert re.fullmatch(rx, text), text
            assert dfa.fullmatch(text), text
    for text in bad_texts + [json.dumps(v) for v in bad_values]:
        assert not re.fullmatch(rx, text), text
        assert not dfa.fullmatch(text), text


SCHEMA = {
    "$defs": {
        "Address": {
            "type": "object",
            "properties": {"street": {"type": "string", "maxLength": 20},
                           "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
            "required": ["street", "zip"],
        },
    },
    "type": "object",
    "title": "Person",
    "properties": {
        "name": {"type": "string", "minLength": 1, "description": "full name"},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "score": {"type": "number"},
        "active": {"type": "boolean"},
        "tags": {"type": "array", "items": {"type": "string"}, "minItems": 1, "maxItems": 3},
        "role": {"enum": ["admin", "user", "guest"]},
        "home": {"$ref": "#/$defs/Address"},
        "nick": {"anyOf": [{"type": "string"}, {"type": "null"}]},
        "id": {"type": ["integer", "string"]},
    },
    "required": ["name", "age"],
}


def _person(**kw):
    base = {"name": "Ann \"A\" O'Neil\n", "age": 37, "score": -1.5e-3, "active": True, "tags": ["x", "y z"],
            "role": "user", "home": {"street": "Main St. 1", "zip": "01234"}, "nick": None, "id": 12}
    base.update(kw)
    return base


def test_json_schema_nested():
    rx = json_schema_regex(SCHEMA)
    assert rx == json_schema_regex(json.dumps(SCHEMA))
    good = [_person(), _person(age=0, score=3, active=False, tags=["é\u4e2d"], role="admin", nick="n", id="7"),
            _person(name="\u00e9\U0001f600", age=150, score=0.0, tags=["a", "b", "c"], id=-3)]
    missing = _person()
    del missing["age"]
    extra = dict(_person(), more=1)
    bad_values = [
        _person(age="37"), _person(age=1.5), _person(age=-1), _person(age=151), _person(name=""),
        _person(active="true"), _person(tags=[]), _person(tags=["a", "b", "c", "d"]), _person(tags=[1]),
        _person(role="root"), _person(home={"street": "x", "zip": "1234"}), _person(nick=3),
        _person(home={"street": "x" * 21, "zip": "12345"}), _person(id=None), missing, extra,
        {k: v for k, v in reversed(list(_person().items()))},
    ]
    _check(rx, good, [json.dumps(_person()) + " ", json.dumps(_person()) + "}", "{}", "null"], bad_values)


def test_json_schema_const_enum_and_scalars():
    _check(json_schema_regex({"const": {"a": [1, "x"], "b": None}}), [{"a": [1, "x"], "b": None}],
           ['{"b":null,"a":[1,"x"]}'], [{"a": [1, "y"], "b": None}, {"a": [1, "x"]}])
    _check(json_schema_regex({"enum": ["caf\u00e9", 1.5, True, None, [1]]}), ["caf\u00e9", 1.5, True, None, [1]],
           ['"caf\u00e9"'.replace("\u00e9", "\\u00E9") + "x"], ["cafe", 1, False, [2], "true"])
    for text in ('"caf\u00e9"', '"caf\\u00e9"', '"caf\\u00E9"'):
        assert re.fullmatch(json_schema_regex({"const": "caf\u00e9"}), text), text
    _check(json_schema_regex({"type": "number"}), [0, -1, 1.25, 1e100, -2.5e-7], ["01", "1.", ".5", "+1", "1e"],
           ["1"])
    _check(json_schema_regex({"type": "integer", "exclusiveMinimum": -3, "exclusiveMaximum": 10}),
           [-2, 0, 9], ["-0.0", "1.0"], [-3, 10, 100])
    _check(json_schema_regex({"type": "boolean"}), [True, False], ["True", "1"], [None])
    _check(json_schema_regex({"type": "null"}), [None], ["nul", "None"], [0])
    _check(json_schema_regex({"type": "string", "format": "date"}), ["2024-02-29"], ['"2024-13-01"'], ["x"])
    _check(json_schema_regex({"type": "array", "maxItems": 0}), [[]], [], [[1]])
    _check(json_schema_regex({"type": "object", "additionalProperties": {"type": "integer"}}),
           [{}, {"a": 1, "b": -2}], [], [{"a": "x"}, [1]])


def test_json_integer_ranges_exact():
    for lo, hi in [(None, None), (0, None), (7, None), (None, -7), (None, 45), (-13, 250), (3, 3), (-100, -5),
                   (123, 987), (-999, 999), (10, 99), (1, 1000)]:
        schema = {"type": "integer"}
        if lo is not None:
            schema["minimum"] = lo
        if hi is not None:
            schema["maximum"] = hi
        rx = re.compile(json_schema_regex(schema))
        for v in range(-1100, 1100):
            assert (rx.fullmatch(str(v)) is not None) == ((lo is None or v >= lo) and (hi is None or v <= hi))
    dfa = CharDFA(json_schema_regex({"type": "integer", "minimum": -13, "maximum": 250}))
    assert [v for v in range(-300, 300) if dfa.fullmatch(str(v))] == list(range(-13, 251))


def test_json_any_value_and_object():
    anything = [{}, [], {"a": [1, None]}, "s", 1.5, None, [[1, 2], {"k": "v"}], {"a": {"b": True}}, 0]
    _check(json_schema_regex({}), anything, ["", "{", "[1,]", "tru", "{'a': 1}"], [])
    _check(json_schema_regex(True), anything, ["", "x"], [])
    assert not re.fullmatch(json_schema_regex({}), json.dumps([[[1]]]))
    _check(json_object_regex(), [{}, {"a": 1}, {"a": [1, "x"], "b": {"c": None}}], ["[]", "1", '{"a":{"b":{}}}'])
    _check(json_object_regex(1), [{"a": 1, "b": "x"}], ['{"a":[]}'])
    _check(json_schema_regex({"type": "object"}), [{}, {"a": 1, "b": "x", "c": None}], ['{"a":[]}'], ["{}"])
    rx = json_schema_regex({"type": "array", "items": {"type": "integer"}}, whitespace=r"[ \n]*")
    assert CharDFA(rx).fullmatch(json.dumps([1, 2, 3], indent=2))
    with pytest.raises(ValueError):
        json_object_regex(0)


@pytest.mark.parametrize("schema,needle", [
    ({"not": {"type": "string"}}, "'not'"),
    ({"type": "object", "patternProperties": {"^a": {}}}, "'patternProperties'"),
    ({"if": {"type": "string"}, "then": {"minLength": 1}}, "'if'"),
    ({"type": "number", "multipleOf": 2}, "'multipleOf'"),
    ({"type": "number", "minimum": 0}, "'minimum'"),
    ({"type": "array", "uniqueItems": True}, "'uniqueItems'"),
    ({"allOf": [{"type": "string"}, {"minLength": 2}]}, "'allOf'"),
    ({"$defs": {"N": {"type": "object", "properties": {"next": {"$ref": "#/$defs/N"}}}}, "$ref": "#/$defs/N"},
     "recursive"),
    ({"$ref": "#/definitions/missing"}, "does not resolve"),
    ({"$ref": "other.json#/x"}, "local"),
    ({"type": "object", "properties": {"a": {}}, "required": ["b"]}, "required"),
    ({"type": "strange"}, "unsupported type"),
    ({"enum": []}, "enum"),
    ({"type": "string", "minLength": 3, "maxLength": 2}, "maxLength"),
    ("{not json", "not valid JSON"),
    (False, "false"),
])
def test_json_schema_errors(schema, needle):
    with pytest.raises(ValueError, match="^guided_json: ") as info:
        json_schema_regex(schema)
    assert needle in str(info.value)


def test_json_schema_refs_and_single_all_of():
    schema = {"definitions": {"Color": {"enum": ["red", "green"]}},
              "type": "object",
              "properties": {"c": {"allOf": [{"$ref": "#/definitions/Color"}], "description": "a color"},
                             "d": {"$ref": "#/definitions/Color"}}}
    _check(json_schema_regex(schema), [{"c": "red", "d": "green"}], [], [{"c": "blue", "d": "red"}])
    compact = json_schema_regex({"type": "object", "properties": {"a": {"type": "integer"}}}, whitespace="")
    _check(compact, [], ['{"a":1}'.replace("1", "1 "), '{ "a":1}'])
    assert CharDFA(compact).fullmatch('{"a":-12}')
    nullable = json_schema_regex({"type": "string", "nullable": True})
    assert re.fullmatch(nullable, "null") and re.fullmatch(nullable, '"x"')
    assert fsm.MAX_NFA_STATES >= 10_000
