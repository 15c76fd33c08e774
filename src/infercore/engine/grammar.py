"""Context-free grammars (GBNF, llama.cpp's format) as character-level pushdown recognizers.

The building block of ``SamplingParams.guided_grammar``: a grammar is parsed and lowered once (:func:`compile_gbnf`,
cached per text) into flat rules whose alternatives are sequences of elements, each a character set or a
reference to a rule; a :class:`Grammar` then recognizes text one character at a time, llama.cpp's way. A
recognizer state is the set of every parse stack still possible: a stack is a tuple of element positions, the
innermost last (the character set the next character must match), each lower one the element its rule resumes at
once the rule above it ends. A rule's last reference pushes nothing to come back to (tail calls), so right
recursion such as ``list ::= item ("," list)?`` keeps stacks short. The empty stack ``()`` is a whole match.

A state is a ``frozenset`` of such tuples: canonical, hashable and picklable, so results per state (the next state
after a character, the tokens allowed) can be cached by it, and a request can carry its state to another engine.
Alternatives that can match no finite string are dropped when the grammar is compiled, so a non-empty stack can
always be completed: :meth:`Grammar.can_continue` is exact and an empty state (:data:`DEAD`) is the only dead one.

Grammar syntax (llama.cpp's GBNF): rules ``name ::= body``; ``root`` is the start rule; names are letters, digits,
``-`` and ``_``; a body is alternatives separated by ``|`` of sequences of items; a rule ends where the next
``name ::=`` begins. Items: string literals ``"..."``, character classes ``[a-z0-9_]`` and negated ones ``[^"\\]``,
``.`` (any character, newlines included), rule names, groups ``( ... )``, each optionally followed by ``*``, ``+``,
``?``, ``{m}``, ``{m,}``, ``{m,n}`` or ``{,n}``. Escapes in literals and classes: ``\\n \\r \\t \\\\ \\" \\' \\[
\\] \\- \\^ \\/``, ``\\xHH``, ``\\uHHHH``, ``\\UHHHHHHHH``. ``#`` starts a comment to the end of the line.

Limits: left recursion (a rule that can reach itself before reading a character, such as ``expr ::= expr "+"
term | term``) is refused with a ValueError; write it with a repetition (``expr ::= term ("+" term)*``). Bounded
repetitions are expanded by copying (at most :data:`MAX_ELEMENTS` elements in all). Token references
(``<[id]>``) of newer llama.cpp are not supported.
"""

from __future__ import annotations

import functools
from bisect import bisect_right
from dataclasses import dataclass

__all__ = ["DEAD", "MAX_ELEMENTS", "Grammar", "compile_gbnf"]

DEAD: frozenset = frozenset()
"""The state of a text that no continuation can make match."""

MAX_ELEMENTS = 100_000
"""Grammars with more elements than this once repetitions are expanded raise ValueError."""

MAX_CLOSURE = 10_000
"""Most stacks the expansion of one element may give (an element with more raises ValueError: too ambiguous)."""

_MAX_CHAR = 0x10FFFF
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
            return ("set", ((0, _MAX_CHAR),), False)
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
            if v > _MAX_CHAR:
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
        return ("set", _merge(ranges), negated)


def _merge(ranges: list[tuple[int, int]]) -> tuple[tuple[int, int], ...]:
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


def _nonempty(ranges: tuple, negated: bool) -> bool:
    if not negated:
        return bool(ranges)
    return _merge(list(ranges)) != ((0, _MAX_CHAR),)


# ---------------------------------------------------------------------------------------------------------------
# compiled tables
# ---------------------------------------------------------------------------------------------------------------

_CHAR, _REF, _END = 0, 1, 2


@dataclass(frozen=True)
class CompiledGrammar:
    """A grammar's flat, immutable tables (shared by every :class:`Grammar` of the same text).

    Positions index the elements of every alternative laid end to end, each alternative closed by an end marker;
    position 0 refers to ``root`` and position 1 ends it. ``push[p]``: the stack tops the element at ``p`` expands
    to before reading a character (tuples of positions, innermost last, each ending at a character set) and
    ``pops[p]``: whether it can also finish its rule without reading one.
    """

    text: str
    kind: tuple[int, ...]
    lit: tuple[str | None, ...]  # a one-character set's character (the common case: a dict lookup)
    los: tuple[tuple[int, ...], ...]  # a character set's range starts / ends, sorted, and whether it is negated
    his: tuple[tuple[int, ...], ...]
    neg: tuple[bool, ...]
    push: tuple[tuple[tuple[int, ...], ...], ...]
    pops: tuple[bool, ...]

    def matches(self, p: int, ch: str) -> bool:
        o = ord(ch)
        los = self.los[p]
        j = bisect_right(los, o) - 1
        return (j >= 0 and o <= self.his[p][j]) != self.neg[p]


@functools.lru_cache(maxsize=64)
def compile_gbnf(text: str) -> CompiledGrammar:
    """Parse and lower a GBNF grammar (see the module docstring). Raises ValueError naming ``guided_grammar`` (with
    the line and column where the text is at fault) on a syntax error, an undefined rule, no ``root`` rule, a root
    that matches no string, left recursion, or a grammar too large or too ambiguous."""
    if not isinstance(text, str):
        raise TypeError(f"guided_grammar must be a str, got {type(text).__name__}")
    parser = _Parser(text)
    rules = parser.parse()
    if "root" not in rules:
        raise ValueError(f"guided_grammar: no rule named 'root' (the start rule); rules: {sorted(rules)}")
    low = _Lowering(parser, rules)
    names, lowered = low.names, low.rules
    n_rules = len(lowered)

    # productive rules (matching some finite string); alternatives needing an unproductive one, or an empty
    # character set, are dropped
    def elem_ok(e: tuple, productive: list[bool]) -> bool:
        return productive[e[1]] if e[0] == "r" else _nonempty(e[1], e[2])

    productive = [False] * n_rules
    changed = True
    while changed:
        changed = False
        for r, alts in enumerate(lowered):
            if not productive[r] and any(all(elem_ok(e, productive) for e in alt) for alt in alts):
                productive[r] = changed = True
    root = low.index["root"]
    if not productive[root]:
        raise ValueError("guided_grammar: rule 'root' matches no string (each alternative needs a rule that never "
                         "ends, or an empty character class)")
    lowered = [[alt for alt in alts if all(elem_ok(e, productive) for e in alt)] for alts in lowered]

    # lay out the rules reachable from root
    reach, todo = {root}, [root]
    while todo:
        for alt in lowered[todo.pop()]:
            for e in alt:
                if e[0] == "r" and e[1] not in reach:
                    reach.add(e[1])
                    todo.append(e[1])
    kind, lit, los, his, neg, target, owner = [_REF, _END], [None, None], [(), ()], [(), ()], [False, False], \
        [root, -1], [root, root]
    starts: dict[int, list[int]] = {}
    for r in sorted(reach):
        starts[r] = []
        for alt in lowered[r]:
            starts[r].append(len(kind))
            for e in alt:
                owner.append(r)
                if e[0] == "r":
                    kind.append(_REF)
                    lit.append(None)
                    los.append(())
                    his.append(())
                    neg.append(False)
                    target.append(e[1])
                else:
                    ranges, negated = e[1], e[2]
                    kind.append(_CHAR)
                    single = not negated and len(ranges) == 1 and ranges[0][0] == ranges[0][1]
                    lit.append(chr(ranges[0][0]) if single else None)
                    los.append(tuple(lo for lo, _ in ranges))
                    his.append(tuple(hi for _, hi in ranges))
                    neg.append(negated)
                    target.append(-1)
            kind.append(_END)
            owner.append(r)
            lit.append(None)
            los.append(())
            his.append(())
            neg.append(False)
            target.append(-1)
    n = len(kind)

    nullable = [False] * n_rules
    changed = True
    while changed:
        changed = False
        for r in reach:
            if not nullable[r] and any(all(e[0] == "r" and nullable[e[1]] for e in alt) for alt in lowered[r]):
                nullable[r] = changed = True

    # Left recursion: expanding a reference leads (through alternatives' first elements, and past nullable ones)
    # back to itself with a resume position pushed in between, so its expansion would never end. Edges p -> q
    # where expanding p expands q; "frame" edges push p + 1. A cycle of frame-free edges is fine (a nullable
    # repetition, say): it only repeats the same expansions.
    edges: list[list[tuple[int, bool]]] = [[] for _ in range(n)]
    for p in range(n):
        if kind[p] == _REF:
            frame = kind[p + 1] != _END
            edges[p] = [(s, frame) for s in starts[target[p]]]
            if nullable[target[p]]:
                edges[p].append((p + 1, False))
    comp = _components(edges)
    for p in range(n):
        for q, frame in edges[p]:
            if frame and comp[p] == comp[q]:
                raise ValueError(
                    f"guided_grammar: rule {names[target[p]]!r} is left-recursive (it can reach itself before "
                    "reading a character), which is not supported: write the recursion on the right or as a "
                    "repetition, e.g. 'expr ::= term (\"+\" term)*'")

    # push / pops: a least fixed point over the expansion graph (a worklist; a change wakes what reads it)
    push: list[set[tuple[int, ...]]] = [set() for _ in range(n)]
    pops = [False] * n
    readers: list[list[int]] = [[] for _ in range(n)]
    for p in range(n):
        if kind[p] == _CHAR:
            push[p].add((p,))
        elif kind[p] == _END:
            pops[p] = True
        else:
            for s in starts[target[p]]:
                readers[s].append(p)
            readers[p + 1].append(p)
    work = [p for p in range(n) if kind[p] == _REF]
    queued = set(work)
    while work:
        p = work.pop()
        queued.discard(p)
        ret = (p + 1,) if kind[p + 1] != _END else ()
        new: set[tuple[int, ...]] = set()
        pop = False
        for s in starts[target[p]]:
            new.update(ret + t for t in push[s])
            if pops[s]:
                new |= push[p + 1]
                pop = pop or pops[p + 1]
        if len(new) > MAX_CLOSURE:
            raise ValueError(f"guided_grammar: rule {names[owner[p]]!r} is too ambiguous (one reference expands "
                             f"to more than {MAX_CLOSURE} parse stacks)")
        if new != push[p] or pop != pops[p]:
            push[p], pops[p] = new, pop
            for q in readers[p]:
                if q not in queued:
                    queued.add(q)
                    work.append(q)
    return CompiledGrammar(text, tuple(kind), tuple(lit), tuple(los), tuple(his), tuple(neg),
                           tuple(tuple(sorted(s)) for s in push), tuple(pops))


def _components(edges: list[list[tuple[int, bool]]]) -> list[int]:
    """Strongly connected component ids of a graph (Tarjan's, without recursion)."""
    n = len(edges)
    index, low, comp = [-1] * n, [0] * n, [-1] * n
    stack: list[int] = []
    on = [False] * n
    counter = ncomp = 0
    for root in range(n):
        if index[root] >= 0:
            continue
        work = [(root, 0)]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on[root] = True
        while work:
            v, i = work[-1]
            if i < len(edges[v]):
                work[-1] = (v, i + 1)
                w = edges[v][i][0]
                if index[w] < 0:
                    index[w] = low[w] = counter
                    counter += 1
                    stack.append(w)
                    on[w] = True
                    work.append((w, 0))
                elif on[w]:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                while True:
                    w = stack.pop()
                    on[w] = False
                    comp[w] = ncomp
                    if w == v:
                        break
                ncomp += 1
    return comp


# ---------------------------------------------------------------------------------------------------------------
# the recognizer
# ---------------------------------------------------------------------------------------------------------------

State = frozenset  # of tuple[int, ...]: parse stacks, innermost position last; () = a whole match


class Grammar:
    """A GBNF grammar's character-level recognizer: states are sets of parse stacks (module docstring).

    Transitions are computed on demand and cached per state, like a lazily built DFA; the cache holds at most
    ``max_states`` states and ``max_transitions`` transitions and is emptied when full (states stay valid: they
    are values, not ids).
    """

    def __init__(self, text: str, *, max_states: int = 20_000, max_transitions: int = 500_000) -> None:
        self.compiled = g = compile_gbnf(text)
        self.max_states, self.max_transitions = max_states, max_transitions
        # state -> [the canonical state object, {character: next state}, {character: stacks whose top is that
        # one-character set}, [(position, stack) for the other tops]]
        self._table: dict[State, list] = {}
        self._transitions = 0
        out: set[tuple[int, ...]] = set()
        _expand(g, (), 0, out)
        self.start: State = self._info(frozenset(out))[0]

    def _info(self, state: State) -> list:
        info = self._table.get(state)
        if info is None:
            if len(self._table) >= self.max_states:
                self._table.clear()
                self._transitions = 0
            lit, lits, others = self.compiled.lit, {}, []
            for stack in state:
                if stack:
                    c = lit[stack[-1]]
                    if c is not None:
                        lits.setdefault(c, []).append(stack)
                    else:
                        others.append((stack[-1], stack))
            info = self._table[state] = [state, {}, lits, others]
        return info

    def _compute(self, info: list, ch: str) -> State:
        g = self.compiled
        out: set[tuple[int, ...]] = set()
        for stack in info[2].get(ch, ()):
            _expand(g, stack[:-1], stack[-1] + 1, out)
        for p, stack in info[3]:
            if g.matches(p, ch):
                _expand(g, stack[:-1], p + 1, out)
        nxt = self._info(frozenset(out))[0] if out else DEAD
        self._transitions += 1
        if self._transitions > self.max_transitions:
            self._table.clear()
            self._transitions = 0
        info[1][ch] = nxt
        return nxt

    def step(self, state: State, ch: str) -> State:
        """The state after reading the single character ``ch``; :data:`DEAD` when no continuation can match."""
        if not state:
            return DEAD
        if len(ch) != 1:
            raise ValueError(f"step takes one character, got {ch!r}")
        info = self._info(state)
        nxt = info[1].get(ch)
        return self._compute(info, ch) if nxt is None else nxt

    def walk(self, state: State, s: str) -> State:
        """The state after reading ``s``; :data:`DEAD` as soon as a character leads there."""
        for ch in s:
            if not state:
                return DEAD
            info = self._info(state)
            nxt = info[1].get(ch)
            state = self._compute(info, ch) if nxt is None else nxt
        return state

    @staticmethod
    def accepting(state: State) -> bool:
        """Whether the text that led to ``state`` is a whole match of ``root``."""
        return () in state

    @staticmethod
    def can_continue(state: State) -> bool:
        """Whether some non-empty continuation still leads to a match. Exact: every stack left in a state can be
        completed (unproductive alternatives and empty character sets are dropped at compilation)."""
        return len(state) > (1 if () in state else 0)

    @staticmethod
    def dead(state: State) -> bool:
        """Whether no continuation of the text that led to ``state`` matches."""
        return not state

    def fullmatch(self, s: str) -> bool:
        """Whether ``s`` is a whole match of ``root``."""
        return self.accepting(self.walk(self.start, s))

    def resume(self, rest: tuple[int, ...]) -> State:
        """The state of the stack ``rest`` once the frames that were above it have all ended (``rest`` non-empty:
        its top is where its innermost frame resumes)."""
        out: set[tuple[int, ...]] = set()
        _expand(self.compiled, rest[:-1], rest[-1], out)
        return self._info(frozenset(out))[0] if out else DEAD

    def token_ids(self, state: State, node: tuple[dict, list[int]], exits: list | None = None,
                  max_exits: int | None = None) -> list[int] | None:
        """The ids of every token below ``node`` of a vocabulary's character trie (a node: ``(children by
        character, ids of the tokens ending there)``; ``node``'s own ids not included) whose text, read after the
        text that led to ``node``, leads from ``state`` to a live state. Pruned at dead prefixes; where a state's
        next character can only be one of a few literals, only those children are looked at. With ``exits``, the
        trie nodes below which the walk reached a state that can have ended (holds ``()``) and that have children
        are appended to it: for a state made of the top frames of longer stacks, where the frames below take over
        (None is returned once there are more than ``max_exits`` of them).
        """
        ids: list[int] = []
        if not self.can_continue(state):
            return ids
        todo = [(node, state)]
        while todo:
            (children, _), st = todo.pop()
            info = self._info(st)
            trans, lits = info[1], info[2]
            if not info[3] and len(lits) < len(children):
                items = [(ch, children[ch]) for ch in lits if ch in children]
            else:
                items = children.items()
            for ch, child in items:
                nxt = trans.get(ch)
                if nxt is None:
                    nxt = self._compute(info, ch)
                if not nxt:
                    continue
                ids.extend(child[1])
                if child[0]:
                    todo.append((child, nxt))
                    if exits is not None and () in nxt:
                        exits.append(child)
                        if max_exits is not None and len(exits) > max_exits:
                            return None
        return ids


def _expand(g: CompiledGrammar, rest: tuple[int, ...], q: int, out: set) -> None:
    """Add to ``out`` the stacks ``rest`` gives once its frame resumes at position ``q`` (each topped by a
    character set; ``()`` where everything can end)."""
    push, pops = g.push, g.pops
    while True:
        for t in push[q]:
            out.add(rest + t)
        if not pops[q]:
            return
        if not rest:
            out.add(())
            return
        q, rest = rest[-1], rest[:-1]
