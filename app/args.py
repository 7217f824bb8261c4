"""Sampling options as each interface takes them, all made from SamplingParams' fields (core.types):
the flags of `run`, `chat` and `batch`, the fields of a `kvchat batch` line, and the chat's settings
screen. A new option is a new field there, and appears everywhere at once."""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
from pathlib import Path

from core.types import SamplingParams
from models.errors import BadInputError

OPTIONS = [f for f in dataclasses.fields(SamplingParams)]
BATCH_OPTIONS = [f for f in OPTIONS if f.metadata["in_batch"]]
SETTINGS_OPTIONS = [f for f in OPTIONS if f.name in SamplingParams().settings()]   # one value each: a text field
# what `kvchat chat` takes on its command line (its sampling comes from each chat's settings)
FORMAT_OPTIONS = [f for f in OPTIONS if f.name in ("json_schema", "grammar")]


def flags(f: dataclasses.Field) -> list[str]:
    return f.metadata["flag"].split("/") if f.metadata["flag"] else ["--" + f.name.replace("_", "-")]


def human(f: dataclasses.Field) -> str:
    """The option's name as people type it: 'top-k'."""
    return f.name.replace("_", "-")


def label(f: dataclasses.Field) -> str:
    """The option's name with its hint: 'top-k (0 = off)'."""
    hint = f.metadata["hint"]
    return human(f) + (f" ({hint})" if hint else "")


def add_sampling_args(p: argparse.ArgumentParser, options: list[dataclasses.Field] = OPTIONS) -> None:
    for f in options:
        m = f.metadata
        if m["repeat"]:
            p.add_argument(*flags(f), dest=f.name, action="append", default=[], metavar=m["metavar"], help=m["help"])
            continue
        if f.default is None:      # no value: the hint speaks of the settings screen's empty field
            notes = []
        else:
            notes = ([m["hint"]] if m["hint"] else []) + [f"default: {f.default}"]
        p.add_argument(*flags(f), dest=f.name, type=m["kind"], default=f.default, metavar=m["metavar"],
                       help=m["help"] + (f" ({'; '.join(notes)})" if notes else ""))


def _logit_bias(item: str) -> tuple[int, float]:
    token, _, value = item.partition("=")
    try:
        return int(token), float(value)
    except ValueError:
        raise BadInputError(f"--logit-bias wants ID=BIAS, got {item!r}") from None


def sampling_from_args(args: argparse.Namespace, options: list[dataclasses.Field] = OPTIONS) -> SamplingParams:
    """SamplingParams from the flags of `options` (the other fields keep their defaults)."""
    values = {}
    for f in options:
        v = getattr(args, f.name)
        if f.name == "logit_bias":
            v = [_logit_bias(item) for item in v]
        if f.name in ("json_schema", "grammar") and v is not None:
            v = _constraint_text(f.name, v)
        values[f.name] = tuple(v) if f.metadata["repeat"] else v
    return SamplingParams(**values).validate()


def _constraint_text(name: str, value: str) -> str:
    """--json-schema / --grammar: a value naming a file is read from it; otherwise --json-schema is
    inline JSON and --grammar inline GBNF (text with a '::=' rule). The schema comes back as compact
    JSON text."""
    flag = "--" + name.replace("_", "-")
    path = Path(value).expanduser()
    if path.is_file():
        try:
            value = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise BadInputError(f"{flag}: cannot read {path}: {e}") from None
    elif name == "grammar" and "::=" not in value:
        raise BadInputError(f"{flag}: no such file: {value}")
    if name == "grammar":
        return value
    try:
        return json.dumps(json.loads(value))
    except json.JSONDecodeError as e:
        raise BadInputError(f"{flag}: neither a file nor valid JSON ({e})") from None


def _constraint_field(name: str, value) -> str:
    """A batch line's (or a request body's) json_schema (an object, or its JSON text) or grammar (GBNF text)."""
    if name == "json_schema" and isinstance(value, (dict, bool)):
        return json.dumps(value)
    if not isinstance(value, str):
        raise BadInputError(f"{name} must be {'a JSON object or a string' if name == 'json_schema' else 'a string'}")
    return value


def set_default_sampling_args(args: argparse.Namespace, **overrides) -> None:
    """Give args every sampling option's default (a command that had no sampling flags)."""
    for f in OPTIONS:
        setattr(args, f.name, overrides.get(f.name, [] if f.metadata["repeat"] else f.default))


def _number(name: str, value, kind: type):
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or \
            (kind is int and not float(value).is_integer()):
        raise BadInputError(f"{name} must be a{'n integer' if kind is int else ' number'}, got {value!r}")
    return kind(value)


def sampling_from_json(obj: dict, base: SamplingParams) -> SamplingParams:
    """A batch line's (or a request body's) sampling fields over `base`. BadInputError if bad."""
    for f in OPTIONS:
        if f not in BATCH_OPTIONS and obj.get(f.name) is not None:   # known, but not here: never ignored
            raise BadInputError(f"{f.name} is not supported in a batch line (use kvchat run {flags(f)[-1]})")
    changes = {}
    for f in BATCH_OPTIONS:
        value = obj.get(f.name)
        if value is None:
            continue
        if f.metadata["repeat"]:        # a string or a list of strings
            value = [value] if isinstance(value, str) else value
            if not isinstance(value, list) or not all(isinstance(s, str) for s in value):
                raise BadInputError(f"{f.name} must be a string or a list of strings")
            changes[f.name] = tuple(value)
        elif f.name in ("json_schema", "grammar"):
            changes[f.name] = _constraint_field(f.name, value)
        else:
            changes[f.name] = _number(f.name, value, f.metadata["kind"])
    return dataclasses.replace(base, **changes).validate()


def sampling_from_text(texts: dict[str, str], base: SamplingParams) -> SamplingParams:
    """The settings screen's text fields over `base` (an empty optional field is None). BadInputError if bad."""
    changes = {}
    for f in SETTINGS_OPTIONS:
        raw = texts[f.name].strip()
        if raw == "" and f.default is None:
            changes[f.name] = None
            continue
        try:
            changes[f.name] = f.metadata["kind"](raw)
        except ValueError:
            kind = "n integer" if f.metadata["kind"] is int else " number"
            raise BadInputError(f"{human(f)}: '{raw}' is not a{kind}") from None
    return dataclasses.replace(base, **changes).validate()


def add_kv_disk_args(p: argparse.ArgumentParser) -> None:
    """The disk KV cache's flags (run, chat, batch); their defaults are the settings (`kvchat cache`)."""
    p.add_argument("--kv-disk", choices=("on", "off"), default=None,
                   help="keep full KV blocks on disk so a repeated prompt prefix or a reopened chat is not "
                        "computed again (default: on; `kvchat cache off` changes the default)")
    p.add_argument("--kv-disk-max", default=None, metavar="SIZE",
                   help="size cap of the disk KV cache, e.g. 4G or 500M; least recently used blocks go first "
                        "(default: 4G; `kvchat cache max SIZE` changes the default)")


def kv_disk_from_args(args: argparse.Namespace) -> dict:
    """Engine's kv_disk and kv_disk_max from the flags. A command without them (bench, which times
    computation) runs with the disk cache off."""
    if not hasattr(args, "kv_disk"):
        return {"kv_disk": False}
    return {"kv_disk": None if args.kv_disk is None else args.kv_disk == "on",
            "kv_disk_max": None if args.kv_disk_max is None else size_arg(args.kv_disk_max, "--kv-disk-max")}


def size_arg(text: str, what: str) -> int:
    from core.kv_disk import parse_size
    try:
        return parse_size(text)
    except ValueError:
        raise BadInputError(f"{what} wants a size such as 4G or 500M, got {text!r}") from None
