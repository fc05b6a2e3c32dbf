"""``tba`` command line: ``tba train CONFIG [--section.field VALUE | section.field=VALUE ...]``."""

from __future__ import annotations

import argparse
import difflib
import shutil
import signal
import sys
import textwrap
import types
import typing
from pathlib import Path

from tba.config import (
    Config,
    ConfigError,
    dump_config,
    field_names,
    iter_fields,
    load_config,
    parse_assignments,
    parse_value,
    unknown_field,
)

SHORTCUTS = {"--max-steps": "trainer.max_steps", "--ray-address": "run.ray_address",
             "--output-dir": "run.output_dir", "--mode": "run.mode", "--seed": "run.seed"}


class _TrainParser(argparse.ArgumentParser):
    """``tba train``'s parser; its help ends with every task's options (imported only when help is shown)."""

    def format_help(self) -> str:
        width = shutil.get_terminal_size().columns - 2
        self.description = textwrap.fill(" ".join(self.description.split()), max(width, 60))
        self.epilog = task_options_help(width)
        return super().format_help()


def type_name(ann) -> str:
    """``Optional[int]`` -> ``int|null``, ``Literal['a', 'b']`` -> ``a|b``, ``list[str]`` -> ``list[str]``: a
    field's type as ``tba train --help`` and the configuration reference (docs/hooks.py) print it."""
    origin, args = typing.get_origin(ann), typing.get_args(ann)
    if origin is typing.Literal:
        return "|".join(map(str, args))
    if origin in (typing.Union, types.UnionType):
        return "|".join("null" if a is type(None) else type_name(a) for a in args)
    if origin is not None:
        return f"{origin.__name__}[{', '.join(map(type_name, args))}]"
    return getattr(ann, "__name__", str(ann))


def task_option_fields() -> dict[str, tuple[str | None, dict]]:
    """Every task's ``task.options`` by ``task.name``: ``(note, fields)``, with ``fields`` the pydantic fields of
    its ``Options`` model and ``note`` what to print instead when it has none (the free dict's docstring, or
    'none'), else None. The one source of the options part of ``tba train --help`` and of the reference."""
    from tba.tasks import task_classes

    out = {}
    for name, cls in task_classes().items():
        fields = cls.Options.model_fields
        note = None
        if not fields:  # none, or a free dict (reasoning-gym: the dataset's own settings)
            free = cls.Options.model_config.get("extra") == "allow"
            note = " ".join((cls.Options.__doc__ or "").split()) if free else "none"
        out[name] = (note, fields)
    return out


def task_options_help(width: int = 100) -> str:
    """The ``task.options`` of every task, a section per task: ``name: type``, description and default, laid
    out as argparse lays out the config fields above them."""
    width = max(width, 60)
    lines = textwrap.wrap("task options: set as task.options.NAME=VALUE (YAML: task: {options: {NAME: VALUE}}); "
                          "each task takes its own, checked before anything starts.", width)
    wrap = textwrap.TextWrapper(width=width, initial_indent=" " * 24, subsequent_indent=" " * 24)
    for name, (note, fields) in task_option_fields().items():
        lines += ["", f"task.options of {name}:"]
        if note is not None:
            lines += textwrap.wrap(note, width, initial_indent="  ", subsequent_indent="  ")
        for field, info in fields.items():
            left = f"  {field}: {type_name(info.annotation)}"
            body = wrap.wrap(f"{info.description or ''} [default: {info.get_default(call_default_factory=True)!r}]")
            lines += [left, *body] if len(left) > 22 else [left.ljust(24) + body[0][24:], *body[1:]]
    return "\n".join(lines)


def _train_parser() -> argparse.ArgumentParser:
    """``tba train``'s argparse parser: one flag per config field, in a group per config section."""
    p = _TrainParser(
        prog="tba train",
        usage="tba train [CONFIG] [--section.field V | section.field=V ...] [--resume RUN_DIR] [--print-config]",
        description="Post-train a causal LM with TBA: searchers -> replay buffer -> trainer -> weights back. "
        "Every config field can be set in the YAML file or overridden here as --section.field VALUE or "
        "section.field=VALUE (values are parsed as YAML: 1e-5, true, null, [1, 2]).",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        allow_abbrev=False,  # --trainer.warm is a typo to report, not trainer.warmup_steps
    )
    p.add_argument("config", nargs="?", help="YAML config file (e.g. configs/quickstart.yaml); omitted = defaults")
    p.add_argument("assignments", nargs="*", help="overrides as section.field=VALUE")
    p.add_argument("--resume", metavar="RUN_DIR", default=None,
                   help="continue RUN_DIR from its checkpoint to trainer.max_steps (its config.yaml + overrides)")
    p.add_argument("--print-config", action="store_true",
                   help="print the resolved config (YAML, overrides applied) and exit without starting anything")
    short = p.add_argument_group("shortcuts")
    for flag, dotted in SHORTCUTS.items():
        short.add_argument(flag, dest=dotted, default=argparse.SUPPRESS, metavar="V", help=f"same as --{dotted}")
    groups = {}
    for dotted, info in iter_fields():
        section = dotted.split(".", 1)[0]
        if section not in groups:
            doc = Config.model_fields[section].annotation.__doc__
            groups[section] = p.add_argument_group(section, " ".join((doc or "").split()) or None)
        default = info.get_default(call_default_factory=True)
        groups[section].add_argument(f"--{dotted}", dest=dotted, default=argparse.SUPPRESS, metavar="V",
                                     help=f"{info.description or ''} [default: {default!r}]")
    return p


class TrainArgs(typing.NamedTuple):
    """``tba train``'s arguments: the config path, the dotted overrides, the run to resume, --print-config."""

    config: str | None
    overrides: dict
    resume: str | None
    print_config: bool


def parse_train_args(argv: list[str]) -> TrainArgs:
    """Split ``tba train`` arguments into the config path, a dict of dotted overrides, the resume dir and
    whether to only print the config. ``--task.options.KEY V`` is ``task.options.KEY=V``.

    Raises:
        ConfigError: an assignment without '=', or a flag that is no config field (the message suggests the
            closest one: ``unknown field trainer.lrr; did you mean trainer.lr?``).
    """
    known = {"-h", "--help", "--resume", "--print-config", *SHORTCUTS, *(f"--{d}" for d in field_names())}
    ns = vars(_train_parser().parse_intermixed_args(_check_flags(argv, known)))
    config = ns.pop("config")
    assignments = ns.pop("assignments")
    resume = ns.pop("resume")
    print_config = ns.pop("print_config")
    if config and "=" in config:  # `tba train trainer.lr=1e-5` with no config file
        assignments, config = [config, *assignments], None
    overrides = {**{k: parse_value(v) for k, v in ns.items()}, **parse_assignments(assignments)}
    if resume and config is None:
        config = str(Path(resume) / "config.yaml")
    return TrainArgs(config, overrides, resume, print_config)


def _check_flags(argv: list[str], known: set[str]) -> list[str]:
    """``argv`` with every ``--task.options.KEY V`` turned into ``task.options.KEY=V``.

    Raises:
        ConfigError: a ``--flag`` the parser does not know, with the closest known one.
    """
    out, options, rest = [], [], iter(argv)  # options after every positional: CONFIG stays the first
    for arg in rest:
        name, eq, value = arg[2:].partition("=")
        if arg == "--":
            out += [arg, *rest]
        elif not arg.startswith("--") or f"--{name}" in known:
            out.append(arg)
        elif name.startswith("task.options.") and len(name) > len("task.options."):
            value = value if eq else next(rest, None)
            if value is None:
                raise ConfigError(f"--{name} needs a value")
            options.append(f"{name}={value}")
        elif "." in name:
            raise unknown_field(name)
        else:  # --lr: a field's name without its section, or a misspelt option (--max-step)
            leaf = [f"--{d}" for d in field_names() if d.rsplit(".", 1)[-1] == name]
            close = leaf or difflib.get_close_matches(f"--{name}", sorted(known), n=1)
            raise ConfigError(f"unknown option --{name}" + (f"; did you mean {close[0]}?" if close else ""))
    return out + options


def _fmt3(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.3f}"


def print_summary(s: dict) -> None:
    """Human-readable end-of-run summary."""
    lines = ["", "== tba summary =="]
    before, after = s.get("eval_before", {}), s.get("eval_after", {})
    for key in [k for k in {**before, **after} if k not in ("n", "stderr")]:
        b, a = before.get(key), after.get(key)
        gain = f" (change {a - b:+.3f})" if a is not None and b is not None else ""
        noise = (f", eval stderr {after['stderr']:.3f} on {after['n']} problems"
                 if key == "accuracy" and "stderr" in after else "")
        lines.append(f"eval {key}: before {_fmt3(b)} -> after {_fmt3(a)}{gain}{noise}")
    lines += [
        f"trainer steps: {s['trainer_steps']}   samples generated: {s['samples_generated']}",
        f"wall time: {s['wall_s']:.0f} s (training {s['train_wall_s']:.0f} s"
        + (f", trainer idle {s['trainer_idle_frac']:.1%} of it)" if s.get("trainer_idle_frac") is not None else ")"),
        f"staleness (trainer step - policy version): mean {s['staleness_mean']:.2f}, max {s['staleness_max']:.0f}",
        f"searchers: newest policy version received {s['searcher_max_version']}, restarts {s['searcher_restarts']}, "
        f"reward failures {s['reward_failures']}"
        + (f"\nwarning: {s['sync_gap_warnings']} sync checks found a searcher engine's log-probs far from the "
           "trainer's or not moving with them: published weights may not have reached it; see the log"
           if s.get("sync_gap_warnings") else ""),
        f"run directory: {s['run_dir']}" + (f" (library logs: {Path(s['library_log']).name}, each warning shown "
                                            "above once)" if Path(s.get("library_log", "")).is_file() else ""),
    ]
    print("\n".join(lines), flush=True)


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``tba`` command; returns the process exit code."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: tba train CONFIG [overrides]   (tba train --help lists every config field)")
        return 0 if argv else 2
    command, rest = argv[0], argv[1:]
    if command != "train":
        print(f"error: unknown command '{command}'; use 'tba train'", file=sys.stderr)
        return 2
    from tba.logger import remove_routes, route_console

    route_console()  # tba's lines, and each distinct library warning once; library logs go to the run dir
    try:
        return _train(rest)
    finally:
        remove_routes()


def _train(rest: list[str]) -> int:
    """``tba train REST``: runs and prints the summary (or, with --print-config, the config), or prints one
    error line; returns the exit code."""
    try:
        args = parse_train_args(rest)
        cfg = load_config(args.config, args.overrides)
    except (ConfigError, OSError) as e:  # OSError: the config file does not exist
        print(f"error: {e}", file=sys.stderr)
        return 2 if isinstance(e, ConfigError) else 1
    if args.print_config:
        print(dump_config(cfg), end="", flush=True)
        return 0
    return _run_and_report(cfg, args.resume)


def _run_and_report(cfg: Config, resume: str | None) -> int:
    from tba.api import raise_interrupt, train
    from tba.models import ModelLoadError
    from tba.runtime.cadence import NoSamples, TooManySkippedSteps

    try:
        signal.signal(signal.SIGTERM, raise_interrupt)  # SIGTERM checkpoints and cleans up like Ctrl-C
        # a shell starts background jobs with SIGINT ignored; `kill -INT` must still stop such a run cleanly
        signal.signal(signal.SIGINT, signal.default_int_handler)
        summary = train(cfg, resume_dir=resume)
    except KeyboardInterrupt:
        print("\ninterrupted; all actors stopped", file=sys.stderr)
        return 130
    except TooManySkippedSteps as e:
        print(f"error: {e} (a checkpoint was saved)", file=sys.stderr)
        return 1
    except (ConfigError, ModelLoadError, NoSamples, OSError, ValueError, TimeoutError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2 if isinstance(e, ConfigError) else 1
    except Exception as e:  # noqa: BLE001 - one line for the user; the Ray traceback is already logged
        msg = str(e).strip().splitlines()
        print(f"error: {type(e).__name__}: {msg[-1] if msg else ''}", file=sys.stderr)
        return 1
    print_summary(summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())
