"""A Griffe extension for the API reference (mkdocs.yml).

The docstrings write formulas in plain text, such as ``A[t] = delta[t] +
gamma*lmbda*(1-done[t])*A[t+1]``, and Markdown would read their asterisks as emphasis. This
escapes every ``*`` outside code (inline code spans, indented and fenced code blocks), so the
formulas render as written.

The functions decorated with ``documented`` (rl_triton/core/docstrings.py) get their Args section
when the module is imported, and a module attribute made by a call (rl_games' ``discount_values
= _fused(...)``) gets its docstring there too, neither of which Griffe's reading of the source
sees: for those, the docstring is the imported object's.
"""

from __future__ import annotations

import inspect
import re

import griffe

_CODE_SPAN = re.compile(r"(`+)(?:.*?)\1", re.S)


def _escape_prose(text: str) -> str:
    parts, last = [], 0
    for span in _CODE_SPAN.finditer(text):
        parts.append(re.sub(r"(?<!\\)\*", r"\\*", text[last:span.start()]))
        parts.append(span.group(0))
        last = span.end()
    parts.append(re.sub(r"(?<!\\)\*", r"\\*", text[last:]))
    return "".join(parts)


def escape_asterisks(docstring: str) -> str:
    """``docstring`` with each ``*`` outside code escaped for Markdown."""
    out, fenced, paragraph = [], False, []

    def flush():
        if paragraph:
            out.append(_escape_prose("\n".join(paragraph)))
            paragraph.clear()

    for line in docstring.split("\n"):
        if line.lstrip().startswith("```"):
            flush()
            fenced = not fenced
            out.append(line)
        elif fenced or line.startswith("    ") or not line.strip():
            flush()
            out.append(line)
        else:
            paragraph.append(line)
    flush()
    return "\n".join(out)


def _built(obj: griffe.Object) -> bool:
    """Whether the object's docstring is made at import: by ``documented``, or for a public module
    attribute of the package that a call makes."""
    if obj.is_function:
        return any(d.callable_path.split(".")[-1] == "documented" for d in obj.decorators)
    return (obj.is_attribute and obj.docstring is None and obj.parent is not None and obj.parent.is_module
            and obj.path.startswith("rl_triton.") and not obj.name.startswith("_")
            and isinstance(obj.value, griffe.ExprCall))


class PlainFormulas(griffe.Extension):
    """Take the imported docstring of the functions decorated with ``documented``, and escape the
    asterisks of every docstring's prose, once the object tree is loaded."""

    def on_object(self, *, obj: griffe.Object, **kwargs) -> None:
        if _built(obj):
            try:
                runtime = griffe.dynamic_import(obj.path)
            except ImportError:
                if obj.is_function:
                    raise  # the built Args section would be missing: its module needs its framework
                runtime = None  # an attribute of a module whose framework is not installed: as read
            if callable(runtime) and runtime.__doc__:
                obj.docstring = griffe.Docstring(inspect.cleandoc(runtime.__doc__), parent=obj)
        if obj.docstring is not None:
            obj.docstring.value = escape_asterisks(obj.docstring.value)
