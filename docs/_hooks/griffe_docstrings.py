"""Griffe extension for the API pages (build code, not a page; excluded from the docs).

The package's docstrings follow the project's conventions, which differ from what
mkdocstrings' Google-style parser expects in two small ways; this rewrites them as each object
is loaded, so the source stays as it is:

- an ``Example:`` section (the project's spelling) becomes ``Examples:``, which the parser
  renders as highlighted doctest code instead of Markdown text;
- Sphinx roles such as ``:class:`OptimizerWrapper``` and ``:meth:`~Foo.bar``` become code
  spans.
"""

from __future__ import annotations

import re
from typing import Any

import griffe

_EXAMPLE = re.compile(r"^(\s*)Example:\s*$", re.MULTILINE)
_ROLE = re.compile(r":(?:py:)?(?:class|func|meth|mod|attr|data|exc|obj|const):`~?([^`]+)`")


class DocstringConventions(griffe.Extension):
    """Rewrites ``Example:`` sections and Sphinx roles before docstrings are parsed."""

    def on_instance(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        docstring = obj.docstring
        if docstring is None:
            return
        text = _EXAMPLE.sub(r"\1Examples:", docstring.value)
        docstring.value = _ROLE.sub(lambda m: f"`{m.group(1)}`", text)
