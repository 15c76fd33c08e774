"""JSON schemas as GBNF grammars: the context-free side of ``SamplingParams.guided_json``.

A regex (:func:`~infercore.engine.fsm.json_schema_regex`) cannot follow a recursive ``$ref`` (a tree whose nodes
hold nodes, a linked list) nor a free-form JSON value of any depth. :func:`json_schema_grammar` writes the schema
as a GBNF grammar instead (llama.cpp's format, run by :class:`~infercore.engine.guided.GrammarGuide`), as
llama.cpp's json-schema-to-grammar and xgrammar do: each ``$ref`` is a rule, so a reference back to a rule being
written is recursion, and a free-form value is the rule ``value`` of JSON's own grammar.

The grammar takes the regex generator's walk of the schema (its keywords, checks and error messages) and only
joins the pieces differently; every regular piece (a string with its length, pattern or format, an integer range,
a number, a const or enum) is the regex generator's own regex, translated to GBNF by :func:`regex_gbnf`. So on a
schema the regex can express, the grammar accepts the same documents, with the same whitespace. Where they part:

- a value the schema leaves free (``true``, ``{}``, a schema of annotations only, ``items`` absent,
  ``{"type": "object"}`` without ``properties``, ``additionalProperties`` true or ``{}``): any JSON value, nested
  to any depth (the regex: up to two levels, and scalars alone as the values of a free object);
- an optional property (not in ``required``) whose schema can recurse may be left out; every other property is
  written, in the schema's order, as the regex writes them (otherwise a linked list whose ``next`` is optional
  could never end).

:func:`json_schema_guide` picks the engine per schema: the regex (a DFA: faster, and bounded) unless the schema
recurses or has a free value, else the grammar.
"""

from __future__ import annotations

import functools
import json
import re

from .fsm import (
    _CATEGORY_SOURCES,
    _FLAGS_OK,
    JSON_BOOLEAN,
    JSON_INTEGER,
    JSON_NULL,
    JSON_NUMBER,
    JSON_STRING,
    _JsonSchemaRegex,
    _string_literal,
    json_schema_regex,
    sre_parse,
)
from .gbnf import MAX_CHAR, merge_ranges

__all__ = ["json_schema_grammar", "json_schema_guide", "regex_gbnf"]

_OP = sre_parse


# ---------------------------------------------------------------------------------------------------------------
# regex -> GBNF
# ---------------------------------------------------------------------------------------------------------------


@functools.cache
def _category_ranges(source: str) -> tuple[tuple[int, int], ...]:
    """The code points ``re`` matches with the class ``source`` (``\\d``, ``\\w``, ...), as inclusive ranges."""
    every = "".join(map(chr, range(MAX_CHAR + 1)))
    return tuple((m.start(), m.end() - 1) for m in re.finditer(f"{source}+", every))


def _gbnf_char(o: int) -> str:
    c = chr(o)
    if c.isascii() and c.isalnum():
        return c
    if o < 0x100:
        return f"\\x{o:02x}"
    return f"\\u{o:04x}" if o < 0x10000 else f"\\U{o:08x}"


def gbnf_literal(s: str) -> str:
    """``s`` as a GBNF string literal."""
    return '"' + "".join(c if " " <= c <= "~" and c not in '"\\' else _gbnf_char(ord(c)) for c in s) + '"'


def gbnf_class(ranges: tuple[tuple[int, int], ...], negated: bool) -> str:
    """A GBNF character class of the inclusive code-point ``ranges`` (or, ``negated``, of every other one)."""
    if not ranges:  # nothing: the complement of everything (a set the grammar drops)
        ranges, negated = ((0, MAX_CHAR),), not negated
    body = "".join(_gbnf_char(a) if a == b else f"{_gbnf_char(a)}-{_gbnf_char(b)}" for a, b in ranges)
    return f"[{'^' if negated else ''}{body}]"


class _RegexGbnf:
    """sre's parse tree of a regex as a GBNF expression (CharDFA's subset of the syntax, the same meaning)."""

    def __init__(self, pattern: str) -> None:
        self.pattern = pattern

    def unsupported(self, what: object) -> ValueError:
        return ValueError(f"guided_json: unsupported regex construct '{getattr(what, 'name', what)}' in "
                          f"{self.pattern!r}")

    def check_flags(self, flags: int) -> None:
        if flags & ~_FLAGS_OK:
            raise self.unsupported(f"flags {flags & ~_FLAGS_OK:#x}")

    def seq(self, items: list) -> str:
        out: list[str] = []
        text: list[str] = []  # literal characters in a row: one string literal
        for op, av in items:
            if op is _OP.LITERAL:
                text.append(chr(av))
                continue
            if text:
                out.append(gbnf_literal("".join(text)))
                text = []
            out.append(self.item(op, av))
        if text:
            out.append(gbnf_literal("".join(text)))
        out = [x for x in out if x != '""']
        return " ".join(out) if out else '""'

    def item(self, op: object, av: object) -> str:
        if op is _OP.NOT_LITERAL:
            return gbnf_class(((av, av),), True)
        if op is _OP.ANY:
            return gbnf_class(((10, 10),), True)
        if op is _OP.IN:
            return self.char_set(av)
        if op is _OP.BRANCH:
            return "(" + " | ".join(self.seq(alt) for alt in av[1]) + ")"
        if op is _OP.SUBPATTERN:
            _group, add_flags, del_flags, sub = av
            self.check_flags(add_flags | del_flags)
            return f"({self.seq(sub)})"
        if op is _OP.MAX_REPEAT or op is _OP.MIN_REPEAT:  # laziness does not matter to a whole match
            lo, hi, sub = av
            inner = f"({self.seq(sub)})"
            if hi is _OP.MAXREPEAT:
                return inner + ("*" if lo == 0 else "+" if lo == 1 else f"{{{lo},}}")
            return inner + ("?" if (lo, hi) == (0, 1) else f"{{{lo}}}" if lo == hi else f"{{{lo},{hi}}}")
        # anchors included: a fragment here is always embedded in a larger text, where the regex path refuses them
        raise self.unsupported(av if op is _OP.AT else op)

    def char_set(self, items: list) -> str:
        negated = False
        ranges: list[tuple[int, int]] = []
        for op, av in items:
            if op is _OP.NEGATE:
                negated = True
            elif op is _OP.LITERAL:
                ranges.append((av, av))
            elif op is _OP.RANGE:
                ranges.append(av)
            elif op is _OP.CATEGORY and av in _CATEGORY_SOURCES:
                ranges.extend(_category_ranges(_CATEGORY_SOURCES[av]))
            else:
                raise self.unsupported(av if op is _OP.CATEGORY else op)
        return gbnf_class(merge_ranges(ranges), negated)


def regex_gbnf(pattern: str) -> str:
    """A GBNF expression (no rule name; group it to repeat it) for the strings ``pattern`` fully matches, for the
    regexes :class:`~infercore.engine.fsm.CharDFA` takes, except anchors (refused: a fragment of a JSON schema's
    regex is never at the start or end of the whole). Raises ValueError naming ``guided_json`` otherwise."""
    try:
        parsed = sre_parse.parse(pattern)
    except re.error as e:
        raise ValueError(f"guided_json: invalid regex {pattern!r}: {e}") from e
    tr = _RegexGbnf(pattern)
    tr.check_flags(parsed.state.flags)
    return tr.seq(list(parsed))


# ---------------------------------------------------------------------------------------------------------------
# schema -> GBNF
# ---------------------------------------------------------------------------------------------------------------

_NAMED = {JSON_STRING: "string", JSON_NUMBER: "number", JSON_INTEGER: "integer", JSON_BOOLEAN: "boolean",
          JSON_NULL: "null"}


class _JsonSchemaGrammar(_JsonSchemaRegex):
    """The regex generator's walk, joined as GBNF: every method returns a GBNF expression that can be written
    beside another or repeated as it is (a rule name, a literal or a group). Rules go to ``self.rules``."""

    def __init__(self, root: object, whitespace: str) -> None:
        super().__init__(root, whitespace)  # self.ws stays the regex whitespace: it is inside const/enum leaves
        self.rules: dict[str, str] = {"ws": regex_gbnf(whitespace) if whitespace else '""'}
        self._leaf_rules: dict[str, str] = {}
        self._ref_rules: dict[str, str] = {}
        self._open: list[str] = []  # refs whose rule is being written
        self._cyclic: set[str] = set()  # refs whose expansion can reach a ref being written: it can recurse
        self.cycles = 0  # references that can recurse, met so far: a walk that raised it can recurse
        self.free = False  # a free-form value was written

    def name(self, hint: str) -> str:
        base = re.sub(r"[^A-Za-z0-9_-]+", "-", hint).strip("-") or "r"
        name, i = base, 2
        while name in self.rules or name == "root":
            name, i = f"{base}-{i}", i + 1
        self.rules[name] = ""  # reserved
        return name

    def leaf(self, regex: str) -> str:
        rule = self._leaf_rules.get(regex)
        if rule is None:
            body = regex_gbnf(regex)
            if re.fullmatch(r'"(?:[^"\\]|\\.)*"', body):  # a plain literal: written where it is used
                return body
            rule = self._leaf_rules[regex] = self.name(_NAMED.get(regex, "leaf"))
            self.rules[rule] = body
        return rule

    @staticmethod
    def alt(parts: list[str]) -> str:
        uniq = list(dict.fromkeys(parts))
        return uniq[0] if len(uniq) == 1 else "(" + " | ".join(uniq) + ")"

    def any_value(self) -> str:
        self.free = True
        if "value" not in self.rules:
            self.rules["value"] = ""
            scalar = self.alt([self.leaf(JSON_STRING), self.leaf(JSON_NUMBER), self.leaf(JSON_BOOLEAN),
                               self.leaf(JSON_NULL)])
            self.rules["value"] = f"{scalar} | {self.object_of('value')} | {self.array_of('value')}"
        return "value"

    def ref(self, ref: str) -> str:
        rule = self._ref_rules.get(ref) if isinstance(ref, str) else None
        if rule is not None:
            if ref in self._open or ref in self._cyclic:
                self.cycles += 1
            return rule
        target = self.resolve(ref)
        rule = self._ref_rules[ref] = self.name("def-" + ref.rsplit("/", 1)[-1] if ref != "#" else "def-root")
        self._open.append(ref)
        before = self.cycles
        try:
            self.rules[rule] = self.gen(target)
        finally:
            self._open.pop()
        if self.cycles > before:
            self._cyclic.add(ref)
        return rule

    def object_of(self, value: str) -> str:
        pair = f'{self.leaf(JSON_STRING)} ws ":" ws {value}'
        return f'("{{" ws ({pair} (ws "," ws {pair})*)? ws "}}")'

    @staticmethod
    def array_of(value: str) -> str:
        return f'("[" ws ({value} (ws "," ws {value})*)? ws "]")'

    def object(self, schema: dict) -> str:
        kind, arg = self.object_shape(schema)
        if kind == "map":
            return self.object_of(self.any_value() if arg is None else self.gen(arg))
        if not arg:
            return '("{" ws "}")'
        members: list[tuple[str, bool]] = []  # (member, may be left out)
        for key, sub, required in arg:
            before = self.cycles
            member = f'{self.leaf(_string_literal(key))} ws ":" ws {self.gen(sub)}'
            members.append((member, not required and self.cycles > before))
        if any(omit for _, omit in members):  # each member is written more than once below: a rule each
            named = []
            for (member, omit), (key, _, _) in zip(members, arg):
                rule = self.name(f"member-{key}")
                self.rules[rule] = member
                named.append((rule, omit))
            members = named

        def tail(i: int) -> str:  # members i.. after one already written
            return " ".join(f'(ws "," ws {m})?' if omit else f'ws "," ws {m}' for m, omit in members[i:])

        heads = []  # the first member written is j: the ones before it left out
        for j, (member, omit) in enumerate(members):
            heads.append(f"{member} {tail(j + 1)}".rstrip())
            if not omit:
                break
        body = "(" + " | ".join(heads) + ") ws"
        if all(omit for _, omit in members):  # even the last: "{}" too
            body = f"({body})?"
        return f'("{{" ws {body} "}}")'

    def array(self, schema: dict) -> str:
        items, lo, hi = self.array_shape(schema)
        item = None if items is None else self.gen(items)
        if hi == 0:
            return '("[" ws "]")'
        if item is None:
            item = self.any_value()
        more = f'(ws "," ws {item})'
        low = max(lo - 1, 0)
        body = f"{item} {more}" + (f"{{{low},}}" if hi is None else f"{{{low},{hi - 1}}}")
        if lo == 0:
            body = f"({body})?"
        return f'("[" ws {body} ws "]")'

    def text(self) -> str:
        root = self.gen(self.root)
        lines = [f"root ::= {root}"] + [f"{name} ::= {body}" for name, body in self.rules.items()]
        return "\n".join(lines) + "\n"


def _load(schema: dict | str | bool) -> object:
    if isinstance(schema, str):
        try:
            return json.loads(schema)
        except json.JSONDecodeError as e:
            raise ValueError(f"guided_json: schema is not valid JSON: {e}") from e
    return schema




def json_schema_grammar(schema: dict | str | bool, *, whitespace: str = r"[ ]?") -> str:
    """A GBNF grammar (start rule ``root``) whose matches are JSON texts valid for ``schema`` (a dict, its JSON
    text, or a boolean schema), the same subset of JSON Schema as
    :func:`~infercore.engine.fsm.json_schema_regex` with recursive ``$ref`` and free values of any depth (see the
    module docstring). ``whitespace`` is a regex, allowed where the regex generator allows it: after ``{``/``[``,
    around ``:`` and ``,``, before ``}``/``]``. Raises ValueError naming ``guided_json`` for what is unsupported,
    and for a schema no finite document matches (a recursion that never ends)."""
    grammar = _JsonSchemaGrammar(_load(schema), whitespace).text()
    _check(grammar)
    return grammar


def json_schema_guide(schema: dict | str | bool, *, whitespace: str = r"[ ]?") -> tuple[str, str]:
    """The language ``guided_json`` decodes in: ``("regex", pattern)`` where :func:`json_schema_regex` expresses
    the schema (it neither recurses nor leaves a value free), else ``("grammar", gbnf)``
    (:func:`json_schema_grammar`). Raises ValueError naming ``guided_json``."""
    schema = _load(schema)
    g = _JsonSchemaGrammar(schema, whitespace)
    grammar = g.text()
    if not g.free and not g.cycles:
        return "regex", json_schema_regex(schema, whitespace=whitespace)
    _check(grammar)
    return "grammar", grammar


def _check(grammar: str) -> None:
    """Compile the grammar (cached for the guide), its refusals said in the schema's terms. (No left recursion can
    come from a schema: a rule refers to another first only as a whole alternative, a tail call; an object or
    array reads its bracket before it refers to anything.)"""
    from .grammar import compile_gbnf

    try:
        compile_gbnf(grammar)
    except ValueError as e:
        msg = str(e).removeprefix("guided_grammar: ")
        if "'root' matches no string" in msg:
            raise ValueError("guided_json: no finite JSON document matches the schema (a recursive $ref that "
                             "every instance must follow again, or a $ref that is only itself: make the recursion "
                             "optional, nullable or an array's items)") from None
        raise ValueError(f"guided_json: the schema's grammar is refused: {msg}") from None
