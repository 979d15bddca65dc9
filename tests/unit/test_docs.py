"""The docs are tested: README.md, BENCHMARKS.md and every page of the site (docs/**/*.md).

Conventions (docs/contributing/development.md, "Docs tests"):

* every ```python block runs, as written, in a fresh process with
  TFDS_DATA_DIR set to the prepared Fashion-MNIST (slow; a block that
  starts a cluster is marked cluster instead); a ```python no-run block is
  shown, not run;
* every ```sh command line that runs `recipes/train.py`, another recipe or
  `tfmulti COMMAND` (also after `tfmulti launch ... --`, and with `\\`
  continuations) is parsed in-process against the real flag definitions
  (fast tier); a command line ending in `# not checked: <why>` is skipped;
* the `tfmulti estimate-memory` commands of ```sh blocks run (slow); a
  ```text block right after such a block is their exact output;
* outside code blocks: inline `--flags` are real flags, inline `tfmulti.x.y`
  names resolve, inline repository paths exist, relative links (and their
  #anchors, as the site's table of contents makes them and, for the files
  read on the repository's web page, as GitHub does) resolve, a page of the
  site links only to pages of the site; every page of docs/ and every
  notebook is in mkdocs.yml's nav (or deliberately in not_in_nav); README.md
  links into every section of the site and is at most 250 lines.
"""

from __future__ import annotations

import ast
import contextlib
import dataclasses
import functools
import importlib
import importlib.util
import io
import os
import re
import shlex
import types
from pathlib import Path

import pytest

from tests._util import RECIPES, REPO

README = REPO / "README.md"
DOCS_DIR = REPO / "docs"
MKDOCS_YML = REPO / "mkdocs.yml"
# The site's pages (docs/notebooks is a link to ../notebooks: its notebooks are
# pages too, checked by tests/unit/test_notebooks.py).
SITE_PAGES = sorted(p for p in DOCS_DIR.rglob("*.md") if "_hooks" not in p.parts)
ROOT_FILES = [README, REPO / "BENCHMARKS.md"]  # read on the repository's web page
DOC_FILES = [*ROOT_FILES, *SITE_PAGES]
README_MAX_LINES = 250
NOT_CHECKED = "# not checked:"
MAX_NOT_CHECKED = 3  # the marker is for placeholders, used sparingly
LANGUAGES = {"python", "sh", "text", "json", "ini", "yaml"}
HELP_FLAGS = {"-h", "--help", "--helpfull", "--helpshort", "--version"}
FORWARDED = {"$@", "$*"}  # a wrapper script passing its own arguments on
# Flags of other tools that the docs name inline (unshare, sbatch, tensorboard,
# pytest, mkdocs build).
FOREIGN_FLAGS = {"net", "requeue", "logdir", "durations", "strict"}

_FENCE = re.compile(r"^(?P<indent>[ \t]*)```(?P<info>[^\n`]*)\n(?P<code>.*?)^(?P=indent)```[ \t]*$",
                    re.M | re.S)


@dataclasses.dataclass(frozen=True)
class Block:
    """One fenced code block of a docs file."""

    path: Path
    line: int  # of the opening fence
    lang: str
    options: tuple
    code: str
    start: int  # offsets of the fence in the file's text
    end: int

    @property
    def id(self) -> str:
        return f"{self.path.relative_to(REPO)}:{self.line}"


@functools.cache
def blocks(path: Path) -> tuple[Block, ...]:
    text = path.read_text()
    found = []
    for m in _FENCE.finditer(text):
        info = m.group("info").split()
        code = "\n".join(line[len(m.group("indent")):] for line in m.group("code").splitlines())
        found.append(Block(path, text.count("\n", 0, m.start()) + 1, info[0] if info else "",
                           tuple(info[1:]), code + "\n", m.start(), m.end()))
    return tuple(found)


def all_blocks(lang: str) -> list[Block]:
    return [b for path in DOC_FILES for b in blocks(path) if b.lang == lang]


def prose(path: Path) -> str:
    """The file's text with its fenced blocks blanked (line numbers kept)."""
    text = path.read_text()
    for b in reversed(blocks(path)):
        text = text[:b.start] + "\n" * text.count("\n", b.start, b.end) + text[b.end:]
    return text


def inline_code(path: Path) -> list[tuple[int, str]]:
    """(line, text) of every inline code span outside the fenced blocks."""
    spans = []
    for number, line in enumerate(prose(path).splitlines(), 1):
        spans += [(number, m.group(1)) for m in re.finditer(r"`([^`\n]+)`", line)]
    return spans


def _where(path: Path, line: int) -> str:
    return f"{path.relative_to(REPO)}:{line}"


# ------------------------------------------------------------------ python blocks

PYTHON_BLOCKS = [b for b in all_blocks("python") if "no-run" not in b.options]


def test_readme_has_the_data_parallel_example():
    assert any("4 x 64" in b.code for b in PYTHON_BLOCKS if b.path == README)


def test_code_blocks_name_their_language():
    for path in DOC_FILES:
        for b in blocks(path):
            assert b.lang in LANGUAGES, f"{b.id}: fence language {b.lang!r}"
            allowed = ("no-run",) if b.lang == "python" else ()
            assert set(b.options) <= set(allowed), f"{b.id}: fence options {b.options}"


# ------------------------------------------------------------------- sh commands


def logical_lines(code: str) -> list[tuple[int, str]]:
    """(offset of the first line, text) of each command line, `\\` continuations joined."""
    lines, parts, first = [], [], None
    for i, raw in enumerate(code.splitlines()):
        first = i if first is None else first
        if raw.rstrip().endswith("\\"):
            parts.append(raw.rstrip()[:-1])
            continue
        parts.append(raw)
        lines.append((first, " ".join(parts)))
        parts, first = [], None
    if parts:
        lines.append((first, " ".join(parts)))
    return lines


def shell_words(line: str) -> list[list[str]]:
    """The simple commands of a shell line, as words (no operators, redirections or comments)."""
    lex = shlex.shlex(line, posix=True, punctuation_chars=";&|<>()")
    lex.whitespace_split = True
    lex.commenters = "#"
    commands, words, tokens = [], [], list(lex)
    i = 0
    while i < len(tokens):
        token = tokens[i]
        if token == "<" or (">" in token and set(token) <= set("<>&")):  # a redirection
            if words and words[-1].isdigit():
                words.pop()
            i += 2
            continue
        if set(token) <= set(";&|()"):
            commands.append(words)
            words = []
        else:
            words.append(token)
        i += 1
    return [c for c in commands + [words] if c]


def _recipe_name(word: str) -> str | None:
    path = Path(word)
    if path.suffix == ".py" and path.parent.name == "recipes" and (RECIPES / path.name).exists():
        return path.stem
    return None


@functools.cache
def _recipe_defines(name: str):
    """The module-level `flags.DEFINE_*` statements of a recipe (and its
    tfmulti and benchmarks imports they need), compiled to run against any FlagValues."""
    path = RECIPES / f"{name}.py"
    keep = []
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith(
                ("tfmulti", "benchmarks")):
            keep.append(node)
        elif isinstance(node, ast.Import) and all(
                a.name.split(".")[0] == "benchmarks" for a in node.names):
            keep.append(node)
        elif isinstance(node, (ast.Assign, ast.Expr)) and isinstance(node.value, ast.Call):
            func = node.value.func
            if (isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name)
                    and func.value.id == "flags" and func.attr.startswith("DEFINE_")):
                keep.append(node)
    return compile(ast.Module(body=keep, type_ignores=[]), str(path), "exec")


def recipe_flag_values(name: str):
    """A fresh absl FlagValues with every flag `recipes/NAME.py` defines."""
    from absl import flags

    from tfmulti.config import flags as config_flags

    fv = flags.FlagValues()
    if name == "train":
        config_flags.define_absl_flags(fv)
    shim = types.SimpleNamespace(**{
        attr: functools.partial(getattr(flags, attr), flag_values=fv)
        for attr in dir(flags) if attr.startswith("DEFINE_")})
    exec(_recipe_defines(name), {"flags": shim})  # noqa: S102  (the recipe's own DEFINEs)
    return fv


def check_recipe(name: str, args: list[str]) -> str:
    """Parses `recipes/NAME.py ARGS` with the recipe's flags; train.py's config is validated."""
    from absl import flags

    from tfmulti.config import flags as config_flags

    args = [a for a in args if a not in FORWARDED]
    shown = f"recipes/{name}.py {' '.join(args)}"
    if HELP_FLAGS & set(args):
        return shown
    fv = recipe_flag_values(name)
    try:  # as recipes/_common.py parses: the tools' flag style first
        rest = fv(config_flags.absl_argv([f"{name}.py", *args], fv))
    except flags.Error as e:
        raise AssertionError(f"{shown}: {e}") from None
    assert rest[1:] == [], f"{shown}: arguments that are not flags: {rest[1:]}"
    if name == "train":
        try:
            config_flags.config_from_absl(fv).validate()
        except ValueError as e:
            raise AssertionError(f"{shown}: {config_flags.flag_message(str(e))}") from None
    return shown


def check_cli(args: list[str]) -> str:
    """Parses `tfmulti ARGS` with the CLI's parser; diagnose's config is
    validated and launch's worker command checked too."""
    from tfmulti import cli
    from tfmulti.config import flags as config_flags
    from tfmulti.config.train_config import TrainConfig, validate_for_diagnose

    args = [a for a in args if a not in FORWARDED]
    shown = f"tfmulti {' '.join(args)}"
    if HELP_FLAGS & set(args[:args.index("--") if "--" in args else len(args)]):
        return shown
    errors = io.StringIO()
    try:
        with contextlib.redirect_stderr(errors):
            namespace = cli.build_parser().parse_args(args)
    except SystemExit:
        raise AssertionError(f"{shown}: {errors.getvalue().strip()}") from None
    if getattr(namespace, "config", None):  # the file's values, then the flags again
        parser = cli.build_parser()
        try:
            config_flags.apply_config_file(cli._subcommands(parser)[namespace.command],
                                           str(REPO / namespace.config))
        except ValueError as e:
            raise AssertionError(f"{shown}: {e}") from None
        namespace = parser.parse_args(args)
    if namespace.command in ("diagnose", "train"):
        validate = validate_for_diagnose if namespace.command == "diagnose" else \
            TrainConfig.validate
        try:
            validate(config_flags.config_from_args(namespace))
        except ValueError as e:
            raise AssertionError(f"{shown}: {config_flags.flag_message(str(e))}") from None
    if namespace.command == "diagnose":
        assert namespace.plot is None or namespace.plot.endswith(".png"), shown
    if namespace.command == "launch":
        worker = namespace.worker_command
        worker = worker[1:] if worker[:1] == ["--"] else worker
        assert worker, f"{shown}: no worker command after --"
        inner = check_words(worker)
        return shown if inner is None else f"{shown} [{inner}]"
    return shown


def check_words(words: list[str]) -> str | None:
    """Checks one simple command if it runs a recipe or `tfmulti`; what it checked."""
    for i, word in enumerate(words):
        name = _recipe_name(word)
        if name is not None:
            return check_recipe(name, words[i + 1:])
        if Path(word).name == "tfmulti" and i + 1 < len(words):
            return check_cli(words[i + 1:])
    return None


_COMMAND_HINT = re.compile(r"recipes/\w+\.py|(?:^|[\s/])tfmulti\s")


@dataclasses.dataclass
class ShCommand:
    block: Block
    line: int  # in the file
    text: str
    skipped: str | None  # the reason given after NOT_CHECKED


def sh_commands(block: Block) -> list[ShCommand]:
    """The command lines of an sh block that run a recipe or `tfmulti`."""
    found = []
    for offset, text in logical_lines(block.code):
        if not _COMMAND_HINT.search(text) or text.lstrip().startswith("#"):
            continue
        reason = text.split(NOT_CHECKED, 1)[1].strip() if NOT_CHECKED in text else None
        found.append(ShCommand(block, block.line + 1 + offset, text, reason))
    return found


SH_BLOCKS = all_blocks("sh")


@pytest.mark.parametrize("block", [pytest.param(b, id=b.id) for b in SH_BLOCKS])
def test_sh_commands_parse(block):
    """Each command parses against the real flags (and train.py's and
    diagnose's configuration validates), without running anything."""
    for command in sh_commands(block):
        if command.skipped is not None:
            assert command.skipped, f"{_where(block.path, command.line)}: {NOT_CHECKED} needs a why"
            continue
        try:
            checked = [check_words(words) for words in shell_words(command.text)]
        except AssertionError as e:
            pytest.fail(f"{_where(block.path, command.line)}: {e}")
        except ValueError as e:  # shlex: unbalanced quotes
            pytest.fail(f"{_where(block.path, command.line)}: cannot split {command.text!r}: {e}")
        assert any(checked), f"{_where(block.path, command.line)}: found no command in " \
                             f"{command.text!r}"


def test_sh_command_checks_cover_the_docs():
    commands = [c for b in SH_BLOCKS for c in sh_commands(b)]
    skipped = [c for c in commands if c.skipped is not None]
    assert len(commands) - len(skipped) >= 20, [c.text for c in commands]
    assert len(skipped) <= MAX_NOT_CHECKED, [_where(c.block.path, c.line) for c in skipped]
    kinds = " ".join(c.text for c in commands)
    for needed in ("recipes/train.py", "tfmulti train", "tfmulti diagnose", "tfmulti launch",
                   "tfmulti estimate-memory", "--config="):
        assert needed in kinds


def test_the_checker_catches_stale_flags():
    with pytest.raises(AssertionError, match="strategy"):
        check_words(["python", "recipes/train.py", "--strategy=mirrored"])
    with pytest.raises(AssertionError, match="global_batch_size"):
        check_words(["python", "recipes/train.py", "--num_virtual_devices=4",
                     "--distribution=hybrid", "--global_batch_size=10"])
    with pytest.raises(AssertionError, match="strategy"):
        check_words(["tfmulti", "estimate-memory", "--strategy", "pipeline"])
    with pytest.raises(AssertionError, match="distribution"):
        check_words(["tfmulti", "diagnose", "--distribution=pipeline"])
    with pytest.raises(AssertionError, match="global_batch_size"):
        check_words(["tfmulti", "train", "--num-virtual-devices=4", "--distribution=hybrid",
                     "--global-batch-size=10"])
    with pytest.raises(AssertionError, match="strategy"):
        check_words(["tfmulti", "train", "--strategy=mirrored"])
    with pytest.raises(AssertionError, match="epochs"):
        check_words(["tfmulti", "launch", "--num_workers", "2", "--", "tfmulti", "train",
                     "--epochs=0"])
    with pytest.raises(AssertionError, match="no_such.yaml"):
        check_words(["tfmulti", "train", "--config=docs/examples/no_such.yaml"])
    assert check_words(["tfmulti", "train", "--config", "docs/examples/train.yaml",
                        "--no-jit-compile", "--epochs", "2"])
    assert check_words(["python", "recipes/train.py", "--no-jit-compile", "--epochs", "2"])
    with pytest.raises(AssertionError, match="epochs"):
        check_words(["tfmulti", "launch", "--num_workers", "2", "--", "python",
                     "recipes/train.py", "--epochs=0"])
    with pytest.raises(AssertionError, match="example"):
        check_words(["python", "recipes/seed_examples.py", "--example=nonsense"])
    assert check_words(["python", "recipes/benchmark.py", "--suite=pipeline"])


# ------------------------------------------------------------- estimate-memory runs

def _estimate_memory_args(block: Block) -> list[list[str]]:
    runs = []
    for command in sh_commands(block):
        for words in shell_words(command.text):
            names = [Path(w).name for w in words]
            if "tfmulti" in names and names[names.index("tfmulti") + 1:][:1] == ["estimate-memory"]:
                runs.append(words[names.index("tfmulti") + 1:])
    return runs


def _following_text_block(block: Block) -> Block | None:
    text = block.path.read_text()
    for other in blocks(block.path):
        if other.start > block.end:
            between = text[block.end:other.start]
            return other if other.lang == "text" and not between.strip() else None
    return None


ESTIMATE_BLOCKS = [b for b in SH_BLOCKS if _estimate_memory_args(b)]
DOCS_PROJECT = REPO / "tests" / "docs_project"


@pytest.mark.parametrize("block", [pytest.param(b, id=b.id) for b in ESTIMATE_BLOCKS])
def test_estimate_memory_commands_run(block, monkeypatch, capsys):
    # In this process (the command's own process start is tested in test_cli.py):
    # an estimate places nothing on a device, so this process's virtual devices
    # do not matter. From the folder of the user's project the docs name
    # (`my_project:build`).
    from tfmulti import cli

    monkeypatch.chdir(DOCS_PROJECT)
    outputs = []
    for args in _estimate_memory_args(block):
        code = cli.main(args)
        out, err = capsys.readouterr()
        assert code == 0, f"{block.id}: tfmulti {' '.join(args)}\n{err}"
        outputs.append(out)
    shown = _following_text_block(block)
    if shown is not None:  # the output the docs show is the real one
        strip = lambda text: [line.rstrip() for line in text.strip().splitlines()]  # noqa: E731
        assert strip("".join(outputs)) == strip(shown.code), shown.id


def test_estimate_memory_is_in_the_docs():
    assert ESTIMATE_BLOCKS


# ------------------------------------------------------------------------ prose


@functools.cache
def known_flags() -> frozenset:
    """Every long flag of recipes/*.py and of the `tfmulti` command (with absl's --noFLAG)."""
    from tfmulti import cli

    names = set(FOREIGN_FLAGS) | {h.lstrip("-") for h in HELP_FLAGS}
    for recipe in sorted(RECIPES.glob("[!_]*.py")):
        fv = recipe_flag_values(recipe.stem)
        for name in fv:
            names.add(name)
            if fv[name].boolean:
                names.add(f"no{name}")
    parser = cli.build_parser()
    for action in parser._subparsers._group_actions:  # noqa: SLF001  (argparse has no public way)
        for sub in action.choices.values():
            names |= {o[2:] for o in sub._option_string_actions if o.startswith("--")}
    return frozenset(names)


def test_inline_flags_exist():
    stale = []
    for path in DOC_FILES:
        for line, span in inline_code(path):
            for m in re.finditer(r"(?<![\w-])--([A-Za-z][\w-]*)", span):
                if m.group(1) not in known_flags():
                    stale.append(f"{_where(path, line)}: --{m.group(1)} in `{span}`")
    assert not stale, "\n".join(stale)


def _resolve(dotted: str):
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ModuleNotFoundError:
            continue
        for attr in parts[i:]:
            obj = getattr(obj, attr)
        return obj
    raise ModuleNotFoundError(dotted)


def _class_members(cls) -> set:
    names = set(dir(cls))
    if dataclasses.is_dataclass(cls):
        names |= {f.name for f in dataclasses.fields(cls)}
    return names


_QUALIFIED = {"TrainConfig": "tfmulti.config.train_config.TrainConfig",
              "PipelineModel": "tfmulti.parallel.pipeline.PipelineModel",
              "Advice": "tfmulti.insight.diagnose.Advice",
              "Diagnosis": "tfmulti.insight.diagnose.Diagnosis",
              "DistributedInput": "tfmulti.data.DistributedInput",
              "StepTimes": "tfmulti.insight.timing.StepTimes"}


def test_inline_tfmulti_names_resolve():
    missing = []
    for path in DOC_FILES:
        for line, span in inline_code(path):
            names = re.findall(r"(?<![\w./])(tfmulti(?:\.\w+)+)", span)
            names += [f"{m}.{n}" for m, n in re.findall(r"from (tfmulti[\w.]*) import (\w+)", span)]
            for name in names:
                try:
                    _resolve(name)
                except (ImportError, AttributeError) as e:
                    missing.append(f"{_where(path, line)}: {name} ({e})")
            for cls, member in re.findall(r"(?<![\w.])(" + "|".join(_QUALIFIED) + r")\.(\w+)",
                                          span):
                if member not in _class_members(_resolve(_QUALIFIED[cls])):
                    missing.append(f"{_where(path, line)}: {cls}.{member}")
    assert not missing, "\n".join(missing)


_REPO_PATH = re.compile(r"(?<![\w./<-])((?:tfmulti|recipes|tests|notebooks|docs|\.ci)/[\w./-]*\w"
                        r"|setup\.cfg|Makefile|pyproject\.toml)(?![\w/<])")


def test_inline_repository_paths_exist():
    missing = []
    for path in DOC_FILES:
        for line, span in inline_code(path):
            for name in _REPO_PATH.findall(span):
                if not (REPO / name).exists():
                    missing.append(f"{_where(path, line)}: {name}")
    assert not missing, "\n".join(missing)


def github_slug(heading: str) -> str:
    """GitHub's anchor for a heading (README.md and BENCHMARKS.md are read there too)."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link: its text
    return re.sub(r"[^\w\- ]", "", text.strip().lower()).replace(" ", "-")


@functools.cache
def _mkdocs_config() -> dict:
    import yaml

    return yaml.safe_load(MKDOCS_YML.read_text())


def _markdown(page: Path):
    """A Markdown converter for PAGE as the site has it: the extensions of
    mkdocs.yml (the snippets' base paths from the repository's root) and the
    site's hook for Markdown written for the repository."""
    import markdown

    names, configs = [], {}
    for entry in _mkdocs_config()["markdown_extensions"]:
        name, options = next(iter(entry.items())) if isinstance(entry, dict) else (entry, None)
        names.append(name)
        if options:
            configs[name] = dict(options)
    if "pymdownx.snippets" in configs:
        snippets = configs["pymdownx.snippets"]
        snippets["base_path"] = [str(REPO / b) for b in snippets.get("base_path", ["."])]
    hook = _site_hook().RepositoryMarkdown(page.relative_to(DOCS_DIR).as_posix())
    return markdown.Markdown(extensions=[*names, hook], extension_configs=configs)


def _toc_ids(tokens) -> set:
    ids = set()
    for token in tokens:
        ids |= {token["id"]} | _toc_ids(token["children"])
    return ids


@functools.cache
def site_anchors(path: Path) -> frozenset:
    """The ids of a page's headings on the site: MkDocs' table of contents."""
    md = _markdown(path)
    md.convert(path.read_text())
    return frozenset(_toc_ids(md.toc_tokens))


@functools.cache
def anchors(path: Path) -> frozenset:
    """The #anchors a link to PATH may use: the site's, and for the files read
    on the repository's web page, only those that GitHub makes the same."""
    ids = site_anchors(path) if DOCS_DIR in path.parents else frozenset()
    if path in ROOT_FILES:
        github = {github_slug(m.group(1)) for m in re.finditer(r"^#+ (.+)$", prose(path), re.M)}
        ids = frozenset(github) if path == README else frozenset(github) & _included_anchors(path)
    return ids


def _included_anchors(root_file: Path) -> frozenset:
    """The site's anchors of a root file on the page that includes it."""
    for page in SITE_PAGES:
        if any(include == root_file for _, include in includes(page)):
            return site_anchors(page)
    return frozenset()


_INCLUDE = re.compile(r'^--8<-- "([^"]+)"\s*$', re.M)


def includes(page: Path) -> list[tuple[int, Path]]:
    """(line, file) of the repository's files a page includes (pymdownx.snippets)."""
    text = page.read_text()
    return [(text.count("\n", 0, m.start()) + 1, REPO / m.group(1))
            for m in _INCLUDE.finditer(text)]


@functools.cache
def _site_hook() -> types.ModuleType:
    """The site's hook (mkdocs.yml), docs/_hooks/repository_markdown.py."""
    spec = importlib.util.spec_from_file_location("repository_markdown", DOCS_DIR / "_hooks" /
                                                  "repository_markdown.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def links(path: Path) -> list[tuple[int, str]]:
    found = []
    for number, line in enumerate(prose(path).splitlines(), 1):
        line = re.sub(r"`[^`\n]*`", "", line)
        found += [(number, m.group(1)) for m in re.finditer(r"\]\(([^)\s]+)\)", line)]
    return found


@dataclasses.dataclass(frozen=True)
class Link:
    where: str
    target: str
    base: Path  # the folder the target is relative to
    on_site: bool  # a link of a site page: it must lead to a page of the site


def all_links(path: Path) -> list[Link]:
    """The relative links a reader follows from PATH: its own, and on a site
    page those of the root files it includes, as the hook rewrites them."""
    on_site = DOCS_DIR in path.parents
    found = [Link(_where(path, line), target, path.parent, on_site)
             for line, target in links(path) if not re.match(r"[a-z]+:", target)]
    if on_site:
        uri = path.relative_to(DOCS_DIR).as_posix()
        for line, included in includes(path):
            for inner_line, target in links(included):
                if re.match(r"[a-z]+:", target):
                    continue
                found.append(Link(f"{_where(path, line)} ({_where(included, inner_line)})",
                                  _site_hook().site_target(target, uri), path.parent,
                                  True))
    return found


def _api_anchor(page: Path, anchor: str) -> bool:
    """An anchor mkdocstrings makes on PAGE: a `::: name` there, or a member of
    it, that resolves (`api.md#tfmulti.TrainConfig.validate`)."""
    documented = re.findall(r"^::: ([\w.]+)", page.read_text(), re.M)
    if not any(anchor == name or anchor.startswith(f"{name}.") for name in documented):
        return False
    try:
        _resolve(anchor)
    except (ImportError, AttributeError):
        return False
    return True


def test_relative_links_resolve():
    broken = []
    for path in DOC_FILES:
        for link in all_links(path):
            file, _, anchor = link.target.partition("#")
            goal = Path(os.path.normpath(link.base / file)) if file else path
            if not goal.exists():
                broken.append(f"{link.where}: {link.target}")
            elif link.on_site and file and DOCS_DIR not in goal.parents:
                broken.append(f"{link.where}: {link.target} (outside docs/: not on the site; "
                              f"name the file as code, `{goal.relative_to(REPO)}`)")
            elif anchor and goal.suffix == ".md" and anchor not in anchors(goal) \
                    and not _api_anchor(goal, anchor):
                broken.append(f"{link.where}: {link.target} (no such heading)")
    assert not broken, "\n".join(broken)


def test_the_link_checker_reads_the_site():
    page = DOCS_DIR / "how-to" / "own_model.md"
    assert "../concepts/data.md" in {link.target.partition("#")[0] for link in all_links(page)}
    assert "no-such-heading" not in anchors(DOCS_DIR / "concepts" / "data.md")
    assert "files" in anchors(DOCS_DIR / "concepts" / "data.md")
    api = DOCS_DIR / "reference" / "api.md"
    assert _api_anchor(api, "tfmulti.TrainConfig.validate")
    assert not _api_anchor(api, "tfmulti.TrainConfig.no_such_member")
    hook = _site_hook()
    assert hook.site_target("docs/how-to/slurm.md#notes", "benchmarks.md") == \
        "how-to/slurm.md#notes"
    assert hook.site_target("README.md", "benchmarks.md") == "index.md"
    assert hook.site_target("recipes/train.py", "benchmarks.md") == "recipes/train.py"


def test_the_site_reads_the_fences_as_the_tests_do():
    """Each page's code blocks on the site are the blocks the docs tests read,
    and its headings those outside them (no fence the site misreads, showing
    the code as text and its comments as headings)."""
    wrong = []
    for page in SITE_PAGES:
        sources = [page, *(included for _, included in includes(page))]
        headings = len(re.findall(r"^#{1,6} ", "".join(prose(p) for p in sources), re.M))
        fenced = sum(len(blocks(p)) for p in sources)
        md = _markdown(page)
        html = md.convert(page.read_text())
        shown = len(_toc_list(md.toc_tokens))
        if (shown, html.count("<pre")) != (headings, fenced):
            wrong.append(f"{page.relative_to(REPO)}: {shown} headings and {html.count('<pre')} "
                         f"code blocks on the site, {headings} and {fenced} in the file")
    assert not wrong, "\n".join(wrong)


def _toc_list(tokens) -> list:
    return [t for token in tokens for t in [token, *_toc_list(token["children"])]]


def _nav_paths(entries) -> list[str]:
    paths = []
    for entry in entries:
        value = next(iter(entry.values())) if isinstance(entry, dict) else entry
        paths += _nav_paths(value) if isinstance(value, list) else [value]
    return paths


def _not_in_nav() -> list[str]:
    return [line.strip().lstrip("/") for line in
            (_mkdocs_config().get("not_in_nav") or "").splitlines() if line.strip()]


def test_every_page_is_in_the_nav():
    nav = _nav_paths(_mkdocs_config()["nav"])
    missing = [p for p in nav if not (DOCS_DIR / p).exists()]
    assert not missing, f"mkdocs.yml's nav names pages that do not exist: {missing}"
    assert len(nav) == len(set(nav)), "a page twice in the nav"
    pages = [p.relative_to(DOCS_DIR).as_posix() for p in SITE_PAGES]
    pages += [f"notebooks/{p.name}" for p in sorted((REPO / "notebooks").glob("*.ipynb"))]
    outside = [p for p in pages if p not in nav and p not in _not_in_nav()]
    assert not outside, f"pages of docs/ in neither the nav nor not_in_nav: {outside}"


def test_readme_links_into_every_section_of_the_site():
    linked = {(README.parent / t.split("#")[0]).resolve() for _, t in links(README)}
    # a root file the site includes (BENCHMARKS.md) is read here as its page
    linked |= {page.resolve() for page in SITE_PAGES
               if any(included.resolve() in linked for _, included in includes(page))}
    for section in _mkdocs_config()["nav"]:
        title, value = next(iter(section.items()))
        pages = _nav_paths(value) if isinstance(value, list) else [value]
        assert any((DOCS_DIR / p).resolve() in linked for p in pages), \
            f"README.md links to no page of the site's section {title!r}"
    for page in ("get-started/install.md", "get-started/first-run.md"):
        assert (DOCS_DIR / page).resolve() in linked, page


def test_readme_is_at_most_250_lines():
    lines = len(README.read_text().splitlines())
    assert lines <= README_MAX_LINES, f"README.md has {lines} lines"
