"""A name -> class registry for pluggable formats (tool-call and reasoning parsers)."""

from __future__ import annotations


class Registry(dict):
    """``name -> class``; :meth:`register` is the class decorator, :meth:`build` makes an instance (ValueError naming
    the registered names for an unknown one, prefixed by ``what``, the option that names them)."""

    def __init__(self, what: str) -> None:
        super().__init__()
        self.what = what

    def register(self, name: str):
        def wrap(cls):
            self[name] = cls
            return cls

        return wrap

    def build(self, name: str):
        cls = self.get(name)
        if cls is None:
            raise ValueError(f"{self.what}: unknown parser {name!r} (registered: {sorted(self)})")
        return cls()
