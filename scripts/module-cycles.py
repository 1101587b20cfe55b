#!/usr/bin/env python3
"""Report circles between the top-level modules of Rust crates; exit 1 if there is one.

    scripts/module-cycles.py runtime/src [bench/src ...]

For each `src/` folder, every top-level module (a file `src/x.rs` or a folder `src/x/`, both
being module `x`) gets the set of other top-level modules it names through paths: `crate::y...`,
`use crate::{y, z::w}` groups, and `super::` paths that climb to the crate root from a nested
file or inline module (`super::super::y` in `src/x/a.rs`'s `mod tests`). A name the root file
(`lib.rs` / `main.rs`) re-exports (`pub use y::Name;`) counts as module `y`. Comments (doc
comments and their intra-doc links included) and string literals are not read: they import
nothing. Test code counts: a test-only import is still an import.

A cycle is a strongly connected component of more than one module; each is printed with its edges
and where each edge is first taken (file:line). Python 3 standard library only.
"""
import os
import re
import sys

IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def tokens(text):
    """Yield (token, line) for Rust source with comments and literals removed.

    Tokens are identifiers, `::`, and single punctuation characters; string, byte-string, raw-string
    and char literals are skipped (lifetimes are kept as punctuation + identifier, harmlessly)."""
    i, n, line = 0, len(text), 1
    while i < n:
        c = text[i]
        if c == "\n":
            line += 1
            i += 1
        elif c.isspace():
            i += 1
        elif text.startswith("//", i):
            j = text.find("\n", i)
            i = n if j < 0 else j
        elif text.startswith("/*", i):
            depth, i = 1, i + 2
            while i < n and depth:
                if text.startswith("/*", i):
                    depth, i = depth + 1, i + 2
                elif text.startswith("*/", i):
                    depth, i = depth - 1, i + 2
                else:
                    line += text[i] == "\n"
                    i += 1
        elif m := re.compile(r'b?r(#*)"').match(text, i):
            end = '"' + m.group(1)
            j = text.find(end, m.end())
            j = n if j < 0 else j + len(end)
            line += text.count("\n", i, j)
            i = j
        elif c == '"' or text.startswith('b"', i):
            i += 2 if c == "b" else 1
            while i < n and text[i] != '"':
                if text[i] == "\\":
                    i += 1
                line += i < n and text[i] == "\n"
                i += 1
            i += 1
        elif c == "'" or text.startswith("b'", i):
            # A char literal ('a', '\n', '\u{1F600}', b'x') or a lifetime ('a): a char literal closes
            # within a few characters.
            k = i + (2 if c == "b" else 1)
            m = re.compile(r"(\\(u\{[0-9A-Fa-f]+\}|x[0-9A-Fa-f]{2}|.)|[^\\'\n])'").match(text, k)
            if m:
                i = m.end()
            else:
                yield "'", line
                i += 1
        elif m := IDENT.match(text, i):
            word = m.group(0)
            # Raw identifiers (r#type) read as their name.
            if word == "r" and text.startswith("#", m.end()) and IDENT.match(text, m.end() + 1):
                m = IDENT.match(text, m.end() + 1)
                word = m.group(0)
            yield word, line
            i = m.end()
        elif text.startswith("::", i):
            yield "::", line
            i += 2
        else:
            yield c, line
            i += 1


def group_heads(toks, k):
    """`toks[k]` is the `{` of a `use` group: return [(first identifier, line)] of its items."""
    heads, depth, expect = [], 0, True
    while k < len(toks):
        t, ln = toks[k]
        if t == "{":
            depth += 1
            expect = depth == 1
        elif t == "}":
            depth -= 1
            if depth == 0:
                break
        elif t == "," and depth == 1:
            expect = True
        elif expect and depth == 1 and IDENT.fullmatch(t):
            heads.append((t, ln))
            expect = False
        k += 1
    return heads


def root_names(path, modules):
    """Names the crate root re-exports from a top-level module: {name: module}."""
    names = {}
    if not os.path.exists(path):
        return names
    with open(path, encoding="utf-8") as f:
        toks = list(tokens(f.read()))
    for k, (t, _) in enumerate(toks):
        if t != "use" or k == 0 or toks[k - 1][0] not in ("pub", ")"):
            continue
        j = k + 1
        if j < len(toks) and toks[j][0] in ("crate", "self") and toks[j + 1][0] == "::":
            j += 2
        if j >= len(toks) or toks[j][0] not in modules:
            continue
        module, end = toks[j][0], j
        while end < len(toks) and toks[end][0] != ";":
            end += 1
        items = toks[j:end]
        if "{" in [x for x, _ in items]:
            # The names a group brings in: every identifier before a `,` or `}` (or `as NAME`).
            for a, (x, _) in enumerate(items):
                if IDENT.fullmatch(x) and a + 1 < len(items) and items[a + 1][0] in (",", "}"):
                    names[x] = module
        else:
            names[items[-1][0]] = module
    return names


def scan(src):
    """Return (modules, edges) where edges maps (from, to) to the first 'file:line' of it."""
    modules = set()
    for entry in os.listdir(src):
        full = os.path.join(src, entry)
        if os.path.isdir(full):
            modules.add(entry)
        elif entry.endswith(".rs") and entry not in ("lib.rs", "main.rs"):
            modules.add(entry[:-3])
    roots = {}
    for root in ("lib.rs", "main.rs"):
        roots.update(root_names(os.path.join(src, root), modules))

    edges = {}
    for dirpath, _, files in os.walk(src):
        for name in sorted(files):
            if not name.endswith(".rs"):
                continue
            full = os.path.join(dirpath, name)
            rel = os.path.relpath(full, src)
            parts = rel[:-3].split(os.sep)
            if parts[-1] == "mod":
                parts.pop()
            if parts in (["lib"], ["main"]) and dirpath == src:
                continue
            here = parts[0]
            with open(full, encoding="utf-8") as f:
                toks = list(tokens(f.read()))

            def reference(target, line):
                if target in roots:
                    target = roots[target]
                if target in modules and target != here:
                    edges.setdefault((here, target), f"{os.path.relpath(full)}:{line}")

            # Inline modules (`mod tests { ... }`) deepen the path `super::` climbs from.
            inline, depth = [], 0
            k = 0
            while k < len(toks):
                t, line = toks[k]
                if t == "{":
                    depth += 1
                elif t == "}":
                    depth -= 1
                    if inline and inline[-1] == depth:
                        inline.pop()
                elif t == "mod" and k + 2 < len(toks) and toks[k + 2][0] == "{":
                    inline.append(depth)
                next_is_path = k + 1 < len(toks) and toks[k + 1][0] == "::"
                if t == "crate" and next_is_path and (k == 0 or toks[k - 1][0] != "::"):
                    at = k + 2
                elif t == "super" and next_is_path and (k == 0 or toks[k - 1][0] != "::"):
                    level = len(parts) + len(inline)
                    at = k
                    while at + 1 < len(toks) and toks[at][0] == "super" and toks[at + 1][0] == "::":
                        level -= 1
                        at += 2
                    if level > 0:
                        k = at
                        continue
                else:
                    k += 1
                    continue
                if at < len(toks) and toks[at][0] == "{":
                    for head, ln in group_heads(toks, at):
                        reference(head, ln)
                elif at < len(toks):
                    reference(toks[at][0], toks[at][1])
                k = at
    return modules, edges


def components(modules, edges):
    """Tarjan's strongly connected components, iteratively."""
    graph = {m: sorted(b for (a, b) in edges if a == m) for m in modules}
    index, low, on, stack, out, counter = {}, {}, set(), [], [], [0]
    for start in sorted(modules):
        if start in index:
            continue
        work = [(start, 0)]
        while work:
            v, i = work.pop()
            if i == 0:
                index[v] = low[v] = counter[0]
                counter[0] += 1
                stack.append(v)
                on.add(v)
            if i < len(graph[v]):
                work.append((v, i + 1))
                w = graph[v][i]
                if w not in index:
                    work.append((w, 0))
                elif w in on:
                    low[v] = min(low[v], index[w])
                continue
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                out.append(sorted(comp))
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[v])
    return out


def shortest_cycle(edge, inside, edges):
    """The shortest cycle through `edge` among the modules `inside`, as a list of modules."""
    a, b = edge
    prev, frontier = {b: None}, [b]
    while frontier and a not in prev:
        nxt = []
        for v in frontier:
            for (x, y) in sorted(edges):
                if x == v and y in inside and y not in prev:
                    prev[y] = v
                    nxt.append(y)
        frontier = nxt
    path, v = [], a
    while v is not None:
        path.append(v)
        v = prev[v]
    return [a] + path[::-1]


def main(argv):
    if len(argv) < 2 or any(a.startswith("-") for a in argv[1:]):
        print(__doc__.strip(), file=sys.stderr)
        return 2
    found = False
    for src in argv[1:]:
        if not os.path.isdir(src):
            print(f"{src}: not a folder", file=sys.stderr)
            return 2
        modules, edges = scan(src)
        cycles = [c for c in components(modules, edges) if len(c) > 1]
        if not cycles:
            print(f"{src}: {len(modules)} top-level modules, {len(edges)} edges, no cycles")
            continue
        found = True
        for comp in cycles:
            inside = set(comp)
            print(f"{src}: cycle among {', '.join(comp)}")
            seen = set()
            for (a, b) in sorted(edges):
                if a in inside and b in inside:
                    print(f"  {a} -> {b}  ({edges[(a, b)]})")
            for (a, b) in sorted(edges):
                if a in inside and b in inside:
                    cycle = shortest_cycle((a, b), inside, edges)
                    key = frozenset(zip(cycle, cycle[1:]))
                    if key not in seen:
                        seen.add(key)
                        print(f"  circle: {' -> '.join(cycle)}")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
