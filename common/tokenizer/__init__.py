"""HF tokenizer wrapper, chat template, incremental detokenizer."""
from common.tokenizer.detokenizer import IncrementalDetokenizer
from common.tokenizer.hf import Tokenizer

__all__ = ["IncrementalDetokenizer", "Tokenizer"]
