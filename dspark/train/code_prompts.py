"""Code prompts made from the Python standard library's own functions (no network, no dataset): a
signature and a docstring become a task for the target to solve, in three shapes.

- "describe" (source stdlib_code): 'Write a Python function `name(args)` that ...'.
- "complete" (source stdlib_completion): the function's header and docstring in a code block.
- "tests" (source stdlib_tests): HumanEval's own prompt shape, instruction line included ("... and make
  sure that it passes the tests:"), docstring examples kept; over more modules than the other two, and
  over the public methods of their classes as well (each method inside its class header).

package_test_prompts() makes the "tests" shape (source package_tests) from every module of a few
permissively licensed packages that torch itself installs or that come with the project's dependencies
(PACKAGES: graph algorithms, number theory and special functions, date parsing, ...), ~7.8k prompts with
the versions of this project's install; a package that is not installed is left out."""
from __future__ import annotations

import contextlib
import importlib
import inspect
import io
import pkgutil
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
# Third-party packages for package_test_prompts(), with their licences (all permissive; the prompts are their
# functions' headers and docstrings, the answers the target's own).
PACKAGES = {"networkx": "BSD-3-Clause", "sympy": "BSD-3-Clause", "mpmath": "BSD-3-Clause",
            "dateutil": "Apache-2.0 / BSD-3-Clause", "pyparsing": "MIT", "packaging": "Apache-2.0 / BSD-2-Clause",
            "jinja2": "BSD-3-Clause"}
STYLES = {"describe": "stdlib_code", "complete": "stdlib_completion", "tests": "stdlib_tests"}
TESTS_HEADER = "Write a solution to the following problem and make sure that it passes the tests:"


def stdlib_code_prompts(limit: int | None = None, style: str = "describe") -> list[Prompt]:
    """Up to `limit` prompts of one shape (module docstring), in a fixed order."""
    if style not in STYLES:
        raise ValueError(f"style must be one of {', '.join(STYLES)}, got {style!r}")
    texts = _tests_prompts() if style == "tests" else _function_prompts(style)
    return [Prompt(t, STYLES[style]) for t in texts][:limit]


def package_test_prompts(limit: int | None = None) -> list[Prompt]:
    """Up to `limit` prompts in HumanEval's shape from the modules of PACKAGES, in a fixed order."""
    modules = tuple(m for pkg in PACKAGES for m in _package_modules(pkg))
    return [Prompt(t, "package_tests") for t in _tests_prompts(modules)][:limit]


def _package_modules(package: str) -> list[str]:
    """The package and its submodules, sorted, leaving out tests and benchmarks ([] if not installed)."""
    try:
        with _quiet():
            root = importlib.import_module(package)
    except Exception:  # noqa: BLE001 - a package that does not import is one source less
        return []
    with _quiet():  # walking imports the subpackages
        names = [info.name for info in pkgutil.walk_packages(getattr(root, "__path__", []), package + ".",
                                                              onerror=lambda _: None)]
    skip = re.compile(r"\.(tests?|testing|conftest|benchmarks?)(\.|$)")
    return [package] + sorted(n for n in names if not skip.search(n))


@contextlib.contextmanager
def _quiet():
    """Importing a module may warn or print (deprecations, optional backends): neither reaches the user."""
    with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()), \
            contextlib.redirect_stderr(io.StringIO()):
        warnings.simplefilter("ignore")
        yield


def _public(modules: tuple[str, ...]):
    """(module, name, object) for every public name of each importable module, names sorted."""
    for name in modules:
        try:
            with _quiet():
                mod = importlib.import_module(name)
        except Exception:  # noqa: BLE001 - ImportError, or a module that fails at import time: left out
            continue
        for attr, obj in sorted(vars(mod).items()):
            if not attr.startswith("_"):
                yield mod, attr, obj


def _function_prompts(style: str) -> list[str]:
    """The "describe" and "complete" shapes: one prompt per function of CODE_MODULES."""
    seen, out = set(), []
    for _, fname, fn in _public(CODE_MODULES):
        if not inspect.isfunction(fn) or fname in seen:
            continue
        doc = inspect.getdoc(fn) or ""
        summary = _first_sentence(doc)
        sig = _signature(fn)
        if len(summary) < 20 or sig is None:
            continue
        seen.add(fname)
        if style == "describe":
            verb = summary[0].lower() + summary[1:]
            out.append(f"Write a Python function `{fname}{sig}` that does the following: {verb} "
                       "Include a short docstring and an example.")
        else:
            body = textwrap.indent(doc.split("\n\n")[0].strip(), "    ")
            out.append("Write a solution to the following problem:\n```python\n"
                       f"def {fname}{sig}:\n    \"\"\"\n{body}\n    \"\"\"\n```")
    return out


def _tests_prompts(modules: tuple[str, ...] = CODE_MODULES + MORE_CODE_MODULES) -> list[str]:
    """The "tests" shape: each module's own functions, and its own classes' public methods."""
    seen, out = set(), []
    for mod, name, obj in _public(modules):
        if getattr(obj, "__module__", None) != mod.__name__:
            continue
        if inspect.isfunction(obj):
            todo = [(name, obj, name, "", "")]
        elif inspect.isclass(obj):
            todo = [(f"{name}.{m}", f, m, f"class {name}:\n    ...\n\n", "    ") for m, f in vars(obj).items()
                    if not m.startswith("_") and inspect.isfunction(f)]
        else:
            continue
        for key, fn, fname, before, indent in todo:
            text = None if key in seen else _tests_prompt(fn, fname, before, indent)
            if text:
                seen.add(key)
                out.append(text)
    return out


def _signature(fn) -> str | None:
    """The function's signature as written, or None when it has none or it is too long for a prompt."""
    try:
        sig = str(inspect.signature(fn))
    except (TypeError, ValueError):
        return None
    sig = sig.replace(", *, backend=None, **backend_kwargs", "")  # networkx's dispatch arguments, on every function
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
