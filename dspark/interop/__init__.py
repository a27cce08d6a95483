"""Drafter checkpoints across ecosystems: vLLM `speculators`, DeepSpec (SGLang), dspark's own layout, and
llama.cpp draft GGUFs (write only)."""
from dspark.interop.convert import FORMATS, OUTPUTS, convert, detect_format, load_any_drafter, remembered_target
from dspark.interop.deepspec import from_deepspec, load_deepspec, to_deepspec
from dspark.interop.gguf_draft import write_gguf
from dspark.interop.speculators import from_speculators, to_speculators

__all__ = ["FORMATS", "OUTPUTS", "convert", "detect_format", "from_deepspec", "from_speculators", "load_any_drafter",
           "load_deepspec", "remembered_target", "to_deepspec", "to_speculators", "write_gguf"]
