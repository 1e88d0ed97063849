#!/usr/bin/env python3
"""Import circles between the modules of every crate in the repository.

A module (a source file) that imports another which, directly or through others, imports it back
makes a circle: neither can be read, changed or moved without the other. Every crate's modules must
form layers instead. A parent module and its own submodules (`foo.rs` / `foo/bar.rs`, or a
`mod.rs` and its siblings) do not count: a parent re-exporting a child is how Rust lays out a
module. Imports are read from `use` lines and `crate::` / `super::` / `self::` paths outside the
`#[cfg(test)] mod tests` block; inline `mod x { ... }` blocks are followed for `super::`.

    python3 tests/module_circles.py            # every crate; exit 1 and name each circle found
    python3 tests/module_circles.py --self-test
"""
import os
import re
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SKIP_DIRS = {"target", ".git", "node_modules", "fuzz", "template"}


def crate_sources(root):
    """Every `src` directory beside a Cargo.toml."""
    for path, dirs, files in os.walk(root):
        dirs[:] = [d for d in dirs if d not in SKIP_DIRS and not d.startswith(".")]
        if "Cargo.toml" in files and os.path.isdir(os.path.join(path, "src")):
            yield os.path.join(path, "src")


def modules(src):
    found = {}
    for path, _, files in os.walk(src):
        for name in files:
            if not name.endswith(".rs"):
                continue
            file = os.path.join(path, name)
            parts = os.path.relpath(file, src)[:-3].split(os.sep)
            if parts[0] == "bin":
                continue
            if parts[-1] in ("mod", "lib", "main"):
                parts = parts[:-1]
            found[tuple(parts)] = file
    return found


def without_tests(text):
    cut = text.find("#[cfg(test)]\nmod tests")
    return text if cut < 0 else text[:cut]


def inline_depths(text):
    """(offset, how many inline `mod x {` blocks enclose it) at each brace."""
    depth, stack, marks = 0, [], []
    for m in re.finditer(r"\bmod\s+\w+\s*\{|[{}]", text):
        token = m.group(0)
        if token == "}":
            if stack and stack.pop():
                depth -= 1
        else:
            inline = token != "{"
            stack.append(inline)
            depth += inline
        marks.append((m.end(), depth))
    return marks


def depth_at(marks, pos):
    depth = 0
    for end, d in marks:
        if end > pos:
            break
        depth = d
    return depth


def expand(tree):
    """`a::{b, c::{d}}` -> `a::b`, `a::c::d`."""
    brace = tree.find("{")
    if brace < 0:
        return [tree]
    prefix, body = tree[:brace], tree[brace + 1 : tree.rfind("}")]
    parts, current, depth = [], "", 0
    for ch in body:
        depth += ch == "{"
        depth -= ch == "}"
        if ch == "," and depth == 0:
            parts.append(current)
            current = ""
        else:
            current += ch
    parts.append(current)
    return [prefix + q for p in parts if p for q in expand(p)]


def outside_inline(path, depth):
    """A path written inside `depth` inline modules, as the file's own module would write it."""
    segs = path.split("::")
    if segs[0] == "self" and depth:
        segs, depth = segs[1:], depth - 1
    while depth and segs and segs[0] == "super":
        segs, depth = segs[1:], depth - 1
    if segs and segs[0] not in ("crate", "super", "self"):
        segs = ["self"] + segs
    return "::".join(segs)


def imported_paths(text):
    text = re.sub(r"//.*", "", text)
    marks = inline_depths(text)
    for m in re.finditer(r"\buse\s+([^;]+);", text):
        depth = depth_at(marks, m.start())
        for path in expand(re.sub(r"\s", "", m.group(1))):
            yield outside_inline(path, depth)
    for m in re.finditer(r"\b((?:crate|super|self)(?:::\w+)+)", text):
        yield outside_inline(m.group(1), depth_at(marks, m.start()))


def resolve(path, here, known):
    segs = path.split("::")
    if segs[0] == "crate":
        base, segs = [], segs[1:]
    elif segs[0] in ("super", "self"):
        base = list(here)
        while segs and segs[0] in ("super", "self"):
            if segs[0] == "super":
                base = base[:-1]
            segs = segs[1:]
    else:
        return None
    full = base + segs
    for n in range(len(full), -1, -1):
        if tuple(full[:n]) in known:
            return tuple(full[:n])
    return None


def circles(src):
    known = modules(src)
    edges = {m: set() for m in known}
    for module, file in known.items():
        with open(file, encoding="utf-8") as f:
            text = without_tests(f.read())
        for path in imported_paths(text):
            target = resolve(path, module, known)
            if target is None or target == module:
                continue
            if target[: len(module)] == module or module[: len(target)] == target:
                continue
            edges[module].add(target)
    # Tarjan's strongly connected components: each of more than one module is a circle.
    index, low, stack, on_stack, found, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in edges[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append((component, edges))

    sys.setrecursionlimit(10000)
    for v in known:
        if v not in index:
            visit(v)
    return found


def name(module):
    return "::".join(module) or "crate root"


def report(src):
    lines = []
    for component, edges in circles(src):
        members = set(component)
        lines.append(f"{os.path.relpath(src, ROOT)}: a circle among {', '.join(sorted(map(name, component)))}")
        for a in sorted(component):
            for b in sorted(edges[a] & members):
                lines.append(f"    {name(a)} imports {name(b)}")
    return lines


def self_test():
    """The checker finds a circle it is shown, and not a parent re-exporting its child."""
    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, "src")
        os.makedirs(os.path.join(src, "engine"))
        files = {
            "lib.rs": "pub mod a;\npub mod b;\npub mod engine;\n",
            "a.rs": "use crate::b::Thing;\n",
            "b.rs": "pub struct Thing;\nfn f() { crate::a::g(); }\n",
            "engine/mod.rs": "mod input;\npub use input::Input;\n",
            "engine/input.rs": "use super::Engine;\n",
        }
        for rel, text in files.items():
            with open(os.path.join(src, rel), "w") as f:
                f.write(text)
        found = [sorted(map(name, c)) for c, _ in circles(src)]
        assert found == [["a", "b"]], found


def main():
    if sys.argv[1:] == ["--self-test"]:
        self_test()
        print("module_circles: the self-test found its circle")
        return 0
    lines = [line for src in sorted(crate_sources(ROOT)) for line in report(src)]
    print("\n".join(lines) if lines else "module_circles: no import circle in any crate")
    return 1 if lines else 0


if __name__ == "__main__":
    sys.exit(main())
