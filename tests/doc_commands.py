"""The checker behind tests/test_docs.py: every command the docs show, checked with the real parsers.

`check_markdown(text, name)` returns one `name:line: problem` string per problem in a markdown text:

* commands: fenced shell blocks (bash, sh, shell, console: `$ ` lines; backslash continuations
  joined, comments dropped, split on `;`, `&&`, `||`, `|`, `&`) and inline code spans that start with
  a known command. `make` (targets and variables from the Makefile; `make demo`'s MODEL, STEPS,
  RUN_DIR and ARGS through the demo's own parse()), `grpo-mesh` / `python -m services[.launch]`
  (the command's parse()), `python -m services.<svc>` (the service's settings, as from_cli reads
  them), `grpcurl` (the method exists in the generated descriptors and its `-d` body parses into the
  request type), `docker compose` (profiles and services exist in docker-compose.yml) and
  `scripts/*.py` / `bench/*.py` (every flag is one their argparse parser defines, read with ast).
  `$(...)` and unknown `$VARS` become a placeholder; a `--config` file of the repo is read (compose's
  `/app/configs/X` is docker/configs/X), one that is not (an example's `run.toml`) becomes an empty
  run-config. A usage synopsis (`[--n N]`, `<cmd>`, `...`) is checked for its command and flag names;
  prose may name a command without its required arguments (`grpo-mesh audit`), a shell block may not.
* files: each repo path an inline code span or a link names exists (run outputs excluded);
* counts: "N RPCs" equals the RPC methods of protos/;
* booleans: a span like `--trace true` (no command around it) breaks the one boolean convention.

Nothing runs: parse() functions raise SystemExit(2) with a one-line error, which becomes the problem.
"""

from __future__ import annotations

import importlib.util
import re
import shlex
from collections.abc import Iterator
from pathlib import Path

from services.launch import serve
from tests.doc_parsers import (
    ROOT,
    check_compose,
    check_grpcurl,
    check_grpo_mesh,
    check_make,
    check_script,
    check_service,
    rpc_count,
)

DOC_GLOBS = ("README.md", "docs/*.md", "services/scheduler/README.md", "deploy/k8s/README.md",
             "deploy/slurm/README.md")  # fmt: skip
SHELLS = {"bash", "sh", "shell", "console", "zsh"}
PLACEHOLDER = "1"  # what `$(cat runs/demo/scheduler.port)` and an unknown `$T` become
REPO_ROOTS = ("services/", "tests/", "docs/", "bench/", "scripts/", "docker/", "deploy/", "examples/",
              "protos/", "grpo/")  # fmt: skip
NOT_IN_REPO = ("runs/", ".venv/", ".cache/", ".whl/", "/", "~", "http:", "https:", "path/to/")
FILE_SUFFIXES = (".py", ".md", ".toml", ".yaml", ".yml", ".proto", ".sh")
SEPARATORS = {";", "&&", "||", "|", "&"}
REDIRECTS = {">", ">>", "<", ">&", "&>", "<&", ">|"}

FENCE = re.compile(r"^\s*(```+|~~~+)\s*([\w+-]*)")
SPAN = re.compile(r"(?<!`)`([^`\n]+)`(?!`)")
LINK = re.compile(r"\]\(([^)\s]+)\)")
SUBSTITUTION = re.compile(r"\$\((?:[^()]|\([^()]*\))*\)")
VARIABLE = re.compile(r"\$\{(\w+)(?::-([^}]*))?\}|\$(\w+)")
ASSIGNMENT = re.compile(r"^[A-Za-z_]\w*=")
QUOTED = re.compile(r"'[^']*'|\"[^\"]*\"")
SYNOPSIS = re.compile(r"\[|\]|<[\w-]+>|\.\.\.|…|\{\w+,")
COMMAND_SPAN = re.compile(
    r"^(?:\.venv/bin/)?(?:grpo-mesh\b|python3?\s+(?:-m\s+services\b|(?:scripts|bench)/)|make\s|grpcurl\s"
    r"|docker\s+compose\s)|^(?:bench|scripts)/[\w-]+\.py\s+-|^ARGS="
)
BOOLEAN_VALUE = re.compile(r"(?:^|\s)(--[a-z][\w.-]*)(?:\s+|=)(true|false)\b")
MISSING_REQUIRED = re.compile(r"the following arguments are required|: required: |Field required")
RPC_COUNT = re.compile(r"\b(\d+) RPCs\b")


# ---- extraction -------------------------------------------------------------------------------------


def doc_files() -> list[Path]:
    return sorted({p for pattern in DOC_GLOBS for p in ROOT.glob(pattern) if p.is_file()})


def strip_comment(line: str) -> str:
    """The line without its shell comment (a `#` that starts a word, outside quotes)."""
    quote = ""
    for index, char in enumerate(line):
        if quote:
            quote = "" if char == quote else quote
        elif char in "'\"":
            quote = char
        elif char == "#" and (index == 0 or line[index - 1].isspace()):
            return line[:index]
    return line


def expand(text: str, variables: dict[str, str]) -> str:
    text = SUBSTITUTION.sub(PLACEHOLDER, text)
    return VARIABLE.sub(lambda m: variables.get(m[1] or m[3]) or m[2] or PLACEHOLDER, text)


def split_commands(text: str, variables: dict[str, str]) -> list[list[str]]:
    """A shell line's simple commands as word lists, leading `VAR=value`s applied to `variables`."""
    lexer = shlex.shlex(expand(text, variables), posix=True, punctuation_chars=";&|<>")
    lexer.whitespace_split, lexer.commenters = True, ""
    try:
        tokens = list(lexer)
    except ValueError:  # an unbalanced quote: not a command we can read
        return []
    commands: list[list[str]] = [[]]
    skip = False
    for token in tokens:
        if skip:
            skip = False
        elif token in SEPARATORS:
            commands.append([])
        elif token in REDIRECTS:
            skip = True
            if commands[-1] and commands[-1][-1].isdigit():  # `2>&1`
                commands[-1].pop()
        else:
            commands[-1].append(token)
    result = []
    for words in commands:
        while words and ASSIGNMENT.match(words[0]):
            name, value = words.pop(0).split("=", 1)
            variables[name] = value
        if words:
            result.append(words)
    return result


def shell_lines(lines: list[str]) -> Iterator[tuple[int, str, str, int]]:
    """(line number, kind, text, fence id): block lines (kind = language) and the other lines ("")."""
    fence, language, block = "", "", 0
    for number, line in enumerate(lines, 1):
        opened = FENCE.match(line)
        if opened and not fence:
            fence, language, block = opened[1], opened[2].lower(), block + 1
        elif opened and line.strip().startswith(fence):
            fence = ""
        else:
            yield number, (language or "text") if fence else "", line, block


def block_commands(lines: list[tuple[int, str]], console: bool) -> Iterator[tuple[int, str]]:
    """A shell block's commands with their first line: continuations joined, comments and prompts
    dropped (in a console block only `$ ` lines are commands)."""
    pending, start = "", 0
    for number, text in lines:
        if not pending:
            if console:
                if not text.lstrip().startswith("$ "):
                    continue
                text = text.lstrip()[2:]
            start = number
        text = strip_comment(text)
        if text.rstrip().endswith("\\"):
            pending += text.rstrip()[:-1] + " "
            continue
        yield start, pending + text
        pending = ""
    if pending:
        yield start, pending


# ---- one command --------------------------------------------------------------------------------------


def _module_exists(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except ModuleNotFoundError:  # a parent package is missing
        return False


def check_command(words: list[str], synopsis: bool = False) -> list[str]:
    """The problems of one simple command (its words after the shell's parsing)."""
    head = words[0].removeprefix(".venv/bin/")
    args = [w.strip("[]") if synopsis else w for w in words[1:]]
    if head == "make":
        return check_make(args, synopsis)
    if head == "grpo-mesh":
        return check_grpo_mesh(args, synopsis)
    if head in ("python", "python3") and args[:1] == ["-m"] and len(args) > 1:
        module, rest = args[1], args[2:]
        if module in ("services", "services.launch"):
            return check_grpo_mesh(rest, synopsis)
        parts = module.split(".")
        if parts[0] == "services" and len(parts) == 2 and parts[1] in serve.SERVICES:
            return check_service(parts[1], rest, synopsis)
        if parts[0] in ("services", "grpo") and "<" not in module and not _module_exists(module):
            return [f"python -m {module}: no such module"]
        return []
    if head in ("python", "python3") and args and args[0].endswith(".py"):
        return check_script(args[0], args[1:]) if args[0].startswith(("scripts/", "bench/")) else []
    if head.startswith(("scripts/", "bench/")):
        return check_script(head, args)
    if head == "bash" and args and args[0].startswith("scripts/"):
        return check_script(args[0], [])
    if head == "grpcurl":
        return check_grpcurl(args)
    if head == "docker" and args[:1] == ["compose"]:
        return check_compose(args[1:])
    return []


# ---- files and counts -----------------------------------------------------------------------------------


def path_problem(word: str, doc: Path) -> str | None:
    """A repo path named in a span or a link that does not exist (None: exists, or no repo path)."""
    word = word.strip(".,;:()'\"").split("#")[0]
    word = re.sub(r"(\.py):[\w.]+$", r"\1", word)  # examples/my_env.py:CountLettersEnv
    if not word or any(c in word for c in "<>*{}$…?=") or word.startswith(NOT_IN_REPO):
        return None
    if word.startswith(REPO_ROOTS):
        bases = [ROOT]
    elif "/" in word and word.endswith(FILE_SUFFIXES) and not word.startswith("."):
        bases = [doc.parent, ROOT, ROOT / "services"]  # `scheduler/orchestrator.py` in the README
    else:
        return None
    if any((base / word).exists() for base in bases):
        return None
    return f"{word}: no such file or directory in the repo"


def check_markdown(text: str, name: str = "doc.md", path: Path | None = None) -> list[str]:
    """Every problem of one markdown text, as `name:line: problem`."""
    doc = path or ROOT / name
    problems: list[tuple[int, str]] = []

    def report(line: int, what: str, errors: list[str]) -> None:
        shown = what if len(what) <= 90 else what[:87] + "..."
        problems.extend((line, f"{name}:{line}: `{shown}`: {' '.join(error.split())}") for error in errors)

    blocks: dict[int, tuple[str, list[tuple[int, str]]]] = {}
    for number, kind, line, block in shell_lines(text.splitlines()):
        if kind:
            blocks.setdefault(block, (kind, []))[1].append((number, line))
            continue
        for span in SPAN.findall(line):
            span = span.strip()
            if COMMAND_SPAN.match(span):
                if span.startswith("ARGS="):
                    span = f"make demo {span}"
                synopsis = bool(SYNOPSIS.search(QUOTED.sub("", span)))  # `'["a:1"]'` is a JSON value
                if synopsis:
                    try:
                        words = shlex.split(SUBSTITUTION.sub(PLACEHOLDER, span))
                    except ValueError:
                        words = span.split()
                    report(number, span, check_command(words, synopsis=True))
                else:  # in prose a command may be named without its required arguments
                    for words in split_commands(span, {}):
                        errors = check_command(words)
                        report(number, span, [e for e in errors if not MISSING_REQUIRED.search(e)])
            elif match := BOOLEAN_VALUE.search(span):
                flag = match[1]
                report(number, span, [f"{flag}: booleans are a bare {flag} / --no-{flag[2:]} (no value)"])
            for word in span.split():
                if problem := path_problem(word, doc):
                    report(number, span, [problem])
        for target in LINK.findall(line):
            if not target.startswith(("http://", "https://", "mailto:", "#")):
                target = target.split("#")[0]
                if target and not (doc.parent / target).exists():
                    report(number, target, [f"link to {target}: no such file"])
        for count in RPC_COUNT.findall(line):
            if int(count) != rpc_count():
                report(number, f"{count} RPCs", [f"protos/ define {rpc_count()} RPCs, not {count}"])
    for kind, lines in blocks.values():
        if kind not in SHELLS:
            continue
        variables: dict[str, str] = {}
        for number, command in block_commands(lines, console=kind == "console"):
            for words in split_commands(command, variables):
                report(number, " ".join(words), check_command(words))
    return [problem for _, problem in sorted(problems, key=lambda p: p[0])]
