"""No function in the C++ / CUDA sources (csrc/, ops/) is longer than 200 lines: a kernel's main
loop is a sequence of named steps (load, scores, softmax update, P.V, write-back), each readable on
its own, not one body that holds them all. A brace-matching scanner over the sources, which skips
comments, string and character literals and preprocessor lines, measures every function body
(free functions, member functions, constructors, lambdas with a parameter list), from the line of
its opening brace to the line of its closing one."""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SOURCE_DIRS = ("csrc", "ops")
SUFFIXES = (".h", ".cuh", ".cu", ".cpp")
MAX_LINES = 200

# What stands between a function's parameter list and its body: qualifiers, a trailing return type,
# a constructor's initializer list (which itself ends with a parenthesis).
_AFTER_PARAMS = re.compile(r"\)\s*(?:const|noexcept|override|final|mutable|volatile|&|\s)*(?:->[^{;]*)?$")
_CONTROL = re.compile(r"^(?:else\s+)?(?:if|for|while|switch|catch)\b|^(?:else\s+if|constexpr)\b|\bif\s+constexpr\b")


def strip_code(text):
    """text with comments, string / character literals and preprocessor lines blanked (newlines
    kept, so that line numbers stay those of the file)."""
    out, i, n = [], 0, len(text)
    at_line_start = True
    while i < n:
        c = text[i]
        if at_line_start and c == "#":
            # A directive runs to the end of its line and on over backslash continuations.
            j = i
            while j < n and not (text[j] == "\n" and text[j - 1] != "\\"):
                j += 1
            out.append(re.sub(r"[^\n]", " ", text[i:j]))
            i = j
            continue
        if c == "/" and text.startswith("//", i):
            j = text.find("\n", i)
            j = n if j < 0 else j
            out.append(" " * (j - i))
            i = j
            continue
        if c == "/" and text.startswith("/*", i):
            j = text.find("*/", i + 2)
            j = n if j < 0 else j + 2
            out.append(re.sub(r"[^\n]", " ", text[i:j]))
            i = j
            continue
        if c == "R" and text.startswith('R"', i):
            m = re.match(r'R"([^(\s]*)\(', text[i:])
            if m:
                end = text.find(")" + m.group(1) + '"', i)
                j = n if end < 0 else end + len(m.group(1)) + 2
                out.append(re.sub(r"[^\n]", " ", text[i:j]))
                i = j
                continue
        if c in "\"'":
            # A digit separator (1'000) is no character literal.
            if c == "'" and i > 0 and text[i - 1].isalnum() and i + 1 < n and text[i + 1].isalnum():
                out.append(" ")
                i += 1
                continue
            j = i + 1
            while j < n and text[j] != c and text[j] != "\n":
                j += 2 if text[j] == "\\" else 1
            j = min(j + 1, n)
            out.append(re.sub(r"[^\n]", " ", text[i:j]))
            i = j
            continue
        out.append(c)
        if c == "\n":
            at_line_start = True
        elif not c.isspace():
            at_line_start = False
        i += 1
    return "".join(out)


def function_bodies(text):
    """[(name, first line, lines)] of every function body in C++ source text (lines of the body:
    from its opening brace's line to its closing brace's, both counted)."""
    code = strip_code(text)
    bodies, stack = [], []  # stack: (position of "{", name or None)
    last_break = 0  # position after the last ";", "{" or "}": where the text before a "{" starts
    depth = 0  # parentheses open (a for statement's ";" ends nothing)
    for i, c in enumerate(code):
        if c == "(":
            depth += 1
        elif c == ")":
            depth -= 1
        elif c == "{":
            head = " ".join(code[last_break:i].split())
            name = None
            if _AFTER_PARAMS.search(head) and not _CONTROL.search(head):
                # The function's name: the identifier before the first "(" (a constructor's, not
                # its initializer list's members; a kernel's after its launch bounds).
                m = re.search(r"([~\w:]+|\]|operator\s*\S+)\s*\(", head)
                name = m.group(1) if m else head[:60]
                if name == "]":
                    name = "lambda"
                elif name.split("::")[-1] in ("__launch_bounds__", "__attribute__", "alignas", "__align__"):
                    m = re.search(r"\)\s*([~\w:]+)\s*\(", head)
                    name = m.group(1) if m else name
            stack.append((i, name))
            last_break = i + 1
        elif c == "}":
            if stack:
                start, name = stack.pop()
                if name is not None:
                    first = code.count("\n", 0, start) + 1
                    last = code.count("\n", 0, i) + 1
                    bodies.append((name, first, last - first + 1))
            last_break = i + 1
        elif c == ";" and depth == 0:
            last_break = i + 1
    return bodies


def sources():
    return sorted(p for d in SOURCE_DIRS for p in (ROOT / d).rglob("*") if p.suffix in SUFFIXES and p.is_file())


def _body(n_lines):
    return "\n".join(f"  x += {k};" for k in range(n_lines - 2))


@pytest.mark.parametrize("n", [MAX_LINES, MAX_LINES + 1])
def test_scanner_measures_a_function(n):
    # A body of n lines (braces' lines included), with braces in comments, strings, characters and
    # a macro that must not count, inside a namespace, a struct and a kernel with launch bounds.
    text = (
        "#define BRACES(X) { X }\n"
        "namespace a {\n"
        "struct S {\n"
        "template <typename T>\n"
        "__global__ void __launch_bounds__(128, 1) kern(const P p) {\n"
        f"{_body(n)}\n"
        "}\n"
        "};\n"
        "}  // namespace a {\n"
        "const char* s = \"{{{\"; char c = '{'; /* { */\n"
    )
    got = function_bodies(text)
    assert got == [("kern", 5, n)]


def test_scanner_skips_control_blocks_and_counts_lambdas():
    text = (
        "void f(int n) {\n"
        "  for (int i = 0; i < n; ++i) {\n"
        "    if (i) {\n"
        "    } else if (n) {\n"
        "    } else {\n"
        "    }\n"
        "  }\n"
        "  auto g = [&](int k) {\n"
        "    return k;\n"
        "  };\n"
        "  if constexpr (true) {\n"
        "  }\n"
        "}\n"
        "S::S(int a) : x(a), y(a) {\n"
        "}\n"
    )
    got = function_bodies(text)
    assert sorted(got) == sorted([("lambda", 8, 3), ("f", 1, 13), ("S::S", 14, 2)])


def test_sources_are_found():
    names = {p.name for p in sources()}
    assert {"flash_dma_cuda.cu", "flash_dma_params.h", "flexdma_ops.cpp"} <= names


# Functions allowed over the limit, with the most lines each may have: none. An entry that is no
# longer needed fails too, so the list only shrinks.
KNOWN_LONG = {}


@pytest.mark.parametrize("path", sources(), ids=lambda p: str(p.relative_to(ROOT)))
def test_no_function_over_200_lines(path):
    rel = path.relative_to(ROOT).as_posix()
    bodies = function_bodies(path.read_text())
    long = [(name, line, n) for name, line, n in bodies if n > KNOWN_LONG.get((rel, name), MAX_LINES)]
    assert not long, f"{rel}: functions over {MAX_LINES} lines (name, line, lines): {long}"
    for (file, name), _ in KNOWN_LONG.items():
        if file == rel:
            assert any(n > MAX_LINES for f, _, n in bodies if f == name), (
                f"{rel}: {name} is short now: drop it from KNOWN_LONG"
            )
