#!/usr/bin/env python3
"""The fenced code blocks of README.md and docs/*.md, and what vouches for each.

Every fenced block carries a marker, an HTML comment on the line before its opening fence:

  <!-- snippet: NAME -->               compiled by the test docs_snippets against the installed package:
                                       ```cpp   the body goes into the harness under tests/docs/ that has the
                                                line "// @snippet NAME@" (one harness may hold several), or the
                                                block is a whole program; its own #include lines come first in the
                                                generated file, and a harness of a snippet with #include lines
                                                includes nothing itself (the snippet must compile with exactly its
                                                own includes)
                                       ```cmake included by the docs project (tests/docs/project/CMakeLists.txt)
                                       ```sh    run by docs_snippets in the project's directory, with
                                                <twobp prefix> and <twobp checkout>/.venv/bin/python filled in
                                                (tests/install/install_test.cmake, STEP docs)
  <!-- verified: TEST[, TEST...] -->   commands that these ctest tests run (the same commands and options, at
                                       small sizes)
  <!-- illustration: WHY -->           shown, not run: an output, a layout, a launch needing GPUs or nodes

  doc_blocks.py check ROOT [--ctest CTEST --build DIR]
                                              fails naming each unmarked block, each indented code block,
                                              duplicate snippet name, missing harness, harness line of no block,
                                              and (with a build: its `ctest -N`) each verified: TEST that is no
                                              test of that build
  doc_blocks.py extract ROOT OUTDIR           writes OUTDIR/<harness>.cpp (or <NAME>.cpp for a whole program),
                                              <NAME>.cmake and <NAME>.sh

Standard-library Python only.
"""
import argparse
import pathlib
import re
import subprocess
import sys

MARKER = re.compile(r"^<!--\s*(snippet|verified|illustration)\s*(?::\s*(.*?))?\s*-->$")
FENCE = re.compile(r"^(\s*)(```+|~~~+)\s*([\w+-]*)")
SNIPPET_LANGUAGES = {"cpp": ".cpp", "cmake": ".cmake", "sh": ".sh"}


class Block:
    def __init__(self, path, line, language, marker, text):
        self.path, self.line, self.language, self.marker, self.text = path, line, language, marker, text

    def where(self):
        return f"{self.path}:{self.line}"


def markdown_files(root):
    return [root / "README.md"] + sorted((root / "docs").glob("*.md"))


def blocks(root):
    """Every fenced block of the documentation, with the marker on the line before its fence (or None)."""
    found = []
    for path in markdown_files(root):
        lines = path.read_text(encoding="utf-8").split("\n")
        i = 0
        while i < len(lines):
            m = FENCE.match(lines[i])
            if not m:
                i += 1
                continue
            fence = m.group(2)
            end = i + 1
            while end < len(lines) and not lines[end].strip().startswith(fence):
                end += 1
            previous = lines[i - 1].strip() if i > 0 else ""
            marker = MARKER.match(previous)
            found.append(Block(path.relative_to(root), i + 1, m.group(3),
                               (marker.group(1), (marker.group(2) or "").strip()) if marker else None,
                               "\n".join(lines[i + 1:end]) + "\n"))
            i = end + 1
    return found


def indented_blocks(root):
    """(file, line) of each indented code block (4 spaces after a blank line, not in a list): they cannot carry a
    marker, so the documentation fences every block."""
    found = []
    for path in markdown_files(root):
        lines = path.read_text(encoding="utf-8").split("\n")
        in_fence = False
        for i, line in enumerate(lines):
            if FENCE.match(line):
                in_fence = not in_fence
                continue
            if in_fence or i < 2 or lines[i - 1].strip() or not re.match(r"^(    |\t)\S", line):
                continue
            before = next((l for l in reversed(lines[:i - 1]) if l.strip()), "")
            if not re.match(r"^(\s|[*+-] |\d+\. )", before):
                found.append(f"{path.relative_to(root)}:{i + 1}")
    return found


def harness_path(root, name):
    """The harness under tests/docs/ with the line for snippet `name`, or None."""
    for path in sorted((root / "tests" / "docs").glob("*.cpp")):
        if f"// @snippet {name}@" in path.read_text(encoding="utf-8"):
            return path
    return None


def split_includes(text):
    """(the snippet's leading #include lines, the rest, how many lines the first part spans)."""
    lines = text.split("\n")
    n = 0
    while n < len(lines) and (lines[n].startswith("#include") or not lines[n].strip()):
        n += 1
    return "\n".join(lines[:n]).strip() + "\n", "\n".join(lines[n:]), n


def problems_of(root, known_tests):
    problems = [f"{where}: an indented code block: fence it (```sh, ```cpp, ...) and mark it" for where in
                indented_blocks(root)]
    names = {}
    for b in blocks(root):
        if b.marker is None:
            problems.append(f"{b.where()}: a ```{b.language} block without a marker: put <!-- snippet: NAME -->, "
                            "<!-- verified: TEST --> or <!-- illustration: WHY --> on the line before it "
                            "(tests/scripts/doc_blocks.py says what each means)")
            continue
        kind, argument = b.marker
        if kind in ("snippet", "verified") and not argument:
            problems.append(f"{b.where()}: <!-- {kind} --> needs a name")
        elif kind == "snippet":
            if b.language not in SNIPPET_LANGUAGES:
                problems.append(f"{b.where()}: snippet {argument} is ```{b.language}; snippets are "
                                f"{', '.join(SNIPPET_LANGUAGES)}")
            if argument in names:
                problems.append(f"{b.where()}: snippet name {argument} also at {names[argument]}")
            names[argument] = b.where()
            if b.language == "cpp":
                problems += harness_problems(root, b, argument)
        elif kind == "verified" and known_tests is not None:
            problems += [f"{b.where()}: verified: {test} is no ctest test of this build"
                         for test in re.split(r"\s*,\s*", argument) if test not in known_tests]
    for harness in sorted((root / "tests" / "docs").glob("*.cpp")):
        for name in re.findall(r"// @snippet (\S+)@", harness.read_text(encoding="utf-8")):
            if name not in names:
                problems.append(f"{harness.relative_to(root)}: '// @snippet {name}@' names no snippet of the docs")
    return problems


def harness_problems(root, block, name):
    includes, _, _ = split_includes(block.text)
    harness = harness_path(root, name)
    if harness is None:
        if "int main(" in block.text:
            return []
        return [f"{block.where()}: snippet {name} is no whole program and no harness under tests/docs/ has the "
                f"line '// @snippet {name}@'"]
    text = harness.read_text(encoding="utf-8")
    problems = []
    if includes.strip() and re.search(r"^\s*#\s*include", text, re.M):
        problems.append(f"{harness.relative_to(root)}: includes headers, but snippet {name} ({block.where()}) "
                        "brings its own: it must compile with exactly those")
    return problems


def extract(root, out):
    out.mkdir(parents=True, exist_ok=True)
    generated = {}  # harness path -> [its text so far, the snippets' #include lines, where they came from]
    for b in blocks(root):
        if not b.marker or b.marker[0] != "snippet" or b.language not in SNIPPET_LANGUAGES:
            continue
        name = b.marker[1]
        harness = harness_path(root, name) if b.language == "cpp" else None
        if harness is None:
            (out / (name + SNIPPET_LANGUAGES[b.language])).write_text(b.text, encoding="utf-8")
            continue
        includes, body, skipped = split_includes(b.text)
        original = harness.read_text(encoding="utf-8")
        placeholder = f"// @snippet {name}@"
        after = original[:original.index(placeholder)].count("\n") + 2  # the harness's line after the placeholder
        entry = generated.setdefault(harness, [original, "", []])
        entry[0] = entry[0].replace(placeholder, f'#line {b.line + 1 + skipped} "{b.path}"\n{body}\n'
                                                 f'#line {after} "{harness.relative_to(root)}"')
        entry[1] += includes
        entry[2].append(b.where())
    for harness, (text, includes, sources) in generated.items():
        (out / harness.name).write_text(
            f"// Generated by tests/scripts/doc_blocks.py from {harness.relative_to(root)} and "
            f"{', '.join(sources)}.\n{includes}#line 1 \"{harness.relative_to(root)}\"\n{text}", encoding="utf-8")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    check = sub.add_parser("check")
    check.add_argument("root", type=pathlib.Path)
    check.add_argument("--ctest", help="ctest, to list the tests of --build")
    check.add_argument("--build", help="the build directory whose tests verified: may name")
    ex = sub.add_parser("extract")
    ex.add_argument("root", type=pathlib.Path)
    ex.add_argument("out", type=pathlib.Path)
    args = parser.parse_args()
    if args.command == "extract":
        extract(args.root, args.out)
        return 0
    known = None
    if args.ctest and args.build:
        listing = subprocess.run([args.ctest, "-N", "--test-dir", args.build], capture_output=True, text=True,
                                 check=True).stdout
        known = set(re.findall(r"Test\s+#\d+: (\S+)", listing))
    problems = problems_of(args.root, known)
    for p in problems:
        print(p)
    n = len(blocks(args.root))
    print(f"doc_blocks: {n} fenced blocks, {len(problems)} problem(s)")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
