"""mkdocs hooks (``hooks:`` in mkdocs.yml), run by ``mkdocs build``; not a page (``exclude_docs``).

- ``configuration.md`` is generated at build time from the config classes' field declarations
  (:func:`tba.config.iter_fields`) and every task's ``Options`` model (:func:`tba.cli.task_option_fields`): the
  source ``tba train --help`` prints, so each default and its explanation are written once, in the code.
- The repository's own reports outside ``docs/`` (README.md, benchmarks/README.md, the benchmark tables,
  figures and top-level JSON results) are mounted under ``repo/`` as they are, so the site shows them without
  copies; a docs page links to them as ``../README.md`` (right on GitHub too), which :func:`on_page_markdown`
  points at ``repo/README.md``; a mounted file's links into ``docs/`` (``docs/usage.md`` in the README) point
  at the site's pages.
"""

from __future__ import annotations

import posixpath
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MOUNT = "repo"
#: repository files the site carries under ``repo/`` (one level of results folders: their runs/ stay out)
MOUNTED = ("README.md", "benchmarks/README.md", "benchmarks/results/*.md", "benchmarks/results/*.json",
           "benchmarks/results/*/*.md", "benchmarks/results/*/*.png")

_CODE_SPAN = re.compile(r"(`[^`]*`)")
_SPECIAL = re.compile(r"([\\*_<>|\[\]])")


def _text(s: str) -> str:
    """Plain text for a table cell: markdown's special characters escaped outside the text's code spans."""
    parts = _CODE_SPAN.split(" ".join(s.split()))
    return "".join(p if p.startswith("`") else _SPECIAL.sub(r"\\\1", p) for p in parts)


def _row(name: str, info) -> str:
    """One field's table row: name, type, default (as ``tba train --help`` prints it), description."""
    from tba.cli import type_name

    default = repr(info.get_default(call_default_factory=True))
    return f"| `{name}` | `{type_name(info.annotation)}` | `{default}` | {_text(info.description or '')} |"


_HEADER = ["| field | type | default | description |", "|---|---|---|---|"]


def config_reference() -> str:
    """The configuration reference page (markdown): a section per config section, a row per field (name, type,
    default, description), then each task's ``task.options``; all read from the code."""
    from tba.cli import SHORTCUTS, task_option_fields
    from tba.config import Config, iter_fields

    out = [
        "# Configuration reference", "",
        "Every field of a run's config, generated when the site is built from the declarations in "
        "`src/tba/config.py` and in each task's options model: the same text `tba train --help` prints. "
        "Set a field in the YAML file (`trainer: {lr: 2e-5}`) or on the command line as "
        "`--trainer.lr 2e-5` or `trainer.lr=2e-5` (values are parsed as YAML). Defaults are shown as "
        "`--help` prints them, as Python values: `None` is YAML `null`, `True`/`False` are `true`/`false`. "
        "A run writes its resolved config to `RUN_DIR/config.yaml`.", "",
        "Short flags: " + ", ".join(f"`{flag}` (`--{dotted}`)" for flag, dotted in SHORTCUTS.items()) + ".",
    ]
    fields = list(iter_fields())
    for section, info in Config.model_fields.items():
        doc = " ".join((info.annotation.__doc__ or "").split())
        out += ["", f"## `{section}`", "", *([doc, ""] if doc else []), *_HEADER]
        out += [_row(dotted, f) for dotted, f in fields if dotted.split(".", 1)[0] == section]
    out += ["", "## Task options (`task.options`)", "",
            "Set as `task.options.NAME=VALUE` (YAML: `task: {options: {NAME: VALUE}}`); each task takes its "
            "own, checked before anything starts."]
    for task, (note, opts) in task_option_fields().items():
        out += ["", f"### `{task}`", ""]
        if note is not None:
            out += ["No options." if note == "none" else _text(note)]
        if opts:
            out += [*_HEADER, *(_row(f"task.options.{name}", f) for name, f in opts.items())]
    return "\n".join(out) + "\n"


def on_files(files, config):
    """Add the generated configuration reference and the mounted repository files to the build."""
    from mkdocs.structure.files import File, InclusionLevel

    files.append(File.generated(config, "configuration.md", content=config_reference()))
    for pattern in MOUNTED:  # reached by links; only the two READMEs are in the nav
        for path in sorted(ROOT.glob(pattern)):
            files.append(File.generated(config, f"{MOUNT}/{path.relative_to(ROOT).as_posix()}",
                                        abs_src_path=str(path), inclusion=InclusionLevel.NOT_IN_NAV))
    return files


_LINK = re.compile(r"\]\(([^)#\s]+)(#[^)\s]*)?\)")


def _docs_link(uri: str, markdown: str) -> str:
    """In a mounted repository file ``repo/<path>``, a relative link into ``docs/`` (``docs/usage.md`` from the
    README, as GitHub resolves it) points at the site's own page (``../usage.md``)."""
    here = posixpath.dirname(uri)  # repo/... in the site
    base = posixpath.dirname(uri.removeprefix(f"{MOUNT}/"))  # the same folder in the repository

    def fix(m: re.Match) -> str:
        target = posixpath.normpath(posixpath.join(base, m.group(1)))
        if "://" in m.group(1) or not target.startswith("docs/"):
            return m.group(0)
        return f"]({posixpath.relpath(target.removeprefix('docs/'), here)}{m.group(2) or ''})"

    return _LINK.sub(fix, markdown)


def on_page_markdown(markdown, page, config, files):
    """In the pages of ``docs/`` (all at its top level), a link ``../X`` (a repository file, as GitHub resolves
    it) points at the mounted copy ``repo/X``; in a mounted file, a link into ``docs/`` points at the site's
    page. The build's link check then finds the target or fails."""
    if page.file.src_uri.startswith(f"{MOUNT}/"):
        return _docs_link(page.file.src_uri, markdown)
    if page.file.generated_by:
        return markdown
    return re.sub(r"\]\(\.\./", f"]({MOUNT}/", markdown)
