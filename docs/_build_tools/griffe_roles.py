"""A griffe extension: the docstrings' Sphinx roles become checked cross-references.

The library's docstrings name other objects with Sphinx roles (``:func:`solve```,
``:class:`~svflow_jax.claims.ClaimResult```, ``:mod:`.problem```). mkdocstrings does not read
roles, so once the package is loaded this extension rewrites each role into an autorefs link
``[`solve`][svflow_jax.solvers.solve.solve]``, resolving the name as Python would from the
docstring's scope (griffe's ``Object.resolve``; relative module names from the module's package),
then, failing that, as the one object of the package with that name. Names outside the package
(``diffrax.diffeqsolve``) stay code without a link. A name that resolves to nothing logs a
warning, so the strict build fails on it; an autorefs link to an object no page renders (a
private one) fails it too; a name that resolves to a private object (``_sub``) stays code.
"""

from __future__ import annotations

import logging
import re

import griffe

ROLE = re.compile(r":(?:mod|func|class|meth|attr|data|obj|exc|const):`(~?)([^`]+)`")
PACKAGE = "svflow_jax"
log = logging.getLogger("mkdocs.plugins.svflow_docs.roles")


def _walk(obj):
    yield obj
    for member in obj.members.values():
        if not member.is_alias:
            yield from _walk(member)


def _exists(root, path: str) -> bool:
    if path == root.path:
        return True
    if not path.startswith(root.path + "."):
        return False
    try:
        root[path[len(root.path) + 1:]]
    except Exception:  # noqa: BLE001 (KeyError, or an alias whose target is not loaded)
        return False
    return True


class SphinxRoles(griffe.Extension):
    """Rewrites Sphinx roles in every docstring of the package into autorefs links."""

    def on_package(self, *, pkg, **kwargs) -> None:
        if pkg.name != PACKAGE:
            return
        by_name: dict[str, set[str]] = {}
        objects = list(_walk(pkg))
        for obj in objects:
            by_name.setdefault(obj.name, set()).add(obj.path)
        for obj in objects:
            if obj.docstring is not None and ":" in obj.docstring.value:
                obj.docstring.value = ROLE.sub(
                    lambda m, obj=obj: self._link(pkg, by_name, obj, m.group(1), m.group(2)),
                    obj.docstring.value)

    def _resolve(self, pkg, by_name, obj, name: str) -> str | None:
        if name.startswith("."):
            module = obj if obj.is_module else obj.module
            base = module if module.is_init_module else module.parent
            dots = len(name) - len(name.lstrip("."))
            for _ in range(dots - 1):
                base = base.parent
            path = f"{base.path}.{name.lstrip('.')}"
            return path if _exists(pkg, path) else None
        if name.split(".")[0] == PACKAGE:
            return name if _exists(pkg, name) else None
        try:
            path = obj.resolve(name)
        except Exception:  # noqa: BLE001 (griffe.NameResolutionError and alias errors)
            path = None
        if path is not None:
            return path
        head = name.split(".")[0]
        if head in by_name and len(by_name[head]) == 1:
            path = next(iter(by_name[head])) + name[len(head):]
            return path if _exists(pkg, path) else None
        candidates = by_name.get(name.rsplit(".", 1)[-1], set())
        return next(iter(candidates)) if len(candidates) == 1 else None

    def _link(self, pkg, by_name, obj, tilde: str, name: str) -> str:
        name = re.sub(r"\s+", "", name)  # a role wrapped over two lines
        shown = name.rsplit(".", 1)[-1] if tilde else name
        path = self._resolve(pkg, by_name, obj, name)
        if path is None:
            if name.split(".")[0] in (PACKAGE, "") or "." not in name:
                log.warning("%s: cannot resolve the reference %r in its docstring", obj.path,
                            name)
            return f"`{shown}`"
        if not path.startswith(PACKAGE + ".") and path != PACKAGE:
            return f"`{shown}`"  # another library: code, no link
        if any(part.startswith("_") for part in path.split(".")):
            return f"`{shown}`"  # private: no page renders it, so code without a link
        return f"[`{shown}`][{path}]"
