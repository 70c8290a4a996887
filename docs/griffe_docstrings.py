"""A griffe extension for the documentation build: two Sphinx habits of the docstrings, rendered for Markdown.

- ``Example:`` sections render as ``Examples:``: griffe's Google-style parser turns only ``Examples:``
  (plural) into code blocks, and under ``Example:`` the doctest lines (``>>> ...``) would show as nested
  Markdown quotes.
- Sphinx roles such as ``:func:`precisionloop.autotune``` render as plain code, not as ``:func:`` text.

The package's docstrings are left as they are; this changes only what the site shows.
"""

import re

import griffe

_EXAMPLE = re.compile(r"^(\s*)Example:\s*$", re.M)
_ROLE = re.compile(r":(?:func|class|meth|mod|data|attr|obj|exc):`~?([^`]+)`")


class DocstringMarkup(griffe.Extension):
    def on_object(self, *, obj, **kwargs):
        if obj.docstring is not None:
            value = _EXAMPLE.sub(r"\1Examples:", obj.docstring.value)
            obj.docstring.value = _ROLE.sub(r"`\1`", value)
