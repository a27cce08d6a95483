"""Code prompts made from the Python standard library's own functions (no network, no dataset): a
signature and a docstring become a task for the target to solve, in three shapes.

- "describe" (source stdlib_code): 'Write a Python function `name(args)` that ...'.
- "complete" (source stdlib_completion): the function's header and docstring in a code block.
- "tests" (source stdlib_tests): HumanEval's own prompt shape, instruction line included ("... and make
  sure that it passes the tests:"), docstring examples kept; over more modules than the other two, and
  over the public methods of their classes as well (each method inside its class header)."""
from __future__ import annotations

import importlib
import inspect
import re
import textwrap
import warnings

from dspark.train.datagen import Prompt

# Pure-Python stdlib modules whose public functions make reasonable "write this function" prompts.
CODE_MODULES = ("string", "textwrap", "statistics", "heapq", "bisect", "fnmatch", "posixpath", "shlex",
                "base64", "html", "difflib", "calendar", "colorsys", "fractions", "random", "glob", "json",
                "urllib.parse", "csv", "operator", "functools", "itertools", "copy", "keyword", "math",
                "os", "shutil", "tempfile", "filecmp", "zlib", "binascii", "quopri", "uu", "secrets",
                "ipaddress", "datetime", "time", "re", "struct", "gzip", "zipfile", "tarfile", "email.utils",
                "http.cookies", "mimetypes", "locale", "gettext", "platform", "inspect", "ast", "tokenize",
                "pprint", "reprlib", "enum", "graphlib", "sched", "queue", "weakref", "types", "collections")
# The "tests" shape also reads these (a fixed list: a prompt list is reproducible from its recipe).
MORE_CODE_MODULES = ("argparse", "configparser", "logging", "pathlib", "dataclasses", "decimal", "contextlib",
                     "typing", "urllib.request", "http.client", "email.message", "email.header",
                     "email.parser", "xml.dom.minidom", "xml.etree.ElementTree", "html.parser", "unittest",
                     "codecs", "uuid", "wave", "smtplib", "ftplib", "socketserver", "threading", "subprocess",
                     "pickle", "shelve", "io", "numbers", "cmd", "optparse", "traceback", "warnings",
                     "linecache", "trace", "timeit", "pstats", "zipapp", "plistlib", "netrc", "mailbox",
                     "imaplib", "poplib", "selectors", "fileinput", "ntpath", "genericpath", "dis",
                     "symtable", "codeop", "code", "compileall", "py_compile", "pkgutil", "modulefinder",
                     "runpy", "lzma", "bz2", "getopt", "chunk", "copyreg", "json.decoder", "json.encoder",
                     "urllib.robotparser", "http.cookiejar", "http.server", "xmlrpc.client", "pydoc",
                     "doctest", "sysconfig", "stat", "tomllib", "wsgiref.util")
STYLES = {"describe": "stdlib_code", "complete": "stdlib_completion", "tests": "stdlib_tests"}
TESTS_HEADER = "Write a solution to the following problem and make sure that it passes the tests:"


def stdlib_code_prompts(limit: int | None = None, style: str = "describe") -> list[Prompt]:
    """Up to `limit` prompts of one shape (module docstring), in a fixed order."""
    if style not in STYLES:
        raise ValueError(f"style must be one of {', '.join(STYLES)}, got {style!r}")
    modules = CODE_MODULES + MORE_CODE_MODULES if style == "tests" else CODE_MODULES
    seen, out = set(), []
    for name in modules:
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                mod = importlib.import_module(name)
        except ImportError:
            continue
        for fname, fn in sorted(vars(mod).items()):
            if fname.startswith("_"):
                continue
            if style == "tests" and inspect.isclass(fn) and getattr(fn, "__module__", None) == mod.__name__:
                for mname, meth in vars(fn).items():
                    key = f"{fname}.{mname}"
                    if not mname.startswith("_") and inspect.isfunction(meth) and key not in seen:
                        text = _tests_prompt(meth, mname, f"class {fname}:\n    ...\n\n", "    ")
                        if text:
                            seen.add(key)
                            out.append(Prompt(text, STYLES[style]))
                continue
            if not inspect.isfunction(fn) or fname in seen:
                continue
            if style == "tests":
                if getattr(fn, "__module__", None) == mod.__name__:
                    text = _tests_prompt(fn, fname, "", "")
                    if text:
                        seen.add(fname)
                        out.append(Prompt(text, STYLES[style]))
                continue
            doc = inspect.getdoc(fn) or ""
            summary = _first_sentence(doc)
            sig = _signature(fn)
            if len(summary) < 20 or sig is None:
                continue
            seen.add(fname)
            if style == "describe":
                verb = summary[0].lower() + summary[1:]
                out.append(Prompt(f"Write a Python function `{fname}{sig}` that does the following: {verb} "
                                  "Include a short docstring and an example.", "stdlib_code"))
            else:
                body = textwrap.indent(doc.split("\n\n")[0].strip(), "    ")
                out.append(Prompt("Write a solution to the following problem:\n```python\n"
                                  f"def {fname}{sig}:\n    \"\"\"\n{body}\n    \"\"\"\n```", "stdlib_completion"))
    return out[:limit] if limit is not None else out


def _signature(fn) -> str | None:
    """The function's signature as written, or None when it has none or it is too long for a prompt."""
    try:
        sig = str(inspect.signature(fn))
    except (TypeError, ValueError):
        return None
    return sig if len(sig) <= 80 else None


def _tests_prompt(fn, name: str, before: str, indent: str) -> str | None:
    """HumanEval's shape: the instruction line, then a code block with the header and a docstring of the
    first paragraph and any doctest examples (None when the docstring says too little)."""
    doc = inspect.getdoc(fn) or ""
    sig = _signature(fn)
    if len(_first_sentence(doc)) < 20 or sig is None:
        return None
    lines = doc.split("\n\n")[0].strip().splitlines()
    lines += [ln for block in doc.split("\n\n")[1:] if block.lstrip().startswith(">>>") for ln in block.splitlines()]
    inner = indent + "    "
    body = "\n".join(inner + ln if ln.strip() else "" for ln in lines).lstrip()
    return (f"{TESTS_HEADER}\n```python\n{before}{indent}def {name}{sig}:\n{inner}\"\"\" {body}\n{inner}\"\"\"\n\n```")


def _first_sentence(doc: str) -> str:
    """The first sentence of a docstring, whitespace-normalised."""
    text = " ".join(doc.split("\n\n")[0].split())
    m = re.match(r"(.+?[.!?])(\s|$)", text)
    return (m.group(1) if m else text).strip()
