"""Grammar-guided decoding (``SamplingParams.guided_grammar``, GBNF): the parser and its errors, the pushdown
recognizer against Python's ``re`` / the regex DFA on regular grammars and against independent checkers (a depth
counter, ``json``, Python's ``ast``) on context-free ones, the token guide against brute force and against the regex
guide, and generation through the engine on the real SmolLM2 weights."""

import ast
import itertools
import json
import pickle
import re

import pytest
import torch

from infercore import Engine, SamplingParams
from infercore.engine.fsm import DEAD as DFA_DEAD
from infercore.engine.fsm import CharDFA
from infercore.engine.grammar import DEAD, Grammar
from infercore.engine.guided import GrammarGuide, TokenGuide, vocab_strings, vocab_trie

PARENS = 'root ::= p*\np ::= "(" p* ")"'
ARRAYS = r"""
root ::= arr
arr  ::= "[" ( val ( "," val )* )? "]"
val  ::= arr | num
num  ::= "0" | [1-9] [0-9]*   # JSON's integers: no leading zero
"""
ARITH = """
root   ::= expr
expr   ::= term (("+" | "-") term)*
term   ::= factor (("*" | "/") factor)*
factor ::= [0-9]+ | "(" expr ")"
"""
# JSON text (RFC 8259 values, the whitespace limited to spaces and newlines), written the llama.cpp way
JSON = r"""
root   ::= ws value ws
value  ::= object | array | string | number | "true" | "false" | "null"
object ::= "{" ws ( member ( ws "," ws member )* ws )? "}"
member ::= string ws ":" ws value
array  ::= "[" ws ( value ( ws "," ws value )* ws )? "]"
string ::= "\"" ( [^"\\\x00-\x1F] | "\\" ( ["\\/bfnrt] | "u" [0-9a-fA-F]{4} ) )* "\""
number ::= "-"? ( "0" | [1-9] [0-9]* ) ( "." [0-9]+ )? ( [eE] [-+]? [0-9]+ )?
ws     ::= | [ \n]+
"""


def strings_over(alphabet: str, max_len: int):
    for n in range(max_len + 1):
        for t in itertools.product(alphabet, repeat=n):
            yield "".join(t)


# ------------------------------------------------------------------------------------------------ the parser


@pytest.mark.parametrize("grammar, good, bad", [
    ('root ::= "a" "b" | "c"', ["ab", "c"], ["", "a", "abc", "b"]),
    # a rule may continue on the next lines, '|' leading; comments; rules used before they are defined
    ('# a comment\nroot ::= x # trailing\n  | "z"\nx ::= "y"', ["y", "z"], ["", "yz", "#"]),
    ('root ::= [a-c0-9_] [^a-z]', ["a0", "_Z", "9-"], ["ab", "x0", "a"]),
    ('root ::= [-+] [a-]', ["-a", "+-"], ["a-", "--x"]),  # '-' first or last in a class is itself
    ('root ::= "a"{2} "b"{1,} "c"{1,2} "d"{,1}', ["aabc", "aabbbccd"], ["abc", "aacc", "aabccc", "aabcdd"]),
    ('root ::= ("x" | "y")+ "."?', ["x", "yxy.", "y."], ["", ".", "x.."]),
    ('root ::= "a" ( "b" ( "c" )* )? ', ["a", "ab", "abccc"], ["ac", "abcb"]),
    (r'root ::= "\n\t\\\"" [\]\[] "\x41\u00e9\U0001F600" [\^]', ['\n\t\\"]Aé\U0001f600^', '\n\t\\"[Aé\U0001f600^'],
     ['\n\t\\"]Ae\U0001f600^']),
    ('root ::= . .', ["ab", "\n\U0010ffff"], ["a", "abc"]),
    ('root ::= ws "x" ws\nws ::= | " " ws', ["x", "  x ", " x"], ["", " "]),  # an empty alternative
    ('root ::= a-b_2\na-b_2 ::= ""', [""], ["a"]),  # names take '-' and '_'; "" is the empty string
    ('root ::= x\nx ::= "a" x | "b"\ny ::= y "q"', ["b", "aab"], ["a"]),  # unused left recursion is not looked at
    ('root ::= ("a"?)* "b"', ["b", "aab"], ["a", "ba"]),  # a repeated item that can be empty
    ('root ::= a\na ::= b a | "c"\nb ::= "x"?', ["c", "xxc"], ["x"]),  # a tail call through an empty prefix
    ('root ::= "a" | x\nx ::= "b" x', ["a"], ["b", "bb"]),  # an alternative that never ends is dropped
])
def test_grammars_parse_and_match(good, bad, grammar):
    g = Grammar(grammar)
    for s in good:
        assert g.fullmatch(s), s
    for s in bad:
        assert not g.fullmatch(s), s


@pytest.mark.parametrize("grammar, message", [
    ("", "empty"),
    ("# only a comment\n", "empty"),
    ('x ::= "a"', "no rule named 'root'"),
    ('root ::= "a" b', "undefined rule 'b' at line 1, column 14"),
    ('root ::= "a"\nroot ::= "b"', "defined twice at line 2, column 1"),
    ('root ::= "abc', "unterminated string literal at line 1, column 10"),
    ('root ::= ("a" | "b"', r"unclosed '\(' at line 1, column 10"),
    ('root ::= "a")', r"unexpected '\)' at line 1, column 13"),
    ('root = "a"', "expected '::='"),
    ('::= "a"', "expected a rule name"),
    ('root ::= "a" !', "unexpected '!' at line 1, column 14"),
    (r'root ::= "\q"', r"unknown escape '\\q' at line 1, column 11"),
    (r'root ::= "\u12G4"', "needs 4 hex digits"),
    (r'root ::= "\UFFFFFFFF"', "past the last Unicode code point"),
    ("root ::=\n  [z-a]", "range 'z'-'a' is reversed at line 2, column 4"),
    ("root ::= []", "empty character class"),
    ("root ::= [abc", "unterminated character class"),
    ('root ::= "a"{3,1}', "maximum below its minimum"),
    ('root ::= "a"{2', "expected '}'"),
    ('root ::= "a"{}', "expected a repetition count"),
    ('root ::= "a"{99999999}', "too large"),
    ('root ::= "a"{60000} "b"{60000}', "elements"),
    ('root ::= x\nx ::= "a" x', "matches no string"),
    ('root ::= [^\\x00-\\U0010FFFF]', "matches no string"),
    ('root ::= root "a" | "b"', "rule 'root' is left-recursive"),
    ('root ::= e\ne ::= t "+" e | t\nt ::= f | e "*" f\nf ::= "1"', "rule 'e' is left-recursive|rule 't'"),
    ('root ::= a\na ::= b a "x" | "c"\nb ::= "y"?', "rule 'a' is left-recursive"),  # through an empty prefix
])
def test_bad_grammars(grammar, message):
    with pytest.raises(ValueError, match=f"guided_grammar: .*(?:{message})"):
        Grammar(grammar)
    with pytest.raises(ValueError, match="guided_grammar"):  # "" included: SamplingParams wants a non-empty one
        SamplingParams(guided_grammar=grammar)


def test_bad_grammar_params():
    with pytest.raises(TypeError, match="guided_grammar"):
        SamplingParams(guided_grammar=5)
    with pytest.raises(ValueError, match="at most one.*guided_grammar"):
        SamplingParams(guided_regex="a", guided_grammar='root ::= "a"')
    with pytest.raises(ValueError, match="guided decoding exclude"):
        SamplingParams(allowed_token_ids=[1], guided_grammar='root ::= "a"')
    p = SamplingParams(guided_grammar='root ::= "a"')
    assert p.guided and p.processes_logits and p.reads_history and p.guided_pattern() is None
    p.guided_grammar = 'root ::= "a" b'  # changed after construction: validate() refuses it again
    with pytest.raises(ValueError, match="undefined rule 'b'"):
        p.validate()


# ------------------------------------------------------------------------------------------------ the recognizer


@pytest.mark.parametrize("grammar, regex", [
    ('root ::= ("ab" | "a")* "b"?', r"(ab|a)*b?"),
    ('root ::= [ab]{1,3} ("c" [ab]?)+', r"[ab]{1,3}(c[ab]?)+"),
    ('root ::= x "c" x\nx ::= "a" x | "b" | ""', r"a*(b)?ca*(b)?"),
    ('root ::= ([^c] "c"?){2,}', r"([^c]c?){2,}"),
])
def test_regular_grammars_agree_with_re(grammar, regex):
    """Every string over a small alphabet: a whole match exactly where ``re.fullmatch`` says so, and dead exactly
    where the regex's DFA is (no continuation can match)."""
    g, dfa = Grammar(grammar), CharDFA(regex)
    for s in strings_over("abcd", 6):
        state = g.walk(g.start, s)
        assert g.accepting(state) == bool(re.fullmatch(regex, s)), s
        assert g.dead(state) == (dfa.walk(dfa.start, s) == DFA_DEAD), s
        assert g.can_continue(state) == dfa.can_continue(dfa.walk(dfa.start, s)), s


def test_balanced_parentheses():
    g = Grammar(PARENS)
    for s in strings_over("()", 12):
        depths = list(itertools.accumulate(1 if c == "(" else -1 for c in s))
        state = g.walk(g.start, s)
        assert g.accepting(state) == (not depths or (min(depths) >= 0 and depths[-1] == 0)), s
        assert g.dead(state) == (bool(depths) and min(depths) < 0), s  # an open prefix can always be closed
    assert not g.fullmatch("(" * 200 + ")" * 199) and g.fullmatch("(" * 200 + ")" * 200)
    assert g.walk(g.start, "x") is DEAD and g.walk(DEAD, "(") is DEAD


def test_nested_arrays():
    g = Grammar(ARRAYS)
    for s in ["[]", "[0]", "[[],[1,[20]],305]", "[[[[[[]]]]]]"]:
        assert g.fullmatch(s), s
    for s in ["", "[", "[01]", "[1,]", "[,1]", "[[]", "[]]", "[1 ]", "1"]:
        assert not g.fullmatch(s), s

    def is_array(s: str) -> bool:
        try:
            v = json.loads(s)
        except ValueError:
            return False

        def ok(x):
            return isinstance(x, list) and all(ok(y) or (type(y) is int and y >= 0) for y in x)
        return ok(v)

    for s in strings_over("[]0,1", 7):
        assert g.fullmatch(s) == is_array(s), s
        if g.fullmatch(s):  # every prefix of a match is live
            assert not any(g.dead(g.walk(g.start, s[:i])) for i in range(len(s)))


def test_arithmetic_expressions():
    g = Grammar(ARITH)
    for s in ["1", "12+3*(4-5)/6", "((7))", "(1+2)*(3+(4*5))"]:
        assert g.fullmatch(s), s
    for s in ["", "+1", "1+", "(1", "1)", "()", "1**2", "(1)(2)"]:
        assert not g.fullmatch(s), s
    assert not g.dead(g.walk(g.start, "((1+")) and g.dead(g.walk(g.start, "(1+)"))

    def is_expr(s: str) -> bool:  # Python's parser, on the operators and literals of the grammar alone
        try:
            tree = ast.parse(s, mode="eval")
        except SyntaxError:
            return False
        allowed = (ast.Expression, ast.BinOp, ast.Add, ast.Sub, ast.Mult, ast.Div, ast.Constant)
        return all(isinstance(n, allowed) for n in ast.walk(tree))

    for s in strings_over("1+*()", 7):
        assert g.fullmatch(s) == is_expr(s), s


def test_json_grammar():
    g = Grammar(JSON)
    value = {"a": [1, -2.5e3, True, None, {"b": "x\"y\\z\n\u00e9"}], "": [], "c": {}}
    for text in (json.dumps(value), json.dumps(value, indent=2), json.dumps(value, ensure_ascii=False)):
        assert g.fullmatch(text), text
        assert not g.fullmatch(text[:-1]) and not g.dead(g.walk(g.start, text[:-1]))
    for bad in ['{"a" 1}', "[1,]", "01", '"\x01"', "{'a': 1}", "tru"]:
        assert not g.fullmatch(bad), bad


def test_states_are_canonical_and_cached():
    g = Grammar(ARITH, max_states=50, max_transitions=200)
    a, b = g.walk(g.start, "(1+2)*"), g.walk(g.start, "(3)/")
    assert a == b and hash(a) == hash(b)  # the same parse stacks after different texts
    assert pickle.loads(pickle.dumps(a)) == a
    for s in strings_over("1+(", 6):  # far past the cache's bounds: emptied and refilled, same answers
        g.walk(g.start, s)
    assert len(g._table) <= 50 and g.walk(g.start, "(1+2)*") == a and g.fullmatch("((1)*2)")


try:
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st
except ImportError:  # pragma: no cover - hypothesis is in the test environment
    given = None

if given is not None:
    # a random regular expression over "abc", written both as a regex and as a GBNF body
    _LEAF = st.sampled_from([("a", '"a"'), ("b", '"b"'), ("[ab]", "[ab]"), ("[^a]", "[^a]"), ("(?:)", '""')])

    def _combine(children):
        def seq(xs):
            return ("".join(f"(?:{r})" for r, _ in xs), " ".join(f"({g})" for _, g in xs))

        def alt(xs):
            return ("|".join(f"(?:{r})" for r, _ in xs), " | ".join(f"({g})" for _, g in xs))

        def rep(x, op):
            return (f"(?:{x[0]}){op}", f"({x[1]}){op}")

        return st.one_of(
            st.lists(children, min_size=2, max_size=3).map(seq),
            st.lists(children, min_size=2, max_size=3).map(alt),
            st.tuples(children, st.sampled_from(["*", "+", "?", "{2}", "{1,2}", "{0,}"])).map(lambda t: rep(*t)),
        )

    _REGEX = st.recursive(_LEAF, _combine, max_leaves=8)

    @settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
    @given(_REGEX, st.lists(st.text("abc", max_size=8), min_size=1, max_size=20))
    def test_random_regular_grammars_agree_with_re(pair, texts):
        regex, body = pair
        g, dfa = Grammar(f"root ::= {body}"), CharDFA(regex)
        for s in texts:
            state = g.walk(g.start, s)
            assert g.accepting(state) == bool(re.fullmatch(regex, s)), (regex, body, s)
            assert g.dead(state) == (dfa.walk(dfa.start, s) == DFA_DEAD), (regex, body, s)

    _JSON = st.recursive(
        st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | st.text(),
        lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=5), inner, max_size=4),
        max_leaves=12)

    @settings(max_examples=100, deadline=None, suppress_health_check=list(HealthCheck))
    @given(_JSON, st.sampled_from([None, 1, 2]), st.booleans())
    def test_random_json_texts_match(value, indent, ascii_only):
        g = Grammar(JSON)
        text = json.dumps(value, indent=indent, ensure_ascii=ascii_only)
        assert g.fullmatch(text), text
        for i in range(len(text)):  # every prefix is live
            assert not g.dead(g.walk(g.start, text[:i])), text[:i]

    @settings(max_examples=200, deadline=None, suppress_health_check=list(HealthCheck))
    @given(st.text("()", max_size=40))
    def test_random_parentheses(s):
        g = Grammar(PARENS)
        depth, low = 0, 0
        for c in s:
            depth += 1 if c == "(" else -1
            low = min(low, depth)
        assert g.fullmatch(s) == (low == 0 and depth == 0)
        assert g.dead(g.walk(g.start, s)) == (low < 0)


# ------------------------------------------------------------------------------------------------ the token guide


@pytest.mark.parametrize("top_frames, max_exits", [(3, 256), (1, 10**9), (1, 0), (2, 2), (10**6, 0)])
def test_toy_vocabulary_masks(top_frames, max_exits):
    """The tokens allowed after each state are those whose text keeps the output live (brute force), whatever the
    number of top frames walked alone (every token ending them, none, more frames taken)."""
    eos = 15
    for grammar, strings, alphabet in [
        (PARENS, ["(", ")", "()", "((", "))", "x", None, "(x", ")("], "()"),
        (ARITH, ["1", "2", "+", "(", ")", "1+", ")*", "((", "12", "+(", "x", None, "1)", "))", ")+("], "1+*()"),
    ]:
        guide = GrammarGuide(grammar, strings, [eos], top_frames=top_frames, max_exits=max_exits)
        g = guide.grammar
        seen = set()
        for text in strings_over(alphabet, 5):
            state = g.walk(g.start, text)
            if g.dead(state) or state in seen:
                continue
            seen.add(state)
            want = [i for i, s in enumerate(strings) if s is not None and not g.dead(g.walk(state, s))]
            if g.accepting(state) or not want:
                want.append(eos)
            assert guide.allowed(state) == want, (grammar, text)
        assert len(seen) > 5


def test_toy_vocabulary_guide():
    strings = ["(", ")", "()", "((", "))", "x", None, "(x", ")("]
    eos = 9
    guide = GrammarGuide(PARENS, strings, [eos])
    s2 = guide.advance(guide.start, [3])  # "((": eos not allowed until closed
    assert guide.allowed(s2) == [0, 1, 2, 3, 4, 8]
    assert guide.advance(guide.start, [1]) == DEAD and guide.allowed(DEAD) == [eos]  # ")" leaves the language
    assert guide.advance(guide.start, [0, 6]) == DEAD  # a token with no text
    assert guide.advance(guide.start, [2, eos]) == guide.start  # end-of-sequence adds nothing
    logits = torch.zeros(2, 12)
    guide.mask_(logits, 1, s2)
    assert torch.isinf(logits[1]).sum() == 6 and not torch.isinf(logits[0]).any()
    assert (logits[1, [0, 1, 2, 3, 4, 8]] == 0).all()
    # a grammar whose next character no token spells: end-of-sequence alone
    z = GrammarGuide('root ::= "(" "z"', strings, [eos])
    assert z.allowed(z.advance(z.start, [0])) == [eos] and z.allowed(z.start) == [0]


@pytest.fixture(scope="module")
def engine():
    return Engine.from_pretrained(device="cpu", dtype=torch.float32, max_num_batched_tokens=128)


def test_real_vocabulary_masks(engine):
    """Over SmolLM2's whole vocabulary: a regular grammar allows exactly the tokens its regex does, and a nested
    JSON text's states allow the same tokens whether each is walked whole or by the top frames of its stacks."""
    strings = vocab_strings(engine.tokenizer, engine.vocab_size)
    trie = vocab_trie(strings)
    gg = GrammarGuide(r'''root ::= "{\"a\": " str ", \"b\": [" ( num ( "," num )* )? "]}"
str ::= "\"" [^"\\]* "\""
num ::= "-"? [0-9]+''', strings, engine._eos, trie=trie)
    tg = TokenGuide(r'\{"a": "[^"\\]*", "b": \[(-?[0-9]+(,-?[0-9]+)*)?\]\}', strings, engine._eos, trie=trie)
    sizes = []
    for text in ['', '{"a": ', '{"a": "', '{"a": "hi th', '{"a": "x", "b": [', '{"a": "x", "b": [12,-3',
                 '{"a": "x", "b": []}']:
        ids = engine.tokenizer.encode(text, add_special_tokens=False)
        want = tg.allowed(tg.advance(tg.start, ids))
        assert gg.allowed(gg.advance(gg.start, ids)) == want, text
        sizes.append(len(want))
    assert min(sizes) == 1 and max(sizes) > 40_000  # from end-of-sequence alone to inside a string

    text = '{"a": ["b", {"c": [1, "d"]}], "e": 3}'
    ids = engine.tokenizer.encode(text, add_special_tokens=False)
    guides = [GrammarGuide(JSON, strings, engine._eos, trie=trie, **kw)
              for kw in (dict(top_frames=10**6), dict(), dict(top_frames=1, max_exits=10**9))]
    states = [g.start for g in guides]
    for n in range(len(ids) + 1):
        want = guides[0].allowed(states[0])
        assert len(want) > 1 or n == len(ids)
        for g, st in zip(guides[1:], states[1:]):
            assert g.allowed(st) == want, engine.tokenizer.decode(ids[:n])
        states = [g.advance(st, ids[n:n + 1]) for g, st in zip(guides, states)]
    assert guides[0].grammar.accepting(states[0])


# ------------------------------------------------------------------------------------------------ the engine


def _check(guide_grammar: Grammar, out, eos) -> None:
    """The output is a live prefix of the grammar's language, a whole match where it stopped, and ends with
    end-of-sequence only there."""
    state = guide_grammar.walk(guide_grammar.start, out.text)
    assert not guide_grammar.dead(state), out.text
    assert all(t not in eos for t in out.token_ids[:-1])
    if out.finish_reason == "stop":
        assert guide_grammar.accepting(state) and out.token_ids[-1] in eos, out.text
    else:
        assert out.finish_reason == "length" and out.token_ids[-1] not in eos


def test_generate(engine):
    arrays = ARRAYS.replace("[1-9] [0-9]*", "[1-9]")  # one digit a number: more structure within the budget
    obj = JSON.replace("root   ::= ws value ws", "root   ::= object")
    cases = [  # grammar, prompt, sampling, an independent check of a finished text
        (PARENS, "Balanced parentheses:", dict(temperature=1.0, seed=1), lambda s: s.count("(") == s.count(")")),
        (PARENS, "Write a short string of balanced parentheses.", dict(temperature=0),  # runs to the length limit
         lambda s: s.count("(") == s.count(")")),
        (arrays, "Write a 2x2 matrix as a JSON array of arrays.", dict(temperature=0),
         lambda s: all(isinstance(row, list) for row in json.loads(s))),
        (arrays, "Write a 3x3 identity matrix as a JSON array of arrays.", dict(temperature=0),
         lambda s: isinstance(json.loads(s), list)),
        (ARITH, "Write an arithmetic expression with parentheses, like (1+2)*3.", dict(temperature=0),
         lambda s: "(" in s and ast.parse(s, mode="eval") is not None),
        (obj, "Describe a cat as a JSON object.", dict(temperature=0), lambda s: isinstance(json.loads(s), dict)),
        ('root ::= "(" [0-9]{3} ") " [0-9]{3} "-" [0-9]{4}', "Give me a phone number.", dict(temperature=0),
         lambda s: re.fullmatch(r"\(\d{3}\) \d{3}-\d{4}", s)),
    ]
    params = [SamplingParams(max_tokens=48, guided_grammar=g, **kw) for g, _, kw, _ in cases]
    prompts = [p for _, p, _, _ in cases]
    outs = engine.generate(prompts + ["What is the capital of France?"],
                           params + [SamplingParams(temperature=0, max_tokens=8)], chat=True)
    stopped = 0
    for (g, _, _, ok), out in zip(cases, outs):
        _check(Grammar(g), out, engine._eos)
        if out.finish_reason == "stop":
            stopped += 1
            assert ok(out.text), out.text
    assert stopped >= 4 and outs[6].finish_reason == "stop"  # the phone number cannot go on
    # the unguided request in the batch is untouched by its neighbours' masks
    alone = engine.generate(["What is the capital of France?"], SamplingParams(temperature=0, max_tokens=8),
                            chat=True)[0]
    assert outs[-1].token_ids == alone.token_ids


def test_same_tokens_as_the_equivalent_regex(engine):
    """A regular grammar masks exactly as its regex does: the same tokens, greedy and sampled with a seed."""
    grammar = 'root ::= ("yes" | "no" | "maybe") ("," " "? [a-z]+){0,3} "."'
    regex = r"(yes|no|maybe)(, ?[a-z]+){0,3}\."
    prompt = "Is the sea salty? Answer, then give up to three reasons."
    for kw in (dict(temperature=0), dict(temperature=1.0, seed=11)):
        a, b = engine.generate([prompt] * 2, [SamplingParams(max_tokens=24, guided_grammar=grammar, **kw),
                                              SamplingParams(max_tokens=24, guided_regex=regex, **kw)], chat=True)
        assert a.token_ids == b.token_ids and a.finish_reason == b.finish_reason
        _check(Grammar(grammar), a, engine._eos)


def test_stream_and_moving_engines(engine):
    sp = SamplingParams(temperature=0, max_tokens=40, guided_grammar=ARITH)
    prompt = "Write an arithmetic expression with parentheses."
    want = engine.generate([prompt], sp, chat=True)[0]
    _check(Grammar(ARITH), want, engine._eos)
    assert "".join(o.new_text for o in engine.stream(prompt, sp, chat=True)) == want.text
    # half-way through, the request moves (pickled, its parse stacks with it) to a second engine, whose guide
    # walks its output again
    other = Engine(engine.model, engine.tokenizer, num_pages=64)
    rid = engine.add_request(prompt, sp, chat=True)
    for _ in range(6):
        engine.step()
    engine.settle()
    moved = engine.take_requests()
    assert len(moved) == 1 and isinstance(moved[0]._guide[2], frozenset)
    other.adopt_request(pickle.loads(pickle.dumps(moved[0])))
    final = None
    while other.has_unfinished():
        for out in other.step():
            if out.request_id == rid and out.finished:
                final = out
    assert final.token_ids == want.token_ids


def test_bad_grammar_through_the_engine(engine):
    with pytest.raises(ValueError, match="guided_grammar: undefined rule 'value' at line 1, column 10"):
        engine.generate(["hi"], SamplingParams(guided_grammar="root ::= value"))
    with pytest.raises(ValueError, match="guided_grammar: rule 'root' is left-recursive"):
        engine.generate(["hi"], SamplingParams(guided_grammar='root ::= root "a" | "a"'))
    spec = Engine(engine.model, engine.tokenizer, num_pages=64, num_speculative_tokens=2)
    with pytest.raises(ValueError, match="speculative"):
        spec.add_request("hi", SamplingParams(guided_grammar='root ::= "a"'))
