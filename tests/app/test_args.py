"""Sampling options are made once, from SamplingParams' fields: the flags, a batch line's fields and
the settings screen's fields all cover them, and each refuses what it cannot take."""
import argparse
import dataclasses

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
                "-n", "9", "--stop", "a", "--stop", "b", "--logit-bias", "5=-inf", "--ban", "zz")
    assert got == SamplingParams(0.1, 5, 0.5, 0.2, 1.1, 32, 0.3, 0.4, 7, 9, ("a", "b"), ((5, float("-inf")),), ("zz",))
    assert len(dataclasses.fields(SamplingParams)) == 13     # a new field needs a line above


def test_batch_lines_take_every_batch_field_and_refuse_the_others():
    base = SamplingParams()
    line = {"temperature": 0, "top_k": 3, "top_p": 0.9, "min_p": 0.1, "repeat_penalty": 1.2, "repeat_last_n": 8,
            "presence_penalty": 0.5, "frequency_penalty": 0.25, "seed": 1, "max_tokens": 4, "stop": "x"}
    assert set(line) == {f.name for f in BATCH_OPTIONS}
    got = sampling_from_json(line, base)
    assert (got.top_k, got.presence_penalty, got.stop) == (3, 0.5, ("x",))
    for bad, message in [({"banned": ["x"]}, "banned is not supported in a batch line"),
                         ({"logit_bias": [[1, 2]]}, "logit_bias is not supported"),
                         ({"top_k": "many"}, "top_k must be an integer"), ({"top_k": 1.5}, "top_k must be an integer"),
                         ({"temperature": True}, "temperature must be a number"), ({"top_p": 2.0}, "top-p must be in")]:
        with pytest.raises(BadInputError, match=message):
            sampling_from_json(bad, base)


def test_settings_screen_fields_are_the_single_valued_options():
    assert [f.name for f in SETTINGS_OPTIONS] == list(SamplingParams().settings())
    texts = {f.name: "" if getattr(SamplingParams(), f.name) is None else str(getattr(SamplingParams(), f.name))
             for f in SETTINGS_OPTIONS}
    assert sampling_from_text(texts, SamplingParams()) == SamplingParams()          # empty seed: None
    with pytest.raises(BadInputError, match="repeat-last-n: 'x' is not an integer"):
        sampling_from_text(texts | {"repeat_last_n": "x"}, SamplingParams())
