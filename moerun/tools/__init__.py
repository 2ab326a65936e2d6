"""Tools around moerun (shipped as moerun.tools): synthetic models, conversion, tokenizers.

    moerun.tools.presets     named model shapes (tiny-*, a3b-L4, a3b-L12) as ModelSpec builders
    moerun.tools.tokenizer   deterministic byte-level BPE tokenizer -> tokenizer.json / GGUF keys
    moerun.tools.gguf_out    streaming GGUF writer, llama.cpp-style quant type selection (Q4_K_M)
    moerun.tools.hf_out      Hugging Face config.json, tensor names, streaming safetensors shards
    moerun.tools.make_model  make_model(): random-weight models as GGUF or safetensors
    moerun.tools.convert     convert_hf_to_gguf(): any model moerun reads -> GGUF

Command lines: `python -m moerun.tools.make_model --help`, `python -m moerun.tools.convert --help`,
or `python -m moerun.tools {make-model,convert} ...`.
"""
