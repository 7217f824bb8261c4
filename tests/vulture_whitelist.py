# Names vulture reports as unused that are used, each reviewed; tests/test_dead_code.py passes this
# file to vulture. Not imported by anything (vulture only reads it).
_ = None
KVSequence  # core/backend.py: a type in string annotations
_.kv_map  # core/backend.py Capabilities: part of the public capabilities record
_.unsafe_undefined  # core/chat_template.py: jinja2's sandbox calls it
_.row_factory  # core/history.py: sqlite3 reads it
exc, tb  # core/history.py: __exit__'s signature
_.pre_tokenizer  # core/tokenizer.py: set on the HF tokenizers object
_.model_type, _.byte_fallback, _.vocab_size, _.add_dummy_prefix  # core/tokenizer.py: sentencepiece proto fields
_.remove_extra_whitespaces, _.escape_whitespaces, _.score  # core/tokenizer.py: sentencepiece proto fields
LlamaConfig, Qwen2Config, Qwen3Config, Phi3Config, Gemma2Config, Gemma3Config  # models/architectures.py: by name
SmolLM3Config, Ernie45Config, GraniteConfig, ExaoneConfig, GemmaConfig, Mistral3Config  # ... and these
Qwen3VLConfig  # ... and this
n_ctx_train, n_ff  # models/transformer.py: the model's trained context and FFN width, config fields
pytestmark  # tests: pytest reads it
_isolated_dirs, qwen15_path, kv_root  # tests: pytest fixtures, requested by name
_.cb_eval  # tests/engine/test_llamacpp_tensors.py: a llama.cpp context parameter (ctypes field)
_.nthread  # tests/engine/conftest.py: a llama_model_quantize parameter (ctypes field)
_.get_suggestion  # app/tui/screens/attach.py: Textual's Suggester calls it
_.tooltip  # app/tui/widgets/attachments.py: Textual shows it on hover
_.bos_token_id  # core/constrained.py: llguidance's TokenizerWrapper reads it
CheckoutCacheLocator, _._cache_path  # core/numba_locator.py: numba loads the class by name (NUMBA_CACHE_LOCATOR_CLASSES) and reads the path
