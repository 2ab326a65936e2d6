"""Text: the model's tokenizer (GGUF or Hugging Face) and its chat template."""

from moerun.text.chat import CHATML_TEMPLATE, ChatTemplate, ChatTemplateError
from moerun.text.tokenizer import IncrementalDecoder, Tokenizer

__all__ = ["CHATML_TEMPLATE", "ChatTemplate", "ChatTemplateError", "IncrementalDecoder", "Tokenizer"]
