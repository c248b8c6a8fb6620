"""Formulas rendered at build time: TeX to MathML, so the site needs no network to show maths.

``pymdownx.arithmatex`` (generic mode, ``mkdocs.yml``) protects every formula of a page from
Markdown and leaves it as ``<span class="arithmatex">\\(...\\)</span>`` (inline) or
``<div class="arithmatex">\\[...\\]</div>`` (display); this covers the Markdown pages and the
notebook pages alike, whose Markdown cells write ``$...$`` and ``$$...$$``. :func:`render`
replaces each of them by the MathML that ``latex2mathml`` computes from the TeX, which browsers
display natively (MathML Core: Chromium, Firefox, Safari). No script and no font is fetched
when a page is read, on or off line.

A formula ``latex2mathml`` cannot convert raises :class:`MathsError` naming it and its page, so
the build fails rather than ship raw TeX.
"""

from __future__ import annotations

import html
import re

from latex2mathml.converter import convert

__all__ = ["MathsError", "render", "render_title", "to_mathml"]

_ARITHMATEX = re.compile(
    r'<(?P<tag>span|div) class="arithmatex">'
    r"(?P<open>\\\(|\\\[)(?P<tex>.*?)(?:\\\)|\\\])</(?P=tag)>", re.DOTALL)
_ALIGNED = re.compile(r"\\begin\{(align|equation|gather)\*?\}(.*?)\\end\{\1\*?\}", re.DOTALL)


class MathsError(ValueError):
    """A formula that could not be converted to MathML."""


def to_mathml(tex: str, display: bool) -> str:
    """The MathML ``<math>`` element of one TeX formula (``display="block"`` for a display
    formula). ``align``/``equation``/``gather`` environments become ``aligned``/plain/``gathered``
    inside the display formula, as MathJax treats them."""
    tex = _ALIGNED.sub(lambda m: {"align": r"\begin{aligned}%s\end{aligned}",
                                   "gather": r"\begin{gathered}%s\end{gathered}",
                                   "equation": "%s"}[m.group(1)] % m.group(2), tex.strip())
    try:
        return convert(tex, display="block" if display else "inline")
    except Exception as err:  # latex2mathml raises many types; one message for all of them
        raise MathsError(f"cannot convert the formula {tex!r} to MathML: "
                         f"{type(err).__name__}: {err}") from err


_INLINE = re.compile(r"\\\((?P<tex>.*?)\\\)", re.DOTALL)


def render_title(title: str, where: str = "page") -> str:
    """A table-of-contents title with its inline formulas (``\\(...\\)``, as the headings' text
    keeps them) as MathML."""
    def one(match: re.Match) -> str:
        try:
            return to_mathml(html.unescape(match.group("tex")), display=False)
        except MathsError as err:
            raise MathsError(f"{where} (table of contents): {err}") from err
    return _INLINE.sub(one, title)


def render(page_html: str, where: str = "page") -> tuple[str, int]:
    """``page_html`` with every arithmatex formula replaced by its MathML; and their number."""
    count = 0

    def one(match: re.Match) -> str:
        nonlocal count
        tex = html.unescape(match.group("tex"))
        display = match.group("open") == r"\["
        try:
            mathml = to_mathml(tex, display)
        except MathsError as err:
            raise MathsError(f"{where}: {err}") from err
        count += 1
        tag = match.group("tag")
        return f'<{tag} class="arithmatex">{mathml}</{tag}>'

    return _ARITHMATEX.sub(one, page_html), count
