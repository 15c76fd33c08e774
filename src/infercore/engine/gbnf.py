"""GBNF (llama.cpp's grammar format) parsed and lowered to flat rules: the front end of
:mod:`infercore.engine.grammar`.

Syntax: rules ``name ::= body``; names are letters, digits, ``-`` and ``_``; a body is alternatives separated by
``|`` of sequences of items; a rule ends where the next ``name ::=`` begins (so an alternative may start on a new
line). Items: string literals ``"..."``, character classes ``[a-z0-9_]`` and negated ones ``[^"\\]`` (``-`` first
or last is itself), ``.`` (any character, newlines included), rule names, groups ``( ... )``, each optionally
followed by ``*``, ``+``, ``?``, ``{m}``, ``{m,}``, ``{m,n}`` or ``{,n}`` (several apply in turn). Escapes in
literals and classes: ``\\n \\r \\t \\\\ \\" \\' \\[ \\] \\- \\^ \\/``, ``\\xHH``, ``\\uHHHH``,
``\\UHHHHHHHH``. ``#`` starts a comment to the end of the line. Errors raise ValueError naming ``guided_grammar``
with the line and column.

Lowered form (:func:`parse_gbnf`): rule ``i`` is a list of alternatives, each a list of elements, either
``("c", ranges, negated)`` (one character in the sorted, merged inclusive code-point ``ranges``, or outside them)
or ``("r", j)`` (rule ``j``). Groups of several alternatives and repetitions become rules of their own, named
after the rule they appear in: ``x*`` is ``R ::= x R |`` (right recursion), ``x{m,n}`` is ``m`` copies of ``x``
and then ``n - m`` nested optional ones.
"""

from __future__ import annotations

__all__ = ["MAX_CHAR", "MAX_ELEMENTS", "merge_ranges", "nonempty", "parse_gbnf"]

MAX_ELEMENTS = 100_000
"""Grammars with more elements than this once repetitions are expanded raise ValueError."""

MAX_CHAR = 0x10FFFF
_NAME_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-_")
_ESCAPES = {"n": "\n", "r": "\r", "t": "\t", "\\": "\\", '"': '"', "'": "'", "[": "[", "]": "]", "-": "-",
            "^": "^", "/": "/"}
_HEX_LEN = {"x": 2, "u": 4, "U": 8}


# ---------------------------------------------------------------------------------------------------------------
# parsing: GBNF text -> {rule name: ("alt", [sequence, ...])}, a sequence a list of items:
#   ("str", text) | ("set", ranges, negated) | ("ref", name, offset) | ("alt", [sequence, ...])
#   | ("rep", item, min, max or None)
# ---------------------------------------------------------------------------------------------------------------


class _Parser:
    def __init__(self, text: str) -> None:
        self.s, self.i = text, 0

    def error(self, what: str, at: int | None = None) -> ValueError:
        at = self.i if at is None else at
        line = self.s.count("\n", 0, at) + 1
        col = at - (self.s.rfind("\n", 0, at) + 1) + 1
        return ValueError(f"guided_grammar: {what} at line {line}, column {col}")

    def peek(self) -> str | None:
        return self.s[self.i] if self.i < len(self.s) else None

    def ws(self) -> None:
        s, n = self.s, len(self.s)
        while self.i < n:
            c = s[self.i]
            if c in " \t\r\n":
                self.i += 1
            elif c == "#":
                j = s.find("\n", self.i)
                self.i = n if j < 0 else j + 1
            else:
                break

    def name(self) -> str:
        j = self.i
        while j < len(self.s) and self.s[j] in _NAME_CHARS:
            j += 1
        name, self.i = self.s[self.i:j], j
        return name

    def at_rule_start(self) -> bool:
        save = self.i
        ok = bool(self.name())
        if ok:
            self.ws()
            ok = self.s.startswith("::=", self.i)
        self.i = save
        return ok

    def parse(self) -> dict[str, tuple]:
        rules: dict[str, tuple] = {}
        self.ws()
        if self.i >= len(self.s):
            raise self.error("the grammar is empty")
        while self.i < len(self.s):
            start = self.i
            name = self.name()
            if not name:
                raise self.error(f"expected a rule name, got {self.peek()!r}")
            self.ws()
            if not self.s.startswith("::=", self.i):
                raise self.error(f"expected '::=' after the rule name {name!r}")
            if name in rules:
                raise self.error(f"rule {name!r} is defined twice", start)
            self.i += 3
            rules[name] = self.alternatives()
            self.ws()
            if self.i < len(self.s) and not self.at_rule_start():
                raise self.error(f"unexpected {self.peek()!r}")
        return rules

    def alternatives(self) -> tuple:
        alts = [self.sequence()]
        while self.peek() == "|":
            self.i += 1
            alts.append(self.sequence())
        return ("alt", alts)

    def sequence(self) -> list:
        items: list = []
        while True:
            self.ws()
            c = self.peek()
            if c is None or c in "|)" or (c in _NAME_CHARS and self.at_rule_start()):
                return items
            item = self.atom()
            while True:  # postfix operators, each applying to what is before it
                save = self.i
                self.ws()
                c = self.peek()
                if c == "*":
                    item, self.i = ("rep", item, 0, None), self.i + 1
                elif c == "+":
                    item, self.i = ("rep", item, 1, None), self.i + 1
                elif c == "?":
                    item, self.i = ("rep", item, 0, 1), self.i + 1
                elif c == "{":
                    item = ("rep", item, *self.bounds())
                else:
                    self.i = save
                    break
            items.append(item)

    def bounds(self) -> tuple[int, int | None]:
        start = self.i
        self.i += 1

        def number() -> int | None:
            self.ws()
            j = self.i
            while self.i < len(self.s) and self.s[self.i].isascii() and self.s[self.i].isdigit():
                self.i += 1
            if j == self.i:
                return None
            v = int(self.s[j:self.i])
            if v > MAX_ELEMENTS:
                raise self.error(f"repetition count {v} is too large (at most {MAX_ELEMENTS})", j)
            return v

        lo = number()
        self.ws()
        if self.peek() == ",":
            self.i += 1
            hi = number()
        elif lo is None:
            raise self.error("expected a repetition count", self.i)
        else:
            hi = lo
        self.ws()
        if self.peek() != "}":
            raise self.error("expected '}' closing the repetition", self.i)
        self.i += 1
        lo = lo or 0
        if hi is not None and hi < lo:
            raise self.error(f"repetition {{{lo},{hi}}} has its maximum below its minimum", start)
        return lo, hi

    def atom(self) -> tuple:
        c, start = self.peek(), self.i
        if c == '"':
            self.i += 1
            chars = []
            while True:
                c = self.peek()
                if c is None:
                    raise self.error("unterminated string literal", start)
                if c == '"':
                    self.i += 1
                    return ("str", "".join(chars))
                chars.append(self.char())
        if c == "[":
            return self.char_class()
        if c == ".":
            self.i += 1
            return ("set", ((0, MAX_CHAR),), False)
        if c == "(":
            self.i += 1
            group = self.alternatives()
            self.ws()
            if self.peek() != ")":
                raise self.error("unclosed '('", start)
            self.i += 1
            return group
        if c in _NAME_CHARS:
            return ("ref", self.name(), start)
        raise self.error(f"unexpected {c!r}")

    def char(self) -> str:
        """One character of a literal or class, escapes decoded."""
        c = self.s[self.i]
        if c != "\\":
            self.i += 1
            return c
        at = self.i
        e = self.s[self.i + 1] if self.i + 1 < len(self.s) else ""
        if e in _ESCAPES:
            self.i += 2
            return _ESCAPES[e]
        if e in _HEX_LEN:
            digits = self.s[self.i + 2:self.i + 2 + _HEX_LEN[e]]
            if len(digits) != _HEX_LEN[e] or not all(d in "0123456789abcdefABCDEF" for d in digits):
                raise self.error(f"'\\{e}' needs {_HEX_LEN[e]} hex digits", at)
            v = int(digits, 16)
            if v > MAX_CHAR:
                raise self.error(f"'\\{e}{digits}' is past the last Unicode code point", at)
            self.i += 2 + len(digits)
            return chr(v)
        raise self.error(f"unknown escape '\\{e}'", at)

    def char_class(self) -> tuple:
        start = self.i
        self.i += 1
        negated = self.peek() == "^"
        if negated:
            self.i += 1
        ranges = []
        while True:
            c = self.peek()
            if c is None:
                raise self.error("unterminated character class", start)
            if c == "]":
                self.i += 1
                break
            at = self.i
            lo = self.char()
            hi = lo
            if self.peek() == "-" and self.i + 1 < len(self.s) and self.s[self.i + 1] != "]":
                self.i += 1
                hi = self.char()
                if ord(hi) < ord(lo):
                    raise self.error(f"character range {lo!r}-{hi!r} is reversed", at)
            ranges.append((ord(lo), ord(hi)))
        if not ranges:
            raise self.error("empty character class", start)
        return ("set", merge_ranges(ranges), negated)


def merge_ranges(ranges: list[tuple[int, int]]) -> tuple[tuple[int, int], ...]:
    out: list[list[int]] = []
    for lo, hi in sorted(ranges):
        if out and lo <= out[-1][1] + 1:
            out[-1][1] = max(out[-1][1], hi)
        else:
            out.append([lo, hi])
    return tuple((lo, hi) for lo, hi in out)


# ---------------------------------------------------------------------------------------------------------------
# lowering: nested items -> flat rules of ("c", ranges, negated) / ("r", rule) elements
# ---------------------------------------------------------------------------------------------------------------


class _Lowering:
    def __init__(self, parser: _Parser, rules: dict[str, tuple]) -> None:
        self.parser = parser
        self.index = {name: i for i, name in enumerate(rules)}
        self.names: list[str] = list(rules)  # a generated rule (group, repetition) is named after its owner
        self.rules: list[list[list[tuple]]] = [[] for _ in rules]
        self.size = 0
        for name, body in rules.items():
            self.rules[self.index[name]] = self.alts(body, name)

    def new_rule(self, alts: list[list[tuple]], owner: str) -> tuple:
        self.names.append(owner)
        self.rules.append(alts)
        return ("r", len(self.rules) - 1)

    def grow(self, n: int) -> None:
        self.size += n
        if self.size > MAX_ELEMENTS:
            raise ValueError(f"guided_grammar: the grammar has more than {MAX_ELEMENTS} elements once its "
                             "repetitions are expanded")

    def alts(self, body: tuple, owner: str) -> list[list[tuple]]:
        return [self.seq(items, owner) for items in body[1]]

    def seq(self, items: list, owner: str) -> list[tuple]:
        out: list[tuple] = []
        for item in items:
            out.extend(self.item(item, owner))
        self.grow(len(out) + 1)
        return out

    def item(self, item: tuple, owner: str) -> list[tuple]:
        kind = item[0]
        if kind == "str":
            return [("c", ((ord(ch), ord(ch)),), False) for ch in item[1]]
        if kind == "set":
            return [("c", item[1], item[2])]
        if kind == "ref":
            if item[1] not in self.index:
                raise self.parser.error(f"undefined rule {item[1]!r}", item[2])
            return [("r", self.index[item[1]])]
        if kind == "alt":
            if len(item[1]) == 1:
                return self.seq(item[1][0], owner)
            return [self.new_rule(self.alts(item, owner), owner)]
        _, inner, lo, hi = item
        one = self.item(inner, owner)
        if len(one) != 1:  # a repeated literal or sequence: one rule to refer to
            one = [self.new_rule([one], owner)]
        self.grow(lo + (1 if hi is None else hi - lo))
        out = one * lo
        if hi is None:  # R ::= x R | (empty)
            r = len(self.rules)
            out.append(self.new_rule([one + [("r", r)], []], owner))
        elif hi > lo:  # x? nested hi - lo deep: R1 ::= x | (empty), Rk ::= x R(k-1) | (empty)
            prev: list[tuple] = []
            for _ in range(hi - lo):
                prev = [self.new_rule([one + prev, []], owner)]
            out.extend(prev)
        return out


def nonempty(ranges: tuple, negated: bool) -> bool:
    """Whether a character set matches some character."""
    if not negated:
        return bool(ranges)
    return merge_ranges(list(ranges)) != ((0, MAX_CHAR),)


def parse_gbnf(text: str) -> tuple[list[str], list[list[list[tuple]]], int]:
    """The grammar ``text`` lowered: (each rule's name, the rules, the index of ``root``). Raises ValueError naming
    ``guided_grammar`` on a syntax error, an undefined rule, no ``root`` or more than :data:`MAX_ELEMENTS`
    elements."""
    parser = _Parser(text)
    rules = parser.parse()
    if "root" not in rules:
        raise ValueError(f"guided_grammar: no rule named 'root' (the start rule); rules: {sorted(rules)}")
    low = _Lowering(parser, rules)
    return low.names, low.rules, low.index["root"]
