"""Constrained decoding (core.constrained) on the real default model: whatever the model would have
said, the output parses and validates against the JSON schema (checked with `jsonschema`), or
matches the GBNF grammar, greedy or sampled, plain, speculative or batched."""
import json
import re

import jsonschema
import pytest

from core.batch import BatchRequest, BatchScheduler
from core.constrained import schema_from_response_format
from core.engine import Engine
from core.types import SamplingParams, SpeculativeConfig
from models.errors import BadInputError
from tests.conftest import run_kvchat

NESTED = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 30},
    "address": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30},
                                                 "zip": {"type": "integer", "minimum": 0, "maximum": 99999}},
                "required": ["city", "zip"], "additionalProperties": False}},
    "required": ["name", "address"], "additionalProperties": False}
ENUMS = {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]},
                                          "size": {"type": "string", "enum": ["S", "M", "L"]}},
         "required": ["color", "size"], "additionalProperties": False}
ARRAY = {"type": "object", "properties": {"tags": {"type": "array", "minItems": 2, "maxItems": 3,
                                                   "items": {"type": "string", "maxLength": 12}}},
         "required": ["tags"], "additionalProperties": False}
PATTERN = {"type": "object", "properties": {"code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"}},
           "required": ["code"], "additionalProperties": False}
SCHEMAS = {
    "nested": (NESTED, "Describe a person who lives in Paris as JSON."),
    "enums": (ENUMS, "Pick a T-shirt for me. Answer in JSON."),
    "array": (ARRAY, "Give me some tags for a blog post about Python, as JSON."),
    "pattern": (PATTERN, "Make up a product code. Answer in JSON."),
}


@pytest.fixture(scope="module")
def native(qwen_path):
    engine = Engine("qwen2.5-coder-0.5b-instruct", backend="native", n_ctx=1024, threads=2)
    yield engine
    engine.close()


def run(engine, prompt: str, params: SamplingParams, **kw) -> tuple[str, str]:
    ids = engine.prompt_ids(prompt)
    text = "".join(e.text for e in engine.generate(ids, params, **kw))
    return text, engine.backend.finish_reason


def valid(text: str, schema: dict) -> dict:
    value = json.loads(text)
    jsonschema.validate(value, schema)
    return value


@pytest.mark.parametrize("name", SCHEMAS)
@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_output_validates_against_the_schema(native, name, temperature):
    schema, prompt = SCHEMAS[name]
    params = SamplingParams(temperature=temperature, seed=5, max_tokens=200, json_schema=json.dumps(schema))
    text, reason = run(native, prompt, params)
    assert reason == "stop", text                      # the grammar completed and ended the request
    valid(text, schema)


def test_unconstrained_output_would_not_validate(native):
    """The schema is what makes the pattern test pass: without it the model writes something else."""
    text, _ = run(native, SCHEMAS["pattern"][1], SamplingParams(temperature=0, max_tokens=60))
    with pytest.raises((ValueError, jsonschema.ValidationError)):
        valid(text, PATTERN)


def test_gbnf_grammar(native):
    grammar = 'root ::= "The answer is " ("yes" | "no") "." [0-9]{0,2}\n'
    text, reason = run(native, "Is Python a programming language?",
                       SamplingParams(temperature=0.7, seed=1, max_tokens=40, grammar=grammar))
    assert reason == "stop" and re.fullmatch(r"The answer is (yes|no)\.[0-9]{0,2}", text), text


def test_banned_strings_back_off_inside_the_grammar(native):
    """A banned string's back-off rolls the grammar back too: the reply avoids the string and still
    validates (greedy picks "blue" here without the ban)."""
    params = SamplingParams(temperature=0, max_tokens=60, json_schema=json.dumps(ENUMS))
    text, _ = run(native, SCHEMAS["enums"][1], params)
    assert "blue" in text
    text, reason = run(native, SCHEMAS["enums"][1], SamplingParams(temperature=0, max_tokens=60, banned=("blue",),
                                                                   json_schema=json.dumps(ENUMS)))
    assert reason == "stop" and "blue" not in text
    valid(text, ENUMS)


def test_speculative_lookup_with_a_schema_keeps_the_greedy_output(native):
    """Drafts are cut where the grammar disallows them and verified against masked logits: greedy
    output is token for token the plain constrained output, and it validates."""
    record = {"name": "Ada Lovelace", "address": {"city": "London", "zip": 12345}}
    prompt = "Repeat this JSON exactly: " + json.dumps(record)
    params = SamplingParams(temperature=0, max_tokens=120, json_schema=json.dumps(NESTED))
    ids = native.prompt_ids(prompt)
    native.backend.reset()
    plain = [e.id for e in native.generate(ids, params)]
    native.backend.reset()
    events = list(native.generate(ids, params, speculative=SpeculativeConfig("lookup")))
    assert [e.id for e in events] == plain
    assert native.backend.finish_reason == "stop"
    assert native.backend.stats.spec_accepted > 0          # drafts did get through the grammar
    assert valid("".join(e.text for e in events), NESTED) == record


def test_a_sentencepiece_vocabulary(gemma_path):
    """Gemma's SentencePiece vocabulary (a leading-space marker, byte tokens) spells the grammar too."""
    engine = Engine("gemma-3-270m", backend="native", n_ctx=512, threads=2)
    try:
        text, reason = run(engine, SCHEMAS["enums"][1],
                           SamplingParams(temperature=0.8, seed=2, max_tokens=60, json_schema=json.dumps(ENUMS)))
    finally:
        engine.close()
    assert reason == "stop", text
    valid(text, ENUMS)


def test_batch_requests_follow_their_own_schemas(native):
    sched = BatchScheduler(native.backend, parallel=2)
    reqs = [BatchRequest(name, native.prompt_ids(SCHEMAS[name][1]),
                         SamplingParams(temperature=0.8, seed=3, max_tokens=200,
                                        json_schema=json.dumps(SCHEMAS[name][0])))
            for name in ("enums", "array")]
    got = {r.id: r for r in sched.results(reqs)}
    for name in ("enums", "array"):
        assert got[name].error is None and got[name].finish_reason == "stop", got[name]
        valid(got[name].text, SCHEMAS[name][0])
    with pytest.raises(jsonschema.ValidationError):
        valid(got["enums"].text, ARRAY)


def test_a_bad_schema_or_grammar_is_refused():
    with pytest.raises(BadInputError, match="JSON schema"):
        SamplingParams(json_schema='{"type": "nope"}').validate()
    with pytest.raises(BadInputError, match="not valid JSON"):
        SamplingParams(json_schema="{").validate()
    with pytest.raises(BadInputError, match="grammar"):
        SamplingParams(grammar="root ::= missing").validate()
    with pytest.raises(BadInputError, match="not both"):
        SamplingParams(json_schema="{}", grammar='root ::= "a"').validate()


def test_openai_response_format_maps_to_a_schema():
    assert schema_from_response_format(None) is None and schema_from_response_format({"type": "text"}) is None
    assert json.loads(schema_from_response_format({"type": "json_object"})) == {"type": "object"}
    rf = {"type": "json_schema", "json_schema": {"name": "shirt", "strict": True, "schema": ENUMS}}
    assert json.loads(schema_from_response_format(rf)) == ENUMS
    for bad in ({"type": "json_schema"}, {"type": "yaml"}, "json"):
        with pytest.raises(BadInputError, match="response_format"):
            schema_from_response_format(bad)


def test_kvchat_run_json_schema(tmp_path, qwen_path):
    schema = tmp_path / "shirt.json"
    schema.write_text(json.dumps(ENUMS), encoding="utf-8")
    out = run_kvchat("run", "--backend", "native", "--temperature", "0", "-n", "60", "--json-schema", str(schema),
                     "--json", SCHEMAS["enums"][1])
    assert out.returncode == 0, out.stderr.decode()
    record = json.loads(out.stdout)
    assert record["finish_reason"] == "stop"
    valid(record["text"], ENUMS)


@pytest.mark.parametrize("flag,value,message", [
    ("--json-schema", '{"type": "nope"}', "bad JSON schema"),
    ("--json-schema", "missing.json", "neither a file nor valid JSON"),
    ("--grammar", "missing.gbnf", "no such file"),
])
def test_kvchat_run_refuses_a_bad_constraint(flag, value, message):
    out = run_kvchat("run", flag, value, "hello")
    err = out.stderr.decode().strip()
    assert out.returncode == 2 and message in err and len(err.splitlines()) == 1, err


def test_bench_json_schema_times_both_runs(native):
    from app.bench import bench_json_schema
    r = bench_json_schema(native, 1, 12)
    assert r["plain_t_s"] > 0 and r["schema_t_s"] > 0
    assert r["plain_tokens"] == r["schema_tokens"] == 12      # the same length of decoding, timed
