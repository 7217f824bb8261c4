"""Sampling options are made once, from SamplingParams' fields: the flags, a batch line's fields and
the settings screen's fields all cover them, and each refuses what it cannot take."""
import argparse
import dataclasses
import json

import pytest

from app.args import BATCH_OPTIONS, SETTINGS_OPTIONS, add_sampling_args, sampling_from_args, sampling_from_json, \
    sampling_from_text
from core.types import SamplingParams
from models.errors import BadInputError


def parse(*argv: str) -> SamplingParams:
    p = argparse.ArgumentParser()
    add_sampling_args(p)
    return sampling_from_args(p.parse_args(list(argv)))


def test_every_field_has_a_flag_and_the_defaults_are_the_dataclass_s():
    assert parse() == SamplingParams()
    got = parse("--temperature", "0.1", "--top-k", "5", "--top-p", "0.5", "--min-p", "0.2", "--repeat-penalty", "1.1",
                "--repeat-last-n", "32", "--presence-penalty", "0.3", "--frequency-penalty", "0.4", "--seed", "7",
                "-n", "9", "--stop", "a", "--stop", "b", "--logit-bias", "5=-inf", "--ban", "zz",
                "--json-schema", '{"type": "integer"}')
    assert got == SamplingParams(0.1, 5, 0.5, 0.2, 1.1, 32, 0.3, 0.4, 7, 9, ("a", "b"), ((5, float("-inf")),), ("zz",),
                                 '{"type": "integer"}')
    assert parse("--grammar", 'root ::= "a"').grammar == 'root ::= "a"'
    assert len(dataclasses.fields(SamplingParams)) == 15     # a new field needs a line above


def test_schema_and_grammar_flags_read_a_file_or_take_the_text(tmp_path):
    schema, grammar = tmp_path / "s.json", tmp_path / "g.gbnf"
    schema.write_text('{\n  "enum": ["a", "b"]\n}\n', encoding="utf-8")
    grammar.write_text('root ::= "x" | "y"\n', encoding="utf-8")
    assert parse("--json-schema", str(schema)).json_schema == '{"enum": ["a", "b"]}'     # compact JSON text
    assert parse("--grammar", str(grammar)).grammar == 'root ::= "x" | "y"\n'
    for argv, message in [(["--json-schema", str(tmp_path / "none.json")], "neither a file nor valid JSON"),
                          (["--json-schema", '{"type": 3}'], "bad JSON schema"),
                          (["--grammar", str(tmp_path / "none.gbnf")], "no such file"),
                          (["--grammar", "root ::= undefined_rule"], "bad grammar")]:
        with pytest.raises(BadInputError, match=message):
            parse(*argv)


def test_batch_lines_take_every_batch_field_and_refuse_the_others():
    base = SamplingParams()
    line = {"temperature": 0, "top_k": 3, "top_p": 0.9, "min_p": 0.1, "repeat_penalty": 1.2, "repeat_last_n": 8,
            "presence_penalty": 0.5, "frequency_penalty": 0.25, "seed": 1, "max_tokens": 4, "stop": "x",
            "json_schema": {"type": "object"}, "grammar": None}
    assert set(line) == {f.name for f in BATCH_OPTIONS}
    got = sampling_from_json(line, base)
    assert (got.top_k, got.presence_penalty, got.stop, got.json_schema) == (3, 0.5, ("x",), '{"type": "object"}')
    assert sampling_from_json({"json_schema": '{"enum": [1]}'}, base).json_schema == '{"enum": [1]}'
    assert sampling_from_json({"grammar": 'root ::= "a"'}, base).grammar == 'root ::= "a"'
    for bad, message in [({"banned": ["x"]}, "banned is not supported in a batch line"),
                         ({"logit_bias": [[1, 2]]}, "logit_bias is not supported"),
                         ({"top_k": "many"}, "top_k must be an integer"), ({"top_k": 1.5}, "top_k must be an integer"),
                         ({"temperature": True}, "temperature must be a number"), ({"top_p": 2.0}, "top-p must be in"),
                         ({"json_schema": 3}, "json_schema must be a JSON object or a string"),
                         ({"json_schema": "{"}, "not valid JSON"), ({"grammar": ["x"]}, "grammar must be a string")]:
        with pytest.raises(BadInputError, match=message):
            sampling_from_json(bad, base)


def test_settings_screen_fields_are_the_single_valued_options():
    assert [f.name for f in SETTINGS_OPTIONS] == list(SamplingParams().settings())
    assert not {"json_schema", "grammar"} & set(SamplingParams().settings())      # documents, not one-line values
    texts = {f.name: "" if getattr(SamplingParams(), f.name) is None else str(getattr(SamplingParams(), f.name))
             for f in SETTINGS_OPTIONS}
    assert sampling_from_text(texts, SamplingParams()) == SamplingParams()          # empty seed: None
    with pytest.raises(BadInputError, match="repeat-last-n: 'x' is not an integer"):
        sampling_from_text(texts | {"repeat_last_n": "x"}, SamplingParams())


def test_the_chat_command_line_gives_the_session_its_output_format():
    """`kvchat chat` takes --json-schema / --grammar (its sampling is each chat's settings): what
    run_tui reads from it, with and without them."""
    from app.args import FORMAT_OPTIONS
    from app.cli import build_parser
    assert sampling_from_args(build_parser().parse_args(["chat"]), FORMAT_OPTIONS) == SamplingParams()
    args = build_parser().parse_args(["chat", "--json-schema", '{"type": "object"}'])
    assert json.loads(sampling_from_args(args, FORMAT_OPTIONS).json_schema) == {"type": "object"}
    with pytest.raises(SystemExit):
        build_parser().parse_args(["chat", "--temperature", "0"])
