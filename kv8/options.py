"""How kv8's user options are declared: once each, as dataclass fields carrying their help and allowed values.

* :func:`option` declares an option where it lives: in the config class whose field it is
  (``CacheConfig.block_size``), or in an argument group (:class:`kv8.engine.args.EngineArgs`,
  :class:`kv8.entrypoints.openai.cli_args.ServerArgs`) when no config holds it as given (``EngineArgs.dtype`` is a name
  the engine turns into a torch dtype).
* :func:`from_config` declares an argument-group field *as* a config field: its default, help, allowed values and
  flag type are the config field's, so the two cannot drift apart, and the config's ``__post_init__`` is the
  option's one validation. ``tests/test_options.py`` fails on an option whose default is written twice.
* :class:`OptionGroup`, the base of the argument groups, generates from the fields what every entry point needs:
  one command-line flag per field (:meth:`OptionGroup.add_cli_args`; booleans as ``--x`` / ``--no-x``),
  reading them back (:meth:`OptionGroup.from_cli_args`) and the table of options (:meth:`OptionGroup.describe`).
  ``LLM(**kwargs)`` takes the same names.

The allowed values are the tuples the configs check against; argparse's ``choices`` only report a bad flag
earlier, with the same list.
"""

from __future__ import annotations

import argparse
import shlex
from collections.abc import Callable, Iterable, Mapping
from dataclasses import MISSING, Field, field, fields
from typing import Any, ClassVar, NoReturn

__all__ = ["OptionGroup", "from_config", "option"]


def option(default: Any, help: str, *, choices: tuple[Any, ...] | None = None,
           type: Callable[[str], Any] | None = str, metavar: str | None = None, nargs: str | None = None,
           cli: bool = True) -> Any:
    """A field declaring one option: its default plus what the command line and :meth:`OptionGroup.describe`
    need. ``type`` converts a flag's text (``bool`` makes a ``--x`` / ``--no-x`` pair; ``nargs="+"`` takes one or
    more values, the field's default then being a tuple); ``choices`` is the tuple the value is checked against;
    ``cli=False`` marks a field each command declares itself (the model, which is positional for some
    commands)."""
    return field(default=default, metadata={"help": help, "choices": choices, "type": type, "metavar": metavar,
                                            "nargs": nargs, "cli": cli, "source": None})


def from_config(config: type, name: str, *, type: Callable[[str], Any] | None = None) -> Any:
    """An argument-group field that is ``config``'s field ``name`` (declared there with :func:`option`): the
    same default, help and choices; ``type`` replaces the flag's converter where the group accepts a wider form
    that the engine converts (a memory size as ``"2GiB"``)."""
    declared: Field[Any] = config.__dataclass_fields__[name]   # type: ignore[attr-defined]
    if declared.default is MISSING or "help" not in declared.metadata:
        raise TypeError(f"{config.__name__}.{name} is not declared with option(): it has no default or no help")
    metadata = dict(declared.metadata)
    metadata["source"] = f"{config.__name__}.{name}"
    if type is not None:
        metadata["type"] = type
    return field(default=declared.default, metadata=metadata)


class OptionGroup:
    """Mixin of the option dataclasses: the flags and the description generated from their fields."""

    #: title of the group in ``--help``
    cli_group_title: ClassVar[str] = "options"

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in fields(cls)]   # type: ignore[arg-type]

    @staticmethod
    def flag(name: str) -> str:
        """The flag of field ``name``: ``kv_cache_dtype`` -> ``--kv-cache-dtype``."""
        return "--" + name.replace("_", "-")

    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser, *, include: Iterable[str] | None = None,
                     exclude: Iterable[str] = (), defaults: Mapping[str, Any] | None = None,
                     aliases: Mapping[str, tuple[str, ...]] | None = None) -> argparse._ArgumentGroup:
        """Add one flag per field (those in ``include`` if given, less ``exclude``) to a group of ``parser``.

        ``defaults`` overrides a field's default for this parser (a command that needs another default says so
        here, in one place); ``aliases`` gives a field more flags (``-dp`` for ``--data-parallel-size``). Fields
        declared with ``cli=False`` are left to the command. Returns the argument group.
        """
        by_name = {f.name: f for f in fields(cls)}   # type: ignore[arg-type]
        chosen = set(by_name) if include is None else set(include)
        excluded = set(exclude)
        defaults = dict(defaults or {})
        aliases = dict(aliases or {})
        unknown = (chosen | excluded | set(defaults) | set(aliases)) - set(by_name)
        if unknown:
            raise ValueError(f"not {cls.__name__} fields: {', '.join(sorted(unknown))}")
        if set(defaults) & excluded or set(defaults) - chosen:
            raise ValueError(f"defaults {sorted(defaults)} name fields this parser does not offer")
        group = parser.add_argument_group(cls.cli_group_title)
        for name, f in by_name.items():
            if name not in chosen or name in excluded or not f.metadata["cli"]:
                continue
            default = defaults.get(name, f.default)
            choices, kind = f.metadata["choices"], f.metadata["type"]
            if choices is not None and default is not None and default not in choices:
                raise ValueError(f"default {name}={default!r} is not one of: {', '.join(map(str, choices))}")
            shown = "" if default in (None, ()) else " (default: %(default)s)"
            help_text = f.metadata["help"].replace("%", "%%") + shown
            kwargs: dict[str, Any] = dict(dest=name, default=default, help=help_text)
            if kind is bool:
                kwargs["action"] = argparse.BooleanOptionalAction
            else:
                kwargs.update(type=kind, choices=choices, metavar=f.metadata["metavar"])
                if f.metadata["nargs"] is not None:
                    kwargs["nargs"] = f.metadata["nargs"]
            group.add_argument(cls.flag(name), *aliases.get(name, ()), **kwargs)
        return group

    @classmethod
    def parse_flags(cls, text: str, *, include: Iterable[str] | None = None, what: str = "flags") -> dict[str, Any]:
        """The options given in ``text``, one string of this group's flags (``"--kv-cache-dtype fp8
        --kv-cache-rotation hadamard"``, shell-quoted as on a command line), as ``{field: value}`` with only the
        fields it names: a configuration that overrides some options. Only the fields in ``include`` (default:
        all) may appear; ``ValueError`` names ``what`` was given, the flag and the allowed ones."""
        parser = _RaisingParser(prog=what, add_help=False)
        group = cls.add_cli_args(parser, include=include)
        for action in group._group_actions:
            action.default = argparse.SUPPRESS   # the namespace then holds only the flags given
        try:
            ns = parser.parse_args(shlex.split(text))
        except ValueError as e:
            allowed = ", ".join(a.option_strings[0] for a in group._group_actions)
            raise ValueError(f"{what} {text!r}: {e} (allowed: {allowed})") from None
        return vars(ns)

    @classmethod
    def from_cli_args(cls, ns: argparse.Namespace) -> Any:
        """The fields the namespace has (flags from :meth:`add_cli_args`, and those a command declares itself);
        the others keep their defaults."""
        return cls(**{name: getattr(ns, name) for name in cls.field_names() if hasattr(ns, name)})

    @classmethod
    def describe(cls) -> str:
        """A table of every option: name, flag, default, allowed values, help and where it is declared."""
        lines = [f"{cls.__name__} options ({cls.cli_group_title}):"]
        for f in fields(cls):   # type: ignore[arg-type]
            default = f.default if f.default is not MISSING else None
            flag = cls.flag(f.name) if f.metadata["cli"] else "(given by each command)"
            if f.metadata["type"] is bool:
                flag = flag.replace("--", "--[no-]", 1)
            source = f" (declared as {f.metadata['source']})" if f.metadata.get("source") else ""
            lines.append(f"  {f.name:<32} {flag:<40} default {default!r}{source}")
            lines.append(f"      {f.metadata['help']}")
            if f.metadata["choices"]:
                lines.append(f"      one of: {', '.join(map(str, f.metadata['choices']))}")
        return "\n".join(lines)


class _RaisingParser(argparse.ArgumentParser):
    """argparse that raises ``ValueError`` instead of printing usage and exiting."""

    def error(self, message: str) -> NoReturn:
        raise ValueError(message)
