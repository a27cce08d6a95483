"""Drafter checkpoints across ecosystems: vLLM `speculators`, DeepSpec (SGLang), and dspark's own layout."""
from dspark.interop.convert import FORMATS, convert, detect_format, load_any_drafter
from dspark.interop.deepspec import from_deepspec, load_deepspec, to_deepspec
from dspark.interop.speculators import from_speculators, to_speculators

__all__ = ["FORMATS", "convert", "detect_format", "from_deepspec", "from_speculators", "load_any_drafter",
           "load_deepspec", "to_deepspec", "to_speculators"]
