"""Names a package exports but imports only on first use (PEP 562), so that importing one light
module of a layer (from the CLI, say) does not pay for the whole layer."""

from __future__ import annotations

import importlib
from typing import Any, Callable


def lazy_exports(package: str, exports: dict[str, str], namespace: dict[str, Any]
                 ) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """The `__getattr__` and `__dir__` of `package`, whose `exports` map a name to the module (relative
    to the package, or absolute with a leading 'tvmpipe.') that defines it. A name is imported once,
    then kept in the package's `namespace` (its globals())."""

    def getattr_(name: str) -> Any:
        module = exports.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        path = module if module.startswith("tvmpipe.") else f"{package}.{module}"
        value = getattr(importlib.import_module(path), name)
        namespace[name] = value
        return value

    def dir_() -> list[str]:
        return sorted(set(namespace) | set(exports))

    return getattr_, dir_
