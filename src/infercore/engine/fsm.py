"""Regular expressions as lazily built character-level DFAs, and JSON schemas / choice lists as regexes.

The building block of structured-output (guided) decoding: a constraint is a regular expression, compiled once
into a :class:`CharDFA`; a decoder keeps one DFA state per sequence, advances it by the characters of each
sampled token (:meth:`CharDFA.walk`) and masks out the tokens that would reach :data:`DEAD`.

:class:`CharDFA` has the semantics of ``re.fullmatch(pattern, s)`` with no flags. The pattern is parsed with
Python's own regex parser, turned into a Thompson NFA whose edges carry character predicates, and determinized
on demand: a DFA state is the set of NFA states reachable after the characters read so far, created the first
time a ``(state, character)`` transition leads to it and cached from then on, so a hot walk costs one dict
lookup per character whatever the size of the alphabet.

NFA states from which the accepting state cannot be reached are dropped from every DFA state, so a transition
returns :data:`DEAD` exactly when no continuation of the text read so far can match; this also makes
:meth:`CharDFA.can_continue` exact (see there).

:func:`json_schema_regex` and :func:`json_object_regex` turn a practical subset of JSON Schema into a regex
whose matches are JSON texts valid for the schema; :func:`choice_regex` matches exactly one of a list of
strings. A regex from them is always a restriction: every match is valid, not every valid text matches (for
instance, object properties always come in the order the schema lists them). ``guided_json`` takes a schema that
recurses or leaves a value free through a grammar instead (:mod:`infercore.engine.json_grammar`).
"""

from __future__ import annotations

import functools
import json
import math
import re
from collections.abc import Callable

try:
    import re._parser as sre_parse
except ImportError:  # pragma: no cover - Python before 3.11
    import sre_parse

__all__ = ["DEAD", "MAX_NFA_STATES", "CharDFA", "choice_regex", "json_object_regex", "json_schema_regex"]

DEAD = -1
"""The state id of a text that no continuation can make match."""

MAX_NFA_STATES = 100_000
"""Patterns whose NFA (repeats expanded by copying) would have more states than this raise ValueError."""

_OP = sre_parse
_FLAGS_OK = sre_parse.SRE_FLAG_UNICODE | sre_parse.SRE_FLAG_VERBOSE  # the default for str, and parse-only
_CATEGORY_SOURCES = {
    sre_parse.CATEGORY_DIGIT: r"\d",
    sre_parse.CATEGORY_NOT_DIGIT: r"\D",
    sre_parse.CATEGORY_SPACE: r"\s",
    sre_parse.CATEGORY_NOT_SPACE: r"\S",
    sre_parse.CATEGORY_WORD: r"\w",
    sre_parse.CATEGORY_NOT_WORD: r"\W",
}
_FLAG_NAMES = {
    sre_parse.SRE_FLAG_IGNORECASE: "IGNORECASE",
    sre_parse.SRE_FLAG_LOCALE: "LOCALE",
    sre_parse.SRE_FLAG_MULTILINE: "MULTILINE",
    sre_parse.SRE_FLAG_DOTALL: "DOTALL",
    sre_parse.SRE_FLAG_ASCII: "ASCII",
    sre_parse.SRE_FLAG_DEBUG: "DEBUG",
}

# The meaning `re` gives the escapes \d \D \s \S \w \W in a str pattern without the ASCII flag.
_CATEGORIES: dict[object, Callable[[str], bool]] = {
    sre_parse.CATEGORY_DIGIT: str.isdecimal,
    sre_parse.CATEGORY_NOT_DIGIT: lambda c: not c.isdecimal(),
    sre_parse.CATEGORY_SPACE: str.isspace,
    sre_parse.CATEGORY_NOT_SPACE: lambda c: not c.isspace(),
    sre_parse.CATEGORY_WORD: lambda c: c.isalnum() or c == "_",
    sre_parse.CATEGORY_NOT_WORD: lambda c: not (c.isalnum() or c == "_"),
}

# Characters tried first when checking that a character predicate matches something.
_SAMPLE = "".join(chr(i) for i in range(128)) + "\x85\xa0\xb2\xbd\xe9\u0378\u0660\u1680\u2028\u3000\u4e2d\ud800\uffff"
_SAMPLE += "\U0001f600\U0010ffff"


def _name(x: object) -> str:
    return str(getattr(x, "name", x))


def _unsupported(what: object) -> ValueError:
    return ValueError(f"guided_regex: unsupported regex construct '{_name(what)}'")


def _check_flags(flags: int) -> None:
    bad = flags & ~_FLAGS_OK
    if bad:
        names = [n for f, n in _FLAG_NAMES.items() if bad & f] or [f"flags {bad:#x}"]
        raise _unsupported(names[0])


@functools.cache
def _all_chars() -> str:
    return "".join(map(chr, range(0x110000)))


def _matches_something(pred: Callable[[str], bool], hints: set[int], source: str | None = None) -> bool:
    """Whether ``pred`` accepts some character: the hints and a sample first, then the whole code space.

    ``source``, a regex for the same set of characters, makes the last resort a scan by ``re``.
    """
    for o in hints:
        if 0 <= o <= 0x10FFFF and pred(chr(o)):
            return True
    if any(pred(c) for c in _SAMPLE):
        return True
    if source is not None:
        return re.search(source, _all_chars()) is not None
    return any(pred(chr(o)) for o in range(0x110000))


class _NFA:
    """A Thompson NFA: per state, epsilon edges, literal-character edges and predicate edges."""

    def __init__(self) -> None:
        self.eps: list[list[int]] = []
        self.lit: list[list[tuple[str, int]]] = []
        self.pred: list[list[tuple[Callable[[str], bool], int]]] = []

    def new(self) -> int:
        n = len(self.eps)
        if n >= MAX_NFA_STATES:
            raise ValueError(f"guided_regex: pattern expands to more than {MAX_NFA_STATES} automaton states")
        self.eps.append([])
        self.lit.append([])
        self.pred.append([])
        return n

    # Each builder appends edges out of `s` (never into it) and returns a state with no outgoing edges yet.
    def seq(self, items: list, s: int, at_start: bool, at_end: bool) -> int:
        n = len(items)
        for i, (op, av) in enumerate(items):
            s = self.item(op, av, s, at_start and i == 0, at_end and i == n - 1)
        return s

    def item(self, op: object, av: object, s: int, at_start: bool, at_end: bool) -> int:
        if op is _OP.LITERAL:
            t = self.new()
            self.lit[s].append((chr(av), t))
            return t
        if op is _OP.NOT_LITERAL:
            c = chr(av)
            return self._pred(s, lambda ch: ch != c, {av - 1, av + 1})
        if op is _OP.ANY:
            return self._pred(s, lambda ch: ch != "\n", {0})
        if op is _OP.IN:
            return self._in(av, s)
        if op is _OP.BRANCH:
            e = self.new()
            for alt in av[1]:
                self.eps[self.seq(alt, s, at_start, at_end)].append(e)
            return e
        if op is _OP.SUBPATTERN:
            _group, add_flags, del_flags, sub = av
            _check_flags(add_flags | del_flags)
            return self.seq(sub, s, at_start, at_end)
        if op is _OP.MAX_REPEAT or op is _OP.MIN_REPEAT:
            lo, hi, sub = av
            for _ in range(lo):
                s = self.seq(sub, s, False, False)
            if hi is _OP.MAXREPEAT:
                b = self.new()
                self.eps[s].append(b)
                be = self.seq(sub, b, False, False)
                e = self.new()
                self.eps[be] += [b, e]
                self.eps[s].append(e)
                return e
            e = self.new()
            for _ in range(hi - lo):
                self.eps[s].append(e)
                s = self.seq(sub, s, False, False)
            self.eps[s].append(e)
            return e
        if op is _OP.AT:
            if (av is _OP.AT_BEGINNING or av is _OP.AT_BEGINNING_STRING) and at_start:
                return s
            if (av is _OP.AT_END or av is _OP.AT_END_STRING) and at_end:
                return s
            raise _unsupported(av)
        raise _unsupported(op)

    def _pred(self, s: int, pred: Callable[[str], bool], hints: set[int], source: str | None = None) -> int:
        t = self.new()
        if _matches_something(pred, hints, source):  # an edge nothing can cross is left out
            self.pred[s].append((pred, t))
        return t

    def _in(self, items: list, s: int) -> int:
        negate = False
        chars: set[str] = set()
        ranges: list[tuple[int, int]] = []
        cats: list[Callable[[str], bool]] = []
        source = [""]  # the same set as a regex, opened once negation is known
        for op, av in items:
            if op is _OP.NEGATE:
                negate = True
            elif op is _OP.LITERAL:
                chars.add(chr(av))
                source.append(f"\\U{av:08x}")
            elif op is _OP.RANGE:
                ranges.append(av)
                source.append(f"\\U{av[0]:08x}-\\U{av[1]:08x}")
            elif op is _OP.CATEGORY:
                if av not in _CATEGORIES:
                    raise _unsupported(av)
                cats.append(_CATEGORIES[av])
                source.append(_CATEGORY_SOURCES[av])
            else:
                raise _unsupported(op)
        if not negate and not ranges and not cats:
            t = self.new()
            self.lit[s].extend((c, t) for c in sorted(chars))
            return t
        fchars, franges, fcats = frozenset(chars), tuple(ranges), tuple(cats)

        def pred(ch: str) -> bool:
            if ch in fchars:
                hit = True
            else:
                o = ord(ch)
                hit = any(a <= o <= b for a, b in franges) or any(f(ch) for f in fcats)
            return hit != negate

        hints = {ord(c) + d for c in chars for d in (-1, 0, 1)} | {x for a, b in ranges for x in (a - 1, a, b, b + 1)}
        source[0] = "[^" if negate else "["
        return self._pred(s, pred, hints, "".join(source) + "]")


class CharDFA:
    """A regex as a lazily determinized character-level DFA with ``re.fullmatch`` semantics.

    Supported: literals, ``.`` (any character but a newline), character classes (ranges, negation, ``\\d \\D \\s
    \\S \\w \\W`` with the Unicode meaning ``re`` gives them), alternation, groups (capturing or not; a group that
    sets flags other than ``u``/``x`` is refused), greedy and lazy repeats (``? * + {m} {m,n} {m,}``; for a whole
    match laziness does not matter), and ``^``/``\\A`` as the pattern's first item and ``$``/``\\Z`` as its last
    one (no-ops there). Anything else - backreferences, lookarounds, ``\\b``, possessive repeats, atomic groups,
    conditionals, flags - raises ValueError naming the construct. Bounded repeats are expanded by copying, and a
    pattern whose NFA would exceed :data:`MAX_NFA_STATES` states raises ValueError.

    States are ints numbered from 0 in order of discovery; :data:`DEAD` (-1) is absorbing.
    """

    def __init__(self, pattern: str) -> None:
        if not isinstance(pattern, str):
            raise TypeError("guided_regex: the pattern must be a str")
        self.pattern = pattern
        try:
            parsed = sre_parse.parse(pattern)
        except re.error as e:
            raise ValueError(f"guided_regex: invalid regex {pattern!r}: {e}") from e
        _check_flags(parsed.state.flags)
        nfa = _NFA()
        start = nfa.new()
        self._accept = nfa.seq(list(parsed), start, True, True)
        self._eps, lit, pred = nfa.eps, nfa.lit, nfa.pred
        n = len(self._eps)

        # live[s]: the accepting state can be reached from s (every edge predicate matches some character).
        rev: list[list[int]] = [[] for _ in range(n)]
        for s in range(n):
            for t in self._eps[s]:
                rev[t].append(s)
            for _, t in lit[s]:
                rev[t].append(s)
            for _, t in pred[s]:
                rev[t].append(s)
        live = [False] * n
        live[self._accept] = True
        stack = [self._accept]
        while stack:
            for p in rev[stack.pop()]:
                if not live[p]:
                    live[p] = True
                    stack.append(p)
        self._live = live
        # Only edges into live states matter; states with none (and not accepting) are not kept in DFA states.
        self._lit = [[(c, t) for c, t in lit[s] if live[t]] for s in range(n)]
        self._pred = [[(f, t) for f, t in pred[s] if live[t]] for s in range(n)]
        self._important = [bool(self._lit[s] or self._pred[s]) or s == self._accept for s in range(n)]

        self._ids: dict[frozenset[int], int] = {}
        self._sets: list[frozenset[int]] = []
        self._accepting: list[bool] = []
        self._cont: list[bool] = []
        self._lits: list[dict[str, tuple[int, ...]]] = []
        self._preds: list[tuple[tuple[Callable[[str], bool], int], ...]] = []
        self._trans: list[dict[str, int]] = []
        self.start: int = self._add(self._closure([start]))

    @property
    def num_states(self) -> int:
        """DFA states discovered so far."""
        return len(self._sets)

    def _closure(self, seeds: list[int]) -> frozenset[int]:
        live, eps, important = self._live, self._eps, self._important
        stack = [s for s in seeds if live[s]]
        seen = set(stack)
        while stack:
            for t in eps[stack.pop()]:
                if t not in seen and live[t]:
                    seen.add(t)
                    stack.append(t)
        return frozenset(s for s in seen if important[s])

    def _add(self, key: frozenset[int]) -> int:
        sid = len(self._sets)
        self._ids[key] = sid
        self._sets.append(key)
        lits: dict[str, list[int]] = {}
        preds: list[tuple[Callable[[str], bool], int]] = []
        for s in sorted(key):
            for c, t in self._lit[s]:
                lits.setdefault(c, []).append(t)
            preds.extend(self._pred[s])
        self._lits.append({c: tuple(ts) for c, ts in lits.items()})
        self._preds.append(tuple(preds))
        self._accepting.append(self._accept in key)
        self._cont.append(bool(lits or preds))
        self._trans.append({})
        return sid

    def _compute(self, state: int, ch: str) -> int:
        seeds = list(self._lits[state].get(ch, ()))
        for f, t in self._preds[state]:
            if f(ch):
                seeds.append(t)
        if seeds:
            key = self._closure(seeds)
            nxt = self._ids.get(key)
            if nxt is None:
                nxt = self._add(key)
        else:
            nxt = DEAD
        self._trans[state][ch] = nxt
        return nxt

    def step(self, state: int, ch: str) -> int:
        """The state after reading the single character ``ch`` from ``state``, or DEAD."""
        if state < 0:
            return DEAD
        nxt = self._trans[state].get(ch)
        if nxt is None:
            if len(ch) != 1:
                raise ValueError(f"step takes one character, got {ch!r}")
            nxt = self._compute(state, ch)
        return nxt

    def walk(self, state: int, s: str) -> int:
        """The state after reading ``s`` from ``state``; DEAD as soon as a character leads there."""
        if state < 0:
            return DEAD
        trans = self._trans
        for ch in s:
            nxt = trans[state].get(ch)
            if nxt is None:
                nxt = self._compute(state, ch)
            if nxt < 0:
                return DEAD
            state = nxt
        return state

    def accepting(self, state: int) -> bool:
        """Whether the text that led to ``state`` matches the whole pattern."""
        return state >= 0 and self._accepting[state]

    def can_continue(self, state: int) -> bool:
        """Whether some non-empty continuation from ``state`` still leads to a match.

        Exact: the state holds only NFA states from which acceptance is reachable, and every character
        predicate on an NFA edge accepts at least one character (checked when the NFA is built; an edge
        whose predicate accepts nothing, such as ``[^\\d\\D]``, is dropped), so any outgoing edge into a live
        NFA state is the first step of a path to acceptance.
        """
        return state >= 0 and self._cont[state]

    def fullmatch(self, s: str) -> bool:
        """Whether ``s`` matches the whole pattern, as ``re.fullmatch(pattern, s) is not None``."""
        return self.accepting(self.walk(self.start, s))


def choice_regex(choices: list[str]) -> str:
    """A regex matching exactly one of ``choices`` (compared as literal text)."""
    if isinstance(choices, str) or not isinstance(choices, (list, tuple)):
        raise ValueError("guided_choice: choices must be a list of strings")
    if not choices:
        raise ValueError("guided_choice: the list of choices is empty")
    for c in choices:
        if not isinstance(c, str):
            raise ValueError(f"guided_choice: choice {c!r} is not a string")
    return "(?:" + "|".join(re.escape(c) for c in choices) + ")"


# ---------------------------------------------------------------------------------------------------------------
# JSON

_JSON_CHAR = r'(?:[^"\\\x00-\x1f]|\\["\\/bfnrt]|\\u[0-9a-fA-F]{4})'
JSON_STRING = '"' + _JSON_CHAR + '*"'
JSON_INTEGER = r"-?(?:0|[1-9][0-9]*)"
JSON_NUMBER = JSON_INTEGER + r"(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?"
JSON_BOOLEAN = "(?:true|false)"
JSON_NULL = "null"
_JSON_SCALAR = f"(?:{JSON_STRING}|{JSON_NUMBER}|{JSON_BOOLEAN}|{JSON_NULL})"

_DATE = r"[0-9]{4}-(?:0[1-9]|1[0-2])-(?:0[1-9]|[12][0-9]|3[01])"
_TIME = r"(?:[01][0-9]|2[0-3]):[0-5][0-9]:(?:[0-5][0-9]|60)(?:\.[0-9]+)?(?:[Zz]|[+-](?:[01][0-9]|2[0-3]):[0-5][0-9])"
_FORMATS = {
    "date": _DATE,
    "time": _TIME,
    "date-time": _DATE + "[Tt]" + _TIME,
    "uuid": r"[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}",
}

# Keywords that change which instances are valid and that are not implemented.
_UNSUPPORTED = (
    "not", "if", "then", "else", "allOf", "patternProperties", "propertyNames", "dependentRequired",
    "dependentSchemas", "dependencies", "minProperties", "maxProperties", "contains", "minContains", "maxContains",
    "prefixItems", "additionalItems", "unevaluatedItems", "multipleOf", "$dynamicRef", "$recursiveRef",
)
# Keywords this generator acts on; anything else is taken as an annotation and ignored.
_KEYWORDS = frozenset((
    "type", "properties", "required", "additionalProperties", "items", "minItems", "maxItems", "pattern",
    "minLength", "maxLength", "format", "enum", "const", "anyOf", "oneOf", "allOf", "$ref", "minimum", "maximum",
    "exclusiveMinimum", "exclusiveMaximum", "nullable", "uniqueItems",
))
_TYPE_HINTS = {
    "object": ("properties", "additionalProperties", "required"),
    "array": ("items", "minItems", "maxItems"),
    "string": ("pattern", "minLength", "maxLength", "format"),
    "number": ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"),
}
_NUMBER_BOUNDS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum")
_SHORT_ESCAPES = {'"': '\\"', "\\": "\\\\", "\b": "\\b", "\f": "\\f", "\n": "\\n", "\r": "\\r", "\t": "\\t"}


def _ws(whitespace: str) -> str:
    return f"(?:{whitespace})" if whitespace else ""


def _object_of(value: str, ws: str) -> str:
    pair = f"{JSON_STRING}{ws}:{ws}{value}"
    return rf"\{{{ws}(?:{pair}(?:{ws},{ws}{pair})*)?{ws}\}}"


def _array_of(value: str, ws: str) -> str:
    return rf"\[{ws}(?:{value}(?:{ws},{ws}{value})*)?{ws}\]"


def _any_value(depth: int, ws: str) -> str:
    v = _JSON_SCALAR
    for _ in range(depth):
        v = f"(?:{_JSON_SCALAR}|{_object_of(v, ws)}|{_array_of(v, ws)})"
    return v


def json_object_regex(depth: int = 2, *, whitespace: str = r"[ ]?") -> str:
    """A regex for any JSON object with at most ``depth`` levels of nested objects/arrays (itself included)."""
    if not isinstance(depth, int) or depth < 1:
        raise ValueError(f"guided_json: depth must be an int >= 1, got {depth!r}")
    ws = _ws(whitespace)
    return _object_of(_any_value(depth - 1, ws), ws)


def _hex_escape(o: int) -> str:
    """A regex for the JSON escape (\\u and four hex digits) of the UTF-16 unit ``o``, hex digits in either case."""
    return r"\\u" + "".join(f"[{d}{d.upper()}]" if d.isalpha() else d for d in f"{o:04x}")


def _string_literal(s: str) -> str:
    out = ['"']
    for ch in s:
        o = ord(ch)
        if ch in _SHORT_ESCAPES:
            out.append(re.escape(_SHORT_ESCAPES[ch]))
        elif o < 0x20:
            out.append(re.escape(f"\\u{o:04x}"))
        elif o < 0x7F:
            out.append(re.escape(ch))
        elif o > 0xFFFF:  # raw, or as a UTF-16 surrogate pair
            o -= 0x10000
            out.append(f"(?:{ch}|{_hex_escape(0xD800 + (o >> 10))}{_hex_escape(0xDC00 + (o & 0x3FF))})")
        elif 0xD800 <= o <= 0xDFFF:
            out.append(_hex_escape(o))
        else:
            out.append(f"(?:{re.escape(ch)}|{_hex_escape(o)})")
    out.append('"')
    return "".join(out)


def _literal(value: object, ws: str) -> str:
    """A regex for the JSON encodings of ``value`` (objects with their keys in the given order)."""
    if value is None or isinstance(value, bool):
        return json.dumps(value)
    if isinstance(value, (int, float)):
        if isinstance(value, float) and not math.isfinite(value):
            raise ValueError(f"guided_json: {value!r} is not a JSON number")
        return re.escape(json.dumps(value))
    if isinstance(value, str):
        return _string_literal(value)
    if isinstance(value, (list, tuple)):
        if not value:
            return rf"\[{ws}\]"
        return rf"\[{ws}" + f"{ws},{ws}".join(_literal(v, ws) for v in value) + rf"{ws}\]"
    if isinstance(value, dict):
        if not value:
            return rf"\{{{ws}\}}"
        pairs = []
        for k, v in value.items():
            if not isinstance(k, str):
                raise ValueError(f"guided_json: object key {k!r} is not a string")
            pairs.append(f"{_string_literal(k)}{ws}:{ws}{_literal(v, ws)}")
        return rf"\{{{ws}" + f"{ws},{ws}".join(pairs) + rf"{ws}\}}"
    raise ValueError(f"guided_json: {value!r} is not a JSON value")


def _alternation(parts: list[str]) -> str:
    uniq = list(dict.fromkeys(parts))
    return uniq[0] if len(uniq) == 1 else "(?:" + "|".join(uniq) + ")"


def _same_length_range(a: str, b: str) -> str:
    """A regex for the decimal strings of the length of ``a`` and ``b`` between them (a <= b)."""
    n = len(a)
    if a == b:
        return a
    if n == 1:
        return f"[{a}-{b}]"
    rest = n - 1
    if a[1:] == "0" * rest and b[1:] == "9" * rest:
        return f"[{a[0]}-{b[0]}][0-9]{{{rest}}}"
    if a[0] == b[0]:
        return f"{a[0]}(?:{_same_length_range(a[1:], b[1:])})"
    parts = [f"{a[0]}(?:{_same_length_range(a[1:], '9' * rest)})"]
    if int(a[0]) + 1 <= int(b[0]) - 1:
        parts.append(f"[{int(a[0]) + 1}-{int(b[0]) - 1}][0-9]{{{rest}}}")
    parts.append(f"{b[0]}(?:{_same_length_range('0' * rest, b[1:])})")
    return "(?:" + "|".join(parts) + ")"


def _natural_range(lo: int, hi: int | None) -> str:
    """A regex for the canonical decimals of the integers in [lo, hi] (0 <= lo; hi None: unbounded)."""
    parts = []
    top = len(str(hi)) if hi is not None else len(str(lo))
    for length in range(len(str(lo)), top + 1):
        a = max(lo, 10 ** (length - 1) if length > 1 else 0)
        b = 10**length - 1 if hi is None else min(hi, 10**length - 1)
        if a <= b:
            parts.append(_same_length_range(str(a), str(b)))
    if hi is None:
        parts.append(f"[1-9][0-9]{{{top},}}")
    return _alternation(parts)


def _integer_range(lo: int | None, hi: int | None) -> str:
    """A regex for the canonical JSON integers in [lo, hi]; None is an open end."""
    if lo is None and hi is None:
        return JSON_INTEGER
    if lo is not None and hi is not None and lo > hi:
        raise ValueError(f"guided_json: integer range [{lo}, {hi}] is empty")
    parts = []
    if lo is None or lo < 0:  # negative values, by magnitude
        mag_lo = 1 if hi is None or hi >= -1 else -hi
        mag_hi = None if lo is None else -lo
        parts.append("-" + _natural_range(mag_lo, mag_hi))
    if hi is None or hi >= 0:
        parts.append(_natural_range(max(lo, 0) if lo is not None else 0, hi))
    return _alternation(parts)


def _int_param(schema: dict, key: str, default: int | None) -> int | None:
    v = schema.get(key, default)
    if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 0):
        raise ValueError(f"guided_json: '{key}' must be a non-negative integer, got {v!r}")
    return v


def _strip_anchors(pattern: str) -> str:
    if pattern.startswith("^"):
        pattern = pattern[1:]
    if pattern.endswith("$"):
        backslashes = len(pattern) - 1 - len(pattern[:-1].rstrip("\\"))
        if backslashes % 2 == 0:
            pattern = pattern[:-1]
    return pattern


class _JsonSchemaRegex:
    """The walk of a schema and its checks, with the pieces put together as a regex. The GBNF generator
    (:mod:`infercore.engine.json_grammar`) takes the same walk and overrides how pieces are joined (``leaf``,
    ``alt``, ``any_value``, ``ref``, ``object``, ``array``), so what the two accept can only differ where the regex
    has to stop: recursion and free-form values of any depth."""

    def __init__(self, root: object, whitespace: str) -> None:
        self.root = root
        self.ws = _ws(whitespace)
        self.refs: list[str] = []

    @staticmethod
    def leaf(regex: str) -> str:
        """A regular piece (a scalar, a const or enum) in this generator's syntax."""
        return regex

    @staticmethod
    def alt(parts: list[str]) -> str:
        return _alternation(parts)

    def any_value(self) -> str:
        return _any_value(2, self.ws)

    def ref(self, ref: str) -> str:
        if ref in self.refs:
            raise ValueError(f"guided_json: recursive $ref {ref!r} is not supported")
        self.refs.append(ref)
        try:
            return self.gen(self.resolve(ref))
        finally:
            self.refs.pop()

    def resolve(self, ref: object) -> object:
        if not isinstance(ref, str) or not ref.startswith("#"):
            raise ValueError(f"guided_json: only local $ref ('#/...') is supported, got {ref!r}")
        node = self.root
        for part in ref[1:].split("/")[1:] if ref != "#" else []:
            part = part.replace("~1", "/").replace("~0", "~")
            try:
                node = node[int(part)] if isinstance(node, list) else node[part]
            except (KeyError, IndexError, ValueError, TypeError):
                raise ValueError(f"guided_json: $ref {ref!r} does not resolve") from None
        return node

    def gen(self, schema: object) -> str:
        if schema is True:
            return self.any_value()
        if schema is False:
            raise ValueError("guided_json: schema false matches nothing")
        if not isinstance(schema, dict):
            raise ValueError(f"guided_json: a schema must be an object or a boolean, got {schema!r}")
        for key in _UNSUPPORTED:
            if key in schema and not (key == "allOf" and self._single_all_of(schema)):
                raise ValueError(f"guided_json: unsupported keyword '{key}'")
        if schema.get("uniqueItems") is True:
            raise ValueError("guided_json: unsupported keyword 'uniqueItems'")
        if schema.get("nullable") is True:
            rest = {k: v for k, v in schema.items() if k != "nullable"}
            return self.alt([self.gen(rest), self.leaf(JSON_NULL)])

        if "$ref" in schema:
            self._no_siblings(schema, "$ref")
            return self.ref(schema["$ref"])
        if "allOf" in schema:  # a single subschema (as emitted to attach annotations to a $ref)
            self._no_siblings(schema, "allOf")
            return self.gen(schema["allOf"][0])
        if "const" in schema:
            return self.leaf(_literal(schema["const"], self.ws))
        if "enum" in schema:
            values = schema["enum"]
            if not isinstance(values, list) or not values:
                raise ValueError("guided_json: 'enum' must be a non-empty list")
            return self.leaf(_alternation([_literal(v, self.ws) for v in values]))
        for key in ("anyOf", "oneOf"):
            if key in schema:
                self._no_siblings(schema, key)
                subs = schema[key]
                if not isinstance(subs, list) or not subs:
                    raise ValueError(f"guided_json: '{key}' must be a non-empty list")
                return self.alt([self.gen(s) for s in subs])

        types = schema.get("type")
        if isinstance(types, list):
            if not types:
                raise ValueError("guided_json: 'type' is an empty list")
            return self.alt([self.gen({**schema, "type": t}) for t in types])
        if types is None:
            found = [t for t, keys in _TYPE_HINTS.items() if any(k in schema for k in keys)]
            if not found:
                return self.any_value()
            if len(found) > 1:
                raise ValueError(f"guided_json: schema without 'type' has keywords of several types: {found}")
            types = found[0]
        if types == "object":
            return self.object(schema)
        if types == "array":
            return self.array(schema)
        if types == "string":
            return self.leaf(self.string(schema))
        if types == "integer":
            return self.leaf(self.integer(schema))
        if types == "number":
            for key in _NUMBER_BOUNDS:
                if key in schema:
                    raise ValueError(f"guided_json: unsupported keyword '{key}' for type 'number'")
            return self.leaf(JSON_NUMBER)
        if types == "boolean":
            return self.leaf(JSON_BOOLEAN)
        if types == "null":
            return self.leaf(JSON_NULL)
        raise ValueError(f"guided_json: unsupported type {types!r}")

    @staticmethod
    def _single_all_of(schema: dict) -> bool:
        subs = schema["allOf"]
        return isinstance(subs, list) and len(subs) == 1

    @staticmethod
    def _no_siblings(schema: dict, key: str) -> None:
        others = sorted(k for k in schema if k != key and k in _KEYWORDS)
        if others:
            raise ValueError(f"guided_json: '{key}' together with {others} is not supported")

    @staticmethod
    def object_shape(schema: dict) -> tuple[str, object]:
        """An object schema checked: ``("map", value schema or None)`` (no ``properties``: any keys, values
        matching ``additionalProperties`` when it is a non-empty schema, else free), ``("props", [(key, schema,
        required), ...])`` (every property the schema lists, in order; ``false`` ones left out) or ``("props",
        [])`` for ``{}`` alone."""
        props = schema.get("properties")
        required = schema.get("required", [])
        if not isinstance(required, list):
            raise ValueError("guided_json: 'required' must be a list")
        if props is None:
            if required:
                raise ValueError("guided_json: 'required' without 'properties' is not supported")
            extra = schema.get("additionalProperties", True)
            if extra is False:
                return "props", []
            return "map", (extra if isinstance(extra, dict) and extra else None)
        if not isinstance(props, dict):
            raise ValueError("guided_json: 'properties' must be an object")
        missing = [k for k in required if k not in props]
        if missing:
            raise ValueError(f"guided_json: required properties {missing} are not in 'properties'")
        members = []
        for key, sub in props.items():
            if sub is False:
                if key in required:
                    raise ValueError(f"guided_json: required property {key!r} has schema false")
                continue
            members.append((key, sub, key in required))
        return "props", members

    def object(self, schema: dict) -> str:
        ws = self.ws
        kind, arg = self.object_shape(schema)
        if kind == "map":
            return _object_of(_JSON_SCALAR if arg is None else self.gen(arg), ws)
        pairs = [f"{_string_literal(key)}{ws}:{ws}{self.gen(sub)}" for key, sub, _ in arg]
        if not pairs:
            return rf"\{{{ws}\}}"
        return rf"\{{{ws}" + f"{ws},{ws}".join(pairs) + rf"{ws}\}}"

    @staticmethod
    def array_shape(schema: dict) -> tuple[object, int, int | None]:
        """An array schema checked: (the items' schema, None where any value goes; minItems; maxItems or
        None)."""
        items = schema.get("items")
        if isinstance(items, list):
            raise ValueError("guided_json: unsupported keyword 'items' as a list")
        lo = _int_param(schema, "minItems", 0)
        hi = _int_param(schema, "maxItems", None)
        if hi is not None and hi < lo:
            raise ValueError(f"guided_json: maxItems {hi} < minItems {lo}")
        return (None if items is None or items is True or items == {} else items), lo, hi

    def array(self, schema: dict) -> str:
        ws = self.ws
        items, lo, hi = self.array_shape(schema)
        item = None if items is None else self.gen(items)  # a bad items schema is refused even under maxItems 0
        if hi == 0:
            return rf"\[{ws}\]"
        if item is None:
            item = self.any_value()
        more = f"(?:{ws},{ws}{item})"
        low = max(lo - 1, 0)
        body = item + (f"{more}{{{low},}}" if hi is None else f"{more}{{{low},{hi - 1}}}")
        if lo == 0:
            body = f"(?:{body})?"
        return rf"\[{ws}{body}{ws}\]"

    def string(self, schema: dict) -> str:
        lengths = "minLength" in schema or "maxLength" in schema
        if "pattern" in schema:
            if lengths:
                raise ValueError("guided_json: 'pattern' together with minLength/maxLength is not supported")
            pattern = schema["pattern"]
            if not isinstance(pattern, str):
                raise ValueError("guided_json: 'pattern' must be a string")
            return f'"(?:{_strip_anchors(pattern)})"'
        fmt = schema.get("format")
        if fmt in _FORMATS and not lengths:
            return f'"{_FORMATS[fmt]}"'
        lo = _int_param(schema, "minLength", 0)
        hi = _int_param(schema, "maxLength", None)
        if hi is not None and hi < lo:
            raise ValueError(f"guided_json: maxLength {hi} < minLength {lo}")
        if lo == 0 and hi is None:
            return JSON_STRING
        return '"' + _JSON_CHAR + (f"{{{lo},}}" if hi is None else f"{{{lo},{hi}}}") + '"'

    @staticmethod
    def integer(schema: dict) -> str:
        lo: int | None = None
        hi: int | None = None
        for key in _NUMBER_BOUNDS:
            v = schema.get(key)
            if v is None or isinstance(v, bool):
                continue
            if not isinstance(v, (int, float)) or not math.isfinite(v):
                raise ValueError(f"guided_json: '{key}' must be a finite number, got {v!r}")
            if key == "minimum":
                b = math.floor(v) + 1 if schema.get("exclusiveMinimum") is True else math.ceil(v)
                lo = b if lo is None else max(lo, b)
            elif key == "exclusiveMinimum":
                b = math.floor(v) + 1
                lo = b if lo is None else max(lo, b)
            elif key == "maximum":
                b = math.ceil(v) - 1 if schema.get("exclusiveMaximum") is True else math.floor(v)
                hi = b if hi is None else min(hi, b)
            else:
                b = math.ceil(v) - 1
                hi = b if hi is None else min(hi, b)
        return _integer_range(lo, hi)


def json_schema_regex(schema: dict | str, *, whitespace: str = r"[ ]?") -> str:
    """A regex whose matches are JSON texts valid for ``schema`` (a dict, or its JSON text).

    Supported: ``type`` (one or a list) object, array, string, integer, number, boolean, null; ``enum`` and
    ``const`` anywhere (objects in them with their keys in the given order); ``anyOf``/``oneOf`` (as alternation:
    the exclusivity of ``oneOf`` is not enforced); ``allOf`` with a single subschema; local ``$ref`` (``#/$defs/...``,
    ``#/definitions/...``), not recursive; ``nullable``; ``true``/``{}`` or a schema of annotations only as any
    JSON value up to two levels of nesting.

    - object: every property of ``properties`` is emitted, in the order given, whether required or not, and no
      other; ``additionalProperties`` is then irrelevant. Without ``properties``: any object whose values are
      JSON scalars (or match ``additionalProperties`` when that is a schema; ``false``: only ``{}``).
    - array: ``items`` (one schema; absent: any JSON value), ``minItems``, ``maxItems``.
    - string: ``minLength``/``maxLength`` (an escape sequence counts as one character); ``pattern`` (anchors ``^``
      and ``$`` at its ends stripped), matched against the encoded string content, between the quotes, as a
      whole; ``format`` date, time, date-time, uuid (other formats are ignored).
    - integer: ``minimum``, ``maximum``, ``exclusiveMinimum``, ``exclusiveMaximum`` (bounds exact). number: no
      bounds.

    ``whitespace`` (a regex) may appear after ``{``/``[``, around ``:`` and ``,``, and before ``}``/``]``. Keywords
    that change validity and are not implemented (``not``, ``if``, ``patternProperties``, ``multipleOf``, ...)
    raise ValueError naming them; other unknown keywords are taken as annotations and ignored.
    """
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as e:
            raise ValueError(f"guided_json: schema is not valid JSON: {e}") from e
    return _JsonSchemaRegex(schema, whitespace).gen(schema)
