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

The syntax is llama.cpp's GBNF (start rule ``root``), parsed and lowered in :mod:`infercore.engine.gbnf`.

Limits: left recursion (a rule that can reach itself before reading a character, such as ``expr ::= expr "+"
term | term``) is refused with a ValueError; write it with a repetition (``expr ::= term ("+" term)*``). Bounded
repetitions are expanded by copying (at most :data:`MAX_ELEMENTS` elements in all). Token references
(``<[id]>``) of newer llama.cpp are not supported.
"""

from __future__ import annotations

import functools
from bisect import bisect_right
from dataclasses import dataclass

from .gbnf import MAX_ELEMENTS, nonempty, parse_gbnf

__all__ = ["DEAD", "MAX_ELEMENTS", "Grammar", "compile_gbnf"]

DEAD: frozenset = frozenset()
"""The state of a text that no continuation can make match."""

MAX_CLOSURE = 10_000
"""Most stacks the expansion of one element may give (an element with more raises ValueError: too ambiguous)."""

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
    names, lowered, root = parse_gbnf(text)
    n_rules = len(lowered)

    # productive rules (matching some finite string); alternatives needing an unproductive one, or an empty
    # character set, are dropped
    def elem_ok(e: tuple, productive: list[bool]) -> bool:
        return productive[e[1]] if e[0] == "r" else nonempty(e[1], e[2])

    productive = [False] * n_rules
    changed = True
    while changed:
        changed = False
        for r, alts in enumerate(lowered):
            if not productive[r] and any(all(elem_ok(e, productive) for e in alt) for alt in alts):
                productive[r] = changed = True
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
