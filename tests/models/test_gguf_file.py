"""GGUF files are untrusted: every kind of damage is a one-line BadInputError, and info is right."""
import shutil

import numpy as np
import pytest
from gguf import GGMLQuantizationType, GGUFWriter

from models.errors import BadInputError
from models.gguf_file import GGUFFile, open_model


def write_gguf(path, arch="llama", tensor_type=None):
    writer = GGUFWriter(str(path), arch)
    writer.add_context_length(128)
    writer.add_embedding_length(32)
    writer.add_tensor("token_embd.weight", np.random.default_rng(0).standard_normal((8, 32)).astype(np.float32))
    if tensor_type is not None:
        block_bytes = {GGMLQuantizationType.IQ2_XXS: 66}[tensor_type]
        raw = np.zeros((4, block_bytes), dtype=np.uint8)
        writer.add_tensor("blk.0.attn_q.weight", raw, raw_dtype=tensor_type)   # shape given in bytes
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_valid_file_info(tmp_path):
    info = open_model(write_gguf(tmp_path / "ok.gguf")).info()
    assert info["architecture"] == "llama"
    assert info["parameters"] == 8 * 32
    assert info["tensor_types"] == {"F32": 1}
    assert info["context_length"] == 128
    assert info["chat_template"] is False
    assert info["file_size"] == (tmp_path / "ok.gguf").stat().st_size


def test_real_model_info(qwen_path):
    info = open_model(qwen_path).info()
    assert info["architecture"] == "qwen2"
    assert 4.5e8 < info["parameters"] < 7e8   # 0.49B plus a separate output matrix
    assert set(info["tensor_types"]) == {"Q5_0", "Q8_0", "Q6_K", "Q4_K", "F32"}
    assert info["chat_template"] is True and info["context_length"] == 32768


def test_missing(tmp_path):
    with pytest.raises(BadInputError, match="not found"):
        GGUFFile(tmp_path / "nope.gguf")


def test_empty(tmp_path):
    (tmp_path / "empty.gguf").write_bytes(b"")
    with pytest.raises(BadInputError, match="empty"):
        GGUFFile(tmp_path / "empty.gguf")


def test_not_gguf(tmp_path):
    (tmp_path / "x.gguf").write_bytes(b"PK\x03\x04 this is a zip, not a model" * 10)
    with pytest.raises(BadInputError, match="not a GGUF"):
        GGUFFile(tmp_path / "x.gguf")


@pytest.mark.parametrize("keep", [6, 24, 100, 300])
def test_truncated_header(tmp_path, keep):
    data = write_gguf(tmp_path / "ok.gguf").read_bytes()
    (tmp_path / "cut.gguf").write_bytes(data[:keep])
    with pytest.raises(BadInputError, match="corrupt|truncated|past the end"):
        GGUFFile(tmp_path / "cut.gguf")


def test_tensor_past_end(tmp_path):
    data = write_gguf(tmp_path / "ok.gguf").read_bytes()
    (tmp_path / "cut.gguf").write_bytes(data[:-100])     # header intact, tensor data cut short
    with pytest.raises(BadInputError, match="past the end"):
        GGUFFile(tmp_path / "cut.gguf")


def test_truncated_real_model(qwen_path, tmp_path):
    cut = tmp_path / "qwen-cut.gguf"
    with open(qwen_path, "rb") as src, open(cut, "wb") as dst:
        dst.write(src.read(50_000_000))
    with pytest.raises(BadInputError, match="past the end"):
        GGUFFile(cut)


def test_unsupported_architecture(tmp_path):
    g = open_model(write_gguf(tmp_path / "m.gguf", arch="mamba"))    # a valid file (llama.cpp may run it)...
    assert g.unsupported() == "architecture 'mamba'" and g.info()["kvchat_engine_lacks"] == g.unsupported()
    with pytest.raises(BadInputError, match="does not run architecture 'mamba' in m.gguf"):
        g.require_supported()                                           # ...that kvchat's engines do not run


def test_unsupported_rope_scaling(tmp_path):
    """LongRoPE outside phi3 is not built (a llama file's rope.scaling.type "longrope", or its
    factor tensors): such files go to llama.cpp under --backend auto; linear scaling, YaRN and
    phi3's LongRoPE run."""
    from tests.engine.conftest import write_tiny_model
    assert open_model(write_tiny_model(tmp_path / "y.gguf", "llama", "F32", rope_scaling="yarn")).unsupported() is None
    assert open_model(write_tiny_model(tmp_path / "t.gguf", "llama", "F32", meta=(("rope.scaling.type", "longrope"),))
                      ).unsupported() == "rope scaling 'longrope'"
    assert open_model(write_tiny_model(tmp_path / "l.gguf", "llama", "F32", rope_scaling="linear")).unsupported() is None
    assert open_model(write_tiny_model(tmp_path / "p.gguf", "phi3", "F32", rope_scaling="longrope")).unsupported() is None
    assert open_model(write_tiny_model(tmp_path / "q.gguf", "llama", "F32", rope_scaling="longrope")).unsupported() \
        == "LongRoPE rope scaling"


def test_tensors_the_engines_do_not_read_are_named(tmp_path):
    """A tensor the engines would skip (llama.cpp's optional output and FFN biases, a mixture of
    experts' router in a file without `expert_count`) would change what llama.cpp computes: such
    files are refused by name."""
    from tests.engine.conftest import HEAD_DIM, N_EMBD, N_FF, write_tiny_model
    for name, shape in (("blk.1.attn_output.bias", (N_EMBD,)), ("blk.0.ffn_down.bias", (N_EMBD,)),
                        ("blk.0.ffn_gate_inp.weight", (8, N_FF)), ("output.bias", (N_EMBD,))):
        g = open_model(write_tiny_model(tmp_path / f"{name}.gguf", "llama", "F32",
                                        extra={name: np.zeros(shape, np.float32)}))
        assert g.unsupported() == f"tensor {name}"
    assert open_model(write_tiny_model(tmp_path / "plain.gguf", "qwen2", "F32")).unsupported() is None
    g = open_model(write_tiny_model(tmp_path / "kv.gguf", "llama", "F32", meta=(("attention.value_length", 32),)))
    assert g.unsupported() == f"key heads of {HEAD_DIM} and value heads of 32"      # llama's key heads: n_embd / n_head


def test_unsupported_tensor_type(tmp_path):
    g = open_model(write_gguf(tmp_path / "iq.gguf", tensor_type=GGMLQuantizationType.IQ2_XXS))
    assert g.type_counts["IQ2_XXS"] == 1 and g.unsupported() == "tensor type IQ2_XXS"
    with pytest.raises(BadInputError, match="does not run tensor type IQ2_XXS"):
        g.require_supported()
    assert open_model(write_gguf(tmp_path / "ok.gguf")).unsupported() is None


def test_garbage_after_magic(tmp_path):
    (tmp_path / "g.gguf").write_bytes(b"GGUF" + np.random.default_rng(1).bytes(5000))
    with pytest.raises(BadInputError):
        GGUFFile(tmp_path / "g.gguf")


@pytest.mark.parametrize("model", ["qwen_path", "gemma_path"])
def test_our_parser_agrees_with_gguf_reader(request, model):
    """Our fast reader must see exactly what gguf.GGUFReader sees: metadata, tensor layout and bytes."""
    from gguf import GGUFReader
    path = request.getfixturevalue(model)
    ours, theirs = GGUFFile(path), GGUFReader(path)
    for key, field in theirs.fields.items():
        if key.startswith("GGUF."):
            continue
        expected = field.contents()
        if isinstance(expected, list) and expected and isinstance(expected[0], float):
            np.testing.assert_allclose(ours.get(key), expected, rtol=0)
        else:
            assert ours.get(key) == expected, key
    assert [t.name for t in ours.reader.tensors] == [t.name for t in theirs.tensors]
    for a, b in zip(ours.reader.tensors, theirs.tensors):
        assert (a.data.shape, a.data.dtype, a.data_offset, a.n_bytes) == (b.data.shape, b.data.dtype, b.data_offset, b.n_bytes)
        assert np.array_equal(a.data[:3], b.data[:3]) and np.array_equal(a.data[-1:], b.data[-1:])


def test_bad_version(tmp_path):
    data = bytearray(write_gguf(tmp_path / "ok.gguf").read_bytes())
    data[4:8] = (99).to_bytes(4, "little")
    (tmp_path / "v.gguf").write_bytes(bytes(data))
    with pytest.raises(BadInputError, match="version 99"):
        GGUFFile(tmp_path / "v.gguf")


def test_absurd_counts_do_not_allocate(tmp_path):
    data = bytearray(write_gguf(tmp_path / "ok.gguf").read_bytes())
    data[16:24] = (2**60).to_bytes(8, "little")          # n_kv
    (tmp_path / "n.gguf").write_bytes(bytes(data))
    with pytest.raises(BadInputError, match="corrupt|truncated"):
        GGUFFile(tmp_path / "n.gguf")


def test_granite_vision_deepstack_is_refused(tmp_path):
    """Granite Vision's files (granite architecture) add image features inside the layers
    (`granite.deepstack_mapping`), which the engines do not: refused, so auto hands them to llama.cpp."""
    from tests.engine.conftest import write_tiny_model
    plain = open_model(write_tiny_model(tmp_path / "g.gguf", "granite", "F32"))
    assert plain.unsupported() is None
    g = open_model(write_tiny_model(tmp_path / "v.gguf", "granite", "F32", meta=(("deepstack_mapping", [False, True]),)))
    assert g.unsupported() == "deepstack layers"


def test_mixtures_of_experts_the_engines_run_and_do_not(tmp_path):
    """The engines run softmax-gated experts (kernels.cpu.moe) in the architectures whose llama.cpp
    graph has them; a dense architecture's file with experts, per-layer expert counts or gate-less
    experts go to llama.cpp."""
    from tests.engine.conftest import write_tiny_model
    for arch, experts in (("qwen3moe", False), ("llama", True), ("granitemoe", False)):
        g = open_model(write_tiny_model(tmp_path / f"{arch}.gguf", arch, "Q4_K", experts=experts))
        assert g.n_expert == 8 and g.unsupported() is None, arch
        assert g.unsupported(cpu=False) is None
    dense = open_model(write_tiny_model(tmp_path / "q.gguf", "qwen3", "Q4_K", experts=True))
    assert dense.n_expert == 0 and dense.unsupported() == "tensor blk.0.ffn_gate_inp.weight"
    per_layer = open_model(write_tiny_model(tmp_path / "p.gguf", "qwen3moe", "Q4_K", meta=(("expert_used_count", [2, 1]),)))
    assert per_layer.unsupported() == "mixture-of-experts layers without one expert_used_count"
    gateless = open_model(write_tiny_model(tmp_path / "g.gguf", "llama", "F32", experts=True, drop=("blk.1.ffn_gate_exps.weight",)))
    assert gateless.unsupported() == "experts without gate matrices"
